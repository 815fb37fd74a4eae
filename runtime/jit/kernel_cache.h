// The JIT's front door: a KernelConfig in, a launchable CUfunction out. Compiles with NVRTC at
// first use (single flight per key), consults the memory and disk caches, and loads modules per
// device. Everything up to "compiled" needs no GPU.
#pragma once

#include <cuda.h>

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "gemvz/config.h"

namespace gemvz::internal {

// A compiled kernel: what the disk cache stores.
struct CompiledKernel {
  std::string key;            // hex digest of everything that determines the binary
  std::string arch;           // "sm_90", "sm_90a"
  std::string kernel_name;    // config.KernelName()
  std::string name_expression;  // "gemvz_z12_kernel<8, 2, 2, 3>"
  std::string lowered_name;   // the mangled name NVRTC reported for it
  std::string cubin;          // bytes
  std::string ptx;            // kept when available (tests look into it)
  int registers = -1;         // ptxas statistics, -1 when unknown
  int spill_bytes = -1;       // spill stores + loads
  int shared_bytes = -1;
  double compile_ms = 0;      // NVRTC time when it was compiled
  bool from_disk = false;     // true when this request was served from the disk cache
};

// Compiles (or fetches) the kernel of `config` (splits ignored) for `arch` ("sm_90" etc.).
// Needs no GPU. Invalid configurations are refused before NVRTC runs.
absl::StatusOr<std::shared_ptr<const CompiledKernel>> GetCompiledKernel(const KernelConfig& config,
                                                                        std::string_view arch);

// A kernel loaded on one device's primary context.
struct LoadedKernel {
  CUfunction function = nullptr;
  std::shared_ptr<const CompiledKernel> compiled;
};

// The architecture NVRTC targets for `device`: "sm_<major><minor>" ("sm_90" on an H200).
absl::StatusOr<std::string> DeviceArch(int device);

// Compiles or fetches the kernel for the device's architecture and loads it there. Cached per
// (device, key): the second call costs a hash lookup.
absl::StatusOr<LoadedKernel> GetKernel(int device, const KernelConfig& config);

}  // namespace gemvz::internal

namespace gemvz::internal {

// Any kernel of the embedded sources by name expression, for tools (the bandwidth probe of
// `gemvz bench`): the source is `#include "<source_file>"`, compiled and cached like the rest.
absl::StatusOr<LoadedKernel> GetKernelByName(int device, std::string_view source_file,
                                             std::string_view name_expression);

}  // namespace gemvz::internal
