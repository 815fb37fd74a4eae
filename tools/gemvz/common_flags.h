// Flags that several subcommands share; each is defined once in common_flags.cc.
#pragma once

#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"

ABSL_DECLARE_FLAG(std::string, arch);    // target architecture, e.g. sm_90 (default: the GPU's)
ABSL_DECLARE_FLAG(std::string, shape);   // NxK, e.g. 4096x8192
ABSL_DECLARE_FLAG(std::string, m);       // comma list of activation rows, e.g. 1,8,16
ABSL_DECLARE_FLAG(std::string, config);  // a kernel configuration, e.g. z12.nw8.ug2.nb2.pipe3.s1
ABSL_DECLARE_FLAG(std::string, json);    // write results as JSON to this file
ABSL_DECLARE_FLAG(int, j);               // worker threads (0: all cores)
ABSL_DECLARE_FLAG(int, device);          // GPU ordinal

namespace gemvz::cli {

// --arch, checked, or when it is empty the library's default: $GEMVZ_ARCH, else the GPU's, else
// sm_90 on a machine without one. A bad value is an error that names where it came from.
absl::StatusOr<std::string> ArchFromFlag(int device);

// --j, checked: 0 (all cores) to kMaxThreads. More threads than that only fail to start (a huge
// value made std::thread throw out of the command).
inline constexpr int kMaxThreads = 1024;
absl::StatusOr<int> ThreadsFromFlag();

}  // namespace gemvz::cli
