// Programmatic dependent launch (GemvOptions::pdl): a chain of GEMVs in which each one's x is the
// previous one's output, launched with PDL so that each kernel starts while its predecessor
// finishes. The results must be bitwise those of the same chain launched plainly (the library is
// deterministic), so a kernel that read its x, or wrote its output, before its predecessor had
// finished would show up as different bits (or as the poison left in the buffers). Skips cleanly
// without a GPU.
#include <cstdint>
#include <memory>
#include <vector>

#include "gemvz/gemv.h"
#include "gtest/gtest.h"
#include "runtime/cuda/driver.h"
#include "tests/support/gpu_util.h"
#include "tests/support/random_weights.h"

namespace gemvz {
namespace {

using testing::DeviceBuffer;
using testing::Distribution;
using testing::FreshSeed;

constexpr uint16_t kPoison = 0x7FC1;  // a NaN

// x0 [m, 4096] -> A (12-bit, 8192 x 4096, one all-zero row: long) -> y1 -> B (plain BF16, 2048 x 8192: short)
// -> y2 -> C (12-bit, 1024 x 2048, split-K 4: workspace and semaphores) -> y3.
struct Chain {
  static constexpr int64_t kM = 16;
  std::vector<uint16_t> wa, wb, wc, x0;
  DeviceMatrix a, b, c;
  DeviceBuffer dx{kM * 4096 * 2}, y1{kM * 8192 * 2}, y2{kM * 2048 * 2}, y3{kM * 1024 * 2};

  explicit Chain(uint64_t seed) {
    wa = testing::RandomMatrix(8192, 4096, Distribution::kNormal, seed);
    for (int64_t col = 0; col < 4096; ++col) wa[100 * 4096 + col] = 0;  // a dense row: its own CTA
    wb = testing::RandomMatrix(2048, 8192, Distribution::kNormal, seed + 1);
    wc = testing::RandomMatrix(1024, 2048, Distribution::kStudentT3, seed + 2);
    x0 = testing::RandomActivations(kM, 4096, seed + 3);
    auto da = DeviceMatrix::FromBf16(wa.data(), 8192, 4096);
    auto db = DeviceMatrix::UploadPlain(wb.data(), 2048, 8192);
    auto dc = DeviceMatrix::FromBf16(wc.data(), 1024, 2048);
    EXPECT_TRUE(da.ok() && db.ok() && dc.ok());
    if (da.ok()) a = *da;
    if (db.ok()) b = *db;
    if (dc.ok()) c = *dc;
    dx.Upload(x0.data(), x0.size() * 2);
  }

  void Poison() {
    y1.Fill16(kPoison);
    y2.Fill16(kPoison);
    y3.Fill16(kPoison);
  }

  // Enqueues the chain `times` times on `stream`.
  // pdl: every link with Pdl::kAlways (kAuto would leave the small grids plain).
  absl::Status Enqueue(CUstream stream, bool pdl, int times) {
    GemvOptions oa, ob, oc;
    oa.pdl = ob.pdl = oc.pdl = pdl ? Pdl::kAlways : Pdl::kOff;
    oc.config = KernelConfig{WeightFormat::kZ12, 4, 2, 2, 3, 4};
    for (int i = 0; i < times; ++i) {
      absl::Status st = Gemv(a, dx.as<uint16_t>(), kM, y1.as<uint16_t>(), stream, oa);
      if (st.ok()) st = Gemv(b, y1.as<uint16_t>(), kM, y2.as<uint16_t>(), stream, ob);
      if (st.ok()) st = Gemv(c, y2.as<uint16_t>(), kM, y3.as<uint16_t>(), stream, oc);
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  }

  std::vector<uint16_t> Outputs() const {
    std::vector<uint16_t> all(kM * (8192 + 2048 + 1024));
    y1.Download(all.data(), kM * 8192 * 2);
    y2.Download(all.data() + kM * 8192, kM * 2048 * 2);
    y3.Download(all.data() + kM * (8192 + 2048), kM * 1024 * 2);
    return all;
  }
};

// Each test: a fresh chain, a stream, and the chain's outputs from plain launches (checked
// against the double reference on its first link) to compare the PDL runs with.
class PdlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    GEMVZ_REQUIRE_GPU();
    seed_ = FreshSeed();
    chain_ = std::make_unique<Chain>(seed_);
    ASSERT_TRUE(chain_->a.valid() && chain_->b.valid() && chain_->c.valid());
    ASSERT_EQ(api().cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    chain_->Poison();
    ASSERT_TRUE(chain_->Enqueue(stream_, /*pdl=*/false, 1).ok());  // also sizes the workspace
    ASSERT_EQ(api().cuStreamSynchronize(stream_), CUDA_SUCCESS);
    plain_ = chain_->Outputs();
    std::vector<uint16_t> y1(plain_.begin(), plain_.begin() + Chain::kM * 8192);
    std::vector<double> ref, abs_sum;
    testing::ReferenceGemv(chain_->wa, chain_->x0, Chain::kM, 8192, 4096, &ref, &abs_sum);
    ASSERT_EQ(testing::CompareToReference(y1, ref, abs_sum, Chain::kM, 8192), "")
        << "seed " << seed_;
  }
  void TearDown() override {
    if (stream_ != nullptr) api().cuStreamDestroy(stream_);
  }
  static const internal::DriverApi& api() { return **internal::Driver(); }

  uint64_t seed_ = 0;
  std::unique_ptr<Chain> chain_;
  CUstream stream_ = nullptr;
  std::vector<uint16_t> plain_;
};

TEST_F(PdlTest, ChainMatchesPlainLaunchesBitForBit) {
  for (int round = 0; round < 5; ++round) {
    chain_->Poison();
    ASSERT_TRUE(chain_->Enqueue(stream_, /*pdl=*/true, 10).ok());
    ASSERT_EQ(api().cuStreamSynchronize(stream_), CUDA_SUCCESS);
    EXPECT_TRUE(chain_->Outputs() == plain_) << "round " << round << ", seed " << seed_;
  }
}

TEST_F(PdlTest, CapturedChainReplaysBitForBit) {
  CUgraph graph;
  CUgraphExec exec;
  ASSERT_EQ(api().cuStreamBeginCapture(stream_, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
  const absl::Status st = chain_->Enqueue(stream_, /*pdl=*/true, 4);
  ASSERT_EQ(api().cuStreamEndCapture(stream_, &graph), CUDA_SUCCESS);
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_EQ(api().cuGraphInstantiate(&exec, graph, 0), CUDA_SUCCESS);
  for (int replay = 0; replay < 5; ++replay) {
    chain_->Poison();
    testing::Synchronize();
    ASSERT_EQ(api().cuGraphLaunch(exec, stream_), CUDA_SUCCESS);
    ASSERT_EQ(api().cuStreamSynchronize(stream_), CUDA_SUCCESS);
    EXPECT_TRUE(chain_->Outputs() == plain_) << "replay " << replay << ", seed " << seed_;
  }
  api().cuGraphExecDestroy(exec);
  api().cuGraphDestroy(graph);
}

}  // namespace
}  // namespace gemvz
