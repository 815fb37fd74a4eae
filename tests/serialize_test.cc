// Tests of ValidatePacked and the packed-matrix file format: round trips, and refusal of every
// truncation, bit flip, wrong magic, future version and broken invariant.
#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gemvz/format.h"
#include "gtest/gtest.h"
#include "runtime/common/file_util.h"
#include "runtime/common/hash.h"
#include "tests/support/random_weights.h"
#include "tests/support/temp_files.h"

namespace gemvz {
namespace {

using ::gemvz::testing::ListDir;
using ::gemvz::testing::MakeTempDir;
using ::gemvz::testing::ReadAll;
using ::gemvz::testing::ReturnsWithoutAWriter;
using ::gemvz::testing::WriteAll;
using ::gemvz::testing::FreshSeed;

constexpr size_t kHeaderBytes = 276;  // version 1 header, see serialize.cc

void WriteBytes(const std::string& path, const uint8_t* data, size_t size) {
  FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << path;
  if (size > 0) ASSERT_EQ(std::fwrite(data, 1, size, f), size);
  std::fclose(f);
}

uint32_t FloatBitsOf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Moves the window to `base`, with the tl/th words that hold it. At base 120 the window's top
// value, e7 127, decodes to Inf or NaN with a low byte of 0x80 or more (all eight exponent bits
// set), which Pack never writes: every low byte (the first two sections of each group) loses its
// top bit there.
void SetWindow(PackedMatrix& p, int base) {
  const uint32_t b = static_cast<uint32_t>(base);
  p.base = base;
  p.tl = b | (b + 1) << 8 | (b + 2) << 16 | (b + 3) << 24;
  p.th = p.tl + 0x04040404u;
  if (base == 120) {
    for (size_t i = 0; i < p.weights.size(); ++i) {
      if (i % 1536 < 1024) p.weights[i] &= 0x7F;
    }
  }
}

// A structurally valid matrix with random contents: sparse corrections (some weights with two),
// and a few dense rows; built by hand so these tests do not depend on Pack.
PackedMatrix RandomValidMatrix(int64_t rows, int64_t cols, uint64_t seed, bool with_tables = true) {
  std::mt19937_64 rng(seed);
  PackedMatrix p;
  p.rows = rows;
  p.cols = cols;
  const int base = static_cast<int>(rng() % 121);
  p.weights.resize(rows / 16 * cols / 64 * 1536);
  for (auto& x : p.weights) x = static_cast<uint8_t>(rng());
  SetWindow(p, base);  // after the weights: base 120 clears their low bytes' top bits
  p.row_offsets.push_back(0);
  p.dense_block_offsets.push_back(0);
  std::uniform_real_distribution<float> val(-1e-3f, 1e-3f);
  for (int64_t rb = 0; rb < rows / 16; ++rb) {
    std::set<int> dense;
    if (with_tables && rng() % 3 == 0) {
      const int n = 1 + rng() % 3;
      for (int i = 0; i < n; ++i) dense.insert(static_cast<int>(rng() % 16));
    }
    for (int r = 0; r < 16; ++r) {
      if (dense.count(r)) {
        p.dense_rows.push_back(static_cast<uint8_t>(r));
        for (int64_t c = 0; c < cols; ++c) {
          p.dense_values.push_back(FloatToBf16(val(rng)));
        }
      } else if (with_tables) {
        const int n = rng() % 5;
        std::set<int> cs;
        for (int i = 0; i < n; ++i) cs.insert(static_cast<int>(rng() % cols));
        for (int c : cs) {
          float v = val(rng);
          if (v == 0) v = 1e-4f;
          p.entries.push_back({c, FloatBitsOf(v)});
          if (rng() % 4 == 0) p.entries.push_back({c, FloatBitsOf(v * 1e-9f)});
        }
      }
      p.row_offsets.push_back(static_cast<uint32_t>(p.entries.size()));
    }
    p.dense_block_offsets.push_back(static_cast<uint32_t>(p.dense_rows.size()));
  }
  p.stats.weights = rows * cols;
  p.stats.outside_window = static_cast<int64_t>(rng() % 1000);
  p.stats.sparse_entries = static_cast<int64_t>(p.entries.size());
  p.stats.residual_entries = 3;
  p.stats.dense_rows = static_cast<int64_t>(p.dense_rows.size());
  p.stats.total_bytes = 12345;
  p.stats.padded_table_bytes = 678;
  p.stats.bits_per_weight = 12.25;
  p.stats.exception_rate = 1.0 / 3.0;
  p.stats.window_coverage = 2.0 / 3.0;
  return p;
}

void ExpectSameMatrix(const PackedMatrix& a, const PackedMatrix& b) {
  EXPECT_EQ(a.rows, b.rows);
  EXPECT_EQ(a.cols, b.cols);
  EXPECT_EQ(a.base, b.base);
  EXPECT_EQ(a.tl, b.tl);
  EXPECT_EQ(a.th, b.th);
  EXPECT_EQ(a.weights, b.weights);
  EXPECT_EQ(a.row_offsets, b.row_offsets);
  ASSERT_EQ(a.entries.size(), b.entries.size());
  for (size_t i = 0; i < a.entries.size(); ++i) {
    EXPECT_EQ(a.entries[i].col, b.entries[i].col) << i;
    EXPECT_EQ(a.entries[i].value_bits, b.entries[i].value_bits) << i;
  }
  EXPECT_EQ(a.dense_block_offsets, b.dense_block_offsets);
  EXPECT_EQ(a.dense_rows, b.dense_rows);
  EXPECT_EQ(a.dense_values, b.dense_values);
  EXPECT_EQ(a.stats.weights, b.stats.weights);
  EXPECT_EQ(a.stats.outside_window, b.stats.outside_window);
  EXPECT_EQ(a.stats.sparse_entries, b.stats.sparse_entries);
  EXPECT_EQ(a.stats.residual_entries, b.stats.residual_entries);
  EXPECT_EQ(a.stats.dense_rows, b.stats.dense_rows);
  EXPECT_EQ(a.stats.total_bytes, b.stats.total_bytes);
  EXPECT_EQ(a.stats.padded_table_bytes, b.stats.padded_table_bytes);
  EXPECT_EQ(a.stats.bits_per_weight, b.stats.bits_per_weight);
  EXPECT_EQ(a.stats.exception_rate, b.stats.exception_rate);
  EXPECT_EQ(a.stats.window_coverage, b.stats.window_coverage);
}

// Byte offsets where each part of a serialised matrix begins (header, then the six sections).
std::vector<size_t> Boundaries(const PackedMatrix& p) {
  std::vector<size_t> b = {0, 8, 12, 16, kHeaderBytes};
  size_t at = kHeaderBytes;
  for (size_t bytes :
       {p.weights.size(), p.row_offsets.size() * 4, p.entries.size() * 8,
        p.dense_block_offsets.size() * 4, p.dense_rows.size(), p.dense_values.size() * 2}) {
    at += bytes;
    b.push_back(at);
  }
  return b;
}

TEST(SerializeTest, RoundTripInMemory) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(seed);
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{16, 64}, {64, 192}, {256, 512}}) {
    const PackedMatrix p = RandomValidMatrix(rows, cols, seed + rows);
    ASSERT_TRUE(ValidatePacked(p).ok()) << ValidatePacked(p);
    const std::vector<uint8_t> bytes = Serialize(p);
    ASSERT_EQ(bytes.size(), Boundaries(p).back());
    absl::StatusOr<PackedMatrix> q = Deserialize(bytes.data(), bytes.size());
    ASSERT_TRUE(q.ok()) << q.status();
    ExpectSameMatrix(p, *q);
    EXPECT_EQ(Serialize(*q), bytes);
  }
}

TEST(SerializeTest, RoundTripWithoutSideTables) {
  const PackedMatrix p = RandomValidMatrix(32, 128, FreshSeed(), /*with_tables=*/false);
  ASSERT_TRUE(p.entries.empty() && p.dense_rows.empty());
  const std::vector<uint8_t> bytes = Serialize(p);
  absl::StatusOr<PackedMatrix> q = Deserialize(bytes.data(), bytes.size());
  ASSERT_TRUE(q.ok()) << q.status();
  ExpectSameMatrix(p, *q);
}

TEST(SerializeTest, SaveLoadRoundTrip) {
  const std::string dir = MakeTempDir("serialize_test");
  ASSERT_FALSE(dir.empty());
  const PackedMatrix p = RandomValidMatrix(128, 256, FreshSeed());
  const std::string path = dir + "/m.gemvz";
  ASSERT_TRUE(Save(p, path).ok());
  absl::StatusOr<PackedMatrix> q = Load(path);
  ASSERT_TRUE(q.ok()) << q.status();
  ExpectSameMatrix(p, *q);
  // The file is exactly Serialize's bytes, and only the final name is left in the directory.
  absl::StatusOr<std::string> raw = internal::ReadFile(path);
  ASSERT_TRUE(raw.ok());
  const std::vector<uint8_t> bytes = Serialize(p);
  EXPECT_EQ(std::string(bytes.begin(), bytes.end()), *raw);
  EXPECT_EQ(ListDir(dir), std::vector<std::string>{"m.gemvz"});
  // Saving again replaces the file atomically.
  const PackedMatrix p2 = RandomValidMatrix(16, 64, FreshSeed());
  ASSERT_TRUE(Save(p2, path).ok());
  q = Load(path);
  ASSERT_TRUE(q.ok()) << q.status();
  ExpectSameMatrix(p2, *q);
  EXPECT_EQ(ListDir(dir), std::vector<std::string>{"m.gemvz"});
}

TEST(SerializeTest, RoundTripOfPackedMatrices) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(seed);
  const std::string dir = MakeTempDir("serialize_test");
  using testing::Distribution;
  int i = 0;
  for (Distribution d : {Distribution::kNormal, Distribution::kStudentT3, Distribution::kFullRange,
                         Distribution::kSparseZeros, Distribution::kTiny}) {
    std::vector<uint16_t> w = testing::RandomMatrix(128, 512, d, seed + i);
    std::fill(w.begin() + 5 * 512, w.begin() + 6 * 512, 0);  // an all-zero row: a dense row
    absl::StatusOr<PackedMatrix> p = Pack(w.data(), 128, 512);
    ASSERT_TRUE(p.ok()) << p.status();
    const std::string path = dir + "/p" + std::to_string(i++) + ".gemvz";
    ASSERT_TRUE(Save(*p, path).ok());
    absl::StatusOr<PackedMatrix> q = Load(path);
    ASSERT_TRUE(q.ok()) << q.status();
    ExpectSameMatrix(*p, *q);
    absl::StatusOr<std::vector<uint16_t>> back = Unpack(*q);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, w);
  }
}

TEST(SerializeTest, TruncationIsRefusedAtEveryBoundaryAndRandomLengths) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(seed);
  std::mt19937_64 rng(seed);
  const PackedMatrix p = RandomValidMatrix(64, 256, seed);
  const std::vector<uint8_t> bytes = Serialize(p);
  std::vector<size_t> lengths;
  for (size_t b : Boundaries(p)) {
    for (int d = -1; d <= 1; ++d) {
      if (b + d < bytes.size() && !(b == 0 && d < 0)) lengths.push_back(b + d);
    }
  }
  for (int i = 0; i < 300; ++i) lengths.push_back(rng() % bytes.size());
  for (size_t n : lengths) {
    // A copy of exactly n bytes, so that reading past the end would be caught by ASan.
    std::vector<uint8_t> cut(bytes.begin(), bytes.begin() + n);
    absl::StatusOr<PackedMatrix> q = Deserialize(cut.data(), cut.size());
    ASSERT_FALSE(q.ok()) << "length " << n << " of " << bytes.size() << " was accepted";
    EXPECT_NE(q.status().message().find("truncated"), std::string::npos) << n << ": " << q.status();
  }
  // The same through a file: the error names it.
  const std::string dir = MakeTempDir("serialize_test");
  const std::string path = dir + "/cut.gemvz";
  for (size_t n : {size_t{0}, size_t{10}, kHeaderBytes - 1, kHeaderBytes, bytes.size() - 1}) {
    WriteBytes(path, bytes.data(), n);
    absl::StatusOr<PackedMatrix> q = Load(path);
    ASSERT_FALSE(q.ok()) << n;
    EXPECT_NE(q.status().message().find(path), std::string::npos) << q.status();
    EXPECT_NE(q.status().message().find("truncated"), std::string::npos) << q.status();
  }
}

TEST(SerializeTest, EveryBitFlipIsRefused) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(seed);
  // Small enough to flip every single bit of the file.
  const PackedMatrix p = RandomValidMatrix(32, 64, seed);
  ASSERT_FALSE(p.entries.empty() && p.dense_rows.empty());
  std::vector<uint8_t> bytes = Serialize(p);
  for (size_t bit = 0; bit < bytes.size() * 8; ++bit) {
    bytes[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    absl::StatusOr<PackedMatrix> q = Deserialize(bytes.data(), bytes.size());
    ASSERT_FALSE(q.ok()) << "flip of bit " << bit << " (byte " << bit / 8 << ") was accepted";
    EXPECT_FALSE(q.status().message().empty());
    bytes[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
  }
  ASSERT_TRUE(Deserialize(bytes.data(), bytes.size()).ok());
}

TEST(SerializeTest, RandomBitFlipsInALargerFileAreRefused) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(seed);
  std::mt19937_64 rng(seed);
  const PackedMatrix p = RandomValidMatrix(512, 1024, seed);
  std::vector<uint8_t> bytes = Serialize(p);
  const std::string dir = MakeTempDir("serialize_test");
  const std::string path = dir + "/flip.gemvz";
  for (int i = 0; i < 200; ++i) {
    const size_t bit = rng() % (bytes.size() * 8);
    bytes[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    absl::StatusOr<PackedMatrix> q = Deserialize(bytes.data(), bytes.size());
    ASSERT_FALSE(q.ok()) << "flip of bit " << bit;
    if (i % 20 == 0) {
      WriteBytes(path, bytes.data(), bytes.size());
      absl::StatusOr<PackedMatrix> l = Load(path);
      ASSERT_FALSE(l.ok()) << "flip of bit " << bit;
      EXPECT_NE(l.status().message().find(path), std::string::npos) << l.status();
    }
    bytes[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
  }
}

TEST(SerializeTest, SectionCorruptionNamesTheSection) {
  const PackedMatrix p = RandomValidMatrix(64, 128, FreshSeed());
  ASSERT_FALSE(p.entries.empty());
  std::vector<uint8_t> bytes = Serialize(p);
  const size_t entries_at = kHeaderBytes + p.weights.size() + p.row_offsets.size() * 4;
  bytes[entries_at + 3] ^= 0x10;
  absl::StatusOr<PackedMatrix> q = Deserialize(bytes.data(), bytes.size());
  ASSERT_FALSE(q.ok());
  EXPECT_EQ(q.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(q.status().message().find("'entries'"), std::string::npos) << q.status();
  EXPECT_NE(q.status().message().find("checksum"), std::string::npos) << q.status();
}

// Rewrites the header checksum so that a test reaches the checks behind it.
void FixHeaderCrc(std::vector<uint8_t>& bytes) {
  const uint32_t crc = internal::Crc32c(bytes.data(), kHeaderBytes - 4);
  std::memcpy(bytes.data() + kHeaderBytes - 4, &crc, 4);
}

TEST(SerializeTest, WrongMagicIsRefused) {
  std::vector<uint8_t> bytes = Serialize(RandomValidMatrix(16, 64, FreshSeed()));
  bytes[0] = 'X';
  FixHeaderCrc(bytes);
  absl::StatusOr<PackedMatrix> q = Deserialize(bytes.data(), bytes.size());
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.status().message().find("magic"), std::string::npos) << q.status();
  // A file that is something else entirely.
  const std::string text = "{\"this\": \"is json\"} and not a packed matrix, but long enough";
  q = Deserialize(reinterpret_cast<const uint8_t*>(text.data()), text.size());
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.status().message().find("magic"), std::string::npos) << q.status();
}

TEST(SerializeTest, FutureAndUnknownVersionsAreRefused) {
  const std::vector<uint8_t> good = Serialize(RandomValidMatrix(16, 64, FreshSeed()));
  for (uint32_t version : {2u, 7u, 0xFFFFFFFFu}) {
    std::vector<uint8_t> bytes = good;
    std::memcpy(bytes.data() + 8, &version, 4);
    FixHeaderCrc(bytes);  // a genuine newer file has a valid checksum of its own
    absl::StatusOr<PackedMatrix> q = Deserialize(bytes.data(), bytes.size());
    ASSERT_FALSE(q.ok()) << version;
    EXPECT_EQ(q.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(q.status().message().find("newer"), std::string::npos) << q.status();
    EXPECT_NE(q.status().message().find(std::to_string(version)), std::string::npos);
  }
  // A newer file may have a longer header and different sections: the version check comes first.
  std::vector<uint8_t> v2 = good;
  const uint32_t two = 2, big_header = 4096;
  std::memcpy(v2.data() + 8, &two, 4);
  std::memcpy(v2.data() + 12, &big_header, 4);
  v2.resize(20);
  absl::StatusOr<PackedMatrix> q = Deserialize(v2.data(), v2.size());
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.status().message().find("newer"), std::string::npos) << q.status();

  std::vector<uint8_t> v0 = good;
  std::memset(v0.data() + 8, 0, 4);
  FixHeaderCrc(v0);
  q = Deserialize(v0.data(), v0.size());
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.status().message().find("version 0"), std::string::npos) << q.status();
}

TEST(SerializeTest, HugeLengthInACheckedHeaderIsRefusedWithoutAllocating) {
  const PackedMatrix p = RandomValidMatrix(16, 64, FreshSeed());
  const std::vector<uint8_t> good = Serialize(p);
  // Each section's count field, set to absurd values; the checksum is fixed so that only the
  // length check stands between the header and a terabyte allocation.
  for (int section = 0; section < 6; ++section) {
    for (uint64_t count : {uint64_t{1} << 40, ~uint64_t{0}, ~uint64_t{0} / 2 + 1}) {
      std::vector<uint8_t> bytes = good;
      std::memcpy(bytes.data() + 48 + 24 * section + 8, &count, 8);
      FixHeaderCrc(bytes);
      absl::StatusOr<PackedMatrix> q = Deserialize(bytes.data(), bytes.size());
      ASSERT_FALSE(q.ok()) << section << " " << count;
      EXPECT_NE(q.status().message().find("truncated"), std::string::npos) << q.status();
    }
  }
  // Consistent lengths but a shape that does not match them: ValidatePacked refuses it.
  std::vector<uint8_t> bytes = good;
  const int64_t rows = 32;
  std::memcpy(bytes.data() + 16, &rows, 8);
  FixHeaderCrc(bytes);
  absl::StatusOr<PackedMatrix> q = Deserialize(bytes.data(), bytes.size());
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.status().message().find("invalid"), std::string::npos) << q.status();
}

// A section record with another id, element size or a nonzero reserved word is not version 1's,
// even under a valid header checksum. The element size matters on its own: the lengths are
// checked with the version's sizes, so a record claiming 8-byte row offsets would otherwise load
// as if it said 4.
TEST(SerializeTest, SectionRecordsOtherThanVersion1sAreRefused) {
  const PackedMatrix p = RandomValidMatrix(16, 64, FreshSeed());
  const std::vector<uint8_t> good = Serialize(p);
  const char* const names[6] = {"weights",             "row_offsets", "entries",
                                "dense_block_offsets", "dense_rows",  "dense_values"};
  const uint32_t sizes[6] = {1, 4, 8, 4, 1, 2};
  for (int section = 0; section < 6; ++section) {
    const size_t record = 48 + 24 * section;
    struct Field {
      size_t offset;  // in the record: 0 id, 4 element size, 20 reserved
      uint32_t value;
    };
    std::vector<Field> fields = {{0, static_cast<uint32_t>(section + 2)}, {0, 0}, {20, 1}};
    for (uint32_t size : {0u, 1u, 2u, 3u, 4u, 8u, 16u, 0xFFFFFFFFu}) {
      if (size != sizes[section]) fields.push_back({4, size});
    }
    for (const Field& f : fields) {
      std::vector<uint8_t> bytes = good;
      std::memcpy(bytes.data() + record + f.offset, &f.value, 4);
      FixHeaderCrc(bytes);
      absl::StatusOr<PackedMatrix> q = Deserialize(bytes.data(), bytes.size());
      ASSERT_FALSE(q.ok()) << names[section] << ": " << f.value << " at " << f.offset;
      EXPECT_EQ(q.status().code(), absl::StatusCode::kDataLoss) << q.status();
      EXPECT_NE(q.status().message().find(absl::StrCat("section record ", section, " is not the '",
                                                       names[section], "' section")),
                std::string::npos)
          << q.status();
    }
  }
  // The same through Load, which names the file.
  const std::string path = MakeTempDir("serialize_test") + "/record.gemvz";
  std::vector<uint8_t> bytes = good;
  const uint32_t eight = 8;
  std::memcpy(bytes.data() + 48 + 24 * 1 + 4, &eight, 4);  // row_offsets as 8-byte elements
  FixHeaderCrc(bytes);
  WriteBytes(path, bytes.data(), bytes.size());
  absl::StatusOr<PackedMatrix> q = Load(path);
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.status().message().find(path), std::string::npos) << q.status();
  EXPECT_NE(q.status().message().find("'row_offsets' section"), std::string::npos) << q.status();
}

TEST(SerializeTest, TrailingBytesAreRefused) {
  std::vector<uint8_t> bytes = Serialize(RandomValidMatrix(16, 64, FreshSeed()));
  bytes.push_back(0);
  absl::StatusOr<PackedMatrix> q = Deserialize(bytes.data(), bytes.size());
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.status().message().find("after the last section"), std::string::npos) << q.status();
  EXPECT_FALSE(Deserialize(nullptr, 10).ok());
  EXPECT_FALSE(Deserialize(nullptr, 0).ok());
}

TEST(SerializeTest, SaveIntoAMissingDirectoryFailsAndLeavesNothing) {
  const std::string dir = MakeTempDir("serialize_test");
  const std::string path = dir + "/missing/sub/m.gemvz";
  const absl::Status st = Save(RandomValidMatrix(16, 64, FreshSeed()), path);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find(path), std::string::npos) << st;
  struct stat sb;
  EXPECT_NE(::stat((dir + "/missing").c_str(), &sb), 0);
  EXPECT_TRUE(ListDir(dir).empty());
}

TEST(SerializeTest, SaveOfAnInvalidMatrixFailsAndLeavesNothing) {
  const std::string dir = MakeTempDir("serialize_test");
  PackedMatrix p = RandomValidMatrix(16, 64, FreshSeed());
  p.row_offsets.pop_back();
  const absl::Status st = Save(p, dir + "/bad.gemvz");
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("row_offsets"), std::string::npos) << st;
  EXPECT_TRUE(ListDir(dir).empty());
  // A failed save does not disturb a file already published under the name.
  const PackedMatrix good = RandomValidMatrix(16, 64, FreshSeed());
  ASSERT_TRUE(Save(good, dir + "/bad.gemvz").ok());
  ASSERT_FALSE(Save(p, dir + "/bad.gemvz").ok());
  absl::StatusOr<PackedMatrix> q = Load(dir + "/bad.gemvz");
  ASSERT_TRUE(q.ok()) << q.status();
  ExpectSameMatrix(good, *q);
  EXPECT_EQ(ListDir(dir).size(), 1u);
}

TEST(SerializeTest, LoadOfAFifoIsRefusedWithoutWaitingForAWriter) {
  const std::string fifo = MakeTempDir("serialize_test") + "/pipe.gemvz";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  absl::Status st;
  EXPECT_TRUE(ReturnsWithoutAWriter(fifo, [&] { st = Load(fifo).status(); }));
  EXPECT_NE(st.message().find("regular file"), std::string::npos) << st;
}

TEST(SerializeTest, LoadOfAMissingFileNamesIt) {
  const std::string path = MakeTempDir("serialize_test") + "/nope.gemvz";
  absl::StatusOr<PackedMatrix> q = Load(path);
  ASSERT_FALSE(q.ok());
  EXPECT_EQ(q.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(q.status().message().find(path), std::string::npos) << q.status();
  const std::string dir = MakeTempDir("serialize_test");
  q = Load(dir);
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.status().message().find("regular file"), std::string::npos) << q.status();
}

// Each mutation breaks one invariant; ValidatePacked must refuse it and name the rule.
struct Breakage {
  const char* name;
  const char* expected;  // substring of the error
  std::function<void(PackedMatrix&)> apply;
};

TEST(ValidatePackedTest, CatchesEachBrokenInvariant) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(seed);
  // Find a matrix with entries, pairs and dense rows in it (the builder is random).
  PackedMatrix good;
  for (uint64_t s = seed;; ++s) {
    good = RandomValidMatrix(64, 128, s);
    bool pair = false;
    for (size_t i = 1; i < good.entries.size(); ++i)
      pair |= good.entries[i].col == good.entries[i - 1].col;
    if (pair && good.dense_rows.size() >= 2 && good.entries.size() >= 4) break;
  }
  ASSERT_TRUE(ValidatePacked(good).ok()) << ValidatePacked(good);
  // A row that has at least two entries, and the first dense row.
  int64_t row2 = -1;
  for (int64_t r = 0; r < good.rows && row2 < 0; ++r) {
    if (good.row_offsets[r + 1] - good.row_offsets[r] >= 2) row2 = r;
  }
  ASSERT_GE(row2, 0);
  int64_t dense_block = -1;
  for (int64_t b = 0; b < good.rows / 16 && dense_block < 0; ++b) {
    if (good.dense_block_offsets[b + 1] > good.dense_block_offsets[b]) dense_block = b;
  }
  const uint32_t e2 = good.row_offsets[row2];
  const uint32_t d0 = good.dense_block_offsets[dense_block];
  const int64_t dense_row = dense_block * 16 + good.dense_rows[d0];

  const std::vector<Breakage> cases = {
      {"rows not a multiple of 16", "N % 16", [](PackedMatrix& p) { p.rows = 72; }},
      {"cols not a multiple of 64", "K % 64", [](PackedMatrix& p) { p.cols = 100; }},
      {"zero rows", "empty", [](PackedMatrix& p) { p.rows = 0; }},
      {"negative cols", "empty", [](PackedMatrix& p) { p.cols = -64; }},
      // With words that hold it: base 121's top e7, 128, needs 8 bits, so Unpack would write
      // its high bit into the sign.
      {"base too large", "base 121 outside 0..120", [](PackedMatrix& p) { SetWindow(p, 121); }},
      {"base negative", "base -1 outside 0..120", [](PackedMatrix& p) { p.base = -1; }},
      {"tl off", "window words", [](PackedMatrix& p) { p.tl ^= 1u << 8; }},
      {"th off", "window words", [](PackedMatrix& p) { p.th += 1; }},
      {"base moved without tl/th", "window words",
       [](PackedMatrix& p) { p.base = p.base > 0 ? p.base - 1 : 1; }},
      {"weights short", "weights hold", [](PackedMatrix& p) { p.weights.pop_back(); }},
      {"weights long", "weights hold",
       [](PackedMatrix& p) { p.weights.resize(p.weights.size() + 1536); }},
      {"row_offsets short", "row_offsets has", [](PackedMatrix& p) { p.row_offsets.pop_back(); }},
      {"row_offsets long", "row_offsets has",
       [](PackedMatrix& p) { p.row_offsets.push_back(p.row_offsets.back()); }},
      {"row_offsets start", "row_offsets[0]", [](PackedMatrix& p) { p.row_offsets[0] = 1; }},
      {"row_offsets end", "row_offsets ends",
       [](PackedMatrix& p) { p.entries.push_back(p.entries.back()); }},
      {"row_offsets decreasing", "row_offsets decreases",
       [](PackedMatrix& p) { p.row_offsets[p.rows / 2] = p.row_offsets.back() + 1; }},
      {"col negative", "outside [0,", [e2](PackedMatrix& p) { p.entries[e2].col = -1; }},
      {"col too large", "outside [0,",
       [e2](PackedMatrix& p) { p.entries[e2 + 1].col = static_cast<int32_t>(p.cols); }},
      {"unsorted", "not sorted",
       [e2](PackedMatrix& p) {
         ExceptionEntry& a = p.entries[e2];
         ExceptionEntry& b = p.entries[e2 + 1];
         if (a.col != b.col) {
           std::swap(a.col, b.col);
         } else if (a.col > 0) {
           b.col = a.col - 1;
         } else {
           a.col = 1;
         }
       }},
      {"three entries for one col", "more than two",
       [e2](PackedMatrix& p) {
         const ExceptionEntry e = p.entries[e2];
         p.entries.insert(p.entries.begin() + e2, {e, e});
         for (size_t r = 0; r < p.row_offsets.size(); ++r) {
           if (p.row_offsets[r] > e2) p.row_offsets[r] += 2;
         }
       }},
      {"NaN value", "non-finite",
       [e2](PackedMatrix& p) { p.entries[e2].value_bits = 0x7FC00000u; }},
      {"Inf value", "non-finite",
       [e2](PackedMatrix& p) { p.entries[e2].value_bits = 0xFF800000u; }},
      {"zero value", "zero value", [e2](PackedMatrix& p) { p.entries[e2].value_bits = 0; }},
      {"negative zero value", "zero value",
       [e2](PackedMatrix& p) { p.entries[e2].value_bits = 0x80000000u; }},
      // Two FLT_MAX entries for one weight: each finite, their sum is not, so Unpack would
      // restore an Inf weight and the kernel add FLT_MAX * x twice.
      {"corrections restore Inf", "restore a non-finite weight",
       [e2](PackedMatrix& p) {
         p.entries[e2 + 1].col = p.entries[e2].col;
         p.entries[e2].value_bits = p.entries[e2 + 1].value_bits = 0x7F7FFFFFu;
       }},
      {"dense_block_offsets short", "dense_block_offsets has",
       [](PackedMatrix& p) { p.dense_block_offsets.pop_back(); }},
      {"dense_block_offsets start", "dense_block_offsets[0]",
       [](PackedMatrix& p) { p.dense_block_offsets[0] = 1; }},
      {"dense_block_offsets end", "dense_block_offsets ends",
       [](PackedMatrix& p) {
         p.dense_rows.push_back(15);
         p.dense_values.resize(p.dense_values.size() + p.cols);
       }},
      {"dense_block_offsets decreasing", "dense_block_offsets decreases",
       [](PackedMatrix& p) { p.dense_block_offsets[2] = p.dense_block_offsets.back() + 1; }},
      {"dense row out of block", "outside 0..15", [d0](PackedMatrix& p) { p.dense_rows[d0] = 16; }},
      {"dense rows not increasing", "strictly increasing",
       [d0, dense_block](PackedMatrix& p) {
         // The block's first dense row, twice.
         p.dense_rows.insert(p.dense_rows.begin() + d0 + 1, p.dense_rows[d0]);
         p.dense_values.insert(p.dense_values.begin() + (d0 + 1) * p.cols, p.cols, 0x3c00);
         for (size_t b = dense_block + 1; b < p.dense_block_offsets.size(); ++b) {
           ++p.dense_block_offsets[b];
         }
       }},
      {"dense row with entries", "is dense but also has",
       [dense_row](PackedMatrix& p) {
         p.entries.insert(p.entries.begin() + p.row_offsets[dense_row],
                          ExceptionEntry{0, 0x3f800000u});
         for (size_t r = dense_row + 1; r < p.row_offsets.size(); ++r) ++p.row_offsets[r];
       }},
      {"dense_values short", "dense_values has",
       [](PackedMatrix& p) { p.dense_values.pop_back(); }},
      {"dense_values long", "dense_values has",
       [](PackedMatrix& p) { p.dense_values.push_back(0); }},
      {"dense value NaN", "non-finite BF16",
       [](PackedMatrix& p) { p.dense_values[p.cols + 3] = 0x7FC1; }},
      {"dense value Inf", "non-finite BF16", [](PackedMatrix& p) { p.dense_values[0] = 0xFF80; }},
  };
  const std::string dir = MakeTempDir("serialize_test");
  for (const Breakage& c : cases) {
    PackedMatrix p = good;
    c.apply(p);
    const absl::Status st = ValidatePacked(p);
    EXPECT_FALSE(st.ok()) << c.name;
    EXPECT_NE(st.message().find(c.expected), std::string::npos)
        << c.name << ": expected '" << c.expected << "' in: " << st;
    // A broken matrix is never saved and never survives a serialise/deserialise round trip.
    const std::vector<uint8_t> bytes = Serialize(p);
    EXPECT_FALSE(Deserialize(bytes.data(), bytes.size()).ok()) << c.name;
    EXPECT_FALSE(Save(p, dir + "/x.gemvz").ok()) << c.name;
  }
  EXPECT_TRUE(ListDir(dir).empty());
}

// A correction is judged with the weight it corrects: at window base 119, 2e38 added to 0x7EFF
// (e7 126, 1.69e38) restores Inf, added to 0x7700 (e7 119, 2.6e33) a finite weight. Each of a
// block's 1024 positions in turn holds the large weight, so the decoder's position of every
// weight is the one ValidatePacked reads.
TEST(ValidatePackedTest, RefusesCorrectionsThatRestoreANonFiniteWeight) {
  for (int r = 0; r < 16; ++r) {
    for (int c = 0; c < 64; ++c) {
      std::vector<uint16_t> w(16 * 64, 0x7700);
      w[r * 64 + c] = 0x7EFF;
      absl::StatusOr<PackedMatrix> packed = Pack(w.data(), 16, 64);
      ASSERT_TRUE(packed.ok()) << packed.status();
      ASSERT_EQ(packed->base, 119);
      ASSERT_TRUE(packed->entries.empty());
      auto with_entry = [&](int row, int col) {
        PackedMatrix p = *packed;
        p.entries.push_back({col, FloatBitsOf(2e38f)});
        for (int i = row + 1; i <= 16; ++i) p.row_offsets[i] = 1;
        return p;
      };
      const absl::Status big = ValidatePacked(with_entry(r, c));
      EXPECT_NE(big.message().find("row " + std::to_string(r) + " col " + std::to_string(c) +
                                   ": its 1 correction entries restore a non-finite weight"),
                std::string::npos)
          << big;
      const int other = (r + 1) % 16;
      EXPECT_TRUE(ValidatePacked(with_entry(other, c)).ok()) << r << " " << c;
    }
  }
}

// At window base 120 code 7 decodes to e7 127, whose low bytes 0x80 and above are Inf and NaN:
// refused in a row that is not dense (the kernel would multiply it), at each of a block's 1024
// positions (found as the byte that changes with the weight's low byte), and not in a dense row.
TEST(ValidatePackedTest, RefusesAWeightThatDecodesToInfOrNaN) {
  for (int r = 0; r < 16; ++r) {
    for (int c = 0; c < 64; ++c) {
      std::vector<uint16_t> w(16 * 64, 0x7800);  // e7 120
      w[r * 64 + c] = 0x7F00;                    // e7 127, 2^127
      absl::StatusOr<PackedMatrix> packed = Pack(w.data(), 16, 64);
      w[r * 64 + c] = 0x7F01;
      absl::StatusOr<PackedMatrix> other = Pack(w.data(), 16, 64);
      ASSERT_TRUE(packed.ok() && other.ok());
      ASSERT_EQ(packed->base, 120);
      ASSERT_TRUE(ValidatePacked(*packed).ok()) << ValidatePacked(*packed);
      size_t low = 0;
      while (low < packed->weights.size() && packed->weights[low] == other->weights[low]) ++low;
      ASSERT_LT(low, packed->weights.size());
      for (uint8_t byte : {0x80, 0x81, 0xFF}) {  // Inf, NaN, NaN
        PackedMatrix p = *packed;
        p.weights[low] = byte;
        const absl::Status st = ValidatePacked(p);
        EXPECT_NE(st.message().find("row " + std::to_string(r) + " col " + std::to_string(c) +
                                    " decodes to a non-finite BF16"),
                  std::string::npos)
            << st;
      }
    }
  }
  // Row 3 dense: its decoded weights are ignored.
  std::vector<uint16_t> w(16 * 64, 0x7800);
  w[3 * 64 + 5] = 0x7F00;
  for (int c = 10; c < 64; ++c) w[3 * 64 + c] = 0x3F80;  // 54 weights outside: a dense row
  absl::StatusOr<PackedMatrix> packed = Pack(w.data(), 16, 64);
  w[3 * 64 + 5] = 0x7F01;
  absl::StatusOr<PackedMatrix> other = Pack(w.data(), 16, 64);
  ASSERT_TRUE(packed.ok() && other.ok());
  ASSERT_EQ(packed->base, 120);
  ASSERT_EQ(packed->dense_rows, std::vector<uint8_t>{3});
  size_t low = 0;
  while (low < packed->weights.size() && packed->weights[low] == other->weights[low]) ++low;
  ASSERT_LT(low, packed->weights.size());
  packed->weights[low] = 0x80;
  EXPECT_TRUE(ValidatePacked(*packed).ok()) << ValidatePacked(*packed);
}

TEST(ValidatePackedTest, AcceptsTheEdgeWindows) {
  for (int base : {0, 120}) {
    PackedMatrix p = RandomValidMatrix(16, 64, FreshSeed());
    SetWindow(p, base);
    EXPECT_TRUE(ValidatePacked(p).ok()) << base << ": " << ValidatePacked(p);
  }
}

}  // namespace
}  // namespace gemvz
