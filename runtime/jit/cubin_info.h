// Facts about a kernel read from its cubin (ELF) rather than from ptxas's log: the log is the
// richer source (spill stores and loads), but on one H200 host NVRTC's -v report came back
// empty for some compiles, and the cubin always carries the register count and frame size.
#pragma once

#include <string_view>

#include "absl/status/statusor.h"

namespace gemvz::internal {

struct CubinKernelInfo {
  int registers = -1;     // EIATTR_REGCOUNT
  int frame_bytes = -1;   // EIATTR_FRAME_SIZE: local memory per thread (spills, for these kernels)
  int shared_bytes = -1;  // static shared memory: .nv.shared.<kernel> less the 1 KiB reserve
};

// Reads `kernel` (its lowered name) from an sm_XY cubin. Errors name what is malformed.
absl::StatusOr<CubinKernelInfo> ReadCubinKernelInfo(std::string_view cubin, std::string_view kernel);

}  // namespace gemvz::internal
