// The configuration for shapes the tuned table has never seen: always a valid launch, chosen by
// the grid arithmetic that the tuned winners follow (fill the SMs, keep the warps' loops long).
#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <tuple>

#include "gemvz/dispatch.h"
#include "runtime/dispatch/dispatcher.h"

namespace gemvz {
namespace internal {

int TokenBlocksFor(int64_t m) {
  const int64_t rows = std::clamp<int64_t>(m, 1, kMaxTokensPerLaunch);
  return static_cast<int>((rows + 7) / 8);
}

}  // namespace internal

namespace {

// Below this many loop trips per warp, the prologue, the pipeline fill and the reduction
// dominate, and splitting K further only adds a workspace round trip.
constexpr int64_t kMinTripsPerWarp = 2;
// CTAs per SM worth aiming for: with two resident CTAs one can stream while the other reduces.
constexpr int64_t kTargetWavesOfCtas = 2;

constexpr std::array<int, 6> kSplits = {1, 2, 3, 4, 6, 8};
constexpr std::array<int, 3> kUgPreference = {2, 1, 4};

// Chapter 8's tuner settles on 8 warps for most shapes and 16 for the largest; other counts are
// there for K that the usual ones do not divide.
int WarpRank(int nw, bool starved) {
  static constexpr int kUsual[] = {8, 4, 16, 12, 6, 2, 1};
  static constexpr int kStarved[] = {16, 8, 12, 4, 6, 2, 1};
  const int* order = starved ? kStarved : kUsual;
  for (int i = 0; i < 7; ++i) {
    if (order[i] == nw) return i;
  }
  return 100 + nw;
}

int UgRank(int ug) {
  for (int i = 0; i < static_cast<int>(kUgPreference.size()); ++i) {
    if (kUgPreference[i] == ug) return i;
  }
  return 100 + ug;
}

// NOTES: ptxas on sm_90 (NVRTC 13.0; see tuned_table.cc): PIPE 3 (minBlocks 1) never spills up to
// 8 warps. With 16 warps, PIPE 2's two CTAs per SM cap a thread at 56-64 registers, which only
// the 12-bit kernel with UG 1 and NB 1 fits (chapter 8's choice for the largest shapes); the
// others spill hundreds of bytes there, and PIPE 3 leaves one CTA per SM, so they take PIPE 0.
int PipeFor(WeightFormat format, int nw, int ug, int nb) {
  if (nw < 16) return 3;
  return format == WeightFormat::kZ12 && ug == 1 && nb == 1 ? 2 : 0;
}

// The best valid configuration with exactly `nb` token blocks, if there is one.
std::optional<KernelConfig> BestWithTokenBlocks(const GemvShape& shape, WeightFormat format, int nb,
                                                int sm_count) {
  const GemvShape launch{std::min<int64_t>(shape.m, 8 * nb), shape.n, shape.k};
  const DeviceLimits limits = DefaultDeviceLimits();
  const int64_t row_blocks = shape.n / 16;
  const int64_t groups = shape.k / 64;
  const int64_t target_ctas = kTargetWavesOfCtas * sm_count;
  // Even the largest split leaves SMs idle: more warps per CTA is the only other lever (up to
  // NB = 2: with 4 token blocks 16 warps spill whatever the PIPE).
  const bool starved = row_blocks * kSplits.back() < sm_count && nb <= 2;

  // Lexicographic, smaller is better: long enough loops, then the GPU filled (up to the target),
  // then as little split-K as that takes, then the usual warp counts and groups per trip.
  using Score = std::tuple<int, int64_t, int, int, int>;
  std::optional<Score> best_score;
  std::optional<KernelConfig> best;
  for (int nw = nb; nw <= 32; ++nw) {
    for (int ug : kUgPreference) {
      for (int s : kSplits) {
        const int64_t quantum = int64_t{s} * nw * ug;
        if (groups % quantum != 0) continue;
        const KernelConfig c{format, nw, ug, nb, PipeFor(format, nw, ug, nb), s};
        if (!Validate(c, launch, limits).ok()) continue;
        const int64_t trips = groups / quantum;
        const Score score{trips < kMinTripsPerWarp ? 1 : 0, -std::min(row_blocks * s, target_ctas),
                          s, WarpRank(nw, starved), UgRank(ug)};
        if (!best_score || score < *best_score) {
          best_score = score;
          best = c;
        }
      }
    }
  }
  return best;
}

}  // namespace

KernelConfig HeuristicConfig(const GemvShape& shape, WeightFormat format, int sm_count) {
  sm_count = std::max(sm_count, 1);
  const GemvShape s{std::max<int64_t>(shape.m, 1), shape.n, shape.k};
  const int nb_wanted = internal::TokenBlocksFor(s.m);
  // Fewer token blocks than m needs only when K admits no NW >= NB (K = 64 * odd and m > 8, say):
  // the caller then runs smaller chunks (GemvPlan::chunk_m).
  for (int nb = nb_wanted; nb >= 1; --nb) {
    if (std::optional<KernelConfig> c = BestWithTokenBlocks(s, format, nb, sm_count)) return *c;
  }
  // Only shapes no kernel takes (N % 16, K % 64) get here; Validate names their problem.
  return KernelConfig{format, 8, 1, nb_wanted, 3, 1};
}

}  // namespace gemvz
