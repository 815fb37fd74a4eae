// The GPU machinery under `gemvz bench`, `demo` and `tune` (tools/gemvz/bench_gpu.h), in process:
// that a timed graph's time is per launch, that the timed launches take every rotated copy in
// turn in whole rotations, that a path's output is poisoned before it runs (a path that writes
// nothing fails its check rather than passing with the last path's output), that copies of one
// matrix which give different bits are reported, and that a session frees its stream's Gemv
// workspace when it closes. Each needs a GPU and skips without one.
#include "tools/gemvz/bench_gpu.h"

#include <cuda.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "gemvz/gemv.h"
#include "gtest/gtest.h"
#include "runtime/cuda/driver.h"
#include "runtime/gemv/autotune.h"
#include "tests/support/gpu_util.h"
#include "tools/gemvz/bench_support.h"

namespace gemvz::cli {
namespace {

struct Opened {
  std::unique_ptr<GpuSession> session;
  std::unique_ptr<ShapeWorkload> work;
  const std::vector<DeviceMatrix>* plain = nullptr;  // the workload's plain BF16 copies
  // The workload's x and output, typed for Gemv.
  const uint16_t* x() const { return reinterpret_cast<const uint16_t*>(work->x()); }
  uint16_t* out() const { return reinterpret_cast<uint16_t*>(work->out()); }
  // RunAndCheck of one Gemv on `matrix` with the workload's x (m rows) into its output.
  absl::StatusOr<ErrorCheck> RunGemv(const DeviceMatrix& matrix, int64_t m,
                                     std::vector<uint16_t>* result) const {
    return work->RunAndCheck(
        m, [&] { return Gemv(matrix, x(), m, out(), work->stream()); }, result);
  }
};

// A session on GPU 0 and the workload of one shape (weights N(0, 1/K), x, the reference), with
// its plain copies uploaded; `plain` stays null (the failure recorded) if any step fails.
Opened OpenWorkload(int64_t n, int64_t k, int64_t max_m, int64_t rotate_bytes) {
  Opened o;
  absl::StatusOr<std::unique_ptr<GpuSession>> session = GpuSession::Open(0);
  EXPECT_TRUE(session.ok()) << session.status();
  if (!session.ok()) return o;
  o.session = std::move(*session);
  WorkloadOptions options;
  options.rotate_bytes = rotate_bytes;
  options.seed = 20261201;
  absl::StatusOr<std::unique_ptr<ShapeWorkload>> work =
      ShapeWorkload::Create(o.session.get(), MatrixShape{"", n, k}, max_m, options);
  EXPECT_TRUE(work.ok()) << work.status();
  if (!work.ok()) return o;
  o.work = std::move(*work);
  absl::StatusOr<const std::vector<DeviceMatrix>*> plain = o.work->Plain();
  EXPECT_TRUE(plain.ok()) << plain.status();
  if (plain.ok()) o.plain = *plain;
  return o;
}

// MedianMicros is the time of one launch: each replay's time divided by that graph's own
// launches. The same memset (256 MiB, about 0.1 ms: launch overheads are noise) captured once,
// 8 times and 3 times must come out at about the same time per launch; a division by another
// graph's count, or none, is off by 3x or 8x.
TEST(BenchGpu, MedianMicrosIsTheTimeOfOneLaunchOfEachGraph) {
  GEMVZ_REQUIRE_GPU();
  absl::StatusOr<std::unique_ptr<GpuSession>> session = GpuSession::Open(0);
  ASSERT_TRUE(session.ok()) << session.status();
  CUstream stream = (*session)->stream();
  constexpr size_t kBytes = size_t{256} << 20;
  absl::StatusOr<DeviceBuffer> buffer = DeviceBuffer::Allocate(kBytes);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  const CUdeviceptr ptr = buffer->ptr();
  auto fill = [&](int launch) -> absl::Status {
    CU_RETURN_IF_ERROR(cuMemsetD8Async(ptr, static_cast<unsigned char>(launch), kBytes, stream));
    return absl::OkStatus();
  };
  GraphTimer timer(stream);
  const int launches[] = {1, 8, 3};
  for (const int l : launches) {
    absl::StatusOr<int> graph = timer.Capture(l, fill);
    ASSERT_TRUE(graph.ok()) << graph.status();
  }
  TimingOptions timing;
  timing.replays = 7;
  timing.warmup_replays = 1;
  absl::StatusOr<std::vector<double>> us = timer.MedianMicros(timing);
  ASSERT_TRUE(us.ok()) << us.status();
  ASSERT_EQ(us->size(), 3u);
  for (size_t g = 0; g < us->size(); ++g) {
    EXPECT_GT((*us)[g], 0) << "graph " << g;
    const double ratio = (*us)[g] / (*us)[0];
    EXPECT_GT(ratio, 0.5) << "graph " << g << " of " << launches[g] << " launches: " << (*us)[g]
                          << " us per launch against " << (*us)[0] << " for one launch";
    EXPECT_LT(ratio, 2.0) << "graph " << g << " of " << launches[g] << " launches: " << (*us)[g]
                          << " us per launch against " << (*us)[0] << " for one launch";
  }
  EXPECT_TRUE((*session)->Synchronize().ok());
}

// The timed launches take copy 0, 1, ..., copies - 1, 0, 1, ... in whole rotations: at least
// min_launches and the fewest whole rotations that reach it (so each launch reads a copy the
// previous copies - 1 launches did not touch, out of L2), one rotation when a rotation is
// already longer than min_launches.
TEST(BenchGpu, CaptureRotatedTakesEveryCopyInTurnInWholeRotations) {
  GEMVZ_REQUIRE_GPU();
  Opened o = OpenWorkload(64, 64, 1, int64_t{1} << 20);
  ASSERT_NE(o.work, nullptr);
  ShapeWorkload& work = *o.work;
  struct Case {
    int copies, min_launches, launches;
  };
  for (const Case& c : {Case{3, 8, 9}, Case{4, 8, 8}, Case{5, 1, 5}, Case{7, 16, 21},
                        Case{1, 3, 3}}) {
    GraphTimer timer(work.stream());
    TimingOptions timing;
    timing.min_launches = c.min_launches;
    std::vector<int> seen;
    auto call = [&](int copy) -> absl::Status {
      seen.push_back(copy);
      CU_RETURN_IF_ERROR(cuMemsetD8Async(work.out(), 0, 2, work.stream()));
      return absl::OkStatus();
    };
    int launches = 0;
    absl::StatusOr<int> graph = work.CaptureRotated(&timer, c.copies, timing, call, &launches);
    ASSERT_TRUE(graph.ok()) << graph.status();
    EXPECT_EQ(launches, c.launches) << c.copies << " copies, at least " << c.min_launches;
    ASSERT_EQ(static_cast<int>(seen.size()), launches) << c.copies << " copies";
    for (int i = 0; i < launches; ++i) {
      EXPECT_EQ(seen[i], i % c.copies) << "launch " << i << " of " << launches << " over "
                                       << c.copies << " copies";
    }
    timing.replays = 1;
    timing.warmup_replays = 0;
    EXPECT_TRUE(timer.MedianMicros(timing).ok());  // the graph runs
  }
}

// RunAndCheck poisons the output before each path: a path that writes nothing fails its check
// (every element NaN) even right after a path that wrote the right answer into the same buffer.
TEST(BenchGpu, RunAndCheckFailsAPathThatWritesNothing) {
  GEMVZ_REQUIRE_GPU();
  constexpr int64_t kN = 1024, kK = 2048, kM = 4;
  Opened o = OpenWorkload(kN, kK, kM, int64_t{8} << 20);
  ASSERT_NE(o.plain, nullptr);
  ShapeWorkload& work = *o.work;
  std::vector<uint16_t> right, nothing;
  absl::StatusOr<ErrorCheck> check = o.RunGemv((*o.plain)[0], kM, &right);
  ASSERT_TRUE(check.ok()) << check.status();
  ASSERT_TRUE(check->ok()) << check->ToString();
  check = work.RunAndCheck(kM, [] { return absl::OkStatus(); }, &nothing);
  ASSERT_TRUE(check.ok()) << check.status();
  EXPECT_FALSE(check->ok()) << "a path that wrote nothing passed: " << check->ToString();
  EXPECT_EQ(check->failures, kM * kN);
  ASSERT_EQ(nothing.size(), static_cast<size_t>(kM * kN));
  EXPECT_EQ(std::count(nothing.begin(), nothing.end(), uint16_t{0xFFFF}), kM * kN)
      << "the output was not poisoned with all ones (NaN)";
}

// CheckAndCaptureGemv runs copy 0 and the last copy and requires the same bits (the library
// promises them for one matrix uploaded either way). Copies of one matrix in the two formats,
// plain BF16 first and 12-bit last, each right within the tolerance but summed in another order
// by another kernel, must be reported; the compressed path's own copies (FromBf16, then Uploads
// of a Pack) must not.
TEST(BenchGpu, CheckAndCaptureGemvReportsALastCopyWithOtherBits) {
  GEMVZ_REQUIRE_GPU();
  // 64 Ki outputs: two right kernels that sum in different orders (the 12-bit one adds each
  // exception's correction apart) round some of them to neighbouring BF16 values.
  constexpr int64_t kN = 4096, kK = 4096, kM = 16;
  Opened o = OpenWorkload(kN, kK, kM, int64_t{8} << 20);
  ASSERT_NE(o.plain, nullptr);
  ShapeWorkload& work = *o.work;
  absl::StatusOr<const std::vector<DeviceMatrix>*> z12 = work.Compressed();
  ASSERT_TRUE(z12.ok()) << z12.status();
  ASSERT_EQ((**z12)[0].format(), WeightFormat::kZ12);
  ASSERT_GE((**z12).size(), 2u);

  // The premise: each is right, and their bits differ.
  std::vector<uint16_t> from_plain, from_z12;
  absl::StatusOr<ErrorCheck> check = o.RunGemv((*o.plain)[0], kM, &from_plain);
  ASSERT_TRUE(check.ok() && check->ok()) << (check.ok() ? check->ToString() : "");
  check = o.RunGemv((**z12)[0], kM, &from_z12);
  ASSERT_TRUE(check.ok() && check->ok()) << (check.ok() ? check->ToString() : "");
  ASSERT_NE(from_plain, from_z12) << "the plain and 12-bit kernels agreed bit for bit on all "
                                  << kM * kN << " outputs: this test needs a case where they differ";

  TimingOptions timing;
  timing.min_launches = 4;
  GraphTimer timer(work.stream());
  const std::vector<DeviceMatrix> mixed = {(*o.plain)[0], (**z12)[0]};
  absl::StatusOr<ShapeWorkload::GemvRun> run =
      work.CheckAndCaptureGemv(&timer, mixed, kM, {}, timing);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_FALSE(run->check.ok()) << "copies giving different bits passed: "
                                << run->check.ToString();
  EXPECT_EQ(run->check.failures, 1);
  EXPECT_EQ(run->result, from_plain);  // copy 0's output

  run = work.CheckAndCaptureGemv(&timer, **z12, kM, {}, timing);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_TRUE(run->check.ok()) << run->check.ToString();
  EXPECT_EQ(run->launches % static_cast<int>((**z12).size()), 0);
  EXPECT_GE(run->launches, timing.min_launches);
}

// A session's stream gets a Gemv workspace (split-K partials and counters) from the library's
// calls on it. Closing the session frees it before destroying the stream, as gemv.h asks: left
// behind, it would stay allocated for the process (demo, bench and tune open sessions in turn
// in one process's tests), and a later stream given the same handle would inherit it. Every
// buffer is an allocation before the close and none after.
TEST(BenchGpu, ClosingASessionFreesItsStreamsGemvWorkspace) {
  GEMVZ_REQUIRE_GPU();
  constexpr int64_t kN = 1024, kK = 4096, kM = 8;
  Opened o = OpenWorkload(kN, kK, kM, int64_t{8} << 20);
  ASSERT_NE(o.plain, nullptr);
  absl::StatusOr<const std::vector<DeviceMatrix>*> z12 = o.work->Compressed();
  ASSERT_TRUE(z12.ok()) << z12.status();
  GemvOptions split;
  split.config = KernelConfig{WeightFormat::kZ12, 4, 2, 1, 1, 2};  // S = 2: partials, counters
  std::vector<uint16_t> result;
  absl::StatusOr<ErrorCheck> check = o.work->RunAndCheck(
      kM, [&] { return Gemv((**z12)[0], o.x(), kM, o.out(), o.work->stream(), split); }, &result);
  ASSERT_TRUE(check.ok()) << check.status();
  ASSERT_TRUE(check->ok()) << check->ToString();

  const absl::StatusOr<CUcontext> ctx = internal::PrimaryContext(0);
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  const CUstream stream = o.session->stream();
  const std::vector<CUdeviceptr> buffers = internal::StreamWorkspaceBuffers(*ctx, stream);
  ASSERT_GE(buffers.size(), 2u) << "split-K partials and arrival counters";
  for (const CUdeviceptr p : buffers)
    ASSERT_TRUE(testing::IsAllocationStart(p)) << "buffer 0x" << std::hex << p;
  o.work.reset();
  o.session.reset();
  for (const CUdeviceptr p : buffers) {
    EXPECT_FALSE(testing::IsAllocationStart(p))
        << "buffer 0x" << std::hex << p << " outlived the session";
  }
  EXPECT_TRUE(internal::StreamWorkspaceBuffers(*ctx, stream).empty());
}

}  // namespace
}  // namespace gemvz::cli
