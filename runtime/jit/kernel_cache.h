// The JIT's front door: a KernelConfig in, a launchable CUfunction out. Compiles with NVRTC at
// first use (single flight per key), consults the memory and disk caches, and loads modules per
// device. Everything up to "compiled" needs no GPU.
#pragma once

#include <cuda.h>

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "gemvz/config.h"
#include "gemvz/runtime.h"
#include "runtime/common/per_thread_cache.h"
#include "runtime/jit/nvrtc_compiler.h"

namespace gemvz::internal {

// A compiled kernel: what the disk cache stores.
struct CompiledKernel {
  std::string key;              // hex digest of everything that determines the binary
  std::string arch;             // "sm_90", "sm_90a"
  std::string kernel_name;      // config.KernelName()
  std::string name_expression;  // "gemvz_z12_kernel<8, 2, 2, 3>"
  std::string lowered_name;     // the mangled name NVRTC reported for it
  std::string cubin;            // bytes
  std::string ptx;              // kept when available (tests look into it)
  int registers = -1;           // ptxas statistics, -1 when unknown
  int spill_bytes = -1;         // spill stores + loads
  int shared_bytes = -1;
  double compile_ms = 0;   // NVRTC time when it was compiled
  bool from_disk = false;  // true when this request was served from the disk cache
  std::string log;         // NVRTC's program log: the ptxas report (-v)
};

// Compiles (or fetches) the kernel of `config` (splits ignored) for `arch` ("sm_90" etc.).
// Needs no GPU. Invalid configurations are refused before NVRTC runs.
absl::StatusOr<std::shared_ptr<const CompiledKernel>> GetCompiledKernel(const KernelConfig& config,
                                                                        std::string_view arch);

// A kernel loaded on one device's primary context.
struct LoadedKernel {
  CUfunction function = nullptr;
  std::shared_ptr<const CompiledKernel> compiled;
  // CTAs of config.threads() threads resident per SM (the driver's occupancy), for kernels
  // loaded by configuration (GetKernel); 0 for those loaded by name.
  int blocks_per_sm = 0;
};

// The architecture NVRTC targets for `device`: GEMVZ_ARCH when set (checked, read at every call),
// else "sm_<major><minor>" as the device reports it ("sm_90" on an H200; cached per device).
// A device's GEMVs keep the value read at its first use (LaunchArch).
absl::StatusOr<std::string> DeviceArch(int device);

// The architecture a device's GEMVs compile and load their kernels for: DeviceArch's answer at
// the device's first call here, kept for the process. GetDeviceInfo takes it too, so the
// dispatcher's choice (tuned for info.arch) and the kernel GetKernel loads agree even when
// GEMVZ_ARCH changes later (a warm-up going from one target to the next).
absl::StatusOr<std::string> LaunchArch(int device);

// The architecture to compile for when none is named: GEMVZ_ARCH when set (checked), else
// `device`'s when a GPU is visible, else sm_90 (the H200 this library targets), so that a machine
// without a GPU warms a cache for one. What the tools' --arch and Precompile("") default to.
absl::StatusOr<std::string> DefaultArch(int device);

// Compiles or fetches the kernel for the device's architecture (LaunchArch) and loads it there.
// Cached per (device, key): the second call costs a hash lookup.
absl::StatusOr<LoadedKernel> GetKernel(int device, const KernelConfig& config);

// A configuration's loaded function and its occupancy: what a launch needs, without the reference
// to the compiled kernel that LoadedKernel holds (a module stays loaded for the process; copying
// that reference is an atomic add on a count that every thread launching the kernel shares).
struct KernelFunction {
  CUfunction function = nullptr;
  int blocks_per_sm = 0;  // as LoadedKernel's
};

// GetKernel's function, from the calling thread's own copy after its first call: the launch path's
// lookup, with no lock.
absl::StatusOr<KernelFunction> GetKernelFunction(int device, const KernelConfig& config);

// Precompile of each of `configs` for `arch` (not empty) on `threads` workers (0: all cores),
// result i for configuration i; `progress` as PrecompileAll's, after each success. With
// `stop_on_error` no configuration is started after a failure (those hold CancelledError);
// without, every one is tried (the autotuner drops those that fail).
std::vector<absl::StatusOr<PrecompileResult>> PrecompileEach(
    const std::vector<KernelConfig>& configs, const std::string& arch, int threads,
    bool stop_on_error,
    const std::function<void(int done, int total, const PrecompileResult&)>& progress = nullptr);

}  // namespace gemvz::internal

namespace gemvz::internal {

class DiskCache;  // disk_cache.h

// Any kernel of the embedded sources by name expression, for tools (the bandwidth probe of
// `gemvz bench`): the source is `#include "<source_file>"`, compiled and cached like the rest.
absl::StatusOr<LoadedKernel> GetKernelByName(int device, std::string_view source_file,
                                             std::string_view name_expression);

// ---------------------------------------------------------------------------------------------
// The machinery behind the functions above. The process uses one KernelCache (Default());
// tests build their own with their own sources, directory and options.

// What a kernel of `config` is called in source: the file and the name expression.
CompileRequest RequestForConfig(const KernelConfig& config, std::string_view arch);

// Where one request was served from.
enum class CacheSource { kMemory, kDisk, kCompiled };
std::string_view CacheSourceName(CacheSource source);  // "memory" / "disk" / "compiled"

struct KernelCacheOptions {
  // The headers NVRTC sees; null: the embedded kernel_sources/.
  std::shared_ptr<const SourceSet> sources;
  // The disk cache root; nullopt: CacheDirectory(), re-read at every miss so that the
  // environment decides; "": no disk cache.
  std::optional<std::string> disk_directory;
  // The disk size cap; nullopt: GEMVZ_CACHE_MAX_BYTES or 1 GiB, re-read at every write.
  std::optional<int64_t> max_disk_bytes;
  // Options appended to the canonical ones (and so part of the key); nullopt: the
  // whitespace-separated GEMVZ_NVRTC_OPTIONS, read when the cache is made.
  std::optional<std::vector<std::string>> extra_options;
  // The dump directory for sources, PTX and ptxas reports; nullopt: GEMVZ_DUMP_DIR at each compile.
  std::optional<std::string> dump_directory;
};

class KernelCache {
 public:
  explicit KernelCache(KernelCacheOptions options = {});
  KernelCache(const KernelCache&) = delete;
  KernelCache& operator=(const KernelCache&) = delete;
  ~KernelCache();

  // The process-wide cache behind GetCompiledKernel / GetKernel / Precompile.
  static KernelCache& Default();

  // Memory, then disk, then NVRTC; one compile per key however many threads ask at once.
  absl::StatusOr<std::shared_ptr<const CompiledKernel>> Get(const CompileRequest& request,
                                                            CacheSource* source = nullptr);
  // Validates the configuration first (no NVRTC for an invalid one).
  absl::StatusOr<std::shared_ptr<const CompiledKernel>> GetForConfig(const KernelConfig& config,
                                                                     std::string_view arch,
                                                                     CacheSource* source = nullptr);

  // Compiled (as above) and loaded on `device`'s primary context, cached per (device, request).
  absl::StatusOr<LoadedKernel> Load(int device, const CompileRequest& request);
  // The same keyed by configuration, with a lookup that allocates nothing on a hit.
  absl::StatusOr<LoadedKernel> LoadForConfig(int device, const KernelConfig& config);
  // LoadForConfig's function and occupancy, found in the calling thread's copy after its first
  // call for the configuration (per_thread_cache.h).
  absl::StatusOr<KernelFunction> FunctionForConfig(int device, const KernelConfig& config);

  // The cache key `request` has here (no compile, no disk access).
  absl::StatusOr<std::string> KeyFor(const CompileRequest& request) const;
  // The options NVRTC gets (the canonical ones, part of the key).
  std::vector<std::string> Options(std::string_view arch) const;
  const SourceSet& sources() const { return *sources_; }
  // The disk cache root in use now ("" when none).
  std::string DiskDirectory() const;

  JitCounters counters() const;
  void ResetCounters();

  // Forgets every compiled kernel and loaded function held in memory, so the next request goes
  // to the disk cache (tests: "a new process hits disk"). Loaded modules stay loaded, so that
  // CUfunctions handed out earlier remain valid.
  void DropMemoryForTesting();

 private:
  struct Flight;
  struct Counters {
    std::atomic<int64_t> memory_hits{0}, disk_hits{0}, compiles{0}, disk_writes{0}, disk_rejects{0},
        module_loads{0}, compile_failures{0}, flight_waits{0};
  };

  std::string RequestId(const CompileRequest& request) const;
  absl::StatusOr<std::shared_ptr<const CompiledKernel>> Produce(const CompileRequest& request,
                                                                CacheSource* source);
  DiskCache* DiskFor(const std::string& directory);
  void Dump(const CompileRequest& request, const CompiledKernel& kernel) const;
  absl::StatusOr<LoadedKernel> LoadCompiled(int device,
                                            std::shared_ptr<const CompiledKernel> compiled)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(load_mu_);

  const KernelCacheOptions options_;
  const std::shared_ptr<const SourceSet> sources_;
  const std::vector<std::string> extra_options_;
  Counters counters_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<const CompiledKernel>> compiled_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<Flight>> flights_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::unique_ptr<DiskCache>> disks_ ABSL_GUARDED_BY(mu_);

  // Loaded functions: looked up on every launch, so under a reader lock of their own.
  mutable absl::Mutex load_mu_;
  absl::flat_hash_map<std::pair<int, std::string>, LoadedKernel> loaded_ ABSL_GUARDED_BY(load_mu_);
  absl::flat_hash_map<std::pair<int, KernelConfig>, LoadedKernel> loaded_configs_
      ABSL_GUARDED_BY(load_mu_);
  std::vector<std::pair<int, CUmodule>> modules_ ABSL_GUARDED_BY(load_mu_);
  // Each thread's copies of FunctionForConfig's answers: its hits take no lock.
  PerThreadCache<std::pair<int, KernelConfig>, KernelFunction> function_front_;
};

}  // namespace gemvz::internal
