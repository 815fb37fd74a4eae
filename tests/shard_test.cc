// Tensor-parallel sharding: every shard restores exactly its slice of the original weights, column
// shards' partial GEMVs add up to the whole, and (with GPUs) shards run per device.
#include "gemvz/shard.h"

#include <cmath>
#include <thread>

#include "gemvz/gemv.h"
#include "gtest/gtest.h"
#include "runtime/cuda/driver.h"
#include "tests/support/gpu_util.h"
#include "tests/support/random_weights.h"

namespace gemvz {
namespace {

using testing::Distribution;

std::vector<uint16_t> Weights(int64_t n, int64_t k, uint64_t seed) {
  auto w = testing::RandomMatrix(n, k, Distribution::kTiny, seed);
  for (int64_t c = 0; c < k; ++c) w[21 * k + c] = 0;  // a dense row
  return w;
}

TEST(Shard, RowShardsRestoreTheirSlices) {
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const int64_t n = 160, k = 512;
  auto w = Weights(n, k, seed);
  auto p = Pack(w.data(), n, k);
  ASSERT_TRUE(p.ok());
  for (int parts : {1, 2, 3, 10}) {
    auto shards = SplitRows(*p, parts);
    ASSERT_TRUE(shards.ok()) << shards.status();
    int64_t row = 0, entries = 0;
    for (const PackedMatrix& s : *shards) {
      ASSERT_TRUE(ValidatePacked(s).ok());
      auto back = Unpack(s);
      ASSERT_TRUE(back.ok());
      ASSERT_TRUE(std::equal(back->begin(), back->end(), w.begin() + row * k)) << "parts " << parts;
      row += s.rows;
      entries += s.stats.sparse_entries;
    }
    EXPECT_EQ(row, n);
    EXPECT_EQ(entries, p->stats.sparse_entries) << "every correction goes with its shard";
  }
}

// A shard counts its statistics from its own tables; one shard of the whole matrix must report
// what Pack did, field by field, also for a dense row holding a weight far below the window,
// which takes two correction entries (its padded table row counts both).
TEST(Shard, AWholeShardReportsThePackersStatistics) {
  const int64_t n = 16, k = 64;
  std::vector<uint16_t> w(n * k, 0x3C00);          // 1.0
  for (int c = 0; c < 9; ++c) w[c] = 0;            // 9 > k/8 outside: row 0 is dense
  w[9] = static_cast<uint16_t>((20 << 8) | 0xA5);  // and one needing two entries
  w[3 * k + 5] = w[9];                             // a sparse row's too
  auto p = Pack(w.data(), n, k);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->stats.dense_rows, 1);
  ASSERT_EQ(p->stats.residual_entries, 1);
  auto rows = ShardRows(*p, 0, n);
  auto cols = ShardCols(*p, 0, k);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_TRUE(cols.ok()) << cols.status();
  for (const PackStats& s : {rows->stats, cols->stats}) {
    EXPECT_EQ(s.weights, p->stats.weights);
    EXPECT_EQ(s.outside_window, p->stats.outside_window);
    EXPECT_EQ(s.sparse_entries, p->stats.sparse_entries);
    EXPECT_EQ(s.residual_entries, p->stats.residual_entries);
    EXPECT_EQ(s.dense_rows, p->stats.dense_rows);
    EXPECT_EQ(s.total_bytes, p->stats.total_bytes);
    EXPECT_EQ(s.bits_per_weight, p->stats.bits_per_weight);
    EXPECT_EQ(s.exception_rate, p->stats.exception_rate);
    EXPECT_EQ(s.window_coverage, p->stats.window_coverage);
    EXPECT_EQ(s.padded_table_bytes, p->stats.padded_table_bytes);
  }
}

TEST(Shard, ColumnShardsRestoreTheirSlicesAndSumToTheWhole) {
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const int64_t n = 64, k = 1024, m = 2;
  auto w = Weights(n, k, seed);
  auto x = testing::RandomActivations(m, k, seed + 1);
  auto p = Pack(w.data(), n, k);
  ASSERT_TRUE(p.ok());
  for (int parts : {2, 3, 16}) {
    auto shards = SplitCols(*p, parts);
    ASSERT_TRUE(shards.ok()) << shards.status();
    std::vector<double> sum(m * n, 0.0);
    int64_t col = 0, outside = 0;
    for (const PackedMatrix& s : *shards) {
      ASSERT_TRUE(ValidatePacked(s).ok());
      auto back = Unpack(s);
      ASSERT_TRUE(back.ok());
      for (int64_t r = 0; r < n; ++r)
        for (int64_t c = 0; c < s.cols; ++c)
          ASSERT_EQ((*back)[r * s.cols + c], w[r * k + col + c]) << "row " << r << " col " << col + c;
      for (int64_t t = 0; t < m; ++t)
        for (int64_t r = 0; r < n; ++r)
          for (int64_t c = 0; c < s.cols; ++c)
            sum[t * n + r] += static_cast<double>(Bf16ToFloat((*back)[r * s.cols + c])) *
                              Bf16ToFloat(x[t * k + col + c]);
      col += s.cols;
      outside += s.stats.outside_window;
    }
    EXPECT_EQ(col, k);
    EXPECT_EQ(outside, p->stats.outside_window);
    std::vector<double> ref, abs_sum;
    testing::ReferenceGemv(w, x, m, n, k, &ref, &abs_sum);
    for (int64_t i = 0; i < m * n; ++i) EXPECT_NEAR(sum[i], ref[i], 1e-12 * (abs_sum[i] + 1e-300));
  }
}

TEST(Shard, RefusesMisalignedRanges) {
  const int64_t n = 32, k = 128;
  auto w = Weights(n, k, 1);
  auto p = Pack(w.data(), n, k);
  ASSERT_TRUE(p.ok());
  EXPECT_NE(ShardRows(*p, 8, 32).status().message().find("16-row blocks"), std::string::npos);
  EXPECT_NE(ShardRows(*p, 0, 48).status().message().find("16-row blocks"), std::string::npos);
  EXPECT_NE(ShardCols(*p, 0, 96).status().message().find("64-wide groups"), std::string::npos);
  EXPECT_NE(ShardCols(*p, 64, 64).status().message().find("non-empty"), std::string::npos);
  EXPECT_FALSE(SplitRows(*p, 3).ok());
  EXPECT_FALSE(SplitCols(*p, 0).ok());
}

TEST(Shard, SplitRangesDealsWholeUnitsAndRefusesBadArguments) {
  using Ranges = std::vector<std::pair<int64_t, int64_t>>;
  auto r = SplitRanges(112, 16, 3);  // 7 units: 3, 2, 2
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, (Ranges{{0, 48}, {48, 80}, {80, 112}}));
  r = SplitRanges(64, 16, 4);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, (Ranges{{0, 16}, {16, 32}, {32, 48}, {48, 64}}));
  // Each refusal names its reason; none divides by zero or drops a remainder.
  EXPECT_NE(SplitRanges(64, 0, 2).status().message().find("unit 0 < 1"), std::string::npos);
  EXPECT_NE(SplitRanges(64, 16, 0).status().message().find("parts 0 < 1"), std::string::npos);
  EXPECT_NE(SplitRanges(100, 16, 2).status().message().find("not a whole number"),
            std::string::npos);
  EXPECT_NE(SplitRanges(-16, 16, 1).status().message().find("not a whole number"),
            std::string::npos);
  EXPECT_NE(SplitRanges(64, 16, 8).status().message().find("cannot split 4 units"),
            std::string::npos);
  EXPECT_EQ(SplitRanges(64, 16, 8).status().code(), absl::StatusCode::kInvalidArgument);
}

// Runs the shards of one matrix on `devices` GPUs (round robin, one thread per shard) and checks
// the assembled output against the reference: output-parallel concatenates, input-parallel sums
// FP32 partials (what an all-reduce does).
void RunShards(int devices) {
  const uint64_t seed = testing::FreshSeed();
  const int64_t n = 1024, k = 8192, m = 8;
  auto w = Weights(n, k, seed);
  auto x = testing::RandomActivations(m, k, seed + 1);
  auto p = Pack(w.data(), n, k);
  ASSERT_TRUE(p.ok());
  std::vector<double> ref, abs_sum;
  testing::ReferenceGemv(w, x, m, n, k, &ref, &abs_sum);
  const auto& api = **internal::Driver();
  for (bool by_rows : {true, false}) {
    auto shards = by_rows ? SplitRows(*p, 2) : SplitCols(*p, 2);
    ASSERT_TRUE(shards.ok());
    std::vector<std::vector<float>> partial(2);
    std::vector<absl::Status> status(2);
    std::vector<std::thread> threads;
    for (int i = 0; i < 2; ++i) {
      threads.emplace_back([&, i] {
        const int dev = i % devices;
        const PackedMatrix& s = (*shards)[i];
        auto dm = DeviceMatrix::Upload(s, dev);
        if (!dm.ok()) { status[i] = dm.status(); return; }
        auto ctx = internal::PrimaryContext(dev);
        api.cuCtxSetCurrent(*ctx);
        // x slice for input-parallel shards: columns [i*k/2, (i+1)*k/2)
        std::vector<uint16_t> xs(m * s.cols);
        const int64_t c0 = by_rows ? 0 : (i == 0 ? 0 : (*shards)[0].cols);
        for (int64_t t = 0; t < m; ++t)
          std::copy(x.begin() + t * k + c0, x.begin() + t * k + c0 + s.cols, xs.begin() + t * s.cols);
        CUdeviceptr dx, dout;
        api.cuMemAlloc(&dx, xs.size() * 2);
        api.cuMemAlloc(&dout, m * s.rows * 4);
        api.cuMemcpyHtoD(dx, xs.data(), xs.size() * 2);
        status[i] = GemvFp32(*dm, reinterpret_cast<uint16_t*>(dx), m, reinterpret_cast<float*>(dout),
                             nullptr);
        partial[i].resize(m * s.rows);
        api.cuCtxSynchronize();
        api.cuMemcpyDtoH(partial[i].data(), dout, partial[i].size() * 4);
        api.cuMemFree(dx);
        api.cuMemFree(dout);
      });
    }
    for (auto& t : threads) t.join();
    ASSERT_TRUE(status[0].ok()) << status[0];
    ASSERT_TRUE(status[1].ok()) << status[1];
    for (int64_t t = 0; t < m; ++t) {
      for (int64_t r = 0; r < n; ++r) {
        double got;
        if (by_rows) {
          const int64_t half = (*shards)[0].rows;
          got = r < half ? partial[0][t * half + r] : partial[1][t * (n - half) + r - half];
        } else {
          got = static_cast<double>(partial[0][t * n + r]) + partial[1][t * n + r];
        }
        const double tol = std::ldexp(std::abs(ref[t * n + r]), -12) + std::ldexp(abs_sum[t * n + r], -16);
        ASSERT_LE(std::abs(got - ref[t * n + r]), tol)
            << (by_rows ? "rows" : "cols") << " token " << t << " row " << r;
      }
    }
  }
}

TEST(Shard, ShardsOnOneGpu) {
  GEMVZ_REQUIRE_GPU();
  RunShards(1);
}

TEST(Shard, ShardsOnTwoGpus) {
  GEMVZ_REQUIRE_GPUS(2);
  RunShards(2);
}

}  // namespace
}  // namespace gemvz
