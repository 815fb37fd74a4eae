// Kernel cache: memory hits, disk hits with zero compiles (after dropping memory, and in a new
// process), a key that changes with exactly what determines the binary, recompiles of damaged
// entries, read-only fallback, single flight, two racing processes, eviction, invalid
// configurations refused before NVRTC, dumps, and GPU entry points without a driver.
#include "runtime/jit/kernel_cache.h"

#include <algorithm>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/barrier.h"
#include "gemvz/runtime.h"
#include "gtest/gtest.h"
#include "runtime/common/file_util.h"
#include "runtime/cuda/driver.h"
#include "runtime/jit/cache_key.h"
#include "runtime/jit/disk_cache.h"
#include "tests/support/jit_test_util.h"

namespace gemvz::internal {
namespace {

using ::gemvz::jit_test::CountOccurrences;
using ::gemvz::jit_test::FileSize;
using ::gemvz::jit_test::ListFiles;
using ::gemvz::jit_test::RandomValidConfig;
using ::gemvz::jit_test::Rng;
using ::gemvz::jit_test::ScopedEnv;
using ::gemvz::jit_test::StandInOptions;
using ::gemvz::jit_test::TempDir;

// Distinct random kernels (splits ignored).
std::vector<KernelConfig> DistinctConfigs(int n) {
  std::vector<KernelConfig> out;
  std::set<std::string> seen;
  while (static_cast<int>(out.size()) < n) {
    KernelConfig c = RandomValidConfig(Rng(), 8);
    if (seen.insert(c.KernelName()).second) out.push_back(c);
  }
  return out;
}

std::string EntryPath(const std::string& dir, const std::string& key) {
  return absl::StrCat(dir, "/kernels/", key, ".gemvzk");
}

TEST(KernelCacheTest, SecondRequestHitsMemoryThenDiskAfterDroppingMemory) {
  TempDir dir;
  KernelCache cache(StandInOptions(dir.path()));
  const KernelConfig config = RandomValidConfig(Rng());
  CacheSource source;
  auto first = cache.GetForConfig(config, "sm_90", &source);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(source, CacheSource::kCompiled);
  EXPECT_FALSE((*first)->from_disk);
  EXPECT_EQ(cache.counters().compiles, 1);
  EXPECT_EQ(cache.counters().disk_writes, 1);
  EXPECT_GT(FileSize(EntryPath(dir.path(), (*first)->key)), 0);

  // Same kernel, other split count: the same object from memory.
  KernelConfig other_split = config;
  other_split.splits = config.splits + 3;
  auto second = cache.GetForConfig(other_split, "sm_90", &source);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(source, CacheSource::kMemory);
  EXPECT_EQ(second->get(), first->get());
  EXPECT_EQ(cache.counters().memory_hits, 1);

  cache.DropMemoryForTesting();
  cache.ResetCounters();
  auto third = cache.GetForConfig(config, "sm_90", &source);
  ASSERT_TRUE(third.ok());
  EXPECT_EQ(source, CacheSource::kDisk);
  EXPECT_TRUE((*third)->from_disk);
  EXPECT_EQ(cache.counters().compiles, 0);
  EXPECT_EQ(cache.counters().disk_hits, 1);
  EXPECT_EQ((*third)->cubin, (*first)->cubin);
  EXPECT_EQ((*third)->lowered_name, (*first)->lowered_name);
  EXPECT_EQ((*third)->ptx, (*first)->ptx);
  EXPECT_EQ((*third)->registers, (*first)->registers);
}

TEST(KernelCacheTest, NewProcessHitsDiskWithZeroCompiles) {
  TempDir dir;
  const KernelConfig config = RandomValidConfig(Rng());
  {
    KernelCache cache(StandInOptions(dir.path()));
    ASSERT_TRUE(cache.GetForConfig(config, "sm_90").ok());
  }
  const int code = jit_test::RunInChild([&] {
    KernelCache cache(StandInOptions(dir.path()));
    CacheSource source;
    auto k = cache.GetForConfig(config, "sm_90", &source);
    if (!k.ok()) return 1;
    if (source != CacheSource::kDisk) return 2;
    if (cache.counters().compiles != 0) return 3;
    return (*k)->cubin.empty() ? 4 : 0;
  });
  EXPECT_EQ(code, 0);
}

TEST(KernelCacheTest, KeyChangesWithWhatDeterminesTheBinaryAndNothingElse) {
  TempDir dir_a, dir_b;
  const KernelConfig config = RandomValidConfig(Rng());
  KernelCache base(StandInOptions(dir_a.path()));
  auto key = [](const KernelCache& c, const KernelConfig& k, const std::string& arch) {
    absl::StatusOr<std::string> s = c.KeyFor(RequestForConfig(k, arch));
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : std::string();
  };
  const std::string k0 = key(base, config, "sm_90");
  ASSERT_EQ(k0.size(), 64u);

  // Nothing else: split count, the directory, another instance, the sources' input order, the
  // display name, the environment.
  KernelConfig split = config;
  split.splits += 1 + static_cast<int>(Rng()() % 7);
  EXPECT_EQ(key(base, split, "sm_90"), k0);
  KernelCache elsewhere(StandInOptions(dir_b.path()));
  EXPECT_EQ(key(elsewhere, config, "sm_90"), k0);
  auto files = jit_test::StandInKernelFiles();
  std::reverse(files.begin(), files.end());
  KernelCacheOptions reordered = StandInOptions("");
  reordered.sources = SourceSet::FromFiles(files);
  EXPECT_EQ(key(KernelCache(reordered), config, "sm_90"), k0);
  CompileRequest renamed = RequestForConfig(config, "sm_90");
  renamed.kernel_name = "another label";
  EXPECT_EQ(*base.KeyFor(renamed), k0);
  {
    ScopedEnv log("GEMVZ_LOG", "2");
    ScopedEnv cache_dir("GEMVZ_CACHE_DIR", dir_b.path());
    EXPECT_EQ(key(base, config, "sm_90"), k0);
  }

  // The configuration: every template argument and the format.
  for (int field = 0; field < 5; ++field) {
    KernelConfig c = config;
    if (field == 0) c.nw += 1;
    if (field == 1) c.ug = c.ug % 4 + 1;
    if (field == 2) c.nb = c.nb == 1 ? 2 : 1, c.nw = std::max(c.nw, c.nb);
    if (field == 3) c.pipe = (c.pipe + 1) % 4;
    if (field == 4)
      c.format = c.format == WeightFormat::kZ12 ? WeightFormat::kBf16 : WeightFormat::kZ12;
    EXPECT_NE(key(base, c, "sm_90"), k0) << "field " << field;
  }
  // The architecture.
  EXPECT_NE(key(base, config, "sm_90a"), k0);
  EXPECT_NE(key(base, config, "sm_80"), k0);
  // The options.
  KernelCacheOptions with_option = StandInOptions("");
  with_option.extra_options = std::vector<std::string>{"-maxrregcount=128"};
  const std::string k128 = key(KernelCache(with_option), config, "sm_90");
  EXPECT_NE(k128, k0);
  // An option's value, not only how many there are (a key of the option count alone passed the
  // line above: tools/mutants.tsv, F3).
  with_option.extra_options = std::vector<std::string>{"-maxrregcount=96"};
  EXPECT_NE(key(KernelCache(with_option), config, "sm_90"), k128);
  // The source text: one character of a comment in a header the kernel does include, and a
  // file the kernel never includes.
  KernelCacheOptions salted = StandInOptions("");
  salted.sources = jit_test::StandInSources(std::to_string(Rng()()));
  EXPECT_NE(key(KernelCache(salted), config, "sm_90"), k0);
  auto extra = jit_test::StandInKernelFiles();
  extra.emplace_back("unrelated.cuh", "// never included\n");
  KernelCacheOptions more_files = StandInOptions("");
  more_files.sources = SourceSet::FromFiles(extra);
  EXPECT_NE(key(KernelCache(more_files), config, "sm_90"), k0);

  // The version fields, at the key function itself.
  CacheKeyInputs in;
  in.library_version = LibraryVersion();
  in.nvrtc_version = NvrtcVersionString();
  in.nvrtc_library = NvrtcLibraryIdentity();
  in.arch = "sm_90";
  in.options = CanonicalOptions("sm_90", {});
  in.sources = base.sources().files();
  in.generated_source = GeneratedSource("z12_gemv.cuh");
  in.name_expression = "gemvz_z12_kernel<8, 2, 2, 3>";
  const std::string v0 = ComputeCacheKey(in);
  EXPECT_EQ(ComputeCacheKey(in), v0);
  ASSERT_FALSE(in.options.empty());
  for (int field = 0; field < 8; ++field) {
    CacheKeyInputs changed = in;
    if (field == 0) changed.schema_version += 1;
    if (field == 1) changed.library_version += ".1";
    if (field == 2) changed.nvrtc_version = "99.9";
    if (field == 3) changed.generated_source += "\n";
    if (field == 4) changed.nvrtc_library += " (patched)";
    if (field == 5) changed.options.back() += "0";  // as many options, one of them another
    if (field == 6) changed.arch = "sm_100";
    if (field == 7) changed.name_expression = "gemvz_z12_kernel<8, 2, 2, 1>";
    EXPECT_NE(ComputeCacheKey(changed), v0) << "field " << field;
  }
}

// Damage an entry, drop memory, ask again: one warning, a recompile, a valid entry after.
void ExpectRecompileAfterDamage(
    const std::function<void(const std::string& dir, const CompiledKernel& k)>& damage) {
  TempDir dir;
  KernelCache cache(StandInOptions(dir.path()));
  const KernelConfig config = RandomValidConfig(Rng());
  auto first = cache.GetForConfig(config, "sm_90");
  ASSERT_TRUE(first.ok()) << first.status();
  damage(dir.path(), **first);
  cache.DropMemoryForTesting();
  cache.ResetCounters();
  testing::internal::CaptureStderr();
  CacheSource source;
  auto again = cache.GetForConfig(config, "sm_90", &source);
  const std::string err = testing::internal::GetCapturedStderr();
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(source, CacheSource::kCompiled);
  EXPECT_EQ(cache.counters().compiles, 1);
  EXPECT_EQ(cache.counters().disk_rejects, 1);
  EXPECT_EQ(cache.counters().disk_hits, 0);
  EXPECT_EQ(CountOccurrences(err, "warning"), 1) << err;
  EXPECT_EQ((*again)->cubin, (*first)->cubin);
  // The entry on disk is whole again.
  absl::StatusOr<std::string> bytes = ReadFile(EntryPath(dir.path(), (*first)->key));
  ASSERT_TRUE(bytes.ok());
  EXPECT_TRUE(ParseEntry(*bytes, (*first)->key).ok());
}

TEST(KernelCacheTest, CorruptEntryIsRecompiled) {
  ExpectRecompileAfterDamage([](const std::string& dir, const CompiledKernel& k) {
    const std::string path = EntryPath(dir, k.key);
    jit_test::FlipByte(path, 24 + Rng()() % (FileSize(path) - 24), 0x04);
  });
}

TEST(KernelCacheTest, TruncatedEntryIsRecompiled) {
  ExpectRecompileAfterDamage([](const std::string& dir, const CompiledKernel& k) {
    const std::string path = EntryPath(dir, k.key);
    jit_test::TruncateFile(path, Rng()() % FileSize(path));
  });
}

TEST(KernelCacheTest, WrongKeyEntryIsRecompiled) {
  ExpectRecompileAfterDamage([](const std::string& dir, const CompiledKernel& k) {
    // Another kernel's valid entry, renamed to this key.
    KernelCache other(StandInOptions(dir));
    KernelConfig c = KernelConfig::Parse(k.kernel_name).value();
    c.ug = c.ug % 4 + 1;
    auto o = other.GetForConfig(c, "sm_90");
    ASSERT_TRUE(o.ok());
    ASSERT_EQ(::rename(EntryPath(dir, (*o)->key).c_str(), EntryPath(dir, k.key).c_str()), 0);
  });
}

TEST(KernelCacheTest, UnwritableDirectoryFallsBackToMemoryWithOneWarning) {
  TempDir dir;
  ASSERT_TRUE(AtomicWriteFile(dir.Join("file"), "not a directory").ok());
  KernelCache cache(StandInOptions(dir.Join("file/cache")));
  testing::internal::CaptureStderr();
  for (const KernelConfig& c : DistinctConfigs(3)) {
    auto k = cache.GetForConfig(c, "sm_90");
    ASSERT_TRUE(k.ok()) << k.status();
    EXPECT_FALSE((*k)->cubin.empty());
    auto again = cache.GetForConfig(c, "sm_90");
    EXPECT_EQ(again->get(), k->get());
  }
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(CountOccurrences(err, "not writable"), 1) << err;
  EXPECT_EQ(CountOccurrences(err, "warning"), 1) << err;
  EXPECT_EQ(cache.counters().compiles, 3);
  EXPECT_EQ(cache.counters().disk_writes, 0);
}

// One entry that cannot be published (a directory under its name, as may lie in a shared
// directory) fails that kernel's write only: the next kernel is still published, and nothing says
// the directory is not writable. (It used to turn the disk cache off for the process, locks
// included, with that wrong diagnosis.)
TEST(KernelCacheTest, OneEntryThatCannotBeWrittenLeavesTheCacheWritable) {
  TempDir dir;
  KernelCache cache(StandInOptions(dir.path()));
  const std::vector<KernelConfig> c = DistinctConfigs(2);
  const absl::StatusOr<std::string> key_a = cache.KeyFor(RequestForConfig(c[0], "sm_90"));
  ASSERT_TRUE(key_a.ok()) << key_a.status();
  const std::string a_path = EntryPath(dir.path(), *key_a);
  ASSERT_TRUE(CreateDirectories(a_path).ok());
  ASSERT_TRUE(AtomicWriteFile(a_path + "/inside", "x").ok());
  testing::internal::CaptureStderr();
  ASSERT_TRUE(cache.GetForConfig(c[0], "sm_90").ok());
  const auto b = cache.GetForConfig(c[1], "sm_90");
  ASSERT_TRUE(b.ok()) << b.status();
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(FileSize(a_path + "/inside"), 1) << "the directory in the way was touched";
  EXPECT_GT(FileSize(EntryPath(dir.path(), (*b)->key)), 0) << "the next kernel was not published";
  EXPECT_EQ(cache.counters().disk_writes, 1);
  EXPECT_EQ(CountOccurrences(err, "not writable"), 0) << err;
  EXPECT_EQ(CountOccurrences(err, "cannot be written"), 1) << err;
}

TEST(KernelCacheTest, DisabledDiskCacheWritesNothing) {
  TempDir dir;
  ScopedEnv cache_dir("GEMVZ_CACHE_DIR", dir.path());
  ScopedEnv off("GEMVZ_DISABLE_DISK_CACHE", "1");
  KernelCacheOptions o = StandInOptions("");
  o.disk_directory.reset();  // from the environment
  KernelCache cache(o);
  EXPECT_EQ(cache.DiskDirectory(), "");
  ASSERT_TRUE(cache.GetForConfig(RandomValidConfig(Rng()), "sm_90").ok());
  EXPECT_TRUE(ListFiles(dir.Join("kernels")).empty());
  EXPECT_EQ(cache.counters().disk_writes, 0);
}

TEST(KernelCacheTest, SixteenThreadsOneCompile) {
  TempDir dir;
  KernelCache cache(StandInOptions(dir.path()));
  const KernelConfig config = RandomValidConfig(Rng());
  constexpr int kThreads = 16;
  absl::Barrier* start = new absl::Barrier(kThreads);
  std::vector<std::shared_ptr<const CompiledKernel>> got(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      if (start->Block()) delete start;
      auto k = cache.GetForConfig(config, "sm_90");
      if (k.ok()) got[t] = *k;
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(cache.counters().compiles, 1);
  EXPECT_EQ(cache.counters().disk_writes, 1);
  EXPECT_EQ(cache.counters().memory_hits, kThreads - 1);
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_NE(got[t], nullptr) << t;
    EXPECT_EQ(got[t].get(), got[0].get());
  }
}

TEST(KernelCacheTest, DifferentKeysCompileInParallelEachOnce) {
  TempDir dir;
  KernelCache cache(StandInOptions(dir.path()));
  const std::vector<KernelConfig> configs = DistinctConfigs(4);
  constexpr int kPerKey = 4;
  const int n = static_cast<int>(configs.size()) * kPerKey;
  absl::Barrier* start = new absl::Barrier(n);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < n; ++t) {
    threads.emplace_back([&, t] {
      if (start->Block()) delete start;
      if (!cache.GetForConfig(configs[t % configs.size()], "sm_90").ok()) ++failures;
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(cache.counters().compiles, static_cast<int64_t>(configs.size()));
  EXPECT_EQ(ListFiles(dir.Join("kernels")).size(), configs.size());
}

TEST(KernelCacheTest, TwoProcessesRacingBothSucceedAndLeaveOneEntry) {
  TempDir dir;
  const KernelConfig config = RandomValidConfig(Rng());
  // Both children wait on a pipe, then start together.
  int go[2];
  ASSERT_EQ(::pipe(go), 0);
  std::vector<std::thread> parents;
  std::atomic<int> codes[2];
  for (int p = 0; p < 2; ++p) {
    parents.emplace_back([&, p] {
      codes[p] = jit_test::RunInChild([&] {
        char c;
        if (::read(go[0], &c, 1) != 1) return 5;
        KernelCache cache(StandInOptions(dir.path()));
        auto k = cache.GetForConfig(config, "sm_90");
        if (!k.ok()) return 1;
        if ((*k)->cubin.empty()) return 2;
        // Report whether this process compiled: the key lock makes exactly one of them do it.
        return 100 * static_cast<int>(cache.counters().compiles);
      });
    });
  }
  ::usleep(100 * 1000);
  ASSERT_EQ(::write(go[1], "ab", 2), 2);
  for (auto& t : parents) t.join();
  ::close(go[0]);
  ::close(go[1]);
  EXPECT_EQ(codes[0].load() % 100, 0) << codes[0].load();
  EXPECT_EQ(codes[1].load() % 100, 0) << codes[1].load();
  EXPECT_EQ(codes[0].load() / 100 + codes[1].load() / 100, 1) << "compiles in the two processes";
  const std::vector<std::string> files = ListFiles(dir.Join("kernels"));
  ASSERT_EQ(files.size(), 1u) << "temporary files or duplicates left behind";
  DiskCache disk(dir.path());
  auto list = disk.List(/*verify=*/true);
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  EXPECT_TRUE((*list)[0].status.ok()) << (*list)[0].status;
}

TEST(KernelCacheTest, SizeCapEvictsLeastRecentlyUsed) {
  TempDir dir;
  const std::vector<KernelConfig> configs = DistinctConfigs(4);
  // Measure every entry, then allow the two newest plus half of the smallest: three never fit.
  std::vector<int64_t> sizes;
  {
    TempDir probe;
    KernelCache cache(StandInOptions(probe.path()));
    for (const KernelConfig& c : configs) {
      auto k = cache.GetForConfig(c, "sm_90");
      ASSERT_TRUE(k.ok());
      sizes.push_back(FileSize(EntryPath(probe.path(), (*k)->key)));
    }
  }
  const int64_t smallest = *std::min_element(sizes.begin(), sizes.end());
  KernelCacheOptions o = StandInOptions(dir.path());
  o.max_disk_bytes = sizes[2] + sizes[3] + smallest / 2;
  KernelCache cache(o);
  std::vector<std::string> keys;
  for (size_t i = 0; i < configs.size(); ++i) {
    auto k = cache.GetForConfig(configs[i], "sm_90");
    ASSERT_TRUE(k.ok());
    keys.push_back((*k)->key);
    // Distinct mtimes even on coarse clocks: entry i was used at time 1e9 + i.
    struct timespec t[2] = {{static_cast<time_t>(1000000000 + i), 0},
                            {static_cast<time_t>(1000000000 + i), 0}};
    ::utimensat(AT_FDCWD, EntryPath(dir.path(), keys.back()).c_str(), t, 0);
  }
  // At most two fit, and the newest always stays.
  const std::vector<std::string> files = ListFiles(dir.Join("kernels"));
  EXPECT_LE(files.size(), 2u);
  EXPECT_GT(FileSize(EntryPath(dir.path(), keys[3])), 0);
  EXPECT_EQ(FileSize(EntryPath(dir.path(), keys[0])), -1);
  EXPECT_EQ(FileSize(EntryPath(dir.path(), keys[1])), -1);
}

TEST(KernelCacheTest, ACapBelowOneEntryKeepsTheEntryJustWritten) {
  // A cap smaller than any entry (GEMVZ_CACHE_MAX_BYTES=1K) evicts every other entry, but never
  // the one just published: without it on disk every process would compile the kernel again.
  TempDir dir;
  KernelCacheOptions o = StandInOptions(dir.path());
  o.max_disk_bytes = 1;
  KernelCache cache(o);
  for (const KernelConfig& c : DistinctConfigs(2)) {
    SCOPED_TRACE(c.KernelName());
    auto k = cache.GetForConfig(c, "sm_90");
    ASSERT_TRUE(k.ok()) << k.status();
    EXPECT_EQ(ListFiles(dir.Join("kernels")), std::vector<std::string>{(*k)->key + ".gemvzk"});
    // The next process (here: this one without its memory) finds it.
    cache.DropMemoryForTesting();
    cache.ResetCounters();
    CacheSource source;
    ASSERT_TRUE(cache.GetForConfig(c, "sm_90", &source).ok());
    EXPECT_EQ(source, CacheSource::kDisk);
    EXPECT_EQ(cache.counters().compiles, 0);
  }
}

TEST(KernelCacheTest, InvalidConfigurationIsRefusedBeforeNvrtc) {
  TempDir dir;
  KernelCache cache(StandInOptions(dir.path()));
  KernelConfig c;
  c.nb = 3 + static_cast<int>(Rng()() % 2);
  c.nw = c.nb - 1;  // breaks NW >= NB
  auto k = cache.GetForConfig(c, "sm_90");
  ASSERT_FALSE(k.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(k.status()));
  EXPECT_NE(std::string(k.status().message()).find("NW >= NB"), std::string::npos) << k.status();
  KernelConfig pipe;
  pipe.pipe = 14 + static_cast<int>(Rng()() % 10);  // 0..13 are valid
  auto p = cache.GetForConfig(pipe, "sm_90");
  ASSERT_FALSE(p.ok());
  EXPECT_NE(std::string(p.status().message()).find("PIPE"), std::string::npos) << p.status();
  EXPECT_EQ(cache.counters().compiles, 0);
  EXPECT_EQ(cache.counters().compile_failures, 0);
  EXPECT_TRUE(ListFiles(dir.Join("kernels")).empty());
  // A bad architecture is refused before NVRTC too.
  auto arch = cache.GetForConfig(KernelConfig{}, "sm90");
  ASSERT_FALSE(arch.ok());
  EXPECT_NE(std::string(arch.status().message()).find("sm90"), std::string::npos);
  EXPECT_EQ(cache.counters().compile_failures, 0);
}

TEST(KernelCacheTest, FailedCompileIsReportedAndRetried) {
  auto files = jit_test::StandInKernelFiles();
  for (auto& [name, text] : files) {
    if (name == "bf16_gemv.cuh") text += "\n#error deliberately broken\n";
  }
  KernelCacheOptions o = StandInOptions("");
  o.sources = SourceSet::FromFiles(files);
  KernelCache cache(o);
  KernelConfig c;
  c.format = WeightFormat::kBf16;
  for (int attempt = 1; attempt <= 2; ++attempt) {
    auto k = cache.GetForConfig(c, "sm_90");
    ASSERT_FALSE(k.ok());
    EXPECT_NE(std::string(k.status().message()).find("deliberately broken"), std::string::npos);
    EXPECT_EQ(cache.counters().compile_failures, attempt);
  }
  // The other kernel of the same sources is fine.
  EXPECT_TRUE(cache.GetForConfig(KernelConfig{}, "sm_90").ok());
}

TEST(KernelCacheTest, DumpDirectoryGetsSourcePtxAndReport) {
  TempDir dir, dump;
  KernelCacheOptions o = StandInOptions(dir.path());
  o.dump_directory = dump.Join("nested/dumps");
  KernelCache cache(o);
  const KernelConfig c = RandomValidConfig(Rng());
  auto k = cache.GetForConfig(c, "sm_90");
  ASSERT_TRUE(k.ok());
  const std::string base =
      absl::StrCat(dump.Join("nested/dumps/"), c.KernelName(), ".sm_90.", (*k)->key.substr(0, 12));
  auto cu = ReadFile(base + ".cu");
  auto ptx = ReadFile(base + ".ptx");
  auto report = ReadFile(base + ".ptxas.txt");
  ASSERT_TRUE(cu.ok() && ptx.ok() && report.ok()) << base;
  EXPECT_NE(cu->find("#include"), std::string::npos);
  EXPECT_NE(ptx->find("mma.sync"), std::string::npos);
  EXPECT_NE(report->find("registers"), std::string::npos);
  EXPECT_NE(report->find("--gpu-architecture=sm_90"), std::string::npos);
  // A disk hit compiles nothing and dumps nothing new.
  cache.DropMemoryForTesting();
  ASSERT_TRUE(cache.GetForConfig(c, "sm_90").ok());
  EXPECT_EQ(ListFiles(dump.Join("nested/dumps")).size(), 3u);
}

TEST(KernelCacheTest, GpuEntryPointsWithoutDriverSayWhy) {
  if (DeviceCount() > 0) GTEST_SKIP() << "a GPU is present; this checks the driverless path";
  TempDir dir;
  KernelCache cache(StandInOptions(dir.path()));
  auto loaded = cache.LoadForConfig(0, KernelConfig{});
  ASSERT_FALSE(loaded.ok());
  EXPECT_FALSE(std::string(loaded.status().message()).empty());
  EXPECT_EQ(cache.counters().compiles, 0) << "no compile for a launch that cannot happen";
  auto arch = DeviceArch(0);
  EXPECT_FALSE(arch.ok());
  auto by_name = GetKernelByName(0, "bandwidth_probe.cuh", "gemvz_bandwidth_probe<4, 256>");
  EXPECT_FALSE(by_name.ok());
  // Compiling still works.
  EXPECT_TRUE(cache.GetForConfig(KernelConfig{}, "sm_90").ok());
}

// GEMVZ_ARCH is read at every call (a warm-up may go from one target to the next by changing it);
// only what a device reports is cached, and a value set once does not stick after it is unset.
TEST(KernelCacheTest, GemvzArchIsReadAtEveryCall) {
  std::string own;  // the device's own, where there is one
  if (DeviceCount() > 0) {
    ScopedEnv env("GEMVZ_ARCH", std::nullopt);
    auto device = DeviceArch(0);
    ASSERT_TRUE(device.ok()) << device.status();
    own = *device;
  }
  // Ends on sm_90a, which no device reports as its own.
  for (const char* arch : {"sm_80", "sm_90a", "sm_80", "sm_90a"}) {
    ScopedEnv env("GEMVZ_ARCH", arch);
    auto device = DeviceArch(0);
    ASSERT_TRUE(device.ok()) << device.status();
    EXPECT_EQ(*device, arch);
    auto by_default = DefaultArch(0);
    ASSERT_TRUE(by_default.ok()) << by_default.status();
    EXPECT_EQ(*by_default, arch);
  }
  {
    ScopedEnv env("GEMVZ_ARCH", "sm_foo");
    EXPECT_NE(DeviceArch(0).status().message().find("GEMVZ_ARCH: "), std::string::npos);
  }
  ScopedEnv env("GEMVZ_ARCH", std::nullopt);
  if (!own.empty()) {
    auto device = DeviceArch(0);
    ASSERT_TRUE(device.ok()) << device.status();
    EXPECT_EQ(*device, own) << "the device's own architecture, not the last GEMVZ_ARCH";
  } else {
    EXPECT_FALSE(DeviceArch(0).ok()) << "no GPU, no GEMVZ_ARCH: nothing to report";
    auto by_default = DefaultArch(0);
    ASSERT_TRUE(by_default.ok()) << by_default.status();
    EXPECT_EQ(*by_default, "sm_90");
  }
}

TEST(KernelCacheTest, UnknownSourceFileIsNamed) {
  KernelCache cache(StandInOptions(""));
  CompileRequest r;
  r.arch = "sm_90";
  r.source_file = "nope.cuh";
  r.name_expression = "k<1>";
  r.kernel_name = "nope";
  auto k = cache.Get(r);
  ASSERT_FALSE(k.ok());
  EXPECT_TRUE(absl::IsNotFound(k.status()));
  EXPECT_NE(std::string(k.status().message()).find("nope.cuh"), std::string::npos);
  EXPECT_NE(std::string(k.status().message()).find("z12_gemv.cuh"), std::string::npos);
}

TEST(KernelCacheTest, GlobalCacheFollowsGemvzCacheDir) {
  TempDir dir;
  ScopedEnv off("GEMVZ_DISABLE_DISK_CACHE", std::nullopt);
  ScopedEnv cache_dir("GEMVZ_CACHE_DIR", dir.path());
  EXPECT_EQ(CacheDirectory(), dir.path());
  const JitCounters before = GetJitCounters();
  // The real bf16 kernel, through the public warm-up entry point.
  KernelConfig c;
  c.format = WeightFormat::kBf16;
  c.nw = 4;
  c.nb = 1;
  c.ug = 1;
  c.pipe = 0;
  absl::StatusOr<PrecompileResult> r = Precompile(c, "sm_90");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->from_disk);
  EXPECT_GT(r->registers, 0);
  EXPECT_EQ(GetJitCounters().compiles, before.compiles + 1);
  EXPECT_EQ(ListFiles(dir.Join("kernels")).size(), 1u);
  absl::StatusOr<PrecompileResult> again = Precompile(c, "sm_90");
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->from_disk);
  EXPECT_EQ(GetJitCounters().compiles, before.compiles + 1);
}

}  // namespace
}  // namespace gemvz::internal
