// The 12-bit format on the host: bit-exact round trips, the emulated device decoder, the exact
// corrections (residual case included), compact exception storage and every refusal.
#include <algorithm>
#include <cfenv>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "gemvz/config.h"
#include "gemvz/format.h"
#include "gtest/gtest.h"
#include "runtime/format/z12_layout.h"
#include "tests/support/random_weights.h"

namespace gemvz {
namespace {

using testing::Distribution;
using testing::FreshSeed;
using testing::RandomMatrix;

float AsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void ExpectRoundTrip(const std::vector<uint16_t>& w, int64_t rows, int64_t cols) {
  auto p = Pack(w.data(), rows, cols);
  ASSERT_TRUE(p.ok()) << p.status();
  auto back = Unpack(*p);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->size(), w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    ASSERT_EQ((*back)[i], w[i]) << "weight " << i << " (row " << i / cols << ", col " << i % cols
                                << ") not restored";
  }
}

class RoundTrip : public ::testing::TestWithParam<Distribution> {};

TEST_P(RoundTrip, BitExact) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{16, 64}, {64, 256}, {256, 1024}}) {
    ExpectRoundTrip(RandomMatrix(rows, cols, GetParam(), seed), rows, cols);
  }
}

INSTANTIATE_TEST_SUITE_P(Distributions, RoundTrip,
                         ::testing::Values(Distribution::kNormal, Distribution::kStudentT3,
                                           Distribution::kFullRange, Distribution::kSparseZeros,
                                           Distribution::kTiny));

// FloatToBf16 (format.h): round to nearest, ties to even, NaN kept quiet (and still NaN), Inf and
// zeros kept with their sign, overflow to Inf.
TEST(Format, FloatToBf16RoundsToNearestEvenAndKeepsNaN) {
  auto from_bits = [](uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  EXPECT_EQ(FloatToBf16(from_bits(0x3F808000u)), 0x3F80);  // a tie, down to the even
  EXPECT_EQ(FloatToBf16(from_bits(0x3F818000u)), 0x3F82);  // a tie, up to the even
  EXPECT_EQ(FloatToBf16(from_bits(0x3F808001u)), 0x3F81);  // above the tie
  EXPECT_EQ(FloatToBf16(from_bits(0x3F807FFFu)), 0x3F80);  // below it
  EXPECT_EQ(FloatToBf16(from_bits(0xBF818000u)), 0xBF82);  // the sign apart, the same
  EXPECT_EQ(FloatToBf16(from_bits(0x7F7FFFFFu)), 0x7F80);  // FLT_MAX rounds up to Inf
  EXPECT_EQ(FloatToBf16(from_bits(0x7F800000u)), 0x7F80);
  EXPECT_EQ(FloatToBf16(from_bits(0xFF800000u)), 0xFF80);
  EXPECT_EQ(FloatToBf16(from_bits(0x80000000u)), 0x8000);
  EXPECT_EQ(FloatToBf16(from_bits(0x00000001u)), 0x0000);  // the least subnormal, to zero
  // A signalling NaN whose payload lies only in the low 16 bits: truncated, it would be Inf.
  EXPECT_EQ(FloatToBf16(from_bits(0x7F800001u)), 0x7FC0);
  EXPECT_EQ(FloatToBf16(from_bits(0xFF800001u)), 0xFFC0);
  EXPECT_EQ(FloatToBf16(from_bits(0x7FC00000u)), 0x7FC0);
  EXPECT_EQ(FloatToBf16(from_bits(0x7FFFFFFFu)), 0x7FFF);  // no rounding carry into the sign
  for (uint32_t u : {0x7F800001u, 0x7FBFFFFFu, 0xFFFFFFFFu}) {
    EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(from_bits(u))))) << std::hex << u;
  }
}

TEST(Format, LargeMatrixRoundTrip) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  ExpectRoundTrip(RandomMatrix(4096, 14336, Distribution::kNormal, seed), 4096, 14336);
}

TEST(Format, ZerosSignedZerosSubnormalsAndZeroRowsAndColumns) {
  const int64_t rows = 64, cols = 128;
  auto w = RandomMatrix(rows, cols, Distribution::kNormal, FreshSeed());
  for (int64_t c = 0; c < cols; ++c) w[5 * cols + c] = 0x0000;           // all-zero row
  for (int64_t c = 0; c < cols; ++c) w[6 * cols + c] = 0x8000;           // all -0.0 row
  for (int64_t r = 0; r < rows; ++r) w[r * cols + 17] = 0x0000;          // all-zero column
  w[9 * cols + 3] = 0x0001;                                              // smallest subnormal
  w[9 * cols + 4] = 0x807F;                                              // largest -subnormal
  w[9 * cols + 5] = 0x7F7F;                                              // largest finite
  w[9 * cols + 6] = 0xFF7F;                                              // most negative
  w[9 * cols + 7] = 0x0080;                                              // smallest normal
  ExpectRoundTrip(w, rows, cols);
  auto p = Pack(w.data(), rows, cols);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->stats.dense_rows, 2) << "the two zero rows are stored dense";
}

TEST(Format, WindowMaximisesCoverage) {
  // 70 % of weights in e7 60..67, the rest at e7 40: the window must start at 60.
  const int64_t rows = 16, cols = 640;
  std::vector<uint16_t> w(rows * cols);
  for (size_t i = 0; i < w.size(); ++i) {
    const int e7 = (i % 10 < 7) ? 60 + static_cast<int>(i % 8) : 40;
    w[i] = static_cast<uint16_t>((e7 << 8) | (i & 0xFF));
  }
  auto p = Pack(w.data(), rows, cols);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->base, 60);
  EXPECT_EQ(p->tl, 0x3F3E3D3Cu);
  EXPECT_EQ(p->th, 0x43424140u);
  EXPECT_NEAR(p->stats.window_coverage, 0.7, 0.01);
}

// Two windows that cover as many weights: the first, the lower base, is taken. Half the weights
// have e7 (the exponent's top 7 bits, the sign aside) 40..47, half 80..87, each e7 as often and
// either sign; no other window covers as many.
TEST(Format, ATieBetweenWindowsGoesToTheLowerBase) {
  const int64_t rows = 16, cols = 256;
  std::vector<uint16_t> w(rows * cols);
  for (size_t i = 0; i < w.size(); ++i) {
    const int e7 = (i % 2 == 0 ? 40 : 80) + static_cast<int>(i / 2 % 8);
    const uint16_t sign = (i / 16) % 2 == 0 ? 0 : 0x8000;
    w[i] = static_cast<uint16_t>(sign | e7 << 8 | ((i * 37) & 0xFF));
  }
  ExpectRoundTrip(w, rows, cols);
  auto p = Pack(w.data(), rows, cols);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->base, 40);
  EXPECT_EQ(p->stats.outside_window, rows * cols / 2);
  // With the lower half one weight short, the upper window covers more and is taken.
  w[0] = static_cast<uint16_t>(80 << 8);
  p = Pack(w.data(), rows, cols);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->base, 80);
}

// A row is stored dense when more than K/8 of its weights lie outside the window (format.h), as
// when it has more than kMaxRowEntries entries: at K = 64 the first rule is the tighter. With
// exactly K/8 it keeps its correction entries, with one more it is dense. Every other weight is
// inside the window at 60..67; the outside ones are just above it, one entry each, so that only
// the K/8 rule can make the row dense.
TEST(Format, ARowIsDenseAboveKOver8WeightsOutsideTheWindow) {
  const int64_t rows = 32, cols = 64, limit = cols / 8;
  ASSERT_LT(limit + 1, kMaxRowEntries);
  std::vector<uint16_t> w(rows * cols);
  for (size_t i = 0; i < w.size(); ++i) {
    w[i] = static_cast<uint16_t>((60 + i % 8) << 8 | ((i * 37) & 0xFF));
  }
  const int64_t sparse_row = 3, dense_row = 21;  // row blocks 0 and 1
  const uint16_t above = 68 << 8;
  for (int64_t j = 0; j < limit; ++j) w[sparse_row * cols + 7 * j + 1] = above;
  for (int64_t j = 0; j < limit + 1; ++j) w[dense_row * cols + 7 * j + 2] = above;
  ExpectRoundTrip(w, rows, cols);
  auto p = Pack(w.data(), rows, cols);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->base, 60);
  EXPECT_EQ(p->stats.outside_window, 2 * limit + 1);
  EXPECT_EQ(p->stats.dense_rows, 1);
  EXPECT_EQ(p->dense_block_offsets, (std::vector<uint32_t>{0, 0, 1}));
  EXPECT_EQ(p->dense_rows, (std::vector<uint8_t>{static_cast<uint8_t>(dense_row % 16)}));
  // The sparse row's entries, one a weight, and none for any other row.
  EXPECT_EQ(p->row_offsets[sparse_row], 0u);
  EXPECT_EQ(p->row_offsets[sparse_row + 1], static_cast<uint32_t>(limit));
  EXPECT_EQ(p->row_offsets[sparse_row + 1], p->entries.size());
  EXPECT_EQ(p->stats.sparse_entries, static_cast<int64_t>(p->entries.size()));
}

// A weight far below the window: its difference to the decoded value needs more than FP32's 24
// bits, so a second (residual) entry must carry the rest.
TEST(Format, ResidualEntry) {
  const int64_t rows = 16, cols = 64;
  std::vector<uint16_t> w(rows * cols, 0x3C00);  // 2^-7 everywhere: window starts at e7 = 60-7
  // e7 = 40 -> ~2^-46, with low bits set: decoded e7 is 53; the difference spans ~34 bits.
  w[3 * cols + 10] = static_cast<uint16_t>((40 << 8) | 0xA5);
  auto p = Pack(w.data(), rows, cols);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->stats.outside_window, 1);
  EXPECT_EQ(p->stats.residual_entries, 1);
  ASSERT_EQ(p->entries.size(), 2u);
  EXPECT_EQ(p->entries[0].col, 10);
  EXPECT_EQ(p->entries[1].col, 10);
  // decoded + c1 + c2 == original, in exact (double) arithmetic
  const uint16_t orig = w[3 * cols + 10];
  const uint16_t dec = static_cast<uint16_t>((p->base << 8) | 0xA5);
  const double sum = static_cast<double>(Bf16ToFloat(dec)) +
                     (static_cast<double>(AsFloat(p->entries[0].value_bits)) +
                      static_cast<double>(AsFloat(p->entries[1].value_bits)));
  EXPECT_EQ(sum, static_cast<double>(Bf16ToFloat(orig)));
  EXPECT_NE(static_cast<double>(AsFloat(p->entries[0].value_bits)) +
                static_cast<double>(Bf16ToFloat(dec)),
            static_cast<double>(Bf16ToFloat(orig)))
      << "one entry alone would not restore it";
  ExpectRoundTrip(w, rows, cols);
  // And a subnormal far below: the difference is wider than a double; still exact.
  w[4 * cols + 11] = 0x0003;
  w[5 * cols + 12] = 0x8001;
  ExpectRoundTrip(w, rows, cols);
}

// Every fragment decoded by the emulated prmt/lop3 decz equals the decoded weights that Unpack
// starts from (Unpack before corrections == what the kernel's streaming warps see).
TEST(Format, EmulatedDecoderMatchesLayout) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const int64_t rows = 64, cols = 512;
  auto w = RandomMatrix(rows, cols, Distribution::kStudentT3, seed);
  auto p = Pack(w.data(), rows, cols);
  ASSERT_TRUE(p.ok());
  const auto& slots = internal::GroupSlots();
  const int64_t ngroups = cols / 64;
  int64_t checked = 0;
  for (int64_t rb = 0; rb < rows / 16; ++rb) {
    for (int64_t g = 0; g < ngroups; ++g) {
      const uint8_t* grp = p->weights.data() + (rb * ngroups + g) * kGroupBytes;
      for (int lane = 0; lane < 32; ++lane) {
        uint32_t a0[4], a1[4], b[4];
        std::memcpy(a0, grp + lane * 16, 16);
        std::memcpy(a1, grp + 512 + lane * 16, 16);
        std::memcpy(b, grp + 1024 + lane * 16, 16);
        const std::array<uint32_t, 4> frag[4] = {
            internal::EmulateDecz(a0[0], a0[1], b[0], p->tl, p->th),
            internal::EmulateDecz(a0[2], a0[3], b[1], p->tl, p->th),
            internal::EmulateDecz(a1[0], a1[1], b[2], p->tl, p->th),
            internal::EmulateDecz(a1[2], a1[3], b[3], p->tl, p->th)};
        for (int f = 0; f < 4; ++f) {
          for (int i = 0; i < 8; ++i) {
            const uint16_t got = static_cast<uint16_t>(frag[f][i / 2] >> (16 * (i % 2)));
            const auto s = slots[f][lane][i];
            const uint16_t orig = w[(rb * 16 + s.row) * cols + g * 64 + s.col];
            const int e7 = (orig >> 8) & 0x7F;
            const int code = std::clamp(e7 - p->base, 0, 7);
            const uint16_t want =
                static_cast<uint16_t>((orig & 0x80FF) | ((p->base + code) << 8));
            ASSERT_EQ(got, want) << "rb " << rb << " group " << g << " f " << f << " lane "
                                 << lane << " i " << i;
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_EQ(checked, rows * cols);
}

// The group-major device order (WeightOrder::kGroupMajor) moves whole 1536-byte units: unit
// (row block b, group g) of the packed, block-major weights lands at g * rows/16 + b.
TEST(Format, GroupMajorOrderMovesWholeUnits) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  // ToGroupMajor copies with min(groups, cores, 16, bytes / 16 MiB) threads, each a contiguous
  // range of groups. The last case is 48 MiB (bytes >> 24 == 3) of 257 groups, which do not
  // divide evenly: three threads where there are three cores, two on a two-core machine; the
  // smaller cases take one.
  int64_t most_threads = 1;  // what the cases would use with cores enough
  for (const auto [rows, cols] : {std::pair<int64_t, int64_t>{16, 64}, {48, 64}, {16, 320},
                                  {80, 448}, {2048, 7168}, {2048, 257 * 64}}) {
    const int64_t blocks = rows / 16, groups = cols / 64;
    std::vector<uint8_t> w(static_cast<size_t>(blocks * groups * kGroupBytes));
    for (size_t i = 0; i < w.size(); i += 8) {
      const uint64_t r = rng();
      std::memcpy(w.data() + i, &r, std::min<size_t>(8, w.size() - i));
    }
    most_threads = std::max<int64_t>(
        most_threads, std::min<int64_t>({groups, 16, static_cast<int64_t>(w.size() >> 24)}));
    std::vector<uint8_t> gm(w.size());
    internal::ToGroupMajor(w.data(), rows, cols, gm.data());
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t g = 0; g < groups; ++g) {
        ASSERT_EQ(std::memcmp(gm.data() + (g * blocks + b) * kGroupBytes,
                              w.data() + (b * groups + g) * kGroupBytes, kGroupBytes),
                  0)
            << rows << "x" << cols << " block " << b << " group " << g;
      }
    }
  }
  EXPECT_GE(most_threads, 3) << "no case splits the copy between threads any more";
}

TEST(Format, PrmtAndLop3FollowPtx) {
  // prmt: {b, a} bytes 7..0 = 77 66 55 44 33 22 11 00 with a = 0x33221100, b = 0x77665544
  EXPECT_EQ(internal::EmulatePrmt(0x33221100u, 0x77665544u, 0x3210u), 0x33221100u);
  EXPECT_EQ(internal::EmulatePrmt(0x33221100u, 0x77665544u, 0x7654u), 0x77665544u);
  EXPECT_EQ(internal::EmulatePrmt(0x33221100u, 0x77665544u, 0x5140u), 0x55114400u);
  EXPECT_EQ(internal::EmulatePrmt(0x800000FFu, 0, 0x4448u), 0x000000FFu);  // sign replicate of 0xFF
  EXPECT_EQ(internal::EmulatePrmt(0x0000007Fu, 0, 0x8888u), 0x00000000u);
  // lop3 with 0xF8 is a | (b & c)
  EXPECT_EQ(internal::EmulateLop3(0x00F0F0F0u, 0xFF00FF00u, 0x0F0F0F0Fu, 0xF8), 0x0FF0FFF0u);
  EXPECT_EQ(internal::EmulateLop3(0xF0u, 0xCCu, 0xAAu, 0x96), 0xF0u ^ 0xCCu ^ 0xAAu);
}

// decoded weights times x plus corrections (in double) equals the double GEMV on the originals.
TEST(Format, ReferenceGemvOnPackedForm) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const int64_t rows = 64, cols = 1024, m = 3;
  auto w = RandomMatrix(rows, cols, Distribution::kTiny, seed);
  for (int64_t c = 0; c < cols; ++c) w[7 * cols + c] = 0;  // a dense (all-zero) row too
  auto x = testing::RandomActivations(m, cols, seed + 1);
  auto p = Pack(w.data(), rows, cols);
  ASSERT_TRUE(p.ok());
  ASSERT_GT(p->stats.sparse_entries, 0);
  // decoded matrix via the emulated decoder's bit layout (Unpack minus corrections)
  std::vector<uint16_t> dec(rows * cols);
  for (size_t i = 0; i < dec.size(); ++i) {
    const int e7 = (w[i] >> 8) & 0x7F;
    dec[i] = static_cast<uint16_t>((w[i] & 0x80FF) | ((p->base + std::clamp(e7 - p->base, 0, 7)) << 8));
  }
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t r = 0; r < rows; ++r) {
      double want = 0, got = 0, mag = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const double xv = Bf16ToFloat(x[t * cols + c]);
        want += static_cast<double>(Bf16ToFloat(w[r * cols + c])) * xv;
        mag += std::abs(static_cast<double>(Bf16ToFloat(w[r * cols + c])) * xv);
      }
      bool dense = false;
      for (uint32_t d = p->dense_block_offsets[r / 16]; d < p->dense_block_offsets[r / 16 + 1]; ++d) {
        if (p->dense_rows[d] == r % 16) {
          dense = true;
          for (int64_t c = 0; c < cols; ++c) {
            got += static_cast<double>(Bf16ToFloat(p->dense_values[d * cols + c])) *
                   Bf16ToFloat(x[t * cols + c]);
          }
        }
      }
      if (!dense) {
        for (int64_t c = 0; c < cols; ++c) {
          got += static_cast<double>(Bf16ToFloat(dec[r * cols + c])) * Bf16ToFloat(x[t * cols + c]);
        }
        for (uint32_t e = p->row_offsets[r]; e < p->row_offsets[r + 1]; ++e) {
          got += static_cast<double>(AsFloat(p->entries[e].value_bits)) *
                 Bf16ToFloat(x[t * cols + p->entries[e].col]);
        }
      }
      ASSERT_LE(std::abs(got - want), 1e-12 * std::max(mag, 1e-300)) << "row " << r << " token " << t;
    }
  }
}

// The exact sum of BF16 and FP32 values, as a multiple of 2^-149 (FP32's least subnormal) in
// base-2^32 digits (values below 2^128: 277 bits).
class ExactSum {
 public:
  void Add(uint32_t fp32_bits, int sign) {
    const uint32_t e = (fp32_bits >> 23) & 0xFF, m = fp32_bits & 0x7FFFFF;
    if (e == 0xFF) {
      finite_ = false;
      return;
    }
    if (fp32_bits >> 31) sign = -sign;
    const int shift = e == 0 ? 0 : static_cast<int>(e) - 1;  // value = mantissa * 2^(shift - 149)
    const uint64_t v = static_cast<uint64_t>(e == 0 ? m : (m | 0x800000u)) << (shift % 32);
    digits_[shift / 32] += sign * static_cast<int64_t>(v & 0xFFFFFFFFu);
    digits_[shift / 32 + 1] += sign * static_cast<int64_t>(v >> 32);
  }
  bool IsZero() const {
    int64_t carry = 0;
    for (int64_t d : digits_) {
      const int64_t t = d + carry, low = t & 0xFFFFFFFF;
      if (low != 0) return false;
      carry = (t - low) >> 32;
    }
    return finite_ && carry == 0;
  }

 private:
  int64_t digits_[10] = {};
  bool finite_ = true;
};

// Every finite BF16 value (65280, -0.0, subnormals and the largest included) under every window
// base (0..120): Unpack restores it bit for bit, and, as the kernel computes it, its decoded
// value plus its FP32 correction entries is the original EXACTLY, in real arithmetic: the kernel
// multiplies the decoded value and each entry by x separately, so a correction short of exact
// (a residual dropped or rounded) makes it multiply a weight that is not the matrix's, while
// Unpack, which rounds the sum to BF16, still restores it. The other weights of each matrix hold
// the window at base (e7 base and base + 7); each row takes test weights up to K/8 outside the
// window and 16 entries, so that no row is dense: every correction is an entry.
TEST(Format, EveryFiniteWeightUnderEveryWindowIsRestoredExactly) {
  const int64_t cols = 128;
  std::vector<uint16_t> finite;
  for (uint32_t b = 0; b < 0x10000; ++b) {
    if ((b & 0x7F80) != 0x7F80) finite.push_back(static_cast<uint16_t>(b));
  }
  ASSERT_EQ(finite.size(), 65280u);
  int64_t entries = 0, two_entry_weights = 0;
  for (int base = 0; base <= 120; ++base) {
    SCOPED_TRACE(::testing::Message() << "window base " << base);
    // Rows of at most 16 test weights, at most cols / 8 outside the window and 16 entries. A
    // weight outside needs one entry when its difference to the decoded value spans at most 24
    // bits, as when the two normal exponents are at most 16 apart (e7 at most 8), or when a
    // subnormal's decoded exponent is at most 15; else it is counted as two.
    std::vector<std::pair<size_t, size_t>> rows_of_tests;  // [begin, end) of `finite`
    size_t begin = 0;
    int64_t row_entries = 0;
    for (size_t i = 0; i < finite.size(); ++i) {
      const uint16_t b = finite[i];
      const int e7 = (b >> 8) & 0x7F, dec_e7 = std::clamp(e7, base, base + 7);
      const bool subnormal = (b & 0x7F80) == 0;
      const int64_t n = internal::InWindow(b, base)                                     ? 0
                        : (std::abs(e7 - dec_e7) > 8 || (subnormal && 2 * dec_e7 > 15)) ? 2
                                                                                        : 1;
      if (i - begin == 16 || row_entries + n > kMaxRowEntries) {
        rows_of_tests.emplace_back(begin, i);
        begin = i;
        row_entries = 0;
      }
      row_entries += n;
    }
    rows_of_tests.emplace_back(begin, finite.size());
    const int64_t rows = (static_cast<int64_t>(rows_of_tests.size()) + 15) / 16 * 16;
    std::vector<uint16_t> w(rows * cols);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        // e7 base or base + 7, either sign; a low byte below 0x80 (finite at e7 127)
        const int e7 = base + 7 * static_cast<int>((r + c) % 2);
        w[r * cols + c] =
            static_cast<uint16_t>((r + 3 * c) % 2 << 15 | e7 << 8 | ((5 * c + r) & 0x7F));
      }
    }
    for (size_t r = 0; r < rows_of_tests.size(); ++r) {
      for (size_t j = 0; j < rows_of_tests[r].second - rows_of_tests[r].first; ++j) {
        // spread over fragments and lanes
        w[r * cols + j * 8 + (r + j) % 8] = finite[rows_of_tests[r].first + j];
      }
    }
    PackOptions options;
    options.threads = base % 8 == 0 ? 1 : 0;
    auto p = Pack(w.data(), rows, cols, options);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_EQ(p->base, base);
    ASSERT_EQ(p->stats.dense_rows, 0);
    auto back = Unpack(*p);  // ValidatePacked first
    ASSERT_TRUE(back.ok()) << back.status();
    if (*back != w) {
      for (size_t i = 0; i < w.size(); ++i) {
        ASSERT_EQ((*back)[i], w[i])
            << "BF16 0x" << std::hex << w[i] << " restored as 0x" << (*back)[i];
      }
    }
    // The kernel's view of each corrected weight: decoded (what decz makes, as in
    // EmulatedDecoderMatchesLayout) + its entries == original.
    for (int64_t r = 0; r < rows; ++r) {
      for (uint32_t e = p->row_offsets[r]; e < p->row_offsets[r + 1];) {
        const int32_t c = p->entries[e].col;
        const uint16_t orig = w[r * cols + c];
        const uint16_t dec = static_cast<uint16_t>(
            (orig & 0x80FF) | (base + std::clamp(((orig >> 8) & 0x7F) - base, 0, 7)) << 8);
        ExactSum sum;
        sum.Add(static_cast<uint32_t>(dec) << 16, 1);
        sum.Add(static_cast<uint32_t>(orig) << 16, -1);
        int n = 0;
        for (; e < p->row_offsets[r + 1] && p->entries[e].col == c; ++e, ++n) {
          sum.Add(p->entries[e].value_bits, 1);
        }
        ASSERT_TRUE(sum.IsZero()) << "BF16 0x" << std::hex << orig << ": decoded 0x" << dec
                                  << " plus its " << n << " entries is not it exactly";
        ASSERT_LE(n, 2);
        entries += n;
        two_entry_weights += n == 2;
      }
    }
  }
  EXPECT_GT(two_entry_weights, 0);
  EXPECT_GT(entries, 121 * 60000);
}

// A row keeps its corrections as a list up to kMaxRowEntries entries; one more and it is dense
// (computed by a CTA of its own), so that no row's list holds the kernel back. Weights of one
// binade, all inside the window, so that every entry is one the test put there: outliers just
// above the window take one entry each, the smallest subnormal two.
TEST(Format, ARowWithMoreThanKMaxRowEntriesIsDense) {
  const int64_t rows = 32, cols = 4096;
  std::mt19937_64 rng(FreshSeed());
  std::vector<uint16_t> w(rows * cols);
  for (uint16_t& v : w) v = static_cast<uint16_t>((rng() & 0x807F) | (120 << 7));  // [2^-7, 2^-6)
  const auto plain = Pack(w.data(), rows, cols);
  ASSERT_TRUE(plain.ok());
  ASSERT_EQ(plain->stats.outside_window, 0);
  // 2^9, eight window values above the weights' one (60: no window holds both, and 2^9 minus
  // the window's top value fits FP32: one entry), and the smallest subnormal (two entries).
  const uint16_t kOneEntry = (60 + 8) << 8, kTwoEntries = 0x0001;
  auto set = [&](int64_t row, int64_t count, uint16_t value) {
    for (int64_t i = 0; i < count; ++i) w[row * cols + 7 + i * 200] = value;
  };
  set(1, kMaxRowEntries, kOneEntry);            // 16 entries: a list
  set(2, kMaxRowEntries + 1, kOneEntry);        // 17: dense
  set(3, kMaxRowEntries / 2, kTwoEntries);      // 16: a list
  set(4, kMaxRowEntries / 2 + 1, kTwoEntries);  // 18: dense
  set(17, 1, kOneEntry);                        // a list of one in the second row block
  const auto p = Pack(w.data(), rows, cols);
  ASSERT_TRUE(p.ok()) << p.status();
  auto entries = [&](int64_t row) { return p->row_offsets[row + 1] - p->row_offsets[row]; };
  EXPECT_EQ(entries(0), 0u);
  EXPECT_EQ(entries(1), static_cast<uint32_t>(kMaxRowEntries));
  EXPECT_EQ(entries(2), 0u);
  EXPECT_EQ(entries(3), static_cast<uint32_t>(kMaxRowEntries));
  EXPECT_EQ(entries(4), 0u);
  EXPECT_EQ(entries(17), 1u);
  EXPECT_EQ(p->stats.dense_rows, 2);
  ASSERT_EQ(p->dense_rows, (std::vector<uint8_t>{2, 4}));
  EXPECT_EQ(p->dense_block_offsets, (std::vector<uint32_t>{0, 2, 2}));
  const auto back = Unpack(*p);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, w);
}

TEST(Format, CompactExceptionsWithAZeroRow) {
  const int64_t rows = 4096, cols = 8192;
  auto w = RandomMatrix(rows, cols, Distribution::kNormal, FreshSeed());
  auto base = Pack(w.data(), rows, cols);
  ASSERT_TRUE(base.ok());
  for (int64_t c = 0; c < cols; ++c) w[1234 * cols + c] = 0;
  auto p = Pack(w.data(), rows, cols);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->stats.dense_rows, 1);
  // Every byte a kernel may read (format.h's arrays), the dense row's values included.
  const PackStats& st = p->stats;
  EXPECT_EQ(st.total_bytes, static_cast<int64_t>(p->weights.size()) + 4 * (rows + 1) +
                                8 * st.sparse_entries + 4 * (rows / 16 + 1) + st.dense_rows +
                                2 * st.dense_rows * cols);
  // The zero row costs its own K BF16 values, nothing for the other rows.
  const int64_t side = p->stats.total_bytes - static_cast<int64_t>(p->weights.size());
  const int64_t side0 = base->stats.total_bytes - static_cast<int64_t>(base->weights.size());
  EXPECT_LE(side - side0, 2 * cols + 64);
  // The seed's padded [N, capr] layout would need N * K * 8 bytes here.
  EXPECT_GE(p->stats.padded_table_bytes, rows * cols * 8);
  std::printf("[ info ] 4096x8192 N(0,1/K): side tables %lld B, with a zero row %lld B; "
              "seed's padded table would be %lld B\n",
              static_cast<long long>(side0), static_cast<long long>(side),
              static_cast<long long>(p->stats.padded_table_bytes));
}

TEST(Format, StatisticsForTheDesignDistributions) {
  const int64_t rows = 1024, cols = 8192;
  for (auto [dist, name] : {std::pair{Distribution::kNormal, "N(0,1/K)"},
                            std::pair{Distribution::kStudentT3, "Student-t(3)/sqrt(K)"}}) {
    auto w = RandomMatrix(rows, cols, dist, FreshSeed());
    auto p = Pack(w.data(), rows, cols);
    ASSERT_TRUE(p.ok());
    EXPECT_GT(p->stats.window_coverage, 0.99);
    EXPECT_LT(p->stats.bits_per_weight, 12.1);
    EXPECT_GE(p->stats.bits_per_weight, 12.0);
    std::printf("[ info ] %s: %.4f bits/weight, exception rate %.4f%%, base %d\n", name,
                p->stats.bits_per_weight, 100 * p->stats.exception_rate, p->base);
  }
}

TEST(Format, PackThroughputLargestSuiteShape) {
  const int64_t rows = 8192, cols = 28672;
  auto w = RandomMatrix(rows, cols, Distribution::kNormal, FreshSeed());
  const auto t0 = std::chrono::steady_clock::now();
  auto p = Pack(w.data(), rows, cols);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(p.ok());
  std::printf("[ info ] pack 8192x28672: %.2f s, %.2f GB/s of BF16 input, %d threads\n", s,
              2.0 * rows * cols / s / 1e9, static_cast<int>(std::thread::hardware_concurrency()));
}

TEST(Format, RefusesBadInput) {
  std::vector<uint16_t> w(16 * 64, 0x3C00);
  EXPECT_EQ(Pack(nullptr, 16, 64).status().code(), absl::StatusCode::kInvalidArgument);
  auto s = Pack(w.data(), 0, 64).status();
  EXPECT_NE(s.message().find("empty"), std::string::npos) << s;
  s = Pack(w.data(), 8, 128).status();
  EXPECT_NE(s.message().find("N % 16 != 0"), std::string::npos) << s;
  s = Pack(w.data(), 16, 32).status();
  EXPECT_NE(s.message().find("K % 64 != 0"), std::string::npos) << s;
  w[3 * 64 + 9] = 0x7F80;   // +Inf at (3, 9)
  w[5 * 64 + 1] = 0x7FC0;   // NaN later
  s = Pack(w.data(), 16, 64).status();
  EXPECT_NE(s.message().find("row 3, col 9"), std::string::npos) << s;
  EXPECT_NE(s.message().find("+Inf"), std::string::npos) << s;
  w[3 * 64 + 9] = 0x3C00;
  s = Pack(w.data(), 16, 64).status();
  EXPECT_NE(s.message().find("row 5, col 1"), std::string::npos) << s;
  EXPECT_NE(s.message().find("NaN"), std::string::npos) << s;
  EXPECT_FALSE(Unpack(PackedMatrix{}).ok());
}

// The largest shapes the format takes, 2^31 - 16 rows (one GEMV's N is below 2^31) and 2^30
// columns (format.h); one 16-row block or 64-column group more is refused, naming the limits.
TEST(Format, ShapesUpTo2To31RowsAnd2To30ColumnsArePackable) {
  const int64_t max_rows = (int64_t{1} << 31) - 16;
  EXPECT_TRUE(CheckPackableShape(16, int64_t{1} << 30).ok());
  EXPECT_TRUE(CheckPackableShape(max_rows, 64).ok());
  EXPECT_TRUE(CheckPackableShape(max_rows, int64_t{1} << 30).ok());
  // The largest packable matrix is one GEMV's shape.
  const KernelConfig one_warp{WeightFormat::kZ12, 1, 1, 1, 3, 1};
  EXPECT_TRUE(Validate(one_warp, GemvShape{1, max_rows, int64_t{1} << 30}).ok());
  EXPECT_FALSE(Validate(one_warp, GemvShape{1, int64_t{1} << 31, 64}).ok());
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{16, (int64_t{1} << 30) + 64},
                                   {int64_t{1} << 31, 64},
                                   {16, int64_t{1} << 31}}) {
    const absl::Status s = CheckPackableShape(rows, cols);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << rows << " x " << cols << ": " << s;
    EXPECT_NE(s.message().find("above 2^31 - 16 rows / 2^30 columns"), std::string::npos) << s;
  }
}

// With several packing threads each scans its own range of rows for non-finite weights; the
// error must still name the first one in row-major order, whichever thread found it and whatever
// the others found. Eight row blocks, a NaN (then an Inf in the same row) in block 2 and a -Inf in
// block 6: with 2 to 8 threads the two rows are in different threads' ranges.
TEST(Format, NamesTheFirstNonFiniteWeightWhateverTheThreads) {
  const int64_t rows = 8 * 16, cols = 128;
  std::vector<uint16_t> w = RandomMatrix(rows, cols, Distribution::kNormal, FreshSeed());
  w[40 * cols + 77] = 0xFFC1;  // NaN at (40, 77)
  w[40 * cols + 90] = 0x7F80;  // +Inf later in the same row
  w[100 * cols + 5] = 0xFF80;  // -Inf at (100, 5)
  for (int threads : {1, 2, 3, 4, 5, 8, 0}) {
    PackOptions options;
    options.threads = threads;
    absl::Status s = Pack(w.data(), rows, cols, options).status();
    ASSERT_FALSE(s.ok()) << threads << " threads";
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("(row 40, col 77) is NaN"), std::string::npos)
        << threads << " threads: " << s;
  }
  // Without the NaN the -Inf is the first.
  w[40 * cols + 77] = 0x3C00;
  w[40 * cols + 90] = 0x3C00;
  for (int threads : {1, 4, 8}) {
    PackOptions options;
    options.threads = threads;
    absl::Status s = Pack(w.data(), rows, cols, options).status();
    EXPECT_NE(s.message().find("(row 100, col 5) is -Inf"), std::string::npos)
        << threads << " threads: " << s;
  }
}

// A caller running with flush-to-zero / denormals-are-zero (torch.set_flush_denormal(True), a
// -ffast-math binary) still gets every subnormal weight back: Pack refused such matrices ("self-
// check failed") and Unpack silently turned subnormals into zeros.
TEST(Format, SubnormalsSurviveACallerInFlushToZeroMode) {
#if defined(__x86_64__) || defined(__i386__)
  std::vector<uint16_t> w = RandomMatrix(32, 128, Distribution::kNormal, FreshSeed());
  const uint16_t subnormals[] = {0x0001, 0x8001, 0x0040, 0x807F, 0x0080, 0x8080};
  for (size_t i = 0; i < std::size(subnormals); ++i) w[37 * i + 3] = subnormals[i];
  auto packed_ieee = Pack(w.data(), 32, 128);
  ASSERT_TRUE(packed_ieee.ok()) << packed_ieee.status();
  const unsigned int csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040u);  // FTZ and DAZ on
  auto packed = Pack(w.data(), 32, 128);
  auto back = packed.ok() ? Unpack(*packed) : absl::StatusOr<std::vector<uint16_t>>(packed.status());
  auto back_ieee = Unpack(*packed_ieee);
  _mm_setcsr(csr);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, w);
  ASSERT_TRUE(back_ieee.ok()) << back_ieee.status();
  EXPECT_EQ(*back_ieee, w);
#else
  GTEST_SKIP() << "x86 only (MXCSR)";
#endif
}

// So does one running in a directed rounding mode (Pack's TwoSum needs round-to-nearest).
TEST(Format, PackIsExactInEveryRoundingMode) {
  const std::vector<uint16_t> w = RandomMatrix(64, 256, Distribution::kFullRange, FreshSeed());
  for (const int mode : {FE_UPWARD, FE_DOWNWARD, FE_TOWARDZERO}) {
    ASSERT_EQ(std::fesetround(mode), 0);
    auto packed = Pack(w.data(), 64, 256);
    auto back = packed.ok() ? Unpack(*packed) : absl::StatusOr<std::vector<uint16_t>>(packed.status());
    std::fesetround(FE_TONEAREST);
    ASSERT_TRUE(back.ok()) << "rounding mode " << mode << ": " << back.status();
    EXPECT_EQ(*back, w) << "rounding mode " << mode;
  }
}

// Pack and Unpack run in IEEE arithmetic on the caller's thread too (its range of the work), and
// give the caller back its own modes for what it computes next: a directed rounding mode and,
// on x86, flush-to-zero and denormals-are-zero stay as it set them.
TEST(Format, PackAndUnpackLeaveTheCallersFloatingPointModesAsTheyWere) {
  // The test's own modes back at the end, whatever fails (on x86, fenv_t holds MXCSR too).
  struct SavedModes {
    std::fenv_t env;
    SavedModes() { std::fegetenv(&env); }
    ~SavedModes() { std::fesetenv(&env); }
  } saved;
  const std::vector<uint16_t> w = RandomMatrix(64, 256, Distribution::kFullRange, FreshSeed());
  ASSERT_EQ(std::fesetround(FE_UPWARD), 0);
#if defined(__x86_64__) || defined(__i386__)
  _mm_setcsr(_mm_getcsr() | 0x8040u);  // FTZ and DAZ on
#endif
  auto expect_callers_modes = [](const char* after) {
    EXPECT_EQ(std::fegetround(), FE_UPWARD) << "rounding mode after " << after;
#if defined(__x86_64__) || defined(__i386__)
    EXPECT_EQ(_mm_getcsr() & 0x8040u, 0x8040u) << "FTZ and DAZ after " << after;
#endif
  };
  for (const int threads : {1, 4}) {
    SCOPED_TRACE(::testing::Message() << threads << " threads");
    PackOptions options;
    options.threads = threads;
    absl::StatusOr<PackedMatrix> packed = Pack(w.data(), 64, 256, options);
    expect_callers_modes("Pack");
    ASSERT_TRUE(packed.ok()) << packed.status();
    absl::StatusOr<std::vector<uint16_t>> back = Unpack(*packed);
    expect_callers_modes("Unpack");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, w);
  }
}

// Unpack sizes its output from rows * cols: an invalid shape is an error, never a throw or a huge
// allocation.
TEST(Format, UnpackOfAnInvalidShapeIsAnError) {
  PackedMatrix negative;
  negative.rows = -16;
  negative.cols = 64;
  absl::StatusOr<std::vector<uint16_t>> u = Unpack(negative);
  EXPECT_EQ(u.status().code(), absl::StatusCode::kInvalidArgument) << u.status();
  PackedMatrix huge;  // a packable shape of 2^61 weights, with no data
  huge.rows = int64_t{1} << 31;
  huge.cols = int64_t{1} << 30;
  u = Unpack(huge);
  EXPECT_EQ(u.status().code(), absl::StatusCode::kInvalidArgument) << u.status();
  u = Unpack(PackedMatrix{});
  EXPECT_NE(u.status().message().find("empty"), std::string::npos) << u.status();
}

}  // namespace
}  // namespace gemvz
