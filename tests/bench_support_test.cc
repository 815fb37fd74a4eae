// Tests of the CLI's CPU machinery (tools/gemvz/bench_support): argument parsing, random data,
// the double-precision reference GEMV, the error bound and its checks, tables, JSON and plots.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "runtime/jit/kernel_cache.h"

// The measuring machinery lives in the gemvz_bench_support library (CMakeLists.txt).
#include "absl/strings/str_format.h"
#include "gemvz/format.h"
#include "tests/support/jit_test_util.h"
#include "tests/support/temp_files.h"
#include "tools/gemvz/bench_support.h"

namespace gemvz::cli {
using ::gemvz::Bf16ToFloat;
using ::gemvz::FloatToBf16;
namespace {

std::mt19937_64& Rng() {
  static std::mt19937_64 rng{std::random_device{}()};
  return rng;
}

// Removed when the program ends if every test passed (kept to look at otherwise).
std::string TempDir() { return gemvz::testing::MakeTempDir("bench_support_test"); }

// The plainest possible GEMV in double, to hold ReferenceGemv against.
std::vector<double> NaiveGemv(const std::vector<uint16_t>& w, const std::vector<uint16_t>& x,
                              int64_t m, int64_t n, int64_t k, std::vector<double>* abs_dot) {
  std::vector<double> out(m * n);
  abs_dot->assign(m * n, 0);
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t r = 0; r < n; ++r) {
      double s = 0, a = 0;
      for (int64_t i = 0; i < k; ++i) {
        const double p =
            static_cast<double>(Bf16ToFloat(x[t * k + i])) * Bf16ToFloat(w[r * k + i]);
        s += p;
        a += std::fabs(p);
      }
      out[t * n + r] = s;
      (*abs_dot)[t * n + r] = a;
    }
  }
  return out;
}

// --- Parsing -------------------------------------------------------------------------------------

TEST(ParseShape, AcceptsNxKAndNamesSuiteShapes) {
  absl::StatusOr<MatrixShape> pooler = ParseShape("4096x8192");
  ASSERT_TRUE(pooler.ok()) << pooler.status();
  EXPECT_EQ(pooler->n, 4096);
  EXPECT_EQ(pooler->k, 8192);
  EXPECT_EQ(pooler->name, "pooler");
  EXPECT_EQ(pooler->ToString(), "4096x8192");

  absl::StatusOr<MatrixShape> upper = ParseShape("28672X4096");
  ASSERT_TRUE(upper.ok()) << upper.status();
  EXPECT_EQ(upper->name, "llama3-8b gate_up");

  const int64_t n = 16 * (1 + Rng()() % 100), k = 64 * (1 + Rng()() % 100);
  absl::StatusOr<MatrixShape> custom = ParseShape(absl::StrCat(n, "x", k));
  ASSERT_TRUE(custom.ok()) << custom.status();
  EXPECT_EQ(custom->n, n);
  EXPECT_EQ(custom->k, k);
  // Not in the suite unless it happens to be one of its shapes.
  bool in_suite = false;
  for (const MatrixShape& s : SuiteShapes()) in_suite = in_suite || (s.n == n && s.k == k);
  EXPECT_EQ(custom->name.empty(), !in_suite);
}

TEST(ParseShape, RejectsMalformedShapesNamingThem) {
  for (const std::string bad : {"", "4096", "4096x", "x8192", "0x64", "-16x64", "16x-64",
                                "4096x8192x2", "abcxdef", "4096*8192", "1.5x64", "16x"}) {
    absl::StatusOr<MatrixShape> s = ParseShape(bad);
    ASSERT_FALSE(s.ok()) << "'" << bad << "' parsed as " << s->ToString();
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find(absl::StrCat("'", bad, "'")), absl::string_view::npos)
        << s.status();
    EXPECT_NE(s.status().message().find("NxK"), absl::string_view::npos) << s.status();
  }
  absl::StatusOr<MatrixShape> huge = ParseShape("3000000000x64");
  ASSERT_FALSE(huge.ok());
  EXPECT_NE(huge.status().message().find("too large"), absl::string_view::npos) << huge.status();
  EXPECT_FALSE(ParseShape("1048576x1048576").ok());  // 2^40 weights
}

TEST(ParseMList, AcceptsListsInOrder) {
  absl::StatusOr<std::vector<int64_t>> ms = ParseMList("1,8,16");
  ASSERT_TRUE(ms.ok()) << ms.status();
  EXPECT_EQ(*ms, (std::vector<int64_t>{1, 8, 16}));
  ms = ParseMList(" 16, 3 ,1");
  ASSERT_TRUE(ms.ok()) << ms.status();
  EXPECT_EQ(*ms, (std::vector<int64_t>{16, 3, 1}));
  const int64_t m = 1 + Rng()() % kMaxM;
  ms = ParseMList(absl::StrCat(m));
  ASSERT_TRUE(ms.ok()) << ms.status();
  EXPECT_EQ(*ms, std::vector<int64_t>{m});
}

TEST(ParseMList, RejectsBadListsSayingWhy) {
  const std::pair<std::string, std::string> cases[] = {
      {"", "comma-separated"},       {"1,,8", "not an integer"},
      {"a", "not an integer"},       {"1.5", "not an integer"},
      {"0", "outside 1.."},          {"-1", "outside 1.."},
      {"4097", "outside 1.."},       {"8,1,8", "given twice"},
  };
  for (const auto& [text, why] : cases) {
    absl::StatusOr<std::vector<int64_t>> ms = ParseMList(text);
    ASSERT_FALSE(ms.ok()) << "'" << text << "' parsed";
    EXPECT_NE(ms.status().message().find("--m"), absl::string_view::npos) << ms.status();
    EXPECT_NE(ms.status().message().find(why), absl::string_view::npos)
        << "'" << text << "': " << ms.status();
  }
}

TEST(ShapesFromFlag, SuiteQuickAndOne) {
  absl::StatusOr<std::vector<MatrixShape>> all = ShapesFromFlag("", false);
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->size(), 7u);
  const std::pair<int64_t, int64_t> expected[] = {{4096, 8192},  {6144, 4096},  {4096, 4096},
                                                  {28672, 4096}, {4096, 14336}, {10240, 8192},
                                                  {8192, 28672}};
  for (size_t i = 0; i < 7; ++i) {
    EXPECT_EQ((*all)[i].n, expected[i].first);
    EXPECT_EQ((*all)[i].k, expected[i].second);
    EXPECT_FALSE((*all)[i].name.empty());
  }
  absl::StatusOr<std::vector<MatrixShape>> quick = ShapesFromFlag("", true);
  ASSERT_TRUE(quick.ok());
  ASSERT_EQ(quick->size(), 2u);
  EXPECT_EQ((*quick)[0].ToString(), "4096x8192");
  EXPECT_EQ((*quick)[1].ToString(), "6144x4096");
  absl::StatusOr<std::vector<MatrixShape>> one = ShapesFromFlag("32x128", false);
  ASSERT_TRUE(one.ok());
  ASSERT_EQ(one->size(), 1u);
  EXPECT_EQ((*one)[0].ToString(), "32x128");
  EXPECT_FALSE(ShapesFromFlag("32y128", false).ok());
  // --quick chooses the shapes too: both at once is a conflict, not one silently winning.
  const absl::StatusOr<std::vector<MatrixShape>> both = ShapesFromFlag("32x128", true);
  ASSERT_FALSE(both.ok());
  EXPECT_EQ(both.status().message(),
            "--quick and --shape both choose the shapes: give one of them");
}

TEST(SequenceFromFlag, LayerNameListsAndErrors) {
  absl::StatusOr<std::vector<MatrixShape>> layer = SequenceFromFlag("llama3-8b");
  ASSERT_TRUE(layer.ok());
  ASSERT_EQ(layer->size(), 4u);
  const char* order[] = {"6144x4096", "4096x4096", "28672x4096", "4096x14336"};
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ((*layer)[i].ToString(), order[i]);
    EXPECT_FALSE((*layer)[i].name.empty());  // named after the suite
  }
  absl::StatusOr<std::vector<MatrixShape>> list = SequenceFromFlag("64x128,128x64");
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 2u);
  EXPECT_EQ((*list)[1].ToString(), "128x64");
  absl::StatusOr<std::vector<MatrixShape>> bad = SequenceFromFlag("64x128,nope");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'nope'"), std::string::npos) << bad.status();
  EXPECT_FALSE(SequenceFromFlag(",").ok());
}

TEST(SequenceReport, TableAndJsonCarryEveryPathAndTheSpeedups) {
  SequenceCase c;
  c.m = 8;
  c.z12_us = 80;
  c.z12_pdl_us = 75;
  c.plain_us = 110;
  c.plain_pdl_us = 105;
  c.cublas_us = 120;
  c.launches = 64;
  c.ok = true;
  SequenceCase wrong = c;
  wrong.m = 16;
  wrong.ok = false;
  const std::string table = FormatSequenceTable({c, wrong});
  EXPECT_NE(table.find("1.500x"), std::string::npos) << table;  // 120 / 80
  EXPECT_NE(table.find("1.600x"), std::string::npos) << table;  // 120 / 75
  EXPECT_NE(table.find("1.067x"), std::string::npos) << table;  // PDL gain: 80 / 75, above 1x
  EXPECT_NE(table.find("WRONG"), std::string::npos) << table;

  BenchEnvironment env;
  env.gpu_name = "NVIDIA H200";
  env.date = UtcTimestamp();
  env.commit = "abc1234";
  const std::vector<MatrixShape> shapes = *SequenceFromFlag("llama3-8b");
  nlohmann::json doc = SequenceReportToJson(env, shapes, {c});
  EXPECT_EQ(doc["schema"], "gemvz.sequence/1");
  EXPECT_EQ(doc["commit"], "abc1234");
  EXPECT_EQ(doc["gpu"]["name"], "NVIDIA H200");
  ASSERT_EQ(doc["sequence"].size(), 4u);
  EXPECT_EQ(doc["sequence"][2]["n"], 28672);
  ASSERT_EQ(doc["cases"].size(), 1u);
  EXPECT_EQ(doc["cases"][0]["m"], 8);
  EXPECT_EQ(doc["cases"][0]["launches"], 64);
  EXPECT_DOUBLE_EQ(doc["cases"][0]["time_us"]["z12_pdl"].get<double>(), 75);
  EXPECT_DOUBLE_EQ(doc["cases"][0]["time_us"]["plain_pdl"].get<double>(), 105);
  EXPECT_DOUBLE_EQ(doc["cases"][0]["speedup_vs_cublas"]["z12"].get<double>(), 1.5);
  EXPECT_DOUBLE_EQ(doc["cases"][0]["speedup_vs_cublas"]["z12_pdl"].get<double>(), 1.6);
  EXPECT_TRUE(doc["ok"].get<bool>());
  EXPECT_FALSE(SequenceReportToJson(env, shapes, {c, wrong})["ok"].get<bool>());
  EXPECT_FALSE(SequenceReportToJson(env, shapes, {})["ok"].get<bool>());  // nothing measured
}

// --- Random data ---------------------------------------------------------------------------------

TEST(NormalBf16, DeterministicPerSeedWhateverTheThreads) {
  const uint64_t seed = Rng()();
  const int64_t count = 3 * 65536 + 12345;  // several chunks and a ragged end
  const std::vector<uint16_t> one = NormalBf16(count, 0.5, seed, 1);
  const std::vector<uint16_t> many = NormalBf16(count, 0.5, seed, 4);
  EXPECT_EQ(one, many);
  const std::vector<uint16_t> other = NormalBf16(count, 0.5, seed + 1, 4);
  int64_t same = 0;
  for (int64_t i = 0; i < count; ++i) same += one[i] == other[i];
  EXPECT_LT(same, count / 50) << "a different seed should give different values";
}

TEST(NormalBf16, HasTheAskedMeanAndSpread) {
  const double stddev = 1.0 / std::sqrt(4096.0 + Rng()() % 8192);
  const int64_t count = 1 << 20;
  const std::vector<uint16_t> v = NormalBf16(count, stddev, Rng()(), 2);
  double sum = 0, sq = 0;
  int64_t zeros = 0;
  for (uint16_t b : v) {
    const double f = Bf16ToFloat(b);
    ASSERT_TRUE(std::isfinite(f));
    sum += f;
    sq += f * f;
    zeros += (f == 0);
  }
  const double mean = sum / count, sd = std::sqrt(sq / count - mean * mean);
  EXPECT_LT(std::fabs(mean), 5 * stddev / std::sqrt(static_cast<double>(count)));
  EXPECT_NEAR(sd / stddev, 1.0, 0.01);
  EXPECT_LT(zeros, 8);  // a normal draw is almost never exactly zero
}

// --- Reference GEMV and the error bound -----------------------------------------------------------

TEST(ReferenceGemv, MatchesANaiveGemvExactly) {
  const int64_t m = 1 + Rng()() % 5, n = 1 + Rng()() % 70, k = 1 + Rng()() % 300;
  const std::vector<uint16_t> w = NormalBf16(n * k, 0.1, Rng()(), 1);
  const std::vector<uint16_t> x = NormalBf16(m * k, 1.0, Rng()(), 1);
  std::vector<double> naive_abs;
  const std::vector<double> naive = NaiveGemv(w, x, m, n, k, &naive_abs);
  for (int threads : {1, 3}) {
    const GemvReference ref = ReferenceGemv(w.data(), x.data(), m, n, k, threads);
    ASSERT_EQ(ref.m, m);
    ASSERT_EQ(ref.n, n);
    ASSERT_EQ(ref.k, k);
    // Same products (exact), same order: bitwise the same sums.
    EXPECT_EQ(ref.out, naive) << "threads " << threads;
    EXPECT_EQ(ref.abs_dot, naive_abs) << "threads " << threads;
  }
}

TEST(ReferenceGemv, KnownSmallProduct) {
  // w = [[1, 2], [3, -4]], x = [[0.5, 0.25], [-1, 2]]: out = [[1, 0.5], [3, -11]].
  const std::vector<uint16_t> w = {FloatToBf16(1), FloatToBf16(2), FloatToBf16(3), FloatToBf16(-4)};
  const std::vector<uint16_t> x = {FloatToBf16(0.5f), FloatToBf16(0.25f), FloatToBf16(-1),
                                   FloatToBf16(2)};
  const GemvReference ref = ReferenceGemv(w.data(), x.data(), 2, 2, 2, 1);
  EXPECT_EQ(ref.out, (std::vector<double>{1.0, 0.5, 3.0, -11.0}));
  EXPECT_EQ(ref.abs_dot, (std::vector<double>{1.0, 2.5, 5.0, 11.0}));
}

TEST(GemvTolerance, IsOneBf16UnitPlusTheAccumulationBound) {
  EXPECT_EQ(GemvTolerance(1.0, 0.0, 4096), 0x1.0p-7);
  EXPECT_EQ(GemvTolerance(-3.0, 0.0, 64), 3 * 0x1.0p-7);
  EXPECT_EQ(GemvTolerance(0.0, 2.0, 16 * 64), (64 + 64) * 0x1.0p-23 * 2.0);
  EXPECT_EQ(GemvTolerance(0.0, 0.0, 8192), 0.0);
  // For N(0, 1/K) weights and N(0, 1) x the absolute part stays a small fraction of a typical
  // output (rms 1): about 0.4 % at K = 8192 and 2.4 % at K = 28672.
  EXPECT_LT(GemvTolerance(0.0, 0.6366 * std::sqrt(8192.0), 8192), 0.005);
  EXPECT_LT(GemvTolerance(0.0, 0.6366 * std::sqrt(28672.0), 28672), 0.025);
}

// An FP32 GEMV in a given summation order, rounded to BF16: what a correct kernel does.
std::vector<uint16_t> Fp32Gemv(const std::vector<uint16_t>& w, const std::vector<uint16_t>& x,
                               int64_t m, int64_t n, int64_t k, int64_t block, bool reverse) {
  std::vector<uint16_t> out(m * n);
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t r = 0; r < n; ++r) {
      float total = 0;
      for (int64_t b0 = 0; b0 < k; b0 += block) {
        const int64_t b = reverse ? (k - block - b0) : b0;
        float partial = 0;
        for (int64_t i = b; i < b + block; ++i) {
          partial += Bf16ToFloat(x[t * k + i]) * Bf16ToFloat(w[r * k + i]);
        }
        total += partial;
      }
      out[t * n + r] = FloatToBf16(total);
    }
  }
  return out;
}

class ErrorCheckTest : public ::testing::Test {
 protected:
  void SetUp() override {
    w_ = NormalBf16(n_ * k_, 1.0 / std::sqrt(static_cast<double>(k_)), Rng()(), 2);
    x_ = NormalBf16(m_ * k_, 1.0, Rng()(), 2);
    ref_ = ReferenceGemv(w_.data(), x_.data(), m_, n_, k_, 2);
  }
  const int64_t m_ = 4, n_ = 96, k_ = 4096;
  std::vector<uint16_t> w_, x_;
  GemvReference ref_;
};

TEST_F(ErrorCheckTest, CorrectKernelsPassInAnyOrder) {
  for (const auto& [block, reverse] : {std::pair<int64_t, bool>{16, false}, {64, true},
                                      {4096, false}, {512, true}}) {
    const std::vector<uint16_t> out = Fp32Gemv(w_, x_, m_, n_, k_, block, reverse);
    const ErrorCheck check = CheckAgainstReference(out.data(), m_, ref_);
    EXPECT_TRUE(check.ok()) << "block " << block << ": " << check.ToString();
    EXPECT_EQ(check.checked, m_ * n_);
    EXPECT_LE(check.max_ratio, 1.0);
    EXPECT_NE(check.ToString().find("ok"), std::string::npos);
  }
  // Two correct kernels agree with each other too.
  const std::vector<uint16_t> a = Fp32Gemv(w_, x_, m_, n_, k_, 16, false);
  const std::vector<uint16_t> b = Fp32Gemv(w_, x_, m_, n_, k_, 256, true);
  EXPECT_TRUE(CheckPair(a.data(), b.data(), m_, ref_).ok());
  // And the exact reference rounded once to BF16 is well inside.
  std::vector<uint16_t> rounded(m_ * n_);
  for (int64_t i = 0; i < m_ * n_; ++i) rounded[i] = FloatToBf16(static_cast<float>(ref_.out[i]));
  const ErrorCheck exact = CheckAgainstReference(rounded.data(), m_, ref_);
  EXPECT_TRUE(exact.ok()) << exact.ToString();
  EXPECT_LE(exact.max_ratio, 0.51);
}

TEST_F(ErrorCheckTest, CatchesTheBugsAKernelCanHave) {
  const std::vector<uint16_t> good = Fp32Gemv(w_, x_, m_, n_, k_, 64, false);

  // A 64-wide K group left out of every row.
  std::vector<uint16_t> w_hole = w_;
  const int64_t group = Rng()() % (k_ / 64);
  for (int64_t r = 0; r < n_; ++r) {
    for (int64_t i = group * 64; i < group * 64 + 64; ++i) w_hole[r * k_ + i] = 0;
  }
  const std::vector<uint16_t> hole = Fp32Gemv(w_hole, x_, m_, n_, k_, 64, false);
  EXPECT_FALSE(CheckAgainstReference(hole.data(), m_, ref_).ok()) << "dropped group " << group;
  EXPECT_FALSE(CheckPair(hole.data(), good.data(), m_, ref_).ok());

  // Two rows swapped.
  std::vector<uint16_t> swapped = good;
  const int64_t r1 = Rng()() % n_, r2 = (r1 + 1 + Rng()() % (n_ - 1)) % n_;
  for (int64_t t = 0; t < m_; ++t) std::swap(swapped[t * n_ + r1], swapped[t * n_ + r2]);
  ErrorCheck check = CheckAgainstReference(swapped.data(), m_, ref_);
  EXPECT_FALSE(check.ok());
  EXPECT_TRUE(check.worst_row == r1 || check.worst_row == r2) << check.ToString();

  // One element off by a few BF16 units.
  std::vector<uint16_t> nudged = good;
  const int64_t t = Rng()() % m_;
  int64_t r = 0;
  for (int64_t i = 1; i < n_; ++i) {  // the largest output of token t, so 4 units are big
    if (std::fabs(ref_.out[t * n_ + i]) > std::fabs(ref_.out[t * n_ + r])) r = i;
  }
  nudged[t * n_ + r] = static_cast<uint16_t>(nudged[t * n_ + r] + 4);
  check = CheckAgainstReference(nudged.data(), m_, ref_);
  EXPECT_FALSE(check.ok());
  EXPECT_EQ(check.failures, 1);
  EXPECT_EQ(check.worst_token, t);
  EXPECT_EQ(check.worst_row, r);
  EXPECT_NE(check.ToString().find(absl::StrFormat("token %d, row %d", t, r)), std::string::npos)
      << check.ToString();

  // An element never written: the poison (all ones, NaN) must fail.
  std::vector<uint16_t> unwritten = good;
  unwritten[Rng()() % (m_ * n_)] = 0xFFFF;
  check = CheckAgainstReference(unwritten.data(), m_, ref_);
  EXPECT_FALSE(check.ok());
  EXPECT_EQ(check.failures, 1);
  EXPECT_FALSE(CheckPair(good.data(), unwritten.data(), m_, ref_).ok());
  EXPECT_FALSE(CheckPair(unwritten.data(), good.data(), m_, ref_).ok());

  // Infinity too.
  std::vector<uint16_t> inf = good;
  inf[0] = 0x7F80;
  EXPECT_FALSE(CheckAgainstReference(inf.data(), m_, ref_).ok());
}

// A NaN in the second output of a pair (bench's "z12 vs cuBLAS" and the like) is where the
// check fails, and the report must say so: a NaN |err|/tol fails the test but compares false
// with every ratio, so it never became the worst element and the report named a right one (at
// |err|/tol below 1), or, at the first element, hid every later failure behind a NaN maximum.
TEST_F(ErrorCheckTest, APairReportsANanInEitherOutputAsTheWorstElement) {
  const std::vector<uint16_t> good = Fp32Gemv(w_, x_, m_, n_, k_, 64, false);
  const int64_t t = 1 + Rng()() % (m_ - 1), r = Rng()() % n_;
  std::vector<uint16_t> poisoned = good;
  poisoned[t * n_ + r] = 0xFFFF;
  for (const bool nan_first : {true, false}) {
    const ErrorCheck check = nan_first ? CheckPair(poisoned.data(), good.data(), m_, ref_)
                                       : CheckPair(good.data(), poisoned.data(), m_, ref_);
    EXPECT_FALSE(check.ok());
    EXPECT_EQ(check.failures, 1);
    EXPECT_EQ(check.max_ratio, std::numeric_limits<double>::infinity()) << check.ToString();
    EXPECT_EQ(check.worst_token, t);
    EXPECT_EQ(check.worst_row, r);
    EXPECT_NE(check.ToString().find(absl::StrFormat("token %d, row %d", t, r)), std::string::npos)
        << check.ToString();
  }
  // A NaN in the first element does not hide a later one: the first non-finite is reported, and
  // the maximum is a number, not NaN.
  poisoned[0] = 0xFFFF;
  const ErrorCheck check = CheckPair(good.data(), poisoned.data(), m_, ref_);
  EXPECT_EQ(check.failures, 2);
  EXPECT_EQ(check.max_ratio, std::numeric_limits<double>::infinity()) << check.ToString();
  EXPECT_EQ(check.worst_token, 0);
  EXPECT_EQ(check.worst_row, 0);
}

TEST_F(ErrorCheckTest, ChecksOnlyTheTokensAskedAndNothingBeyondTheReference) {
  std::vector<uint16_t> out = Fp32Gemv(w_, x_, m_, n_, k_, 64, false);
  out[(m_ - 1) * n_] = 0xFFFF;  // the last token is wrong
  EXPECT_TRUE(CheckAgainstReference(out.data(), m_ - 1, ref_).ok());
  EXPECT_FALSE(CheckAgainstReference(out.data(), m_, ref_).ok());
  const ErrorCheck beyond = CheckAgainstReference(out.data(), m_ + 1, ref_);
  EXPECT_FALSE(beyond.ok());
  EXPECT_EQ(beyond.checked, 0);
  EXPECT_EQ(beyond.ToString(), "not checked");
}

TEST(ErrorCheck, ZeroOutputsMustBeExactlyZero) {
  // An all-zero weight row: A = 0, so the tolerance is 0 and only an exact zero passes.
  const int64_t k = 128;
  std::vector<uint16_t> w(2 * k, 0);
  for (int64_t i = 0; i < k; ++i) w[k + i] = FloatToBf16(1.0f);
  const std::vector<uint16_t> x = NormalBf16(k, 1.0, Rng()(), 1);
  const GemvReference ref = ReferenceGemv(w.data(), x.data(), 1, 2, k, 1);
  std::vector<uint16_t> out = {0x8000 /* -0 */, FloatToBf16(static_cast<float>(ref.out[1]))};
  EXPECT_TRUE(CheckAgainstReference(out.data(), 1, ref).ok());
  out[0] = 0x0001;  // the smallest subnormal
  EXPECT_FALSE(CheckAgainstReference(out.data(), 1, ref).ok());
}

// --- Results, tables and JSON ----------------------------------------------------------------------

BenchCase FakeCase(const MatrixShape& shape, int64_t m, double z12_us, double plain_us,
                   double cublas_us, double probe_us) {
  BenchCase c;
  c.shape = shape;
  c.m = m;
  c.config = "z12.nw8.ug2.nb1.pipe3.s1";
  c.config_source = "tuned";
  c.weight_format = "z12";
  c.plain_config = "bf16.nw4.ug2.nb1.pipe3.s1";
  c.copies_z12 = 11;
  c.copies_bf16 = 8;
  c.launches_z12 = 66;
  c.launches_bf16 = 64;
  const int64_t io = 2 * m * shape.k + 2 * m * shape.n;
  c.z12 = {z12_us, shape.n * shape.k * 3 / 2 + io, 0.02, true};
  c.plain = {plain_us, 2 * shape.n * shape.k + io, 0.03, true};
  c.cublas = {cublas_us, 2 * shape.n * shape.k + io, 0.04, true};
  c.probe = {probe_us, 2 * shape.n * shape.k, -1, false};
  // The probe over z12's weight bytes: three quarters of the BF16 bytes, with the same fixed cost
  // as a quarter of its time (so slower than three quarters of the probe's time).
  c.probe_z12 = {probe_us * (0.25 + 0.75 * 0.75), shape.n * shape.k * 3 / 2, -1, false};
  c.pair_check_ok = true;
  return c;
}

// The ceiling is the fastest form, wherever it stands, the first of equal times; a slower one
// would lower the ceiling by 0.1-5 % (docs/BENCHMARKS.md, "The ceiling") and no GPU check sees it.
TEST(FastestForm, IsTheLeastTimeFirstOfEquals) {
  EXPECT_EQ(FastestForm({}), -1);
  EXPECT_EQ(FastestForm({7.5}), 0);
  EXPECT_EQ(FastestForm({8.05, 7.69, 7.71}), 1);
  EXPECT_EQ(FastestForm({7.69, 8.05, 7.71}), 0);
  EXPECT_EQ(FastestForm({8.05, 7.71, 7.69}), 2);
  EXPECT_EQ(FastestForm({7.70, 7.69, 7.69}), 1);
  EXPECT_EQ(FastestForm({7.69, 7.69, 7.69}), 0);
}

TEST(BenchCase, DerivedNumbers) {
  const MatrixShape pooler = SuiteShapes()[0];
  const BenchCase c = FakeCase(pooler, 8, 12.0, 16.0, 18.0, 15.0);
  EXPECT_DOUBLE_EQ(c.SpeedupVsCublas(), 18.0 / 12.0);
  EXPECT_DOUBLE_EQ(c.SpeedupVsPlain(), 16.0 / 12.0);
  EXPECT_DOUBLE_EQ(c.probe.TeraBytesPerSecond(), 2.0 * 4096 * 8192 / 15e-6 / 1e12);
  EXPECT_DOUBLE_EQ(c.CeilingTbps(), c.probe.TeraBytesPerSecond());
  EXPECT_DOUBLE_EQ(c.PercentOfCeiling(c.z12),
                   100.0 * c.z12.TeraBytesPerSecond() / c.probe.TeraBytesPerSecond());
  EXPECT_DOUBLE_EQ(c.BoundVsCublas(), 18.0 / (15.0 * 0.8125));
  EXPECT_DOUBLE_EQ(c.PercentOfBound(), 100.0 * 15.0 * 0.8125 / 12.0);
  BenchCase plain_kept = c;
  plain_kept.probe_z12 = {};
  EXPECT_EQ(plain_kept.BoundVsCublas(), 0.0);  // no bound where the matrix was kept plain
  EXPECT_TRUE(c.ok());
  BenchCase wrong = c;
  wrong.pair_check_ok = false;
  EXPECT_FALSE(wrong.ok());
  wrong = c;
  wrong.cublas.check_ok = false;
  EXPECT_FALSE(wrong.ok());
  const TimedPath untimed;
  EXPECT_EQ(untimed.TeraBytesPerSecond(), 0.0);
  EXPECT_EQ(ActivationBytes(8, pooler), 2 * 8 * 8192 + 2 * 8 * 4096);
}

TEST(ExceptionColumns, EvenlySpreadDistinctAndRoundedToTheShare) {
  for (const auto& [k, percent, count] : std::vector<std::tuple<int64_t, double, int64_t>>{
           {8192, 1, 82}, {4096, 1, 41}, {8192, 12.5, 1024}, {64, 100, 64}, {4096, 0.001, 1}}) {
    const std::vector<int64_t> cols = ExceptionColumns(k, percent);
    ASSERT_EQ(static_cast<int64_t>(cols.size()), count) << k << " " << percent;
    EXPECT_EQ(cols.front(), 0);
    EXPECT_LT(cols.back(), k);
    EXPECT_GE(cols.back(), k - (k + count - 1) / count);  // the spread reaches the row's end
    for (size_t i = 1; i < cols.size(); ++i) {
      ASSERT_GT(cols[i], cols[i - 1]) << k << " " << percent << " " << i;
      // Evenly spread: consecutive columns are floor(k / count) or ceil(k / count) apart.
      EXPECT_LE(cols[i] - cols[i - 1], (k + count - 1) / count);
      EXPECT_GE(cols[i] - cols[i - 1], k / count);
    }
  }
}

// What --exception_rows promises: each chosen weight (the smallest BF16 subnormal) becomes an
// exception of its row among N(0, 1/K) weights, with two correction entries; a row of more than
// kMaxRowEntries entries is dense (format_test pins the limit).
TEST(ExceptionColumns, EachBecomesAnExceptionWithTwoEntries) {
  const int64_t n = 64, k = 4096;
  std::vector<uint16_t> w = NormalBf16(n * k, 1.0 / std::sqrt(double(k)), Rng()(), 2);
  const std::vector<uint16_t> plain = w;
  const double percent = 100.0 * 3 / k;  // three weights: six entries, a list
  for (int64_t row : {3, 40}) {
    for (int64_t col : ExceptionColumns(k, row == 3 ? percent : 1)) w[row * k + col] = 0x0001;
  }
  const auto base = Pack(plain.data(), n, k);
  const auto packed = Pack(w.data(), n, k);
  ASSERT_TRUE(base.ok() && packed.ok());
  ASSERT_EQ(packed->base, base->base);  // two rows of outliers do not move the window
  auto entries = [](const PackedMatrix& p, int64_t row) {
    return static_cast<int64_t>(p.row_offsets[row + 1] - p.row_offsets[row]);
  };
  // Two entries for each chosen weight; a weight that was an exception already had one or two.
  EXPECT_GE(entries(*packed, 3), 6 - entries(*base, 3));
  EXPECT_LE(entries(*packed, 3), entries(*base, 3) + 6);
  EXPECT_EQ(entries(*packed, 40), 0);  // 1 %: 82 entries, dense
  EXPECT_EQ(packed->stats.dense_rows, base->stats.dense_rows + 1);
}

TEST(Seeds, DependOnTheRunSeedAndTheShapeOnly) {
  const uint64_t seed = Rng()();
  const MatrixShape a = SuiteShapes()[0], b = SuiteShapes()[1];
  EXPECT_EQ(WeightSeed(seed, a), WeightSeed(seed, MatrixShape{"", a.n, a.k}));
  EXPECT_NE(WeightSeed(seed, a), WeightSeed(seed, b));
  EXPECT_NE(WeightSeed(seed, a), WeightSeed(seed + 1, a));
  EXPECT_NE(WeightSeed(seed, a), InputSeed(seed, a));
  EXPECT_EQ(InputSeed(seed, b), InputSeed(seed, b));
}

TEST(GeoMeans, OfSpeedupsAndCeilingShares) {
  const MatrixShape s = SuiteShapes()[2];
  const std::vector<BenchCase> cases = {FakeCase(s, 1, 10, 20, 40, 10),   // 4x, 2x
                                        FakeCase(s, 8, 10, 5, 2.5, 10)};  // 0.25x, 0.5x
  const GeoMeans g = ComputeGeoMeans(cases);
  EXPECT_EQ(g.count, 2);
  EXPECT_NEAR(g.speedup_vs_cublas, 1.0, 1e-12);
  EXPECT_NEAR(g.speedup_vs_plain, 1.0, 1e-12);
  EXPECT_NEAR(g.pct_ceiling_z12,
              std::sqrt(cases[0].PercentOfCeiling(cases[0].z12) *
                        cases[1].PercentOfCeiling(cases[1].z12)),
              1e-9);
  // Each path's share of the ceiling is its own: plain and cuBLAS move other bytes in other
  // times than z12, so a mean taken over the wrong path's shares differs.
  EXPECT_NEAR(g.pct_ceiling_plain,
              std::sqrt(cases[0].PercentOfCeiling(cases[0].plain) *
                        cases[1].PercentOfCeiling(cases[1].plain)),
              1e-9);
  EXPECT_NEAR(g.pct_ceiling_cublas,
              std::sqrt(cases[0].PercentOfCeiling(cases[0].cublas) *
                        cases[1].PercentOfCeiling(cases[1].cublas)),
              1e-9);
  EXPECT_EQ(g.bound_count, 2);
  EXPECT_NEAR(g.bound_vs_cublas, std::sqrt(40 / 8.125 * 2.5 / 8.125), 1e-12);
  EXPECT_NEAR(g.pct_bound_z12, 81.25, 1e-9);
  EXPECT_EQ(ComputeGeoMeans({}).count, 0);
  // Only the cases with a bound count towards its means.
  std::vector<BenchCase> one_kept_plain = cases;
  one_kept_plain[1].probe_z12 = {};
  const GeoMeans h = ComputeGeoMeans(one_kept_plain);
  EXPECT_EQ(h.count, 2);
  EXPECT_EQ(h.bound_count, 1);
  EXPECT_NEAR(h.bound_vs_cublas, 40 / 8.125, 1e-12);
  // Both bound means divide by the cases with a bound, not by every case.
  EXPECT_NEAR(h.pct_bound_z12, 81.25, 1e-9);
  // A case whose probe was not timed has no ceiling: it stays out of every mean, rather than
  // putting log(0) into the ceiling shares (which would read 0 %) and its speedups into the rest.
  std::vector<BenchCase> one_unprobed = cases;
  one_unprobed.push_back(FakeCase(s, 16, 10, 40, 80, 10));
  one_unprobed.back().probe = {};
  const GeoMeans u = ComputeGeoMeans(one_unprobed);
  EXPECT_EQ(u.count, 2);
  EXPECT_NEAR(u.speedup_vs_cublas, g.speedup_vs_cublas, 1e-12);
  EXPECT_NEAR(u.pct_ceiling_z12, g.pct_ceiling_z12, 1e-9);
  EXPECT_NEAR(u.pct_ceiling_plain, g.pct_ceiling_plain, 1e-9);
}

TEST(FormatBenchTable, HasEveryCaseAndTheMeans) {
  const std::vector<BenchCase> cases = {FakeCase(SuiteShapes()[0], 1, 10, 13, 14, 12),
                                        FakeCase(SuiteShapes()[3], 16, 30, 40, 41, 38)};
  const std::string table = FormatBenchTable(cases);
  EXPECT_NE(table.find("pooler 4096x8192"), std::string::npos) << table;
  EXPECT_NE(table.find("llama3-8b gate_up 28672x4096"), std::string::npos) << table;
  EXPECT_NE(table.find("z12.nw8.ug2.nb1.pipe3.s1 (tuned)"), std::string::npos) << table;
  EXPECT_NE(table.find("1.400x"), std::string::npos) << table;  // 14 / 10
  EXPECT_NE(table.find("geometric mean over 2 cases"), std::string::npos) << table;
  EXPECT_NE(table.find(absl::StrFormat("would be %.3fx over cuBLAS BF16",
                                       ComputeGeoMeans(cases).bound_vs_cublas)),
            std::string::npos)
      << table;
  BenchCase wrong = cases[0];
  wrong.z12.check_ok = false;
  EXPECT_NE(FormatBenchTable({wrong}).find("WRONG"), std::string::npos);
}

TEST(BenchReportToJson, FollowsTheDocumentedSchema) {
  BenchReport report;
  report.env.gpu_name = "NVIDIA H200";
  report.env.arch = "sm_90";
  report.env.sm_count = 132;
  report.env.memory_bytes = int64_t{150} << 30;
  report.env.driver_version = "580.82.07";
  report.env.cuda_driver_api = "13.0";
  report.env.cublas_library = "libcublas.so.13";
  report.env.cublas_version = 130100;
  report.env.date = UtcTimestamp();
  report.env.replays = 20;
  report.env.rotate_bytes = int64_t{512} << 20;
  report.env.seed = Rng()();
  report.cases = {FakeCase(SuiteShapes()[0], 1, 10, 13, 14, 12),
                  FakeCase(SuiteShapes()[6], 16, 100, 130, 135, 120)};
  report.cases[1].weight_format = "bf16";
  report.cases[1].fallback_reason = "a reason";
  // The probes name the fastest form of the read kernel (bench fills it in; without a GPU only
  // this test sees the field).
  for (BenchCase& c : report.cases) {
    c.probe.kernel = ProbeForms()[1].Name();
    c.probe_z12.kernel = ProbeForms()[0].Name();
  }

  const nlohmann::json doc = BenchReportToJson(report);
  EXPECT_EQ(doc["schema"], "gemvz.bench/1");
  EXPECT_EQ(doc["date"], report.env.date);
  EXPECT_TRUE(doc["commit"].is_null());
  EXPECT_EQ(doc["gpu"]["name"], "NVIDIA H200");
  EXPECT_EQ(doc["gpu"]["arch"], "sm_90");
  EXPECT_EQ(doc["gpu"]["sm_count"], 132);
  EXPECT_EQ(doc["gpu"]["memory_bytes"], int64_t{150} << 30);
  EXPECT_EQ(doc["gpu"]["driver_version"], "580.82.07");
  EXPECT_EQ(doc["gpu"]["cuda_driver_api"], "13.0");
  EXPECT_EQ(doc["cublas"]["library"], "libcublas.so.13");
  EXPECT_EQ(doc["cublas"]["version"], 130100);
  EXPECT_EQ(doc["settings"]["replays"], 20);
  EXPECT_EQ(doc["settings"]["pdl"], false);
  EXPECT_EQ(doc["settings"]["rotate_bytes"], int64_t{512} << 20);
  EXPECT_EQ(doc["settings"]["seed"].get<uint64_t>(), report.env.seed);
  ASSERT_EQ(doc["cases"].size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const BenchCase& c = report.cases[i];
    const nlohmann::json& j = doc["cases"][i];
    EXPECT_EQ(j["shape"]["name"], c.shape.name);
    EXPECT_EQ(j["shape"]["n"], c.shape.n);
    EXPECT_EQ(j["shape"]["k"], c.shape.k);
    EXPECT_EQ(j["m"], c.m);
    EXPECT_EQ(j["dispatch"]["config"], c.config);
    EXPECT_EQ(j["dispatch"]["source"], "tuned");
    EXPECT_EQ(j["dispatch"]["weight_format"], c.weight_format);
    EXPECT_EQ(j["dispatch"]["fallback_reason"], c.fallback_reason);
    EXPECT_EQ(j["dispatch"]["plain_config"], c.plain_config);
    EXPECT_EQ(j["rotation"]["copies_z12"], 11);
    EXPECT_EQ(j["rotation"]["copies_bf16"], 8);
    EXPECT_EQ(j["rotation"]["launches_z12"], 66);
    EXPECT_EQ(j["rotation"]["launches_bf16"], 64);
    for (const char* path : {"z12", "plain", "cublas", "probe", "probe_z12"}) {
      const nlohmann::json& p = j["paths"][path];
      ASSERT_TRUE(p.is_object()) << path;
      for (const char* field : {"time_us", "bytes", "tbps", "pct_of_ceiling"}) {
        EXPECT_TRUE(p[field].is_number()) << path << "." << field;
      }
      const bool probe = std::string(path).rfind("probe", 0) == 0;
      EXPECT_EQ(p.contains("check_ok"), !probe) << path;
      EXPECT_EQ(p.contains("max_err_ratio"), !probe) << path;
      EXPECT_EQ(p.contains("kernel"), probe) << path;
    }
    EXPECT_EQ(j["paths"]["probe"]["kernel"], c.probe.kernel);
    EXPECT_EQ(j["paths"]["probe_z12"]["kernel"], c.probe_z12.kernel);
    EXPECT_DOUBLE_EQ(j["paths"]["z12"]["time_us"].get<double>(), c.z12.time_us);
    EXPECT_EQ(j["paths"]["z12"]["bytes"], c.z12.bytes);
    EXPECT_DOUBLE_EQ(j["paths"]["z12"]["tbps"].get<double>(), c.z12.TeraBytesPerSecond());
    EXPECT_DOUBLE_EQ(j["paths"]["cublas"]["pct_of_ceiling"].get<double>(),
                     c.PercentOfCeiling(c.cublas));
    EXPECT_DOUBLE_EQ(j["paths"]["probe"]["pct_of_ceiling"].get<double>(), 100.0);
    EXPECT_DOUBLE_EQ(j["ceiling_tbps"].get<double>(), c.CeilingTbps());
    EXPECT_DOUBLE_EQ(j["speedup_vs_cublas"].get<double>(), c.SpeedupVsCublas());
    EXPECT_DOUBLE_EQ(j["speedup_vs_plain"].get<double>(), c.SpeedupVsPlain());
    EXPECT_DOUBLE_EQ(j["paths"]["probe_z12"]["time_us"].get<double>(), c.probe_z12.time_us);
    EXPECT_EQ(j["paths"]["probe_z12"]["bytes"], c.probe_z12.bytes);
    EXPECT_DOUBLE_EQ(j["bound_vs_cublas"].get<double>(), c.BoundVsCublas());
    EXPECT_DOUBLE_EQ(j["pct_of_bound"].get<double>(), c.PercentOfBound());
    EXPECT_EQ(j["pair_check_ok"], true);
    EXPECT_EQ(j["ok"], true);
  }
  EXPECT_EQ(doc["geomean"]["count"], 2);
  EXPECT_DOUBLE_EQ(doc["geomean"]["speedup_vs_cublas"].get<double>(),
                   ComputeGeoMeans(report.cases).speedup_vs_cublas);
  EXPECT_EQ(doc["geomean"]["bound_count"], 2);
  for (const char* field : {"speedup_vs_plain", "pct_ceiling_z12", "pct_ceiling_plain",
                            "pct_ceiling_cublas", "bound_vs_cublas", "pct_bound_z12"}) {
    EXPECT_TRUE(doc["geomean"][field].is_number()) << field;
  }
  EXPECT_EQ(doc["ok"], true);

  report.env.commit = "abc123";
  report.cases[0].plain.check_ok = false;
  const nlohmann::json bad = BenchReportToJson(report);
  EXPECT_EQ(bad["commit"], "abc123");
  EXPECT_EQ(bad["cases"][0]["paths"]["plain"]["check_ok"], false);
  EXPECT_EQ(bad["cases"][0]["ok"], false);
  EXPECT_EQ(bad["ok"], false);
}

TEST(WriteJsonFile, WritesParsableJsonAndNamesUnwritablePaths) {
  const std::string dir = TempDir();
  const std::string path = dir + "/out.json";
  const nlohmann::json doc = {{"schema", kBenchSchema}, {"value", static_cast<int>(Rng()() % 1000)}};
  ASSERT_TRUE(WriteJsonFile(path, doc).ok());
  std::ifstream in(path);
  const nlohmann::json back = nlohmann::json::parse(in);
  EXPECT_EQ(back, doc);
  const absl::Status st = WriteJsonFile(dir + "/no/such/dir/out.json", doc);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("no/such/dir/out.json"), absl::string_view::npos) << st;
}

TEST(WriteJsonReport, SaysWhatItWroteOrWhyNot) {
  const std::string dir = TempDir();
  const nlohmann::json doc = {{"schema", kBenchSchema}, {"value", static_cast<int>(Rng()() % 1000)}};
  ::testing::internal::CaptureStdout();
  EXPECT_TRUE(WriteJsonReport("bench", dir + "/report.json", doc));
  EXPECT_EQ(::testing::internal::GetCapturedStdout(), "wrote " + dir + "/report.json\n");
  std::ifstream in(dir + "/report.json");
  EXPECT_EQ(nlohmann::json::parse(in), doc);
  ::testing::internal::CaptureStderr();
  EXPECT_FALSE(WriteJsonReport("tune", dir + "/no/such/dir/out.json", doc));
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.rfind("gemvz tune: ", 0), 0u) << err;
  EXPECT_NE(err.find("no/such/dir/out.json"), std::string::npos) << err;
}

// --- Environment helpers ---------------------------------------------------------------------------

TEST(Environment, TimestampCommitAndPath) {
  EXPECT_TRUE(std::regex_match(UtcTimestamp(),
                               std::regex(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)")))
      << UtcTimestamp();
  setenv("GEMVZ_COMMIT", "from-env", 1);
  EXPECT_EQ(CommitFrom(""), "from-env");
  EXPECT_EQ(CommitFrom("from-flag"), "from-flag");
  unsetenv("GEMVZ_COMMIT");
  EXPECT_EQ(CommitFrom(""), "");
  EXPECT_FALSE(FindOnPath("sh").empty());
  EXPECT_EQ(FindOnPath("gemvz-no-such-program-" + std::to_string(Rng()())), "");
  const std::string version = NvidiaDriverVersion();  // "" without a driver
  if (!version.empty()) {
    EXPECT_TRUE(std::isdigit(version[0])) << version;
  }
}

TEST(PlotSpeedups, SaysClearlyWhenGnuplotIsMissing) {
  const std::string dir = TempDir();
  const char* old_path = std::getenv("PATH");
  const std::string saved = old_path == nullptr ? "" : old_path;
  setenv("PATH", dir.c_str(), 1);  // an empty directory: no gnuplot
  const absl::Status st =
      PlotSpeedups({FakeCase(SuiteShapes()[0], 1, 10, 13, 14, 12)}, "t", dir + "/p.png");
  setenv("PATH", saved.c_str(), 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("gnuplot"), absl::string_view::npos) << st;
  EXPECT_NE(st.message().find("p.png"), absl::string_view::npos) << st;
  struct stat info;
  EXPECT_NE(stat((dir + "/p.png").c_str(), &info), 0);
  EXPECT_EQ(PlotSpeedups({}, "t", dir + "/q.png").code(), absl::StatusCode::kInvalidArgument);
}

TEST(PlotSpeedups, DrawsAPngWhenGnuplotIsInstalled) {
  if (FindOnPath("gnuplot").empty()) GTEST_SKIP() << "gnuplot is not installed";
  const std::string dir = TempDir();
  const std::string png = dir + "/speedups.png";
  std::vector<BenchCase> cases;
  for (const MatrixShape& s : SuiteShapes()) {
    for (int64_t m : {1, 8, 16}) cases.push_back(FakeCase(s, m, 10, 13, 14, 12));
  }
  const std::string tmp = dir + "/tmp";
  ASSERT_EQ(mkdir(tmp.c_str(), 0755), 0);
  absl::Status st;
  {
    gemvz::jit_test::ScopedEnv tmpdir("TMPDIR", tmp);
    st = PlotSpeedups(cases, "it's a test", png);
  }
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_TRUE(gemvz::testing::ListDir(tmp).empty());
  std::ifstream in(png, std::ios::binary);
  char magic[8] = {0};
  in.read(magic, 8);
  EXPECT_EQ(std::string(magic + 1, 3), "PNG");
}

// A test directory with bin/gnuplot, a shell script of `body`, and an empty tmp/ to serve as
// TMPDIR (a step that fails fails the test).
struct FakeGnuplotDirs {
  std::string dir, bin, tmp;
};
FakeGnuplotDirs MakeFakeGnuplot(const std::string& body) {
  FakeGnuplotDirs d{TempDir(), "", ""};
  d.bin = d.dir + "/bin";
  d.tmp = d.dir + "/tmp";
  EXPECT_EQ(mkdir(d.bin.c_str(), 0755), 0);
  EXPECT_EQ(mkdir(d.tmp.c_str(), 0755), 0);
  const std::string fake = d.bin + "/gnuplot";
  {
    std::ofstream script(fake);
    script << "#!/bin/sh\n" << body;
  }
  EXPECT_EQ(chmod(fake.c_str(), 0755), 0);
  return d;
}

// gnuplot draws into a scratch directory; only a whole chart reaches the user's path, and the
// scratch directory goes whatever happens. A fake gnuplot that writes half a file and fails stands
// for a crash or a full disk mid-drawing.
TEST(PlotSpeedups, NeverLeavesAHalfDrawnChartOrItsScratchDirectory) {
  const auto [dir, bin, tmp] = MakeFakeGnuplot(
      "out=$(sed -n \"s/^set output '\\(.*\\)'$/\\1/p\" \"$1\")\n"
      "printf '\\211PN' > \"$out\"\n"
      "echo 'fake gnuplot: disk full' >&2\n"
      "exit 1\n");
  const char* old_path = std::getenv("PATH");
  const std::string png = dir + "/chart.png";
  absl::Status st;
  {
    gemvz::jit_test::ScopedEnv path("PATH", bin + ":" + (old_path == nullptr ? "" : old_path));
    gemvz::jit_test::ScopedEnv tmpdir("TMPDIR", tmp);
    st = PlotSpeedups({FakeCase(SuiteShapes()[0], 1, 10, 13, 14, 12)}, "t", png);
  }
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  EXPECT_NE(st.message().find("disk full"), absl::string_view::npos) << st;
  EXPECT_FALSE(gemvz::testing::Exists(png));
  EXPECT_TRUE(gemvz::testing::ListDir(tmp).empty());
}

// A Ctrl-C while gnuplot draws reaches gnuplot and its shell only (std::system ignores SIGINT in
// the caller meanwhile): PlotSpeedups then removes its scratch directory and ends the process by
// the same signal, as every command does when interrupted. In a forked child, since it dies.
TEST(PlotSpeedups, AnInterruptedGnuplotEndsTheCommandByTheSignal) {
  // Both the shell that std::system started and the fake itself get SIGINT, as from a terminal.
  const auto [dir, bin, tmp] = MakeFakeGnuplot("kill -INT $PPID\nkill -INT $$\nsleep 5\nexit 0\n");
  const std::string png = dir + "/chart.png";
  std::fflush(nullptr);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const char* old_path = std::getenv("PATH");
    setenv("PATH", (bin + ":" + (old_path == nullptr ? "" : old_path)).c_str(), 1);
    setenv("TMPDIR", tmp.c_str(), 1);
    (void)PlotSpeedups({FakeCase(SuiteShapes()[0], 1, 10, 13, 14, 12)}, "t", png);
    _exit(3);  // returned: the signal did not end it
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGINT)
      << "status " << status << (WIFEXITED(status) ? " (exited)" : "");
  EXPECT_FALSE(gemvz::testing::Exists(png));
  EXPECT_TRUE(gemvz::testing::ListDir(tmp).empty());
}

// --- The bandwidth probe kernel ------------------------------------------------------------------

// bench launches kernel_sources/bandwidth_probe.cuh through GetKernelByName; compiling it needs no
// GPU, so its source, name expression and load path are checked here, where CI runs.
TEST(BandwidthProbeKernel, EveryFormCompilesToStreamingLoadsWithoutSpills) {
  internal::KernelCacheOptions options;
  options.disk_directory = "";  // memory only: the user's cache is not touched
  internal::KernelCache cache(options);
  ASSERT_FALSE(ProbeForms().empty());
  std::set<std::string> names;
  for (const ProbeForm& form : ProbeForms()) {
    SCOPED_TRACE(form.Name());
    EXPECT_TRUE(names.insert(form.Name()).second) << "a form listed twice";
    internal::CompileRequest request;
    request.arch = "sm_90";
    request.source_file = "bandwidth_probe.cuh";
    request.name_expression = form.NameExpression();
    request.kernel_name = "bandwidth_probe.cuh:" + form.NameExpression();
    absl::StatusOr<std::shared_ptr<const internal::CompiledKernel>> kernel = cache.Get(request);
    ASSERT_TRUE(kernel.ok()) << kernel.status();
    EXPECT_FALSE((*kernel)->cubin.empty());
    EXPECT_NE((*kernel)->lowered_name.find("gemvz_bandwidth_probe"), std::string::npos);
    EXPECT_NE((*kernel)->ptx.find("ld.global.nc.L1::no_allocate.v4.u32"), std::string::npos);
    EXPECT_EQ((*kernel)->spill_bytes, 0);
    EXPECT_GT((*kernel)->registers, 0);
    EXPECT_LE((*kernel)->registers * form.threads, 65536) << "a block must fit an SM's registers";
  }
}

}  // namespace
}  // namespace gemvz::cli
