// The JIT runtime's public face: where the kernel cache lives, what it has done (counters), and
// precompiling configurations ahead of serving (cache warm-up). No GPU is needed for any of it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gemvz/config.h"

namespace gemvz {

// Counters since process start (or the last ResetJitCounters), for tests and tools.
struct JitCounters {
  int64_t memory_hits = 0;       // served from the in-process cache
  int64_t disk_hits = 0;         // served from the disk cache, no compile
  int64_t compiles = 0;          // NVRTC compilations
  int64_t disk_writes = 0;       // entries published to disk
  int64_t disk_rejects = 0;      // corrupt, truncated or mismatched entries removed
  int64_t module_loads = 0;      // cuModuleLoadData calls
  int64_t compile_failures = 0;  // NVRTC compilations that failed
  int64_t flight_waits = 0;      // requests that waited for another thread's compile of their key
};
JitCounters GetJitCounters();
void ResetJitCounters();

// The disk cache directory in use: GEMVZ_CACHE_DIR, else $XDG_CACHE_HOME/gemvz, else
// ~/.cache/gemvz. Empty when GEMVZ_DISABLE_DISK_CACHE=1 (or no home directory is known).
// Read from the environment at every call. Entries live in <dir>/kernels, at most
// GEMVZ_CACHE_MAX_BYTES (default 1 GiB; "512M" etc. accepted), least recently used evicted first.
std::string CacheDirectory();

// What precompiling one configuration did.
struct PrecompileResult {
  KernelConfig config;
  std::string arch;
  bool from_disk = false;  // a hit (disk, or memory in this process): nothing was compiled
  double millis = 0;       // wall time of this request
  int registers = -1;
  int spill_bytes = -1;
  int shared_bytes = -1;
  std::string cache_key;  // its disk cache entry: <CacheDirectory()>/kernels/<key>.gemvzk
};

// Compiles (or finds on disk) one configuration for `arch` ("sm_90", "sm_90a", ...; empty:
// $GEMVZ_ARCH, else the architecture of GPU 0, else sm_90).
absl::StatusOr<PrecompileResult> Precompile(const KernelConfig& config, const std::string& arch);

// Precompiles many in parallel on `threads` workers (0: all cores; at most one a configuration and
// 1024), calling `progress` after each (done, total, result) from a worker thread (one call at a
// time). Returns every result in the order of `configs`, or the first error (then no new
// configuration is started).
absl::StatusOr<std::vector<PrecompileResult>> PrecompileAll(
    const std::vector<KernelConfig>& configs, const std::string& arch, int threads,
    const std::function<void(int done, int total, const PrecompileResult&)>& progress = nullptr);

}  // namespace gemvz
