// The configuration for shapes the tuned table has never seen: always a valid launch, chosen by
// the grid arithmetic that the tuned winners follow (fill the SMs, keep the warps' loops long).
#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "absl/types/span.h"
#include "gemvz/dispatch.h"
#include "runtime/dispatch/dispatcher.h"

namespace gemvz {
namespace internal {

int64_t LaunchRowsFor(int64_t m) {
  if (m <= kMaxTokensPerLaunch) return std::max<int64_t>(m, 1);
  // Rounded up as (m - 1) / d + 1: m + d - 1 would overflow for m near 2^63.
  const int64_t launches = (m - 1) / kMaxTokensPerLaunch + 1;
  return (m - 1) / launches + 1;
}

GemvShape LaunchShape(const GemvShape& shape, const KernelConfig& c) {
  return GemvShape{std::min<int64_t>(LaunchRowsFor(shape.m), c.tokens_per_launch()), shape.n,
                   shape.k};
}

int TokenBlocksFor(int64_t m) {
  const int64_t rows = std::clamp<int64_t>(m, 1, kMaxTokensPerLaunch);
  return static_cast<int>((rows + 7) / 8);
}

bool EvenShares(int64_t groups, const KernelConfig& c) {
  return groups % (int64_t{c.splits} * c.nw * c.ug) == 0;
}

namespace {
// A K slice's trips of UG groups and the busiest warp's share of them (k_range.cuh's dealing).
struct SliceTrips {
  int64_t trips;
  int64_t busiest;
};
SliceTrips TripsOf(int64_t groups, const KernelConfig& c) {
  const int64_t trips = groups / (int64_t{c.splits} * c.ug);
  return {trips, (trips + c.nw - 1) / c.nw};
}
}  // namespace

// 4096x11008's 172 groups over NW 16 give 11 trips against a mean of 10.75: balanced.
bool Balanced(int64_t groups, const KernelConfig& c, double max_imbalance) {
  const SliceTrips t = TripsOf(groups, c);
  // (The slack keeps a ratio such as 4/3, 8 trips over a mean of 6, on the right side of rounding.)
  return static_cast<double>(t.busiest * c.nw) <=
         max_imbalance * static_cast<double>(t.trips) + 1e-9;
}

}  // namespace internal

namespace {

// Below this many loop trips per warp, the prologue, the pipeline fill and the reduction
// dominate, and splitting K further only adds a workspace round trip.
constexpr int64_t kMinTripsPerWarp = 2;
// CTAs per SM worth aiming for: with two resident CTAs one can stream while the other reduces.
constexpr int64_t kTargetWavesOfCtas = 2;

constexpr std::array<int, 6> kSplits = {1, 2, 3, 4, 6, 8};
// The families split K only from this K on (the default of Families::min_split_k; see Shaped);
// below it only the tiniest grids' fixed splits do (Families::tiny), and the 12-bit fallback for
// shorter K does not (ShortKFallback).
constexpr int64_t kMinSplitK = 8192;
// Families::starved_min_trips applies from this K on.
constexpr int64_t kStarvedMinK = 2048;

// The loop trips of the warp with the fewest: the 12-bit kernel's warps share a K slice's trips of
// UG groups as evenly as whole trips go (kernel_sources/k_range.cuh).
int64_t MinTripsPerWarp(int64_t groups, const KernelConfig& c) {
  return internal::TripsOf(groups, c).trips / c.nw;
}

using internal::Balanced;
using internal::EvenShares;
using internal::kMaxShortWarpImbalance;

// What the shaped rules take of a valid configuration: loops of `min_trips` trips or more (by
// default kMinTripsPerWarp), and shares of K within `max_imbalance` (equal shares are).
bool LongAndBalanced(int64_t groups, const KernelConfig& c,
                     int64_t min_trips = kMinTripsPerWarp,
                     double max_imbalance = internal::kMaxWarpImbalance) {
  return MinTripsPerWarp(groups, c) >= min_trips && Balanced(groups, c, max_imbalance);
}
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

// Warps in flight worth aiming for with short K: about 16 per SM.
constexpr int64_t kTargetWarpsPerSm = 16;

// The 12-bit fallback for K below kMinSplitK that no family takes (few groups, or a count that
// NW 8 and 16 share unevenly): unsplit, the measured warp counts only, the most streaming warps
// over the grid (up to kTargetWarpsPerSm per SM) among balanced shares, one trip a warp being
// enough. On the H200 (session 8, m = 1) the lexicographic rule's choices split K or ran one warp
// per CTA: 3568x960 (15 groups) 6.06 us (NW 1, S = 3) against 3.85 for NW 8 with uneven shares;
// 1600x960 5.39 against 3.03; 4192x1344 (21 groups) 7.08 against 6.34 for NW 2; 1152x896 (14)
// 5.59 against 4.17; 1776x576 (9) 4.72 against 3.63 for NW 2; 2048x768 (12) 4.56 against 3.08
// for NW 12 (the best, NW 6 with UG 2: 2.90).
std::optional<KernelConfig> ShortKFallback(const GemvShape& launch, int nb, int sm_count) {
  const int64_t row_blocks = launch.n / 16;
  const int64_t groups = launch.k / 64;
  const int64_t target_warps = kTargetWarpsPerSm * sm_count;
  using Score = std::tuple<int64_t, int, int, int>;
  std::optional<Score> best_score;
  std::optional<KernelConfig> best;
  for (int nw : {16, 12, 8, 6, 4, 2, 1}) {
    if (nw < nb) continue;
    for (int ug : kUgPreference) {
      const KernelConfig c{
          WeightFormat::kZ12, nw, ug, nb, PipeFor(WeightFormat::kZ12, nw, ug, nb), 1};
      if (!Validate(c, launch, DefaultDeviceLimits()).ok() || !Balanced(groups, c)) continue;
      const Score score{-std::min(row_blocks * nw, target_warps), EvenShares(groups, c) ? 0 : 1,
                        WarpRank(nw, false), UgRank(ug)};
      if (!best_score || score < *best_score) {
        best_score = score;
        best = c;
      }
    }
  }
  return best;
}

// The best valid configuration with exactly `nb` token blocks, if there is one.
std::optional<KernelConfig> BestWithTokenBlocks(const GemvShape& shape, WeightFormat format, int nb,
                                                int sm_count) {
  const GemvShape launch{std::min<int64_t>(shape.m, 8 * nb), shape.n, shape.k};
  // (Measured at NB 1 and 2 only.)
  if (format == WeightFormat::kZ12 && shape.k < kMinSplitK && nb <= 2) {
    if (std::optional<KernelConfig> c = ShortKFallback(launch, nb, sm_count)) return c;
  }
  const DeviceLimits limits = DefaultDeviceLimits();
  const int64_t row_blocks = shape.n / 16;
  const int64_t groups = shape.k / 64;
  const int64_t target_ctas = kTargetWavesOfCtas * sm_count;
  // Even the largest split leaves SMs idle: more warps per CTA is the only other lever (ranked
  // first up to NB = 2, as this fallback was first fitted; NB 3-4 reach it only for K that no
  // family takes).
  const bool starved = row_blocks * kSplits.back() < sm_count && nb <= 2;

  // Lexicographic, smaller is better: the 12-bit warps' shares of K equal or balanced, long
  // enough loops, then the GPU filled (up to the target), then as little split-K as that takes,
  // equal shares before uneven ones, then the usual warp counts and groups per trip.
  using Score = std::tuple<int, int, int64_t, int, int, int, int>;
  std::optional<Score> best_score;
  std::optional<KernelConfig> best;
  for (int nw = nb; nw <= 32; ++nw) {
    for (int ug : kUgPreference) {
      for (int s : kSplits) {
        const KernelConfig c{format, nw, ug, nb, PipeFor(format, nw, ug, nb), s};
        if (!Validate(c, launch, limits).ok()) continue;
        const int64_t trips = MinTripsPerWarp(groups, c);
        const bool even = EvenShares(groups, c);
        const Score score{Balanced(groups, c) ? 0 : 1,
                          trips < kMinTripsPerWarp ? 1 : 0,
                          -std::min(row_blocks * s, target_ctas),
                          s,
                          even ? 0 : 1,
                          WarpRank(nw, starved),
                          UgRank(ug)};
        if (!best_score || score < *best_score) {
          best_score = score;
          best = c;
        }
      }
    }
  }
  return best;
}

// ---- The shaped rule, NB 1 to 4 (m <= 32): size the grid to the GPU's resident slots.
//
// A grid of 1.3 waves runs its second wave nearly empty: 8192x8192 at m = 1 takes 28.7 us with
// 3 CTAs per SM (512 CTAs in 396 slots) and 25.4 us with 4 (one wave). So the heuristic picks
// the split S first (none unless the row blocks leave SMs idle), then the kernel family whose
// CTAs per SM waste the least of the last wave. Each family's CTAs per SM come from its launch
// bounds (PIPE 2: minBlocks 2; 12-bit PIPE 4..8: PIPE - 2, 9..13: PIPE - 7) or from the
// registers ptxas gives it; HeuristicTest.FamiliesHoldTheirCtasPerSm compiles every family and
// checks the count, and JitGpuTest compares it with the driver's occupancy.
// Fitted on the H200 (2026-11-29) to sweeps of 34 shapes at m = 1, 8, 16 (docs/BENCHMARKS.md,
// "The heuristic"), in geometric mean over the 102 cases: 12-bit 1.008x the best configuration
// measured (worst 1.15x), against 1.136x (worst 1.64x) for the previous, occupancy-blind rule;
// plain BF16 1.017x (worst 1.13x) against 1.153x (worst 2.03x).
struct Family {
  int ctas_per_sm;  // 0: an unused slot of Families::mid
  int nw;
  int pipe;
  std::array<int, 3> ugs;  // in order of preference; 0 ends the list
  // A mid family taken only where it fills the last wave best of the mid families and K is at
  // least kBestFillOnlyMinK, never as a fallback for shapes the others refuse (short K, measured
  // with other kernels).
  bool best_fill_only = false;
};

// A split for the tiniest grids, below the K from which the families split: grids of at most
// max_row_blocks row blocks (on 132 SMs; scaled with the SM count) with K in [min_k, kMinSplitK)
// run this kernel with S slices, if it is valid. Its shares need not be balanced: for the K each
// entry takes, the busiest warp stays within 1.6x the mean (two trips against 1.25), and at 1.6x
// on 112x5120 (NW 4, UG 2, S = 8) it was the fastest measured. s = 0: an unused slot.
struct TinySplit {
  int64_t max_row_blocks;
  int64_t min_k;
  int s;
  int nw;
  int ug;
  int pipe;
};

struct Families {
  Family wide;                // grids of at most wide.ctas_per_sm CTAs per SM: the most warps
  std::array<Family, 5> mid;  // up to kMaxShapedCtasPerSm CTAs per SM: the least-waste one
  Family many;                // more CTAs per SM: many waves, the best streamer
  Family single = {};         // if set: grids of at most one CTA per SM (up to 2048 rows)...
  int64_t single_min_k = 0;   // ... whose CTAs each take at least this much of K (K / S)
  // Split K only from this K on, where the row blocks fill at least a quarter of the SMs (fewer
  // than that keep kMinSplitK).
  int64_t min_split_k = kMinSplitK;
  int single_max_sm_pct = 100;  // the single family takes grids on at most this share of the SMs
  bool single_split = true;      // ... split ones too
  // Grids split into the narrowest slices (kMinSplitColumns) take a family's UG only with at
  // least this many trips per warp.
  int64_t narrow_split_min_trips = kMinTripsPerWarp;
  std::array<TinySplit, 2> tiny = {};  // tried in order, before the families
  // Unsplit grids on at most starved_max_sm_pct of the SMs (100: one CTA per SM) with K of at
  // least kStarvedMinK take a family's UG with this many trips per warp.
  int64_t starved_min_trips = kMinTripsPerWarp;
  int starved_max_sm_pct = 100;
  // If set: unsplit grids that the single family takes run, of its kernels and these (another
  // warp count, also one CTA per SM), the one whose busiest warp takes the fewest trips, then
  // the one whose shares are the most even (UGs in their order; single first), shares within
  // kMaxShortWarpImbalance rather than kMaxWarpImbalance (FewestTrips).
  Family single_alt = {};
};

constexpr int kMaxShapedCtasPerSm = 8;
// The shortest K a best_fill_only family was measured at (session 10: K = 2048 to 14336).
constexpr int64_t kBestFillOnlyMinK = 2048;

// 12-bit, NB 1.
constexpr Families kZ12Nb1 = {
    {2, 16, 2, {1, 0, 0}},   // 4096x{4096,8192,14336}, 3072x3072, 2048x2048 (UG 2 spills)
    {{{3, 8, 3, {2, 1, 0}},  // 66-68 registers: 3 CTAs of 288 threads (UG 4: 98, 1 CTA)
      {4, 8, 6, {2, 1, 4}},  // 8192x8192, 8192x28672
      // Three warps (66 registers: 7 CTAs of 128 threads), for grids of 6.x to 7 CTAs per SM
      // (session 10, H200, m = 1 and 8, two rounds): 1.2-8.2 % faster than the 4-CTA family on
      // all 9 shapes measured (12800x4096 0.951x, 14336x4096 0.966x, 14336x3584 0.966x,
      // 14080x2048 0.949x, 13824x8192 0.987x, 12800x14336 0.918x).
      {7, 3, 3, {2, 1, 0}, true},
      {},
      {}}},
    {3, 8, 3, {2, 1, 0}},  // 28672x4096, 57344x8192, 128256x4096
    // One CTA of 16 uncapped warps (66-94 registers) per SM for K / S >= 4096, and no split
    // below K = 12288 (session 6, H200, m = 1): 1024x4096 4.25 us (UG 2) against 4.68 for the
    // wide family, 1024x8192 6.11 against 6.89 split 4 ways, 1024x11008 7.56 against 7.93,
    // 2048x8192 8.65 against 9.22, 2048x4096 5.43 against 5.72; 1024x14336 stays split (8.87
    // against 9.22 unsplit). With two trips a warp, 2048x2048 ran 4.11 against the wide
    // family's 3.86.
    {1, 16, 3, {4, 2, 1}},
    4096,
    12288,
    100,
    true,
    kMinTripsPerWarp,
    // Session 8 (H200, m = 1 and 8, 18 shapes of 64 to 2048 rows and K 2048 to 7168): one trip a
    // warp for unsplit grids on at most half the SMs (64x4096 to 1024x4096: UG 4 1.5-6.9 %
    // faster than UG 2; on 1536x4096 and 2048x4096, held out, 0.9-1.4 % slower), and the
    // smallest grids split 4 ways from K = 6144 (64x7168 4.31 us against 5.14 unsplit, 128x6144
    // 4.20 against 4.51, 256x7168 4.72 against 5.29; 384x5120 and 512x6144 ran fastest
    // unsplit).
    {{{16, 6144, 4, 16, 1, 3}}},
    1,
    50,
};
// 12-bit, NB 2: fewer, heavier warps (about 90 registers uncapped).
constexpr Families kZ12Nb2 = {
    {2, 8, 4, {4, 2, 1}},  // 4096x4096, 4096x8192, 3072x8192
    {{{3, 8, 5, {1, 2, 0}},  // 6144x4096, 4608x3584
      {4, 4, 6, {2, 1, 0}},  // 8192x8192, 8192x28672
      {6, 4, 8, {1, 0, 0}},  // 10240x8192, 12288x4096
      {}, {}}},
    {4, 4, 6, {2, 1, 0}},  // 28672x4096, 57344x8192, 128256x4096
    // Session 7 (H200, m = 12 and 16, row-starved shapes): the one-CTA family of NB 1 for
    // unsplit grids on at most half the SMs (1024x6144: 6.76 us against 7.11 for the wide
    // family; 512x6144 6.39 against 6.77); with more SMs (2048x4096, 2048x8192) the wide family
    // was 5-7 % faster, and so it was on 128x32768 split 8 ways (7.15 us against 7.45). K slices
    // of 2048 columns want four trips a warp (1024x8192 split 4 ways at m = 16: UG 1 7.73 us,
    // UG 2 8.80; 768x8192 7.13 against 8.03); wider ones keep two (256x32768 split 8 ways: UG 4
    // 8.13 us, UG 2 8.40).
    {1, 16, 3, {4, 2, 1}},
    3072,
    kMinSplitK,
    50,
    false,
    4,
    // Session 8 (H200, m = 16, the same 18 shapes): one trip a warp for unsplit grids of one CTA
    // per SM at most (UG 4 at K = 2048 and 4096, 1024x4096: 4.99 us against 5.37 for UG 2;
    // 2048x2048 4.78 against 4.95), and the smallest grids split below K = 8192: 8 ways on 8
    // row blocks or fewer from K = 4096 (128x6144 5.00 us against 6.02 unsplit, 64x4096 4.20
    // against 4.75), 4 ways on up to 40 from K = 5120 (384x5120 5.19 against 5.71, 512x6144
    // 5.54 against 6.25; 640x6144 in session 7: 5.91 against 6.49); at K = 4096 16-32 row blocks
    // ran as fast or faster unsplit (256x4096 4.70 us against 4.82 split).
    {{{8, 4096, 8, 4, 2, 6}, {40, 5120, 4, 8, 1, 4}}},
    1,
    100,
    // Session 8: NW 12 with UG 4 takes K that 16 warps share unevenly or in more trips (768x5120
    // at m = 16: 5.71 us against 6.18 for NW 16 with UG 1; 1024x6144 6.22 against 6.55 for UG 2;
    // 768x3072 4.30 against 4.68 for the wide family, which K = 3072 went to before).
    {1, 12, 3, {4, 0, 0}},
};
// 12-bit, NB 3 and 4 (m = 17..32), fitted on a sweep of 13 shapes at m = 24 and 32 (session 7,
// H200, 60-125 configurations each; docs/BENCHMARKS.md, "m = 17 to 32"). Every shape ran
// fastest unsplit.
// NB 3: 72 (NW 12, PIPE 2), 124-128 (NW 4, PIPE 5) and 96 registers (NW 16, PIPE 3).
constexpr Families kZ12Nb3 = {
    {2, 12, 2, {1, 0, 0}},  // 4096x{8192,11008,14336}, 3072x3072 (4096x4096: 1.07x the best)
    {{{3, 4, 5, {4, 2, 1}},  // 6144x4096, 10240x8192
      {}, {}, {}, {}}},
    {3, 4, 5, {4, 2, 1}},  // 28672x4096
    {1, 16, 3, {2, 1, 4}},  // 2048x4096, 1024x8192
    4096,
    12288,  // (the families' splits were not measured at NB 3 or 4)
    100,
    false,
    kMinTripsPerWarp,
    // Session 8 (H200, m = 24, 8 shapes of 64 to 1024 rows, K 4096 to 7168): the tiniest grids
    // split 8 ways, like NB 2's (64x7168: 5.31 us against 7.18 unsplit; 128x6144 5.08 against
    // 6.61; 256x7168 5.70 against 7.61; 512x6144 6.18 against 7.59); 1024x4096 ran fastest
    // unsplit.
    {{{8, 4096, 8, 4, 2, 5}, {40, 5120, 8, 4, 2, 5}}},
};
// NB 4: 89 (PIPE 3), 105 (NW 4, PIPE 4) and 72 registers (NW 4, PIPE 0).
constexpr Families kZ12Nb4 = {
    {2, 8, 3, {1, 0, 0}},  // 4096x{4096,8192,11008,14336}, 3072x3072, 2048x4096
    {{{3, 4, 4, {1, 0, 0}},  // 6144x4096
      {4, 4, 3, {1, 0, 0}},  // 8192x8192, 8192x28672, 14336x4096
      {5, 4, 0, {2, 1, 0}},  // 10240x8192
      {}, {}}},
    {4, 4, 3, {1, 0, 0}},  // 28672x4096
    {1, 16, 3, {1, 2, 4}},  // 1024x8192 (2048x4096: 1.10x the best, so at most half the SMs)
    4096,
    12288,
    50,
    false,
    kMinTripsPerWarp,
    // Session 8 (H200, m = 32, the same 8 shapes): 8 ways on up to 8 row blocks (64x4096: 4.73 us
    // against 6.57 unsplit; 128x6144 5.60 against 7.90), 4 ways on up to 40 from K = 5120
    // (384x5120 5.93 against 7.63; 512x6144 6.54 against 9.32; 256x7168 6.78 against 9.86).
    {{{8, 4096, 8, 4, 1, 4}, {40, 5120, 4, 8, 1, 3}}},
};
// 12-bit, several row blocks per CTA (RB 2 or 4): N/(16*RB) CTAs, so their own wave arithmetic.
// A family's kernel is its one UG with S = 1.
struct RowBlockFamily {
  int rb;
  Family family;
  int64_t min_k = 0;  // taken only from this K on (where it was measured)
};
// NB 2: 88, 124 and 128 registers; NB 3: 154, 154 and 96. At equal fill the first valid family
// with balanced shares is taken (MoreRowBlocks).
// NB 2's RB 4 family (session 11, H200, m = 12 and 16, 12 shapes, two rounds): four row blocks
// from one load of x's fragments, 4 CTAs per SM as the first RB 2 family, were 1.6-2.4 % faster
// than the rule's choice where their grid fills the slots better (28672x8192, 27648x5120,
// 128256x4096; 28672x4096 in the tuned table) and 1-34 % slower where it fills them as well or
// less well (57344x8192 1.01-1.02x, 18944x4096 and 22016x4096 1.05x, 14336x4096 1.20x,
// 12288x4096 1.34x); listed last, so taken only when its fill is the best.
constexpr std::array<RowBlockFamily, 3> kZ12Nb2Rb = {{
    {2, {4, 4, 3, {1, 0, 0}}},        // 14336x4096, 16384x3072, 14336x14336
    {2, {3, 4, 5, {2, 0, 0}}},        // 10240x8192, 12288x4096, 22016x4096, 37888x3584
    {4, {4, 3, 3, {1, 0, 0}}, 4096},  // 27648x5120, 28672x{4096,8192}, 128256x4096
}};
// Session 10 (H200, m = 17 and 24, 10 shapes, two rounds): five warps with UG 2 were 2.2-8.5 %
// faster than NW 8 with UG 1 on 19 of the 20 cases (57344x8192 0.917x and 0.928x, 14336x14336
// 0.915x and 0.931x, 14336x4096 0.970x and 0.978x), 3.2 % slower on 8192x3584 at m = 24. NW 8
// stays below K = 4096, where NW 5 was not measured or lost (8192x3584), and so for K that five
// warps cannot share in balance (K = 2048: 16 trips).
// Session 11 (H200, m = 17 and 24, 16 shapes): four row blocks with five warps (154 registers, 2
// CTAs per SM as the RB 2 family) were 1.6-6.1 % faster than that family where they fill the
// slots as well (14336x4096 0.939x and 0.941x, 13824x5120, 14336x14336, 16384x4096, 16384x5120,
// 128256x4096), and slower where they fill them worse (22016x4096 1.10-1.12x, 57344x8192
// 1.03-1.05x), as the fill rule has it; listed first, so taken at equal fill.
constexpr std::array<RowBlockFamily, 3> kZ12Nb3Rb = {{
    {4, {2, 5, 4, {1, 0, 0}}, 4096},  // 14336x4096, 16384x4096, 14336x14336, 128256x4096
    {2, {2, 5, 4, {2, 0, 0}}, 4096},  // 8192x8192, 8192x28672, 22016x4096, 57344x8192
    {2, {2, 8, 4, {1, 0, 0}}},        // K below 4096 (8192x3584, 8192x2048)
}};
// NB 4: four row blocks from one load of x's 32 rows of fragments (158 registers, 2 CTAs per SM).
// Session 9 (H200, m = 25, 28, 32, 14 shapes): 1.08-1.15x faster than the RB 1 family where its
// grid fills the slots as well (14336x4096, 16384x4096, 28672x{4096,8192}, 128256x4096; 12288x4096
// 1.01-1.02x, 10240x8192 0.98x), 0.90-0.94x where it fills them worse (18944x4096, 22016x4096),
// 0.45-0.77x on grids that leave SMs idle. RB 2 at NB 4 was never the best.
constexpr std::array<RowBlockFamily, 1> kZ12Nb4Rb = {{
    {4, {2, 4, 0, {1, 0, 0}}},  // 14336x4096, 16384x4096, 28672x4096, 128256x4096
}};
// RB 2 (and RB 4) is taken when its grid fills the last wave at least as well as the RB 1
// family's, less this slack: at equal fill it streamed 1-3 % faster on the H200 (session 5,
// m = 16: 14 shapes with many row blocks, the rule's choice within 0.7 % of the best on all of
// them); where its fill is worse it lost 2-22 % (8192x8192: 31.9 against 26.1 us).
constexpr double kRowBlockFillSlack = 0.02;

// A row-block family's kernel: its one UG, S 1.
KernelConfig RowBlockKernel(const RowBlockFamily& f, int nb) {
  return KernelConfig{WeightFormat::kZ12, f.family.nw, f.family.ugs[0], nb, f.family.pipe, 1, f.rb};
}
// The row-block families for `nb` token blocks (none for NB 1).
absl::Span<const RowBlockFamily> RowBlockFamilies(int nb) {
  if (nb == 2) return kZ12Nb2Rb;
  if (nb == 3) return kZ12Nb3Rb;
  if (nb == 4) return kZ12Nb4Rb;
  return {};
}
// Plain BF16 (NW warps, no exception warp): 70-116 registers at NB 1 and 88-156 at NB 2 hold
// about 16 warps per SM whatever NW, so NW sets the grain of a wave. The shapes named are the
// swept ones each family's kernels serve.
constexpr Families kBf16Nb1 = {
    {1, 16, 3, {2, 1, 4}},  // 114-116 registers: 2048x2048, 2048x4096, 2048x8192, 256x32768
    {{{2, 8, 3, {2, 1, 4}},  // 4096x4096, 4096x8192, 3072x3072, 1024x8192 (S = 4)
      {3, 8, 1, {1, 0, 0}},  // 70 registers: 6144x4096, 4608x3584, 5120x5120, 12288x4096
      {4, 4, 3, {2, 1, 0}},  // 8192x8192, 8192x28672
      {5, 4, 1, {2, 0, 0}},  // 96 registers: 10240x8192
      {8, 2, 3, {2, 1, 0}}}},  // 16384x3072, 15360x5120
    {2, 8, 3, {2, 1, 4}},  // 28672x4096, 22016x4096, 57344x8192, 128256x4096
};
constexpr Families kBf16Nb2 = {
    {1, 16, 3, {2, 1, 4}},  // 2048x2048, 2048x4096, 2048x8192, 256x32768
    {{{2, 8, 1, {2, 1, 0}},  // 4096x4096, 4096x8192, 4096x14336, 3072x3072
      {3, 4, 3, {2, 1, 0}},  // 154-156 registers: 4608x3584, 5120x5120, 6144x4096
      {4, 4, 1, {2, 0, 0}},  // 128 registers (UG 1: 88, 5 CTAs): 8192x8192, 8192x28672
      {6, 2, 3, {2, 4, 1}},  // 10240x8192, 12288x4096
      {8, 2, 1, {2, 0, 0}}}},  // 16384x3072, 15360x5120
    {4, 4, 1, {2, 0, 0}},  // 28672x4096, 57344x8192, 128256x4096
};

// Plain BF16, NB 3 and 4 (m = 17..32), fitted like the 12-bit ones (session 7, 13 shapes at m = 24
// and 32, 92 non-spilling kernels). A family lists only the UGs that hold its CTAs per SM (NB 3,
// NW 8, PIPE 3: 128 registers with UG 2, 179-182 with UG 1 or 4). K that no family's warps divide
// evenly (4096x11008 at NB 3; at NB 4 the NW 4 family's UG 1 takes it) keeps the lexicographic
// rule, which measured within 0.3 % of the best there.
constexpr Families kBf16Nb3 = {
    {2, 8, 3, {2, 0, 0}},  // 4096x{4096,8192,14336}, 3072x3072
    {{{3, 4, 2, {2, 0, 0}},  // 162 registers: 10240x8192, 6144x4096 (1.03x; PIPE 3 the best)
      {4, 4, 3, {2, 0, 0}},  // 128 registers: 8192x8192, 8192x28672, 14336x4096
      {}, {}, {}}},
    {4, 4, 3, {2, 0, 0}},  // 28672x4096
    {1, 16, 3, {2, 4, 0}},  // 124-128 registers: 1024x8192, 2048x4096
    4096,
    12288,
    100,
    false,
};
constexpr Families kBf16Nb4 = {
    {2, 8, 2, {1, 0, 0}},  // 128 registers: 4096x{4096,8192,14336}, 3072x3072
    {{{3, 4, 3, {2, 1, 0}},  // 148 registers: 6144x4096, 14336x4096
      {5, 4, 1, {1, 0, 0}},  // 96 registers: 8192x8192, 8192x28672, 10240x8192
      {}, {}, {}}},
    {3, 4, 3, {2, 1, 0}},  // 28672x4096
    {1, 16, 3, {1, 2, 0}},  // 127 registers: 1024x8192, 2048x4096
    4096,
    12288,
    100,
    false,
};

// The family set for `nb` token blocks (nullptr past NB 4).
const Families* FamiliesFor(WeightFormat format, int nb) {
  static constexpr const Families* kZ12[] = {&kZ12Nb1, &kZ12Nb2, &kZ12Nb3, &kZ12Nb4};
  static constexpr const Families* kBf16[] = {&kBf16Nb1, &kBf16Nb2, &kBf16Nb3, &kBf16Nb4};
  if (nb < 1 || nb > 4) return nullptr;
  return format == WeightFormat::kZ12 ? kZ12[nb - 1] : kBf16[nb - 1];
}

// A kernel that two families share must be counted with the same CTAs per SM.
constexpr bool FamiliesCountAlike(const Families& fam) {
  const Family* all[] = {&fam.wide,   &fam.mid[0], &fam.mid[1], &fam.mid[2],     &fam.mid[3],
                         &fam.mid[4], &fam.many,   &fam.single, &fam.single_alt};
  for (const Family* a : all) {
    for (const Family* b : all) {
      if (a->nw != b->nw || a->pipe != b->pipe || a->ctas_per_sm == b->ctas_per_sm) continue;
      for (int ua : a->ugs) {
        for (int ub : b->ugs) {
          if (ua != 0 && ua == ub) return false;
        }
      }
    }
  }
  return true;
}
// Apart from the optional single family (fewer still), the wide family holds the fewest CTAs per
// SM and mid lists the others in ascending order (the order the rule tries them in when the grid
// fits the wide family, best_fill_only ones left out), empty slots last.
constexpr bool FamiliesAscend(const Families& fam) {
  if (fam.single.ctas_per_sm != 0 && fam.single.ctas_per_sm >= fam.wide.ctas_per_sm) return false;
  if (fam.single_alt.ctas_per_sm != 0 && fam.single_alt.ctas_per_sm != fam.single.ctas_per_sm) {
    return false;
  }
  int last = fam.wide.ctas_per_sm;
  bool empty_seen = false;
  for (const Family& f : fam.mid) {
    if (f.ctas_per_sm == 0) {
      empty_seen = true;
      continue;
    }
    if (empty_seen || f.ctas_per_sm <= last) return false;
    last = f.ctas_per_sm;
  }
  return true;
}
static_assert(FamiliesAscend(kZ12Nb1) && FamiliesAscend(kZ12Nb2) && FamiliesAscend(kZ12Nb3) &&
                  FamiliesAscend(kZ12Nb4) && FamiliesAscend(kBf16Nb1) &&
                  FamiliesAscend(kBf16Nb2) && FamiliesAscend(kBf16Nb3) && FamiliesAscend(kBf16Nb4),
              "families out of order");
static_assert(FamiliesCountAlike(kZ12Nb1) && FamiliesCountAlike(kZ12Nb2) &&
                  FamiliesCountAlike(kZ12Nb3) && FamiliesCountAlike(kZ12Nb4) &&
                  FamiliesCountAlike(kBf16Nb1) && FamiliesCountAlike(kBf16Nb2) &&
                  FamiliesCountAlike(kBf16Nb3) && FamiliesCountAlike(kBf16Nb4),
              "a kernel listed in two families with different CTAs per SM");

// Split K only when the row blocks leave more than a tenth of the SMs idle and K is at least
// the family set's min_split_k, then as far as a grid of two CTAs per SM while each split keeps
// 2048 columns: on the H200 (session 4, the family kernels of then), 1024xK took S = 4 for
// K = 8192..28672 (S = 2: 3-13 % slower), 512x8192 S = 4 (S = 8: 12 % slower), 256x32768 S = 8;
// 2048x4096 and 2048x8192 (128 row blocks) ran fastest unsplit, and so did 1024x4096 (4.59 us;
// S = 2: 5.35), whose whole GEMV is shorter than a split's cost. (12-bit sweeps; the plain
// kernel's agree but for 1024x8192, where S = 4 is 1.13x the unsplit best.) Session 6's one-CTA
// family for the 12-bit NB 1 kernel runs 1024x8192 and 1024x11008 faster unsplit (kZ12Nb1).
constexpr int64_t kMinSplitColumns = 2048;
constexpr int kMaxSplitCtasPerSm = 2;

// The share of the last wave's slots that the grid fills, over all its waves.
double WaveFill(int64_t need, int ctas_per_sm) {
  const int64_t waves = (need + ctas_per_sm - 1) / ctas_per_sm;
  return static_cast<double>(need) / static_cast<double>(waves * ctas_per_sm);
}

// The share of the slots of all its waves that a grid of `ctas` fills: unlike WaveFill, a grid
// under one wave counts as partly empty (192 CTAs in 264 slots: 0.73).
double GridFill(int64_t ctas, int ctas_per_sm, int sm_count) {
  const int64_t slots = int64_t{ctas_per_sm} * sm_count;
  return static_cast<double>(ctas) / static_cast<double>((ctas + slots - 1) / slots * slots);
}

// The row-block (RB 2 or 4) kernel whose grid fills the last wave best, if that is within
// kRowBlockFillSlack of the RB 1 family's fill (unsplit 12-bit NB 2 to 4 launches). NB 2 counts
// fill by WaveFill, as it was fitted; NB 3 and 4 by GridFill: NB 3's RB 2 family holds 2 CTAs per
// SM, and 6144x4096's 192 CTAs ran 1.17x slower than the RB 1 family's 384 in 396 slots (m = 24),
// which WaveFill rates alike.
std::optional<KernelConfig> MoreRowBlocks(const GemvShape& launch, int nb, int sm_count,
                                          int rb1_ctas_per_sm) {
  const int64_t row_blocks = launch.n / 16;
  const int64_t groups = launch.k / 64;
  const auto fill_of = [&](int64_t ctas, int ctas_per_sm) {
    return nb == 2 ? WaveFill((ctas + sm_count - 1) / sm_count, ctas_per_sm)
                   : GridFill(ctas, ctas_per_sm, sm_count);
  };
  const double fill_rb1 = fill_of(row_blocks, rb1_ctas_per_sm);
  std::optional<KernelConfig> best;
  double best_fill = 0;
  for (const RowBlockFamily& f : RowBlockFamilies(nb)) {
    // A fraction of the CTAs of a grid that leaves SMs idle run slower (2048x768 at m = 16 on the
    // H200: 64 CTAs of z12.nw4.ug1.nb2.pipe3.rb2 4.53 us, 128 of its RB 1 kernel 3.73), so only
    // where the grid gives every SM a CTA.
    if (row_blocks % f.rb != 0 || row_blocks / f.rb < sm_count || launch.k < f.min_k) continue;
    const KernelConfig c = RowBlockKernel(f, nb);
    if (!Validate(c, launch, DefaultDeviceLimits()).ok() || !LongAndBalanced(groups, c)) continue;
    const double fill = fill_of(row_blocks / f.rb, f.family.ctas_per_sm);
    if (!best || fill > best_fill) {
      best = c;
      best_fill = fill;
    }
  }
  if (best && best_fill >= fill_rb1 - kRowBlockFillSlack) return best;
  return std::nullopt;
}

// Of the single family's kernels and single_alt's (unsplit), the valid one with at least
// `min_trips` trips per warp whose busiest warp takes the fewest trips, then the one whose shares
// are the most even (the busiest warp against the mean), then single's before single_alt's, each
// family's UGs in their order.
std::optional<KernelConfig> FewestTrips(const Families& fam, WeightFormat format,
                                        const GemvShape& launch, int nb, int64_t min_trips) {
  const int64_t groups = launch.k / 64;
  std::optional<KernelConfig> best;
  std::tuple<int64_t, double, int, int> best_score;
  const Family* both[] = {&fam.single, &fam.single_alt};
  for (int which = 0; which < 2; ++which) {
    const Family& f = *both[which];
    for (int i = 0; i < static_cast<int>(f.ugs.size()) && f.ugs[i] != 0; ++i) {
      const KernelConfig c{format, f.nw, f.ugs[i], nb, f.pipe, 1};
      if (!Validate(c, launch, DefaultDeviceLimits()).ok() ||
          !LongAndBalanced(groups, c, min_trips, kMaxShortWarpImbalance)) {
        continue;
      }
      const internal::SliceTrips t = internal::TripsOf(groups, c);
      const std::tuple<int64_t, double, int, int> score{
          t.busiest, static_cast<double>(t.busiest * c.nw) / static_cast<double>(t.trips), which,
          i};
      if (!best || score < best_score) {
        best = c;
        best_score = score;
      }
    }
  }
  return best;
}

std::optional<KernelConfig> Shaped(const GemvShape& shape, WeightFormat format, int nb,
                                   int sm_count, bool allow_row_blocks) {
  const Families* families = FamiliesFor(format, nb);
  if (families == nullptr) return std::nullopt;
  const Families& fam = *families;
  const GemvShape launch{std::min<int64_t>(shape.m, 8 * nb), shape.n, shape.k};
  const DeviceLimits limits = DefaultDeviceLimits();
  const int64_t row_blocks = shape.n / 16;
  const int64_t groups = shape.k / 64;
  if (row_blocks == 0 || groups == 0) return std::nullopt;  // Validate names the problem
  // S = 1 when the row blocks leave at most a tenth of the SMs idle or K is short; else the
  // splits that keep kMinSplitColumns, largest first, from the largest that stays within
  // kMaxSplitCtasPerSm, and S = 1 last.
  std::vector<int> splits;
  // (min_split_k was measured down to 1024 rows; fewer row blocks than a quarter of the SMs keep
  // the default.)
  const int64_t min_split_k = row_blocks * 4 >= sm_count ? fam.min_split_k : kMinSplitK;
  if (row_blocks * 10 < int64_t{sm_count} * 9 && shape.k >= min_split_k) {
    for (auto it = kSplits.rbegin(); it != kSplits.rend(); ++it) {
      const int s = *it;
      if (s > 1 && groups % s == 0 && shape.k / s >= kMinSplitColumns &&
          row_blocks * s <= int64_t{kMaxSplitCtasPerSm} * sm_count) {
        splits.push_back(s);
      }
    }
  }
  splits.push_back(1);
  // The tiniest grids, where the families would not split: a fixed split and kernel (thresholds
  // measured on 132 SMs, scaled with the SM count; only grids that leave SMs idle).
  for (const TinySplit& t : fam.tiny) {
    if (t.s == 0 || row_blocks * 132 > t.max_row_blocks * sm_count || shape.k < t.min_k ||
        shape.k >= kMinSplitK || groups % t.s != 0 || row_blocks * 10 >= int64_t{sm_count} * 9) {
      continue;
    }
    const KernelConfig c{format, t.nw, t.ug, nb, t.pipe, t.s};
    if (Validate(c, launch, limits).ok()) return c;
  }
  // mid: every mid family; fallbacks: those that may also stand in for others.
  std::vector<const Family*> mid, fallbacks;
  for (const Family& f : fam.mid) {
    if (f.ctas_per_sm == 0) continue;
    mid.push_back(&f);
    if (!f.best_fill_only) fallbacks.push_back(&f);
  }
  for (int s : splits) {
    const int64_t need = (row_blocks * s + sm_count - 1) / sm_count;  // CTAs per SM, one wave
    // Families in order of preference: the first valid UG with min_trips trips per warp or
    // more (below) and equal or balanced shares is taken.
    std::vector<const Family*> by_fill = mid;
    std::stable_sort(by_fill.begin(), by_fill.end(), [&](const Family* a, const Family* b) {
      const double fill_a = WaveFill(need, a->ctas_per_sm);
      const double fill_b = WaveFill(need, b->ctas_per_sm);
      if (fill_a != fill_b) return fill_a > fill_b;
      return a->ctas_per_sm > b->ctas_per_sm;  // equal waste: fewer waves
    });
    // A best_fill_only family is tried first if it fills best, the grid is a mid one and K is
    // long enough, else not at all.
    const bool best_fill_taken =
        need > fam.wide.ctas_per_sm && need <= kMaxShapedCtasPerSm && shape.k >= kBestFillOnlyMinK;
    std::vector<const Family*> kept;
    for (size_t i = 0; i < by_fill.size(); ++i) {
      if (!by_fill[i]->best_fill_only || (i == 0 && best_fill_taken)) kept.push_back(by_fill[i]);
    }
    by_fill = kept;
    std::vector<const Family*> order;
    if (need <= fam.wide.ctas_per_sm) {
      order.push_back(&fam.wide);
      order.insert(order.end(), fallbacks.begin(), fallbacks.end());
      order.push_back(&fam.many);
    } else if (need <= kMaxShapedCtasPerSm) {
      order = by_fill;
      order.push_back(&fam.many);
      order.push_back(&fam.wide);
    } else {
      order.push_back(&fam.many);
      order.insert(order.end(), by_fill.begin(), by_fill.end());
      order.push_back(&fam.wide);
    }
    // Trips per warp a family's UG needs: fewer for the starved grids of some family sets, from
    // K = 2048 (at K = 1024 one trip was slower on the H200: 2048x1024 at m = 16 with UG 2 4.06
    // us, UG 1 and two trips 3.91).
    const int64_t min_trips =
        s == 1 && shape.k >= kStarvedMinK &&
                row_blocks * 100 <= int64_t{sm_count} * fam.starved_max_sm_pct
            ? fam.starved_min_trips
            : kMinTripsPerWarp;
    // Grids of one CTA per SM at most take the single family first, if each CTA's share of K is
    // long enough and the grid leaves enough SMs idle.
    if (fam.single.ctas_per_sm > 0 && need <= fam.single.ctas_per_sm &&
        (s == 1 || fam.single_split) && shape.k / s >= fam.single_min_k &&
        row_blocks * s * 100 <= int64_t{sm_count} * fam.single_max_sm_pct) {
      // (No RB 2 step here: its grid would leave SMs idle, which MoreRowBlocks refuses.)
      if (s == 1 && fam.single_alt.ctas_per_sm > 0) {
        if (std::optional<KernelConfig> c = FewestTrips(fam, format, launch, nb, min_trips)) {
          return c;
        }
      }
      order.insert(order.begin(), &fam.single);
    }
    // A family's UGs in its order of preference, equal shares or balanced ones alike: on the
    // H200 the preferred UG's uneven shares beat a later UG's equal ones (3584x18944 at m = 16:
    // z12.nw8.ug4.nb2.pipe4 28.93 us, z12.nw8.ug1.nb2.pipe4 30.30; at m = 1 UG 2 26.06, UG 1
    // 26.27; 4096x11008 at m = 1: 18.02 against 17.99).
    for (const Family* f : order) {
      for (int ug : f->ugs) {
        if (ug == 0) break;
        const KernelConfig c{format, f->nw, ug, nb, f->pipe, s};
        if (!Validate(c, launch, limits).ok() || !LongAndBalanced(groups, c, min_trips)) continue;
        if (s > 1 && shape.k / s <= kMinSplitColumns &&
            MinTripsPerWarp(groups, c) < fam.narrow_split_min_trips) {
          continue;
        }
        if (allow_row_blocks && format == WeightFormat::kZ12 && s == 1) {
          if (std::optional<KernelConfig> r = MoreRowBlocks(launch, nb, sm_count, f->ctas_per_sm)) {
            return r;
          }
        }
        return c;
      }
    }
  }
  return std::nullopt;
}

}  // namespace

namespace internal {

std::vector<HeuristicFamilyKernel> HeuristicFamilyKernels() {
  std::vector<HeuristicFamilyKernel> out;
  for (WeightFormat format : {WeightFormat::kZ12, WeightFormat::kBf16}) {
    for (int nb = 1; nb <= kMaxTokenBlocks; ++nb) {
      const Families* families = FamiliesFor(format, nb);
      if (families == nullptr) continue;
      const Families& fam = *families;
      std::vector<const Family*> all = {&fam.wide, &fam.many};
      for (const Family& f : fam.mid) {
        if (f.ctas_per_sm > 0) all.push_back(&f);
      }
      if (fam.single.ctas_per_sm > 0) all.push_back(&fam.single);
      if (fam.single_alt.ctas_per_sm > 0) all.push_back(&fam.single_alt);
      for (const Family* f : all) {
        for (int ug : f->ugs) {
          if (ug == 0) break;
          const KernelConfig c{format, f->nw, ug, nb, f->pipe, 1};
          bool seen = false;  // listed twice: counted alike (FamiliesCountAlike)
          for (const HeuristicFamilyKernel& k : out) seen = seen || k.config == c;
          if (!seen) out.push_back({c, f->ctas_per_sm});
        }
      }
    }
  }
  for (int nb = 1; nb <= kMaxTokenBlocks; ++nb) {
    for (const RowBlockFamily& f : RowBlockFamilies(nb)) {
      out.push_back({RowBlockKernel(f, nb), f.family.ctas_per_sm});
    }
  }
  return out;
}

}  // namespace internal

namespace {

KernelConfig Heuristic(const GemvShape& shape, WeightFormat format, int sm_count,
                       bool allow_row_blocks) {
  sm_count = std::max(sm_count, 1);
  // One launch's rows: m above 32 runs as equal chunks (LaunchRowsFor), each planned alone.
  const GemvShape s{internal::LaunchRowsFor(shape.m), shape.n, shape.k};
  const int nb_wanted = internal::TokenBlocksFor(s.m);
  // Fewer token blocks than m needs only when K admits no NW >= NB (the plain kernel's K = 64 *
  // odd with m > 8, say; the 12-bit kernel's only K/64 < NB): the caller then runs smaller chunks
  // (GemvPlan::chunk_m).
  for (int nb = nb_wanted; nb >= 1; --nb) {
    // K that no family takes gets BestWithTokenBlocks: ShortKFallback for 12-bit K below
    // kMinSplitK at NB 1-2, else the lexicographic rule.
    if (std::optional<KernelConfig> c = Shaped(s, format, nb, sm_count, allow_row_blocks)) {
      return *c;
    }
    if (std::optional<KernelConfig> c = BestWithTokenBlocks(s, format, nb, sm_count)) return *c;
  }
  // Only shapes no kernel takes (N % 16, K % 64) get here; Validate names their problem.
  return KernelConfig{format, 8, 1, nb_wanted, 3, 1};
}

}  // namespace

namespace internal {

KernelConfig HeuristicConfigWithoutRowBlocks(const GemvShape& shape, WeightFormat format,
                                             int sm_count) {
  return Heuristic(shape, format, sm_count, /*allow_row_blocks=*/false);
}

}  // namespace internal

KernelConfig HeuristicConfig(const GemvShape& shape, WeightFormat format, int sm_count) {
  return Heuristic(shape, format, sm_count, /*allow_row_blocks=*/true);
}

}  // namespace gemvz
