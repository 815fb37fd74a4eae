// The launch path: plan (forced, env, tuned, heuristic or autotuned configuration), fetch the
// JIT-compiled kernel, take this stream's workspace, launch one kernel per chunk of m.
#include "gemvz/gemv.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernel_sources/gemv_params.cuh"
#include "runtime/common/env.h"
#include "runtime/common/log.h"
#include "runtime/common/per_thread_cache.h"
#include "runtime/common/status_macros.h"
#include "runtime/cuda/driver.h"
#include "runtime/dispatch/dispatcher.h"
#include "runtime/gemv/autotune.h"
#include "runtime/gemv/device_state.h"
#include "runtime/jit/kernel_cache.h"

namespace gemvz {
namespace internal {
namespace {

struct RetiredBuffer {
  CUdeviceptr ptr;
  size_t bytes;
};

// Split-K partials, semaphores and the padded-x buffer of one stream. Calls on one stream run in
// order, so one workspace per stream is enough; distinct streams never share one. Each has its own
// lock, held from growth through the launches that use it (two threads may call on one stream);
// calls on other streams never wait for it, not even while a launch into a full queue blocks.
struct Workspace {
  absl::Mutex mu;
  // Set, under mu, by ReleaseStreamWorkspace after it took the workspace out of the map: a call
  // that fetched it before then fetches the stream's new one.
  bool released = false;
  CUdeviceptr ws = 0;
  size_t ws_bytes = 0;
  CUdeviceptr sem = 0;  // zero between calls: the last CTA of a row block resets its counter
  size_t sem_bytes = 0;
  CUdeviceptr xpad = 0;
  size_t xpad_bytes = 0;
  // Outgrown buffers, never freed: a CUDA graph captured before a growth still launches kernels
  // that use them (freeing them made such replays read and write freed memory). Each growth at
  // least doubles a buffer, so together they stay smaller than the buffers in use.
  std::vector<RetiredBuffer> retired;
};

// A number for the calling thread, never reused in the process (std::thread::id is: a thread
// started after another ended may get its id, and would inherit its per-thread stream's
// workspace while that stream may still run).
uint64_t ThreadSerial() {
  static std::atomic<uint64_t> next{1};
  thread_local const uint64_t serial = next.fetch_add(1, std::memory_order_relaxed);
  return serial;
}

// (context, stream handle, thread): CU_STREAM_PER_THREAD (cudaStreamPerThread) is one handle
// for a distinct stream in every thread, whose work runs concurrently, so its workspaces are the
// calling thread's; every other handle is one stream, whichever thread calls (thread 0), and
// CU_STREAM_LEGACY is nullptr's stream, the legacy default one.
using WorkspaceKey = std::tuple<CUcontext, CUstream, uint64_t>;
WorkspaceKey KeyFor(CUcontext ctx, CUstream stream) {
  if (stream == CU_STREAM_LEGACY) stream = nullptr;
  return {ctx, stream, stream == CU_STREAM_PER_THREAD ? ThreadSerial() : 0};
}

// Guards the map only, never a workspace's use; never held while taking a Workspace::mu.
absl::Mutex workspaces_mu(absl::kConstInit);
absl::flat_hash_map<WorkspaceKey, std::shared_ptr<Workspace>>& Workspaces() {
  static auto* m = new absl::flat_hash_map<WorkspaceKey, std::shared_ptr<Workspace>>();
  return *m;
}

// The stream's workspace, or null when it has none.
std::shared_ptr<Workspace> FindWorkspace(CUcontext ctx, CUstream stream) {
  absl::ReaderMutexLock lock(&workspaces_mu);
  auto& map = Workspaces();
  auto it = map.find(KeyFor(ctx, stream));
  return it == map.end() ? nullptr : it->second;
}

// Whether `stream` is being captured into a CUDA graph, asked of the driver at the first Get and
// only then: a call on a stream of its own that neither autotunes nor grows its workspace asks
// nothing (under many threads each driver call is a turn at the driver's lock; a launch is one
// already). The legacy default stream is always asked (LaunchPlannedEntered).
class CaptureQuery {
 public:
  explicit CaptureQuery(CUstream stream) : stream_(stream) {}
  absl::StatusOr<bool> Get() {
    if (!known_) {
      ASSIGN_OR_RETURN(const DriverApi* driver, Driver());
      CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
      const CUresult r = driver->cuStreamIsCapturing(stream_, &status);
      if (r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) {
        return absl::FailedPreconditionError(
            "the legacy default stream takes no work while a blocking stream of its context is "
            "being captured (CUDA would make the work wait for that capture, an implicit "
            "dependency), so nothing was enqueued; use a stream made with "
            "CU_STREAM_NON_BLOCKING, or call after the capture ends");
      }
      if (r != CUDA_SUCCESS) return CuResultToStatus(r, "cuStreamIsCapturing", __FILE__, __LINE__);
      capturing_ = status != CU_STREAM_CAPTURE_STATUS_NONE;
      known_ = true;
    }
    return capturing_;
  }

 private:
  CUstream stream_;
  bool known_ = false;
  bool capturing_ = false;
};

// Grows `buf` to at least `bytes` (at least doubling it), retiring the old buffer into
// `retired` rather than freeing it. Growth during graph capture is refused: an allocation there
// would not be replayed. `zero` clears new memory (semaphores must start at zero) on `stream`,
// ahead of the kernel that will use it (a plain cuMemsetD8 goes to the legacy default stream,
// which a non-blocking stream does not wait for). On failure `buf` is unchanged.
absl::Status Ensure(CUdeviceptr& buf, size_t& have, size_t bytes, bool zero, CaptureQuery& capture,
                    CUstream stream, std::vector<RetiredBuffer>* retired) {
  if (have >= bytes) return absl::OkStatus();
  ASSIGN_OR_RETURN(const bool captured, capture.Get());
  if (captured) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Gemv needs a larger workspace (", bytes, " bytes) while the stream is being captured; "
        "run the same call once on this stream before capturing it"));
  }
  const size_t alloc = std::max({bytes, 2 * have, size_t{4096}});
  const RelaxedCaptureMode relaxed;  // a first call beside another thread's capture
  CUdeviceptr fresh = 0;
  CU_RETURN_IF_ERROR(cuMemAlloc(&fresh, alloc));
  if (zero) {
    const absl::Status st = [&]() -> absl::Status {
      CU_RETURN_IF_ERROR(cuMemsetD8Async(fresh, 0, alloc, stream));
      return absl::OkStatus();
    }();
    if (!st.ok()) {
      (*Driver())->cuMemFree(fresh);  // nothing was enqueued; Driver() worked for the allocation
      return st;
    }
  }
  if (buf != 0) retired->push_back(RetiredBuffer{buf, have});
  buf = fresh;
  have = alloc;
  return absl::OkStatus();
}

// Each thread's copies of the map's answers, so that a call finds its stream's workspace with no
// lock; invalidated by every release.
PerThreadCache<WorkspaceKey, std::shared_ptr<Workspace>>& WorkspaceFront() {
  static auto* front = new PerThreadCache<WorkspaceKey, std::shared_ptr<Workspace>>();
  return *front;
}

// The stream's workspace in the map, made on its first call.
std::shared_ptr<Workspace> MapWorkspace(CUcontext ctx, CUstream stream) {
  if (std::shared_ptr<Workspace> found = FindWorkspace(ctx, stream)) return found;
  absl::MutexLock lock(&workspaces_mu);
  std::shared_ptr<Workspace>& w = Workspaces()[KeyFor(ctx, stream)];
  if (w == nullptr) w = std::make_shared<Workspace>();
  return w;
}

// The same from this thread's copy: one released since this thread last asked may be returned (a
// release's invalidation can race a lookup), which LockedWorkspace checks, asking the map then.
std::shared_ptr<Workspace> GetWorkspace(CUcontext ctx, CUstream stream) {
  return WorkspaceFront().FindOrAsk(KeyFor(ctx, stream), [&] { return MapWorkspace(ctx, stream); });
}

// The stream's workspace, locked for as long as this lives. One released between the fetch and
// the lock is no longer the stream's: the stream's new one is fetched.
class LockedWorkspace {
 public:
  LockedWorkspace(CUcontext ctx, CUstream stream) {
    for (bool retry = false;; retry = true) {
      w_ = retry ? MapWorkspace(ctx, stream) : GetWorkspace(ctx, stream);
      w_->mu.Lock();
      if (!w_->released) return;
      w_->mu.Unlock();
    }
  }
  ~LockedWorkspace() { w_->mu.Unlock(); }
  LockedWorkspace(const LockedWorkspace&) = delete;
  LockedWorkspace& operator=(const LockedWorkspace&) = delete;
  Workspace* get() const { return w_.get(); }

 private:
  std::shared_ptr<Workspace> w_;
};

// Pdl::kAuto: PDL only for grids that fill at least this many tenths of the resident CTA slots.
constexpr int64_t kPdlMinFillTenths = 9;

// A 12-bit kernel reads its weights in one order (KernelConfig::order); the matrix holds them in
// one (DeviceMatrix::order).
absl::Status CheckOrder(const KernelConfig& c, const DeviceMatrixState& s, const char* source) {
  if (s.format != WeightFormat::kZ12 || c.order == s.order) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "configuration ", c.ToString(), " (", source, ") reads ", std::string(OrderName(c.order)),
      "-major weights, but the matrix was uploaded ", std::string(OrderName(s.order)),
      "-major: use ", InOrder(c, s.order).ToString(), ", or upload the matrix in the other order ",
      "(UploadOptions::order, GEMVZ_WEIGHT_ORDER)"));
}

int64_t Rows16(const DeviceMatrixState& s) { return (s.rows + 15) / 16 * 16; }
int64_t Cols64(const DeviceMatrixState& s) { return (s.cols + 63) / 64 * 64; }
// The plain path with K not a multiple of 64 copies x into a zero-padded [m, K64] buffer; every
// other path reads the caller's x in place, 16 bytes at a time.
bool CopiesX(const DeviceMatrixState& s) {
  return s.format == WeightFormat::kBf16 && Cols64(s) != s.cols;
}

}  // namespace
}  // namespace internal

namespace internal {

int64_t StreamWorkspaceBytes(CUcontext ctx, CUstream stream) {
  const std::shared_ptr<Workspace> found = FindWorkspace(ctx, stream);
  if (found == nullptr) return 0;
  absl::MutexLock lock(&found->mu);
  const Workspace& w = *found;
  int64_t bytes = static_cast<int64_t>(w.ws_bytes + w.sem_bytes + w.xpad_bytes);
  for (const RetiredBuffer& r : w.retired) bytes += static_cast<int64_t>(r.bytes);
  return bytes;
}

std::vector<CUdeviceptr> StreamWorkspaceBuffers(CUcontext ctx, CUstream stream) {
  std::vector<CUdeviceptr> buffers;
  const std::shared_ptr<Workspace> found = FindWorkspace(ctx, stream);
  if (found == nullptr) return buffers;
  absl::MutexLock lock(&found->mu);
  const Workspace& w = *found;
  for (const RetiredBuffer& r : w.retired) buffers.push_back(r.ptr);
  for (CUdeviceptr p : {w.ws, w.sem, w.xpad}) {
    if (p != 0) buffers.push_back(p);
  }
  return buffers;
}

absl::Status ReleaseStreamWorkspace(CUcontext ctx, CUstream stream) {
  std::shared_ptr<Workspace> w;
  {
    absl::MutexLock lock(&workspaces_mu);
    auto& map = Workspaces();
    auto it = map.find(KeyFor(ctx, stream));
    if (it != map.end()) {
      w = std::move(it->second);
      map.erase(it);
    }
  }
  if (w == nullptr) {
    const RelaxedCaptureMode relaxed;
    CU_RETURN_IF_ERROR(cuStreamSynchronize(stream));  // the same wait, with nothing to free
    return absl::OkStatus();
  }
  // Threads drop their copies, which would keep finding this one (after the erase:
  // per_thread_cache.h); a call that found it before sees `released` below.
  WorkspaceFront().Invalidate();
  // After the launches of a call that holds the lock; a call waiting for it fetches the stream's
  // new workspace. Then the stream's queued and running kernels, that call's included, finish
  // before their buffers go. Relaxed: the sync and the frees touch no stream that another thread
  // may be capturing. A failed sync leaves the buffers allocated (the context is broken).
  absl::MutexLock lock(&w->mu);
  w->released = true;
  const RelaxedCaptureMode relaxed;
  CU_RETURN_IF_ERROR(cuStreamSynchronize(stream));
  auto driver = Driver();
  if (driver.ok()) {
    for (const RetiredBuffer& r : w->retired) (*driver)->cuMemFree(r.ptr);
    for (CUdeviceptr p : {w->ws, w->sem, w->xpad}) {
      if (p != 0) (*driver)->cuMemFree(p);
    }
  }
  w->retired.clear();
  w->ws = w->sem = w->xpad = 0;
  w->ws_bytes = w->sem_bytes = w->xpad_bytes = 0;
  return absl::OkStatus();
}

absl::StatusOr<GemvPlan> PlanGemvInternal(const DeviceMatrix& w, int64_t m,
                                          const GemvOptions& options, bool allow_autotune) {
  if (!w.valid()) return absl::InvalidArgumentError("Gemv: the DeviceMatrix is empty");
  if (m < 1) return absl::InvalidArgumentError(absl::StrCat("Gemv: m must be >= 1 (got ", m, ")"));
  const DeviceMatrixState& s = *w.state();
  ASSIGN_OR_RETURN(DeviceInfo info, GetDeviceInfo(s.device));
  const int64_t m_launch = LaunchRowsFor(m);
  const GemvShape shape{m_launch, Rows16(s), Cols64(s)};

  auto forced = [&](const KernelConfig& c, const char* source) -> absl::StatusOr<GemvPlan> {
    if (c.format != s.format) {
      return absl::InvalidArgumentError(absl::StrCat(
          "configuration ", c.ToString(), " (", source, ") is for ",
          std::string(FormatName(c.format)), " weights, but the matrix is ",
          std::string(FormatName(s.format))));
    }
    RETURN_IF_ERROR(CheckOrder(c, s, source));
    const GemvShape launch = LaunchShape(shape, c);
    RETURN_IF_ERROR(Validate(c, launch, info.limits));
    return GemvPlan{c, source, launch.m};
  };
  if (options.config) return forced(*options.config, "forced");
  if (auto env = GetEnv("GEMVZ_FORCE_CONFIG")) {
    auto c = KernelConfig::Parse(*env);
    if (!c.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("GEMVZ_FORCE_CONFIG: ", c.status().message()));
    }
    // A forced configuration of the other format does not apply to this matrix; a 12-bit one
    // runs in this matrix's order (a process-wide setting meets matrices of both orders; an
    // API-forced configuration is one call's, and must match).
    if (c->format == s.format) return forced(InOrder(*c, s.order), "env");
  }
  ASSIGN_OR_RETURN(GemvPlan plan, ChooseConfig(shape, s.format, info.arch, info.limits.sm_count,
                                               s.order, info.name));
  if (plan.source == "heuristic" && AutotuneEnabled()) {
    if (allow_autotune) return Autotune(w, shape, info, plan);
    // During a capture: what an earlier call tuned, even where no tuning file kept it.
    if (std::optional<GemvPlan> tuned = AutotunedBefore(w, shape, info)) return *tuned;
  }
  return plan;
}

absl::StatusOr<Pdl> PdlFromEnv(const std::optional<std::string>& value) {
  if (!value || value->empty() || *value == "0") return Pdl::kOff;
  if (*value == "1" || *value == "auto") return Pdl::kAuto;
  if (*value == "always") return Pdl::kAlways;
  return absl::InvalidArgumentError(
      absl::StrCat("GEMVZ_PDL must be 0, 1 (or auto) or always, not '", *value, "'"));
}

namespace {

// LaunchPlanned inside the matrix's device's context, entered by the caller, with the caller's
// query of whether `stream` is being captured: Gemv enters and asks once for its checks and its
// launch.
absl::Status LaunchPlannedEntered(const DeviceMatrix& w, const KernelConfig& config,
                                  int64_t chunk_m, const uint16_t* x, int64_t m, void* out,
                                  bool fp32_out, CUstream stream, Pdl pdl_mode,
                                  const ScopedDeviceContext& scope, CaptureQuery& capture) {
  const DeviceMatrixState& s = *w.state();
  RETURN_IF_ERROR(CheckOrder(config, s, "launch"));
  // The legacy default stream is asked before anything is enqueued: while a blocking stream of
  // the context is being captured, work sent to it would invalidate that capture, where the query
  // only fails (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT).
  if (stream == nullptr || stream == CU_STREAM_LEGACY) RETURN_IF_ERROR(capture.Get().status());
  ASSIGN_OR_RETURN(const KernelFunction kernel, GetKernelFunction(s.device, config));
  const int64_t row_blocks = Rows16(s) / 16;
  // One CTA per RB row blocks; z12 adds one CTA per dense row, before them. The split-K partials
  // and counters below are per CTA: N/(16*RB) counters of RB*NB*32 float4 each, so their sizes
  // depend on N, S and NB only.
  const int64_t grid_x = row_blocks / config.rb + (s.format == WeightFormat::kZ12 ? s.n_dense : 0);
  bool pdl = false;
  if (pdl_mode != Pdl::kOff) {
    // griddepcontrol needs sm_90, the launch a CUDA 12 driver (cuLaunchKernelEx). kAuto: a grid
    // that leaves many CTA slots idle launches plainly: there the next kernel's early CTAs crowd
    // onto the idle slots, and the SMs that take most of them finish last (on the H200,
    // 8192x28672 at m = 8 ran 11 % slower with PDL, its 512 CTAs filling 65 % of the slots;
    // grids that fill 97 % of them gained up to 10 %).
    ASSIGN_OR_RETURN(DeviceInfo info, GetDeviceInfo(s.device));
    const int64_t slots = static_cast<int64_t>(kernel.blocks_per_sm) * info.limits.sm_count;
    ASSIGN_OR_RETURN(const DriverApi* driver, Driver());
    pdl = info.limits.cc_major >= 9 && driver->cuLaunchKernelEx != nullptr &&
          (pdl_mode == Pdl::kAlways || grid_x * config.splits * 10 >= slots * kPdlMinFillTenths);
  }

  const int64_t k64 = Cols64(s);
  const LockedWorkspace locked(scope.context(), stream);  // growth and use, in order
  Workspace* const ws = locked.get();
  if (config.splits > 1) {
    const size_t ws_bytes =
        static_cast<size_t>(row_blocks) * config.splits * config.nb * 32 * 16;
    RETURN_IF_ERROR(Ensure(ws->ws, ws->ws_bytes, ws_bytes, false, capture, stream, &ws->retired));
    RETURN_IF_ERROR(Ensure(ws->sem, ws->sem_bytes, static_cast<size_t>(row_blocks) * 4, true,
                           capture, stream, &ws->retired));
  }
  // Plain BF16 with K not a multiple of 64: x is copied into a zero-padded [m, K64] buffer.
  const uint16_t* xk = x;
  int64_t ldx = s.cols;
  if (CopiesX(s)) {
    RETURN_IF_ERROR(Ensure(ws->xpad, ws->xpad_bytes, static_cast<size_t>(m * k64 * 2), false,
                           capture, stream, &ws->retired));
    CU_RETURN_IF_ERROR(cuMemsetD8Async(ws->xpad, 0, static_cast<size_t>(m * k64 * 2), stream));
    CUDA_MEMCPY2D c;
    std::memset(&c, 0, sizeof(c));
    c.srcMemoryType = CU_MEMORYTYPE_DEVICE;
    c.srcDevice = reinterpret_cast<CUdeviceptr>(x);
    c.srcPitch = static_cast<size_t>(s.cols) * 2;
    c.dstMemoryType = CU_MEMORYTYPE_DEVICE;
    c.dstDevice = ws->xpad;
    c.dstPitch = static_cast<size_t>(k64) * 2;
    c.WidthInBytes = static_cast<size_t>(s.cols) * 2;
    c.Height = static_cast<size_t>(m);
    CU_RETURN_IF_ERROR(cuMemcpy2DAsync(&c, stream));
    xk = reinterpret_cast<const uint16_t*>(ws->xpad);
    ldx = k64;
  }

  for (int64_t c0 = 0; c0 < m; c0 += chunk_m) {
    const int mc = static_cast<int>(std::min<int64_t>(chunk_m, m - c0));
    Z12Params zp;
    Bf16Params bp;
    void* args[1];
    if (s.format == WeightFormat::kZ12) {
      zp = Z12MatrixParams(s);
      zp.x = xk + c0 * ldx;
      zp.out = static_cast<char*>(out) + c0 * s.rows * (fp32_out ? 4 : 2);
      zp.ws = reinterpret_cast<void*>(ws->ws);
      zp.sem = reinterpret_cast<int*>(ws->sem);
      zp.ldx = ldx;
      zp.ldo = s.rows;
      zp.M = mc;
      zp.S = config.splits;
      zp.flags = (fp32_out ? 2 : 0) | (pdl ? 4 : 0);
      args[0] = &zp;
    } else {
      bp.x = xk + c0 * ldx;
      bp.w = reinterpret_cast<const unsigned short*>(s.plain);
      bp.out = static_cast<char*>(out) + c0 * s.rows * (fp32_out ? 4 : 2);
      bp.ws = reinterpret_cast<void*>(ws->ws);
      bp.sem = reinterpret_cast<int*>(ws->sem);
      bp.ldx = ldx;
      bp.ldo = s.rows;
      bp.ldw = s.ldw;
      bp.M = mc;
      bp.N = static_cast<int>(s.rows);
      bp.K = static_cast<int>(k64);
      bp.S = config.splits;
      bp.flags = (fp32_out ? 2 : 0) | (pdl ? 4 : 0);
      args[0] = &bp;
    }
    if (pdl) {
      CUlaunchAttribute attr;
      std::memset(&attr, 0, sizeof(attr));
      attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
      attr.value.programmaticStreamSerializationAllowed = 1;
      CUlaunchConfig lc;
      std::memset(&lc, 0, sizeof(lc));
      lc.gridDimX = static_cast<unsigned>(grid_x);
      lc.gridDimY = static_cast<unsigned>(config.splits);
      lc.gridDimZ = 1;
      lc.blockDimX = static_cast<unsigned>(config.threads());
      lc.blockDimY = 1;
      lc.blockDimZ = 1;
      lc.hStream = stream;
      lc.attrs = &attr;
      lc.numAttrs = 1;
      CU_RETURN_IF_ERROR(cuLaunchKernelEx(&lc, kernel.function, args, nullptr));
    } else {
      CU_RETURN_IF_ERROR(cuLaunchKernel(kernel.function, static_cast<unsigned>(grid_x),
                                        static_cast<unsigned>(config.splits), 1,
                                        static_cast<unsigned>(config.threads()), 1, 1, 0, stream,
                                        args, nullptr));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchPlanned(const DeviceMatrix& w, const KernelConfig& config, int64_t chunk_m,
                           const uint16_t* x, int64_t m, void* out, bool fp32_out, CUstream stream,
                           Pdl pdl_mode) {
  ASSIGN_OR_RETURN(auto scope, ScopedDeviceContext::Enter(w.state()->device));
  CaptureQuery capture(stream);
  return LaunchPlannedEntered(w, config, chunk_m, x, m, out, fp32_out, stream, pdl_mode, scope,
                              capture);
}

Z12Params Z12MatrixParams(const DeviceMatrixState& s) {
  Z12Params p{};
  p.w = reinterpret_cast<const void*>(s.weights);
  p.row_offsets = reinterpret_cast<const unsigned*>(s.row_offsets);
  p.entries = reinterpret_cast<const void*>(s.entries);
  p.dense_block_offsets = reinterpret_cast<const unsigned*>(s.dense_block_offsets);
  p.dense_rows = reinterpret_cast<const unsigned char*>(s.dense_rows);
  p.dense_values = reinterpret_cast<const unsigned short*>(s.dense_values);
  p.dense_global_rows = reinterpret_cast<const int*>(s.dense_global_rows);
  p.n_dense = static_cast<int>(s.n_dense);
  p.N = static_cast<int>(s.rows);
  p.K = static_cast<int>(s.cols);
  p.tl = s.tl;
  p.th = s.th;
  return p;
}

}  // namespace internal

namespace {

// Whether `stream` belongs to `ctx` (the legacy default stream, nullptr, to every context).
absl::StatusOr<bool> StreamOnContext(CUstream stream, CUcontext ctx) {
  if (stream == nullptr) return true;
  CUcontext stream_ctx = nullptr;
  CU_RETURN_IF_ERROR(cuStreamGetCtx(stream, &stream_ctx));
  return stream_ctx == ctx;
}

// Enters `device`'s context for a call about `stream`'s workspace (`what` names the call).
absl::StatusOr<internal::ScopedDeviceContext> EnterForStream(CUstream stream, int device,
                                                             const char* what) {
  ASSIGN_OR_RETURN(auto scope, internal::ScopedDeviceContext::Enter(device));
  ASSIGN_OR_RETURN(const bool same, StreamOnContext(stream, scope.context()));
  if (!same) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the stream belongs to another context than device ", device,
                     "'s primary one (another device's, or a context of its own); pass the device "
                     "whose matrices the stream's GEMVs used"));
  }
  return scope;
}

absl::Status GemvAny(const DeviceMatrix& w, const uint16_t* x, int64_t m, void* out, bool fp32_out,
                     CUstream_st* stream, const GemvOptions& options) {
  if (x == nullptr || out == nullptr) {
    return absl::InvalidArgumentError("Gemv: x and out must be device pointers, not null");
  }
  if (!w.valid()) return absl::InvalidArgumentError("Gemv: the DeviceMatrix is empty");
  // A misaligned pointer would fault inside the kernel, and the fault would spoil the context for
  // every later call: refuse it here. The kernels load x 16 bytes at a time (where they read it
  // in place) and store out element by element.
  const uintptr_t x_at = reinterpret_cast<uintptr_t>(x);
  const bool x_read_in_place = !internal::CopiesX(*w.state());
  const uintptr_t x_align = x_read_in_place ? 16 : 2;
  if (x_at % x_align != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gemv: x (at 0x", absl::Hex(x_at), ") must be ", x_align, "-byte aligned",
                     x_read_in_place ? " (the kernels load it 16 bytes at a time)" : ""));
  }
  const uintptr_t out_at = reinterpret_cast<uintptr_t>(out);
  const uintptr_t out_align = fp32_out ? 4 : 2;
  if (out_at % out_align != 0) {
    return absl::InvalidArgumentError(absl::StrCat("Gemv: out (at 0x", absl::Hex(out_at),
                                                   ") must be ", out_align, "-byte aligned"));
  }
  // The context stays entered from the checks through the launch: one entry a call (a driver
  // call, and threads calling at once meet in the driver).
  ASSIGN_OR_RETURN(auto scope, internal::ScopedDeviceContext::Enter(w.device()));
  // A DeviceMatrix belongs to one device: a stream of another device's context is refused.
  ASSIGN_OR_RETURN(const bool same, StreamOnContext(stream, scope.context()));
  if (!same) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Gemv: the matrix lives on device ", w.device(),
        " but the stream belongs to another context than that device's primary one (the "
        "context the library and the CUDA runtime use): another device's, or a context of its "
        "own; upload the matrix to the stream's device (DeviceMatrix::Upload(packed, device)) or "
        "use a stream of device ",
        w.device(), "'s primary context"));
  }
  // Autotuning launches and allocates: never while the caller's stream is being captured.
  bool allow_autotune = false;
  if (internal::AutotuneEnabled()) {
    ASSIGN_OR_RETURN(const bool capturing, internal::CaptureQuery(stream).Get());
    allow_autotune = !capturing;
  }
  ASSIGN_OR_RETURN(GemvPlan plan, internal::PlanGemvInternal(w, m, options, allow_autotune));
  internal::CaptureQuery capture(stream);  // asked afresh if at all: tuning may take seconds
  Pdl pdl = Pdl::kOff;
  if (options.pdl) {
    pdl = *options.pdl;
  } else {
    ASSIGN_OR_RETURN(pdl, internal::PdlFromEnv(internal::GetEnv("GEMVZ_PDL")));
  }
  return internal::LaunchPlannedEntered(w, plan.config, plan.chunk_m, x, m, out, fp32_out, stream,
                                        pdl, scope, capture);
}

}  // namespace

absl::Status Gemv(const DeviceMatrix& w, const uint16_t* x, int64_t m, uint16_t* out,
                  CUstream_st* stream, const GemvOptions& options) {
  return GemvAny(w, x, m, out, false, stream, options);
}

absl::Status GemvFp32(const DeviceMatrix& w, const uint16_t* x, int64_t m, float* out,
                      CUstream_st* stream, const GemvOptions& options) {
  return GemvAny(w, x, m, out, true, stream, options);
}

absl::StatusOr<int64_t> GemvWorkspaceBytes(CUstream_st* stream, int device) {
  ASSIGN_OR_RETURN(auto scope, EnterForStream(stream, device, "GemvWorkspaceBytes"));
  return internal::StreamWorkspaceBytes(scope.context(), stream);
}

absl::Status ReleaseGemvWorkspace(CUstream_st* stream, int device) {
  ASSIGN_OR_RETURN(auto scope, EnterForStream(stream, device, "ReleaseGemvWorkspace"));
  ASSIGN_OR_RETURN(const bool capturing, internal::CaptureQuery(stream).Get());
  if (capturing) {
    return absl::FailedPreconditionError(
        "ReleaseGemvWorkspace: the stream is being captured; the graph being captured would use "
        "the workspace it frees. End the capture first");
  }
  return internal::ReleaseStreamWorkspace(scope.context(), stream);  // waits for the stream
}

absl::StatusOr<GemvPlan> PlanGemv(const DeviceMatrix& w, int64_t m, const GemvOptions& options) {
  return internal::PlanGemvInternal(w, m, options, /*allow_autotune=*/true);
}

}  // namespace gemvz
