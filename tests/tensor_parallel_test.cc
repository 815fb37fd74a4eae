// Two-way tensor parallelism over NCCL (the toolkit's libnccl, opened at run time): output-parallel
// shards (row blocks) gathered with ncclAllGather, input-parallel shards (column ranges) whose FP32
// partial outputs are summed with ncclAllReduce, both checked against the same GEMV on one GPU.
// Needs two GPUs and libnccl; skips, saying which is missing, otherwise.
#include <dlfcn.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "gemvz/gemv.h"
#include "gemvz/runtime.h"
#include "gemvz/shard.h"
#include "gtest/gtest.h"
#include "runtime/cuda/driver.h"
#include "runtime/jit/kernel_cache.h"
#include "tests/support/gpu_util.h"
#include "tests/support/random_weights.h"

namespace gemvz {
namespace {

struct Nccl {
  decltype(&::ncclCommInitAll) CommInitAll = nullptr;
  decltype(&::ncclCommDestroy) CommDestroy = nullptr;
  decltype(&::ncclAllReduce) AllReduce = nullptr;
  decltype(&::ncclAllGather) AllGather = nullptr;
  decltype(&::ncclGroupStart) GroupStart = nullptr;
  decltype(&::ncclGroupEnd) GroupEnd = nullptr;
  decltype(&::ncclGetErrorString) GetErrorString = nullptr;
};

// libnccl.so.2 from the loader path or the toolkit; nullptr (with the reason) when absent.
const Nccl* LoadNccl(std::string* why) {
  void* lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) lib = dlopen("/usr/local/cuda/lib64/libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    *why = std::string("libnccl.so.2 not found: ") + dlerror();
    return nullptr;
  }
  auto* n = new Nccl();
#define GEMVZ_NCCL_SYM(field, name)                                   \
  n->field = reinterpret_cast<decltype(n->field)>(dlsym(lib, #name)); \
  if (n->field == nullptr) {                                          \
    *why = "libnccl.so.2 lacks " #name;                               \
    return nullptr;                                                   \
  }
  GEMVZ_NCCL_SYM(CommInitAll, ncclCommInitAll)
  GEMVZ_NCCL_SYM(CommDestroy, ncclCommDestroy)
  GEMVZ_NCCL_SYM(AllReduce, ncclAllReduce)
  GEMVZ_NCCL_SYM(AllGather, ncclAllGather)
  GEMVZ_NCCL_SYM(GroupStart, ncclGroupStart)
  GEMVZ_NCCL_SYM(GroupEnd, ncclGroupEnd)
  GEMVZ_NCCL_SYM(GetErrorString, ncclGetErrorString)
#undef GEMVZ_NCCL_SYM
  return n;
}

// Declares `nccl`, the loaded library, or skips the test saying why it is missing; and keeps
// NVLink multicast off, which can take a host's GPUs out of service.
#define REQUIRE_NCCL(nccl)                         \
  std::string nccl##_why;                          \
  const Nccl* nccl = LoadNccl(&nccl##_why);        \
  if (nccl == nullptr) GTEST_SKIP() << nccl##_why; \
  setenv("NCCL_NVLS_ENABLE", "0", 1)

#define NCCL_ASSERT(call)                                                    \
  do {                                                                       \
    const ncclResult_t r_ = (call);                                          \
    ASSERT_EQ(r_, ncclSuccess) << #call << ": " << nccl->GetErrorString(r_); \
  } while (0)
#define CU_ASSERT(call) ASSERT_EQ((call), CUDA_SUCCESS) << #call

// Per-GPU resources of one run.
struct Rank {
  int device = 0;
  CUcontext ctx = nullptr;
  CUstream stream = nullptr;
  DeviceMatrix w;
  CUdeviceptr x = 0, out = 0, gathered = 0;
};

// Device `device`'s primary context, made current, and a stream on it.
void OpenRank(Rank& r, int device) {
  const auto& api = **internal::Driver();
  r.device = device;
  auto ctx = internal::PrimaryContext(device);
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  r.ctx = *ctx;
  CU_ASSERT(api.cuCtxSetCurrent(r.ctx));
  CU_ASSERT(api.cuStreamCreate(&r.stream, CU_STREAM_NON_BLOCKING));
}

void ReleaseRank(Rank& r) {
  const auto& api = **internal::Driver();
  api.cuCtxSetCurrent(r.ctx);
  api.cuMemFree(r.x);
  api.cuMemFree(r.out);
  api.cuMemFree(r.gathered);
  api.cuStreamDestroy(r.stream);
}

TEST(TensorParallel, TwoWayOverNcclMatchesOneGpu) {
  GEMVZ_REQUIRE_GPUS(2);
  REQUIRE_NCCL(nccl);
  const auto& api = **internal::Driver();

  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const int64_t n = 8192, k = 8192, m = 8;
  auto w = testing::RandomMatrix(n, k, testing::Distribution::kNormal, seed);
  for (int64_t c = 0; c < k; ++c) w[77 * k + c] = 0;  // a dense row travels with its shard
  auto x = testing::RandomActivations(m, k, seed + 1);
  auto packed = Pack(w.data(), n, k);
  ASSERT_TRUE(packed.ok()) << packed.status();
  std::vector<double> ref, abs_sum;
  testing::ReferenceGemv(w, x, m, n, k, &ref, &abs_sum);

  int devs[2] = {0, 1};
  ncclComm_t comms[2];
  NCCL_ASSERT(nccl->CommInitAll(comms, 2, devs));

  for (bool by_rows : {true, false}) {
    SCOPED_TRACE(by_rows ? "output-parallel" : "input-parallel");
    auto shards = by_rows ? SplitRows(*packed, 2) : SplitCols(*packed, 2);
    ASSERT_TRUE(shards.ok()) << shards.status();
    Rank ranks[2];
    for (int i = 0; i < 2; ++i) {
      Rank& r = ranks[i];
      ASSERT_NO_FATAL_FAILURE(OpenRank(r, i));
      auto dm = DeviceMatrix::Upload((*shards)[i], i);
      ASSERT_TRUE(dm.ok()) << dm.status();
      r.w = *dm;
      const PackedMatrix& s = (*shards)[i];
      std::vector<uint16_t> xs(m * s.cols);  // this rank's columns of x
      const int64_t c0 = by_rows ? 0 : i * (*shards)[0].cols;
      for (int64_t t = 0; t < m; ++t) {
        std::copy(x.begin() + t * k + c0, x.begin() + t * k + c0 + s.cols, xs.begin() + t * s.cols);
      }
      CU_ASSERT(api.cuMemAlloc(&r.x, xs.size() * 2));
      CU_ASSERT(api.cuMemcpyHtoD(r.x, xs.data(), xs.size() * 2));
      CU_ASSERT(api.cuMemAlloc(&r.out, m * s.rows * 4));
      CU_ASSERT(api.cuMemAlloc(&r.gathered, m * n * 4));
      // Warm-up: module load and workspace, outside the timed region.
      ASSERT_TRUE(GemvFp32(r.w, reinterpret_cast<uint16_t*>(r.x), m,
                           reinterpret_cast<float*>(r.out), r.stream)
                      .ok());
      CU_ASSERT(api.cuStreamSynchronize(r.stream));
    }
    // Both ranks: GEMV, then the collective that assembles the output.
    const auto t0 = std::chrono::steady_clock::now();
    for (Rank& r : ranks) {
      CU_ASSERT(api.cuCtxSetCurrent(r.ctx));
      ASSERT_TRUE(GemvFp32(r.w, reinterpret_cast<uint16_t*>(r.x), m,
                           reinterpret_cast<float*>(r.out), r.stream)
                      .ok());
    }
    NCCL_ASSERT(nccl->GroupStart());
    for (int i = 0; i < 2; ++i) {
      Rank& r = ranks[i];
      const size_t count = static_cast<size_t>(m * (*shards)[i].rows);
      if (by_rows) {
        NCCL_ASSERT(nccl->AllGather(reinterpret_cast<void*>(r.out),
                                    reinterpret_cast<void*>(r.gathered), count, ncclFloat32,
                                    comms[i], r.stream));
      } else {
        NCCL_ASSERT(nccl->AllReduce(reinterpret_cast<void*>(r.out),
                                    reinterpret_cast<void*>(r.gathered), count, ncclFloat32,
                                    ncclSum, comms[i], r.stream));
      }
    }
    NCCL_ASSERT(nccl->GroupEnd());
    for (Rank& r : ranks) CU_ASSERT(api.cuStreamSynchronize(r.stream));
    const double us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    std::printf(
        "[ info ] %s 2-way, %lldx%lld m=%lld: GEMV + collective %.1f us (host wall, one "
        "first call with NCCL's lazy setup; ShardSpeedAgainstOneGpu measures speed)\n",
        by_rows ? "output-parallel" : "input-parallel", static_cast<long long>(n),
        static_cast<long long>(k), static_cast<long long>(m), us);
    // Rank 0's assembled output against the reference. AllGather lays out [rank][m][N/2].
    std::vector<float> got(m * n);
    CU_ASSERT(api.cuCtxSetCurrent(ranks[0].ctx));
    CU_ASSERT(api.cuMemcpyDtoH(got.data(), ranks[0].gathered, got.size() * 4));
    const int64_t half = (*shards)[0].rows;
    for (int64_t t = 0; t < m; ++t) {
      for (int64_t row = 0; row < n; ++row) {
        double v;
        if (by_rows) {
          const int rank = row < half ? 0 : 1;
          const int64_t rows_r = rank == 0 ? half : n - half;
          v = got[rank * m * half + t * rows_r + (row - rank * half)];
        } else {
          v = got[t * n + row];
        }
        const double tol =
            std::ldexp(std::abs(ref[t * n + row]), -12) + std::ldexp(abs_sum[t * n + row], -16);
        ASSERT_LE(std::abs(v - ref[t * n + row]), tol) << "token " << t << " row " << row;
      }
    }
    for (Rank& r : ranks) ReleaseRank(r);
  }
  for (ncclComm_t c : comms) nccl->CommDestroy(c);
}

// Speed: a large layer (packed shards well above the 60 MB L2) on one GPU against its two
// shards on two GPUs, each rank alone, both at once, and both with the collective that
// assembles the output. Host-timed over many calls on each rank's stream (median of repeats);
// printed for docs/BENCHMARKS.md. Correctness of the same path is the test above.
TEST(TensorParallel, ShardSpeedAgainstOneGpu) {
  GEMVZ_REQUIRE_GPUS(2);
  REQUIRE_NCCL(nccl);
  const auto& api = **internal::Driver();
  const int64_t n = 28672, k = 8192, max_m = 16;
  auto w = testing::RandomMatrix(n, k, testing::Distribution::kNormal, testing::FreshSeed());
  auto packed = Pack(w.data(), n, k);
  ASSERT_TRUE(packed.ok()) << packed.status();
  w.clear();
  int devs[2] = {0, 1};
  ncclComm_t comms[2];
  NCCL_ASSERT(nccl->CommInitAll(comms, 2, devs));

  // Per device: x of max_m x K (a column shard reads its first max_m x K/2 values: only the
  // timing matters here), the FP32 out and the assembled output. Matrices are uploaded below.
  Rank dev[2];
  for (int i = 0; i < 2; ++i) {
    ASSERT_NO_FATAL_FAILURE(OpenRank(dev[i], i));
    const auto xs = testing::RandomActivations(max_m, k, 7 + i);
    CU_ASSERT(api.cuMemAlloc(&dev[i].x, xs.size() * 2));
    CU_ASSERT(api.cuMemcpyHtoD(dev[i].x, xs.data(), xs.size() * 2));
    CU_ASSERT(api.cuMemAlloc(&dev[i].out, max_m * n * 4));
    CU_ASSERT(api.cuMemAlloc(&dev[i].gathered, max_m * n * 4));
  }
  // Median over repeats of the per-call time of `calls` rounds of `round` on the given devices.
  auto median_us = [&](const std::vector<int>& on, auto&& round) {
    constexpr int kCalls = 200, kRepeats = 5;
    std::vector<double> t;
    for (int rep = 0; rep <= kRepeats; ++rep) {  // the first repeat warms up
      for (int d : on) {
        api.cuCtxSetCurrent(dev[d].ctx);
        api.cuStreamSynchronize(dev[d].stream);
      }
      const auto t0 = std::chrono::steady_clock::now();
      for (int c = 0; c < kCalls; ++c) round();
      for (int d : on) {
        api.cuCtxSetCurrent(dev[d].ctx);
        api.cuStreamSynchronize(dev[d].stream);
      }
      const double us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      if (rep > 0) t.push_back(us / kCalls);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  auto gemv = [&](const DeviceMatrix& dm, int d, int64_t m) {
    api.cuCtxSetCurrent(dev[d].ctx);
    const absl::Status st = GemvFp32(dm, reinterpret_cast<uint16_t*>(dev[d].x), m,
                                     reinterpret_cast<float*>(dev[d].out), dev[d].stream);
    EXPECT_TRUE(st.ok()) << st;
  };

  auto whole = DeviceMatrix::Upload(*packed, 0);
  ASSERT_TRUE(whole.ok()) << whole.status();
  for (int64_t m : {1, 8, 16}) {
    const double one = median_us({0}, [&] { gemv(*whole, 0, m); });
    std::printf("[ info ] %lldx%lld m=%lld: one GPU %.2f us\n", static_cast<long long>(n),
                static_cast<long long>(k), static_cast<long long>(m), one);
  }
  for (bool by_rows : {true, false}) {
    auto shards = by_rows ? SplitRows(*packed, 2) : SplitCols(*packed, 2);
    ASSERT_TRUE(shards.ok()) << shards.status();
    std::vector<DeviceMatrix> dm;
    for (int i = 0; i < 2; ++i) {
      auto u = DeviceMatrix::Upload((*shards)[i], i);
      ASSERT_TRUE(u.ok()) << u.status();
      dm.push_back(*u);
    }
    const char* name = by_rows ? "output-parallel (rows)" : "input-parallel (columns)";
    for (int64_t m : {1, 8, 16}) {
      const double r0 = median_us({0}, [&] { gemv(dm[0], 0, m); });
      const double r1 = median_us({1}, [&] { gemv(dm[1], 1, m); });
      const double both = median_us({0, 1}, [&] {
        gemv(dm[0], 0, m);
        gemv(dm[1], 1, m);
      });
      const double with_collective = median_us({0, 1}, [&] {
        gemv(dm[0], 0, m);
        gemv(dm[1], 1, m);
        EXPECT_EQ(nccl->GroupStart(), ncclSuccess);
        for (int i = 0; i < 2; ++i) {
          const size_t count = static_cast<size_t>(m * (*shards)[i].rows);
          const ncclResult_t r =
              by_rows ? nccl->AllGather(reinterpret_cast<void*>(dev[i].out),
                                        reinterpret_cast<void*>(dev[i].gathered), count,
                                        ncclFloat32, comms[i], dev[i].stream)
                      : nccl->AllReduce(reinterpret_cast<void*>(dev[i].out),
                                        reinterpret_cast<void*>(dev[i].gathered), count,
                                        ncclFloat32, ncclSum, comms[i], dev[i].stream);
          EXPECT_EQ(r, ncclSuccess) << nccl->GetErrorString(r);
        }
        EXPECT_EQ(nccl->GroupEnd(), ncclSuccess);
      });
      std::printf(
          "[ info ] %s %lldx%lld m=%lld: rank 0 alone %.2f us, rank 1 alone %.2f us, both "
          "at once %.2f us, with the collective %.2f us\n",
          name, static_cast<long long>(n), static_cast<long long>(k), static_cast<long long>(m), r0,
          r1, both, with_collective);
    }
  }
  for (Rank& r : dev) ReleaseRank(r);
  for (ncclComm_t c : comms) nccl->CommDestroy(c);
}

// The same configuration on two GPUs from two threads: one compile (or disk hit), one module per
// device, and a DeviceMatrix of one device refuses a stream of the other.
TEST(TensorParallel, OneCompileOneModulePerDevice) {
  GEMVZ_REQUIRE_GPUS(2);
  KernelConfig c{WeightFormat::kZ12, 4, 1, 1, 1, 1};
  c.ug = 3;  // a kernel no other test of this binary asks for
  const JitCounters before = GetJitCounters();
  absl::Status st[2];
  std::thread t0([&] { st[0] = internal::GetKernel(0, c).status(); });
  std::thread t1([&] { st[1] = internal::GetKernel(1, c).status(); });
  t0.join();
  t1.join();
  ASSERT_TRUE(st[0].ok()) << st[0];
  ASSERT_TRUE(st[1].ok()) << st[1];
  const JitCounters after = GetJitCounters();
  // Fetched once (compiled, or found on disk by an earlier run), loaded once per device.
  EXPECT_EQ((after.compiles - before.compiles) + (after.disk_hits - before.disk_hits), 1);
  EXPECT_EQ(after.module_loads - before.module_loads, 2);

  const auto& api = **internal::Driver();
  auto w = testing::RandomMatrix(64, 256, testing::Distribution::kNormal, 5);
  auto dm = DeviceMatrix::FromBf16(w.data(), 64, 256, /*device=*/0);
  ASSERT_TRUE(dm.ok());
  auto ctx1 = internal::PrimaryContext(1);
  ASSERT_TRUE(ctx1.ok());
  CU_ASSERT(api.cuCtxSetCurrent(*ctx1));
  CUstream other;
  CU_ASSERT(api.cuStreamCreate(&other, CU_STREAM_NON_BLOCKING));
  CUdeviceptr x, out;
  CU_ASSERT(api.cuMemAlloc(&x, 256 * 2));
  CU_ASSERT(api.cuMemAlloc(&out, 64 * 2));
  absl::Status wrong =
      Gemv(*dm, reinterpret_cast<uint16_t*>(x), 1, reinterpret_cast<uint16_t*>(out), other);
  EXPECT_FALSE(wrong.ok());
  EXPECT_NE(wrong.message().find("lives on device 0"), std::string::npos) << wrong;
  api.cuMemFree(x);
  api.cuMemFree(out);
  api.cuStreamDestroy(other);
}

}  // namespace
}  // namespace gemvz
