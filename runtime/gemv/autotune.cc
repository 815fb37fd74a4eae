#include "runtime/gemv/autotune.h"

#include <algorithm>
#include <limits>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gemvz/dispatch.h"
#include "gemvz/runtime.h"
#include "runtime/common/env.h"
#include "runtime/common/log.h"
#include "runtime/common/status_macros.h"
#include "runtime/cuda/driver.h"
#include "runtime/dispatch/dispatcher.h"

namespace gemvz::internal {
namespace {

using TuneKey = std::tuple<std::string, int, int64_t, int64_t, int64_t, int>;  // + order

absl::Mutex tune_mu(absl::kConstInit);
absl::flat_hash_map<TuneKey, GemvPlan>& Tuned() {
  static auto* m = new absl::flat_hash_map<TuneKey, GemvPlan>();
  return *m;
}

// Device buffers freed on scope exit.
struct DeviceBuffer {
  CUdeviceptr p = 0;
  ~DeviceBuffer() {
    if (p != 0) (*Driver())->cuMemFree(p);
  }
};

}  // namespace

bool AutotuneEnabled() { return GetEnvBool("GEMVZ_AUTOTUNE", false); }

absl::StatusOr<GemvPlan> Autotune(const DeviceMatrix& w, const GemvShape& shape,
                                  const DeviceInfo& info) {
  const DeviceMatrixState& s = *w.state();
  const TuneKey key{info.arch, static_cast<int>(s.format), shape.m, shape.n,
                    shape.k,   static_cast<int>(s.order)};
  absl::MutexLock lock(&tune_mu);  // one tuning at a time; the others wait for its answer
  if (auto it = Tuned().find(key); it != Tuned().end()) return it->second;

  std::vector<KernelConfig> space = SweepSpace(shape, s.format);
  for (KernelConfig& c : space) c = InOrder(c, s.order);  // the matrix's order
  const size_t cap = static_cast<size_t>(std::max<int64_t>(1, GetEnvInt64("GEMVZ_AUTOTUNE_MAX", 24)));
  std::vector<KernelConfig> candidates;
  if (space.size() <= cap) {
    candidates = space;
  } else {  // an even spread over the space, always including the heuristic's choice
    for (size_t i = 0; i < cap; ++i) candidates.push_back(space[i * space.size() / cap]);
  }
  const KernelConfig heuristic =
      InOrder(HeuristicConfig(shape, s.format, info.limits.sm_count), s.order);
  if (std::find(candidates.begin(), candidates.end(), heuristic) == candidates.end()) {
    candidates.push_back(heuristic);
  }
  GEMVZ_LOG_INFO("autotune %s %s: %d candidates", std::string(FormatName(s.format)), shape.ToString(),
                 static_cast<int>(candidates.size()));
  // Compile in parallel first, so timing does not wait on NVRTC one by one.
  auto compiled = PrecompileAll(candidates, info.arch, 0);
  if (!compiled.ok()) return compiled.status();

  ASSIGN_OR_RETURN(auto scope, ScopedDeviceContext::Enter(s.device));
  const auto* d = *Driver();
  CUstream stream;
  CU_RETURN_IF_ERROR(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
  DeviceBuffer x, out;
  CU_RETURN_IF_ERROR(cuMemAlloc(&x.p, static_cast<size_t>(shape.m * shape.k * 2)));
  CU_RETURN_IF_ERROR(cuMemAlloc(&out.p, static_cast<size_t>(shape.m * shape.n * 2)));
  CU_RETURN_IF_ERROR(cuMemsetD16(x.p, 0x3C00, static_cast<size_t>(shape.m * shape.k)));
  CUevent start, stop;
  CU_RETURN_IF_ERROR(cuEventCreate(&start, CU_EVENT_DEFAULT));
  CU_RETURN_IF_ERROR(cuEventCreate(&stop, CU_EVENT_DEFAULT));
  GemvPlan best{heuristic, "autotuned", std::min<int64_t>(shape.m, heuristic.tokens_per_launch())};
  float best_ms = std::numeric_limits<float>::max();
  absl::Status status;
  for (const KernelConfig& c : candidates) {
    const int64_t chunk = std::min<int64_t>(shape.m, c.tokens_per_launch());
    auto run = [&] {
      return LaunchPlanned(w, c, chunk, reinterpret_cast<const uint16_t*>(x.p), shape.m,
                           reinterpret_cast<void*>(out.p), false, stream);
    };
    status = run();  // warm-up: loads the module, sizes the workspace
    if (!status.ok()) break;
    constexpr int kReps = 20;
    if (d->cuEventRecord(start, stream) != CUDA_SUCCESS) break;
    for (int r = 0; r < kReps && status.ok(); ++r) status = run();
    if (!status.ok()) break;
    d->cuEventRecord(stop, stream);
    d->cuEventSynchronize(stop);
    float ms = 0;
    d->cuEventElapsedTime(&ms, start, stop);
    ms /= kReps;
    GEMVZ_LOG_DEBUG("autotune %s: %.2f us", c.ToString(), 1000.0 * ms);
    if (ms < best_ms) {
      best_ms = ms;
      best = GemvPlan{c, "autotuned", chunk};
    }
  }
  d->cuStreamSynchronize(stream);
  d->cuEventDestroy(start);
  d->cuEventDestroy(stop);
  // The candidates' split-K workspace lives as long as its stream (a later stream could get the
  // same handle and inherit it, but nothing would free it).
  ReleaseStreamWorkspace(scope.context(), stream);
  d->cuStreamDestroy(stream);
  RETURN_IF_ERROR(status);
  TunedChoice choice;
  choice.arch = info.arch;
  choice.format = s.format;
  choice.m = shape.m;
  choice.n = shape.n;
  choice.k = shape.k;
  choice.config = best.config;
  choice.time_us = 1000.0 * best_ms;
  if (absl::Status saved = SaveTunedChoices({choice}); !saved.ok()) {
    GEMVZ_LOG_WARNING("autotune: could not save the winner to %s: %s", TuningFilePath(),
                      saved.ToString());
  }
  GEMVZ_LOG_INFO("autotune %s: %s wins at %.2f us", shape.ToString(), best.config.ToString(),
                 choice.time_us);
  Tuned()[key] = best;
  return best;
}

}  // namespace gemvz::internal
