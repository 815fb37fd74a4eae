// The fused GEMV on the GPU against a double-precision CPU reference: a broad configuration sweep,
// every dispatcher choice, m from 1 to 64, exception probes, dense rows, determinism, graphs,
// concurrent streams and every error path. Skips cleanly without a GPU.
#include "gemvz/gemv.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gemvz/dispatch.h"
#include "gemvz/runtime.h"
#include "gtest/gtest.h"
#include "kernel_sources/gemv_params.cuh"
#include "runtime/common/env.h"
#include "runtime/common/status_macros.h"
#include "runtime/cuda/driver.h"
#include "runtime/dispatch/dispatcher.h"
#include "runtime/gemv/autotune.h"
#include "runtime/gemv/device_state.h"
#include "runtime/jit/config_list.h"
#include "runtime/jit/kernel_cache.h"
#include "tests/support/gpu_util.h"
#include "tests/support/jit_test_util.h"
#include "tests/support/random_weights.h"
#include "tests/support/temp_files.h"

namespace gemvz {
namespace {

using testing::DeviceBuffer;
using testing::Distribution;
using testing::FreshSeed;

using testing::kPoison;
using testing::TestStream;

// The configurations of `format` over the given NW and S values, every UG (1, 2, 4), NB (1-4),
// PIPE and, for z12, RB (1, 2, 4), that Validate accepts for one token row on [n, k], in that
// nesting order.
std::vector<KernelConfig> ValidConfigs(WeightFormat format, int64_t n, int64_t k,
                                       std::initializer_list<int> nws,
                                       std::initializer_list<int> splits) {
  std::vector<KernelConfig> configs;
  for (int nw : nws)
    for (int ug : {1, 2, 4})
      for (int nb = 1; nb <= 4; ++nb)
        for (int pipe = 0; pipe <= MaxPipe(format); ++pipe)
          for (int s : splits)
            for (int rb = 1; rb <= (format == WeightFormat::kZ12 ? 4 : 1); rb *= 2) {
              const KernelConfig c{format, nw, ug, nb, pipe, s, rb};
              if (Validate(c, GemvShape{1, n, k}).ok()) configs.push_back(c);
            }
  return configs;
}

// One matrix on the GPU with its host copy, and a runner that checks one GEMV call.
struct Problem {
  int64_t n, k;
  std::vector<uint16_t> w;
  DeviceMatrix dm;

  static Problem Make(int64_t n, int64_t k, std::vector<uint16_t> w, bool plain = false,
                      const UploadOptions& upload = {}) {
    Problem p{n, k, std::move(w), {}};
    auto dm = plain ? DeviceMatrix::UploadPlain(p.w.data(), n, k)
                    : DeviceMatrix::FromBf16(p.w.data(), n, k, 0, upload);
    EXPECT_TRUE(dm.ok()) << dm.status();
    if (dm.ok()) p.dm = *dm;
    return p;
  }

  // Runs Gemv with m rows of fresh x (or x_in) on `stream` (nullptr: the legacy default stream)
  // and compares to the reference, the output followed by a poisoned guard
  // (testing::CheckGemv); returns the error text.
  std::string Check(int64_t m, const GemvOptions& opt, uint64_t seed,
                    const std::vector<uint16_t>* x_in = nullptr, CUstream stream = nullptr) const {
    const std::vector<uint16_t> x = x_in ? *x_in : testing::RandomActivations(m, k, seed);
    return testing::CheckGemv(dm, w, x, m, opt, stream);
  }
};

std::vector<uint16_t> MixedWeights(int64_t n, int64_t k, uint64_t seed) {
  auto w = testing::RandomMatrix(n, k, Distribution::kTiny, seed);
  // An all-zero (dense) row; one in the next row block, so RB 2's CTAs meet a dense row in their
  // second block too; and one in the fourth, the upper half of RB 4's 64-bit dense-row mask.
  for (const int64_t row : {n / 2 + 3, n / 2 + 16 + 5, n / 2 + 48 + 9}) {
    std::fill(w.begin() + row * k, w.begin() + (row + 1) * k, uint16_t{0});
  }
  return w;
}

TEST(GemvOptions, PdlFromTheEnvironment) {  // no GPU needed
  EXPECT_EQ(*internal::PdlFromEnv(std::nullopt), Pdl::kOff);
  EXPECT_EQ(*internal::PdlFromEnv(""), Pdl::kOff);
  EXPECT_EQ(*internal::PdlFromEnv("0"), Pdl::kOff);
  EXPECT_EQ(*internal::PdlFromEnv("1"), Pdl::kAuto);
  EXPECT_EQ(*internal::PdlFromEnv("auto"), Pdl::kAuto);
  EXPECT_EQ(*internal::PdlFromEnv("always"), Pdl::kAlways);
  const absl::StatusOr<Pdl> bad = internal::PdlFromEnv("yes please");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("GEMVZ_PDL"), std::string::npos);
  EXPECT_NE(bad.status().message().find("'yes please'"), std::string::npos);
}

// A dense row's CTA comes on top of the row blocks' (RB 1: one each), so an upload whose grid
// could pass the x limit is refused, naming it; one at the limit is not. No GPU needed.
TEST(GemvOptions, DenseRowsCountAgainstTheGridLimit) {
  DeviceLimits limits = DefaultDeviceLimits();
  limits.max_grid_x = 1000;
  EXPECT_TRUE(internal::CheckDenseRowGrid(16 * 990, 10, limits).ok());
  const absl::Status st = internal::CheckDenseRowGrid(16 * 990, 11, limits);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("grid's x limit (1000)"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("11 dense rows"), std::string::npos) << st.message();
  // The H200's limit: the largest packable matrix (2^31 - 16 rows), every row dense, is refused.
  EXPECT_FALSE(
      internal::CheckDenseRowGrid(int64_t{2147483632}, int64_t{2147483632}, DefaultDeviceLimits())
          .ok());
  EXPECT_TRUE(internal::CheckDenseRowGrid(int64_t{2147483632}, 0, DefaultDeviceLimits()).ok());
}

// Without a GPU (CI) the workspace calls say why they cannot run rather than crash; with one, a
// device that does not exist is an error too.
TEST(GemvOptions, WorkspaceCallsWithoutADevice) {
  const int device = internal::DeviceCount() == 0 ? 0 : 99;
  absl::StatusOr<int64_t> bytes = GemvWorkspaceBytes(nullptr, device);
  EXPECT_FALSE(bytes.ok());
  absl::Status st = ReleaseGemvWorkspace(nullptr, device);
  EXPECT_FALSE(st.ok());
  EXPECT_FALSE(st.message().empty());
}

TEST(Gemv, BroadConfigurationSweep) {
  GEMVZ_REQUIRE_GPU();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const int64_t n = 256, k = 4096;
  const Problem z = Problem::Make(n, k, MixedWeights(n, k, seed));
  const Problem b = Problem::Make(n, k, MixedWeights(n, k, seed), /*plain=*/true);
  ASSERT_EQ(z.dm.format(), WeightFormat::kZ12);
  std::vector<KernelConfig> configs;
  for (WeightFormat f : {WeightFormat::kZ12, WeightFormat::kBf16}) {
    const std::vector<KernelConfig> valid = ValidConfigs(f, n, k, {1, 2, 4, 8, 16}, {1, 2, 4});
    configs.insert(configs.end(), valid.begin(), valid.end());
  }
  // Compile everything in parallel first.
  auto arch = internal::DeviceArch(0);
  ASSERT_TRUE(arch.ok());
  auto compiled = PrecompileAll(internal::DistinctKernels(configs), *arch, 0);
  ASSERT_TRUE(compiled.ok()) << compiled.status();
  // Extreme corners of the space may spill (e.g. NW=16 with PIPE 2's two-blocks-per-SM register
  // cap); they must still be right. The default table's kernels are checked for spills elsewhere.
  int spilling = 0;
  for (const auto& r : *compiled) spilling += r.spill_bytes > 0;
  std::mt19937 rng(static_cast<uint32_t>(seed));
  int tested = 0;
  for (const KernelConfig& c : configs) {
    // m: a random count that this NB covers (all of 1..8*NB over the sweep)
    const int64_t m = 1 + static_cast<int64_t>(rng() % (8 * c.nb));
    const Problem& p = c.format == WeightFormat::kZ12 ? z : b;
    const std::string err = p.Check(m, GemvOptions{c}, seed + tested);
    EXPECT_EQ(err, "") << c.ToString() << " m=" << m;
    ++tested;
  }
  std::printf("[ info ] %d configurations checked (%d kernels, %d of them spill)\n", tested,
              static_cast<int>(compiled->size()), spilling);
}

// The dispatcher's own choice for each shape at each m of `ms` (12-bit, or plain BF16 with
// `plain`) against the CPU reference.
void CheckDispatcherChoices(const std::vector<std::pair<int64_t, int64_t>>& shapes,
                            const std::vector<int64_t>& ms = {1, 8, 16}, bool plain = false) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << (plain ? ", plain BF16" : ", 12-bit"));
  for (auto [n, k] : shapes) {
    const Problem p =
        Problem::Make(n, k, testing::RandomMatrix(n, k, Distribution::kNormal, seed), plain);
    for (int64_t m : ms) {
      auto plan = PlanGemv(p.dm, m);
      ASSERT_TRUE(plan.ok()) << plan.status();
      if (!plain) EXPECT_EQ(plan->config.order, p.dm.order()) << plan->config.ToString();
      EXPECT_EQ(p.Check(m, {}, seed + m), "") << n << "x" << k << " m=" << m << " "
                                              << plan->config.ToString() << " (" << plan->source
                                              << ")";
    }
  }
}

// m = 17..32 too: the table's rows above 16, in each shape's default order, with their token
// blocks filled (24, 32) and partly filled (17, 25: the m = 24 and 32 rows, rows past m unstored).
TEST(Gemv, DispatcherChoicesOnTheSuite) {
  GEMVZ_REQUIRE_GPU();
  CheckDispatcherChoices({{4096, 8192},
                          {6144, 4096},
                          {4096, 4096},
                          {28672, 4096},
                          {4096, 14336},
                          {10240, 8192},
                          {8192, 28672}},
                         {1, 8, 16, 17, 24, 25, 32});
}

// K whose groups few warp counts divide: 43 groups (a prime), 86 and 172 (Llama-2-7B's K, the
// only one of the three that takes UG 4), so the 12-bit kernel's warps take uneven shares (counts
// one trip apart) at most NW, with and without split-K, RB 2 and 4 and every PIPE; the dense rows
// of MixedWeights and its exceptions fall in every share.
TEST(Gemv, UnevenSharesOfK) {
  GEMVZ_REQUIRE_GPU();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const int64_t n = 256;
  std::mt19937 rng(static_cast<uint32_t>(seed));
  int tested = 0, uneven = 0;
  for (const int64_t k : {64 * 43, 64 * 86, 64 * 172}) {
    const Problem z = Problem::Make(n, k, MixedWeights(n, k, seed + k));
    ASSERT_EQ(z.dm.format(), WeightFormat::kZ12);
    const std::vector<KernelConfig> configs =
        ValidConfigs(WeightFormat::kZ12, n, k, {2, 4, 6, 8, 16}, {1, 2});
    auto arch = internal::DeviceArch(0);
    ASSERT_TRUE(arch.ok());
    ASSERT_TRUE(PrecompileAll(internal::DistinctKernels(configs), *arch, 0).ok());
    for (const KernelConfig& c : configs) {
      const int64_t m = 1 + static_cast<int64_t>(rng() % (8 * c.nb));
      EXPECT_EQ(z.Check(m, GemvOptions{c}, seed + tested), "") << c.ToString() << " k=" << k
                                                                << " m=" << m;
      ++tested;
      uneven += !internal::EvenShares(k / 64, c);
    }
  }
  EXPECT_GT(uneven, 500);
  std::printf("[ info ] %d configurations checked, %d with uneven shares\n", tested, uneven);
}

// The dispatcher on real models' K that the warps cannot share evenly (Llama-2-7B's and
// Qwen2.5-7B's down projections, and a row-starved one that may split K).
TEST(Gemv, DispatcherChoicesOnOddK) {
  GEMVZ_REQUIRE_GPU();
  CheckDispatcherChoices({{4096, 11008}, {3584, 18944}, {1024, 11008}});
}

// Tall shapes outside the tuned table, where the heuristic streams several row blocks per CTA at
// m = 9..16: four (RB 4) on 27648x5120, two (RB 2) on 16384x4096.
TEST(Gemv, DispatcherChoicesOnTallShapes) {
  GEMVZ_REQUIRE_GPU();
  CheckDispatcherChoices({{27648, 5120}, {16384, 4096}}, {1, 8, 12, 16});
}

// Row-starved shapes, where the heuristic's one-CTA-per-SM family and its split rules take over
// (16 warps, UG 4/2/1, split 4, 6 or 8 ways or not; K / 64 = 80 and 144 leave only some UGs
// balanced; 512x5120 at m = 16 takes the tiniest grids' fixed split).
TEST(Gemv, DispatcherChoicesOnRowStarvedShapes) {
  GEMVZ_REQUIRE_GPU();
  CheckDispatcherChoices(
      {{1024, 8192}, {768, 9216}, {512, 5120}, {256, 8192}, {128, 32768}, {512, 12288}});
}

// Short K that no family takes (small models' hidden sizes: 960, 896, 768, 576): at m = 1 and 8
// the 12-bit fallback's unsplit NW 8 with uneven shares (960), NW 2 (896, 576) and NW 12 (768);
// at m = 16 NW 2 (896, 576) or the families' NW 4 kernel (960, 768), RB 1 where RB 2 would leave
// SMs idle (2048x768).
TEST(Gemv, DispatcherChoicesOnShortK) {
  GEMVZ_REQUIRE_GPU();
  CheckDispatcherChoices({{1600, 960}, {1152, 896}, {3072, 768}, {2048, 768}, {960, 576}});
}

// The tiniest grids (MoE routers and the like), m = 1 to 32: fixed splits below K = 8192, 4 or 8
// ways with slices of 8 to 28 groups, some of which NW 4, 8 or 16 warps take unevenly; one trip
// a warp unsplit; and NB 2's one-CTA choice of NW 12 with UG 4, on even (768x5120) and uneven
// shares (896x4864, the busiest warp 1.26x the mean). HeuristicTest.TiniestGrids pins which shape
// takes which.
TEST(Gemv, DispatcherChoicesOnTheTiniestGrids) {
  GEMVZ_REQUIRE_GPU();
  CheckDispatcherChoices({{64, 7168},
                          {48, 6144},
                          {128, 4096},
                          {448, 5632},
                          {256, 7168},
                          {96, 2048},
                          {768, 5120},
                          {896, 4864}},
                         {1, 8, 12, 16, 24, 32});
}

// m = 17..32 (NB 3 and 4): every kind of choice of the heuristic's NB 3-4 families: the wide
// one, the mid ones, RB 2 at NB 3 (8192x8192), RB 4 at NB 3 and 4 (14336x4096), the one-CTA
// family (2048x4096, 1024x8192), odd K (4096x11008: uneven shares for the 12-bit kernel, the
// plain kernel's lexicographic rule at NB 3); both formats.
TEST(Gemv, DispatcherChoicesForM17To32) {
  GEMVZ_REQUIRE_GPU();
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {8192, 8192}, {6144, 4096}, {10240, 4096}, {4096, 11008},
      {2048, 4096}, {1024, 8192}, {14336, 4096}};
  CheckDispatcherChoices(shapes, {17, 24, 25, 32});
  CheckDispatcherChoices(shapes, {17, 24, 25, 32}, /*plain=*/true);
}

TEST(Gemv, EveryMFrom1To64) {
  GEMVZ_REQUIRE_GPU();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const int64_t n = 512, k = 2048;
  const Problem z = Problem::Make(n, k, MixedWeights(n, k, seed));
  const Problem b = Problem::Make(n, k, MixedWeights(n, k, seed), true);
  for (int64_t m = 1; m <= 64; ++m) {
    EXPECT_EQ(z.Check(m, {}, seed + m), "") << "z12 m=" << m;
    EXPECT_EQ(b.Check(m, {}, seed + 100 + m), "") << "bf16 m=" << m;
  }
  // Above 32 rows the launches take equal chunks (17 + 16 rows for 33, 22 + 22 + 21 for 65), the
  // last one shorter by up to a row per launch.
  for (int64_t m : {65, 80, 97, 100}) {
    EXPECT_EQ(z.Check(m, {}, seed + m), "") << "z12 m=" << m;
    EXPECT_EQ(b.Check(m, {}, seed + 100 + m), "") << "bf16 m=" << m;
  }
  // (Whatever the plan's source: a tuning file may hold a configuration of fewer token blocks.)
  for (int64_t m : {33, 40, 48, 65, 100}) {
    const absl::StatusOr<GemvPlan> plan = PlanGemv(z.dm, m);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->chunk_m,
              std::min<int64_t>(internal::LaunchRowsFor(m), plan->config.tokens_per_launch()))
        << m << " " << plan->config.ToString() << " (" << plan->source << ")";
  }
}

TEST(Gemv, OddShapesGoToThePlainPath) {
  GEMVZ_REQUIRE_GPU();
  const uint64_t seed = FreshSeed();
  for (auto [n, k] : {std::pair<int64_t, int64_t>{100, 4096}, {256, 1000}, {33, 77}}) {
    const Problem p = Problem::Make(n, k, testing::RandomMatrix(n, k, Distribution::kNormal, seed));
    EXPECT_EQ(p.dm.format(), WeightFormat::kBf16);
    EXPECT_FALSE(p.dm.fallback_reason().empty());
    EXPECT_EQ(p.dm.weight_bytes(), 2 * n * k);  // gemv.h: 2 x rows x cols for plain BF16
    for (int64_t m : {1, 5, 16, 40}) EXPECT_EQ(p.Check(m, {}, seed + m), "") << n << "x" << k;
    // Asked plain: no fallback, so no reason.
    const Problem asked = Problem::Make(n, k, p.w, /*plain=*/true);
    EXPECT_EQ(asked.dm.format(), WeightFormat::kBf16);
    EXPECT_EQ(asked.dm.order(), WeightOrder::kBlockMajor);
    EXPECT_TRUE(asked.dm.fallback_reason().empty()) << asked.dm.fallback_reason();
    EXPECT_EQ(asked.dm.weight_bytes(), 2 * n * k);
  }
}

// Weights the 12-bit format cannot hold (NaN, Inf) in a packable shape: FromBf16 keeps them as
// plain BF16, saying why, as it does for a shape it cannot pack; the product carries them through.
TEST(Gemv, NonFiniteWeightsGoToThePlainPath) {
  GEMVZ_REQUIRE_GPU();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const int64_t n = 64, k = 256, m = 5;
  auto w = testing::RandomMatrix(n, k, Distribution::kNormal, seed);
  w[5 * k + 7] = 0x7FC0;  // NaN
  w[9 * k + 3] = 0xFF80;  // -Inf
  auto dm = DeviceMatrix::FromBf16(w.data(), n, k);
  ASSERT_TRUE(dm.ok()) << dm.status();
  EXPECT_EQ(dm->format(), WeightFormat::kBf16);
  EXPECT_NE(dm->fallback_reason().find("(row 5, col 7) is NaN"), std::string::npos)
      << dm->fallback_reason();
  const auto x = testing::RandomActivations(m, k, seed + 1);
  DeviceBuffer dx(x.size() * 2), dout(m * n * 2);
  dx.Upload(x.data(), x.size() * 2);
  dout.Fill16(kPoison);
  ASSERT_TRUE(Gemv(*dm, dx.as<uint16_t>(), m, dout.as<uint16_t>(), nullptr).ok());
  std::vector<uint16_t> got(m * n);
  dout.Download(got.data(), got.size() * 2);
  // Rows 5 and 9 come out non-finite; the rest against the reference of the other weights.
  auto w_finite = w;
  for (int64_t row : {5, 9}) {
    std::fill(w_finite.begin() + row * k, w_finite.begin() + (row + 1) * k, uint16_t{0});
    for (int64_t t = 0; t < m; ++t) {
      EXPECT_EQ(got[t * n + row] & 0x7F80, 0x7F80) << "token " << t << ", row " << row;
      got[t * n + row] = 0;
    }
  }
  std::vector<double> ref, abs_sum;
  testing::ReferenceGemv(w_finite, x, m, n, k, &ref, &abs_sum);
  EXPECT_EQ(testing::CompareToReference(got, ref, abs_sum, m, n), "");
}

// x is nonzero only on columns that hold exceptions: the decoded weights alone give a visibly
// wrong answer there; with the corrections the answer is exact.
TEST(Gemv, ExceptionProbe) {
  GEMVZ_REQUIRE_GPU();
  const uint64_t seed = FreshSeed();
  const int64_t n = 256, k = 4096, m = 8;
  auto w = testing::RandomMatrix(n, k, Distribution::kNormal, seed);
  // Plant out-of-window weights (tiny and huge) on a few columns of every row.
  const int64_t cols[] = {5, 700, 2049, 4095};
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c : cols) w[r * k + c] = (r % 2) ? 0x3001 /* ~4.7e-10 */ : 0x4280 /* 64 */;
  const Problem p = Problem::Make(n, k, w);
  std::vector<uint16_t> x(m * k, 0);
  for (int64_t t = 0; t < m; ++t)
    for (int64_t c : cols) x[t * k + c] = FloatToBf16(0.5f + 0.25f * t);
  for (int s : {1, 2, 4}) {
    for (int rb : {1, 2}) {
      KernelConfig c{WeightFormat::kZ12, 4, 1, 1, 3, s, rb};
      EXPECT_EQ(p.Check(m, GemvOptions{c}, seed, &x), "") << c.ToString();
    }
  }
  EXPECT_EQ(p.Check(m, {}, seed, &x), "");
}

TEST(Gemv, HeavyTailsZeroRowsAndSkew) {
  GEMVZ_REQUIRE_GPU();
  const uint64_t seed = FreshSeed();
  const int64_t n = 1024, k = 8192;
  auto w = testing::RandomMatrix(n, k, Distribution::kStudentT3, seed);
  for (int64_t c = 0; c < k; ++c) w[17 * k + c] = 0;                   // zero row
  for (int64_t c = 0; c < k; ++c) w[(n - 1) * k + c] = 0;              // last row zero too
  for (int64_t c = 0; c < k; c += 100) w[300 * k + c] = 0x0001;        // a row with 1 % tiny
  const Problem p = Problem::Make(n, k, w);
  for (int64_t m : {1, 8, 16}) EXPECT_EQ(p.Check(m, {}, seed + m), "") << "m=" << m;
  for (int s : {2, 4}) {
    EXPECT_EQ(p.Check(16, GemvOptions{KernelConfig{WeightFormat::kZ12, 8, 2, 2, 1, s}}, seed), "");
  }
  // Two row blocks per CTA: row 17's block is the second of its pair, row 300's the first.
  for (int s : {1, 2, 4}) {
    const KernelConfig c{WeightFormat::kZ12, 4, 1, 2, 3, s, 2};
    EXPECT_EQ(p.Check(16, GemvOptions{c}, seed), "") << c.ToString();
  }
}

// Rows with many exceptions. Up to kMaxRowEntries entries a row keeps its list, walked by its
// two lanes of the exception warp; above, it is dense, computed by a CTA of its own. Rows at the
// limit (8 smallest subnormals: 16 entries) and just past it (9), rows of 1 % and 12 % outliers
// (dense), a row block whose 16 rows have 3 each, a dense row beside a long list, a list crowded
// into one K slice, and the last row. Right against the reference and bitwise the same twice,
// with split-K, RB 2 and 4, NB 1, 2 and 4 and chunks of m.
TEST(Gemv, SkewedRowsRightAndDeterministic) {
  GEMVZ_REQUIRE_GPU();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const int64_t n = 256, k = 8192;
  auto w = testing::RandomMatrix(n, k, Distribution::kNormal, seed);
  auto outliers = [&](int64_t row, int64_t count, int64_t from, int64_t to) {
    for (int64_t i = 0; i < count; ++i) w[row * k + from + i * (to - from) / count] = 0x0001;
  };
  outliers(0, 983, 0, k);                     // 12 %
  outliers(2, kMaxRowEntries / 2, 0, k);      // 16 entries: the longest list
  outliers(3, kMaxRowEntries / 2 + 1, 0, k);  // 18: dense
  outliers(15, 82, 0, k);                     // 1 %, the block's last row
  for (int64_t row = 16; row < 32; ++row) outliers(row, 3, 64 * row, k);
  std::fill(w.begin() + 40 * k, w.begin() + 41 * k, uint16_t{0});  // dense
  outliers(41, kMaxRowEntries / 2, 0, k);
  outliers(70, kMaxRowEntries / 2, 0, 1024);  // crowded into the first K slice
  outliers(n - 1, 983, 0, k);
  const Problem p = Problem::Make(n, k, w);
  ASSERT_TRUE(p.dm.valid());
  std::vector<GemvOptions> options = {GemvOptions{}};
  for (const KernelConfig& c : {KernelConfig{WeightFormat::kZ12, 8, 1, 1, 2, 1},
                                KernelConfig{WeightFormat::kZ12, 8, 2, 2, 3, 4},
                                KernelConfig{WeightFormat::kZ12, 4, 1, 2, 3, 2, 2},
                                KernelConfig{WeightFormat::kZ12, 4, 2, 2, 5, 1, 4},
                                KernelConfig{WeightFormat::kZ12, 8, 1, 4, 3, 2}}) {
    options.push_back(GemvOptions{c});
  }
  for (const GemvOptions& opt : options) {
    const std::string name = opt.config ? opt.config->ToString() : "the dispatcher's";
    for (int64_t m : {1, 5, 8, 16, 27, 40}) {
      if (opt.config && m > 8 * opt.config->nb) continue;
      EXPECT_EQ(p.Check(m, opt, seed + m), "") << name << " m=" << m;
    }
  }
  // Bitwise the same twice (the sums' order is fixed), split-K included.
  const int64_t m = 16;
  auto x = testing::RandomActivations(m, k, seed);
  DeviceBuffer dx(x.size() * 2), dout(m * n * 2);
  dx.Upload(x.data(), x.size() * 2);
  for (const GemvOptions& opt : {options[0], options[2], options[3]}) {
    std::vector<uint16_t> first(m * n), again(m * n);
    for (std::vector<uint16_t>* out : {&first, &again}) {
      dout.Fill16(kPoison);
      ASSERT_TRUE(Gemv(p.dm, dx.as<uint16_t>(), m, dout.as<uint16_t>(), nullptr, opt).ok());
      dout.Download(out->data(), m * n * 2);
    }
    EXPECT_EQ(first, again);
  }
}

// Dense rows that hold values (the all-zero rows elsewhere would hide a wrong sum): rows scaled
// by 2^12, so that nearly all their weights lie above the window, are computed by a CTA of their
// own from the original BF16 values. K gives every thread of that CTA (up to 1024) at least one 16-byte chunk, so every
// warp's partial counts; the rows sit in the first, second and fourth row block (RB 2's and RB
// 4's later blocks), two in one block, and last; m covers the dense CTA's one-token loop (NB 1)
// and its four-token loop with a ragged last four (NB 2 and 4), and chunks of m.
TEST(Gemv, DenseRowsWithValues) {
  GEMVZ_REQUIRE_GPU();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const int64_t n = 256, k = 12288;  // k / 8 = 1536 chunks of 16 bytes
  auto w = testing::RandomMatrix(n, k, Distribution::kNormal, seed);
  const int64_t dense[] = {3, 16 + 5, 16 + 6, 48 + 15, n - 1};
  for (const int64_t row : dense) {
    for (int64_t c = 0; c < k; ++c) {
      uint16_t& b = w[row * k + c];
      if ((b & 0x7F80) != 0) b = static_cast<uint16_t>(b + (12 << 7));  // x 4096, exactly
    }
  }
  absl::StatusOr<PackedMatrix> packed = Pack(w.data(), n, k);
  ASSERT_TRUE(packed.ok()) << packed.status();
  ASSERT_EQ(packed->stats.dense_rows, 5) << "the test needs these five rows to be dense";
  const Problem p = Problem::Make(n, k, w);
  // The bytes a call reads, dense rows' values once: what the benchmark divides by.
  EXPECT_EQ(p.dm.weight_bytes(), packed->stats.total_bytes);
  for (const int64_t m : {1, 8, 13, 16, 29}) {
    EXPECT_EQ(p.Check(m, {}, seed + m), "") << "dispatcher, m=" << m;
  }
  const KernelConfig configs[] = {
      {WeightFormat::kZ12, 4, 1, 1, 3, 1, 1},   {WeightFormat::kZ12, 31, 1, 1, 0, 1, 1},
      {WeightFormat::kZ12, 16, 1, 1, 2, 2, 1},  {WeightFormat::kZ12, 8, 2, 2, 1, 3, 1},
      {WeightFormat::kZ12, 4, 1, 2, 3, 1, 2},   {WeightFormat::kZ12, 4, 1, 2, 11, 1, 4},
      {WeightFormat::kZ12, 8, 1, 4, 3, 1, 1},
  };
  for (const KernelConfig& c : configs) {
    ASSERT_TRUE(Validate(c, GemvShape{c.tokens_per_launch(), n, k}).ok()) << c.ToString();
    for (const int64_t m : {int64_t{1}, int64_t{c.tokens_per_launch()} - 3, int64_t{29}}) {
      EXPECT_EQ(p.Check(m, GemvOptions{c}, seed + 100 + m), "") << c.ToString() << " m=" << m;
    }
  }
}

// FP32 output is the unrounded sum: within FP32 accumulation error of the double reference, and
// its round-to-nearest-even BF16 is bitwise the BF16 call's output. Both row-block layouts, with
// and without split-K, and the dispatcher's own choice, on a matrix with dense rows.
TEST(Gemv, Fp32OutputIsTheUnroundedSum) {
  GEMVZ_REQUIRE_GPU();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const int64_t n = 512, k = 4096, m = 13;
  const Problem p = Problem::Make(n, k, MixedWeights(n, k, seed));
  const std::vector<uint16_t> x = testing::RandomActivations(m, k, seed + 1);
  std::vector<double> ref, abs_sum;
  testing::ReferenceGemv(p.w, x, m, n, k, &ref, &abs_sum);
  DeviceBuffer dx(x.size() * 2), d16(m * n * 2), d32(m * n * 4);
  dx.Upload(x.data(), x.size() * 2);
  for (const GemvOptions& opt :
       {GemvOptions{}, GemvOptions{KernelConfig{WeightFormat::kZ12, 4, 1, 2, 3, 1, 1}},
        GemvOptions{KernelConfig{WeightFormat::kZ12, 4, 1, 2, 3, 1, 2}},
        GemvOptions{KernelConfig{WeightFormat::kZ12, 4, 1, 2, 3, 4, 2}},
        GemvOptions{KernelConfig{WeightFormat::kZ12, 4, 2, 2, 5, 2, 2}},
        GemvOptions{KernelConfig{WeightFormat::kZ12, 4, 1, 2, 0, 1, 4}}}) {
    SCOPED_TRACE(opt.config ? opt.config->ToString() : std::string("dispatcher"));
    d16.Fill16(kPoison);
    d32.Fill16(kPoison);  // two NaN halves: a NaN float
    ASSERT_TRUE(Gemv(p.dm, dx.as<uint16_t>(), m, d16.as<uint16_t>(), nullptr, opt).ok());
    ASSERT_TRUE(GemvFp32(p.dm, dx.as<uint16_t>(), m, d32.as<float>(), nullptr, opt).ok());
    std::vector<uint16_t> got16(m * n);
    std::vector<float> got32(m * n);
    d16.Download(got16.data(), got16.size() * 2);
    d32.Download(got32.data(), got32.size() * 4);
    int bad = 0;
    for (int64_t i = 0; i < m * n && bad < 5; ++i) {
      // The BF16 check's accumulation term (2^-16 sum|w x|) without its rounding term (2^-8).
      const double tol = 1e-6 * std::abs(ref[i]) + std::ldexp(abs_sum[i], -16);
      if (!(std::abs(got32[i] - ref[i]) <= tol)) {
        ADD_FAILURE() << "fp32 out[" << i / n << "][" << i % n << "] = " << got32[i]
                      << ", reference " << ref[i] << " (tolerance " << tol << ")";
        ++bad;
      }
      if (FloatToBf16(got32[i]) != got16[i]) {
        ADD_FAILURE() << "out[" << i / n << "][" << i % n << "]: bf16 " << got16[i]
                      << " is not the rounded fp32 " << got32[i];
        ++bad;
      }
    }
  }
}

// GemvFp32 and Gemv on fresh x (m rows) with `opt`: every FP32 output within FP32 accumulation
// error of the double reference and rounding to the BF16 call's output, and a poisoned guard of
// one more token row and 64 values after the FP32 output untouched. Returns the error text.
std::string CheckFp32(const Problem& p, int64_t m, const GemvOptions& opt, uint64_t seed) {
  const int64_t n = p.n, k = p.k, guard = n + 64;
  const std::vector<uint16_t> x = testing::RandomActivations(m, k, seed);
  DeviceBuffer dx(x.size() * 2), d16(static_cast<size_t>(m * n * 2)),
      d32(static_cast<size_t>((m * n + guard) * 4));
  dx.Upload(x.data(), x.size() * 2);
  d16.Fill16(kPoison);
  d32.Fill16(kPoison);  // two NaN halves: a NaN float
  absl::Status st = GemvFp32(p.dm, dx.as<uint16_t>(), m, d32.as<float>(), nullptr, opt);
  if (!st.ok()) return absl::StrCat("GemvFp32: ", st.message());
  st = Gemv(p.dm, dx.as<uint16_t>(), m, d16.as<uint16_t>(), nullptr, opt);
  if (!st.ok()) return absl::StrCat("Gemv: ", st.message());
  std::vector<float> got32(static_cast<size_t>(m * n + guard));
  std::vector<uint16_t> got16(static_cast<size_t>(m * n));
  d32.Download(got32.data(), got32.size() * 4);
  d16.Download(got16.data(), got16.size() * 2);
  std::string err;
  for (int64_t i = m * n; i < m * n + guard; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &got32[i], 4);
    if (bits != 0x7FC17FC1u) {
      err = absl::StrCat("a store past the FP32 output: value ", i - m * n, " after the last\n");
      break;
    }
  }
  std::vector<double> ref, abs_sum;
  testing::ReferenceGemv(p.w, x, m, n, k, &ref, &abs_sum);
  int bad = 0;
  for (int64_t i = 0; i < m * n; ++i) {
    const double tol = 1e-6 * std::abs(ref[i]) + std::ldexp(abs_sum[i], -16);
    const bool wrong32 = !(std::abs(got32[i] - ref[i]) <= tol);
    const bool unrounded = FloatToBf16(got32[i]) != got16[i];
    if ((wrong32 || unrounded) && bad++ < 5) {
      absl::StrAppend(&err, "out[", i / n, "][", i % n, "]: fp32 ", got32[i], ", reference ",
                      ref[i], " (tolerance ", tol, "), bf16 bits 0x", absl::Hex(got16[i]), "\n");
    }
  }
  if (bad > 0) absl::StrAppend(&err, bad, " of ", m * n, " outputs wrong\n");
  return err;
}

// FP32 output where the launch path has more to place than one launch's rows: m above 32 in
// chunks (40: 20 + 20; 70: 24 + 24 + 22), each chunk's rows 4 bytes a value from the
// chunk's first row, and a forced NB 1 configuration (8 rows a launch: 13 = 8 + 5, with and
// without split-K); and plain BF16 matrices, whose kernel takes the FP32 flag in its own
// parameters: K a multiple of 64, and K padded (1000: x copied into the stream's zero-padded
// buffer at its own row stride), N not a multiple of 16 (200: the fallback of FromBf16).
TEST(Gemv, Fp32OutputInChunksAndOnThePlainPath) {
  GEMVZ_REQUIRE_GPU();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const Problem z = Problem::Make(512, 2048, MixedWeights(512, 2048, seed));
  const Problem plain = Problem::Make(512, 2048, MixedWeights(512, 2048, seed + 1), true);
  const Problem padded =
      Problem::Make(200, 1000, testing::RandomMatrix(200, 1000, Distribution::kNormal, seed + 2));
  ASSERT_EQ(z.dm.format(), WeightFormat::kZ12);
  ASSERT_EQ(plain.dm.format(), WeightFormat::kBf16);
  ASSERT_EQ(padded.dm.format(), WeightFormat::kBf16);
  ASSERT_FALSE(padded.dm.fallback_reason().empty());
  int run = 0;
  for (const Problem* p : {&z, &plain, &padded}) {
    const char* what = p == &z ? "z12" : p == &plain ? "plain" : "plain, K padded";
    for (const int64_t m : {1, 13, 40, 70}) {
      EXPECT_EQ(CheckFp32(*p, m, {}, seed + 10 + run++), "") << what << ", dispatcher, m=" << m;
    }
  }
  for (KernelConfig c : {KernelConfig{WeightFormat::kZ12, 4, 1, 1, 3, 1},
                         KernelConfig{WeightFormat::kZ12, 4, 1, 1, 3, 2, 2}}) {
    c = internal::InOrder(c, z.dm.order());  // (a tuning file may make 512x2048 group-major)
    const absl::StatusOr<GemvPlan> plan = PlanGemv(z.dm, 13, GemvOptions{c});
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_EQ(plan->chunk_m, 8) << c.ToString();
    EXPECT_EQ(CheckFp32(z, 13, GemvOptions{c}, seed + 10 + run++), "") << c.ToString();
  }
  const KernelConfig b{WeightFormat::kBf16, 4, 1, 1, 1, 1};
  ASSERT_TRUE(Validate(b, GemvShape{8, 512, 2048}).ok()) << b.ToString();
  EXPECT_EQ(CheckFp32(plain, 13, GemvOptions{b}, seed + 10 + run++), "") << b.ToString();
}

// Plain BF16 with K not a multiple of 64 copies x into the stream's [m, K64] buffer, whose columns
// past K meet the zero padding of the weights. They must be zeroed on every call, not only when
// the buffer is new: garbage there is harmless unless it holds a NaN or an Inf (times 0). So the
// buffer is filled with NaNs between two calls, and the second must still be right.
TEST(Gemv, PaddedXIsZeroedOnEveryCall) {
  GEMVZ_REQUIRE_GPU();
  const auto& api = **internal::Driver();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const Problem padded =
      Problem::Make(200, 1000, testing::RandomMatrix(200, 1000, Distribution::kNormal, seed));
  ASSERT_EQ(padded.dm.format(), WeightFormat::kBf16);
  const KernelConfig b{WeightFormat::kBf16, 4, 1, 1, 1, 1};  // no split-K: x's buffer alone
  ASSERT_TRUE(Validate(b, GemvShape{8, 208, 1024}).ok()) << b.ToString();  // the padded launch
  const TestStream stream;
  ASSERT_TRUE(stream.ok());

  EXPECT_EQ(padded.Check(8, GemvOptions{b}, seed + 1, nullptr, stream), "");
  const std::vector<CUdeviceptr> buffers =
      internal::StreamWorkspaceBuffers(stream.context(), stream);
  const absl::StatusOr<int64_t> bytes = GemvWorkspaceBytes(stream);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  ASSERT_EQ(buffers.size(), 1u) << "x's padded copy only";
  ASSERT_GE(*bytes, 8 * 1024 * 2);
  ASSERT_EQ(api.cuStreamSynchronize(stream), CUDA_SUCCESS);
  ASSERT_EQ(api.cuMemsetD8(buffers[0], 0xFF, static_cast<size_t>(*bytes)), CUDA_SUCCESS);  // NaNs
  ASSERT_EQ(api.cuCtxSynchronize(), CUDA_SUCCESS);
  EXPECT_EQ(padded.Check(8, GemvOptions{b}, seed + 2, nullptr, stream), "");
  EXPECT_EQ(padded.Check(5, GemvOptions{b}, seed + 3, nullptr, stream), "") << "fewer rows";
}

TEST(Gemv, BitwiseDeterministic) {
  GEMVZ_REQUIRE_GPU();
  const uint64_t seed = FreshSeed();
  const int64_t n = 2048, k = 8192, m = 16;
  const Problem p = Problem::Make(n, k, MixedWeights(n, k, seed));
  auto x = testing::RandomActivations(m, k, seed);
  DeviceBuffer dx(x.size() * 2), dout(m * n * 2);
  dx.Upload(x.data(), x.size() * 2);
  for (const KernelConfig& c : {KernelConfig{WeightFormat::kZ12, 8, 2, 2, 3, 1},
                                KernelConfig{WeightFormat::kZ12, 8, 2, 2, 3, 4},
                                KernelConfig{WeightFormat::kZ12, 4, 1, 2, 3, 1, 2},
                                KernelConfig{WeightFormat::kZ12, 4, 1, 2, 3, 4, 2},
                                // uneven shares of K: 64 trips over 6 warps, 32 over 12 (S = 4)
                                KernelConfig{WeightFormat::kZ12, 6, 2, 2, 3, 1},
                                KernelConfig{WeightFormat::kZ12, 12, 1, 2, 0, 4}}) {
    SCOPED_TRACE(c.ToString());
    const GemvOptions opt{c};
    std::vector<uint16_t> first(m * n), again(m * n);
    for (int run = 0; run < 20; ++run) {
      dout.Fill16(kPoison);
      ASSERT_TRUE(Gemv(p.dm, dx.as<uint16_t>(), m, dout.as<uint16_t>(), nullptr, opt).ok());
      dout.Download(run == 0 ? first.data() : again.data(), m * n * 2);
      if (run > 0) {
        ASSERT_EQ(std::memcmp(first.data(), again.data(), m * n * 2), 0) << "run " << run;
      }
    }
  }
}

// A stream of its own and a graph of `calls` Gemv calls captured on it, after one plain call has
// loaded the kernel and sized the stream's workspace. Destroyed with everything it made: the
// graph, then (the stream's destructor) the workspace and the stream.
struct CapturedGemv {
  TestStream stream;
  CUgraph graph = nullptr;
  CUgraphExec exec = nullptr;
  ~CapturedGemv() {
    const auto& api = **internal::Driver();
    if (exec != nullptr) api.cuGraphExecDestroy(exec);
    if (graph != nullptr) api.cuGraphDestroy(graph);
  }
};

void Capture(const Problem& p, const DeviceBuffer& dx, const DeviceBuffer& dout, int64_t m,
             const GemvOptions& opt, int calls, CapturedGemv* g) {
  const auto& api = **internal::Driver();
  ASSERT_TRUE(g->stream.ok());
  ASSERT_TRUE(Gemv(p.dm, dx.as<uint16_t>(), m, dout.as<uint16_t>(), g->stream, opt).ok());
  ASSERT_EQ(api.cuStreamSynchronize(g->stream), CUDA_SUCCESS);
  ASSERT_EQ(api.cuStreamBeginCapture(g->stream, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
  for (int i = 0; i < calls; ++i) {
    ASSERT_TRUE(Gemv(p.dm, dx.as<uint16_t>(), m, dout.as<uint16_t>(), g->stream, opt).ok());
  }
  ASSERT_EQ(api.cuStreamEndCapture(g->stream, &g->graph), CUDA_SUCCESS);
  ASSERT_EQ(api.cuGraphInstantiate(&g->exec, g->graph, 0), CUDA_SUCCESS);
}

// Replays the graph `replays` times, each into a poisoned `dout`, against the reference of x.
void ReplayAndCheck(const CapturedGemv& g, const Problem& p, const std::vector<uint16_t>& x,
                    DeviceBuffer* dout, int64_t m, int replays) {
  const auto& api = **internal::Driver();
  std::vector<double> ref, abs_sum;
  testing::ReferenceGemv(p.w, x, m, p.n, p.k, &ref, &abs_sum);
  for (int replay = 0; replay < replays; ++replay) {
    dout->Fill16(kPoison);
    testing::Synchronize();
    ASSERT_EQ(api.cuGraphLaunch(g.exec, g.stream), CUDA_SUCCESS);
    ASSERT_EQ(api.cuStreamSynchronize(g.stream), CUDA_SUCCESS) << "replay " << replay;
    std::vector<uint16_t> got(m * p.n);
    dout->Download(got.data(), got.size() * 2);
    EXPECT_EQ(testing::CompareToReference(got, ref, abs_sum, m, p.n), "") << "replay " << replay;
  }
}

TEST(Gemv, GraphCaptureAndReplay) {
  GEMVZ_REQUIRE_GPU();
  const uint64_t seed = FreshSeed();
  const int64_t n = 1024, k = 4096, m = 8;
  const Problem p = Problem::Make(n, k, MixedWeights(n, k, seed));
  auto x = testing::RandomActivations(m, k, seed);
  DeviceBuffer dx(x.size() * 2), dout(m * n * 2);
  dx.Upload(x.data(), x.size() * 2);
  const GemvOptions opt{KernelConfig{WeightFormat::kZ12, 4, 2, 1, 1, 2}};  // split-K in a graph
  CapturedGemv g;
  ASSERT_NO_FATAL_FAILURE(Capture(p, dx, dout, m, opt, 3, &g));
  ReplayAndCheck(g, p, x, &dout, m, 5);
}

// Two split-K calls, the second needing a far larger workspace than the first: `small` (1024 x
// 4096, 64 row blocks) at S = 2, NB 1 and m = 8 needs 64 KiB of partials and 256 bytes of
// semaphores (4 KiB allocated); `big` (32768 x 1024, 2048 row blocks) at S = 4, NB 2 and m = 16
// 8 MiB and 8 KiB.
struct WorkspaceGrowth {
  static constexpr int64_t kSmallM = 8, kBigM = 16;
  Problem small, big;
  GemvOptions small_opt{KernelConfig{WeightFormat::kZ12, 4, 2, 1, 1, 2}};
  GemvOptions big_opt{KernelConfig{WeightFormat::kZ12, 4, 1, 2, 3, 4}};
  explicit WorkspaceGrowth(uint64_t seed)
      : small(Problem::Make(1024, 4096, MixedWeights(1024, 4096, seed))),
        big(Problem::Make(32768, 1024,
                          testing::RandomMatrix(32768, 1024, Distribution::kNormal, seed + 1))) {}
};

// The kernel parameters of a graph that captured one Gemv call: its only node, a kernel node.
// False, with the failure recorded, if the graph holds another number of nodes or another kind.
bool OnlyKernelNodeParams(CUgraph graph, CUDA_KERNEL_NODE_PARAMS* kp) {
  const auto& api = **internal::Driver();
  size_t nodes = 0;
  if (api.cuGraphGetNodes(graph, nullptr, &nodes) != CUDA_SUCCESS || nodes != 1) {
    ADD_FAILURE() << "the graph holds " << nodes << " nodes, not the call's one kernel";
    return false;
  }
  CUgraphNode node = nullptr;
  std::memset(kp, 0, sizeof(*kp));
  if (api.cuGraphGetNodes(graph, &node, &nodes) != CUDA_SUCCESS ||
      api.cuGraphKernelNodeGetParams(node, kp) != CUDA_SUCCESS || kp->kernelParams == nullptr) {
    ADD_FAILURE() << "the graph's node is not a kernel node with parameters";
    return false;
  }
  return true;
}

// A graph captured while the stream's workspace was small must replay correctly after a later
// call on that stream grows it. Outgrown buffers used to be freed: the graph's split-K partials
// and semaphores then lay in freed memory (an illegal address in `gemvz tune`'s 1675-graph sweep
// on 4096x4096 at m = 16), or in a new allocation that someone else filled. The test reads the
// buffers that the captured kernel was given and checks that they are still the allocations they
// were; then it fills buffers of the old sizes with ones (semaphores read from such memory would
// never name a last CTA, and the poisoned output would stay) and replays.
TEST(Gemv, GraphReplayAfterTheWorkspaceGrows) {
  GEMVZ_REQUIRE_GPU();
  const auto& api = **internal::Driver();
  const uint64_t seed = FreshSeed();
  const WorkspaceGrowth w(seed);
  const Problem& p = w.small;
  const Problem& big = w.big;
  const GemvOptions& opt = w.small_opt;
  const GemvOptions& big_opt = w.big_opt;
  const int64_t n = p.n, k = p.k, m = WorkspaceGrowth::kSmallM;
  auto x = testing::RandomActivations(m, k, seed);
  DeviceBuffer dx(x.size() * 2), dout(m * n * 2);
  dx.Upload(x.data(), x.size() * 2);
  CapturedGemv g;
  ASSERT_NO_FATAL_FAILURE(Capture(p, dx, dout, m, opt, 1, &g));
  // The graph's one kernel node and the workspace pointers in its Z12Params.
  CUDA_KERNEL_NODE_PARAMS kp;
  ASSERT_TRUE(OnlyKernelNodeParams(g.graph, &kp));
  const Z12Params captured = *static_cast<const Z12Params*>(kp.kernelParams[0]);
  ASSERT_NE(captured.ws, nullptr);
  ASSERT_NE(captured.sem, nullptr);
  // The allocation (start, size) that holds `p`; start 0 when none does.
  auto allocation = [&](const void* p) {
    CUdeviceptr start = 0;
    size_t size = 0;
    const auto ptr = reinterpret_cast<CUdeviceptr>(p);
    if (api.cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ptr) !=
            CUDA_SUCCESS ||
        api.cuPointerGetAttribute(&size, CU_POINTER_ATTRIBUTE_RANGE_SIZE, ptr) != CUDA_SUCCESS) {
      return std::pair<CUdeviceptr, size_t>{0, 0};
    }
    return std::pair<CUdeviceptr, size_t>{start, size};
  };
  const auto ws_before = allocation(captured.ws), sem_before = allocation(captured.sem);
  ASSERT_NE(ws_before.first, 0u);
  ASSERT_NE(sem_before.first, 0u);

  // The growth: a larger split-K call on the same stream, checked too.
  ASSERT_EQ(big.Check(WorkspaceGrowth::kBigM, big_opt, seed + 2, nullptr, g.stream), "");
  EXPECT_EQ(allocation(captured.ws), ws_before) << "the graph's split-K partials were freed";
  EXPECT_EQ(allocation(captured.sem), sem_before) << "the graph's semaphores were freed";
  std::vector<std::unique_ptr<DeviceBuffer>> squatters;
  for (const size_t bytes : {size_t{4096}, size_t{65536}}) {
    for (int i = 0; i < 8; ++i) {
      squatters.push_back(std::make_unique<DeviceBuffer>(bytes));
      squatters.back()->Fill16(0xFFFF);
    }
  }

  ReplayAndCheck(g, p, x, &dout, m, 3);
}

// One call made while `stream` is being captured (global mode), and the capture ended: the
// call's status, what ending the capture returned, and the graph, destroyed with this.
struct CaptureOfOneCall {
  absl::Status status;
  CUresult end;
  CUgraph graph = nullptr;

  CaptureOfOneCall(CUstream stream, const std::function<absl::Status()>& call) {
    const auto& api = **internal::Driver();
    const CUresult begin = api.cuStreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_GLOBAL);
    if (begin != CUDA_SUCCESS) {
      ADD_FAILURE() << "cuStreamBeginCapture failed: " << begin;
      end = begin;
      return;
    }
    status = call();
    end = api.cuStreamEndCapture(stream, &graph);
  }
  ~CaptureOfOneCall() {
    if (graph != nullptr) (**internal::Driver()).cuGraphDestroy(graph);
  }
  CaptureOfOneCall(const CaptureOfOneCall&) = delete;
  CaptureOfOneCall& operator=(const CaptureOfOneCall&) = delete;

  // The graph's nodes; -1, with the failure recorded, when they cannot be counted.
  int64_t Nodes() const {
    size_t nodes = 0;
    if (graph == nullptr ||
        (**internal::Driver()).cuGraphGetNodes(graph, nullptr, &nodes) != CUDA_SUCCESS) {
      ADD_FAILURE() << "the capture left no graph whose nodes could be counted";
      return -1;
    }
    return static_cast<int64_t>(nodes);
  }
};

// The first split-K call on a stream that is being captured would allocate the stream's workspace
// inside the capture: refused, naming the remedy, with nothing enqueued (the capture ends with an
// empty graph). Outside the capture the same call sizes the workspace and runs right.
TEST(Gemv, CaptureRefusesToGrowTheWorkspace) {
  GEMVZ_REQUIRE_GPU();
  const uint64_t seed = FreshSeed();
  const int64_t n = 1024, k = 4096, m = 8;
  const Problem p = Problem::Make(n, k, MixedWeights(n, k, seed));
  const GemvOptions opt{KernelConfig{WeightFormat::kZ12, 4, 2, 1, 1, 2}};  // split-K
  ASSERT_EQ(p.Check(m, opt, seed), "");  // the kernel loaded, on the legacy stream
  auto x = testing::RandomActivations(m, k, seed);
  DeviceBuffer dx(x.size() * 2), dout(m * n * 2);
  dx.Upload(x.data(), x.size() * 2);
  const TestStream stream;
  ASSERT_TRUE(stream.ok());
  const CaptureOfOneCall c(
      stream, [&] { return Gemv(p.dm, dx.as<uint16_t>(), m, dout.as<uint16_t>(), stream, opt); });
  ASSERT_EQ(c.end, CUDA_SUCCESS);
  EXPECT_EQ(c.Nodes(), 0) << "the refused call enqueued work into the graph";
  const absl::Status& st = c.status;
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("while the stream is being captured"), std::string::npos) << st;
  EXPECT_NE(st.message().find("run the same call once on this stream before capturing it"),
            std::string::npos)
      << st;
  EXPECT_EQ(p.Check(m, opt, seed + 1, nullptr, stream), "");
}

// While a blocking stream is being captured, work sent to the legacy default stream would
// invalidate that capture (CUDA's implicit synchronisation of the two): Gemv on the legacy
// stream is refused before anything is enqueued, saying why, and the capture ends intact.
TEST(Gemv, LegacyStreamCallLeavesABlockingStreamsCaptureIntact) {
  GEMVZ_REQUIRE_GPU();
  const uint64_t seed = FreshSeed();
  const int64_t n = 1024, k = 4096, m = 8;
  const Problem p = Problem::Make(n, k, MixedWeights(n, k, seed));
  const GemvOptions opt{KernelConfig{WeightFormat::kZ12, 8, 2, 1, 3, 1}};  // no workspace needed
  ASSERT_EQ(p.Check(m, opt, seed), "");  // loaded, and right, on the legacy stream
  const TestStream blocking(CU_STREAM_DEFAULT);
  ASSERT_TRUE(blocking.ok());
  DeviceBuffer dx(m * k * 2), dout(m * n * 2);
  const CaptureOfOneCall c(blocking, [&] {
    return Gemv(p.dm, dx.as<uint16_t>(), m, dout.as<uint16_t>(), nullptr, opt);
  });
  EXPECT_EQ(c.end, CUDA_SUCCESS) << "the blocking stream's capture was invalidated";
  const absl::Status& st = c.status;
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("legacy default stream"), std::string::npos) << st;
  EXPECT_EQ(p.Check(m, opt, seed + 1), "");  // after the capture, the legacy stream serves again
}

// The flags a Gemv call gave its kernel (Z12Params or Bf16Params::flags), read from the one kernel
// node of a graph that captured the call; -1 (with the failure recorded) when that went wrong.
int CapturedFlags(const Problem& p, int64_t m, const GemvOptions& opt) {
  DeviceBuffer dx(static_cast<size_t>(m * p.k * 2)), dout(static_cast<size_t>(m * p.n * 2));
  dx.Fill16(0x3F80);
  testing::Synchronize();
  CapturedGemv g;
  Capture(p, dx, dout, m, opt, 1, &g);
  if (::testing::Test::HasFatalFailure()) return -1;
  CUDA_KERNEL_NODE_PARAMS kp;
  int flags = -1;
  if (OnlyKernelNodeParams(g.graph, &kp)) {
    flags = p.dm.format() == WeightFormat::kZ12
                ? static_cast<const Z12Params*>(kp.kernelParams[0])->flags
                : static_cast<const Bf16Params*>(kp.kernelParams[0])->flags;
  }
  return flags;  // g's stream releases its workspace (the graph is never launched)
}

// Whether a call launches with programmatic dependent launch (flags bit 2, which only such a
// launch sets; its results are the same either way, so PdlTest's bitwise comparisons cannot
// tell): GemvOptions::pdl over GEMVZ_PDL; kAlways on any grid, also one that fills few CTA
// slots; kAuto only on a grid that fills at least 90 % of them; kOff and unset never; plain BF16
// too. Where the GPU has no PDL (before sm_90, or a driver without cuLaunchKernelEx) no call
// sets the bit.
TEST(Gemv, PdlModeReachesTheLaunch) {
  GEMVZ_REQUIRE_GPU();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const jit_test::ScopedEnv no_env("GEMVZ_PDL", std::nullopt);
  absl::StatusOr<internal::DeviceInfo> info = internal::GetDeviceInfo(0);
  ASSERT_TRUE(info.ok()) << info.status();
  const bool can = info->limits.cc_major >= 9 && (*internal::Driver())->cuLaunchKernelEx != nullptr;
  // A small grid: 4 row blocks (and any dense rows) of one K slice.
  const Problem small =
      Problem::Make(64, 256, testing::RandomMatrix(64, 256, Distribution::kNormal, seed));
  const KernelConfig sc{WeightFormat::kZ12, 2, 1, 1, 3, 1};
  ASSERT_LT((4 + small.dm.state()->n_dense) * 10, int64_t{info->limits.sm_count} * 9);
  // A full one: 128 row blocks x 16 K slices, 2048 CTAs of 160 threads.
  const Problem big =
      Problem::Make(2048, 4096, testing::RandomMatrix(2048, 4096, Distribution::kNormal, seed + 1));
  const KernelConfig bc{WeightFormat::kZ12, 4, 1, 1, 3, 16};
  const auto kernel = internal::GetKernel(0, internal::InOrder(bc, big.dm.order()));
  ASSERT_TRUE(kernel.ok()) << kernel.status();
  const int64_t slots = int64_t{kernel->blocks_per_sm} * info->limits.sm_count;
  ASSERT_GE((128 + big.dm.state()->n_dense) * 16 * 10, slots * 9) << "the big grid must fill 90 %";
  const Problem plain =
      Problem::Make(64, 256, testing::RandomMatrix(64, 256, Distribution::kNormal, seed + 2), true);
  const KernelConfig pc{WeightFormat::kBf16, 2, 1, 1, 1, 1};

  auto flags = [&](const Problem& p, const KernelConfig& c, std::optional<Pdl> pdl) {
    GemvOptions opt{internal::InOrder(c, p.dm.order())};
    opt.pdl = pdl;
    return CapturedFlags(p, 8, opt);
  };
  const int pdl_bit = can ? 4 : 0;
  EXPECT_EQ(flags(small, sc, std::nullopt) & 4, 0) << "unset, GEMVZ_PDL unset";
  EXPECT_EQ(flags(small, sc, Pdl::kOff) & 4, 0) << "kOff";
  EXPECT_EQ(flags(small, sc, Pdl::kAuto) & 4, 0) << "kAuto, a grid of few CTAs";
  EXPECT_EQ(flags(small, sc, Pdl::kAlways) & 4, pdl_bit) << "kAlways, a grid of few CTAs";
  EXPECT_EQ(flags(big, bc, Pdl::kAuto) & 4, pdl_bit) << "kAuto, a full grid";
  EXPECT_EQ(flags(big, bc, Pdl::kOff) & 4, 0) << "kOff, a full grid";
  EXPECT_EQ(flags(plain, pc, Pdl::kAlways) & 4, pdl_bit) << "plain BF16, kAlways";
  EXPECT_EQ(flags(plain, pc, Pdl::kOff) & 4, 0) << "plain BF16, kOff";
  {
    const jit_test::ScopedEnv always("GEMVZ_PDL", "always");
    EXPECT_EQ(flags(small, sc, std::nullopt) & 4, pdl_bit) << "GEMVZ_PDL=always";
    EXPECT_EQ(flags(small, sc, Pdl::kOff) & 4, 0) << "kOff over GEMVZ_PDL=always";
  }
  {
    const jit_test::ScopedEnv automatic("GEMVZ_PDL", "1");
    EXPECT_EQ(flags(big, bc, std::nullopt) & 4, pdl_bit) << "GEMVZ_PDL=1, a full grid";
    EXPECT_EQ(flags(small, sc, Pdl::kAlways) & 4, pdl_bit) << "kAlways over GEMVZ_PDL=1";
  }
}

// nullptr and CU_STREAM_LEGACY name one stream, the legacy default one, and so one workspace:
// what a call on either holds, the other reports and releases.
TEST(Gemv, NullAndCuStreamLegacyShareOneWorkspace) {
  GEMVZ_REQUIRE_GPU();
  const uint64_t seed = FreshSeed();
  const WorkspaceGrowth w(seed);
  ASSERT_TRUE(ReleaseGemvWorkspace(nullptr).ok());  // none held, whatever ran before
  ASSERT_EQ(w.small.Check(WorkspaceGrowth::kSmallM, w.small_opt, seed, nullptr, CU_STREAM_LEGACY),
            "");
  absl::StatusOr<int64_t> by_null = GemvWorkspaceBytes(nullptr);
  absl::StatusOr<int64_t> by_legacy = GemvWorkspaceBytes(CU_STREAM_LEGACY);
  ASSERT_TRUE(by_null.ok()) << by_null.status();
  ASSERT_TRUE(by_legacy.ok()) << by_legacy.status();
  EXPECT_GE(*by_null, 64 * 1024) << "the split-K call's workspace, asked by nullptr";
  EXPECT_EQ(*by_legacy, *by_null);
  ASSERT_EQ(w.small.Check(WorkspaceGrowth::kSmallM, w.small_opt, seed + 1, nullptr, nullptr), "");
  by_null = GemvWorkspaceBytes(nullptr);
  ASSERT_TRUE(by_null.ok()) << by_null.status();
  EXPECT_EQ(*by_null, *by_legacy) << "a call on nullptr made a second workspace";
  ASSERT_TRUE(ReleaseGemvWorkspace(nullptr).ok());
  by_legacy = GemvWorkspaceBytes(CU_STREAM_LEGACY);
  ASSERT_TRUE(by_legacy.ok()) << by_legacy.status();
  EXPECT_EQ(*by_legacy, 0) << "released by nullptr, still held for CU_STREAM_LEGACY";
}

// ReleaseGemvWorkspace frees what Gemv keeps for a stream, outgrown buffers included (each buffer
// is an allocation before the call and none after it), and the next split-K
// call on the stream allocates afresh and is right (its new semaphores start at zero). Refused
// during capture, an error for a device that does not exist, a no-op where nothing is held.
TEST(Gemv, ReleaseWorkspaceFreesItAndALaterCallStartsAfresh) {
  GEMVZ_REQUIRE_GPU();
  const uint64_t seed = FreshSeed();
  const WorkspaceGrowth w(seed);
  const TestStream stream;
  ASSERT_TRUE(stream.ok());
  auto held = [&] {
    absl::StatusOr<int64_t> bytes = GemvWorkspaceBytes(stream);
    EXPECT_TRUE(bytes.ok()) << bytes.status();
    return bytes.ok() ? *bytes : -1;
  };
  EXPECT_EQ(held(), 0);
  EXPECT_TRUE(ReleaseGemvWorkspace(stream).ok());  // nothing held yet

  ASSERT_EQ(w.small.Check(WorkspaceGrowth::kSmallM, w.small_opt, seed, nullptr, stream), "");
  const int64_t small = held();
  EXPECT_GE(small, 64 * 1024 + 256);
  ASSERT_EQ(w.big.Check(WorkspaceGrowth::kBigM, w.big_opt, seed + 2, nullptr, stream), "");
  const int64_t grown = held();
  EXPECT_GE(grown, small + (8 << 20)) << "the outgrown buffers count too";

  // Refused while the stream is being captured (the graph would use what it frees).
  {
    const CaptureOfOneCall c(stream, [&] { return ReleaseGemvWorkspace(stream); });
    ASSERT_EQ(c.end, CUDA_SUCCESS);
    EXPECT_EQ(c.status.code(), absl::StatusCode::kFailedPrecondition) << c.status;
    EXPECT_NE(c.status.message().find("being captured"), std::string::npos) << c.status;
  }
  EXPECT_EQ(held(), grown);

  // Every buffer, the outgrown ones included, is an allocation before the release and none after
  // it. (Free device memory would say so too, but it moves with every other process on the GPU:
  // under `ctest -j8` this test failed on it alone.)
  const std::vector<CUdeviceptr> buffers =
      internal::StreamWorkspaceBuffers(stream.context(), stream);
  EXPECT_GE(buffers.size(), 4u) << "partials and semaphores, small and grown";
  for (const CUdeviceptr p : buffers)
    EXPECT_TRUE(testing::IsAllocationStart(p)) << "buffer 0x" << std::hex << p;
  const absl::Status st = ReleaseGemvWorkspace(stream);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(held(), 0);
  EXPECT_TRUE(internal::StreamWorkspaceBuffers(stream.context(), stream).empty());
  for (const CUdeviceptr p : buffers) {
    EXPECT_FALSE(testing::IsAllocationStart(p)) << "buffer 0x" << std::hex << p << " was not freed";
  }

  // A later call allocates afresh, with zeroed semaphores, and is right; twice, so that the
  // semaphores it reset serve again. Afresh, it holds exactly what the call needs (gemv.h): the
  // partials, N/16 x S x NB x 512 bytes, and one 4-byte counter per row block. Both are above the
  // 4 KiB least allocation here (2048 row blocks), so counters sized in ints, not bytes, show.
  EXPECT_EQ(w.big.Check(WorkspaceGrowth::kBigM, w.big_opt, seed + 3, nullptr, stream), "");
  EXPECT_EQ(w.big.Check(WorkspaceGrowth::kBigM, w.big_opt, seed + 4, nullptr, stream), "");
  const int64_t row_blocks = 32768 / 16;
  EXPECT_EQ(held(), row_blocks * w.big_opt.config->splits * w.big_opt.config->nb * 512 +
                        row_blocks * 4);
  ASSERT_TRUE(ReleaseGemvWorkspace(stream).ok());
  EXPECT_FALSE(ReleaseGemvWorkspace(nullptr, 99).ok());  // no such device
}

// ReleaseGemvWorkspace racing Gemv on the same stream (gemv.h): each call either launches first,
// and the release waits for it, or allocates afresh. Every call succeeds with the right result
// (none ran on a freed workspace), every release succeeds, and a last one leaves nothing held.
TEST(Gemv, ReleaseRacingCallsOnTheSameStream) {
  GEMVZ_REQUIRE_GPU();
  const auto& api = **internal::Driver();
  const uint64_t seed = FreshSeed();
  const int64_t n = 1024, k = 4096, m = 8;
  const Problem p = Problem::Make(n, k, MixedWeights(n, k, seed));
  const GemvOptions opt{KernelConfig{WeightFormat::kZ12, 4, 2, 1, 1, 2}};  // split-K: a workspace
  const auto x = testing::RandomActivations(m, k, seed);
  std::vector<double> ref, abs_sum;
  testing::ReferenceGemv(p.w, x, m, n, k, &ref, &abs_sum);
  DeviceBuffer dx(x.size() * 2);
  dx.Upload(x.data(), x.size() * 2);
  constexpr int kCalls = 3000;
  std::vector<std::unique_ptr<DeviceBuffer>> outs;  // one poisoned output a call
  for (int i = 0; i < kCalls; ++i) {
    outs.push_back(std::make_unique<DeviceBuffer>(m * n * 2));
    outs.back()->Fill16(kPoison);
  }
  testing::Synchronize();
  const TestStream stream;
  ASSERT_TRUE(stream.ok());

  // The releaser counts the releases that found a workspace to free; the calls go on until a few
  // did (or all kCalls are made), so that the race is run, not only a release beside idle calls.
  std::atomic<bool> done{false};
  std::atomic<int> freed{0};
  absl::Notification started;
  absl::Mutex mu;
  absl::Status release_failure;
  std::thread releaser([&] {
    started.Notify();
    do {
      const absl::StatusOr<int64_t> held = GemvWorkspaceBytes(stream);
      absl::Status st = ReleaseGemvWorkspace(stream);
      if (!st.ok() || !held.ok()) {
        absl::MutexLock lock(&mu);
        release_failure = st.ok() ? held.status() : st;
      } else if (*held > 0) {
        freed.fetch_add(1);
      }
    } while (!done.load());
  });
  started.WaitForNotification();
  std::vector<absl::Status> calls(kCalls);
  int made = 0;
  while (made < kCalls && (made < kCalls / 3 || freed.load() < 3)) {
    calls[made] = Gemv(p.dm, dx.as<uint16_t>(), m, outs[made]->as<uint16_t>(), stream, opt);
    ++made;
  }
  done = true;
  releaser.join();
  ASSERT_EQ(api.cuStreamSynchronize(stream), CUDA_SUCCESS);
  EXPECT_TRUE(release_failure.ok()) << release_failure;
  EXPECT_GE(freed.load(), 1) << "no release freed a workspace while the calls ran";
  int wrong = 0;
  for (int i = 0; i < made && wrong < 3; ++i) {
    EXPECT_TRUE(calls[i].ok()) << "call " << i << ": " << calls[i];
    std::vector<uint16_t> got(m * n);
    outs[i]->Download(got.data(), got.size() * 2);
    const std::string diff = testing::CompareToReference(got, ref, abs_sum, m, n);
    EXPECT_EQ(diff, "") << "call " << i;
    if (!diff.empty() || !calls[i].ok()) ++wrong;
  }
  EXPECT_TRUE(ReleaseGemvWorkspace(stream).ok());
  absl::StatusOr<int64_t> held = GemvWorkspaceBytes(stream);
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(*held, 0);
}

// With two GPUs: a stream of device 1 is refused for a matrix on device 0 (Gemv) and for device
// 0's workspace calls, each naming the mismatch; on device 1 with its own matrix it works, and its
// workspace is device 1's, released there.
TEST(Gemv, StreamOfAnotherDevice) {
  GEMVZ_REQUIRE_GPUS(2);
  const auto& api = **internal::Driver();
  const uint64_t seed = FreshSeed();
  const int64_t n = 1024, k = 4096, m = 8;
  const auto w = MixedWeights(n, k, seed);
  auto on0 = DeviceMatrix::FromBf16(w.data(), n, k, 0);
  auto on1 = DeviceMatrix::FromBf16(w.data(), n, k, 1);
  ASSERT_TRUE(on0.ok()) << on0.status();
  ASSERT_TRUE(on1.ok()) << on1.status();
  absl::StatusOr<CUcontext> ctx1 = internal::PrimaryContext(1);
  ASSERT_TRUE(ctx1.ok()) << ctx1.status();
  ASSERT_EQ(api.cuCtxSetCurrent(*ctx1), CUDA_SUCCESS);
  CUstream stream1 = nullptr;
  ASSERT_EQ(api.cuStreamCreate(&stream1, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
  const auto x = testing::RandomActivations(m, k, seed);
  CUdeviceptr dx = 0, dout = 0;
  ASSERT_EQ(api.cuMemAlloc(&dx, x.size() * 2), CUDA_SUCCESS);
  ASSERT_EQ(api.cuMemAlloc(&dout, m * n * 2), CUDA_SUCCESS);
  ASSERT_EQ(api.cuMemcpyHtoD(dx, x.data(), x.size() * 2), CUDA_SUCCESS);
  auto* x1 = reinterpret_cast<const uint16_t*>(dx);
  auto* out1 = reinterpret_cast<uint16_t*>(dout);
  const GemvOptions split{KernelConfig{WeightFormat::kZ12, 4, 2, 1, 1, 2}};

  absl::Status st = Gemv(*on0, x1, m, out1, stream1, split);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("the matrix lives on device 0 but the stream belongs to another"),
            std::string::npos)
      << st;
  st = ReleaseGemvWorkspace(stream1, 0);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("another context than device 0's primary one"), std::string::npos)
      << st;
  EXPECT_FALSE(GemvWorkspaceBytes(stream1, 0).ok());

  // On device 1, with device 1's matrix: right, and its workspace is held and freed there.
  ASSERT_TRUE(Gemv(*on1, x1, m, out1, stream1, split).ok());
  ASSERT_EQ(api.cuCtxSetCurrent(*ctx1), CUDA_SUCCESS);
  ASSERT_EQ(api.cuStreamSynchronize(stream1), CUDA_SUCCESS);
  std::vector<uint16_t> got(m * n);
  ASSERT_EQ(api.cuMemcpyDtoH(got.data(), dout, got.size() * 2), CUDA_SUCCESS);
  std::vector<double> ref, abs_sum;
  testing::ReferenceGemv(w, x, m, n, k, &ref, &abs_sum);
  EXPECT_EQ(testing::CompareToReference(got, ref, abs_sum, m, n), "");
  absl::StatusOr<int64_t> held = GemvWorkspaceBytes(stream1, 1);
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_GE(*held, 64 * 1024);
  EXPECT_TRUE(ReleaseGemvWorkspace(stream1, 1).ok());
  held = GemvWorkspaceBytes(stream1, 1);
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(*held, 0);

  ASSERT_EQ(api.cuCtxSetCurrent(*ctx1), CUDA_SUCCESS);
  api.cuMemFree(dx);
  api.cuMemFree(dout);
  api.cuStreamDestroy(stream1);
}

// Where autotuning keeps its winners: a tuning file in a temporary directory (not the user's), or
// only this process's memory (no GEMVZ_TUNING_FILE, the disk cache off, so no file at all).
enum class TunedWinners { kInATuningFile, kInTheProcessOnly };

// GEMVZ_AUTOTUNE=1 with at most `max` candidates, the winners kept as `winners` says, and nothing
// this process tuned before. On the way out, also when an assertion returns early: no candidate
// hook, nothing remembered, and the tuning file read afresh from the environment's path by later
// tests.
struct ScopedAutotune {
  explicit ScopedAutotune(const char* max, TunedWinners winners = TunedWinners::kInATuningFile)
      : file(dir.path() + "/tuning.json"),
        autotune("GEMVZ_AUTOTUNE", "1"),
        cap("GEMVZ_AUTOTUNE_MAX", max),
        tuning_file("GEMVZ_TUNING_FILE", winners == TunedWinners::kInATuningFile
                                             ? std::optional<std::string>(file)
                                             : std::nullopt) {
    if (winners == TunedWinners::kInTheProcessOnly) {
      disk_cache.emplace("GEMVZ_DISABLE_DISK_CACHE", "1");
    }
    internal::InvalidateTuningFileCache();
    internal::ForgetAutotunedForTesting();
  }
  ~ScopedAutotune() {
    internal::SetAutotuneCandidateHookForTesting(nullptr);
    internal::ForgetAutotunedForTesting();
    internal::InvalidateTuningFileCache();
  }
  jit_test::TempDir dir;
  const std::string file;
  jit_test::ScopedEnv autotune, cap, tuning_file;
  std::optional<jit_test::ScopedEnv> disk_cache;
};

// GEMVZ_AUTOTUNE=1: on the first call for a shape that no table knows, Gemv times candidates on
// the real matrix, runs the winner (right results), and saves it to the tuning file, where the
// dispatcher, like a later process, finds it.
TEST(Gemv, AutotuneOnFirstUsePersistsTheWinner) {
  GEMVZ_REQUIRE_GPU();
  const ScopedAutotune tuning("6");
  const std::string& file = tuning.file;
  const uint64_t seed = FreshSeed();
  const int64_t n = 3072, k = 2048, m = 5;  // no table has 3072x2048
  const Problem p = Problem::Make(n, k, MixedWeights(n, k, seed));
  absl::StatusOr<GemvPlan> before = internal::PlanGemvInternal(p.dm, m, {}, false);
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_EQ(before->source, "heuristic");
  EXPECT_EQ(p.Check(m, {}, seed), "");  // the first call tunes, then runs the winner

  absl::StatusOr<std::vector<TunedChoice>> saved = LoadTunedChoices();
  ASSERT_TRUE(saved.ok()) << saved.status();
  ASSERT_EQ(saved->size(), 1u) << "the winner should be in " << file;
  const TunedChoice& entry = (*saved)[0];
  EXPECT_EQ(entry.n, n);
  EXPECT_EQ(entry.k, k);
  EXPECT_GT(entry.time_us, 0);
  absl::StatusOr<GemvPlan> after = PlanGemv(p.dm, m);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->source, "tuning-file");
  EXPECT_EQ(after->config, entry.config);
  EXPECT_EQ(p.Check(m, {}, seed + 1), "");  // and again, from the file's choice
}

// GEMVZ_AUTOTUNE=1 and a shape that no table knows, first planned while its stream is being
// captured: no candidate is compiled or timed there (timing launches and allocates); the call runs
// the heuristic's plan into the graph. The next call after the capture tunes the shape.
TEST(Gemv, AutotuneWaitsForTheCaptureToEnd) {
  GEMVZ_REQUIRE_GPU();
  const ScopedAutotune tuning("3");
  const uint64_t seed = FreshSeed();
  const int64_t n = 2304, k = 2048, m = 2;  // no table has 2304x2048
  const Problem p = Problem::Make(n, k, MixedWeights(n, k, seed));
  const absl::StatusOr<GemvPlan> heuristic = internal::PlanGemvInternal(p.dm, m, {}, false);
  ASSERT_TRUE(heuristic.ok()) << heuristic.status();
  ASSERT_EQ(heuristic->source, "heuristic");
  int calls = 0;
  internal::SetAutotuneCandidateHookForTesting([&](const KernelConfig&, internal::AutotuneStage) {
    ++calls;
    return absl::OkStatus();
  });
  auto x = testing::RandomActivations(m, k, seed);
  DeviceBuffer dx(x.size() * 2), dout(m * n * 2);
  dx.Upload(x.data(), x.size() * 2);
  const TestStream stream;
  ASSERT_TRUE(stream.ok());
  // The heuristic's kernel loaded and this stream's workspace sized, forced, so with no tuning.
  ASSERT_EQ(p.Check(m, GemvOptions{heuristic->config}, seed, nullptr, stream), "");
  ASSERT_EQ(calls, 0);
  {
    const CaptureOfOneCall c(
        stream, [&] { return Gemv(p.dm, dx.as<uint16_t>(), m, dout.as<uint16_t>(), stream); });
    ASSERT_EQ(c.end, CUDA_SUCCESS);
    EXPECT_TRUE(c.status.ok()) << c.status;
    EXPECT_EQ(calls, 0) << "candidates were compiled or timed during the capture";
    EXPECT_EQ(c.Nodes(), 1) << "the captured call should be the heuristic's one launch";
  }
  EXPECT_EQ(p.Check(m, {}, seed + 1, nullptr, stream), "");
  EXPECT_GT(calls, 0) << "the shape was not tuned after the capture";
}

// GEMVZ_AUTOTUNE=1 with no tuning file to keep the winner (the disk cache off, no
// GEMVZ_TUNING_FILE): a capture after the shape was tuned runs the winner, as eager calls do, not
// the dispatcher's heuristic. The heuristic's kernel is made to fail as a candidate, so that the
// two differ.
TEST(Gemv, ACaptureRunsTheWinnerThatNoTuningFileKept) {
  GEMVZ_REQUIRE_GPU();
  const ScopedAutotune tuning("4", TunedWinners::kInTheProcessOnly);
  const uint64_t seed = FreshSeed();
  const int64_t n = 1792, k = 2048, m = 3;  // no table has 1792x2048
  const Problem p = Problem::Make(n, k, MixedWeights(n, k, seed));
  const absl::StatusOr<GemvPlan> heuristic = internal::PlanGemvInternal(p.dm, m, {}, false);
  ASSERT_TRUE(heuristic.ok()) << heuristic.status();
  ASSERT_EQ(heuristic->source, "heuristic");
  internal::SetAutotuneCandidateHookForTesting(
      [&](const KernelConfig& c, internal::AutotuneStage) -> absl::Status {
        if (c.KernelName() == heuristic->config.KernelName()) {
          return absl::InternalError("test: not this kernel");
        }
        return absl::OkStatus();
      });
  const TestStream stream;
  ASSERT_TRUE(stream.ok());
  ::testing::internal::CaptureStderr();  // the failed candidate and the save that cannot be
  const std::string tuned_call = p.Check(m, {}, seed, nullptr, stream);
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(tuned_call, "");
  EXPECT_NE(err.find("could not save the winner"), std::string::npos) << err;
  const absl::StatusOr<GemvPlan> eager = PlanGemv(p.dm, m);
  ASSERT_TRUE(eager.ok()) << eager.status();
  ASSERT_EQ(eager->source, "autotuned");
  ASSERT_NE(eager->config.KernelName(), heuristic->config.KernelName());
  const absl::StatusOr<internal::LoadedKernel> winner = internal::GetKernel(0, eager->config);
  ASSERT_TRUE(winner.ok()) << winner.status();

  DeviceBuffer dx(m * k * 2), dout(m * n * 2);
  {
    const CaptureOfOneCall c(
        stream, [&] { return Gemv(p.dm, dx.as<uint16_t>(), m, dout.as<uint16_t>(), stream); });
    ASSERT_EQ(c.end, CUDA_SUCCESS);
    EXPECT_TRUE(c.status.ok()) << c.status;
    CUDA_KERNEL_NODE_PARAMS kp;
    if (c.status.ok() && OnlyKernelNodeParams(c.graph, &kp)) {
      EXPECT_EQ(kp.func, winner->function)
          << "the graph runs another kernel than the winner, " << eager->config.ToString();
    }
  }
}

// A candidate that fails is skipped and the rest still tune; when every candidate fails, Gemv
// runs the dispatcher's plan, warns once, and does not tune that shape again in the process.
TEST(Gemv, AutotuneSkipsFailingCandidatesAndRemembersAFailure) {
  GEMVZ_REQUIRE_GPU();
  const ScopedAutotune tuning("5");
  const std::string& file = tuning.file;
  const uint64_t seed = FreshSeed();
  const int64_t n = 2560, k = 2048, m = 3;  // no table has 2560x2048
  const Problem p = Problem::Make(n, k, MixedWeights(n, k, seed));
  absl::StatusOr<GemvPlan> heuristic = internal::PlanGemvInternal(p.dm, m, {}, false);
  ASSERT_TRUE(heuristic.ok()) << heuristic.status();
  ASSERT_EQ(heuristic->source, "heuristic");

  // Every candidate fails to compile. GEMVZ_AUTOTUNE_MAX = 5 candidates at most, the heuristic's
  // choice among them.
  int calls = 0;
  std::vector<KernelConfig> tried;
  internal::SetAutotuneCandidateHookForTesting([&](const KernelConfig& c, internal::AutotuneStage) {
    ++calls;
    tried.push_back(c);
    return absl::InternalError("test: NVRTC failed");
  });
  ::testing::internal::CaptureStderr();
  // The first call on this thread; the next two each on a thread of its own, whose first call
  // finds no copy of its own (per_thread_cache.h) and must find the failure that was kept.
  EXPECT_EQ(p.Check(m, {}, seed), "") << "call 0";
  for (int i = 1; i < 3; ++i) {
    std::thread([&] { EXPECT_EQ(p.Check(m, {}, seed + i), "") << "call " << i; }).join();
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  const int calls_after_first_tuning = calls;
  EXPECT_GT(calls, 0);
  EXPECT_LE(calls, 5);
  EXPECT_NE(std::find(tried.begin(), tried.end(), heuristic->config), tried.end())
      << "the heuristic's " << heuristic->config.ToString() << " was not a candidate";
  EXPECT_EQ(jit_test::CountOccurrences(err, "autotune of"), 1) << err;
  EXPECT_NE(err.find("test: NVRTC failed"), std::string::npos) << err;
  absl::StatusOr<GemvPlan> plan = PlanGemv(p.dm, m);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->source, "heuristic");
  EXPECT_EQ(plan->config, heuristic->config);
  EXPECT_EQ(calls, calls_after_first_tuning) << "a failed shape was tuned again";
  EXPECT_FALSE(gemvz::testing::Exists(file));

  // Only the first candidate fails, at its launch: the others are timed and the winner is saved.
  internal::ForgetAutotunedForTesting();
  std::optional<KernelConfig> failed;
  internal::SetAutotuneCandidateHookForTesting(
      [&](const KernelConfig& c, internal::AutotuneStage stage) -> absl::Status {
        if (stage != internal::AutotuneStage::kLaunch) return absl::OkStatus();
        if (!failed) failed = c;
        return c == *failed ? absl::ResourceExhaustedError("test: out of memory")
                            : absl::OkStatus();
      });
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(p.Check(m, {}, seed + 3), "");
  const std::string err2 = ::testing::internal::GetCapturedStderr();
  internal::SetAutotuneCandidateHookForTesting(nullptr);
  EXPECT_NE(err2.find("1 of"), std::string::npos) << err2;
  EXPECT_NE(err2.find("test: out of memory"), std::string::npos) << err2;
  absl::StatusOr<std::vector<TunedChoice>> saved = LoadTunedChoices();
  ASSERT_TRUE(saved.ok()) << saved.status();
  ASSERT_EQ(saved->size(), 1u);
  ASSERT_TRUE(failed.has_value());
  EXPECT_NE((*saved)[0].config, *failed);
}

// GEMVZ_AUTOTUNE=1, no tuning file (so a tuned shape's answer lives only in the process): while
// one thread tunes a shape, other threads' first calls for a shape tuned earlier, eager or during
// a capture, get its answer without waiting for that tuning; and a call for the shape being tuned
// waits for that tuning's answer instead of tuning the shape again.
TEST(Gemv, ATuningDoesNotHoldUpCallsForShapesTunedBefore) {
  GEMVZ_REQUIRE_GPU();
  const ScopedAutotune autotune("2", TunedWinners::kInTheProcessOnly);
  const uint64_t seed = FreshSeed();
  const int64_t k = 2048, m = 4;  // no table has 1280x2048 or 2816x2048
  const Problem tuned = Problem::Make(1280, k, MixedWeights(1280, k, seed));
  const Problem tuning = Problem::Make(2816, k, MixedWeights(2816, k, seed + 1));
  for (const Problem* p : {&tuned, &tuning}) {
    const absl::StatusOr<GemvPlan> plan = internal::PlanGemvInternal(p->dm, m, {}, false);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_EQ(plan->source, "heuristic") << p->n << "x" << k;
  }
  ::testing::internal::CaptureStderr();  // each tuning's save that cannot be
  const absl::StatusOr<GemvPlan> earlier = internal::PlanGemvInternal(tuned.dm, m, {}, true);
  ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(earlier.ok()) << earlier.status();
  ASSERT_EQ(earlier->source, "autotuned");

  // The tuning holds at its first compiled candidate until released. The hook runs on the thread
  // that tunes: each thread that reached it is kept.
  absl::Notification in_tuning, release;
  absl::Mutex mu;
  std::vector<std::thread::id> tuned_on;
  internal::SetAutotuneCandidateHookForTesting(
      [&](const KernelConfig&, internal::AutotuneStage stage) -> absl::Status {
        if (stage != internal::AutotuneStage::kCompile) return absl::OkStatus();
        bool first = false;
        {
          absl::MutexLock lock(&mu);
          first = tuned_on.empty();
          tuned_on.push_back(std::this_thread::get_id());
        }
        if (first) {
          in_tuning.Notify();
          release.WaitForNotificationWithTimeout(absl::Seconds(120));
        }
        return absl::OkStatus();
      });
  absl::StatusOr<GemvPlan> tuner_plan, waiter_plan, eager_plan, capture_plan;
  ::testing::internal::CaptureStderr();
  absl::Notification eager_done, capture_done;
  // Fresh threads, whose first calls find no copies of their own (per_thread_cache.h): a pool's
  // threads that asked before would read their copies and never meet the locks.
  std::thread tuner([&] { tuner_plan = internal::PlanGemvInternal(tuning.dm, m, {}, true); });
  const bool tuning_started = in_tuning.WaitForNotificationWithTimeout(absl::Seconds(120));
  std::thread waiter([&] { waiter_plan = internal::PlanGemvInternal(tuning.dm, m, {}, true); });
  const std::thread::id tuner_id = tuner.get_id();
  std::thread eager([&] {
    eager_plan = internal::PlanGemvInternal(tuned.dm, m, {}, true);
    eager_done.Notify();
  });
  std::thread capture([&] {  // what Gemv asks while the caller's stream is being captured
    capture_plan = internal::PlanGemvInternal(tuned.dm, m, {}, false);
    capture_done.Notify();
  });
  const bool eager_in_time = eager_done.WaitForNotificationWithTimeout(absl::Seconds(20));
  const bool capture_in_time = capture_done.WaitForNotificationWithTimeout(absl::Seconds(20));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the waiter at the tuning's lock
  release.Notify();
  for (std::thread* t : {&tuner, &waiter, &eager, &capture}) t->join();
  ::testing::internal::GetCapturedStderr();

  ASSERT_TRUE(tuning_started) << "the tuning never reached its first candidate";
  EXPECT_TRUE(eager_in_time) << "an eager call for a tuned shape waited for another's tuning";
  EXPECT_TRUE(capture_in_time) << "a call during a capture waited for another shape's tuning";
  for (const absl::StatusOr<GemvPlan>* plan : {&eager_plan, &capture_plan}) {
    ASSERT_TRUE(plan->ok()) << plan->status();
    EXPECT_EQ((*plan)->source, "autotuned");
    EXPECT_EQ((*plan)->config, earlier->config);
  }
  ASSERT_TRUE(tuner_plan.ok()) << tuner_plan.status();
  ASSERT_TRUE(waiter_plan.ok()) << waiter_plan.status();
  EXPECT_EQ(tuner_plan->source, "autotuned");
  EXPECT_EQ(waiter_plan->source, "autotuned");
  EXPECT_EQ(waiter_plan->config, tuner_plan->config);
  ASSERT_FALSE(tuned_on.empty());
  for (const std::thread::id id : tuned_on) {
    EXPECT_EQ(id, tuner_id) << "the shape was tuned again by the call that waited for it";
  }
  EXPECT_EQ(tuned.Check(m, {}, seed + 2), "");  // and the plans run right
  EXPECT_EQ(tuning.Check(m, {}, seed + 3), "");
}

// Another thread captures a graph of its own stream in the default (global) mode while this one
// makes first uses: a kernel never loaded, a split-K configuration's first workspace, and an
// autotune; releases a stream's workspace; uploads weights and frees a matrix. None of them may
// fail, nor break that capture.
TEST(Gemv, FirstUsesBesideAnotherThreadsCapture) {
  GEMVZ_REQUIRE_GPU();
  const auto& api = **internal::Driver();
  const ScopedAutotune tuning("4");
  const uint64_t seed = FreshSeed();
  const Problem captured = Problem::Make(1024, 4096, MixedWeights(1024, 4096, seed));
  DeviceBuffer dx(16 * 4096 * 2), dout(16 * 4096 * 2);
  const TestStream capture_stream;
  ASSERT_TRUE(capture_stream.ok());
  const GemvOptions captured_opt{KernelConfig{WeightFormat::kZ12, 4, 2, 1, 1, 2}};
  ASSERT_TRUE(
      Gemv(captured.dm, dx.as<uint16_t>(), 8, dout.as<uint16_t>(), capture_stream, captured_opt)
          .ok());
  ASSERT_EQ(api.cuStreamSynchronize(capture_stream), CUDA_SUCCESS);

  // The first uses, each on a fresh stream of this thread.
  const int64_t n = 2560, k = 3072;  // no table has 2560x3072
  const Problem tuned = Problem::Make(n, k, MixedWeights(n, k, seed + 1));
  // A configuration outside the sweep (UG 3), so not loaded by another test, and a split-K one.
  const GemvOptions fresh_kernel{KernelConfig::Parse("z12.nw5.ug3.nb1.pipe0.s1").value()};
  const GemvOptions split_k{KernelConfig::Parse("z12.nw4.ug1.nb1.pipe3.s3").value()};
  // Streams and buffers are made before the capture begins and the results read after it ends:
  // in the window this thread calls only the library (an allocation or a synchronous copy of
  // the test's own would itself break a global-mode capture).
  struct Use {
    const char* what;
    GemvOptions options;
    std::unique_ptr<TestStream> stream;
    std::unique_ptr<DeviceBuffer> out;
    absl::Status status;
  };
  std::vector<Use> uses;
  uses.push_back({"a kernel loaded for the first time", fresh_kernel});
  uses.push_back({"a split-K workspace's first allocation", split_k});
  uses.push_back({"an autotune", {}});
  const int64_t m = 3;
  const auto x = testing::RandomActivations(m, k, seed + 2);
  DeviceBuffer tx(m * k * 2);
  tx.Upload(x.data(), x.size() * 2);
  for (Use& u : uses) {
    u.stream = std::make_unique<TestStream>();
    ASSERT_TRUE(u.stream->ok());
    u.out = std::make_unique<DeviceBuffer>(m * n * 2);
    u.out->Fill16(kPoison);
  }
  // Weights uploaded inside the window (packed and plain), generated outside it.
  const std::vector<uint16_t> upload_w = MixedWeights(256, 512, seed + 3);
  // A stream whose split-K workspace is released inside the window.
  const TestStream released;
  ASSERT_TRUE(released.ok());
  DeviceBuffer rout(m * n * 2);
  ASSERT_TRUE(Gemv(tuned.dm, tx.as<uint16_t>(), m, rout.as<uint16_t>(), released, split_k).ok());
  ASSERT_EQ(api.cuStreamSynchronize(released), CUDA_SUCCESS);
  testing::Synchronize();
  absl::Notification begun, uses_done;
  CUresult begin = CUDA_SUCCESS, end = CUDA_SUCCESS;
  absl::Status in_capture;
  CUgraph graph = nullptr;
  std::thread capturer([&] {
    auto scope = internal::ScopedDeviceContext::Enter(0);
    begin = api.cuStreamBeginCapture(capture_stream, CU_STREAM_CAPTURE_MODE_GLOBAL);
    begun.Notify();
    uses_done.WaitForNotification();
    in_capture = Gemv(captured.dm, dx.as<uint16_t>(), 8, dout.as<uint16_t>(), capture_stream,
                      captured_opt);
    end = api.cuStreamEndCapture(capture_stream, &graph);
  });
  begun.WaitForNotification();
  for (Use& u : uses) {
    u.status = Gemv(tuned.dm, tx.as<uint16_t>(), m, u.out->as<uint16_t>(), *u.stream, u.options);
  }
  const absl::Status release = ReleaseGemvWorkspace(released);
  absl::StatusOr<GemvPlan> plan = PlanGemv(tuned.dm, m);
  absl::StatusOr<DeviceMatrix> uploaded = DeviceMatrix::FromBf16(upload_w.data(), 256, 512, 0);
  absl::StatusOr<DeviceMatrix> uploaded_plain = DeviceMatrix::UploadPlain(upload_w.data(), 256, 512);
  const bool dropped = DeviceMatrix::FromBf16(upload_w.data(), 256, 512, 0).ok();  // freed here
  uses_done.Notify();
  capturer.join();
  EXPECT_EQ(begin, CUDA_SUCCESS);
  EXPECT_TRUE(release.ok()) << release;
  EXPECT_TRUE(dropped);
  ASSERT_TRUE(uploaded.ok()) << uploaded.status();
  ASSERT_TRUE(uploaded_plain.ok()) << uploaded_plain.status();
  const Problem up{256, 512, upload_w, *uploaded};
  EXPECT_EQ(up.Check(5, {}, seed + 4), "") << "weights uploaded beside the capture";
  const Problem up_plain{256, 512, upload_w, *uploaded_plain};
  EXPECT_EQ(up_plain.Check(5, {}, seed + 5), "") << "plain weights uploaded beside the capture";
  std::vector<double> ref, abs_sum;
  testing::ReferenceGemv(tuned.w, x, m, n, k, &ref, &abs_sum);
  for (Use& u : uses) {
    EXPECT_TRUE(u.status.ok()) << u.what << ": " << u.status;
    EXPECT_EQ(api.cuStreamSynchronize(*u.stream), CUDA_SUCCESS) << u.what;
    std::vector<uint16_t> got(m * n);
    u.out->Download(got.data(), got.size() * 2);
    if (u.status.ok())
      EXPECT_EQ(testing::CompareToReference(got, ref, abs_sum, m, n), "") << u.what;
  }
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->source, "tuning-file") << "the autotune did not complete and save its winner";
  EXPECT_TRUE(in_capture.ok()) << in_capture;
  EXPECT_EQ(end, CUDA_SUCCESS) << "the other thread's capture was invalidated";
  if (graph != nullptr) api.cuGraphDestroy(graph);
}

TEST(Gemv, TwoStreamsAtOnce) {
  GEMVZ_REQUIRE_GPU();
  const auto& api = **internal::Driver();
  const uint64_t seed = FreshSeed();
  const int64_t n = 2048, k = 8192, m = 16;
  const Problem p = Problem::Make(n, k, MixedWeights(n, k, seed));
  auto x0 = testing::RandomActivations(m, k, seed), x1 = testing::RandomActivations(m, k, seed + 1);
  DeviceBuffer dx0(m * k * 2), dx1(m * k * 2), do0(m * n * 2), do1(m * n * 2);
  dx0.Upload(x0.data(), x0.size() * 2);
  dx1.Upload(x1.data(), x1.size() * 2);
  do0.Fill16(kPoison);
  do1.Fill16(kPoison);
  const TestStream s0, s1;
  ASSERT_TRUE(s0.ok() && s1.ok());
  const GemvOptions opt{KernelConfig{WeightFormat::kZ12, 8, 2, 2, 3, 4}};  // split-K: workspaces
  absl::Status st0, st1;
  std::thread t0([&] {
    for (int i = 0; i < 50 && st0.ok(); ++i)
      st0 = Gemv(p.dm, dx0.as<uint16_t>(), m, do0.as<uint16_t>(), s0, opt);
  });
  std::thread t1([&] {
    for (int i = 0; i < 50 && st1.ok(); ++i)
      st1 = Gemv(p.dm, dx1.as<uint16_t>(), m, do1.as<uint16_t>(), s1, opt);
  });
  t0.join();
  t1.join();
  ASSERT_TRUE(st0.ok()) << st0;
  ASSERT_TRUE(st1.ok()) << st1;
  api.cuStreamSynchronize(s0);
  api.cuStreamSynchronize(s1);
  for (int i = 0; i < 2; ++i) {
    std::vector<uint16_t> got(m * n);
    (i == 0 ? do0 : do1).Download(got.data(), got.size() * 2);
    std::vector<double> ref, abs_sum;
    testing::ReferenceGemv(p.w, i == 0 ? x0 : x1, m, n, k, &ref, &abs_sum);
    EXPECT_EQ(testing::CompareToReference(got, ref, abs_sum, m, n), "") << "stream " << i;
  }
}

// A stream whose queue is full behind unfinished work blocks the thread that launches into it,
// inside cuLaunchKernel. That thread must not hold up GEMVs on other streams: each stream's
// workspace has its own lock (a process-wide one, held across the launches, stalled every
// stream's calls on every device behind the one slow stream).
void WaitForGate(void* gate) { static_cast<absl::Notification*>(gate)->WaitForNotification(); }

TEST(Gemv, AThreadBlockedOnAFullStreamDoesNotStallOtherStreams) {
  GEMVZ_REQUIRE_GPU();
  if (const std::optional<std::string> c = internal::GetEnv("CUDA_DEVICE_MAX_CONNECTIONS");
      c && *c == "1") {
    GTEST_SKIP() << "CUDA_DEVICE_MAX_CONNECTIONS=1: every stream shares one hardware queue, so "
                    "the driver itself stalls the other stream's launch";
  }
  const auto& api = **internal::Driver();
  // cuLaunchHostFunc is not in the library's driver table (the library never needs it).
  void* libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(libcuda, nullptr) << "libcuda.so.1 is not loaded: " << dlerror();
  using LaunchHostFunc = CUresult (*)(CUstream, CUhostFn, void*);
  const auto launch_host_func =
      reinterpret_cast<LaunchHostFunc>(dlsym(libcuda, "cuLaunchHostFunc"));
  ASSERT_NE(launch_host_func, nullptr) << dlerror();

  const uint64_t seed = FreshSeed();
  const int64_t n = 1024, k = 1024, m = 1;
  const Problem p = Problem::Make(n, k, MixedWeights(n, k, seed));
  auto x = testing::RandomActivations(m, k, seed);
  DeviceBuffer dx(m * k * 2), dout_a(m * n * 2), dout_b(m * n * 2);
  dx.Upload(x.data(), x.size() * 2);
  dout_b.Fill16(kPoison);
  absl::Notification gate;  // before the streams: ~TestStream waits for a's host function
  const TestStream a, b;
  ASSERT_TRUE(a.ok() && b.ok());
  // Split-K, so that every call takes its stream's workspace.
  const GemvOptions opt{KernelConfig{WeightFormat::kZ12, 8, 1, 1, 2, 2}};
  ASSERT_TRUE(Gemv(p.dm, dx.as<uint16_t>(), m, dout_b.as<uint16_t>(), b, opt).ok());  // compiled
  ASSERT_EQ(api.cuStreamSynchronize(b), CUDA_SUCCESS);
  dout_b.Fill16(kPoison);

  // No ASSERT from here until the gate opens: the stream's host function waits for it.
  const CUresult held = launch_host_func(a, WaitForGate, &gate);
  constexpr int64_t kMaxCalls = 200000;
  std::atomic<int64_t> queued{0};
  std::atomic<bool> a_failed{false}, stop{false};
  absl::Status st_a;  // the filler's, read after it is joined
  std::thread filler([&] {
    for (int64_t i = 0; i < kMaxCalls && !stop.load(); ++i) {
      st_a = Gemv(p.dm, dx.as<uint16_t>(), m, dout_a.as<uint16_t>(), a, opt);
      if (!st_a.ok()) {
        a_failed = true;
        break;
      }
      queued.fetch_add(1);
    }
  });
  // The filler is blocked once its count has not moved for half a second.
  int64_t last = -1;
  auto moved_at = std::chrono::steady_clock::now();
  while (held == CUDA_SUCCESS && !a_failed.load() && queued.load() < kMaxCalls) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const int64_t now_queued = queued.load();
    const auto now = std::chrono::steady_clock::now();
    if (now_queued != last) {
      last = now_queued;
      moved_at = now;
    } else if (now - moved_at > std::chrono::milliseconds(500)) {
      break;
    }
  }
  const int64_t stalled_at = queued.load();
  absl::Status st_b;
  absl::Notification b_done;
  std::thread other([&] {
    st_b = Gemv(p.dm, dx.as<uint16_t>(), m, dout_b.as<uint16_t>(), b, opt);
    b_done.Notify();
  });
  const auto t0 = std::chrono::steady_clock::now();
  const bool b_in_time = b_done.WaitForNotificationWithTimeout(absl::Seconds(10));
  const double b_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  // Still where it stopped: the filler was blocked (in a launch into the full queue) throughout.
  const bool still_blocked = queued.load() == stalled_at;
  stop = true;
  gate.Notify();
  other.join();
  filler.join();

  ASSERT_EQ(held, CUDA_SUCCESS);
  ASSERT_TRUE(st_a.ok()) << st_a;
  ASSERT_TRUE(st_b.ok()) << st_b;
  ASSERT_EQ(api.cuStreamSynchronize(a), CUDA_SUCCESS);
  ASSERT_EQ(api.cuStreamSynchronize(b), CUDA_SUCCESS);
  std::vector<uint16_t> got(m * n);
  dout_b.Download(got.data(), got.size() * 2);
  std::vector<double> ref, abs_sum;
  testing::ReferenceGemv(p.w, x, m, n, k, &ref, &abs_sum);
  EXPECT_EQ(testing::CompareToReference(got, ref, abs_sum, m, n), "");
  if (stalled_at >= kMaxCalls) {
    GTEST_SKIP() << kMaxCalls << " launches into the held stream never blocked: this driver's "
                 << "queue is deeper, so no thread was stalled to test against";
  }
  if (b_in_time && !still_blocked) {
    GTEST_SKIP() << "the filler moved on after " << stalled_at << " calls while the gate was "
                 << "still shut: its pause was not a full queue, so nothing was tested";
  }
  std::printf(
      "[ info ] the filler blocked after %lld calls; a call on another stream took "
      "%.3f ms meanwhile\n",
      static_cast<long long>(stalled_at), b_ms);
  EXPECT_TRUE(b_in_time) << "a Gemv on stream b waited over 10 s for a thread blocked launching "
                         << "into stream a (after " << stalled_at << " calls)";
}

// cudaStreamPerThread (CU_STREAM_PER_THREAD) is one handle for a different stream in every
// thread, and those streams run concurrently: split-K calls from two threads on it must not share
// partials and arrival counters.
TEST(Gemv, PerThreadDefaultStreamsHaveTheirOwnWorkspaces) {
  GEMVZ_REQUIRE_GPU();
  const auto& api = **internal::Driver();
  const uint64_t seed = FreshSeed();
  const int64_t n = 2048, k = 8192, m = 16;
  const Problem p = Problem::Make(n, k, MixedWeights(n, k, seed));
  CUstream per_thread = CU_STREAM_PER_THREAD;
  const GemvOptions opt{KernelConfig{WeightFormat::kZ12, 8, 2, 2, 3, 4}};  // split-K: workspaces
  std::vector<uint16_t> x[2] = {testing::RandomActivations(m, k, seed),
                                testing::RandomActivations(m, k, seed + 1)};
  DeviceBuffer dx0(m * k * 2), dx1(m * k * 2), do0(m * n * 2), do1(m * n * 2);
  DeviceBuffer* dx[2] = {&dx0, &dx1};
  DeviceBuffer* dout[2] = {&do0, &do1};
  for (int i = 0; i < 2; ++i) {
    dx[i]->Upload(x[i].data(), x[i].size() * 2);
    dout[i]->Fill16(kPoison);
  }
  testing::Synchronize();
  // One thread's calls: another thread sees no workspace of its own.
  absl::Status st = Gemv(p.dm, dx0.as<uint16_t>(), m, do0.as<uint16_t>(), per_thread, opt);
  ASSERT_TRUE(st.ok()) << st;
  absl::StatusOr<int64_t> mine = GemvWorkspaceBytes(per_thread);
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_GT(*mine, 0);
  absl::StatusOr<int64_t> other;
  std::thread([&] { other = GemvWorkspaceBytes(per_thread); }).join();
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(*other, 0) << "a new thread's per-thread stream holds the first thread's workspace";
  // Nor does a thread started after one that used it has ended (glibc reuses thread ids).
  absl::Status ended;
  std::thread([&] {
    auto scope = internal::ScopedDeviceContext::Enter(0);
    ended = scope.ok() ? Gemv(p.dm, dx1.as<uint16_t>(), m, do1.as<uint16_t>(), per_thread, opt)
                       : scope.status();
    if (ended.ok() && api.cuStreamSynchronize(per_thread) != CUDA_SUCCESS) {
      ended = absl::InternalError("cuStreamSynchronize");
    }
  }).join();
  ASSERT_TRUE(ended.ok()) << ended;
  std::thread([&] { other = GemvWorkspaceBytes(per_thread); }).join();
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(*other, 0) << "a thread inherited the workspace of a thread that ended";

  // Two threads at once, each on its own per-thread stream, right results for both.
  absl::Status sts[2];
  auto worker = [&](int i) {
    auto scope = internal::ScopedDeviceContext::Enter(0);
    if (!scope.ok()) {
      sts[i] = scope.status();
      return;
    }
    for (int r = 0; r < 200 && sts[i].ok(); ++r) {
      sts[i] = Gemv(p.dm, dx[i]->as<uint16_t>(), m, dout[i]->as<uint16_t>(), per_thread, opt);
    }
    if (sts[i].ok() && api.cuStreamSynchronize(per_thread) != CUDA_SUCCESS) {
      sts[i] = absl::InternalError("cuStreamSynchronize");
    }
    if (sts[i].ok()) sts[i] = ReleaseGemvWorkspace(per_thread);
  };
  std::thread t0(worker, 0), t1(worker, 1);
  t0.join();
  t1.join();
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(sts[i].ok()) << sts[i];
    std::vector<uint16_t> got(m * n);
    dout[i]->Download(got.data(), got.size() * 2);
    std::vector<double> ref, abs_sum;
    testing::ReferenceGemv(p.w, x[i], m, n, k, &ref, &abs_sum);
    EXPECT_EQ(testing::CompareToReference(got, ref, abs_sum, m, n), "") << "thread " << i;
  }
  EXPECT_TRUE(ReleaseGemvWorkspace(per_thread).ok());
}

TEST(Gemv, ErrorPaths) {
  GEMVZ_REQUIRE_GPU();
  const int64_t n = 64, k = 256;
  const Problem p = Problem::Make(n, k, testing::RandomMatrix(n, k, Distribution::kNormal, 1));
  DeviceBuffer dx(16 * k * 2), dout(16 * n * 2);
  auto run = [&](int64_t m, GemvOptions opt, const uint16_t* x, uint16_t* out) {
    return Gemv(p.dm, x, m, out, nullptr, opt);
  };
  const uint16_t* x = dx.as<uint16_t>();
  uint16_t* out = dout.as<uint16_t>();
  EXPECT_NE(run(0, {}, x, out).message().find("m must be >= 1"), std::string::npos);
  EXPECT_NE(run(1, {}, nullptr, out).message().find("not null"), std::string::npos);
  EXPECT_NE(run(1, {}, x, nullptr).message().find("not null"), std::string::npos);
  EXPECT_NE(Gemv(DeviceMatrix(), x, 1, out, nullptr).message().find("empty"), std::string::npos);
  // K = 256 = 4 groups: not one for each of 8 warps.
  auto st = run(1, GemvOptions{KernelConfig{WeightFormat::kZ12, 8, 1, 1, 3, 1}}, x, out);
  EXPECT_NE(st.message().find("K/(64*S*UG) = 4 trips per K slice must be at least NW = 8"),
            std::string::npos)
      << st;
  st = run(1, GemvOptions{KernelConfig{WeightFormat::kBf16, 4, 1, 1, 3, 1}}, x, out);
  EXPECT_NE(st.message().find("matrix is z12"), std::string::npos) << st;
  st = run(9, GemvOptions{KernelConfig{WeightFormat::kZ12, 2, 1, 1, 3, 1}}, x, out);
  EXPECT_TRUE(st.ok()) << "m above 8*NB runs in chunks: " << st;
  EXPECT_FALSE(DeviceMatrix::Upload(PackedMatrix{}, 0).ok());
  auto packed = Pack(p.w.data(), n, k);
  ASSERT_TRUE(packed.ok());
  auto bad_dev = DeviceMatrix::Upload(*packed, 99);
  EXPECT_FALSE(bad_dev.ok());
  EXPECT_NE(bad_dev.status().message().find("device 99"), std::string::npos) << bad_dev.status();
  // Two row blocks per CTA need N % 32 == 0; 64 rows pass, 48 do not.
  st = run(5, GemvOptions{KernelConfig{WeightFormat::kZ12, 4, 1, 2, 3, 1, 2}}, x, out);
  EXPECT_TRUE(st.ok()) << st;
  {
    const Problem q =
        Problem::Make(48, k, testing::RandomMatrix(48, k, Distribution::kNormal, 2));
    st = Gemv(q.dm, x, 5, out, nullptr,
              GemvOptions{KernelConfig{WeightFormat::kZ12, 4, 1, 2, 3, 1, 2}});
    EXPECT_NE(st.message().find("N must be a multiple of 16*RB = 32"), std::string::npos) << st;
  }
  setenv("GEMVZ_FORCE_CONFIG", "z12.nw3", 1);
  st = run(1, {}, x, out);
  unsetenv("GEMVZ_FORCE_CONFIG");
  EXPECT_NE(st.message().find("GEMVZ_FORCE_CONFIG"), std::string::npos) << st;
}

// A misaligned x or out is refused before anything is launched: in a kernel it would be a
// misaligned-address fault, which spoils the context for every later call. The plain path with K
// not a multiple of 64 copies x first, so there x needs only its elements' alignment.
TEST(Gemv, MisalignedPointersAreRefusedBeforeAnyLaunch) {
  GEMVZ_REQUIRE_GPU();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const int64_t n = 64, k = 256;
  const Problem p = Problem::Make(n, k, testing::RandomMatrix(n, k, Distribution::kNormal, seed));
  ASSERT_EQ(p.dm.format(), WeightFormat::kZ12);
  auto plain = DeviceMatrix::UploadPlain(p.w.data(), n, k);
  ASSERT_TRUE(plain.ok()) << plain.status();
  DeviceBuffer dx(2 * 16 * 1024 * 2), dout(2 * 16 * 256 * 4);
  const uint16_t* x = dx.as<uint16_t>();
  uint16_t* out = dout.as<uint16_t>();
  auto bytes_past = [](auto* ptr, int bytes) {
    using T = std::remove_pointer_t<decltype(ptr)>;
    return reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(ptr) + bytes);
  };
  for (const DeviceMatrix* w : std::initializer_list<const DeviceMatrix*>{&p.dm, &*plain}) {
    for (int off : {2, 8, 14}) {
      const absl::Status st = Gemv(*w, bytes_past(x, off), 1, out, nullptr);
      EXPECT_NE(st.message().find("must be 16-byte aligned"), std::string::npos) << st;
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    }
    EXPECT_NE(Gemv(*w, x, 1, bytes_past(out, 1), nullptr).message().find("2-byte aligned"),
              std::string::npos);
    float* out32 = dout.as<float>();
    EXPECT_NE(GemvFp32(*w, x, 1, bytes_past(out32, 2), nullptr).message().find("4-byte aligned"),
              std::string::npos);
    EXPECT_TRUE(Gemv(*w, bytes_past(x, 16), 1, bytes_past(out, 2), nullptr).ok());
  }
  // K = 1000: the plain path copies x, so any 2-byte aligned x will do; an odd address will not.
  const Problem padded =
      Problem::Make(48, 1000, testing::RandomMatrix(48, 1000, Distribution::kNormal, seed + 1));
  ASSERT_EQ(padded.dm.format(), WeightFormat::kBf16);
  EXPECT_TRUE(Gemv(padded.dm, bytes_past(x, 2), 3, out, nullptr).ok());
  EXPECT_NE(Gemv(padded.dm, bytes_past(x, 1), 3, out, nullptr).message().find("2-byte aligned"),
            std::string::npos);
  // Nothing was spoiled: the context still runs GEMVs, and right.
  absl::StatusOr<CUcontext> ctx = internal::PrimaryContext(0);
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  const auto& api = **internal::Driver();
  ASSERT_EQ(api.cuCtxSetCurrent(*ctx), CUDA_SUCCESS);
  EXPECT_EQ(api.cuCtxSynchronize(), CUDA_SUCCESS);
  EXPECT_EQ(p.Check(8, {}, seed + 2), "");
  EXPECT_EQ(padded.Check(8, {}, seed + 3), "");
}

// Group-major weights (WeightOrder::kGroupMajor): each 12-bit configuration of a broad sweep
// (drawn afresh each run), split-K and RB 2 and 4 included, on a matrix uploaded group-major gives
// bitwise the result of the same configuration on the block-major upload (the kernels differ in
// addresses only, so the sums are the same in the same order), which is right against the
// reference; PDL launches (the group-major prefetch) too. Three shapes, whose row-block counts
// are the group stride of the group-major address: 256x4096 (16 row blocks, 400 configurations);
// 192x3072 (12, not a power of two, which RB 2 and 4 and split-K all take; 200); and 208x2752
// (13, odd, and 43 groups, a prime, so that warps take uneven shares of K; RB 1, UG 1 and S 1
// only, 100).
TEST(Gemv, GroupMajorMatchesBlockMajorBitForBit) {
  GEMVZ_REQUIRE_GPU();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  auto arch = internal::DeviceArch(0);
  ASSERT_TRUE(arch.ok());
  std::mt19937 rng(static_cast<uint32_t>(seed));
  struct Case {
    int64_t n, k;
    size_t sample;
  };
  for (const Case& shape : {Case{256, 4096, 400}, Case{192, 3072, 200}, Case{208, 2752, 100}}) {
    const int64_t n = shape.n, k = shape.k;
    SCOPED_TRACE(::testing::Message() << n << "x" << k);
    const std::vector<uint16_t> w = MixedWeights(n, k, seed + n);
    const Problem block = Problem::Make(n, k, w, false, {WeightOrder::kBlockMajor});
    const Problem group = Problem::Make(n, k, w, false, {WeightOrder::kGroupMajor});
    ASSERT_EQ(block.dm.order(), WeightOrder::kBlockMajor);
    ASSERT_EQ(group.dm.order(), WeightOrder::kGroupMajor);
    ASSERT_EQ(group.dm.format(), WeightFormat::kZ12);
    std::vector<KernelConfig> configs =
        ValidConfigs(WeightFormat::kZ12, n, k, {1, 2, 3, 4, 7, 8, 16}, {1, 2, 4});
    // A fresh sample of the space each run (all of it would be ~1000 more kernels to compile).
    std::shuffle(configs.begin(), configs.end(), rng);
    configs.resize(std::min(configs.size(), shape.sample));
    std::vector<KernelConfig> both;
    for (const KernelConfig& c : configs) {
      both.push_back(c);
      both.push_back(internal::InOrder(c, WeightOrder::kGroupMajor));
    }
    ASSERT_TRUE(PrecompileAll(internal::DistinctKernels(both), *arch, 0).ok());
    DeviceBuffer dx(static_cast<size_t>(32 * k * 2)), d1(static_cast<size_t>(32 * n * 2)),
        d2(static_cast<size_t>(32 * n * 2));
    int tested = 0;
    for (const KernelConfig& c : configs) {
      const int64_t m = 1 + static_cast<int64_t>(rng() % (8 * c.nb));
      const std::vector<uint16_t> x = testing::RandomActivations(m, k, seed + tested);
      dx.Upload(x.data(), x.size() * 2);
      const KernelConfig g = internal::InOrder(c, WeightOrder::kGroupMajor);
      GemvOptions gopt{g};
      if (tested % 4 == 0) gopt.pdl = Pdl::kAlways;  // the group-major prefetch
      d1.Fill16(kPoison);
      d2.Fill16(kPoison);
      ASSERT_TRUE(Gemv(block.dm, dx.as<uint16_t>(), m, d1.as<uint16_t>(), nullptr, {c}).ok());
      const absl::Status st =
          Gemv(group.dm, dx.as<uint16_t>(), m, d2.as<uint16_t>(), nullptr, gopt);
      ASSERT_TRUE(st.ok()) << g.ToString() << ": " << st;
      std::vector<uint16_t> a(static_cast<size_t>(m * n)), b(a.size());
      d1.Download(a.data(), a.size() * 2);
      d2.Download(b.data(), b.size() * 2);
      EXPECT_EQ(a, b) << g.ToString() << " m=" << m;
      if (tested % 8 == 0) EXPECT_EQ(group.Check(m, gopt, seed + tested, &x), "") << g.ToString();
      ++tested;
    }
    EXPECT_EQ(tested, static_cast<int>(shape.sample));
    std::printf("[ info ] %lldx%lld: %d configurations in both orders\n", static_cast<long long>(n),
                static_cast<long long>(k), tested);
  }
}

// The order a matrix is uploaded in: asked (UploadOptions), else GEMVZ_WEIGHT_ORDER, else the
// tuned table's order for the shape on this GPU (PreferredOrder). A configuration of the other
// order forced through the API is refused, naming the one that fits; one from GEMVZ_FORCE_CONFIG
// runs in the matrix's order.
TEST(Gemv, WeightOrderAtUploadAndMismatchedConfigurations) {
  GEMVZ_REQUIRE_GPU();
  auto arch = internal::DeviceArch(0);
  ASSERT_TRUE(arch.ok());
  const int64_t n = 4096, k = 8192;  // the suite's pooler: group-major in the sm_90 table
  const std::vector<uint16_t> w = testing::RandomMatrix(n, k, Distribution::kNormal, 3);
  auto dm = DeviceMatrix::FromBf16(w.data(), n, k);
  ASSERT_TRUE(dm.ok()) << dm.status();
  EXPECT_EQ(dm->order(), PreferredOrder(*arch, n, k));
  if (*arch == "sm_90") EXPECT_EQ(dm->order(), WeightOrder::kGroupMajor);
  setenv("GEMVZ_WEIGHT_ORDER", "block", 1);
  auto env_block = DeviceMatrix::FromBf16(w.data(), n, k);
  setenv("GEMVZ_WEIGHT_ORDER", "sideways", 1);
  auto bad = DeviceMatrix::FromBf16(w.data(), n, k);
  setenv("GEMVZ_WEIGHT_ORDER", "group", 1);
  auto explicit_block = DeviceMatrix::FromBf16(w.data(), 64, 256, 0, {WeightOrder::kBlockMajor});
  auto env_group = DeviceMatrix::FromBf16(w.data(), 64, 256);
  unsetenv("GEMVZ_WEIGHT_ORDER");
  ASSERT_TRUE(env_block.ok()) << env_block.status();
  EXPECT_EQ(env_block->order(), WeightOrder::kBlockMajor);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("GEMVZ_WEIGHT_ORDER must be block, group or auto"),
            std::string::npos)
      << bad.status();
  ASSERT_TRUE(explicit_block.ok() && env_group.ok());
  EXPECT_EQ(explicit_block->order(), WeightOrder::kBlockMajor);  // the option wins
  EXPECT_EQ(env_group->order(), WeightOrder::kGroupMajor);
  // Plain BF16 has no order.
  auto plain = DeviceMatrix::UploadPlain(w.data(), 64, 256);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->order(), WeightOrder::kBlockMajor);

  // A block-major configuration on the group-major matrix: refused, naming the fix.
  const Problem p = Problem::Make(64, 256, testing::RandomMatrix(64, 256, Distribution::kNormal, 4),
                                  false, {WeightOrder::kGroupMajor});
  DeviceBuffer dx(8 * 256 * 2), dout(8 * 64 * 2);
  const KernelConfig c{WeightFormat::kZ12, 2, 1, 1, 3, 1};
  absl::Status st = Gemv(p.dm, dx.as<uint16_t>(), 1, dout.as<uint16_t>(), nullptr, {c});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("reads block-major weights, but the matrix was uploaded "
                              "group-major: use z12.nw2.ug1.nb1.pipe3.gm.s1"),
            std::string::npos)
      << st;
  // GEMVZ_FORCE_CONFIG is process-wide and meets matrices of both orders: it runs in each one's.
  setenv("GEMVZ_FORCE_CONFIG", "z12.nw2.ug1.nb1.pipe3.s1", 1);
  auto env_plan = PlanGemv(p.dm, 3);
  const std::string env_check = p.Check(3, {}, 7);
  unsetenv("GEMVZ_FORCE_CONFIG");
  ASSERT_TRUE(env_plan.ok()) << env_plan.status();
  EXPECT_EQ(env_plan->source, "env");
  EXPECT_EQ(env_plan->config.ToString(), "z12.nw2.ug1.nb1.pipe3.gm.s1");
  EXPECT_EQ(env_check, "");
  EXPECT_EQ(p.Check(3, GemvOptions{internal::InOrder(c, WeightOrder::kGroupMajor)}, 5), "");
  // The dispatcher answers in the matrix's order.
  auto plan = PlanGemv(p.dm, 8);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->config.order, WeightOrder::kGroupMajor);
  EXPECT_EQ(p.Check(8, {}, 6), "");
}

TEST(Gemv, ForcedByEnvironment) {
  GEMVZ_REQUIRE_GPU();
  const int64_t n = 256, k = 2048;
  const Problem p = Problem::Make(n, k, MixedWeights(n, k, 7));
  setenv("GEMVZ_FORCE_CONFIG", "z12.nw2.ug4.nb1.pipe1.s2", 1);
  auto plan = PlanGemv(p.dm, 4);
  EXPECT_EQ(p.Check(4, {}, 3), "");
  unsetenv("GEMVZ_FORCE_CONFIG");
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->source, "env");
  EXPECT_EQ(plan->config.ToString(), "z12.nw2.ug4.nb1.pipe1.s2");
}

// GEMVZ_ARCH is read at every DeviceArch (a warm-up may go from one target to the next by changing
// it), but a device's GEMVs keep the architecture of the device's first use: their plans were
// chosen for it, and a kernel first loaded after the change is built for it too. (The load read
// GEMVZ_ARCH again: after GEMVZ_ARCH=sm_80 on an H200 every new kernel failed to load.)
TEST(Gemv, AChangedGemvzArchLeavesTheDevicesGemvsOnTheirArchitecture) {
  GEMVZ_REQUIRE_GPU();
  const int64_t n = 256, k = 2048;
  const Problem p = Problem::Make(n, k, MixedWeights(n, k, 11));  // the device's first use
  const absl::StatusOr<std::string> arch = internal::DeviceArch(0);
  ASSERT_TRUE(arch.ok()) << arch.status();
  const std::string other = *arch == "sm_80" ? "sm_90" : "sm_80";
  // A kernel nothing in this process has loaded yet.
  const KernelConfig config = KernelConfig::Parse("z12.nw2.ug1.nb1.pipe6.s1").value();
  ASSERT_TRUE(Validate(config, GemvShape{1, n, k}).ok());
  jit_test::ScopedEnv env("GEMVZ_ARCH", other);
  ASSERT_EQ(internal::DeviceArch(0).value_or(""), other);  // what a warm-up now targets
  EXPECT_EQ(p.Check(1, GemvOptions{config}, 5), "");
  auto loaded = internal::GetKernel(0, config);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->compiled->arch, *arch);
}

}  // namespace
}  // namespace gemvz

namespace gemvz {
namespace {

// A cached Gemv call and a bare cuLaunchKernel of the function it launches, on one m = 1 matrix.
struct HostOverheadSetup {
  int64_t n, k;
  DeviceMatrix dm;
  GemvPlan plan;
  internal::LoadedKernel kernel;
  std::unique_ptr<DeviceBuffer> dx, dout;
  Z12Params params{};

  static absl::StatusOr<HostOverheadSetup> Make(int64_t n, int64_t k) {
    HostOverheadSetup h{n, k, {}, {}, {}, nullptr, nullptr};
    auto w = testing::RandomMatrix(n, k, Distribution::kNormal, 3);
    ASSIGN_OR_RETURN(h.dm, DeviceMatrix::FromBf16(w.data(), n, k));
    ASSIGN_OR_RETURN(h.plan, PlanGemv(h.dm, 1));
    h.plan.config.splits = 1;  // the bare launch has no split-K workspace
    ASSIGN_OR_RETURN(h.kernel, internal::GetKernel(0, h.plan.config));
    h.dx = std::make_unique<DeviceBuffer>(k * 2);
    h.dout = std::make_unique<DeviceBuffer>(n * 2);
    h.dx->Fill16(0x3C00);
    Z12Params& p = h.params;
    p = internal::Z12MatrixParams(*h.dm.state());
    p.x = h.dx->as<unsigned short>();
    p.out = h.dout->as<void>();
    p.ldx = k;
    p.ldo = n;
    p.M = 1;
    p.S = 1;
    return h;
  }

  CUresult Bare(CUstream stream) const {
    Z12Params p = params;
    void* args[] = {&p};
    return (*internal::Driver())
        ->cuLaunchKernel(kernel.function,
                         static_cast<unsigned>(dm.state()->n_dense + n / 16 / plan.config.rb), 1, 1,
                         plan.config.threads(), 1, 1, 0, stream, args, nullptr);
  }
  absl::Status Call(CUstream stream) const {
    return Gemv(dm, dx->as<uint16_t>(), 1, dout->as<uint16_t>(), stream, GemvOptions{plan.config});
  }
};

// DESIGN.md asks for the host cost of a cached Gemv call over a bare cuLaunchKernel of the same
// function. This reports it (no assertion on time; a benchmark number, written to BENCHMARKS.md).
TEST(Gemv, HostOverheadReport) {
  GEMVZ_REQUIRE_GPU();
  const auto& api = **internal::Driver();
  const absl::StatusOr<HostOverheadSetup> made = HostOverheadSetup::Make(4096, 4096);
  ASSERT_TRUE(made.ok()) << made.status();
  const HostOverheadSetup& h = *made;
  const TestStream stream;
  ASSERT_TRUE(stream.ok());
  constexpr int kCalls = 2000;
  auto time_calls = [&](auto&& call) {
    for (int i = 0; i < 100; ++i) call();  // warm
    api.cuStreamSynchronize(stream);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kCalls; ++i) call();
    const double us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    api.cuStreamSynchronize(stream);
    return us / kCalls;
  };
  const double bare = time_calls([&] { ASSERT_EQ(h.Bare(stream), CUDA_SUCCESS); });
  const double gemv = time_calls([&] { ASSERT_TRUE(h.Call(stream).ok()); });
  std::printf(
      "[ info ] host time per call, %s: bare cuLaunchKernel %.2f us, Gemv %.2f us "
      "(overhead %.2f us)\n",
      h.plan.config.ToString().c_str(), bare, gemv, gemv - bare);
}

// The same from 1, 2, 4 and 8 threads at once, each on its own stream, few enough calls that no
// queue fills: how the host cost per call grows with threads, bare and through Gemv. Gemv's locks
// should serialize no more than the driver's do (no assertion on time; BENCHMARKS.md). Threads
// with no current context (Gemv enters the device's for each call) and threads that made it
// current first (as a program using the CUDA runtime has it).
TEST(Gemv, HostOverheadThreadsReport) {
  GEMVZ_REQUIRE_GPU();
  const auto& api = **internal::Driver();
  const absl::StatusOr<HostOverheadSetup> made = HostOverheadSetup::Make(1024, 4096);
  ASSERT_TRUE(made.ok()) << made.status();
  const HostOverheadSetup& h = *made;
  const absl::StatusOr<CUcontext> ctx = internal::PrimaryContext(0);
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  constexpr int kCalls = 400;
  for (int run = 0; run < 8; ++run) {
    const bool current = run >= 4;
    const int threads = 1 << (run % 4);
    std::vector<std::unique_ptr<TestStream>> owned;  // released and destroyed after each run
    std::vector<CUstream> streams;
    for (int t = 0; t < threads; ++t) {
      owned.push_back(std::make_unique<TestStream>());
      ASSERT_TRUE(owned.back()->ok());
      streams.push_back(*owned.back());
    }
    // Wall time of `threads` threads making kCalls calls each, per call and thread, in us.
    auto time_calls = [&](auto&& call) {
      std::atomic<bool> ok{true};
      for (CUstream st : streams)
        for (int i = 0; i < 50; ++i) ok = ok && call(st);  // warm: workspaces, first launches
      for (CUstream st : streams) api.cuStreamSynchronize(st);
      std::atomic<int> ready{0};
      std::vector<std::thread> pool;
      std::atomic<bool> go{false};
      for (int t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
          if (current && api.cuCtxSetCurrent(*ctx) != CUDA_SUCCESS) ok = false;
          ready.fetch_add(1);
          while (!go.load()) std::this_thread::yield();
          for (int i = 0; i < kCalls; ++i) {
            if (!call(streams[t])) ok = false;
          }
        });
      }
      while (ready.load() < threads) std::this_thread::yield();
      const auto t0 = std::chrono::steady_clock::now();
      go = true;
      for (std::thread& th : pool) th.join();
      const double us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      for (CUstream st : streams) api.cuStreamSynchronize(st);
      EXPECT_TRUE(ok.load());
      return us / kCalls;
    };
    const double bare = time_calls([&](CUstream st) { return h.Bare(st) == CUDA_SUCCESS; });
    const double gemv = time_calls([&](CUstream st) { return h.Call(st).ok(); });
    std::printf(
        "[ info ] %d thread(s), %d calls each, %s, %s: wall time per call and thread: bare "
        "cuLaunchKernel %.2f us, Gemv %.2f us\n",
        threads, kCalls, h.plan.config.ToString().c_str(),
        current ? "context current" : "no current context", bare, gemv);
  }
}

}  // namespace
}  // namespace gemvz
