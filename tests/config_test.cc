// KernelConfig: the text form round trip, parse errors, and every rule of ValidateConfig/Validate
// with the message that names it.
#include "gemvz/config.h"

#include <stdlib.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "gemvz/runtime.h"
#include "gtest/gtest.h"
#include "kernel_sources/k_range.cuh"
#include "tests/support/jit_test_util.h"

// gmock is not linked: a substring check that prints both sides.
#define EXPECT_CONTAINS(haystack, needle)                                       \
  EXPECT_NE(std::string(haystack).find(std::string(needle)), std::string::npos) \
      << "'" << (haystack) << "' does not contain '" << (needle) << "' "

namespace gemvz {
namespace {

// Status messages as std::string, whatever Abseil's string_view is.
std::string Msg(const absl::Status& s) { return std::string(s.message()); }

uint64_t Seed() {
  std::random_device rd;
  return (uint64_t{rd()} << 32) | rd();
}

KernelConfig RandomValidConfig(std::mt19937_64& rng) {
  KernelConfig c;
  c.format = rng() % 2 ? WeightFormat::kZ12 : WeightFormat::kBf16;
  c.nb = 1 + static_cast<int>(rng() % 4);
  c.nw = c.nb + static_cast<int>(rng() % (33 - c.nb));
  c.ug = 1 + static_cast<int>(rng() % 8);
  c.pipe = static_cast<int>(rng() % 4);
  c.splits = 1 + static_cast<int>(rng() % 100000);
  // z12 may take two row blocks per CTA where NW + 1 >= 2 * NB.
  if (c.format == WeightFormat::kZ12 && c.nw + 1 >= 2 * c.nb && rng() % 2) c.rb = 2;
  // and read group-major weights.
  if (c.format == WeightFormat::kZ12 && rng() % 2) c.order = WeightOrder::kGroupMajor;
  // what no kernel may declare, or no GPU launch
  while (c.shared_bytes() > kMaxStaticSharedBytes || c.threads() > kMaxThreadsPerBlock) --c.nw;
  return c;
}

TEST(ConfigTest, TextFormIsCanonical) {
  KernelConfig c{WeightFormat::kZ12, 8, 2, 2, 3, 1};
  EXPECT_EQ(c.ToString(), "z12.nw8.ug2.nb2.pipe3.s1");
  EXPECT_EQ(c.KernelName(), "z12.nw8.ug2.nb2.pipe3");
  KernelConfig b{WeightFormat::kBf16, 16, 1, 4, 0, 6};
  EXPECT_EQ(b.ToString(), "bf16.nw16.ug1.nb4.pipe0.s6");
  EXPECT_EQ(b.KernelName(), "bf16.nw16.ug1.nb4.pipe0");
  // RB 1 is written by leaving the field out; RB 2 comes before S.
  KernelConfig r{WeightFormat::kZ12, 4, 1, 2, 3, 2, 2};
  EXPECT_EQ(r.ToString(), "z12.nw4.ug1.nb2.pipe3.rb2.s2");
  EXPECT_EQ(r.KernelName(), "z12.nw4.ug1.nb2.pipe3.rb2");
  absl::StatusOr<KernelConfig> rb1 = KernelConfig::Parse("z12.nw8.ug2.nb2.pipe3.rb1.s1");
  ASSERT_TRUE(rb1.ok()) << Msg(rb1.status());
  EXPECT_EQ(*rb1, c);
  EXPECT_EQ(rb1->ToString(), "z12.nw8.ug2.nb2.pipe3.s1");
  // Group-major weights: ".gm" after RB, before S; block-major by leaving it out.
  KernelConfig g = r;
  g.order = WeightOrder::kGroupMajor;
  EXPECT_EQ(g.ToString(), "z12.nw4.ug1.nb2.pipe3.rb2.gm.s2");
  EXPECT_EQ(g.KernelName(), "z12.nw4.ug1.nb2.pipe3.rb2.gm");
  g.rb = 1;
  EXPECT_EQ(g.ToString(), "z12.nw4.ug1.nb2.pipe3.gm.s2");
  EXPECT_EQ(OrderName(WeightOrder::kBlockMajor), "block");
  EXPECT_EQ(OrderName(WeightOrder::kGroupMajor), "group");
  EXPECT_EQ(FormatName(WeightFormat::kZ12), "z12");
  EXPECT_EQ(FormatName(WeightFormat::kBf16), "bf16");
  EXPECT_EQ((GemvShape{8, 4096, 8192}.ToString()), "m8.n4096.k8192");
}

TEST(ConfigTest, RandomConfigsRoundTripThroughText) {
  const uint64_t seed = Seed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 2000; ++i) {
    const KernelConfig c = RandomValidConfig(rng);
    ASSERT_TRUE(ValidateConfig(c).ok()) << Msg(ValidateConfig(c));
    absl::StatusOr<KernelConfig> back = KernelConfig::Parse(c.ToString());
    ASSERT_TRUE(back.ok()) << c.ToString() << ": " << Msg(back.status());
    EXPECT_EQ(*back, c) << c.ToString() << " came back as " << back->ToString();
    EXPECT_EQ(back->ToString(), c.ToString());
    // The kernel name parses to the same kernel with S = 1.
    absl::StatusOr<KernelConfig> kernel = KernelConfig::Parse(c.KernelName());
    ASSERT_TRUE(kernel.ok()) << Msg(kernel.status());
    KernelConfig expected = c;
    expected.splits = 1;
    EXPECT_EQ(*kernel, expected);
  }
}

TEST(ConfigTest, FieldsParseInAnyOrder) {
  absl::StatusOr<KernelConfig> c = KernelConfig::Parse("bf16.s4.pipe1.nb2.ug4.nw12");
  ASSERT_TRUE(c.ok()) << Msg(c.status());
  EXPECT_EQ(*c, (KernelConfig{WeightFormat::kBf16, 12, 4, 2, 1, 4}));
  c = KernelConfig::Parse("z12.rb2.s4.pipe3.nb2.ug1.nw4");
  ASSERT_TRUE(c.ok()) << Msg(c.status());
  EXPECT_EQ(*c, (KernelConfig{WeightFormat::kZ12, 4, 1, 2, 3, 4, 2}));
  c = KernelConfig::Parse("z12.gm.rb2.s4.pipe3.nb2.ug1.nw4");
  ASSERT_TRUE(c.ok()) << Msg(c.status());
  EXPECT_EQ(*c, (KernelConfig{WeightFormat::kZ12, 4, 1, 2, 3, 4, 2, WeightOrder::kGroupMajor}));
}

TEST(ConfigTest, EqualityAndHashSeeEveryField) {
  const uint64_t seed = Seed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  const KernelConfig base{WeightFormat::kZ12, 8, 2, 2, 3, 1};
  absl::flat_hash_set<KernelConfig> set = {base};
  const KernelConfig variants[] = {
      {WeightFormat::kBf16, 8, 2, 2, 3, 1}, {WeightFormat::kZ12, 4, 2, 2, 3, 1},
      {WeightFormat::kZ12, 8, 1, 2, 3, 1},  {WeightFormat::kZ12, 8, 2, 1, 3, 1},
      {WeightFormat::kZ12, 8, 2, 2, 0, 1},  {WeightFormat::kZ12, 8, 2, 2, 3, 2},
      {WeightFormat::kZ12, 8, 2, 2, 3, 1, 2},
      {WeightFormat::kZ12, 8, 2, 2, 3, 1, 1, WeightOrder::kGroupMajor}};
  for (const KernelConfig& v : variants) {
    EXPECT_NE(v, base) << v.ToString();
    EXPECT_TRUE(set.insert(v).second) << v.ToString();
  }
  EXPECT_FALSE(set.insert(base).second);
  // Distinct texts are distinct values.
  absl::flat_hash_set<std::string> texts;
  absl::flat_hash_set<KernelConfig> configs;
  for (int i = 0; i < 1000; ++i) {
    const KernelConfig c = RandomValidConfig(rng);
    EXPECT_EQ(texts.insert(c.ToString()).second, configs.insert(c).second) << c.ToString();
  }
}

struct ParseErrorCase {
  const char* text;
  const char* message;
};

TEST(ConfigTest, ParseErrorsNameTheProblem) {
  const ParseErrorCase cases[] = {
      // The format.
      {"", "it must start with the format, z12 or bf16"},
      {"z13.nw8.ug2.nb2.pipe3.s1", "it must start with the format, z12 or bf16"},
      {"Z12.nw8.ug2.nb2.pipe3.s1", "it must start with the format"},
      {"nw8.ug2.nb2.pipe3.s1", "it must start with the format"},
      {"fp16.nw8.ug2.nb2.pipe3", "it must start with the format"},
      // Unknown fields.
      {"z12.nw8.ug2.nb2.pipe3.q1",
       "field 'q1' is not one of nw<N>, ug<N>, nb<N>, pipe<N>, rb<N>, gm, s<N>"},
      {"z12.nw8.ug2.nb2.pipe3.gm1", "field 'gm1' is not one of"},
      {"z12.nw8.ug2.nb2.pipe3.GM", "field 'GM' is not one of"},
      {"z12.nw8.ug2.nb2.pipe3.s1.", "field '' is not one of"},
      {"z12..nw8.ug2.nb2.pipe3", "field '' is not one of"},
      {"z12.NW8.ug2.nb2.pipe3", "field 'NW8' is not one of"},
      {"z12.warps8.ug2.nb2.pipe3", "field 'warps8' is not one of"},
      // Bad numbers.
      {"z12.nw.ug2.nb2.pipe3",
       "field 'nw' is not one of nw<N>, ug<N>, nb<N>, pipe<N>, rb<N>, gm, s<N> "
       "(nw takes a decimal number)"},
      {"z12.nwx.ug2.nb2.pipe3", "(nw takes a decimal number)"},
      {"z12.nw8.ug2.nb2.pipe3.s-1", "field 's-1' is not one of"},
      {"z12.nw+8.ug2.nb2.pipe3", "field 'nw+8'"},
      {"z12.nw 8.ug2.nb2.pipe3", "field 'nw 8'"},
      {"z12.nw8 .ug2.nb2.pipe3", "field 'nw8 '"},
      {"z12.nw0x8.ug2.nb2.pipe3", "field 'nw0x8'"},
      // One spelling: no leading zero (pipe0 and s0 are numbers, not padded ones).
      {"z12.nw08.ug2.nb2.pipe3",
       "field 'nw08' has a leading zero (nw is written without one: a configuration has one "
       "spelling)"},
      {"z12.nw8.ug2.nb2.pipe03.s1", "field 'pipe03' has a leading zero"},
      {"z12.nw8.ug2.nb2.pipe3.s0001", "field 's0001' has a leading zero"},
      {"z12.nw8.ug2.nb2.pipe3.rb02", "field 'rb02' has a leading zero"},
      {"z12.nw8.ug2.5.nb2.pipe3", "field '5'"},
      {"z12.nw8.ug2.nb2.pipe3.s99999999999",
       "field 's99999999999' is out of range (s takes a number of at most 9 digits)"},
      {"z12.nw1234567890.ug2.nb2.pipe3", "field 'nw1234567890' is out of range"},
      {"z12.nw8.ug2.nb2.pipe1e1", "(pipe takes a decimal number)"},
      {"z12.nw8.ug2.nb2.pipe3.rbx", "(rb takes a decimal number)"},
      // Duplicates.
      {"z12.nw8.ug2.nb2.pipe3.nw4", "field nw given twice"},
      {"z12.nw8.ug2.nb2.pipe3.s1.s2", "field s given twice"},
      {"z12.nw8.ug2.ug2.nb2.pipe3", "field ug given twice"},
      {"z12.nw8.ug2.nb2.pipe3.rb2.rb2", "field rb given twice"},
      {"z12.nw8.ug2.nb2.pipe3.gm.gm.s1", "field gm given twice"},
      // Missing fields (s alone may be left out).
      {"z12", "missing field nw<N>"},
      {"z12.ug2.nb2.pipe3.s1", "missing field nw<N>"},
      {"z12.nw8.nb2.pipe3.s1", "missing field ug<N>"},
      {"z12.nw8.ug2.pipe3.s1", "missing field nb<N>"},
      {"z12.nw8.ug2.nb2.s1", "missing field pipe<N>"},
      // Well-formed text, values out of range.
      {"z12.nw0.ug2.nb1.pipe3", "NW must be in 1..32 (got 0)"},
      {"z12.nw33.ug2.nb1.pipe3", "NW must be in 1..32 (got 33)"},
      {"z12.nw8.ug0.nb1.pipe3", "UG must be in 1..8 (got 0)"},
      {"z12.nw8.ug9.nb1.pipe3", "UG must be in 1..8 (got 9)"},
      {"bf16.nw8.ug2.nb0.pipe3", "NB must be in 1..4 (got 0)"},
      {"bf16.nw8.ug2.nb5.pipe3", "NB must be in 1..4 (got 5)"},
      {"z12.nw8.ug2.nb2.pipe14", "PIPE must be in 0..13 (got 14)"},
      {"bf16.nw8.ug2.nb2.pipe4",
       "PIPE 4..13 (register-capped plain and rolling loops) exist for z12 only"},
      {"bf16.nw8.ug1.nb2.pipe11", "bf16 takes 0..3 (got 11)"},
      {"z12.nw8.ug2.nb2.pipe3.s0", "S must be at least 1 (got 0)"},
      {"z12.nw2.ug2.nb4.pipe3", "NW >= NB is required"},
      {"z12.nw8.ug2.nb2.pipe3.rb0", "RB must be 1, 2 or 4 (got 0)"},
      {"z12.nw8.ug2.nb2.pipe3.rb3", "RB must be 1, 2 or 4 (got 3)"},
      {"z12.nw8.ug2.nb2.pipe3.rb8", "RB must be 1, 2 or 4 (got 8)"},
      {"z12.nw4.ug1.nb4.pipe0.rb4.s2", "RB 4 takes S = 1 only"},
      {"bf16.nw8.ug1.nb4.pipe0.rb4", "RB 4 (4 row blocks per CTA) exists for z12 only"},
      {"bf16.nw8.ug2.nb2.pipe3.rb2", "RB 2 (2 row blocks per CTA) exists for z12 only"},
      {"z12.nw2.ug2.nb2.pipe3.rb2", "NW + 1 >= RB * NB is required"},
      {"bf16.nw8.ug2.nb2.pipe3.gm", "the group-major order (gm) is a layout of 12-bit weights"},
  };
  for (const ParseErrorCase& c : cases) {
    absl::StatusOr<KernelConfig> parsed = KernelConfig::Parse(c.text);
    ASSERT_FALSE(parsed.ok()) << "'" << c.text << "' parsed as " << parsed->ToString();
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_CONTAINS(Msg(parsed.status()), c.message) << "text '" << c.text << "'";
  }
  // What a message quotes is cut and escaped: a 4 MB line is not echoed whole, and a NUL (which
  // would end the message where it is printed) shows as \x00.
  const std::string huge = "z12." + std::string(4 << 20, 'x');
  const std::string long_message(Msg(KernelConfig::Parse(huge).status()));
  EXPECT_LT(long_message.size(), 400u);
  EXPECT_CONTAINS(long_message, "bad configuration 'z12.xxxx");
  EXPECT_CONTAINS(long_message, "xxx...': field 'xxxx");
  const std::string nul_message(
      Msg(KernelConfig::Parse(std::string("z12.nw8\0.ug2", 12)).status()));
  EXPECT_CONTAINS(nul_message, "bad configuration 'z12.nw8\\x00.ug2'");
}

TEST(ConfigTest, SplitsDefaultToOne) {
  absl::StatusOr<KernelConfig> c = KernelConfig::Parse("z12.nw4.ug1.nb1.pipe2");
  ASSERT_TRUE(c.ok()) << Msg(c.status());
  EXPECT_EQ(c->splits, 1);
  EXPECT_EQ(c->ToString(), "z12.nw4.ug1.nb1.pipe2.s1");
}

TEST(ConfigTest, ValidateConfigChecksEveryRange) {
  struct Case {
    KernelConfig config;
    const char* message;
  };
  const Case cases[] = {
      {{WeightFormat::kZ12, 0, 2, 1, 3, 1}, "NW must be in 1..32 (got 0)"},
      {{WeightFormat::kZ12, 33, 2, 1, 3, 1}, "NW must be in 1..32 (got 33)"},
      {{WeightFormat::kZ12, 8, 0, 1, 3, 1}, "UG must be in 1..8 (got 0)"},
      {{WeightFormat::kBf16, 8, 9, 1, 3, 1}, "UG must be in 1..8 (got 9)"},
      {{WeightFormat::kZ12, 8, 2, 0, 3, 1}, "NB must be in 1..4 (got 0)"},
      {{WeightFormat::kZ12, 8, 2, 5, 3, 1}, "NB must be in 1..4 (got 5)"},
      {{WeightFormat::kZ12, 8, 2, 1, -1, 1}, "PIPE must be in 0..13 (got -1)"},
      {{WeightFormat::kZ12, 8, 2, 1, 14, 1}, "PIPE must be in 0..13 (got 14)"},
      {{WeightFormat::kBf16, 8, 2, 1, 4, 1}, "bf16 takes 0..3 (got 4)"},
      {{WeightFormat::kZ12, 8, 2, 1, 3, 0}, "S must be at least 1 (got 0)"},
      {{WeightFormat::kZ12, 8, 2, 1, 3, -3}, "S must be at least 1 (got -3)"},
      {{WeightFormat::kZ12, 3, 2, 4, 3, 1},
       "NW >= NB is required: the first NB warps do the final reduction (NW=3, NB=4)"},
      {{WeightFormat::kBf16, 1, 1, 2, 0, 1}, "NW >= NB is required"},
  };
  for (const Case& c : cases) {
    const absl::Status st = ValidateConfig(c.config);
    ASSERT_FALSE(st.ok()) << c.message;
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_CONTAINS(Msg(st), c.message);
    EXPECT_CONTAINS(Msg(st), absl::StrCat("configuration ", c.config.ToString(), " is invalid"));
    // Validate applies the same rules first.
    const absl::Status full = Validate(c.config, GemvShape{1, 4096, 4096});
    EXPECT_CONTAINS(Msg(full), c.message);
  }
  // The edges of every range are accepted.
  for (int nw : {1, 32}) {
    for (int ug : {1, 8}) {
      for (int pipe : {0, 3}) {
        const KernelConfig c{WeightFormat::kBf16, nw, ug, 1, pipe, 1};
        EXPECT_TRUE(ValidateConfig(c).ok()) << c.ToString();
      }
    }
  }
  EXPECT_TRUE(ValidateConfig(KernelConfig{WeightFormat::kZ12, 4, 1, 4, 0, 1 << 30}).ok());
  EXPECT_TRUE(ValidateConfig(KernelConfig{WeightFormat::kZ12, 4, 1, 2, 4, 1}).ok());
  EXPECT_TRUE(ValidateConfig(KernelConfig{WeightFormat::kZ12, 4, 1, 2, 8, 1}).ok());
}

TEST(ConfigTest, SharedMemoryMatchesTheKernelsArrays) {
  // red[NW][NB*32] float4 + s_last; z12 adds ecorr[16][NB*8+1] float and s_dense.
  const KernelConfig z{WeightFormat::kZ12, 8, 2, 2, 3, 1};
  EXPECT_EQ(z.shared_bytes(), 8 * 2 * 32 * 16 + 16 * (2 * 8 + 1) * 4 + 4 + 4);
  const KernelConfig b{WeightFormat::kBf16, 8, 2, 2, 3, 1};
  EXPECT_EQ(b.shared_bytes(), 8 * 2 * 32 * 16 + 4);
  // RB 2: red[NW][RB*NB*32] and ecorr[RB*16][NB*8+1].
  const KernelConfig z2{WeightFormat::kZ12, 8, 2, 2, 3, 1, 2};
  EXPECT_EQ(z2.shared_bytes(), 8 * 2 * 2 * 32 * 16 + 2 * 16 * (2 * 8 + 1) * 4 + 4 + 4);
  EXPECT_EQ(z.threads(), 9 * 32);  // the exception warp
  EXPECT_EQ(b.threads(), 8 * 32);
  EXPECT_EQ(z.tokens_per_launch(), 16);
}

// What Validate counts is what the compiled kernels declare: ptxas's static shared memory for a
// few configurations, compiled by NVRTC (no GPU needed) into a private cache directory.
TEST(ConfigTest, SharedMemoryMatchesPtxas) {
  const jit_test::TempDir dir;
  const jit_test::ScopedEnv cache("GEMVZ_CACHE_DIR", dir.path());
  const KernelConfig configs[] = {
      {WeightFormat::kZ12, 8, 1, 2, 3, 1},    {WeightFormat::kZ12, 4, 1, 4, 0, 1},
      {WeightFormat::kZ12, 4, 1, 2, 3, 1, 2}, {WeightFormat::kZ12, 4, 1, 4, 0, 1, 4},
      {WeightFormat::kZ12, 3, 1, 1, 0, 1, 4}, {WeightFormat::kBf16, 8, 1, 1, 3, 1},
      {WeightFormat::kBf16, 4, 1, 4, 0, 1}};
  for (const KernelConfig& c : configs) {
    absl::StatusOr<PrecompileResult> r = Precompile(c, "sm_90");
    ASSERT_TRUE(r.ok()) << c.ToString() << ": " << Msg(r.status());
    ASSERT_GE(r->shared_bytes, 0) << c.ToString() << ": ptxas reported no statistics";
    // Validate may overestimate by alignment padding, never underestimate.
    EXPECT_LE(r->shared_bytes, c.shared_bytes()) << c.ToString();
    EXPECT_GE(r->shared_bytes + 16, c.shared_bytes()) << c.ToString();
  }
}

// A configuration and shape that pass every rule; each case below breaks exactly one.
constexpr KernelConfig kGood{WeightFormat::kZ12, 8, 2, 2, 3, 2};
constexpr GemvShape kGoodShape{16, 4096, 8192};

void ExpectRule(const KernelConfig& c, const GemvShape& s, const std::string& rule,
                const DeviceLimits& limits = DefaultDeviceLimits()) {
  const absl::Status st = Validate(c, s, limits);
  ASSERT_FALSE(st.ok()) << c.ToString() << " " << s.ToString() << " should break: " << rule;
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_CONTAINS(Msg(st), rule);
  EXPECT_CONTAINS(Msg(st), absl::StrCat("configuration ", c.ToString(), " for ", s.ToString(),
                                        " is invalid: "));
}

TEST(ValidateTest, TheBaselinePasses) {
  EXPECT_TRUE(Validate(kGood, kGoodShape).ok()) << Msg(Validate(kGood, kGoodShape));
  EXPECT_EQ(DefaultDeviceLimits().max_threads_per_block, 1024);
  EXPECT_EQ(DefaultDeviceLimits().max_shared_per_block, 48 * 1024);
  EXPECT_EQ(DefaultDeviceLimits().sm_count, 132);
}

// The kernel's own dealing of K (kernel_sources/k_range.cuh, compiled here by g++) for every
// shape Validate accepts up to 300 groups: each K slice covered once, in order, by its warps, each
// warp a whole number (at least one) of trips, counts one trip apart at most, the exception warp
// given its slice, and equal shares exactly where 64*S*NW*UG divides K (the old rule's ranges).
template <int NW, int UG>
void CheckDealing() {
  for (int kg = 1; kg <= 300; ++kg) {
    for (int s = 1; s <= 8; ++s) {
      const KernelConfig c{WeightFormat::kZ12, NW, UG, 1, 3, s};
      if (!Validate(c, GemvShape{1, 16, int64_t{64} * kg}).ok()) continue;
      SCOPED_TRACE(absl::StrCat(c.ToString(), " KG=", kg));
      const bool even = kg % (s * NW * UG) == 0;
      for (int sidx = 0; sidx < s; ++sidx) {
        int next = sidx * kg / s, fewest = kg, most = 0;
        for (int w = 0; w < NW; ++w) {
          const gemvz_dev::KRange r = gemvz_dev::k_range<NW, UG>(kg, s, sidx, w);
          ASSERT_EQ(r.lo, sidx * kg / s);
          ASSERT_EQ(r.hi, (sidx + 1) * kg / s);
          ASSERT_EQ(r.g0, next) << "warp " << w;
          ASSERT_GE(r.n, UG) << "warp " << w;
          ASSERT_EQ(r.n % UG, 0) << "warp " << w;
          if (even) ASSERT_EQ(r.g0, sidx * (kg / s) + w * (kg / s / NW)) << "warp " << w;
          next += r.n;
          fewest = std::min(fewest, r.n);
          most = std::max(most, r.n);
        }
        ASSERT_EQ(next, (sidx + 1) * kg / s);
        EXPECT_LE(most - fewest, UG);
        EXPECT_EQ(most == fewest, even || (kg / s / UG) % NW == 0);
        const gemvz_dev::KRange x = gemvz_dev::k_range<NW, UG>(kg, s, sidx, NW);
        EXPECT_EQ(x.lo, sidx * kg / s);
        EXPECT_EQ(x.hi, (sidx + 1) * kg / s);
      }
    }
  }
}

template <int UG>
void CheckDealingForWarps() {
  CheckDealing<1, UG>();
  CheckDealing<2, UG>();
  CheckDealing<3, UG>();
  CheckDealing<4, UG>();
  CheckDealing<6, UG>();
  CheckDealing<8, UG>();
  CheckDealing<12, UG>();
  CheckDealing<16, UG>();
  CheckDealing<32, UG>();
}

TEST(KRangeTest, DealsEveryGroupOnceInWholeTrips) {
  CheckDealingForWarps<1>();
  CheckDealingForWarps<2>();
  CheckDealingForWarps<4>();
  CheckDealingForWarps<8>();
}

// RB 4: four row blocks per CTA, so N in multiples of 64; its combine takes the fragments in
// turns, so NW = 4 serves NB = 4 (RB*NB*32 = 512 fragments, 160 threads); S = 1 only.
TEST(ValidateTest, FourRowBlocks) {
  const KernelConfig c{WeightFormat::kZ12, 4, 1, 4, 0, 1, 4};
  EXPECT_TRUE(Validate(c, GemvShape{32, 28672, 4096}).ok());
  EXPECT_TRUE(Validate(c, GemvShape{1, 64, 4096}).ok());
  ExpectRule(c, GemvShape{32, 28672 + 32, 4096},
             "N must be a multiple of 16*RB = 64 (each CTA takes RB whole row blocks)");
  KernelConfig split = c;
  split.splits = 2;
  // (Rules of the configuration alone: ValidateConfig names them without a shape.)
  EXPECT_CONTAINS(Msg(Validate(split, GemvShape{32, 28672, 4096})), "RB 4 takes S = 1 only");
  // RB 2 keeps its rule: NW + 1 warps for RB*NB = 8 warps' worth of fragments.
  EXPECT_CONTAINS(
      Msg(Validate(KernelConfig{WeightFormat::kZ12, 4, 1, 4, 0, 1, 2}, GemvShape{32, 28672, 4096})),
      "NW + 1 >= RB * NB is required");
}

TEST(ValidateTest, Z12KComesInWholeTripsAtLeastOnePerWarp) {
  // The 12-bit warps need not get equal shares: 9216 = 36 trips of UG 2 per slice of S = 2 over
  // NW = 8 (4 or 5 each), 8192 over NW = 6, 11008 (Llama-2-7B's 172 groups) over 16 warps.
  EXPECT_TRUE(Validate(kGood, GemvShape{16, 4096, 9216}).ok());
  KernelConfig c = kGood;
  c.nw = 6;
  EXPECT_TRUE(Validate(c, kGoodShape).ok());
  EXPECT_TRUE(Validate(KernelConfig{WeightFormat::kZ12, 16, 1, 1, 2, 1}, GemvShape{1, 4096, 11008})
                  .ok());
  // Every slice the same whole trips: 64*S*UG must divide K.
  ExpectRule(kGood, GemvShape{16, 4096, 8192 + 128},
             "K must be divisible by 64*S*UG = 256 (K slices of whole trips of UG groups)");
  c = kGood;
  c.splits = 3;
  ExpectRule(c, kGoodShape, "K must be divisible by 64*S*UG = 384");
  // A trip for every warp: 1024 is 4 trips of UG 2 per slice, for NW = 8 warps.
  ExpectRule(kGood, GemvShape{16, 4096, 1024},
             "K/(64*S*UG) = 4 trips per K slice must be at least NW = 8, one for every warp");
  EXPECT_TRUE(Validate(kGood, GemvShape{16, 4096, 2048}).ok());
}

TEST(ValidateTest, PlainKMustBeDivisibleBy64TimesSTimesNwTimesUg) {
  // The plain kernel's warps take equal shares: 64*S*NW*UG = 64*2*8*2 = 2048.
  KernelConfig c = kGood;
  c.format = WeightFormat::kBf16;
  ExpectRule(c, GemvShape{16, 4096, 9216},
             "K must be divisible by 64*S*NW*UG = 2048 (the plain kernel's warps take equal "
             "shares)");
  c.nw = 6;
  ExpectRule(c, kGoodShape, "K must be divisible by 64*S*NW*UG = 1536");
  c.splits = 1;
  c.ug = 1;
  EXPECT_TRUE(Validate(c, GemvShape{16, 4096, 64 * 6 * 7}).ok());
}

TEST(ValidateTest, RandomShapesFollowTheTripRule) {
  const uint64_t seed = Seed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 5000; ++i) {
    KernelConfig c = RandomValidConfig(rng);
    c.nw = c.nb + static_cast<int>(rng() % (16 - c.nb + 1));
    c.ug = 1 + static_cast<int>(rng() % 4);
    c.splits = 1 + static_cast<int>(rng() % 8);
    c.rb = 1;  // RB's own rules on N and shared memory have their tests
    const GemvShape s{1 + static_cast<int64_t>(rng() % (8 * c.nb)),
                      16 * (1 + static_cast<int64_t>(rng() % 2048)),
                      64 * (1 + static_cast<int64_t>(rng() % 1024))};
    const absl::Status st = Validate(c, s);
    const int64_t quantum = int64_t{64} * c.splits * c.nw * c.ug;
    const int64_t slice = int64_t{64} * c.splits * c.ug;
    if (c.format == WeightFormat::kBf16 && s.k % quantum != 0) {
      EXPECT_CONTAINS(Msg(st), absl::StrCat("64*S*NW*UG = ", quantum)) << Msg(st);
    } else if (c.format == WeightFormat::kZ12 && s.k % slice != 0) {
      EXPECT_CONTAINS(Msg(st), absl::StrCat("K must be divisible by 64*S*UG = ", slice));
    } else if (c.format == WeightFormat::kZ12 && s.k / slice < c.nw) {
      EXPECT_CONTAINS(Msg(st), absl::StrCat("K/(64*S*UG) = ", s.k / slice,
                                            " trips per K slice must be at least NW = ", c.nw));
    } else {
      EXPECT_TRUE(st.ok()) << Msg(st);
    }
  }
}

TEST(ValidateTest, NwAtLeastNb) {
  // A rule of the configuration alone: the message names the configuration, not the shape.
  const KernelConfig c{WeightFormat::kZ12, 2, 1, 3, 3, 1};
  const absl::Status st = Validate(c, GemvShape{17, 4096, 4096});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_CONTAINS(Msg(st),
                  "configuration z12.nw2.ug1.nb3.pipe3.s1 is invalid: NW >= NB is "
                  "required: the first NB warps do the final reduction (NW=2, NB=3)");
  EXPECT_TRUE(
      Validate(KernelConfig{WeightFormat::kZ12, 3, 1, 3, 3, 1}, GemvShape{17, 4096, 64 * 3 * 16})
          .ok());
}

TEST(ValidateTest, ThreadsPerBlock) {
  // z12 adds the exception warp: 32 streaming warps make 33 * 32 = 1056 threads, more than any
  // GPU launches, so the configuration alone is refused (by Parse and warm-up too, before NVRTC).
  const KernelConfig z{WeightFormat::kZ12, 32, 1, 1, 3, 1};
  const std::string rule =
      "configuration z12.nw32.ug1.nb1.pipe3.s1 is invalid: 1056 threads per block (NW = 32 and "
      "the exception warp) exceed 1024, the most any GPU launches in one block";
  EXPECT_EQ(Msg(Validate(z, GemvShape{1, 4096, 4096})), rule);
  EXPECT_EQ(Msg(ValidateConfig(z)), rule);
  EXPECT_CONTAINS(Msg(KernelConfig::Parse("z12.nw32.ug1.nb1.pipe3").status()), "1056 threads");
  EXPECT_TRUE(ValidateConfig(KernelConfig{WeightFormat::kZ12, 31, 1, 1, 3, 1}).ok());
  const KernelConfig b{WeightFormat::kBf16, 32, 1, 1, 3, 1};
  EXPECT_TRUE(Validate(b, GemvShape{1, 4096, 4096}).ok());
  DeviceLimits small;
  small.max_threads_per_block = 256;
  ExpectRule(kGood, kGoodShape, "threads per block 288 exceed the device limit 256", small);
  const KernelConfig b8{WeightFormat::kBf16, 8, 2, 2, 3, 2};
  EXPECT_TRUE(Validate(b8, kGoodShape, small).ok());
}

// Over 48 KiB of static shared memory no kernel compiles: the configuration alone is refused (by
// ValidateConfig, so by Parse and warm-up too, before NVRTC), whatever the shape.
void ExpectOver48KiB(const KernelConfig& c, const std::string& hint) {
  const std::string rule =
      absl::StrCat("configuration ", c.ToString(), " is invalid: static shared memory ",
                   c.shared_bytes(), " bytes exceeds 49152, the most any kernel may declare ",
                   hint);
  ASSERT_GT(c.shared_bytes(), 48 * 1024);
  EXPECT_EQ(Msg(ValidateConfig(c)), rule);
  EXPECT_EQ(Msg(Validate(c, GemvShape{8, 4096, 64 * c.nw})), rule);
  const absl::StatusOr<KernelConfig> parsed = KernelConfig::Parse(c.ToString());
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(Msg(parsed.status()), rule);
}

TEST(ValidateTest, StaticSharedMemoryOver48KiB) {
  // 24 warps x 4 token blocks: red alone is 24 * 4 * 32 * 16 = 48 KiB.
  const KernelConfig c{WeightFormat::kZ12, 24, 1, 4, 3, 1};
  ExpectOver48KiB(c, "(lower NW or NB)");
  // Found by warm-up in session 5: NVRTC's compile error used to be the first word on it.
  ExpectOver48KiB(KernelConfig{WeightFormat::kZ12, 16, 1, 3, 0, 1, 2}, "(lower NW, NB or RB)");
  const KernelConfig fits{WeightFormat::kZ12, 20, 1, 4, 3, 1};
  EXPECT_LE(fits.shared_bytes(), 48 * 1024);
  EXPECT_TRUE(Validate(fits, GemvShape{32, 4096, 64 * 20}).ok());
  DeviceLimits small;
  small.max_shared_per_block = 8 * 1024;
  ExpectRule(kGood, kGoodShape, "exceeds 8192 (lower NW or NB)", small);
  // RB 2 doubles the partial sums: what fits with RB 1 may not, and the hint says so.
  const KernelConfig rb1{WeightFormat::kZ12, 12, 1, 4, 3, 1};
  KernelConfig rb2 = rb1;
  rb2.rb = 2;
  EXPECT_TRUE(Validate(rb1, GemvShape{32, 4096, 64 * 12}).ok());
  ExpectOver48KiB(rb2, "(lower NW, NB or RB)");
}

TEST(ValidateTest, RowsPerLaunch) {
  for (int nb = 1; nb <= 4; ++nb) {
    const KernelConfig c{WeightFormat::kBf16, 4, 1, nb, 3, 1};
    for (int64_t m = 1; m <= 8 * nb; ++m) {
      EXPECT_TRUE(Validate(c, GemvShape{m, 4096, 4096}).ok()) << c.ToString() << " m" << m;
    }
    ExpectRule(c, GemvShape{8 * nb + 1, 4096, 4096},
               absl::StrCat("m must be in 1..8*NB = ", 8 * nb, " per launch"));
    ExpectRule(c, GemvShape{0, 4096, 4096}, "m must be in 1..8*NB");
    ExpectRule(c, GemvShape{-5, 4096, 4096}, "m must be in 1..8*NB");
  }
}

TEST(ValidateTest, NMultipleOf16) {
  for (int64_t n : {0, -16, 8, 24, 4104}) {
    ExpectRule(kGood, GemvShape{16, n, 8192}, "N must be a positive multiple of 16");
  }
  EXPECT_TRUE(Validate(kGood, GemvShape{16, 16, 8192}).ok());
  // Two row blocks per CTA take whole pairs of row blocks.
  KernelConfig rb2 = kGood;
  rb2.rb = 2;
  for (int64_t n : {16, 48, 4112}) {
    ExpectRule(rb2, GemvShape{16, n, 8192},
               "N must be a multiple of 16*RB = 32 (each CTA takes RB whole row blocks)");
  }
  EXPECT_TRUE(Validate(rb2, GemvShape{16, 32, 8192}).ok());
  EXPECT_TRUE(Validate(rb2, GemvShape{16, 28672, 4096}).ok());
}

TEST(ValidateTest, KMultipleOf64) {
  for (int64_t k : {0, -64, 32, 96, 8192 + 32}) {
    ExpectRule(kGood, GemvShape{16, 4096, k}, "K must be a positive multiple of 64");
  }
}

TEST(ValidateTest, KernelIntArguments) {
  const KernelConfig c{WeightFormat::kBf16, 1, 1, 1, 3, 1};
  ExpectRule(c, GemvShape{1, int64_t{1} << 31, 64}, "N and K must be below 2^31");
  ExpectRule(c, GemvShape{1, 16, int64_t{1} << 32}, "N and K must be below 2^31");
}

TEST(ValidateTest, GridLimits) {
  DeviceLimits limits;
  limits.max_grid_x = 100;  // 100 row blocks of 16
  ExpectRule(kGood, GemvShape{16, 16 * 101, 8192},
             "N/(16*RB) CTAs per K slice exceed the grid's x limit", limits);
  EXPECT_TRUE(Validate(kGood, GemvShape{16, 16 * 100, 8192}, limits).ok());
  KernelConfig rb2 = kGood;  // two row blocks per CTA: half the CTAs
  rb2.rb = 2;
  EXPECT_TRUE(Validate(rb2, GemvShape{16, 16 * 200, 8192}, limits).ok());
  ExpectRule(rb2, GemvShape{16, 16 * 202, 8192},
             "N/(16*RB) CTAs per K slice exceed the grid's x limit", limits);
  limits = DeviceLimits{};
  limits.max_grid_y = 1;
  ExpectRule(kGood, kGoodShape, "S exceeds the grid's y limit", limits);
  KernelConfig s1 = kGood;
  s1.splits = 1;
  EXPECT_TRUE(Validate(s1, kGoodShape, limits).ok());
}

}  // namespace
}  // namespace gemvz
