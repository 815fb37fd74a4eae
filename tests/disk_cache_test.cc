// Disk cache: entries round-trip, and every kind of damage (truncation, flipped bytes, a field
// longer than the rest of the payload, wrong key, bad magic or version) is detected; hits refresh
// the LRU clock; eviction removes the least recently used first; an unwritable directory degrades
// with one warning; the directory comes from the environment as documented.
#include "runtime/jit/disk_cache.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gemvz/runtime.h"
#include "gtest/gtest.h"
#include "runtime/common/file_util.h"
#include "runtime/common/hash.h"
#include "tests/support/fail_readdir.h"
#include "tests/support/jit_test_util.h"

namespace gemvz::internal {
namespace {

using ::gemvz::jit_test::CountOccurrences;
using ::gemvz::jit_test::FileSize;
using ::gemvz::jit_test::Rng;
using ::gemvz::jit_test::ScopedEnv;
using ::gemvz::jit_test::TempDir;

std::string RandomBytes(size_t n) {
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(Rng()() & 0xff);
  return s;
}

// A fake kernel with a fresh random key and random binary contents.
CompiledKernel RandomKernel(size_t cubin_bytes = 4096) {
  CompiledKernel k;
  k.key = Sha256().Update(RandomBytes(32)).HexFinish();
  k.arch = Rng()() % 2 ? "sm_90" : "sm_90a";
  k.kernel_name = "z12.nw8.ug2.nb2.pipe3";
  k.name_expression = "gemvz_z12_kernel<8, 2, 2, 3>";
  k.lowered_name = "_Z16gemvz_z12_kernelILi8ELi2ELi2ELi3EEv9Z12Params";
  k.cubin = RandomBytes(cubin_bytes);
  k.ptx = "// ptx\nmma.sync.aligned " + RandomBytes(64);
  k.log = "ptxas info    : Used 116 registers";
  k.registers = static_cast<int>(Rng()() % 255);
  k.spill_bytes = static_cast<int>(Rng()() % 100);
  k.shared_bytes = static_cast<int>(Rng()() % 40000);
  k.compile_ms = 123.456;
  return k;
}

void ExpectSameKernel(const CompiledKernel& a, const CompiledKernel& b) {
  EXPECT_EQ(a.key, b.key);
  EXPECT_EQ(a.arch, b.arch);
  EXPECT_EQ(a.kernel_name, b.kernel_name);
  EXPECT_EQ(a.name_expression, b.name_expression);
  EXPECT_EQ(a.lowered_name, b.lowered_name);
  EXPECT_EQ(a.cubin, b.cubin);
  EXPECT_EQ(a.ptx, b.ptx);
  EXPECT_EQ(a.log, b.log);
  EXPECT_EQ(a.registers, b.registers);
  EXPECT_EQ(a.spill_bytes, b.spill_bytes);
  EXPECT_EQ(a.shared_bytes, b.shared_bytes);
  EXPECT_NEAR(a.compile_ms, b.compile_ms, 0.001);
}

void SetMtime(const std::string& path, time_t seconds) {
  struct timespec times[2] = {{seconds, 0}, {seconds, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0) << path;
}

TEST(DiskEntryTest, RoundTrips) {
  const CompiledKernel k = RandomKernel(1 + Rng()() % 100000);
  DiskEntryMeta meta;
  absl::StatusOr<CompiledKernel> back = ParseEntry(SerializeEntry(k), k.key, &meta);
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSameKernel(k, *back);
  EXPECT_FALSE(meta.nvrtc_version.empty());
  EXPECT_FALSE(meta.library_version.empty());
  EXPECT_GT(meta.created_unix, 1600000000);
}

TEST(DiskEntryTest, EveryTruncationIsDetected) {
  const CompiledKernel k = RandomKernel(512);
  const std::string bytes = SerializeEntry(k);
  // Every length short of the whole entry, including the header boundary.
  for (size_t n = 0; n < bytes.size(); n += 1 + Rng()() % 7) {
    absl::StatusOr<CompiledKernel> r = ParseEntry(std::string_view(bytes).substr(0, n), k.key);
    ASSERT_FALSE(r.ok()) << "length " << n;
    EXPECT_TRUE(absl::IsDataLoss(r.status())) << r.status();
    EXPECT_NE(std::string(r.status().message()).find("truncated"), std::string::npos)
        << n << ": " << r.status();
  }
  EXPECT_FALSE(ParseEntry(bytes + "x", k.key).ok());
}

TEST(DiskEntryTest, EveryFlippedByteIsDetected) {
  const CompiledKernel k = RandomKernel(256);
  const std::string bytes = SerializeEntry(k);
  for (int trial = 0; trial < 300; ++trial) {
    std::string bad = bytes;
    const size_t at = Rng()() % bad.size();
    bad[at] = static_cast<char>(bad[at] ^ (1 + Rng()() % 255));
    absl::StatusOr<CompiledKernel> r = ParseEntry(bad, k.key);
    EXPECT_FALSE(r.ok()) << "byte " << at << " flipped unnoticed";
  }
}

TEST(DiskEntryTest, SpecificDamageIsNamed) {
  const CompiledKernel k = RandomKernel(128);
  const std::string bytes = SerializeEntry(k);
  std::string bad_magic = bytes;
  bad_magic[0] = 'X';
  EXPECT_NE(std::string(ParseEntry(bad_magic, k.key).status().message()).find("magic"),
            std::string::npos);
  std::string bad_version = bytes;
  bad_version[8] = static_cast<char>(kDiskEntryVersion + 1);
  EXPECT_NE(std::string(ParseEntry(bad_version, k.key).status().message()).find("version"),
            std::string::npos);
  std::string bad_payload = bytes;
  bad_payload[bytes.size() - 1] ^= 0x40;
  EXPECT_NE(std::string(ParseEntry(bad_payload, k.key).status().message()).find("checksum"),
            std::string::npos);
  const std::string other_key = RandomKernel(1).key;
  absl::Status wrong = ParseEntry(bytes, other_key).status();
  EXPECT_NE(std::string(wrong.message()).find("wrong key"), std::string::npos) << wrong;
  // Without an expected key (cache list), the entry is accepted.
  EXPECT_TRUE(ParseEntry(bytes, "").ok());
}

// `entry` with its header's payload size and checksum made to match the bytes after the header:
// damage that the checksum cannot see, as a writer with a bug (or a hand-made file) would produce.
std::string Resealed(std::string entry) {
  const uint64_t size = entry.size() - 24;
  for (int i = 0; i < 8; ++i) entry[16 + i] = static_cast<char>(size >> (8 * i));
  const uint32_t crc = Crc32c(entry.data() + 24, size);
  for (int i = 0; i < 4; ++i) entry[12 + i] = static_cast<char>(crc >> (8 * i));
  return entry;
}

// Replaces the u64 at `offset` of an entry, resealed.
std::string WithU64(std::string entry, size_t offset, uint64_t v) {
  for (int i = 0; i < 8; ++i) entry[offset + i] = static_cast<char>(v >> (8 * i));
  return Resealed(std::move(entry));
}

TEST(DiskEntryTest, AFieldLongerThanWhatRemainsIsRefused) {
  const CompiledKernel k = RandomKernel(64 + Rng()() % 512);
  const std::string bytes = SerializeEntry(k);
  const size_t payload = bytes.size() - 24;
  ASSERT_TRUE(ParseEntry(WithU64(bytes, 24, k.key.size()), k.key).ok());  // the helper is sound
  struct Case {
    const char* field;
    size_t offset;   // of the field's length
    uint64_t claim;  // more than remains after the length, but within the payload
  };
  const size_t cubin_at = bytes.size() - k.cubin.size() - 8;  // the last field
  const Case cases[] = {
      {"key", 24, payload - 8 + 1 + Rng()() % 8},
      {"cubin", cubin_at, k.cubin.size() + 1},
      {"cubin", cubin_at, payload},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat(c.field, " claims ", c.claim));
    ASSERT_LE(c.claim, payload);
    const std::string bad = WithU64(bytes, c.offset, c.claim);
    // Within a longer buffer, so that a parser reading past the entry reads zeros of ours, and
    // fails this test rather than the process.
    const std::string padded = bad + std::string(4096, '\0');
    absl::StatusOr<CompiledKernel> r =
        ParseEntry(std::string_view(padded).substr(0, bad.size()), k.key);
    ASSERT_FALSE(r.ok());
    EXPECT_TRUE(absl::IsDataLoss(r.status())) << r.status();
    EXPECT_NE(std::string(r.status().message())
                  .find(absl::StrCat("field '", c.field, "' claims ", c.claim, " bytes")),
              std::string::npos)
        << r.status();
  }
}

// Keys are lowercase SHA-256 hex digests. An entry whose key is not one is refused even where no
// key is expected (cache list and verify), and a file whose name is not one is listed as bad
// (so that verify names it and clear removes it), whatever it holds.
TEST(DiskEntryTest, AKeyThatIsNotHexIsRefused) {
  const CompiledKernel k = RandomKernel(64);
  for (const std::string& key : {std::string(64, 'g'), std::string(64, 'z'), std::string(64, 'A'),
                                 k.key.substr(0, 63) + "g", k.key.substr(0, 63), k.key + "0"}) {
    CompiledKernel bad = k;
    bad.key = key;
    absl::StatusOr<CompiledKernel> r = ParseEntry(SerializeEntry(bad), "");
    ASSERT_FALSE(r.ok()) << key;
    EXPECT_TRUE(absl::IsDataLoss(r.status())) << r.status();
    EXPECT_NE(std::string(r.status().message()).find("not a 64-digit hex digest"),
              std::string::npos)
        << r.status();
  }
}

// The fields end the payload: bytes after them, which the header's size and checksum cover (a
// writer with a bug, or of another layout under the same version), are refused.
TEST(DiskEntryTest, BytesAfterTheLastFieldAreRefused) {
  const CompiledKernel k = RandomKernel(64 + Rng()() % 512);
  const std::string bytes = SerializeEntry(k);
  ASSERT_TRUE(ParseEntry(Resealed(bytes), k.key).ok());  // the helper is sound
  for (const std::string& extra : {std::string(1, '\0'), std::string("x"), std::string(8, '\0')}) {
    absl::StatusOr<CompiledKernel> r = ParseEntry(Resealed(bytes + extra), k.key);
    ASSERT_FALSE(r.ok()) << extra.size() << " bytes more";
    EXPECT_TRUE(absl::IsDataLoss(r.status())) << r.status();
    EXPECT_NE(std::string(r.status().message()).find("unexpected bytes after the last field"),
              std::string::npos)
        << r.status();
  }
}

// registers and spill_bytes are -1 in an entry written while ptxas's report was missing (the
// reader then takes them from the cubin); below -1 or above 2^30, a count is damage.
TEST(DiskEntryTest, CountsOutOfRangeAreRefused) {
  using Field = int CompiledKernel::*;
  const std::pair<const char*, Field> fields[] = {
      {"registers", &CompiledKernel::registers},
      {"spill_bytes", &CompiledKernel::spill_bytes},
      {"shared_bytes", &CompiledKernel::shared_bytes},
  };
  for (const auto& [name, field] : fields) {
    for (const int v : {-1, 0, 1 << 30}) {
      CompiledKernel k = RandomKernel(64);
      k.*field = v;
      absl::StatusOr<CompiledKernel> r = ParseEntry(SerializeEntry(k), k.key);
      EXPECT_TRUE(r.ok()) << name << " = " << v << ": " << r.status();
    }
    for (const int v : {-2, -1000, std::numeric_limits<int>::min(), (1 << 30) + 1}) {
      CompiledKernel k = RandomKernel(64);
      k.*field = v;
      absl::StatusOr<CompiledKernel> r = ParseEntry(SerializeEntry(k), k.key);
      ASSERT_FALSE(r.ok()) << name << " = " << v;
      EXPECT_TRUE(absl::IsDataLoss(r.status())) << r.status();
      EXPECT_NE(std::string(r.status().message())
                    .find(absl::StrCat("field '", name, "' out of range (", v, ")")),
                std::string::npos)
          << r.status();
    }
  }
}

// An entry is loaded by its cubin and the lowered name of its kernel in it: one written without
// either (a writer with a bug) is refused, never a hit that fails at load or launch.
TEST(DiskEntryTest, AnEntryWithoutACubinOrALoweredNameIsRefused) {
  CompiledKernel k = RandomKernel(64);
  k.cubin.clear();
  absl::StatusOr<CompiledKernel> r = ParseEntry(SerializeEntry(k), k.key);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(absl::IsDataLoss(r.status())) << r.status();
  EXPECT_NE(std::string(r.status().message()).find("empty cubin"), std::string::npos) << r.status();
  k = RandomKernel(64);
  k.lowered_name.clear();
  r = ParseEntry(SerializeEntry(k), k.key);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(absl::IsDataLoss(r.status())) << r.status();
  EXPECT_NE(std::string(r.status().message()).find("empty lowered name"), std::string::npos)
      << r.status();
}

TEST(DiskCacheTest, AFileNamedForAKeyThatIsNotHexIsABadEntry) {
  TempDir dir;
  DiskCache cache(dir.path());
  const CompiledKernel good = RandomKernel(64);
  ASSERT_TRUE(cache.Write(good).ok());
  CompiledKernel stray = RandomKernel(64);
  stray.key = std::string(64, 'g');  // an entry of its own name, but not a digest
  ASSERT_TRUE(AtomicWriteFile(cache.EntryPath(stray.key), SerializeEntry(stray)).ok());
  for (const bool verify : {false, true}) {
    absl::StatusOr<std::vector<DiskEntryInfo>> list = cache.List(verify);
    ASSERT_TRUE(list.ok()) << list.status();
    ASSERT_EQ(list->size(), 2u);
    for (const DiskEntryInfo& e : *list) {
      if (e.key == good.key) {
        EXPECT_TRUE(e.status.ok()) << e.status;
        continue;
      }
      EXPECT_EQ(e.key, stray.key);
      EXPECT_TRUE(absl::IsDataLoss(e.status)) << verify << ": " << e.status;
      EXPECT_NE(std::string(e.status.message()).find("not <64 hex digits>.gemvzk"),
                std::string::npos)
          << verify << ": " << e.status;
    }
  }
  absl::StatusOr<int> cleared = cache.Clear();
  ASSERT_TRUE(cleared.ok()) << cleared.status();
  EXPECT_EQ(*cleared, 2);
  EXPECT_TRUE(jit_test::ListFiles(dir.Join("kernels")).empty());
}

TEST(DiskCacheTest, WriteThenReadAndTouch) {
  TempDir dir;
  DiskCache cache(dir.path());
  const CompiledKernel k = RandomKernel();
  ASSERT_TRUE(cache.Write(k).ok());
  EXPECT_FALSE(cache.read_only());
  const std::string path = cache.EntryPath(k.key);
  EXPECT_EQ(path, absl::StrCat(dir.path(), "/kernels/", k.key, ".gemvzk"));
  SetMtime(path, 1000000000);
  CompiledKernel back;
  std::string reason;
  ASSERT_EQ(cache.Read(k.key, &back, &reason, true), DiskCache::Lookup::kHit) << reason;
  ExpectSameKernel(k, back);
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_GT(st.st_mtime, 1000000000) << "a hit must refresh the LRU clock";
  // Only the entry: no temporary files left behind.
  EXPECT_EQ(jit_test::ListFiles(dir.Join("kernels")), std::vector<std::string>{k.key + ".gemvzk"});
  EXPECT_EQ(cache.Read(RandomKernel(1).key, &back, &reason, true), DiskCache::Lookup::kMissing);
}

TEST(DiskCacheTest, BadEntriesAreRejectedAndRemovedWithOneWarning) {
  TempDir dir;
  DiskCache cache(dir.path());
  for (int kind = 0; kind < 3; ++kind) {
    SCOPED_TRACE(kind);
    const CompiledKernel k = RandomKernel();
    ASSERT_TRUE(cache.Write(k).ok());
    const std::string path = cache.EntryPath(k.key);
    if (kind == 0) jit_test::TruncateFile(path, Rng()() % FileSize(path));
    if (kind == 1) jit_test::FlipByte(path, Rng()() % FileSize(path), 0x10);
    if (kind == 2) {  // another key's valid entry under this key's name
      const CompiledKernel other = RandomKernel();
      ASSERT_TRUE(AtomicWriteFile(path, SerializeEntry(other)).ok());
    }
    CompiledKernel out;
    std::string reason;
    // Without remove_bad the entry stays (the miss path removes it under the key lock).
    EXPECT_EQ(cache.Read(k.key, &out, &reason, false), DiskCache::Lookup::kRejected);
    EXPECT_FALSE(reason.empty());
    EXPECT_EQ(FileSize(path) >= 0, true);
    testing::internal::CaptureStderr();
    EXPECT_EQ(cache.Read(k.key, &out, &reason, true), DiskCache::Lookup::kRejected);
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_EQ(CountOccurrences(err, "is invalid"), 1) << err;
    EXPECT_EQ(FileSize(path), -1) << "a bad entry must be removed";
    EXPECT_EQ(cache.Read(k.key, &out, &reason, true), DiskCache::Lookup::kMissing);
  }
}

TEST(DiskCacheTest, UnwritableDirectoryDegradesWithOneWarning) {
  TempDir dir;
  // A path below a regular file cannot be created, even by root (chmod would not stop root).
  ASSERT_TRUE(AtomicWriteFile(dir.Join("plain_file"), "x").ok());
  DiskCache cache(dir.Join("plain_file/cache"));
  testing::internal::CaptureStderr();
  EXPECT_FALSE(cache.Write(RandomKernel()).ok());
  EXPECT_TRUE(cache.read_only());
  EXPECT_FALSE(cache.Write(RandomKernel()).ok());
  EXPECT_EQ(cache.LockKey(RandomKernel(1).key), nullptr);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(CountOccurrences(err, "not writable"), 1) << err;
  EXPECT_NE(err.find("plain_file/cache"), std::string::npos) << err;
}

TEST(DiskCacheTest, ReadOnlyDirectoryStillServesHits) {
  TempDir dir;
  DiskCache writer(dir.path());
  const CompiledKernel k = RandomKernel();
  ASSERT_TRUE(writer.Write(k).ok());
  ASSERT_EQ(::chmod(dir.path().c_str(), 0755), 0);  // others may enter (see below)
  ASSERT_EQ(::chmod(dir.Join("kernels").c_str(), 0555), 0);
  // Root ignores permissions, so the reader runs in a child that gives up root if it has it.
  const std::string err_path = dir.Join("stderr.txt");
  ASSERT_TRUE(AtomicWriteFile(err_path, "").ok());
  ASSERT_EQ(::chmod(err_path.c_str(), 0666), 0);  // the child may not be its owner
  const int code = jit_test::RunInChild([&] {
    if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) return 10;
    const int fd = ::open(err_path.c_str(), O_WRONLY | O_TRUNC);
    if (fd < 0 || ::dup2(fd, 2) < 0) return 11;
    DiskCache cache(dir.path());
    CompiledKernel out;
    std::string reason;
    if (cache.Read(k.key, &out, &reason, true) != DiskCache::Lookup::kHit) return 12;
    if (out.cubin != k.cubin) return 13;
    if (cache.Write(RandomKernel()).ok()) return 14;
    if (!cache.read_only()) return 15;
    if (cache.Write(RandomKernel()).ok()) return 16;
    return 0;
  });
  ::chmod(dir.Join("kernels").c_str(), 0755);
  EXPECT_EQ(code, 0);
  absl::StatusOr<std::string> err = ReadFile(err_path);
  ASSERT_TRUE(err.ok()) << err.status();
  EXPECT_EQ(CountOccurrences(*err, "not writable"), 1) << *err;
}

TEST(DiskCacheTest, PruneEvictsLeastRecentlyUsedFirst) {
  TempDir dir;
  DiskCache cache(dir.path());
  std::vector<CompiledKernel> ks;
  for (int i = 0; i < 5; ++i) {
    ks.push_back(RandomKernel(1000 + Rng()() % 1000));
    ASSERT_TRUE(cache.Write(ks.back()).ok());
    SetMtime(cache.EntryPath(ks.back().key), 1000000000 + 100 * i);  // 0 oldest ... 4 newest
  }
  // Use entry 0: it becomes the most recent.
  CompiledKernel out;
  std::string reason;
  ASSERT_EQ(cache.Read(ks[0].key, &out, &reason, true), DiskCache::Lookup::kHit);
  auto size = [&](int i) { return FileSize(cache.EntryPath(ks[i].key)); };
  // Room for entries 0, 4 and 3 only: 1 and 2 are the least recently used.
  const int64_t cap = size(0) + size(4) + size(3);
  absl::StatusOr<PruneResult> r = cache.Prune(cap);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->removed, 2);
  EXPECT_EQ(r->removed_bytes + r->kept_bytes, cap + r->removed_bytes);
  EXPECT_EQ(size(1), -1);
  EXPECT_EQ(size(2), -1);
  EXPECT_GT(size(0), 0);
  EXPECT_GT(size(3), 0);
  EXPECT_GT(size(4), 0);
  // The kept key survives even when the cap is below its own size.
  ASSERT_TRUE(cache.Prune(1, ks[3].key).ok());
  EXPECT_GT(size(3), 0);
  EXPECT_EQ(size(0), -1);
  EXPECT_EQ(size(4), -1);
}

// Writes `n` random kernels of cubin_bytes + 0, 1, ... bytes into `cache`, appended to `out`.
void WriteKernels(DiskCache& cache, int n, size_t cubin_bytes, std::vector<CompiledKernel>* out) {
  for (int i = 0; i < n; ++i) {
    out->push_back(RandomKernel(cubin_bytes + i));
    ASSERT_TRUE(cache.Write(out->back()).ok());
  }
}

TEST(DiskCacheTest, ListVerifyAndClear) {
  TempDir dir;
  DiskCache cache(dir.path());
  std::vector<CompiledKernel> ks;
  ASSERT_NO_FATAL_FAILURE(WriteKernels(cache, 4, 100, &ks));
  jit_test::FlipByte(cache.EntryPath(ks[2].key), 30, 0x01);
  absl::StatusOr<std::vector<DiskEntryInfo>> list = cache.List(/*verify=*/true);
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->size(), 4u);
  int bad = 0;
  for (const DiskEntryInfo& e : *list) {
    if (e.key == ks[2].key) {
      EXPECT_FALSE(e.status.ok());
      ++bad;
    } else {
      EXPECT_TRUE(e.status.ok()) << e.status;
      EXPECT_EQ(e.kernel_name, "z12.nw8.ug2.nb2.pipe3");
      EXPECT_EQ(e.size_bytes, FileSize(e.path));
    }
  }
  EXPECT_EQ(bad, 1);
  absl::StatusOr<int> cleared = cache.Clear();
  ASSERT_TRUE(cleared.ok());
  EXPECT_EQ(*cleared, 4);
  EXPECT_TRUE(cache.List(false)->empty());
}

// A listing that fails part way (EIO from a network file system) is an error naming the
// directory, not the end of the listing: list and verify would pass entries they never read, and
// clear would report success with entries left. The listing's last errno is not mistaken for one.
TEST(DiskCacheTest, AListingThatFailsPartWayIsAnErrorNotTheEnd) {
  TempDir dir;
  DiskCache cache(dir.path());
  std::vector<CompiledKernel> ks;
  ASSERT_NO_FATAL_FAILURE(WriteKernels(cache, 3, 200, &ks));
  // ".", ".." and three entries: failing after each of the first four.
  for (int read = 0; read < 5; ++read) {
    SCOPED_TRACE(absl::StrCat("fails after ", read, " entries"));
    g_readdir_error = EIO;
    g_readdir_entries_left = read;
    absl::StatusOr<std::vector<DiskEntryInfo>> list = cache.List(/*verify=*/true);
    g_readdir_entries_left = read;
    absl::StatusOr<int> cleared = cache.Clear();
    g_readdir_entries_left = -1;
    ASSERT_FALSE(list.ok()) << "listed " << list->size() << " of 3 entries";
    EXPECT_EQ(list.status().code(), absl::StatusCode::kUnavailable) << list.status();
    EXPECT_NE(list.status().message().find(std::strerror(EIO)), std::string::npos) << list.status();
    ASSERT_FALSE(cleared.ok()) << "cleared " << *cleared << " of 3 entries";
    EXPECT_EQ(cleared.status().code(), absl::StatusCode::kUnavailable) << cleared.status();
    ASSERT_EQ(cache.List(false).value_or(std::vector<DiskEntryInfo>{}).size(), 3u);
  }
  errno = EIO;
  absl::StatusOr<int> cleared = cache.Clear();
  ASSERT_TRUE(cleared.ok()) << cleared.status();
  EXPECT_EQ(*cleared, 3);
}

// What else may lie under an entry's name in a shared directory: a FIFO (which used to block the
// reader forever), a link to a device (read until memory ran out), a link to nothing (which list
// and verify skipped and clear never removed), a directory with a file in it (which stopped clear
// halfway). Each is a miss for the JIT and a bad entry for list and verify; clear removes what it
// can and then names what it could not.
TEST(DiskCacheTest, WhatIsNotAnEntryUnderAnEntrysNameIsABadEntryNeverAHang) {
  TempDir dir;
  DiskCache cache(dir.path());
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(cache.Write(RandomKernel(200 + i)).ok());
  const std::string fifo = RandomKernel(210).key, zero = RandomKernel(211).key,
                    nowhere = RandomKernel(212).key, folder = RandomKernel(213).key;
  ASSERT_EQ(::mkfifo(cache.EntryPath(fifo).c_str(), 0600), 0);
  ASSERT_EQ(::symlink("/dev/zero", cache.EntryPath(zero).c_str()), 0);
  ASSERT_EQ(::symlink(dir.Join("nothing").c_str(), cache.EntryPath(nowhere).c_str()), 0);
  ASSERT_TRUE(CreateDirectories(cache.EntryPath(folder)).ok());
  ASSERT_TRUE(AtomicWriteFile(cache.EntryPath(folder) + "/inside", "x").ok());
  // In a child: a miss that finds something there warns once per process, and another test
  // checks that once.
  const int code = jit_test::RunInChild([&] {
    for (const std::string& key : {fifo, zero}) {
      CompiledKernel k;
      std::string reason;
      if (cache.Read(key, &k, &reason, false) != DiskCache::Lookup::kMissing) return 1;
      if (reason.find("is not a regular file") == std::string::npos) return 2;
    }
    return 0;
  });
  EXPECT_EQ(code, 0) << "1: not a miss, 2: another reason";
  absl::StatusOr<std::vector<DiskEntryInfo>> list = cache.List(/*verify=*/true);
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->size(), 6u);
  for (const DiskEntryInfo& e : *list) {
    if (e.key == fifo || e.key == zero || e.key == folder) {
      EXPECT_NE(e.status.message().find("is not a regular file"), std::string::npos) << e.status;
    } else if (e.key == nowhere) {
      EXPECT_NE(e.status.message().find("a link that leads nowhere"), std::string::npos)
          << e.status;
    } else {
      EXPECT_TRUE(e.status.ok()) << e.status;
    }
  }
  absl::StatusOr<int> cleared = cache.Clear();
  ASSERT_FALSE(cleared.ok());
  EXPECT_NE(
      cleared.status().message().find("removed 5 entries but could not remove 1, the first '" +
                                      cache.EntryPath(folder) + "'"),
      std::string::npos)
      << cleared.status();
  list = cache.List(/*verify=*/false);
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].key, folder);
}

// An entry that exists but cannot be read (here a directory in its place; a permission or an I/O
// error alike) is a miss with its reason, and one warning per process says so.
TEST(DiskCacheTest, AnUnreadableEntryIsAMissSaidOnce) {
  TempDir dir;
  const std::string key = RandomKernel(1).key;
  ASSERT_TRUE(CreateDirectories(DiskCache(dir.path()).EntryPath(key)).ok());
  // In a child: the warning is once per process, and this binary's other tests may have said it.
  const int code = jit_test::RunInChild([&] {
    DiskCache cache(dir.path());
    CompiledKernel k;
    std::string reason;
    testing::internal::CaptureStderr();
    const bool misses =
        cache.Read(key, &k, &reason, false) == DiskCache::Lookup::kMissing &&
        cache.Read(key, &k, &reason, false) == DiskCache::Lookup::kMissing;
    const std::string err = testing::internal::GetCapturedStderr();
    if (!misses || reason.empty()) return 1;
    if (jit_test::CountOccurrences(err, "warning") != 1) return 2;
    return err.find(key) != std::string::npos ? 0 : 3;
  });
  EXPECT_EQ(code, 0);
}

TEST(DiskCacheTest, KeyLockExcludesAcrossOpenFiles) {
  TempDir dir;
  DiskCache a(dir.path()), b(dir.path());
  const std::string key = RandomKernel(1).key;
  auto held = a.LockKey(key);
  ASSERT_NE(held, nullptr);
  // A second process holding the lock: its flock must block while ours is held.
  const int code = jit_test::RunInChild([&] {
    const std::string lock = absl::StrCat(dir.path(), "/locks/", key, ".lock");
    const int fd = ::open(lock.c_str(), O_RDWR);
    if (fd < 0) return 2;
    return ::flock(fd, LOCK_EX | LOCK_NB) == 0 ? 1 : 0;
  });
  EXPECT_EQ(code, 0) << "the lock did not exclude another process";
  held.reset();
  EXPECT_NE(b.LockKey(key), nullptr);
}

// Whether another open file description can take `key`'s lock now (it is released at once).
bool LockIsFree(const std::string& dir, const std::string& key) {
  const std::string path = absl::StrCat(dir, "/locks/", key, ".lock");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return true;
  const bool free = ::flock(fd, LOCK_EX | LOCK_NB) == 0;
  ::close(fd);
  return free;
}

TEST(DiskCacheTest, KeyLockWaitsForItsHolderButNotForever) {
  TempDir dir;
  DiskCache holder(dir.path()), waiter(dir.path());
  const std::string key = RandomKernel(1).key;
  auto held = holder.LockKey(key);
  ASSERT_NE(held, nullptr);
  // A holder that never lets go (a stopped process): the waiter gives up after its limit, with
  // one warning naming the lock file, and compiles unlocked.
  testing::internal::CaptureStderr();
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(waiter.LockKey(key, absl::Milliseconds(300)), nullptr);
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_GE(waited, 0.3);
  EXPECT_LT(waited, 5.0);
  EXPECT_EQ(jit_test::CountOccurrences(err, "warning"), 1) << err;
  EXPECT_NE(err.find(key + ".lock"), std::string::npos) << err;
  // A holder that lets go within the limit hands the lock over.
  const auto t1 = std::chrono::steady_clock::now();
  std::thread release([&] {
    ::usleep(200 * 1000);
    held.reset();
  });
  auto got = waiter.LockKey(key, absl::Seconds(30));
  const double handed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  release.join();
  ASSERT_NE(got, nullptr);
  EXPECT_GE(handed, 0.15);
  EXPECT_LT(handed, 5.0);
  EXPECT_FALSE(LockIsFree(dir.path(), key));
}

TEST(DiskCacheTest, SweepsNeverRemoveAHeldLock) {
  // A lock file older than the orphan age, whose entry is missing: a process that misses the
  // key now holds it while it compiles. Prune (another process's write) and Clear must not
  // unlink it, or the next process would lock a fresh file and compile the key a second time.
  for (int sweep = 0; sweep < 2; ++sweep) {
    SCOPED_TRACE(sweep == 0 ? "prune" : "clear");
    TempDir dir;
    DiskCache holder(dir.path()), other(dir.path());
    const std::string key = RandomKernel(1).key;
    auto held = holder.LockKey(key);
    ASSERT_NE(held, nullptr);
    const std::string lock = absl::StrCat(dir.path(), "/locks/", key, ".lock");
    SetMtime(lock, std::time(nullptr) - 7200);
    ASSERT_TRUE(sweep == 0 ? other.Prune(int64_t{1} << 30).ok() : other.Clear().ok());
    EXPECT_GE(FileSize(lock), 0) << "a held lock file was removed";
    EXPECT_FALSE(LockIsFree(dir.path(), key)) << "two holders of one key lock";
    held.reset();
    // Unheld and orphaned, it goes.
    ASSERT_TRUE(sweep == 0 ? other.Prune(int64_t{1} << 30).ok() : other.Clear().ok());
    EXPECT_EQ(FileSize(lock), -1);
  }
}

TEST(DiskCacheTest, SweepsLeaveALiveWritersTemporaryFile) {
  // Every compile ends with a Prune, so a sweep often runs while another process is between
  // writing its entry's temporary file and renaming it into place. A young temporary file must
  // stay (removing it fails that writer's rename); one older than any write is a crashed
  // writer's and goes.
  for (int sweep = 0; sweep < 2; ++sweep) {
    SCOPED_TRACE(sweep == 0 ? "prune" : "clear");
    TempDir dir;
    DiskCache cache(dir.path());
    const CompiledKernel k = RandomKernel();
    ASSERT_TRUE(cache.Write(k).ok());
    const std::string live = cache.EntryPath(RandomKernel(1).key) + ".tmp.1234.0";
    const std::string stale = cache.EntryPath(RandomKernel(1).key) + ".tmp.5678.0";
    ASSERT_TRUE(AtomicWriteFile(live, "half of an entry").ok());
    ASSERT_TRUE(AtomicWriteFile(stale, "what a crash left").ok());
    SetMtime(stale, std::time(nullptr) - 2 * 3600);
    ASSERT_TRUE(sweep == 0 ? cache.Prune(int64_t{1} << 30).ok() : cache.Clear().ok());
    EXPECT_GE(FileSize(live), 0) << "a live writer's temporary file was removed";
    EXPECT_EQ(FileSize(stale), -1) << "a crashed writer's temporary file was left";
  }
}

TEST(DiskCacheTest, KeyLockTakenOnARemovedFileIsTakenAgain) {
  // A waiter that blocked on a lock file which its holder then removed must not come back
  // holding the removed file: a newcomer would lock a new file at the same path.
  TempDir dir;
  DiskCache waiter_cache(dir.path());
  const std::string key = RandomKernel(1).key;
  ASSERT_TRUE(CreateDirectories(dir.Join("locks")).ok());
  const std::string lock = absl::StrCat(dir.path(), "/locks/", key, ".lock");
  const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);
  std::unique_ptr<DiskCache::KeyLock> got;
  std::thread waiter([&] { got = waiter_cache.LockKey(key); });
  ::usleep(200 * 1000);  // the waiter is in flock on the file we hold
  ASSERT_EQ(::unlink(lock.c_str()), 0);
  // A newcomer's file at the path before we let go (made while ours is still open, so it cannot
  // reuse our inode number): a waiter that checks only that something is at the path would come
  // back holding our removed file, while anyone else locks this one.
  const int newcomer = ::open(lock.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  EXPECT_GE(newcomer, 0);
  if (newcomer >= 0) ::close(newcomer);
  ::close(fd);
  waiter.join();
  ASSERT_NE(got, nullptr);
  EXPECT_GE(FileSize(lock), 0) << "the waiter holds a lock on a file that is gone";
  EXPECT_FALSE(LockIsFree(dir.path(), key)) << "two holders of one key lock";
}

TEST(DiskCacheTest, KeyLockAfterTheDirectoryWasRemoved) {
  // `rm -rf` of the cache under a long-running process: the next miss must still lock its key
  // (and so wait for another process compiling it) rather than run unlocked from then on.
  TempDir dir;
  DiskCache cache(dir.Join("cache"));
  ASSERT_NE(cache.LockKey(RandomKernel(1).key), nullptr);
  ASSERT_EQ(std::system(absl::StrCat("rm -rf '", dir.Join("cache"), "'").c_str()), 0);
  const std::string key = RandomKernel(1).key;
  auto held = cache.LockKey(key);
  ASSERT_NE(held, nullptr);
  EXPECT_FALSE(LockIsFree(dir.Join("cache"), key));
}

TEST(DiskCacheTest, KeyLockOfAnotherUsersLockFile) {
  // A cache shared by several users (a group-writable directory, files made with umask 022):
  // a lock file another user made is readable but not writable, and must still be locked, or
  // the users' processes compile the same key side by side. Root ignores permissions, so the
  // second user is a child that gives up root; without root both are one user.
  TempDir dir;
  const std::string key = RandomKernel(1).key;
  {
    DiskCache first(dir.path());
    ASSERT_NE(first.LockKey(key), nullptr);
  }
  const std::string lock = absl::StrCat(dir.path(), "/locks/", key, ".lock");
  ASSERT_EQ(::chmod(lock.c_str(), 0644), 0);
  ASSERT_EQ(::chmod(dir.path().c_str(), 0777), 0);
  ASSERT_EQ(::chmod(dir.Join("locks").c_str(), 0777), 0);
  const int code = jit_test::RunInChild([&] {
    if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) return 10;
    DiskCache second(dir.path());
    auto held = second.LockKey(key);
    if (held == nullptr) return 11;
    return LockIsFree(dir.path(), key) ? 12 : 0;
  });
  EXPECT_EQ(code, 0) << "11: no lock at all, 12: a lock that excludes nothing";
}

TEST(CacheDirectoryTest, FollowsTheEnvironment) {
  ScopedEnv disable("GEMVZ_DISABLE_DISK_CACHE", std::nullopt);
  {
    ScopedEnv dir("GEMVZ_CACHE_DIR", "/some/where");
    ScopedEnv xdg("XDG_CACHE_HOME", "/xdg");
    EXPECT_EQ(CacheDirectory(), "/some/where");
    ScopedEnv off("GEMVZ_DISABLE_DISK_CACHE", "1");
    EXPECT_EQ(CacheDirectory(), "");
  }
  {
    ScopedEnv dir("GEMVZ_CACHE_DIR", std::nullopt);
    ScopedEnv xdg("XDG_CACHE_HOME", "/xdg");
    EXPECT_EQ(CacheDirectory(), "/xdg/gemvz");
  }
  {
    ScopedEnv dir("GEMVZ_CACHE_DIR", std::nullopt);
    ScopedEnv xdg("XDG_CACHE_HOME", std::nullopt);
    ScopedEnv home("HOME", "/home/someone");
    EXPECT_EQ(CacheDirectory(), "/home/someone/.cache/gemvz");
    ScopedEnv off("GEMVZ_DISABLE_DISK_CACHE", "0");
    EXPECT_EQ(CacheDirectory(), "/home/someone/.cache/gemvz");
  }
}

// The XDG base directory spec: a relative XDG_CACHE_HOME is invalid and is ignored, so the
// cache falls back to $HOME/.cache rather than landing under the current directory.
TEST(CacheDirectoryTest, IgnoresARelativeXdgCacheHome) {
  ScopedEnv disable("GEMVZ_DISABLE_DISK_CACHE", std::nullopt);
  ScopedEnv dir("GEMVZ_CACHE_DIR", std::nullopt);
  ScopedEnv home("HOME", "/home/someone");
  for (const char* relative : {"relative/cache", ".cache", "~/cache"}) {
    ScopedEnv xdg("XDG_CACHE_HOME", relative);
    EXPECT_EQ(CacheDirectory(), "/home/someone/.cache/gemvz") << "XDG_CACHE_HOME=" << relative;
  }
  ScopedEnv xdg("XDG_CACHE_HOME", "/abs/cache");
  EXPECT_EQ(CacheDirectory(), "/abs/cache/gemvz");
}

TEST(CacheDirectoryTest, MaxBytesComesFromTheEnvironment) {
  {
    ScopedEnv cap("GEMVZ_CACHE_MAX_BYTES", std::nullopt);
    EXPECT_EQ(DiskCacheMaxBytes(), int64_t{1} << 30);
  }
  {
    ScopedEnv cap("GEMVZ_CACHE_MAX_BYTES", "64M");
    EXPECT_EQ(DiskCacheMaxBytes(), int64_t{64} << 20);
  }
  // Malformed, or too large for an int64_t (9000000000G is over 2^63 bytes: taken, it would be
  // a negative cap that evicts every entry): the default, with a warning.
  for (const char* bad : {"lots", "9000000000G", "12iB"}) {
    SCOPED_TRACE(bad);
    ScopedEnv cap("GEMVZ_CACHE_MAX_BYTES", bad);
    testing::internal::CaptureStderr();
    EXPECT_EQ(DiskCacheMaxBytes(), int64_t{1} << 30);
    EXPECT_NE(testing::internal::GetCapturedStderr().find("GEMVZ_CACHE_MAX_BYTES"),
              std::string::npos);
  }
}

}  // namespace
}  // namespace gemvz::internal
