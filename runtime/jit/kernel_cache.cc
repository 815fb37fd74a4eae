// The kernel cache: memory, then disk, then NVRTC, with one compile per key; and the per-device
// module loading on top (see kernel_cache.h).
#include "runtime/jit/kernel_cache.h"

#include <chrono>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "runtime/common/env.h"
#include "runtime/common/file_util.h"
#include "runtime/common/log.h"
#include "runtime/common/status_macros.h"
#include "runtime/cuda/driver.h"
#include "runtime/jit/cache_key.h"
#include "runtime/jit/disk_cache.h"

namespace gemvz::internal {
namespace {

double MillisSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

std::vector<std::string> EnvExtraOptions() {
  std::vector<std::string> out;
  if (std::optional<std::string> v = GetEnv("GEMVZ_NVRTC_OPTIONS")) {
    for (absl::string_view o : absl::StrSplit(*v, absl::ByAnyChar(" \t\n"), absl::SkipEmpty())) {
      out.emplace_back(o);
    }
  }
  return out;
}

// A file-name-safe form of a kernel name ("bw.cuh:probe<4>" -> "bw.cuh_probe_4_").
std::string SafeFileName(std::string_view name) {
  std::string out;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '-' || c == '_';
    out.push_back(ok ? c : '_');
  }
  return out;
}

// The key of `config`'s function on `device` in LoadForConfig's and FunctionForConfig's memos:
// the split count is a run-time argument, so every S shares one function.
std::pair<int, KernelConfig> FunctionId(int device, KernelConfig config) {
  config.splits = 1;
  return {device, config};
}

}  // namespace

std::string_view CacheSourceName(CacheSource source) {
  switch (source) {
    case CacheSource::kMemory:
      return "memory";
    case CacheSource::kDisk:
      return "disk";
    case CacheSource::kCompiled:
      return "compiled";
  }
  return "?";
}

CompileRequest RequestForConfig(const KernelConfig& config, std::string_view arch) {
  CompileRequest r;
  r.arch = std::string(arch);
  const std::string format(FormatName(config.format));
  r.source_file = absl::StrCat(format, "_gemv.cuh");
  // z12's fifth and sixth template arguments, RB and GM, default to 1 and 0 (block-major); each
  // is spelled out only when it or a later one is not its default, so that the block-major
  // kernels keep the name expressions they had before GM existed (and their machine code).
  const bool gm = config.order == WeightOrder::kGroupMajor;
  std::string tail;
  if (config.rb != 1 || gm) absl::StrAppend(&tail, ", ", config.rb);
  if (gm) absl::StrAppend(&tail, ", 1");
  r.name_expression = absl::StrFormat("gemvz_%s_kernel<%d, %d, %d, %d%s>", format, config.nw,
                                      config.ug, config.nb, config.pipe, tail);
  r.kernel_name = config.KernelName();
  return r;
}

// One in-progress production of a key: the leader fills `result`, then notifies the waiters.
struct KernelCache::Flight {
  absl::Notification done;
  absl::StatusOr<std::shared_ptr<const CompiledKernel>> result;
  CacheSource source = CacheSource::kCompiled;
};

KernelCache::KernelCache(KernelCacheOptions options)
    : options_(std::move(options)),
      sources_(options_.sources ? options_.sources : SourceSet::Embedded()),
      extra_options_(options_.extra_options ? *options_.extra_options : EnvExtraOptions()) {}

KernelCache::~KernelCache() = default;

KernelCache& KernelCache::Default() {
  // Never destroyed: launches may run during static destruction of other objects.
  static KernelCache* const cache = new KernelCache();
  return *cache;
}

std::vector<std::string> KernelCache::Options(std::string_view arch) const {
  return CanonicalOptions(arch, extra_options_);
}

std::string KernelCache::DiskDirectory() const {
  return options_.disk_directory ? *options_.disk_directory : CacheDirectory();
}

std::string KernelCache::RequestId(const CompileRequest& r) const {
  return absl::StrCat(r.arch, "|", r.source_file, "|", r.name_expression);
}

absl::StatusOr<std::string> KernelCache::KeyFor(const CompileRequest& request) const {
  RETURN_IF_ERROR(CheckArch(request.arch));
  if (sources_->Find(request.source_file) == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("kernel source '", request.source_file, "' (for ", request.kernel_name,
                     ") is not among the embedded sources: ", sources_->Names()));
  }
  CacheKeyInputs in;
  in.library_version = LibraryVersion();
  in.nvrtc_version = NvrtcVersionString();
  in.nvrtc_library = NvrtcLibraryIdentity();
  in.arch = request.arch;
  in.options = Options(request.arch);
  in.sources = sources_->files();
  in.generated_source = GeneratedSource(request.source_file);
  in.name_expression = request.name_expression;
  return ComputeCacheKey(in);
}

DiskCache* KernelCache::DiskFor(const std::string& directory) {
  absl::MutexLock lock(&mu_);
  std::unique_ptr<DiskCache>& disk = disks_[directory];
  if (disk == nullptr) disk = std::make_unique<DiskCache>(directory);
  return disk.get();
}

absl::StatusOr<std::shared_ptr<const CompiledKernel>> KernelCache::GetForConfig(
    const KernelConfig& config, std::string_view arch, CacheSource* source) {
  // Refuse before NVRTC: its error would be about templates, not the rule that was broken.
  RETURN_IF_ERROR(ValidateConfig(config));
  return Get(RequestForConfig(config, arch), source);
}

absl::StatusOr<std::shared_ptr<const CompiledKernel>> KernelCache::Get(
    const CompileRequest& request, CacheSource* source) {
  const std::string id = RequestId(request);
  std::shared_ptr<Flight> flight;
  bool leader = false;
  {
    absl::MutexLock lock(&mu_);
    // Hit the memory cache.
    if (auto it = compiled_.find(id); it != compiled_.end()) {
      counters_.memory_hits.fetch_add(1, std::memory_order_relaxed);
      if (source != nullptr) *source = CacheSource::kMemory;
      GEMVZ_LOG_DEBUG("jit: memory hit %s for %s", request.kernel_name, request.arch);
      return it->second;
    }
    // Join the flight in progress for this key, or lead a new one.
    std::shared_ptr<Flight>& f = flights_[id];
    if (f == nullptr) {
      f = std::make_shared<Flight>();
      leader = true;
    }
    flight = f;
  }
  if (!leader) {
    counters_.flight_waits.fetch_add(1, std::memory_order_relaxed);
    flight->done.WaitForNotification();
    if (flight->result.ok()) counters_.memory_hits.fetch_add(1, std::memory_order_relaxed);
    if (source != nullptr) *source = CacheSource::kMemory;
    return flight->result;
  }
  CacheSource produced = CacheSource::kCompiled;
  flight->result = Produce(request, &produced);
  flight->source = produced;
  {
    absl::MutexLock lock(&mu_);
    if (flight->result.ok()) compiled_[id] = *flight->result;
    flights_.erase(id);  // a failure is not remembered: the next request tries again
  }
  flight->done.Notify();
  if (source != nullptr) *source = produced;
  return flight->result;
}

absl::StatusOr<std::shared_ptr<const CompiledKernel>> KernelCache::Produce(
    const CompileRequest& request, CacheSource* source) {
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(const std::string key, KeyFor(request));
  const std::string directory = DiskDirectory();
  DiskCache* disk = directory.empty() ? nullptr : DiskFor(directory);

  // Hit the disk cache.
  std::unique_ptr<DiskCache::KeyLock> key_lock;
  if (disk != nullptr) {
    CompiledKernel kernel;
    std::string reason;
    DiskCache::Lookup found = disk->Read(key, &kernel, &reason, /*remove_bad=*/false);
    if (found != DiskCache::Lookup::kHit) {
      // NOTES: another process may be compiling this key; wait for it, then look again. A bad
      // entry is removed only under the lock, so that we never delete a good one just published.
      key_lock = disk->LockKey(key);
      if (key_lock != nullptr || found == DiskCache::Lookup::kRejected) {
        found = disk->Read(key, &kernel, &reason, /*remove_bad=*/true);
        if (found == DiskCache::Lookup::kRejected) {
          counters_.disk_rejects.fetch_add(1, std::memory_order_relaxed);
        }
      }
    }
    if (found == DiskCache::Lookup::kHit) {
      counters_.disk_hits.fetch_add(1, std::memory_order_relaxed);
      kernel.from_disk = true;
      GEMVZ_LOG_INFO("jit: disk hit %s for %s (%s) in %.2f ms", request.kernel_name, request.arch,
                     key.substr(0, 12), MillisSince(start));
      *source = CacheSource::kDisk;
      return std::make_shared<const CompiledKernel>(std::move(kernel));
    }
  }

  // Compile.
  GEMVZ_LOG_INFO("jit: miss %s for %s (%s), compiling with NVRTC %s", request.kernel_name,
                 request.arch, key.substr(0, 12), NvrtcVersionString());
  absl::StatusOr<CompiledKernel> compiled =
      CompileWithNvrtc(request, *sources_, Options(request.arch));
  if (!compiled.ok()) {
    counters_.compile_failures.fetch_add(1, std::memory_order_relaxed);
    return compiled.status();
  }
  counters_.compiles.fetch_add(1, std::memory_order_relaxed);
  compiled->key = key;
  GEMVZ_LOG_INFO("jit: compiled %s for %s in %.1f ms: %d registers, %d spill bytes, %d bytes smem",
                 request.kernel_name, request.arch, compiled->compile_ms, compiled->registers,
                 compiled->spill_bytes, compiled->shared_bytes);
  Dump(request, *compiled);

  // Publish to disk, then keep the cache under its cap (never evicting what we just wrote).
  if (disk != nullptr && disk->Write(*compiled).ok()) {
    counters_.disk_writes.fetch_add(1, std::memory_order_relaxed);
    const int64_t cap = options_.max_disk_bytes ? *options_.max_disk_bytes : DiskCacheMaxBytes();
    if (absl::StatusOr<PruneResult> pruned = disk->Prune(cap, key); !pruned.ok()) {
      GEMVZ_LOG_WARNING("kernel cache eviction in '%s' failed: %s", directory,
                        pruned.status().message());
    }
  }
  *source = CacheSource::kCompiled;
  return std::make_shared<const CompiledKernel>(*std::move(compiled));
}

void KernelCache::Dump(const CompileRequest& request, const CompiledKernel& kernel) const {
  std::optional<std::string> dir =
      options_.dump_directory ? options_.dump_directory : GetEnv("GEMVZ_DUMP_DIR");
  if (!dir || dir->empty()) return;
  const std::string base = absl::StrCat(*dir, "/", SafeFileName(kernel.kernel_name), ".",
                                        kernel.arch, ".", kernel.key.substr(0, 12));
  std::string source = GeneratedSource(request.source_file);
  absl::StrAppend(&source, "// name expression: ", kernel.name_expression,
                  "\n// lowered name: ", kernel.lowered_name,
                  "\n// headers (in memory): ", sources_->Names(), "\n");
  const std::string report = absl::StrCat(
      "options: ", absl::StrJoin(Options(kernel.arch), " "), "\nregisters: ", kernel.registers,
      "\nspill bytes: ", kernel.spill_bytes, "\nshared bytes: ", kernel.shared_bytes,
      "\ncompile ms: ", kernel.compile_ms, "\n\n", kernel.log);
  absl::Status st = CreateDirectories(*dir);
  if (st.ok()) st = AtomicWriteFile(base + ".cu", source);
  if (st.ok() && !kernel.ptx.empty()) st = AtomicWriteFile(base + ".ptx", kernel.ptx);
  if (st.ok()) st = AtomicWriteFile(base + ".ptxas.txt", report);
  if (!st.ok()) {
    GEMVZ_LOG_WARNING("GEMVZ_DUMP_DIR: cannot dump %s: %s", kernel.kernel_name, st.message());
  } else {
    GEMVZ_LOG_INFO("jit: dumped %s.{cu,ptx,ptxas.txt}", base);
  }
}

absl::StatusOr<LoadedKernel> KernelCache::LoadCompiled(
    int device, std::shared_ptr<const CompiledKernel> compiled) {
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(ScopedDeviceContext scope, ScopedDeviceContext::Enter(device));
  // A failed load names the kernel, the architecture it was built for and the device, since the
  // likeliest cause is a GEMVZ_ARCH that the device cannot run (sm_100 on an H200).
  auto which = [&](const absl::Status& st) {
    const std::optional<std::string> env_arch = GetEnv("GEMVZ_ARCH");
    return absl::Status(
        st.code(),
        absl::StrCat("loading kernel ", compiled->kernel_name, " (built for ", compiled->arch,
                     env_arch ? absl::StrCat(", GEMVZ_ARCH=", *env_arch) : std::string(),
                     ") on device ", device, ": ", st.message()));
  };
  ASSIGN_OR_RETURN(const DriverApi* const driver, Driver());
  CUmodule module = nullptr;
  if (const CUresult r = driver->cuModuleLoadData(&module, compiled->cubin.data());
      r != CUDA_SUCCESS) {
    return which(CuResultToStatus(r, "cuModuleLoadData", __FILE__, __LINE__));
  }
  CUfunction function = nullptr;
  const CUresult r = driver->cuModuleGetFunction(&function, module, compiled->lowered_name.c_str());
  if (r != CUDA_SUCCESS) {
    driver->cuModuleUnload(module);
    return which(CuResultToStatus(r, "cuModuleGetFunction(lowered name of the kernel)", __FILE__,
                                  __LINE__));
  }
  counters_.module_loads.fetch_add(1, std::memory_order_relaxed);
  modules_.emplace_back(device, module);
  GEMVZ_LOG_INFO("jit: loaded %s on device %d in %.3f ms", compiled->kernel_name, device,
                 MillisSince(start));
  LoadedKernel out;
  out.function = function;
  out.compiled = std::move(compiled);
  return out;
}

absl::StatusOr<LoadedKernel> KernelCache::Load(int device, const CompileRequest& request) {
  std::pair<int, std::string> id(device, RequestId(request));
  {
    absl::ReaderMutexLock lock(&load_mu_);
    if (auto it = loaded_.find(id); it != loaded_.end()) return it->second;
  }
  RETURN_IF_ERROR(Driver().status());  // no compile for a GPU call that cannot succeed
  ASSIGN_OR_RETURN(std::shared_ptr<const CompiledKernel> compiled, Get(request));
  absl::MutexLock lock(&load_mu_);
  if (auto it = loaded_.find(id); it != loaded_.end()) return it->second;
  ASSIGN_OR_RETURN(LoadedKernel loaded, LoadCompiled(device, std::move(compiled)));
  loaded_.emplace(std::move(id), loaded);
  return loaded;
}

absl::StatusOr<LoadedKernel> KernelCache::LoadForConfig(int device, const KernelConfig& config) {
  const std::pair<int, KernelConfig> id = FunctionId(device, config);
  {
    absl::ReaderMutexLock lock(&load_mu_);
    if (auto it = loaded_configs_.find(id); it != loaded_configs_.end()) return it->second;
  }
  RETURN_IF_ERROR(ValidateConfig(config));
  ASSIGN_OR_RETURN(const std::string arch, LaunchArch(device));
  ASSIGN_OR_RETURN(LoadedKernel loaded, Load(device, RequestForConfig(id.second, arch)));
  {
    ASSIGN_OR_RETURN(ScopedDeviceContext scope, ScopedDeviceContext::Enter(device));
    CU_RETURN_IF_ERROR(cuOccupancyMaxActiveBlocksPerMultiprocessor(
        &loaded.blocks_per_sm, loaded.function, config.threads(), 0));
  }
  absl::MutexLock lock(&load_mu_);
  loaded_configs_.emplace(id, loaded);
  return loaded;
}

absl::StatusOr<KernelFunction> KernelCache::FunctionForConfig(int device,
                                                              const KernelConfig& config) {
  return function_front_.FindOrAsk(
      FunctionId(device, config), [&]() -> absl::StatusOr<KernelFunction> {
        ASSIGN_OR_RETURN(const LoadedKernel loaded, LoadForConfig(device, config));
        return KernelFunction{loaded.function, loaded.blocks_per_sm};
      });
}

JitCounters KernelCache::counters() const {
  JitCounters c;
  c.memory_hits = counters_.memory_hits.load();
  c.disk_hits = counters_.disk_hits.load();
  c.compiles = counters_.compiles.load();
  c.disk_writes = counters_.disk_writes.load();
  c.disk_rejects = counters_.disk_rejects.load();
  c.module_loads = counters_.module_loads.load();
  c.compile_failures = counters_.compile_failures.load();
  c.flight_waits = counters_.flight_waits.load();
  return c;
}

void KernelCache::ResetCounters() {
  for (std::atomic<int64_t>* c :
       {&counters_.memory_hits, &counters_.disk_hits, &counters_.compiles, &counters_.disk_writes,
        &counters_.disk_rejects, &counters_.module_loads, &counters_.compile_failures,
        &counters_.flight_waits}) {
    c->store(0);
  }
}

void KernelCache::DropMemoryForTesting() {
  {
    absl::MutexLock lock(&mu_);
    compiled_.clear();
  }
  absl::MutexLock lock(&load_mu_);
  loaded_.clear();
  loaded_configs_.clear();
  function_front_.Invalidate();  // after the clear (per_thread_cache.h)
}

// --- The process-wide entry points ----------------------------------------------------------

absl::StatusOr<std::string> DeviceArch(int device) {
  // GEMVZ_ARCH is read on every call, as GEMVZ_PDL is: a process that warms the cache for one
  // target after another by changing it gets each one. Only what the device reports is cached.
  if (std::optional<std::string> forced = GetEnv("GEMVZ_ARCH")) {
    // Lets a user pick sm_90a (or test another target) without touching code.
    if (absl::Status st = CheckArch(*forced); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat("GEMVZ_ARCH: ", st.message()));
    }
    return *forced;
  }
  static absl::Mutex mu(absl::kConstInit);
  static auto* const archs = new absl::flat_hash_map<int, std::string>();
  {
    absl::MutexLock lock(&mu);
    if (auto it = archs->find(device); it != archs->end()) return it->second;
  }
  RETURN_IF_ERROR(Driver().status());
  const int count = DeviceCount();
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("device ", device, " does not exist (", count, " visible)"));
  }
  CUdevice dev;
  CU_RETURN_IF_ERROR(cuDeviceGet(&dev, device));
  int major = 0, minor = 0;
  CU_RETURN_IF_ERROR(
      cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
  CU_RETURN_IF_ERROR(
      cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev));
  const std::string arch = absl::StrCat("sm_", major, minor);
  absl::MutexLock lock(&mu);
  archs->emplace(device, arch);
  return arch;
}

absl::StatusOr<std::string> LaunchArch(int device) {
  // NOTES: DeviceArch reads GEMVZ_ARCH at every call; a GEMV must not, or a device whose plans
  // were chosen for one target would load later kernels built for another (and fail to load
  // them, for sm_100 on an H200).
  static absl::Mutex mu(absl::kConstInit);
  static auto* const pinned = new absl::flat_hash_map<int, std::string>();
  {
    absl::MutexLock lock(&mu);
    if (auto it = pinned->find(device); it != pinned->end()) return it->second;
  }
  ASSIGN_OR_RETURN(std::string arch, DeviceArch(device));
  absl::MutexLock lock(&mu);
  return pinned->emplace(device, std::move(arch)).first->second;  // a racing first call's wins
}

absl::StatusOr<std::string> DefaultArch(int device) {
  if (GetEnv("GEMVZ_ARCH").has_value() || DeviceCount() > 0) return DeviceArch(device);
  return std::string("sm_90");
}

absl::StatusOr<std::shared_ptr<const CompiledKernel>> GetCompiledKernel(const KernelConfig& config,
                                                                        std::string_view arch) {
  return KernelCache::Default().GetForConfig(config, arch);
}

absl::StatusOr<LoadedKernel> GetKernel(int device, const KernelConfig& config) {
  return KernelCache::Default().LoadForConfig(device, config);
}

absl::StatusOr<KernelFunction> GetKernelFunction(int device, const KernelConfig& config) {
  return KernelCache::Default().FunctionForConfig(device, config);
}

absl::StatusOr<LoadedKernel> GetKernelByName(int device, std::string_view source_file,
                                             std::string_view name_expression) {
  ASSIGN_OR_RETURN(const std::string arch, DeviceArch(device));
  CompileRequest request;
  request.arch = arch;
  request.source_file = std::string(source_file);
  request.name_expression = std::string(name_expression);
  request.kernel_name = absl::StrCat(request.source_file, ":", request.name_expression);
  return KernelCache::Default().Load(device, request);
}

}  // namespace gemvz::internal
