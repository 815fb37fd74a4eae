// Autotuning on first use (GEMVZ_AUTOTUNE=1): for a shape the tuned tables do not know, time the
// candidates of the sweep space on the real matrix, keep the fastest for this process and persist
// it in the tuning file so later processes start with it.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gemvz/config.h"
#include "gemvz/gemv.h"
#include "runtime/gemv/device_state.h"

namespace gemvz::internal {

bool AutotuneEnabled();

// Times up to GEMVZ_AUTOTUNE_MAX (default 24) candidates for `shape` (m per launch) on `w` and
// returns the fastest, saved to the tuning file. A candidate that fails is skipped (one warning
// for them all). When none runs, or the tuning cannot start, `fallback` (the dispatcher's plan)
// is returned, with one warning. Either answer is kept for the process: a shape is tuned once.
GemvPlan Autotune(const DeviceMatrix& w, const GemvShape& shape, const DeviceInfo& info,
                  const GemvPlan& fallback);

// The plan Autotune answered for `shape` on `w` earlier in this process (its winner, or the
// fallback it kept after a failure), without tuning; nullopt if it has not tuned it. Gemv asks it
// while the stream is being captured, so that a graph runs what eager calls run.
std::optional<GemvPlan> AutotunedBefore(const DeviceMatrix& w, const GemvShape& shape,
                                        const DeviceInfo& info);

// Tests: `hook` runs for each candidate once compiled (kCompile) and before its launches
// (kLaunch), and fails that candidate there with its error (empty: none). And: forget every
// shape tuned in this process.
enum class AutotuneStage { kCompile, kLaunch };
using AutotuneHook = std::function<absl::Status(const KernelConfig&, AutotuneStage)>;
void SetAutotuneCandidateHookForTesting(AutotuneHook hook);
void ForgetAutotunedForTesting();

// Launches `config` over all of m in chunks of chunk_m (the part of Gemv after planning), with
// programmatic dependent launch as `pdl` says, where the GPU has it (GemvOptions::pdl).
absl::Status LaunchPlanned(const DeviceMatrix& w, const KernelConfig& config, int64_t chunk_m,
                           const uint16_t* x, int64_t m, void* out, bool fp32_out,
                           CUstream stream, Pdl pdl = Pdl::kOff);

// Forgets the workspace of (ctx, stream), waits for the stream, and frees the workspace's buffers
// (split-K partials, semaphores, padded x, and the buffers they outgrew). A Gemv on the stream at
// the same time either launches first (and is waited for) or allocates afresh. Only for a stream
// on which no graph that still runs was captured: the autotuner's own stream before it is
// destroyed, and ReleaseGemvWorkspace (gemv.h).
absl::Status ReleaseStreamWorkspace(CUcontext ctx, CUstream stream);

// The device bytes that the workspace of (ctx, stream) holds, outgrown buffers included; 0 if none.
int64_t StreamWorkspaceBytes(CUcontext ctx, CUstream stream);

// The device buffers of that workspace, outgrown ones first; empty if none. For tests, which
// check that ReleaseGemvWorkspace frees each one (free device memory, the other way to see it,
// moves with every other process on the GPU).
std::vector<CUdeviceptr> StreamWorkspaceBuffers(CUcontext ctx, CUstream stream);

// GEMVZ_PDL's value (unset: nullopt) as a mode: 0/empty off, 1 or auto kAuto, always kAlways.
absl::StatusOr<Pdl> PdlFromEnv(const std::optional<std::string>& value);

// Gemv's planning with the choice of whether autotuning may run (never during graph capture).
absl::StatusOr<GemvPlan> PlanGemvInternal(const DeviceMatrix& w, int64_t m,
                                          const GemvOptions& options, bool allow_autotune);

}  // namespace gemvz::internal
