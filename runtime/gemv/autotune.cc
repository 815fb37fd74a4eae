#include "runtime/gemv/autotune.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <optional>
#include <tuple>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gemvz/dispatch.h"
#include "gemvz/runtime.h"
#include "runtime/common/env.h"
#include "runtime/common/log.h"
#include "runtime/common/per_thread_cache.h"
#include "runtime/common/status_macros.h"
#include "runtime/cuda/driver.h"
#include "runtime/dispatch/dispatcher.h"
#include "runtime/jit/kernel_cache.h"

namespace gemvz::internal {
namespace {

// (arch, device name, format, m, n, k, order): the tuning file's key, and the matrix's order.
using TuneKey = std::tuple<std::string, std::string, int, int64_t, int64_t, int64_t, int>;

// Two locks, taken in this order: `tuning_mu` lets one tuning run at a time (tunings side by side
// would time each other's launches) and guards the candidate hook; `tune_mu` guards Tuned() and
// is held only to read or write it, so that a lookup never waits behind a tuning of seconds.
absl::Mutex tuning_mu(absl::kConstInit);
absl::Mutex tune_mu(absl::kConstInit);
absl::flat_hash_map<TuneKey, GemvPlan>& Tuned() {
  static auto* m = new absl::flat_hash_map<TuneKey, GemvPlan>();
  return *m;
}
// Each thread's copies of Tuned()'s answers: a call on a tuned shape takes no lock, and does not
// wait behind another shape's tuning.
PerThreadCache<TuneKey, GemvPlan>& TunedFront() {
  static auto* front = new PerThreadCache<TuneKey, GemvPlan>();
  return *front;
}

// Device buffers freed on scope exit.
struct DeviceBuffer {
  CUdeviceptr p = 0;
  ~DeviceBuffer() {
    if (p != 0) (*Driver())->cuMemFree(p);
  }
};

// Set by tests: called before each candidate is compiled and before its launches; an error
// makes that candidate fail there.
AutotuneHook& CandidateHook() {
  static auto* hook = new AutotuneHook();
  return *hook;
}

// The mean time in ms of `kReps` launches of `c` on `stream`, after one warm-up launch (which
// loads the module and sizes the workspace).
absl::StatusOr<float> TimeCandidate(const DeviceMatrix& w, const GemvShape& shape,
                                    const KernelConfig& c, CUdeviceptr x, CUdeviceptr out,
                                    CUstream stream, CUevent start, CUevent stop) {
  const int64_t chunk = std::min<int64_t>(shape.m, c.tokens_per_launch());
  auto run = [&]() -> absl::Status {
    if (const auto& hook = CandidateHook()) RETURN_IF_ERROR(hook(c, AutotuneStage::kLaunch));
    return LaunchPlanned(w, c, chunk, reinterpret_cast<const uint16_t*>(x), shape.m,
                         reinterpret_cast<void*>(out), false, stream);
  };
  RETURN_IF_ERROR(run());
  constexpr int kReps = 20;
  CU_RETURN_IF_ERROR(cuEventRecord(start, stream));
  for (int r = 0; r < kReps; ++r) RETURN_IF_ERROR(run());
  CU_RETURN_IF_ERROR(cuEventRecord(stop, stream));
  CU_RETURN_IF_ERROR(cuEventSynchronize(stop));
  float ms = 0;
  CU_RETURN_IF_ERROR(cuEventElapsedTime(&ms, start, stop));
  return ms / kReps;
}

// Times the candidates; the fastest that ran. A candidate that fails (its launch, a workspace it
// cannot get) is skipped; an error only when none ran, or when the context is broken.
absl::StatusOr<GemvPlan> TuneShape(const DeviceMatrix& w, const GemvShape& shape,
                                   const DeviceInfo& info, float* best_ms) {
  const DeviceMatrixState& s = *w.state();
  std::vector<KernelConfig> space = SweepSpace(shape, s.format);
  for (KernelConfig& c : space) c = InOrder(c, s.order);  // the matrix's order
  const size_t cap =
      static_cast<size_t>(std::max<int64_t>(1, GetEnvInt64("GEMVZ_AUTOTUNE_MAX", 24)));
  std::vector<KernelConfig> candidates;
  if (space.size() <= cap) {
    candidates = space;
  } else {  // an even spread over the space
    for (size_t i = 0; i < cap; ++i) candidates.push_back(space[i * space.size() / cap]);
  }
  // Always the heuristic's choice, in the last place when the cap is reached: at most `cap`.
  const KernelConfig heuristic =
      InOrder(HeuristicConfig(shape, s.format, info.limits.sm_count), s.order);
  if (std::find(candidates.begin(), candidates.end(), heuristic) == candidates.end()) {
    if (candidates.size() < cap) {
      candidates.push_back(heuristic);
    } else {
      candidates.back() = heuristic;
    }
  }
  const int candidates_total = static_cast<int>(candidates.size());
  GEMVZ_LOG_INFO("autotune %s %s: %d candidates", std::string(FormatName(s.format)), shape.ToString(),
                 candidates_total);
  // A candidate that does not compile is skipped like one that does not run.
  absl::Status first_failure;
  int failed = 0;
  auto skip = [&](const KernelConfig& c, const absl::Status& why) {
    ++failed;
    if (first_failure.ok()) first_failure = why;
    GEMVZ_LOG_INFO("autotune %s: skipped: %s", c.ToString(), why.ToString());
  };
  auto none_left = [&](const char* what) {
    return absl::Status(first_failure.code(),
                        absl::StrCat("none of ", candidates_total, " candidates ", what,
                                     "; the first failure: ", first_failure.message()));
  };
  // Compile in parallel first, so timing does not wait on NVRTC one by one.
  {
    std::vector<absl::StatusOr<PrecompileResult>> compiled =
        PrecompileEach(candidates, info.arch, 0, /*stop_on_error=*/false);
    std::vector<KernelConfig> built;
    for (size_t i = 0; i < candidates.size(); ++i) {
      if (const auto& hook = CandidateHook(); hook && compiled[i].ok()) {
        if (absl::Status st = hook(candidates[i], AutotuneStage::kCompile); !st.ok()) {
          compiled[i] = st;
        }
      }
      if (compiled[i].ok()) {
        built.push_back(candidates[i]);
      } else {
        skip(candidates[i], compiled[i].status());
      }
    }
    candidates = std::move(built);
  }
  if (candidates.empty()) return none_left("compiled");

  ASSIGN_OR_RETURN(auto scope, ScopedDeviceContext::Enter(s.device));
  ASSIGN_OR_RETURN(const DriverApi* const d, Driver());
  // Allocations, events and syncs of the tuning's own stream, beside another thread's capture.
  const RelaxedCaptureMode relaxed;
  DeviceBuffer x, out;  // freed last, once the stream has drained
  CU_RETURN_IF_ERROR(cuMemAlloc(&x.p, static_cast<size_t>(shape.m * shape.k * 2)));
  CU_RETURN_IF_ERROR(cuMemAlloc(&out.p, static_cast<size_t>(shape.m * shape.n * 2)));
  CUstream stream;
  CU_RETURN_IF_ERROR(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
  absl::Cleanup destroy_stream = [&] {
    d->cuStreamSynchronize(stream);
    // The candidates' split-K workspace lives as long as its stream (a later stream could get
    // the same handle and inherit it, but nothing would free it).
    ReleaseStreamWorkspace(scope.context(), stream).IgnoreError();  // best effort, as the sync
    d->cuStreamDestroy(stream);
  };
  // x = 1.0 everywhere, ordered before the launches on the tuning stream.
  CU_RETURN_IF_ERROR(
      cuMemsetD16Async(x.p, 0x3F80, static_cast<size_t>(shape.m * shape.k), stream));
  CUevent start = nullptr, stop = nullptr;
  absl::Cleanup destroy_events = [&] {
    if (start != nullptr) d->cuEventDestroy(start);
    if (stop != nullptr) d->cuEventDestroy(stop);
  };
  CU_RETURN_IF_ERROR(cuEventCreate(&start, CU_EVENT_DEFAULT));
  CU_RETURN_IF_ERROR(cuEventCreate(&stop, CU_EVENT_DEFAULT));

  std::optional<GemvPlan> best;
  *best_ms = std::numeric_limits<float>::max();
  for (const KernelConfig& c : candidates) {
    absl::StatusOr<float> ms = TimeCandidate(w, shape, c, x.p, out.p, stream, start, stop);
    if (!ms.ok()) {
      skip(c, ms.status());
      // A failed launch may leave work queued, or the context broken (then nothing can run).
      CU_RETURN_IF_ERROR(cuStreamSynchronize(stream));
      continue;
    }
    GEMVZ_LOG_DEBUG("autotune %s: %.2f us", c.ToString(), 1000.0 * *ms);
    if (*ms < *best_ms) {
      *best_ms = *ms;
      best = GemvPlan{c, "autotuned", std::min<int64_t>(shape.m, c.tokens_per_launch())};
    }
  }
  if (!best) return none_left("ran");
  if (failed > 0) {
    GEMVZ_LOG_WARNING("autotune %s: %d of %d candidates failed and were skipped (the first: %s)",
                      shape.ToString(), failed, candidates_total, first_failure.ToString());
  }
  return *best;
}

}  // namespace

bool AutotuneEnabled() { return GetEnvBool("GEMVZ_AUTOTUNE", false); }

void SetAutotuneCandidateHookForTesting(AutotuneHook hook) {
  absl::MutexLock lock(&tuning_mu);
  CandidateHook() = std::move(hook);
}

namespace {
TuneKey KeyOf(const DeviceMatrix& w, const GemvShape& shape, const DeviceInfo& info) {
  const DeviceMatrixState& s = *w.state();
  return TuneKey{info.arch, info.name, static_cast<int>(s.format), shape.m,
                 shape.n,   shape.k,   static_cast<int>(s.order)};
}

std::optional<GemvPlan> FindTuned(const TuneKey& key) {
  absl::MutexLock lock(&tune_mu);
  if (auto it = Tuned().find(key); it != Tuned().end()) return it->second;
  return std::nullopt;
}
void KeepTuned(const TuneKey& key, const GemvPlan& plan) {
  absl::MutexLock lock(&tune_mu);
  Tuned()[key] = plan;
}
}  // namespace

std::optional<GemvPlan> AutotunedBefore(const DeviceMatrix& w, const GemvShape& shape,
                                        const DeviceInfo& info) {
  const TuneKey key = KeyOf(w, shape, info);
  return TunedFront().FindOrAsk(key, [&] { return FindTuned(key); });
}

namespace {
// Autotune's answer from Tuned(), tuning the shape there on a miss.
GemvPlan TunedOrTune(const TuneKey& key, const DeviceMatrix& w, const GemvShape& shape,
                     const DeviceInfo& info, const GemvPlan& fallback) {
  const DeviceMatrixState& s = *w.state();
  if (std::optional<GemvPlan> kept = FindTuned(key)) return *kept;  // without waiting
  // One tuning at a time: a call for a shape being tuned waits for its answer, found here.
  absl::MutexLock one_tuning(&tuning_mu);
  if (std::optional<GemvPlan> tuned = FindTuned(key)) return *tuned;
  float best_ms = 0;
  absl::StatusOr<GemvPlan> tuned = TuneShape(w, shape, info, &best_ms);
  if (!tuned.ok()) {
    // Remembered, so that the process neither tunes again on every call nor warns every time.
    GEMVZ_LOG_WARNING("autotune of %s failed; %s (%s) serves it for the rest of the process: %s",
                      shape.ToString(), fallback.config.ToString(), fallback.source,
                      tuned.status().ToString());
    KeepTuned(key, fallback);
    return fallback;
  }
  TunedChoice choice;
  choice.arch = info.arch;
  choice.device = info.name;
  choice.format = s.format;
  choice.m = shape.m;
  choice.n = shape.n;
  choice.k = shape.k;
  choice.config = tuned->config;
  choice.time_us = 1000.0 * best_ms;
  if (absl::Status saved = SaveTunedChoices({choice}); !saved.ok()) {
    GEMVZ_LOG_WARNING("autotune: could not save the winner to %s: %s", TuningFilePath(),
                      saved.ToString());
  }
  GEMVZ_LOG_INFO("autotune %s: %s wins at %.2f us", shape.ToString(), tuned->config.ToString(),
                 choice.time_us);
  KeepTuned(key, *tuned);
  return *tuned;
}
}  // namespace

GemvPlan Autotune(const DeviceMatrix& w, const GemvShape& shape, const DeviceInfo& info,
                  const GemvPlan& fallback) {
  const TuneKey key = KeyOf(w, shape, info);
  return TunedFront().FindOrAsk(key, [&] { return TunedOrTune(key, w, shape, info, fallback); });
}

void ForgetAutotunedForTesting() {
  absl::MutexLock tuning(&tuning_mu);  // after a tuning in progress, which would keep its answer
  absl::MutexLock lock(&tune_mu);
  Tuned().clear();
  TunedFront().Invalidate();
}

}  // namespace gemvz::internal
