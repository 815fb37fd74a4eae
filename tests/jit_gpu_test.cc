// JIT on a GPU: kernels load on device 0 with the register and shared-memory counts ptxas
// reported, loaded functions are cached per (device, key), and the time from a disk hit to a
// launchable CUfunction is measured (printed, not asserted). Skips without a GPU.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gemvz/config.h"
#include "gtest/gtest.h"
#include "runtime/cuda/driver.h"
#include "runtime/dispatch/dispatcher.h"
#include "runtime/jit/kernel_cache.h"
#include "tests/support/jit_test_util.h"

namespace gemvz::internal {
namespace {

using ::gemvz::jit_test::TempDir;

KernelCacheOptions RealKernelsIn(const std::string& dir) {
  KernelCacheOptions o;
  o.disk_directory = dir;
  o.extra_options = std::vector<std::string>{};
  o.dump_directory = "";
  return o;  // sources: the embedded kernel_sources/
}

int FunctionAttribute(CUfunction f, CUfunction_attribute a) {
  int v = -1;
  (*Driver())->cuFuncGetAttribute(&v, a, f);
  return v;
}

class JitGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (DeviceCount() == 0) GTEST_SKIP() << "no GPU (no driver or no device)";
  }
};

TEST_F(JitGpuTest, LoadsOnDeviceZeroWithPtxasStatistics) {
  TempDir dir;
  KernelCache cache(RealKernelsIn(dir.path()));
  auto arch = DeviceArch(0);
  ASSERT_TRUE(arch.ok()) << arch.status();
  std::printf("device 0 arch: %s\n", arch->c_str());
  for (const char* text : {"z12.nw8.ug2.nb2.pipe3", "bf16.nw8.ug2.nb2.pipe3"}) {
    const KernelConfig c = KernelConfig::Parse(text).value();
    auto k = cache.LoadForConfig(0, c);
    ASSERT_TRUE(k.ok()) << k.status();
    ASSERT_NE(k->function, nullptr);
    EXPECT_EQ(k->compiled->arch, *arch);
    EXPECT_EQ(FunctionAttribute(k->function, CU_FUNC_ATTRIBUTE_NUM_REGS), k->compiled->registers);
    EXPECT_EQ(FunctionAttribute(k->function, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES),
              k->compiled->shared_bytes);
    EXPECT_EQ(
        FunctionAttribute(k->function, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK) >= c.threads(),
        true);
    // Another split count is the same function, with no new load.
    KernelConfig s = c;
    s.splits = 4;
    const int64_t loads = cache.counters().module_loads;
    auto again = cache.LoadForConfig(0, s);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->function, k->function);
    EXPECT_EQ(cache.counters().module_loads, loads);
  }
  EXPECT_EQ(cache.counters().module_loads, 2);
}

// The launch path's lookup (GetKernelFunction) gives LoadForConfig's function and occupancy, one
// function for every split count, and forgets it with the cache's memory: from the calling thread's
// own copy too, which would otherwise keep answering.
TEST_F(JitGpuTest, KernelFunctionIsTheLoadedOneAndGoesWithTheMemory) {
  TempDir dir;
  KernelCache cache(RealKernelsIn(dir.path()));
  const KernelConfig c = KernelConfig::Parse("z12.nw8.ug2.nb2.pipe3").value();
  const absl::StatusOr<LoadedKernel> loaded = cache.LoadForConfig(0, c);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const absl::StatusOr<KernelFunction> f = cache.FunctionForConfig(0, c);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->function, loaded->function);
  EXPECT_EQ(f->blocks_per_sm, loaded->blocks_per_sm);
  EXPECT_GT(f->blocks_per_sm, 0);
  KernelConfig split = c;
  split.splits = 3;
  const absl::StatusOr<KernelFunction> f3 = cache.FunctionForConfig(0, split);
  ASSERT_TRUE(f3.ok()) << f3.status();
  EXPECT_EQ(f3->function, f->function);

  // Another thread takes its own copy before the drop, and asks again after it.
  CUfunction other_before = nullptr, other_after = nullptr;
  absl::Notification copied, dropped;
  std::thread t([&] {
    const absl::StatusOr<KernelFunction> g = cache.FunctionForConfig(0, c);
    if (g.ok()) other_before = g->function;
    copied.Notify();
    dropped.WaitForNotification();
    const absl::StatusOr<KernelFunction> h = cache.FunctionForConfig(0, c);
    if (h.ok()) other_after = h->function;
  });
  copied.WaitForNotification();
  EXPECT_EQ(other_before, f->function);
  const int64_t loads = cache.counters().module_loads;
  cache.DropMemoryForTesting();
  const absl::StatusOr<KernelFunction> again = cache.FunctionForConfig(0, c);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(cache.counters().module_loads, loads + 1)
      << "the dropped function was still found in this thread's copy";
  ASSERT_NE(again->function, nullptr);
  EXPECT_NE(again->function, f->function) << "a new load gives a new function";
  dropped.Notify();
  t.join();
  EXPECT_EQ(other_after, again->function) << "the other thread kept its copy across the drop";
  EXPECT_EQ(cache.counters().module_loads, loads + 1);
}

// The heuristic's shaped rule counts CTAs per SM for each kernel family (both formats)
// (HeuristicTest.FamiliesHoldTheirCtasPerSm checks them from ptxas's registers); here the
// driver's occupancy for the loaded kernels must agree, on an sm_90 GPU.
TEST_F(JitGpuTest, HeuristicFamiliesHaveTheirCtasPerSmOnTheDriver) {
  auto arch = DeviceArch(0);
  ASSERT_TRUE(arch.ok()) << arch.status();
  if (*arch != "sm_90" && *arch != "sm_90a") {
    GTEST_SKIP() << "the families' counts are for sm_90; device 0 is " << *arch;
  }
  TempDir dir;
  KernelCache cache(RealKernelsIn(dir.path()));
  for (const HeuristicFamilyKernel& f : HeuristicFamilyKernels()) {
    auto k = cache.LoadForConfig(0, f.config);
    ASSERT_TRUE(k.ok()) << k.status();
    std::printf("%-26s %3d registers: %d CTAs per SM (driver), %d counted\n",
                f.config.KernelName().c_str(), k->compiled->registers, k->blocks_per_sm,
                f.ctas_per_sm);
    EXPECT_EQ(k->blocks_per_sm, f.ctas_per_sm) << f.config.KernelName();
  }
}

TEST_F(JitGpuTest, DiskHitToLoadedFunctionTime) {
  TempDir dir;
  KernelCache cache(RealKernelsIn(dir.path()));
  const KernelConfig c = KernelConfig::Parse("z12.nw8.ug2.nb2.pipe3").value();
  ASSERT_TRUE(cache.LoadForConfig(0, c).ok());  // compile + publish + load once
  std::vector<double> ms;
  for (int i = 0; i < 20; ++i) {
    cache.DropMemoryForTesting();
    cache.ResetCounters();
    const auto t0 = std::chrono::steady_clock::now();
    auto k = cache.LoadForConfig(0, c);
    const auto t1 = std::chrono::steady_clock::now();
    ASSERT_TRUE(k.ok()) << k.status();
    ASSERT_NE(k->function, nullptr);
    EXPECT_EQ(cache.counters().compiles, 0);
    EXPECT_EQ(cache.counters().disk_hits, 1);
    EXPECT_EQ(cache.counters().module_loads, 1);
    ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  std::printf(
      "disk hit -> loaded CUfunction (%s, %zu-byte cubin): median %.3f ms, min %.3f ms, "
      "max %.3f ms over %zu runs\n",
      c.KernelName().c_str(), cache.LoadForConfig(0, c)->compiled->cubin.size(), ms[ms.size() / 2],
      ms.front(), ms.back(), ms.size());
  // And the hot path: a cached function costs a hash lookup.
  constexpr int kCalls = 100000;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kCalls; ++i) {
    auto k = cache.LoadForConfig(0, c);
    if (!k.ok() || k->function == nullptr) FAIL();
  }
  const double ns =
      std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() /
      kCalls;
  std::printf("memory hit (cached CUfunction lookup): %.0f ns per call\n", ns);
}

// A kernel built for an architecture the device cannot run (what GEMVZ_ARCH=sm_100 on an H200
// asks for) fails to load with a message that says which kernel, built for what, on which device.
TEST_F(JitGpuTest, AKernelForAnotherArchitectureSaysWhatItWasBuiltFor) {
  auto arch = DeviceArch(0);
  ASSERT_TRUE(arch.ok()) << arch.status();
  const std::string other = *arch == "sm_100" ? "sm_90" : "sm_100";
  if (!CheckArch(other).ok()) GTEST_SKIP() << "this NVRTC cannot target " << other;
  TempDir dir;
  KernelCache cache(RealKernelsIn(dir.path()));
  const KernelConfig c = KernelConfig::Parse("z12.nw8.ug2.nb2.pipe3").value();
  auto k = cache.Load(0, RequestForConfig(c, other));
  ASSERT_FALSE(k.ok());
  const std::string msg(k.status().message());
  EXPECT_NE(msg.find(c.KernelName()), std::string::npos) << msg;
  EXPECT_NE(msg.find("built for " + other), std::string::npos) << msg;
  EXPECT_NE(msg.find("on device 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("cuModuleLoadData"), std::string::npos) << msg;
}

TEST_F(JitGpuTest, ToolKernelsLoadByName) {
  TempDir dir;
  jit_test::ScopedEnv cache_dir("GEMVZ_CACHE_DIR", dir.path());
  auto k = GetKernelByName(0, "bandwidth_probe.cuh", "gemvz_bandwidth_probe<4, 256>");
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_NE(k->function, nullptr);
  auto again = GetKernelByName(0, "bandwidth_probe.cuh", "gemvz_bandwidth_probe<4, 256>");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->function, k->function);
  auto missing = GetKernelByName(0, "no_such.cuh", "k<1>");
  EXPECT_FALSE(missing.ok());
}

TEST_F(JitGpuTest, GlobalGetKernelServesTheDevice) {
  TempDir dir;
  jit_test::ScopedEnv cache_dir("GEMVZ_CACHE_DIR", dir.path());
  auto k = GetKernel(0, KernelConfig{});
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_NE(k->function, nullptr);
  KernelConfig bad;
  bad.nw = 1;
  bad.nb = 2;
  auto refused = GetKernel(0, bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(std::string(refused.status().message()).find("NW >= NB"), std::string::npos);
  EXPECT_FALSE(GetKernel(DeviceCount(), KernelConfig{}).ok());
}

}  // namespace
}  // namespace gemvz::internal
