// include/gemvz/runtime.h: the cache directory, counters and warm-up, over KernelCache::Default().
#include <algorithm>
#include <atomic>
#include <chrono>

#include "absl/synchronization/mutex.h"
#include "gemvz/runtime.h"
#include "runtime/common/env.h"
#include "runtime/common/parallel.h"
#include "runtime/common/status_macros.h"
#include "runtime/cuda/driver.h"
#include "runtime/jit/kernel_cache.h"

namespace gemvz {

JitCounters GetJitCounters() { return internal::KernelCache::Default().counters(); }
void ResetJitCounters() { internal::KernelCache::Default().ResetCounters(); }

std::string CacheDirectory() {
  using internal::GetEnv;
  if (internal::GetEnvBool("GEMVZ_DISABLE_DISK_CACHE", false)) return "";
  if (std::optional<std::string> dir = GetEnv("GEMVZ_CACHE_DIR")) return *dir;
  // XDG says a relative XDG_CACHE_HOME is invalid and must be ignored.
  if (std::optional<std::string> xdg = GetEnv("XDG_CACHE_HOME"); xdg && (*xdg)[0] == '/') {
    return *xdg + "/gemvz";
  }
  const std::string home = internal::HomeDirectory();
  if (home.empty()) return "";
  return home + "/.cache/gemvz";
}

namespace {

absl::StatusOr<std::string> ResolveArch(const std::string& arch) {
  if (!arch.empty()) return arch;
  return internal::DefaultArch(0);
}

}  // namespace

absl::StatusOr<PrecompileResult> Precompile(const KernelConfig& config, const std::string& arch) {
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(const std::string target, ResolveArch(arch));
  internal::CacheSource source = internal::CacheSource::kCompiled;
  ASSIGN_OR_RETURN(std::shared_ptr<const internal::CompiledKernel> kernel,
                   internal::KernelCache::Default().GetForConfig(config, target, &source));
  PrecompileResult r;
  r.config = config;
  r.arch = target;
  r.from_disk = source != internal::CacheSource::kCompiled;
  r.millis =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  r.registers = kernel->registers;
  r.spill_bytes = kernel->spill_bytes;
  r.shared_bytes = kernel->shared_bytes;
  r.cache_key = kernel->key;
  return r;
}

namespace internal {

std::vector<absl::StatusOr<PrecompileResult>> PrecompileEach(
    const std::vector<KernelConfig>& configs, const std::string& arch, int threads,
    bool stop_on_error,
    const std::function<void(int done, int total, const PrecompileResult&)>& progress) {
  std::vector<absl::StatusOr<PrecompileResult>> results(
      configs.size(), absl::CancelledError("not started: an earlier configuration failed"));
  threads = WorkerCount(threads, static_cast<int64_t>(configs.size()));
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  absl::Mutex mu;
  int done = 0;  // guarded by mu
  auto worker = [&] {
    while (!(stop_on_error && failed.load())) {
      const size_t i = next.fetch_add(1);
      if (i >= configs.size()) return;
      absl::StatusOr<PrecompileResult> r = Precompile(configs[i], arch);
      absl::MutexLock lock(&mu);
      results[i] = r;
      if (!r.ok()) {
        failed.store(true);
        continue;
      }
      ++done;
      // Under the lock: callbacks never overlap and see `done` in order.
      if (progress) progress(done, static_cast<int>(configs.size()), *r);
    }
  };
  RunWorkers(threads, [&](int) { worker(); });
  return results;
}

}  // namespace internal

absl::StatusOr<std::vector<PrecompileResult>> PrecompileAll(
    const std::vector<KernelConfig>& configs, const std::string& arch, int threads,
    const std::function<void(int done, int total, const PrecompileResult&)>& progress) {
  // Check everything before starting any work: a typo at line 40 should not cost 39 compiles.
  for (const KernelConfig& c : configs) RETURN_IF_ERROR(ValidateConfig(c));
  ASSIGN_OR_RETURN(const std::string target, ResolveArch(arch));
  std::vector<absl::StatusOr<PrecompileResult>> each =
      internal::PrecompileEach(configs, target, threads, /*stop_on_error=*/true, progress);
  std::vector<PrecompileResult> results;
  results.reserve(each.size());
  for (const absl::StatusOr<PrecompileResult>& r : each) {
    if (!r.ok() && !absl::IsCancelled(r.status())) return r.status();
  }
  for (absl::StatusOr<PrecompileResult>& r : each) results.push_back(*std::move(r));
  return results;
}

}  // namespace gemvz
