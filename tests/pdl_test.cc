// Programmatic dependent launch (GemvOptions::pdl = Pdl::kAlways): a chain of GEMVs in which
// every link's x is the previous link's output, each kernel starting while its predecessor
// finishes. Each pass's results must be bitwise those of the same pass launched plainly (the
// library is deterministic). Consecutive passes start from different inputs and every buffer is
// poisoned before a checked pass, so a kernel that read its x, or wrote, before its predecessor
// had finished would leave the previous pass's values or the poison behind. Skips cleanly
// without a GPU, and on GPUs without PDL (before sm_90).
#include <cstdint>
#include <memory>
#include <vector>

#include "gemvz/gemv.h"
#include "gtest/gtest.h"
#include "runtime/cuda/driver.h"
#include "runtime/gemv/device_state.h"
#include "tests/support/gpu_util.h"
#include "tests/support/random_weights.h"

namespace gemvz {
namespace {

using testing::DeviceBuffer;
using testing::Distribution;
using testing::FreshSeed;

using testing::kPoison;
constexpr int64_t kM = 16;

// x_src [m, 1024] -> P (plain BF16, 4096 x 1024) -> x [m, 4096] -> A (12-bit, 8192 x 4096, one
// all-zero row: its own CTA reads x too) -> y1 -> B (plain BF16, 2048 x 8192) -> y2 -> C (12-bit,
// 1024 x 2048, split-K 4: workspace and semaphores; 3 warps share each slice's 4 trips unevenly,
// so their PDL prefetches start at uneven offsets) -> y3.
struct Chain {
  std::vector<uint16_t> wa, x_src[2];
  DeviceMatrix p, a, b, c;
  DeviceBuffer src0{kM * 1024 * 2}, src1{kM * 1024 * 2};
  DeviceBuffer x{kM * 4096 * 2}, y1{kM * 8192 * 2}, y2{kM * 2048 * 2}, y3{kM * 1024 * 2};

  explicit Chain(uint64_t seed) {
    const auto wp = testing::RandomMatrix(4096, 1024, Distribution::kNormal, seed);
    wa = testing::RandomMatrix(8192, 4096, Distribution::kNormal, seed + 1);
    for (int64_t col = 0; col < 4096; ++col) wa[100 * 4096 + col] = 0;  // a dense row
    const auto wb = testing::RandomMatrix(2048, 8192, Distribution::kNormal, seed + 2);
    const auto wc = testing::RandomMatrix(1024, 2048, Distribution::kStudentT3, seed + 3);
    auto dp = DeviceMatrix::UploadPlain(wp.data(), 4096, 1024);
    auto da = DeviceMatrix::FromBf16(wa.data(), 8192, 4096);
    auto db = DeviceMatrix::UploadPlain(wb.data(), 2048, 8192);
    auto dc = DeviceMatrix::FromBf16(wc.data(), 1024, 2048);
    EXPECT_TRUE(dp.ok() && da.ok() && db.ok() && dc.ok());
    if (dp.ok()) p = *dp;
    if (da.ok()) a = *da;
    if (db.ok()) b = *db;
    if (dc.ok()) c = *dc;
    for (int i = 0; i < 2; ++i) {
      x_src[i] = testing::RandomActivations(kM, 1024, seed + 4 + i);
      (i == 0 ? src0 : src1).Upload(x_src[i].data(), x_src[i].size() * 2);
    }
  }
  bool valid() const { return p.valid() && a.valid() && b.valid() && c.valid(); }

  // cuMemsetD16 runs on the legacy stream and may return early; the test's stream does not
  // wait for it, so the poison is finished here before anything else is enqueued.
  void Poison() {
    for (DeviceBuffer* buf : {&x, &y1, &y2, &y3}) buf->Fill16(kPoison);
    testing::Synchronize();
  }

  // Enqueues passes first, first + 1, ... (pass i starts from x_src[i % 2]) on `stream`.
  absl::Status Enqueue(CUstream stream, Pdl pdl, int first, int passes) {
    GemvOptions o, oa, oc;
    o.pdl = oa.pdl = oc.pdl = pdl;
    // A: two row blocks per CTA (RB 2, whose PDL prefetch covers both); C: split-K, uneven shares.
    oa.config = KernelConfig{WeightFormat::kZ12, 4, 1, 2, 3, 1, 2};
    oc.config = KernelConfig{WeightFormat::kZ12, 3, 2, 2, 3, 4};
    for (int i = first; i < first + passes; ++i) {
      const DeviceBuffer& src = i % 2 == 0 ? src0 : src1;
      absl::Status st = Gemv(p, src.as<uint16_t>(), kM, x.as<uint16_t>(), stream, o);
      if (st.ok()) st = Gemv(a, x.as<uint16_t>(), kM, y1.as<uint16_t>(), stream, oa);
      if (st.ok()) st = Gemv(b, y1.as<uint16_t>(), kM, y2.as<uint16_t>(), stream, o);
      if (st.ok()) st = Gemv(c, y2.as<uint16_t>(), kM, y3.as<uint16_t>(), stream, oc);
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  }

  // x, y1, y2, y3 one after another.
  std::vector<uint16_t> Outputs() const {
    std::vector<uint16_t> all(kM * (4096 + 8192 + 2048 + 1024));
    uint16_t* at = all.data();
    for (const DeviceBuffer* buf : {&x, &y1, &y2, &y3}) {
      buf->Download(at, buf->bytes());
      at += buf->bytes() / 2;
    }
    return all;
  }
};

// Each test: a fresh chain, a stream, and each input's outputs from plain launches (link A
// checked against the double reference) to compare the PDL passes with.
class PdlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    GEMVZ_REQUIRE_GPU();
    auto info = internal::GetDeviceInfo(0);
    ASSERT_TRUE(info.ok()) << info.status();
    if (info->limits.cc_major < 9) {
      GTEST_SKIP() << "programmatic dependent launch needs sm_90 or later; device 0 is sm_"
                   << info->limits.cc_major << info->limits.cc_minor;
    }
    if ((*internal::Driver())->cuLaunchKernelEx == nullptr) {
      GTEST_SKIP() << "the driver lacks cuLaunchKernelEx (a CUDA 12 driver is needed for PDL)";
    }
    seed_ = FreshSeed();
    chain_ = std::make_unique<Chain>(seed_);
    ASSERT_TRUE(chain_->valid());
    stream_ = std::make_unique<testing::TestStream>();
    ASSERT_TRUE(stream_->ok());
    for (int i = 0; i < 2; ++i) {
      chain_->Poison();
      ASSERT_TRUE(chain_->Enqueue(*stream_, Pdl::kOff, i, 1).ok());  // also sizes the workspace
      ASSERT_EQ(api().cuStreamSynchronize(*stream_), CUDA_SUCCESS);
      plain_[i] = chain_->Outputs();
      std::vector<uint16_t> x(plain_[i].begin(), plain_[i].begin() + kM * 4096);
      std::vector<uint16_t> y1(plain_[i].begin() + kM * 4096, plain_[i].begin() + kM * 12288);
      std::vector<double> ref, abs_sum;
      testing::ReferenceGemv(chain_->wa, x, kM, 8192, 4096, &ref, &abs_sum);
      ASSERT_EQ(testing::CompareToReference(y1, ref, abs_sum, kM, 8192), "") << "seed " << seed_;
    }
    ASSERT_NE(plain_[0], plain_[1]);  // the two inputs must tell the passes apart
  }
  void TearDown() override { stream_.reset(); }  // its workspace released, then destroyed
  static const internal::DriverApi& api() { return **internal::Driver(); }

  uint64_t seed_ = 0;
  std::unique_ptr<Chain> chain_;
  std::unique_ptr<testing::TestStream> stream_;
  std::vector<uint16_t> plain_[2];
};

TEST_F(PdlTest, EveryPassMatchesPlainLaunchesBitForBit) {
  // One pass at a time, each on poisoned buffers: every link inside a pass is checked.
  for (int pass = 0; pass < 6; ++pass) {
    chain_->Poison();
    ASSERT_TRUE(chain_->Enqueue(*stream_, Pdl::kAlways, pass, 1).ok());
    ASSERT_EQ(api().cuStreamSynchronize(*stream_), CUDA_SUCCESS);
    EXPECT_TRUE(chain_->Outputs() == plain_[pass % 2]) << "pass " << pass << ", seed " << seed_;
  }
  // Passes back to back, so each pass's first link also follows the previous pass's last: the
  // last pass must come out as its input says, not as the one before.
  for (int passes : {7, 8}) {
    chain_->Poison();
    ASSERT_TRUE(chain_->Enqueue(*stream_, Pdl::kAlways, 0, passes).ok());
    ASSERT_EQ(api().cuStreamSynchronize(*stream_), CUDA_SUCCESS);
    EXPECT_TRUE(chain_->Outputs() == plain_[(passes - 1) % 2])
        << passes << " passes, seed " << seed_;
  }
}

TEST_F(PdlTest, CapturedPassesReplayBitForBit) {
  CUgraph graph;
  CUgraphExec exec;
  ASSERT_EQ(api().cuStreamBeginCapture(*stream_, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
  const absl::Status st = chain_->Enqueue(*stream_, Pdl::kAlways, 0, 2);  // inputs 0, then 1
  ASSERT_EQ(api().cuStreamEndCapture(*stream_, &graph), CUDA_SUCCESS);
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_EQ(api().cuGraphInstantiate(&exec, graph, 0), CUDA_SUCCESS);
  for (int replay = 0; replay < 5; ++replay) {
    chain_->Poison();
    ASSERT_EQ(api().cuGraphLaunch(exec, *stream_), CUDA_SUCCESS);
    ASSERT_EQ(api().cuStreamSynchronize(*stream_), CUDA_SUCCESS);
    EXPECT_TRUE(chain_->Outputs() == plain_[1]) << "replay " << replay << ", seed " << seed_;
  }
  api().cuGraphExecDestroy(exec);
  api().cuGraphDestroy(graph);
}

}  // namespace
}  // namespace gemvz
