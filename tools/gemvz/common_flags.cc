#include "tools/gemvz/common_flags.h"

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "runtime/jit/kernel_cache.h"
#include "runtime/jit/nvrtc_compiler.h"

ABSL_FLAG(std::string, arch, "", "target architecture (sm_90, sm_90a, ...); default: the GPU's, else sm_90");
ABSL_FLAG(std::string, shape, "", "matrix shape NxK, e.g. 4096x8192");
ABSL_FLAG(std::string, m, "1,8,16", "comma-separated activation row counts");
ABSL_FLAG(std::string, config, "", "kernel configuration, e.g. z12.nw8.ug2.nb2.pipe3.s1");
ABSL_FLAG(std::string, json, "", "write the results as JSON to this file");
ABSL_FLAG(int, j, 0, "worker threads (0: all cores)");
ABSL_FLAG(int, device, 0, "GPU ordinal");

namespace gemvz::cli {

absl::StatusOr<int> ThreadsFromFlag() {
  const int j = absl::GetFlag(FLAGS_j);
  if (j < 0 || j > kMaxThreads) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad --j=", j, ": expected 0 (all cores) to ", kMaxThreads));
  }
  return j;
}

absl::StatusOr<std::string> ArchFromFlag(int device) {
  const std::string arch = absl::GetFlag(FLAGS_arch);
  if (arch.empty()) return internal::DefaultArch(device);
  if (absl::Status st = internal::CheckArch(arch); !st.ok()) {
    return absl::Status(st.code(), absl::StrCat("--arch: ", st.message()));
  }
  return arch;
}

}  // namespace gemvz::cli
