// GPU-side machinery of the gemvz CLI: sessions, buffers, graph timing, cuBLAS through dlopen, the
// bandwidth probe and one shape's rotated workload (bench_gpu.h says what each is for).
#include "tools/gemvz/bench_gpu.h"

#include <cublas_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gemvz/format.h"
#include "runtime/common/status_macros.h"
#include "runtime/jit/kernel_cache.h"

namespace gemvz::cli {
namespace {

constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

double MiB(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

// A copy from pageable host memory may return before its DMA lands, and it ran on the legacy
// stream, which the session's non-blocking stream does not wait for: finish it here.
absl::Status UploadsDone() {
  CU_RETURN_IF_ERROR(cuCtxSynchronize());
  return absl::OkStatus();
}

std::string ShapeLabel(const MatrixShape& shape) {
  return shape.name.empty() ? shape.ToString() : absl::StrCat(shape.name, " ", shape.ToString());
}

}  // namespace

void Progress(const std::string& line) {
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
}

std::string NoGpuReason() {
  if (internal::DeviceCount() > 0) return "";
  absl::StatusOr<const internal::DriverApi*> driver = internal::Driver();
  if (!driver.ok()) return std::string(driver.status().message());
  return "the CUDA driver reports no GPU";
}

// --- DeviceBuffer ------------------------------------------------------------------------------

absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(size_t bytes) {
  DeviceBuffer buffer;
  if (bytes == 0) return buffer;
  CU_RETURN_IF_ERROR(cuMemAlloc(&buffer.ptr_, bytes));
  buffer.bytes_ = bytes;
  return buffer;
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, 0)), bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Release();
    ptr_ = std::exchange(other.ptr_, 0);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() { Release(); }

void DeviceBuffer::Release() {
  if (ptr_ == 0) return;
  absl::StatusOr<const internal::DriverApi*> driver = internal::Driver();
  if (driver.ok()) (*driver)->cuMemFree(ptr_);
  ptr_ = 0;
  bytes_ = 0;
}

// --- GpuSession --------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<GpuSession>> GpuSession::Open(int device) {
  const int count = internal::DeviceCount();
  if (count == 0) {
    return absl::FailedPreconditionError(absl::StrCat("no GPU: ", NoGpuReason()));
  }
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device ", device, ": this machine has ", count, " GPU(s), 0..", count - 1));
  }
  ASSIGN_OR_RETURN(internal::ScopedDeviceContext scope, internal::ScopedDeviceContext::Enter(device));
  ASSIGN_OR_RETURN(const internal::DriverApi* drv, internal::Driver());
  GpuInfo info;
  info.device = device;
  CUdevice dev = 0;
  CU_RETURN_IF_ERROR(cuDeviceGet(&dev, device));
  char name[256] = {0};
  CU_RETURN_IF_ERROR(cuDeviceGetName(name, sizeof(name) - 1, dev));
  info.name = name;
  size_t total = 0;
  CU_RETURN_IF_ERROR(cuDeviceTotalMem(&total, dev));
  info.memory_bytes = static_cast<int64_t>(total);
  auto attribute = [&](CUdevice_attribute a) {
    int v = 0;
    drv->cuDeviceGetAttribute(&v, a, dev);
    return v;
  };
  info.limits.max_threads_per_block = attribute(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK);
  info.limits.max_shared_per_block = attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK);
  info.limits.max_grid_x = attribute(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X);
  info.limits.max_grid_y = attribute(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y);
  info.limits.sm_count = attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
  info.limits.cc_major = attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
  info.limits.cc_minor = attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
  int version = 0;
  CU_RETURN_IF_ERROR(cuDriverGetVersion(&version));
  info.cuda_driver_api = absl::StrCat(version / 1000, ".", (version % 1000) / 10);
  ASSIGN_OR_RETURN(info.arch, internal::DeviceArch(device));
  // Non-blocking: nothing on the legacy stream may slip into a graph capture on this one.
  CUstream stream = nullptr;
  CU_RETURN_IF_ERROR(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
  return std::unique_ptr<GpuSession>(new GpuSession(std::move(scope), std::move(info), stream));
}

GpuSession::~GpuSession() {
  absl::StatusOr<const internal::DriverApi*> driver = internal::Driver();
  if (!driver.ok() || stream_ == nullptr) return;
  // The stream's Gemv workspace goes first (gemv.h): destroyed with it, its buffers would stay
  // allocated for the process, and a stream made later with the same handle would inherit them.
  // A session's graphs are gone by now (whatever captured them is destroyed before the session).
  if (const absl::Status st = ReleaseGemvWorkspace(stream_, info_.device); !st.ok()) {
    Progress(
        absl::StrCat("warning: releasing the session stream's GEMV workspace: ", st.message()));
  }
  (*driver)->cuStreamDestroy(stream_);
}

absl::Status GpuSession::Synchronize() const {
  CU_RETURN_IF_ERROR(cuStreamSynchronize(stream_));
  return absl::OkStatus();
}

// --- Graph timing ------------------------------------------------------------------------------

GraphTimer::~GraphTimer() {
  absl::StatusOr<const internal::DriverApi*> drv = internal::Driver();
  if (!drv.ok()) return;
  for (CUgraphExec exec : execs_) (*drv)->cuGraphExecDestroy(exec);
}

absl::StatusOr<int> GraphTimer::Capture(int launches,
                                        const std::function<absl::Status(int)>& enqueue) {
  if (launches < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("graph timing needs launches >= 1 (", launches, ")"));
  }
  ASSIGN_OR_RETURN(const internal::DriverApi* drv, internal::Driver());
  // Thread-local capture: a call that would allocate or synchronise inside the graph fails here
  // instead of being timed wrongly.
  CU_RETURN_IF_ERROR(cuStreamBeginCapture(stream_, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
  absl::Status enqueued = absl::OkStatus();
  for (int i = 0; i < launches && enqueued.ok(); ++i) enqueued = enqueue(i);
  CUgraph graph = nullptr;
  const CUresult ended = drv->cuStreamEndCapture(stream_, &graph);
  if (!enqueued.ok()) {
    if (graph != nullptr) drv->cuGraphDestroy(graph);
    return absl::Status(enqueued.code(),
                        absl::StrCat("while capturing a CUDA graph: ", enqueued.message()));
  }
  if (ended != CUDA_SUCCESS) {
    return internal::CuResultToStatus(ended, "cuStreamEndCapture", __FILE__, __LINE__);
  }
  CUgraphExec exec = nullptr;
  const CUresult instantiated = drv->cuGraphInstantiate(&exec, graph, 0);
  drv->cuGraphDestroy(graph);
  if (instantiated != CUDA_SUCCESS) {
    return internal::CuResultToStatus(instantiated, "cuGraphInstantiate", __FILE__, __LINE__);
  }
  execs_.push_back(exec);
  launches_.push_back(launches);
  return static_cast<int>(execs_.size()) - 1;
}

absl::StatusOr<std::vector<double>> GraphTimer::MedianMicros(
    const TimingOptions& options, const std::function<void(int done, int total)>& on_round) {
  if (options.replays < 1 || options.warmup_replays < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("graph timing needs replays >= 1 (", options.replays, ") and warm-up >= 0"));
  }
  ASSIGN_OR_RETURN(const internal::DriverApi* drv, internal::Driver());
  CUevent start = nullptr, stop = nullptr;
  absl::Cleanup release = [&] {
    if (start != nullptr) drv->cuEventDestroy(start);
    if (stop != nullptr) drv->cuEventDestroy(stop);
  };
  CU_RETURN_IF_ERROR(cuEventCreate(&start, CU_EVENT_DEFAULT));
  CU_RETURN_IF_ERROR(cuEventCreate(&stop, CU_EVENT_DEFAULT));
  const int rounds = options.warmup_replays + options.replays;
  for (int w = 0; w < options.warmup_replays; ++w) {
    for (CUgraphExec exec : execs_) CU_RETURN_IF_ERROR(cuGraphLaunch(exec, stream_));
    if (on_round) {  // after the round has run, not when it was enqueued
      CU_RETURN_IF_ERROR(cuStreamSynchronize(stream_));
      on_round(w + 1, rounds);
    }
  }
  CU_RETURN_IF_ERROR(cuStreamSynchronize(stream_));
  std::vector<std::vector<double>> per_launch_us(execs_.size());
  // Each timed round in its own order (a fixed seed: the same orders every run), so that no
  // graph keeps the same place and neighbours in every round.
  std::vector<size_t> order(execs_.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::mt19937 rng(1);
  for (int r = 0; r < options.replays; ++r) {
    std::shuffle(order.begin(), order.end(), rng);
    for (const size_t g : order) {
      absl::Status st = [&]() -> absl::Status {
        CU_RETURN_IF_ERROR(cuEventRecord(start, stream_));
        CU_RETURN_IF_ERROR(cuGraphLaunch(execs_[g], stream_));
        CU_RETURN_IF_ERROR(cuEventRecord(stop, stream_));
        CU_RETURN_IF_ERROR(cuEventSynchronize(stop));
        float ms = 0;
        CU_RETURN_IF_ERROR(cuEventElapsedTime(&ms, start, stop));
        per_launch_us[g].push_back(static_cast<double>(ms) * 1000.0 / launches_[g]);
        return absl::OkStatus();
      }();
      if (!st.ok()) {  // name the graph: one of many captured workloads failed
        return absl::Status(st.code(), absl::StrCat("timing graph ", g, " of ", execs_.size(),
                                                    " (replay ", r, "): ", st.message()));
      }
    }
    if (on_round) on_round(options.warmup_replays + r + 1, rounds);
  }
  std::vector<double> medians;
  for (std::vector<double>& t : per_launch_us) {
    std::sort(t.begin(), t.end());
    const size_t h = t.size() / 2;
    medians.push_back(t.size() % 2 == 1 ? t[h] : 0.5 * (t[h - 1] + t[h]));
  }
  return medians;
}

// --- cuBLAS ------------------------------------------------------------------------------------

struct Cublas::Api {
  void* library = nullptr;
  cublasStatus_t (*create)(cublasHandle_t*) = nullptr;
  cublasStatus_t (*destroy)(cublasHandle_t) = nullptr;
  cublasStatus_t (*set_stream)(cublasHandle_t, cudaStream_t) = nullptr;
  cublasStatus_t (*set_workspace)(cublasHandle_t, void*, size_t) = nullptr;
  cublasStatus_t (*set_math_mode)(cublasHandle_t, cublasMath_t) = nullptr;
  cublasStatus_t (*get_version)(cublasHandle_t, int*) = nullptr;
  const char* (*status_string)(cublasStatus_t) = nullptr;
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                            const void*, const void*, cudaDataType, int, const void*,
                            cudaDataType, int, const void*, void*, cudaDataType, int,
                            cublasComputeType_t, cublasGemmAlgo_t) = nullptr;
};

std::vector<std::string> CublasCandidates() {
  std::vector<std::string> out;
  auto add = [&](std::string path) {
    if (!path.empty() && std::find(out.begin(), out.end(), path) == out.end()) {
      out.push_back(std::move(path));
    }
  };
  if (const char* explicit_path = std::getenv("GEMVZ_CUBLAS_LIBRARY")) add(explicit_path);
  add("libcublas.so.13");
  add("libcublas.so.12");
  for (const char* var : {"CUDA_HOME", "CUDA_PATH"}) {
    const char* root = std::getenv(var);
    if (root == nullptr || *root == '\0') continue;
    for (const char* name : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"}) {
      add(absl::StrCat(root, "/lib64/", name));
    }
  }
  for (const char* name : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"}) {
    add(absl::StrCat("/usr/local/cuda/lib64/", name));
  }
  return out;
}

namespace {

template <typename Fn>
bool Resolve(void* library, const char* symbol, Fn* fn, std::string* missing) {
  *fn = reinterpret_cast<Fn>(dlsym(library, symbol));
  if (*fn == nullptr) *missing = symbol;
  return *fn != nullptr;
}

absl::StatusOr<std::unique_ptr<Cublas::Api>> LoadCublasApi(std::string* loaded_from) {
  std::vector<std::string> tried;
  for (const std::string& candidate : CublasCandidates()) {
    void* library = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      const char* why = dlerror();
      tried.push_back(absl::StrCat(candidate, " (", why != nullptr ? why : "not found", ")"));
      continue;
    }
    auto api = std::make_unique<Cublas::Api>();
    api->library = library;
    std::string missing;
    if (Resolve(library, "cublasCreate_v2", &api->create, &missing) &&
        Resolve(library, "cublasDestroy_v2", &api->destroy, &missing) &&
        Resolve(library, "cublasSetStream_v2", &api->set_stream, &missing) &&
        Resolve(library, "cublasSetWorkspace_v2", &api->set_workspace, &missing) &&
        Resolve(library, "cublasSetMathMode", &api->set_math_mode, &missing) &&
        Resolve(library, "cublasGetVersion_v2", &api->get_version, &missing) &&
        Resolve(library, "cublasGetStatusString", &api->status_string, &missing) &&
        Resolve(library, "cublasGemmEx", &api->gemm_ex, &missing)) {
      *loaded_from = candidate;
      return api;
    }
    tried.push_back(absl::StrCat(candidate, " (no symbol ", missing, ")"));
    dlclose(library);
  }
  return absl::NotFoundError(absl::StrCat(
      "cannot load cuBLAS for the comparison; tried: ", absl::StrJoin(tried, "; "),
      ". Set GEMVZ_CUBLAS_LIBRARY to the path of libcublas.so"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Cublas>> Cublas::Open(CUstream stream) {
  std::unique_ptr<Cublas> blas(new Cublas());
  ASSIGN_OR_RETURN(blas->api_, LoadCublasApi(&blas->library_));
  const Api& api = *blas->api_;
  auto check = [&](cublasStatus_t s, const char* call) -> absl::Status {
    if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
    return absl::InternalError(absl::StrCat(call, " failed: ", api.status_string(s), " (",
                                            static_cast<int>(s), "), cuBLAS from ",
                                            blas->library_));
  };
  cublasHandle_t handle = nullptr;
  RETURN_IF_ERROR(check(api.create(&handle), "cublasCreate"));
  blas->handle_ = handle;
  RETURN_IF_ERROR(check(api.set_stream(handle, stream), "cublasSetStream"));
  ASSIGN_OR_RETURN(blas->workspace_, DeviceBuffer::Allocate(kCublasWorkspaceBytes));
  RETURN_IF_ERROR(check(api.set_workspace(handle, reinterpret_cast<void*>(blas->workspace_.ptr()),
                                          blas->workspace_.bytes()),
                        "cublasSetWorkspace"));
  RETURN_IF_ERROR(check(api.set_math_mode(handle, CUBLAS_DEFAULT_MATH), "cublasSetMathMode"));
  RETURN_IF_ERROR(check(api.get_version(handle, &blas->version_), "cublasGetVersion"));
  return blas;
}

Cublas::~Cublas() {
  if (handle_ != nullptr && api_ != nullptr) {
    api_->destroy(static_cast<cublasHandle_t>(handle_));
  }
  // The library stays loaded: cuBLAS's own exit handlers may still run.
}

absl::Status Cublas::GemmBf16(CUdeviceptr w, CUdeviceptr x, CUdeviceptr out, int64_t m, int64_t n,
                              int64_t k) const {
  // Column-major view: out^T [n, m] = (W as a k x n column-major matrix)^T * (x^T, k x m).
  const float alpha = 1.0f, beta = 0.0f;
  const cublasStatus_t s = api_->gemm_ex(
      static_cast<cublasHandle_t>(handle_), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n),
      static_cast<int>(m), static_cast<int>(k), &alpha, reinterpret_cast<const void*>(w),
      CUDA_R_16BF, static_cast<int>(k), reinterpret_cast<const void*>(x), CUDA_R_16BF,
      static_cast<int>(k), &beta, reinterpret_cast<void*>(out), CUDA_R_16BF, static_cast<int>(n),
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (s != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(absl::StrFormat("cublasGemmEx (m %d, n %d, k %d) failed: %s (%d)",
                                               m, n, k, api_->status_string(s),
                                               static_cast<int>(s)));
  }
  return absl::OkStatus();
}

// --- Bandwidth probe ---------------------------------------------------------------------------

absl::StatusOr<BandwidthProbe> BandwidthProbe::Load(const GpuSession& session) {
  BandwidthProbe probe;
  int max_blocks = 1;
  for (const ProbeForm& form : ProbeForms()) {
    ASSIGN_OR_RETURN(internal::LoadedKernel kernel,
                     internal::GetKernelByName(session.info().device, "bandwidth_probe.cuh",
                                               form.NameExpression()));
    Kernel k;
    k.name = form.Name();
    k.function = kernel.function;
    k.blocks = std::max(1, session.info().limits.sm_count * form.blocks_per_sm);
    k.threads = form.threads;
    max_blocks = std::max(max_blocks, k.blocks);
    probe.kernels_.push_back(std::move(k));
  }
  ASSIGN_OR_RETURN(DeviceBuffer sink, DeviceBuffer::Allocate(sizeof(unsigned) * max_blocks));
  probe.sink_ = std::make_shared<DeviceBuffer>(std::move(sink));
  RETURN_IF_ERROR(probe.CheckForms(session.stream()));
  return probe;
}

// Every form must read every word once: the XOR of its blocks' words is the XOR of the buffer.
// An odd size (not a whole number of any form's sweeps) takes each form through its tail loop.
absl::Status BandwidthProbe::CheckForms(CUstream stream) const {
  constexpr int64_t kBytes = (int64_t{3} << 20) + 48;
  std::vector<uint32_t> words(kBytes / 4);
  uint32_t want = 0, state = 0x9e3779b9u;
  for (uint32_t& w : words) {
    state = state * 1664525u + 1013904223u;
    w = state ^ (state >> 13);
    want ^= w;
  }
  ASSIGN_OR_RETURN(DeviceBuffer src, DeviceBuffer::Allocate(kBytes));
  CU_RETURN_IF_ERROR(cuMemcpyHtoD(src.ptr(), words.data(), kBytes));
  RETURN_IF_ERROR(UploadsDone());  // else a form may read the buffer before its last bytes land
  for (int kernel = 0; kernel < kernel_count(); ++kernel) {
    std::vector<uint32_t> sink(kernels_[kernel].blocks);
    RETURN_IF_ERROR(Launch(kernel, src.ptr(), kBytes, stream));
    CU_RETURN_IF_ERROR(cuStreamSynchronize(stream));
    CU_RETURN_IF_ERROR(cuMemcpyDtoH(sink.data(), sink_->ptr(), sink.size() * 4));
    uint32_t got = 0;
    for (uint32_t w : sink) got ^= w;
    if (got != want) {
      return absl::InternalError(
          absl::StrFormat("bandwidth probe %s read %d bytes wrongly: XOR %08x, want %08x",
                          kernel_name(kernel), kBytes, got, want));
    }
  }
  return absl::OkStatus();
}

absl::Status BandwidthProbe::Launch(int kernel, CUdeviceptr src, int64_t bytes,
                                    CUstream stream) const {
  const Kernel& k = kernels_.at(kernel);
  long long units = bytes / 16;
  CUdeviceptr sink = sink_->ptr();
  void* args[] = {&src, &units, &sink};
  CU_RETURN_IF_ERROR(
      cuLaunchKernel(k.function, k.blocks, 1, 1, k.threads, 1, 1, 0, stream, args, nullptr));
  return absl::OkStatus();
}

// --- ShapeWorkload -----------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<ShapeWorkload>> ShapeWorkload::Create(
    GpuSession* session, const MatrixShape& shape, int64_t max_m, const WorkloadOptions& options) {
  std::unique_ptr<ShapeWorkload> w(new ShapeWorkload(session, shape, options));
  const int64_t n = shape.n, k = shape.k;
  w->weights_ = NormalBf16(n * k, 1.0 / std::sqrt(static_cast<double>(k)),
                           WeightSeed(options.seed, shape), options.threads);
  for (int64_t row : options.zero_rows) {
    if (row >= n) {
      return absl::InvalidArgumentError(absl::StrCat("--zero_rows: row ", row, " is outside ",
                                                     shape.ToString(), " (", n, " rows)"));
    }
    std::fill(w->weights_.begin() + row * k, w->weights_.begin() + (row + 1) * k, uint16_t{0});
  }
  for (const auto& [row, percent] : options.exception_rows) {
    if (row >= n) {
      return absl::InvalidArgumentError(absl::StrCat("--exception_rows: row ", row, " is outside ",
                                                     shape.ToString(), " (", n, " rows)"));
    }
    for (int64_t col : ExceptionColumns(k, percent)) w->weights_[row * k + col] = 0x0001;
  }
  const std::vector<uint16_t> x =
      NormalBf16(max_m * k, 1.0, InputSeed(options.seed, shape), options.threads);
  w->reference_ = ReferenceGemv(w->weights_.data(), x.data(), max_m, n, k, options.threads);
  ASSIGN_OR_RETURN(w->x_, DeviceBuffer::Allocate(x.size() * 2));
  CU_RETURN_IF_ERROR(cuMemcpyHtoD(w->x_.ptr(), x.data(), x.size() * 2));
  ASSIGN_OR_RETURN(w->out_, DeviceBuffer::Allocate(static_cast<size_t>(max_m * n) * 2));
  RETURN_IF_ERROR(UploadsDone());
  return w;
}

int ShapeWorkload::CopiesFor(int64_t bytes_per_copy) const {
  int64_t copies = (options_.rotate_bytes + bytes_per_copy - 1) / std::max<int64_t>(1, bytes_per_copy);
  // At most 1024 copies (each an allocation; a graph takes whole rotations): a matrix that small
  // reads less than --rotate_mb, perhaps from L2, and the timings say so.
  constexpr int64_t kMaxCopies = 1024;
  if (copies > kMaxCopies) {
    Progress(
        absl::StrFormat("  note: %d copies of %.3f MiB (%.1f MiB) fall short of --rotate_mb "
                        "(%.0f MiB): timings may include L2 hits",
                        kMaxCopies, MiB(bytes_per_copy), MiB(kMaxCopies * bytes_per_copy),
                        MiB(options_.rotate_bytes)));
  }
  copies = std::clamp<int64_t>(copies, 2, kMaxCopies);
  // Stay within free memory (keeping 1 GiB for everything else), but never below 2 copies.
  size_t free_bytes = 0, total_bytes = 0;
  absl::StatusOr<const internal::DriverApi*> driver = internal::Driver();
  if (driver.ok() && (*driver)->cuMemGetInfo(&free_bytes, &total_bytes) == CUDA_SUCCESS) {
    const int64_t usable = static_cast<int64_t>(free_bytes) - (int64_t{1} << 30);
    const int64_t fit = usable / std::max<int64_t>(1, bytes_per_copy);
    if (fit < copies) {
      Progress(absl::StrFormat("  note: only %d copies of %.1f MiB fit in free GPU memory "
                               "(wanted %d); timings may include L2 hits",
                               std::max<int64_t>(2, fit), MiB(bytes_per_copy), copies));
      copies = std::max<int64_t>(2, fit);
    }
  }
  return static_cast<int>(copies);
}

absl::StatusOr<const std::vector<DeviceMatrix>*> ShapeWorkload::Compressed() {
  if (compressed_) return &*compressed_;
  const int device = session_->info().device;
  const int64_t n = shape_.n, k = shape_.k;
  std::vector<DeviceMatrix> copies;
  ASSIGN_OR_RETURN(DeviceMatrix first, DeviceMatrix::FromBf16(weights_.data(), n, k, device));
  const int count = CopiesFor(first.weight_bytes());
  copies.push_back(first);
  if (first.format() == WeightFormat::kZ12) {
    PackOptions pack_options;
    pack_options.threads = options_.threads;
    ASSIGN_OR_RETURN(PackedMatrix packed, Pack(weights_.data(), n, k, pack_options));
    for (int c = 1; c < count; ++c) {
      ASSIGN_OR_RETURN(DeviceMatrix copy, DeviceMatrix::Upload(packed, device));
      copies.push_back(std::move(copy));
    }
  } else {
    for (int c = 1; c < count; ++c) {
      ASSIGN_OR_RETURN(DeviceMatrix copy, DeviceMatrix::UploadPlain(weights_.data(), n, k, device));
      copies.push_back(std::move(copy));
    }
  }
  RETURN_IF_ERROR(UploadsDone());
  compressed_ = std::move(copies);
  return &*compressed_;
}

absl::StatusOr<const std::vector<DeviceMatrix>*> ShapeWorkload::Plain() {
  if (plain_) return &*plain_;
  const int device = session_->info().device;
  const int count = CopiesFor(2 * shape_.n * shape_.k);
  std::vector<DeviceMatrix> copies;
  for (int c = 0; c < count; ++c) {
    ASSIGN_OR_RETURN(DeviceMatrix copy,
                     DeviceMatrix::UploadPlain(weights_.data(), shape_.n, shape_.k, device));
    copies.push_back(std::move(copy));
  }
  RETURN_IF_ERROR(UploadsDone());
  plain_ = std::move(copies);
  return &*plain_;
}

absl::StatusOr<const std::vector<DeviceBuffer>*> ShapeWorkload::Raw() {
  if (raw_) return &*raw_;
  const int64_t bytes = 2 * shape_.n * shape_.k;
  const int count = CopiesFor(bytes);
  std::vector<DeviceBuffer> copies;
  for (int c = 0; c < count; ++c) {
    ASSIGN_OR_RETURN(DeviceBuffer copy, DeviceBuffer::Allocate(bytes));
    CU_RETURN_IF_ERROR(cuMemcpyHtoD(copy.ptr(), weights_.data(), bytes));
    copies.push_back(std::move(copy));
  }
  RETURN_IF_ERROR(UploadsDone());
  raw_ = std::move(copies);
  return &*raw_;
}

absl::StatusOr<const std::vector<DeviceMatrix>*> ShapeWorkload::ForFormat(WeightFormat format) {
  return format == WeightFormat::kZ12 ? Compressed() : Plain();
}

absl::StatusOr<ErrorCheck> ShapeWorkload::RunAndCheck(int64_t m,
                                                      const std::function<absl::Status()>& run,
                                                      std::vector<uint16_t>* result) {
  if (m < 1 || m > reference_.m) {
    return absl::InvalidArgumentError(
        absl::StrCat("m ", m, " is outside the workload's 1..", reference_.m));
  }
  const size_t bytes = static_cast<size_t>(m * shape_.n) * 2;
  // All ones is NaN in BF16: an element the kernel never writes fails the check.
  CU_RETURN_IF_ERROR(cuMemsetD8Async(out_.ptr(), 0xFF, bytes, session_->stream()));
  RETURN_IF_ERROR(run());
  RETURN_IF_ERROR(session_->Synchronize());
  result->resize(m * shape_.n);
  CU_RETURN_IF_ERROR(cuMemcpyDtoH(result->data(), out_.ptr(), bytes));
  return CheckAgainstReference(result->data(), m, reference_);
}

absl::StatusOr<int> ShapeWorkload::CaptureRotated(GraphTimer* timer, int copies,
                                                  const TimingOptions& timing,
                                                  const std::function<absl::Status(int)>& call,
                                                  int* launches) {
  copies = std::max(1, copies);
  const int rounds = std::max(1, (timing.min_launches + copies - 1) / copies);
  *launches = rounds * copies;
  return timer->Capture(*launches, [&](int i) { return call(i % copies); });
}

absl::StatusOr<ShapeWorkload::GemvRun> ShapeWorkload::CheckAndCaptureGemv(
    GraphTimer* timer, const std::vector<DeviceMatrix>& copies, int64_t m,
    const GemvOptions& options, const TimingOptions& timing) {
  GemvRun run;
  const uint16_t* x = x_.bf16();
  uint16_t* out = out_.bf16();
  CUstream stream = session_->stream();
  // The mode is always explicit here, so GEMVZ_PDL cannot change what the report says (--pdl).
  GemvOptions opts = options;
  if (!opts.pdl) opts.pdl = timing.pdl ? Pdl::kAuto : Pdl::kOff;
  auto gemv_on = [&](int c) { return Gemv(copies[c], x, m, out, stream, opts); };
  ASSIGN_OR_RETURN(run.check, RunAndCheck(m, [&] { return gemv_on(0); }, &run.result));
  if (copies.size() > 1 && run.check.ok()) {
    // The last copy came through another upload path (Upload of a Pack): check it too.
    std::vector<uint16_t> last;
    const int c = static_cast<int>(copies.size()) - 1;
    ASSIGN_OR_RETURN(ErrorCheck check, RunAndCheck(m, [&] { return gemv_on(c); }, &last));
    if (!check.ok()) {
      run.check = check;
    } else if (last != run.result) {
      // Same weights, same x: the library promises the same bits, whichever way they came.
      Progress(absl::StrFormat("  copy %d (Upload of a Pack) and copy 0 (FromBf16) gave different "
                               "bits at m=%d", c, m));
      ++run.check.failures;
    }
  }
  ASSIGN_OR_RETURN(run.graph, CaptureRotated(timer, static_cast<int>(copies.size()), timing,
                                             gemv_on, &run.launches));
  return run;
}

// --- Bench -------------------------------------------------------------------------------------

absl::StatusOr<std::vector<BenchCase>> BenchShape(const BenchTools& tools, const MatrixShape& shape,
                                                  const std::vector<int64_t>& ms) {
  const std::string label = ShapeLabel(shape);
  const int64_t n = shape.n, k = shape.k;
  const int64_t max_m = *std::max_element(ms.begin(), ms.end());
  CUstream stream = tools.session->stream();
  Progress(absl::StrFormat("[bench] %s: weights, x and the CPU reference (m up to %d)", label,
                           max_m));
  ASSIGN_OR_RETURN(std::unique_ptr<ShapeWorkload> work,
                   ShapeWorkload::Create(tools.session, shape, max_m, tools.workload));
  Progress(absl::StrFormat("[bench] %s: uploading rotated copies (%.0f MiB per path)", label,
                           MiB(tools.workload.rotate_bytes)));
  ASSIGN_OR_RETURN(const std::vector<DeviceMatrix>* z, work->Compressed());
  ASSIGN_OR_RETURN(const std::vector<DeviceMatrix>* p, work->Plain());
  ASSIGN_OR_RETURN(const std::vector<DeviceBuffer>* raw, work->Raw());

  const int64_t bf16_bytes = 2 * n * k;
  // The streaming bound: the probe over as many bytes as the 12-bit weights take.
  const DeviceMatrix& z0 = (*z)[0];
  const bool packed = z0.format() == WeightFormat::kZ12;
  const int64_t z12_weight_bytes = std::min(z0.weight_bytes(), bf16_bytes);
  const int raw_copies = static_cast<int>(raw->size());

  std::vector<BenchCase> cases;
  for (const int64_t m : ms) {
    BenchCase c;
    c.shape = shape;
    c.m = m;
    ASSIGN_OR_RETURN(GemvPlan plan, PlanGemv(z0, m));
    c.config = plan.config.ToString();
    c.config_source = plan.source;
    c.weight_format = std::string(FormatName(z0.format()));
    c.fallback_reason = z0.fallback_reason();
    ASSIGN_OR_RETURN(GemvPlan plain_plan, PlanGemv((*p)[0], m));
    c.plain_config = plain_plan.config.ToString();
    c.copies_z12 = static_cast<int>(z->size());
    c.copies_bf16 = static_cast<int>(p->size());
    const int64_t io_bytes = ActivationBytes(m, shape);

    // The GEMVs are checked and captured, then all paths are timed together (GraphTimer): z12,
    // plain, cuBLAS, and the probe's forms over the BF16 bytes (the ceiling, on the very buffers
    // cuBLAS reads) and over the 12-bit weights' bytes (the streaming bound), replay by replay in
    // turn.
    Progress(absl::StrFormat("[bench] %s m=%d: checking z12 (%s, %s), plain BF16 (%s), cuBLAS",
                             label, m, c.config, c.config_source, c.plain_config));
    GraphTimer timer(stream);
    ASSIGN_OR_RETURN(ShapeWorkload::GemvRun zr,
                     work->CheckAndCaptureGemv(&timer, *z, m, {}, tools.timing));
    ASSIGN_OR_RETURN(ShapeWorkload::GemvRun pr,
                     work->CheckAndCaptureGemv(&timer, *p, m, {}, tools.timing));
    auto blas_on = [&](int copy) {
      return tools.cublas->GemmBf16((*raw)[copy].ptr(), work->x(), work->out(), m, n, k);
    };
    std::vector<uint16_t> blas_result;
    ASSIGN_OR_RETURN(ErrorCheck blas_check, work->RunAndCheck(
                                                m, [&] { return blas_on(0); }, &blas_result));

    Progress(absl::StrFormat("[bench] %s m=%d: timing the paths in turn", label, m));
    int launches = 0;  // the probes' and cuBLAS's: whole rotations of the raw copies
    ASSIGN_OR_RETURN(const int blas_graph,
                     work->CaptureRotated(&timer, raw_copies, tools.timing, blas_on, &launches));
    // Each probe form over the BF16 bytes and (packed) over the 12-bit weights' bytes.
    const int forms = tools.probe->kernel_count();
    std::vector<int> probe_graphs, bound_graphs;
    for (int form = 0; form < forms; ++form) {
      for (const bool bound : {false, true}) {
        if (bound && !packed) continue;
        const int64_t bytes = bound ? z12_weight_bytes : bf16_bytes;
        auto read = [&, form, bytes](int copy) {
          return tools.probe->Launch(form, (*raw)[copy].ptr(), bytes, stream);
        };
        ASSIGN_OR_RETURN(const int graph,
                         work->CaptureRotated(&timer, raw_copies, tools.timing, read, &launches));
        (bound ? bound_graphs : probe_graphs).push_back(graph);
      }
    }
    ASSIGN_OR_RETURN(const std::vector<double> us, timer.MedianMicros(tools.timing));
    // The fastest form, and its name.
    auto fastest = [&](const std::vector<int>& graphs, int64_t bytes) {
      std::vector<double> times;
      for (const int graph : graphs) times.push_back(us[graph]);
      const int best = FastestForm(times);
      return TimedPath{times[best], BandwidthProbe::BytesRead(bytes), -1, false,
                       tools.probe->kernel_name(best)};
    };

    c.z12 = {us[zr.graph], z0.weight_bytes() + io_bytes, zr.check.max_ratio, zr.check.ok()};
    c.launches_z12 = zr.launches;
    c.plain = {us[pr.graph], (*p)[0].weight_bytes() + io_bytes, pr.check.max_ratio, pr.check.ok()};
    c.launches_bf16 = pr.launches;
    c.cublas = {us[blas_graph], bf16_bytes + io_bytes, blas_check.max_ratio, blas_check.ok()};
    c.probe = fastest(probe_graphs, bf16_bytes);
    if (packed) c.probe_z12 = fastest(bound_graphs, z12_weight_bytes);

    const ErrorCheck z_vs_blas = CheckPair(zr.result.data(), blas_result.data(), m, work->reference());
    const ErrorCheck p_vs_blas = CheckPair(pr.result.data(), blas_result.data(), m, work->reference());
    const ErrorCheck z_vs_p = CheckPair(zr.result.data(), pr.result.data(), m, work->reference());
    c.pair_check_ok = z_vs_blas.ok() && p_vs_blas.ok() && z_vs_p.ok();

    for (const auto& [what, check] :
         {std::pair<const char*, const ErrorCheck*>{"z12 vs reference", &zr.check},
          {"plain vs reference", &pr.check},
          {"cuBLAS vs reference", &blas_check},
          {"z12 vs cuBLAS", &z_vs_blas},
          {"plain vs cuBLAS", &p_vs_blas},
          {"z12 vs plain", &z_vs_p}}) {
      if (!check->ok()) {
        Progress(absl::StrFormat("[bench] %s m=%d: %s: %s", label, m, what, check->ToString()));
      }
    }
    cases.push_back(std::move(c));
  }
  return cases;
}

absl::StatusOr<std::vector<SequenceCase>> BenchSequence(const BenchTools& tools,
                                                        const std::vector<MatrixShape>& shapes,
                                                        const std::vector<int64_t>& ms) {
  const int64_t max_m = *std::max_element(ms.begin(), ms.end());
  const int count = static_cast<int>(shapes.size());
  CUstream stream = tools.session->stream();
  std::vector<std::unique_ptr<ShapeWorkload>> works;
  std::vector<const std::vector<DeviceMatrix>*> z, p;
  std::vector<const std::vector<DeviceBuffer>*> raw;
  for (const MatrixShape& shape : shapes) {
    Progress(absl::StrFormat("[sequence] %s: weights, x, reference and rotated copies",
                             ShapeLabel(shape)));
    ASSIGN_OR_RETURN(std::unique_ptr<ShapeWorkload> work,
                     ShapeWorkload::Create(tools.session, shape, max_m, tools.workload));
    ASSIGN_OR_RETURN(const std::vector<DeviceMatrix>* zc, work->Compressed());
    ASSIGN_OR_RETURN(const std::vector<DeviceMatrix>* pc, work->Plain());
    ASSIGN_OR_RETURN(const std::vector<DeviceBuffer>* rc, work->Raw());
    z.push_back(zc);
    p.push_back(pc);
    raw.push_back(rc);
    works.push_back(std::move(work));
  }
  auto x_of = [&](int i) { return reinterpret_cast<const uint16_t*>(works[i]->x()); };
  auto out_of = [&](int i) { return reinterpret_cast<uint16_t*>(works[i]->out()); };

  std::vector<SequenceCase> cases;
  for (const int64_t m : ms) {
    SequenceCase c;
    c.m = m;
    c.ok = true;
    GemvOptions plain_launch, pdl_launch;
    plain_launch.pdl = Pdl::kOff;
    pdl_launch.pdl = Pdl::kAuto;
    // Path p of GEMV i on copy `copy`: 0/1 z12 plain/PDL, 2/3 plain BF16 plain/PDL, 4 cuBLAS.
    auto call = [&](int path, int i, int copy) -> absl::Status {
      const GemvOptions& o = (path == 1 || path == 3) ? pdl_launch : plain_launch;
      if (path <= 1) return Gemv((*z[i])[copy], x_of(i), m, out_of(i), stream, o);
      if (path <= 3) return Gemv((*p[i])[copy], x_of(i), m, out_of(i), stream, o);
      const MatrixShape& s = shapes[i];
      return tools.cublas->GemmBf16((*raw[i])[copy].ptr(), works[i]->x(), works[i]->out(), m,
                                    s.n, s.k);
    };
    auto copies = [&](int path, int i) {
      return static_cast<int>(path <= 1 ? z[i]->size() : path <= 3 ? p[i]->size() : raw[i]->size());
    };
    for (int path = 0; path < 5; ++path) {
      for (int i = 0; i < count; ++i) {
        std::vector<uint16_t> result;
        ASSIGN_OR_RETURN(ErrorCheck check,
                         works[i]->RunAndCheck(m, [&] { return call(path, i, 0); }, &result));
        if (!check.ok()) {
          c.ok = false;
          Progress(absl::StrFormat("[sequence] %s m=%d path %d: %s", ShapeLabel(shapes[i]), m,
                                   path, check.ToString()));
        }
      }
    }
    // Whole rotations: a multiple of every GEMV's copy count (all paths), so that a replay
    // starts on the copies the previous one used longest ago, as `gemvz bench` does. Past
    // kMaxRotationPasses the copies' least common multiple is not worth the graph's size: one
    // pass over such a sequence already reads many copies' worth of weights between reuses.
    constexpr int64_t kMaxRotationPasses = 256;
    int64_t rotation = 1;  // stops growing once past the cap, so it cannot overflow
    for (int path = 0; path < 5 && rotation <= kMaxRotationPasses; ++path) {
      for (int i = 0; i < count && rotation <= kMaxRotationPasses; ++i) {
        rotation = std::lcm(rotation, int64_t{copies(path, i)});
      }
    }
    int passes = std::max(1, (tools.timing.min_launches + count - 1) / count);
    if (rotation <= kMaxRotationPasses) {
      passes = static_cast<int>((passes + rotation - 1) / rotation * rotation);
    } else {
      Progress(absl::StrFormat("[sequence] m=%d: %d passes, not whole rotations (the copies' "
                               "least common multiple exceeds %d)",
                               m, passes, kMaxRotationPasses));
    }
    c.launches = passes * count;
    double* times[5] = {&c.z12_us, &c.z12_pdl_us, &c.plain_us, &c.plain_pdl_us, &c.cublas_us};
    const char* names[5] = {"z12", "z12 PDL", "plain", "plain PDL", "cuBLAS"};
    // The five paths timed together, replay by replay in turn (GraphTimer).
    GraphTimer timer(stream);
    for (int path = 0; path < 5; ++path) {
      Progress(absl::StrFormat("[sequence] m=%d: capturing %s", m, names[path]));
      RETURN_IF_ERROR(timer
                          .Capture(c.launches,
                                   [&](int l) {
                                     const int i = l % count;
                                     return call(path, i, (l / count) % copies(path, i));
                                   })
                          .status());
    }
    Progress(absl::StrFormat("[sequence] m=%d: timing the paths in turn", m));
    ASSIGN_OR_RETURN(const std::vector<double> per_launch, timer.MedianMicros(tools.timing));
    for (int path = 0; path < 5; ++path) {
      *times[path] = per_launch[path] * count;  // one pass over the sequence
    }
    cases.push_back(c);
  }
  return cases;
}

BenchEnvironment DescribeEnvironment(const BenchTools& tools, const std::string& commit) {
  BenchEnvironment e;
  const GpuInfo& info = tools.session->info();
  e.gpu_name = info.name;
  e.arch = info.arch;
  e.sm_count = info.limits.sm_count;
  e.memory_bytes = info.memory_bytes;
  e.driver_version = NvidiaDriverVersion();
  e.cuda_driver_api = info.cuda_driver_api;
  if (tools.cublas != nullptr) {
    e.cublas_library = tools.cublas->library();
    e.cublas_version = tools.cublas->version();
  }
  e.date = UtcTimestamp();
  e.commit = commit;
  e.replays = tools.timing.replays;
  e.pdl = tools.timing.pdl;
  e.rotate_bytes = tools.workload.rotate_bytes;
  e.seed = tools.workload.seed;
  return e;
}

absl::StatusOr<std::unique_ptr<BenchStack>> OpenBenchStack(int device, const TimingOptions& timing,
                                                           const WorkloadOptions& workload) {
  auto stack = std::make_unique<BenchStack>();
  ASSIGN_OR_RETURN(stack->session, GpuSession::Open(device));
  ASSIGN_OR_RETURN(stack->cublas, Cublas::Open(stack->session->stream()));
  ASSIGN_OR_RETURN(BandwidthProbe probe, BandwidthProbe::Load(*stack->session));
  stack->probe = std::move(probe);
  stack->tools.session = stack->session.get();
  stack->tools.cublas = stack->cublas.get();
  stack->tools.probe = &*stack->probe;
  stack->tools.timing = timing;
  stack->tools.workload = workload;
  return stack;
}

}  // namespace gemvz::cli
