// The dispatcher's lookup: which configuration one launch of (m, N, K, format) on an architecture
// uses, and where that choice came from. Gemv's path layers the forced/env/autotune choices on top.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gemvz/config.h"
#include "gemvz/gemv.h"

namespace gemvz::internal {

// The largest launch the kernels take: NB <= 4 token blocks of 8 rows. Larger m runs in chunks.
inline constexpr int kMaxTokenBlocks = 4;
inline constexpr int64_t kMaxTokensPerLaunch = 8 * kMaxTokenBlocks;

// The rows of one launch for m activation rows: m itself up to kMaxTokensPerLaunch, else the
// fewest rows per launch that take m in the fewest launches (ceil(m / 32) launches of
// ceil(m / launches) rows, the last taking the rest), so that every chunk runs the kernel for the
// fewest token blocks (m = 40: two launches of 20 rows, NB 3, rather than 32 rows and 8 rows,
// both NB 4; m = 97: 25, 25, 25 and 22). Each launch of a 12-bit or plain kernel reads all
// the weights, whatever its rows, so the count of launches is what costs most and this keeps it.
int64_t LaunchRowsFor(int64_t m);
// One launch of configuration `c` for a call of shape.m rows: LaunchRowsFor's rows, fewer where
// c takes fewer token blocks (its chunks are then smaller). What Validate must accept for the call
// to run.
GemvShape LaunchShape(const GemvShape& shape, const KernelConfig& c);

// The smallest NB (1..4) whose 8*NB rows cover min(m, 32).
int TokenBlocksFor(int64_t m);

// The distinct kernels of `configs` (splits ignored and set to 1: a run-time argument, one
// compiled kernel serves every S), first occurrence first.
std::vector<KernelConfig> DistinctKernels(const std::vector<KernelConfig>& configs);

// The 12-bit kernel's warps share a K slice's trips of UG groups as evenly as whole trips go
// (kernel_sources/k_range.cuh). For a configuration that Validate accepts for K = 64 * groups:
// EvenShares: every warp the same trips;
// Balanced: the busiest warp's trips within `max_imbalance` of the mean (its CTA waits for it),
// by default kMaxWarpImbalance, which the sweep and the heuristic ask of configurations (the
// heuristic allows kMaxShortWarpImbalance for NB 2's one-CTA grids, up to 1.6 for the tiniest
// grids' fixed splits, and unbalanced shares as a last resort); equal shares are balanced.
// An eighth, not a tenth: on the H200 1024x11008 (43 trips per K slice at S = 4) ran 12-13 %
// faster with NW 8 at S = 4 (1.116) than with what a tenth left (S = 2 at m = 1, NW 4 at m = 16),
// while 4096x11008 at m = 16 lost 1.5 % (UG 4 at 1.116 over UG 2 at 1.023).
inline constexpr double kMaxWarpImbalance = 1.125;
// NB 2's one-CTA choice between 16 and 12 warps (session 8): with one to five trips a warp, a
// trip fewer counted for more than even shares on the H200 (768x5120 at m = 16: NW 12, busiest
// warp 1.2x the mean, 5.71 us against 6.18 for NW 16's even five trips; 896x4864 at 1.26x, 5.52
// against 5.95).
inline constexpr double kMaxShortWarpImbalance = 4.0 / 3.0;
bool EvenShares(int64_t groups, const KernelConfig& c);
bool Balanced(int64_t groups, const KernelConfig& c, double max_imbalance = kMaxWarpImbalance);

// Every kernel the heuristic's shaped rule (NB 1 to 4, both formats) may pick, with the CTAs
// per SM that the rule counts on it holding (S = 1; HeuristicTest checks registers against it,
// JitGpuTest the driver's occupancy).
struct HeuristicFamilyKernel {
  KernelConfig config;
  int ctas_per_sm = 0;
};
std::vector<HeuristicFamilyKernel> HeuristicFamilyKernels();
// HeuristicConfig before its last step, which may trade an unsplit 12-bit NB 2 to 4 choice for
// an RB 2 or RB 4 kernel whose grid fills the last wave as well (for tests of that step).
KernelConfig HeuristicConfigWithoutRowBlocks(const GemvShape& shape, WeightFormat format,
                                             int sm_count = 132);

// The configuration for one launch of `shape` (shape.m is the rows per launch; m above 32 is
// planned as its equal chunks, LaunchRowsFor), from, in order:
//   1. the tuning file (source "tuning-file"): an exact (arch, format, m, n, k) entry measured on
//      the GPU named `device`, else one that names no device (the GPU's name, DeviceInfo::name;
//      "" takes only the latter); the file is read once per process and cached,
//   2. the built-in table (source "tuned"): the exact entry, else the entry of the next larger m
//      with the same (arch, format, n, k) when its NB still covers m; an arch-specific target
//      (sm_90a) takes its base arch's rows (sm_90),
//   3. HeuristicConfig (source "heuristic").
// plan.chunk_m is min(m, config.tokens_per_launch()): the rows each launch takes. The heuristic
// lowers NB below what m needs only where K leaves no valid configuration with it (K = 64 * odd
// with m > 8, say); chunk_m says so. An error only for shapes no kernel takes (N % 16, K % 64,
// m < 1, N or K from 2^31), naming the rule. A tuning file that cannot be read or parsed is
// reported once (warning) and ignored. Thread-safe.
// `order` is the matrix's (DeviceMatrix::order): steps 1 and 2 take only entries of that order
// (z12), and the heuristic's configuration gets it.
absl::StatusOr<GemvPlan> ChooseConfig(const GemvShape& shape, WeightFormat format,
                                      const std::string& arch, int sm_count,
                                      WeightOrder order = WeightOrder::kBlockMajor,
                                      const std::string& device = "");

// The entry of the built-in table that ChooseConfig's step 2 would use, if any.
std::optional<KernelConfig> LookupBuiltinTable(const GemvShape& shape, WeightFormat format,
                                               const std::string& arch,
                                               WeightOrder order = WeightOrder::kBlockMajor);

// `c` in `order` where it has one (z12; plain BF16 configurations are returned as they are).
KernelConfig InOrder(KernelConfig c, WeightOrder order);

// Forgets the cached tuning file and reads TuningFilePath() again now (tests, or after another
// process saved). Returns the load's status; on error the dispatcher runs without the file.
absl::Status ReloadTuningFile();

// Why the cached tuning file is being ignored (OK when it loaded, is absent or is not read yet).
absl::Status TuningFileStatus();

// Marks the cached tuning file stale, so the next ChooseConfig reads it again. SaveTunedChoices
// calls it after publishing, so that a winner saved in this process is used by this process.
void InvalidateTuningFileCache();

}  // namespace gemvz::internal
