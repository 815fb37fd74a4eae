// NVRTC, wrapped: the sources it sees (in-memory headers only), the options it gets, the one
// translation unit per kernel, and a compile that returns the cubin, PTX, lowered name and ptxas
// statistics, or a Status holding the log, the options and what was being compiled.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/jit/embedded_sources.h"

namespace gemvz::internal {

struct CompiledKernel;  // kernel_cache.h

// The files NVRTC can include, by name, sorted. Every one is handed to every compile as an
// in-memory header, so an #include never looks at the file system.
class SourceSet {
 public:
  // kernel_sources/ as embedded at build time.
  static std::shared_ptr<const SourceSet> Embedded();
  // Any (name, text) pairs: tests and experiments with sources of their own.
  static std::shared_ptr<const SourceSet> FromFiles(
      std::vector<std::pair<std::string, std::string>> files);

  const std::vector<EmbeddedSource>& files() const { return files_; }
  const EmbeddedSource* Find(std::string_view name) const;
  std::string Names() const;  // "common.cuh, z12_gemv.cuh" (for error messages)

 private:
  std::vector<std::pair<std::string, std::string>> storage_;  // owns FromFiles' text
  std::vector<EmbeddedSource> files_;
};

// One kernel to compile: a generated translation unit that includes `source_file`, and the
// template instantiation to keep, named by `name_expression`.
struct CompileRequest {
  std::string arch;             // "sm_90", "sm_90a", ...
  std::string source_file;      // "z12_gemv.cuh"
  std::string name_expression;  // "gemvz_z12_kernel<8, 2, 2, 3>"
  std::string kernel_name;      // what messages call it: "z12.nw8.ug2.nb2.pipe3"
};

// "sm_<digits>" with an optional 'a' or 'f' suffix, and an architecture this NVRTC can target.
absl::Status CheckArch(std::string_view arch);

// NVRTC's version, "13.0": part of every cache key.
std::string NvrtcVersionString();

// The NVRTC library this process runs, as "libnvrtc.so.13, 109338064 bytes, mtime 1760564160":
// also part of every cache key, because nvrtcVersion says only major.minor and a patch release
// (13.0.88 -> 13.0.97) may generate other code. The file name rather than its directory, so that
// machines with the same toolkit installed in different places still share entries. "unknown"
// when it cannot be found (the key is then the version's alone).
std::string NvrtcLibraryIdentity();

// The options that determine the binary, in a fixed order: these go into the cache key.
// `extra` (from GEMVZ_NVRTC_OPTIONS or a test) is appended as given.
std::vector<std::string> CanonicalOptions(std::string_view arch,
                                          const std::vector<std::string>& extra);
// -I options for the toolkit's headers (cuda_bf16.h etc.), found at run time. Kept out of the
// key: the same toolkit installed elsewhere must not change it (the NVRTC version covers it).
const std::vector<std::string>& ToolkitIncludeOptions();

// The translation unit NVRTC compiles for one kernel.
std::string GeneratedSource(std::string_view source_file);

// What ptxas reported for one entry function (-1: not reported).
struct PtxasStats {
  int registers = -1;
  int spill_bytes = -1;  // spill stores + spill loads
  int shared_bytes = -1;
};
PtxasStats ParsePtxasLog(std::string_view log, std::string_view lowered_name);

// Compiles `request` with `sources` as headers. On success fills everything in CompiledKernel
// except `key` and `from_disk`. Needs no GPU.
absl::StatusOr<CompiledKernel> CompileWithNvrtc(const CompileRequest& request,
                                                const SourceSet& sources,
                                                const std::vector<std::string>& options);

}  // namespace gemvz::internal
