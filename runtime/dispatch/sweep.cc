// What the tuner times for a shape (the sweep space) and what warm-up compiles by default.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "gemvz/dispatch.h"
#include "runtime/dispatch/dispatcher.h"

namespace gemvz {
namespace {

// NW 3 (uneven shares on power-of-two K) won six of the suite's rows in session 10; NW 7 three
// of its group-major rows in session 12 (NW 5 came within 0.2 % of two), at S = 1, the only S
// that NW 5 and 7 are timed with (they share K among the warps more evenly than 4 or 8 would).
constexpr int kSweepNw[] = {1, 2, 3, 4, 5, 6, 7, 8, 12, 16};
constexpr int kSweepUg[] = {1, 2, 4};
constexpr int kSweepSplits[] = {1, 2, 3, 4, 6, 8};

// DESIGN.md's benchmark suite (N, K).
constexpr int64_t kSuite[][2] = {{4096, 8192},  {6144, 4096},  {4096, 4096}, {28672, 4096},
                                 {4096, 14336}, {10240, 8192}, {8192, 28672}};

}  // namespace

std::vector<KernelConfig> SweepSpace(const GemvShape& shape, WeightFormat format) {
  // m above one launch's 32 rows is timed as the equal chunks it will run in.
  const int64_t rows = internal::LaunchRowsFor(shape.m);
  const int nb_min = internal::TokenBlocksFor(rows);
  const GemvShape launch{rows, shape.n, shape.k};
  const DeviceLimits limits = DefaultDeviceLimits();
  const int64_t groups = shape.k / 64;
  std::vector<KernelConfig> out;
  absl::flat_hash_set<KernelConfig> seen;
  for (int nb = nb_min; nb <= std::min(nb_min + 1, internal::kMaxTokenBlocks); ++nb) {
    for (int nw : kSweepNw) {
      for (int ug : kSweepUg) {
        // z12's PIPE 4..8 (register caps) are measured like the rest; bf16 has 0..3.
        for (int pipe = 0; pipe <= MaxPipe(format); ++pipe) {
          for (int s : kSweepSplits) {
            if ((nw == 5 || nw == 7) && s != 1) continue;
            // z12's two row blocks per CTA where they can pay: with NB >= 2 (x's fragments are
            // then the larger share of a warp's registers; at NB 1 they gained nothing on the
            // H200) and UG 1 or 2, or UG 4 at NB 2 (a warp then holds eight groups' weights: two
            // group-major rows of session 12); four with UG 1 (S = 1 only; at NB 4 since session
            // 9, NB 2 and 3 since session 11).
            const bool z12 = format == WeightFormat::kZ12;
            const int max_rb = z12 && nb >= 2 && ug == 1 && s == 1                   ? 4
                               : z12 && nb >= 2 && (ug <= 2 || (ug == 4 && nb == 2)) ? 2
                                                                                     : 1;
            for (int rb = 1; rb <= max_rb; rb *= 2) {
              // The rolling loop (PIPE 9..13) only where it was level or ahead (session 19,
              // docs/BENCHMARKS.md): NB >= 2, UG 1, RB 2 or 4, S 1. With more units a trip its
              // capped kernels spilled 140-1140 bytes; at NB 1 it gained nothing.
              if (pipe >= 9 && (nb < 2 || ug != 1 || rb < 2 || s != 1)) continue;
              const KernelConfig c{format, nw, ug, nb, pipe, s, rb};
              // Uneven shares of K only where the busiest warp is near the mean.
              if (!Validate(c, launch, limits).ok() || !internal::Balanced(groups, c)) continue;
              if (seen.insert(c).second) out.push_back(c);
            }
          }
        }
      }
    }
  }
  return out;
}

std::vector<KernelConfig> DefaultWarmupConfigs() {
  std::vector<KernelConfig> all;
  auto add = [&](const KernelConfig& c) { all.push_back(c); };
  // The table's rows (m = 17..32 on the suite come from its m = 24 and 32 rows, in each shape's
  // default order), then the heuristic's choices below them.
  for (const TunedChoice& choice : BuiltinTunedTable()) add(choice.config);
  for (WeightFormat format : {WeightFormat::kZ12, WeightFormat::kBf16}) {
    for (const auto& nk : kSuite) {
      for (int64_t m = 1; m <= 16; ++m) add(HeuristicConfig(GemvShape{m, nk[0], nk[1]}, format));
    }
  }
  // Every kernel the heuristic's shaped rule can pick, so that shapes outside the table (a 70B
  // model's o and gate_up, say) start warm too.
  for (const internal::HeuristicFamilyKernel& k : internal::HeuristicFamilyKernels()) {
    add(k.config);
  }
  // The same in the other weight order: the heuristic serves any order (InOrder), and a 12-bit
  // matrix is uploaded group-major where its shape's tuning-file entries or table rows are, or
  // where UploadOptions or GEMVZ_WEIGHT_ORDER say so; then m without an entry of its own
  // (2..7, say, when m = 1, 8 and 16 were tuned) runs the heuristic's group-major kernels.
  for (const internal::HeuristicFamilyKernel& k : internal::HeuristicFamilyKernels()) {
    if (k.config.format == WeightFormat::kZ12) {
      add(internal::InOrder(k.config, WeightOrder::kGroupMajor));
    }
  }
  return internal::DistinctKernels(all);
}

absl::StatusOr<std::vector<KernelConfig>> TunedWarmupConfigs(const std::string& arch) {
  absl::StatusOr<std::vector<TunedChoice>> choices = LoadTunedChoices();
  if (!choices.ok()) return choices.status();
  std::vector<KernelConfig> out;
  for (const TunedChoice& c : *choices) {
    if (c.arch == arch) out.push_back(c.config);
  }
  return internal::DistinctKernels(out);
}

}  // namespace gemvz
