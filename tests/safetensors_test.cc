// Tests of the safetensors reader and writer: round trips, the reference format's rules on what
// is written, every kind of bad header refused with the file and tensor named, and a fuzz of
// header bytes that must only ever produce clean errors.
#include "runtime/checkpoint/safetensors.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "gemvz/checkpoint.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/support/random_weights.h"
#include "tests/support/temp_files.h"

namespace gemvz::internal {
namespace {

using ::gemvz::testing::ListDir;
using ::gemvz::testing::MakeTempDir;
using ::gemvz::testing::ReadAll;
using ::gemvz::testing::ReturnsWithoutAWriter;
using ::gemvz::testing::WriteAll;
using ::gemvz::testing::FreshSeed;
using Json = nlohmann::json;

// A raw file: length prefix, header text, data.
std::string RawFile(const std::string& header, const std::string& data, int64_t claimed_len = -1) {
  const uint64_t n = claimed_len >= 0 ? static_cast<uint64_t>(claimed_len) : header.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return out + header + data;
}

struct TestTensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

std::vector<TestTensor> SomeTensors(uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto random_bytes = [&](size_t n) {
    std::string s(n, '\0');
    for (auto& c : s) c = static_cast<char>(rng());
    return s;
  };
  return {
      {"a.bf16", "BF16", {16, 64}, random_bytes(16 * 64 * 2)},
      {"b.f32", "F32", {7}, random_bytes(28)},
      {"c.scalar", "I64", {}, random_bytes(8)},
      {"d.empty", "F16", {0, 5}, ""},
      {"e.u8", "U8", {3, 3}, random_bytes(9)},
      {"f.bool", "BOOL", {5}, random_bytes(5)},
      {"g.f64", "F64", {2, 1, 2}, random_bytes(32)},
      {"h.odd name \xc3\xa9", "I32", {1}, random_bytes(4)},
  };
}

std::string WriteTensors(const std::string& path, const std::vector<TestTensor>& ts,
                         const std::map<std::string, std::string>& meta) {
  std::vector<SafetensorsEntry> bound;
  for (const auto& t : ts) {
    SafetensorsEntry e;
    e.name = t.name;
    e.dtype = t.dtype;
    e.shape = t.shape;
    e.begin = e.end = kMaxHeaderNumber;
    bound.push_back(e);
  }
  auto w = SafetensorsWriter::Create(path, SafetensorsHeaderJson(bound, meta).size());
  EXPECT_TRUE(w.ok()) << w.status();
  for (const auto& t : ts) {
    // In two pieces, to exercise Begin/Write/End.
    EXPECT_TRUE((*w)->BeginTensor(t.name, t.dtype, t.shape).ok());
    const size_t half = t.bytes.size() / 2;
    if (half > 0) EXPECT_TRUE((*w)->Write(t.bytes.data(), half).ok());
    if (t.bytes.size() > half) {
      EXPECT_TRUE((*w)->Write(t.bytes.data() + half, t.bytes.size() - half).ok());
    }
    EXPECT_TRUE((*w)->EndTensor().ok());
  }
  for (const auto& [k, v] : meta) (*w)->SetMetadata(k, v);
  EXPECT_TRUE((*w)->Finish().ok());
  const std::string temp = (*w)->temp_path();
  EXPECT_TRUE((*w)->Publish().ok());
  return temp;
}

// What the reference implementation insists on: header length prefix, a JSON object, tensors
// that cover the data section exactly, with no holes and no overlaps.
void ExpectReferenceLayout(const std::string& path) {
  const std::string bytes = ReadAll(path);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
  ASSERT_LE(8 + n, bytes.size());
  EXPECT_EQ((8 + n) % 8, 0u) << "data section not 8-byte aligned";
  const std::string header = bytes.substr(8, n);
  EXPECT_EQ(header[0], '{');
  Json h = Json::parse(header);  // trailing spaces are allowed
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    ranges.emplace_back(it.value()["data_offsets"][0].get<uint64_t>(),
                        it.value()["data_offsets"][1].get<uint64_t>());
  }
  std::sort(ranges.begin(), ranges.end());
  uint64_t at = 0;
  for (auto [b, e] : ranges) {
    EXPECT_EQ(b, at) << "hole or overlap in the data section";
    at = e;
  }
  EXPECT_EQ(at, bytes.size() - 8 - n) << "data section not fully covered";
}

// A FIFO (named like a checkpoint file, or inside a checkpoint directory) is refused at once.
TEST(SafetensorsTest, AFifoIsRefusedWithoutWaitingForAWriter) {
  const std::string dir = MakeTempDir("safetensors_test");
  const std::string fifo = dir + "/pipe.safetensors";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  absl::Status st;
  EXPECT_TRUE(ReturnsWithoutAWriter(fifo, [&] { st = SafetensorsFile::Open(fifo).status(); }));
  EXPECT_NE(st.message().find("not a regular file"), std::string::npos) << st;
  EXPECT_NE(st.message().find(fifo), std::string::npos) << st;
  EXPECT_TRUE(
      ReturnsWithoutAWriter(fifo, [&] { st = gemvz::PackedCheckpoint::Open(dir).status(); }));
  EXPECT_FALSE(st.ok());
}

TEST(SafetensorsTest, WriterRoundTripsThroughTheReader) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(seed);
  const std::string dir = MakeTempDir("safetensors_test");
  const std::string path = dir + "/x.safetensors";
  const auto ts = SomeTensors(seed);
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "\"quoted\"\n"}};
  const std::string temp = WriteTensors(path, ts, meta);
  EXPECT_EQ(ListDir(dir), std::vector<std::string>{"x.safetensors"});
  struct stat sb;
  EXPECT_NE(::stat(temp.c_str(), &sb), 0) << "temporary file left behind";
  ExpectReferenceLayout(path);

  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->metadata(), meta);
  ASSERT_EQ((*f)->tensors().size(), ts.size());
  for (const auto& t : ts) {
    const SafetensorsEntry* e = (*f)->Find(t.name);
    ASSERT_NE(e, nullptr) << t.name;
    EXPECT_EQ(e->dtype, t.dtype);
    EXPECT_EQ(e->shape, t.shape);
    ASSERT_EQ(e->end - e->begin, t.bytes.size());
    EXPECT_EQ(std::string(reinterpret_cast<const char*>((*f)->data(*e)), t.bytes.size()), t.bytes)
        << t.name;
    (*f)->Release(e->begin, e->end - e->begin);  // harmless; the data stays readable
    EXPECT_EQ(std::string(reinterpret_cast<const char*>((*f)->data(*e)), t.bytes.size()), t.bytes);
  }
  EXPECT_EQ((*f)->Find("nope"), nullptr);
}

// A zero dimension makes a tensor empty whatever its other dimensions are: the writer takes it
// without overflowing (signed overflow in numel() aborted the sanitizer build, e.g. when `gemvz
// pack` copied such a tensor from a valid input), and a shape whose size overflows is refused
// instead of wrapping to a small byte count.
TEST(SafetensorsTest, WriterHandlesShapesWhoseProductOverflows) {
  const std::string dir = MakeTempDir("safetensors_test");
  const std::string path = dir + "/z.safetensors";
  const std::vector<int64_t> empty = {int64_t{1} << 32, int64_t{1} << 32, 0};
  {
    auto w = SafetensorsWriter::Create(path, 512);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_TRUE((*w)->AddTensor("empty", "BF16", empty, nullptr, 0).ok());
    ASSERT_TRUE((*w)->Finish().ok());
    ASSERT_TRUE((*w)->Publish().ok());
  }
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ((*f)->tensors().size(), 1u);
  EXPECT_EQ((*f)->tensors()[0].shape, empty);
  EXPECT_EQ((*f)->tensors()[0].numel(), 0);

  auto w = SafetensorsWriter::Create(dir + "/big.safetensors", 512);
  ASSERT_TRUE(w.ok()) << w.status();
  const absl::Status st =
      (*w)->BeginTensor("big", "BF16", {int64_t{1} << 32, int64_t{1} << 32});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("big"), std::string::npos) << st;
  EXPECT_FALSE((*w)->Finish().ok());
  EXPECT_EQ((*w)->BeginTensor("neg", "U8", {-1}).code(), absl::StatusCode::kInvalidArgument);
}

TEST(SafetensorsTest, UnpublishedWriterLeavesNothing) {
  const std::string dir = MakeTempDir("safetensors_test");
  {
    auto w = SafetensorsWriter::Create(dir + "/y.safetensors", 256);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->AddTensor("t", "U8", {4}, "abcd", 4).ok());
    ASSERT_TRUE((*w)->Finish().ok());
    EXPECT_EQ(ListDir(dir).size(), 1u);  // the temporary file only
    EXPECT_NE(ListDir(dir)[0], "y.safetensors");
  }
  EXPECT_TRUE(ListDir(dir).empty());
  // Wrong byte counts, unknown dtypes and duplicates are refused, and poison the writer.
  for (int c = 0; c < 3; ++c) {
    auto w = SafetensorsWriter::Create(dir + "/z.safetensors", 1000);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->AddTensor("v", "U8", {1}, "a", 1).ok());
    if (c == 0) EXPECT_FALSE((*w)->AddTensor("t", "U8", {4}, "abc", 3).ok());
    if (c == 1) EXPECT_FALSE((*w)->AddTensor("u", "Q7", {1}, "a", 1).ok());
    if (c == 2) EXPECT_FALSE((*w)->AddTensor("v", "U8", {1}, "a", 1).ok());
    const absl::Status st = (*w)->Finish();
    EXPECT_FALSE(st.ok()) << c;
    EXPECT_NE(st.message().find("earlier write failed"), std::string::npos) << st;
    EXPECT_FALSE((*w)->Publish().ok());
  }
  // A reserve too small for the header.
  {
    auto w = SafetensorsWriter::Create(dir + "/z.safetensors", 10);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->AddTensor("a_long_tensor_name", "U8", {1}, "a", 1).ok());
    const absl::Status st = (*w)->Finish();
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find("reserved"), std::string::npos) << st;
  }
  EXPECT_TRUE(ListDir(dir).empty());
  // A reserve past the readers' limit (the header is padded to it, so the file could not be read
  // back) is refused before any file is made; one at the limit is taken.
  {
    auto w = SafetensorsWriter::Create(dir + "/z.safetensors", kMaxSafetensorsHeaderBytes + 1);
    ASSERT_FALSE(w.ok());
    EXPECT_NE(w.status().message().find("-byte limit"), std::string::npos) << w.status();
    EXPECT_NE(w.status().message().find(dir + "/z.safetensors"), std::string::npos) << w.status();
    EXPECT_TRUE(ListDir(dir).empty());
    EXPECT_TRUE(SafetensorsWriter::Create(dir + "/z.safetensors", kMaxSafetensorsHeaderBytes).ok());
  }
  EXPECT_TRUE(ListDir(dir).empty());
  // Into a directory that does not exist.
  EXPECT_FALSE(SafetensorsWriter::Create(dir + "/missing/z.safetensors", 10).ok());
}

TEST(SafetensorsTest, DtypeSizes) {
  EXPECT_EQ(*SafetensorsDtypeSize("BF16"), 2);
  EXPECT_EQ(*SafetensorsDtypeSize("F32"), 4);
  EXPECT_EQ(*SafetensorsDtypeSize("I64"), 8);
  EXPECT_EQ(*SafetensorsDtypeSize("F8_E4M3"), 1);
  EXPECT_FALSE(SafetensorsDtypeSize("F4").ok());
  EXPECT_FALSE(SafetensorsDtypeSize("bf16").ok());
}

struct BadCase {
  const char* name;
  std::string file;      // the whole file
  const char* expected;  // substring of the error
  const char* tensor;    // the tensor the error must name, or nullptr
};

TEST(SafetensorsTest, BadFilesAreRefusedNamingFileAndTensor) {
  const std::string dir = MakeTempDir("safetensors_test");
  const std::string data16(16, '\x11');
  auto entry = [](const char* dtype, const std::string& shape, uint64_t b, uint64_t e) {
    return "{\"dtype\":\"" + std::string(dtype) + "\",\"shape\":" + shape + ",\"data_offsets\":[" +
           std::to_string(b) + "," + std::to_string(e) + "]}";
  };
  const std::string good_header = "{\"w\":" + entry("BF16", "[2,4]", 0, 16) + "}";
  std::string ones;
  for (int i = 0; i < 150; ++i) ones += "1,";
  const std::vector<BadCase> cases = {
      {"empty file", "", "truncated", nullptr},
      {"7 bytes", std::string(7, '\0'), "truncated", nullptr},
      {"header length past the end", RawFile(good_header, data16, 1000), "runs past the end",
       nullptr},
      {"header length 2^63", RawFile(good_header, data16, int64_t{1} << 62), "runs past the end",
       nullptr},
      {"header length zero", RawFile("", data16, 0), "too small", nullptr},
      {"header not json", RawFile("{not json", data16), "not valid JSON", nullptr},
      // The parser's message repeats what it read, escaping only bytes below 0x20.
      {"header not json, with a C1 control (U+009B) where it stops",
       RawFile("{\"a\xc2\x9b[2J", data16), "not valid JSON", nullptr},
      {"header cut short", RawFile(good_header.substr(0, 20), data16), "not valid JSON", nullptr},
      {"header an array", RawFile("[1,2,3]", data16), "not a JSON object", nullptr},
      // Nesting that would crash a DOM's recursive dump or copy is refused before the parse.
      {"shape nested 60000 deep",
       RawFile("{\"w\":" + entry("BF16", std::string(60000, '[') + std::string(60000, ']'), 0, 16) +
                   "}",
               data16),
       "nest more than 64 deep", nullptr},
      {"a NUL in the header", RawFile(good_header + std::string("\0", 1) + "{\"x\":1}", data16),
       "NUL byte at offset", nullptr},
      {"a long shape with a bad dimension, quoted in part",
       RawFile("{\"w\":" + entry("BF16", "[" + ones + "-1]", 0, 16) + "}", data16),
       ",1,1... has a dimension", "w"},
      {"duplicate tensor",
       RawFile("{\"w\":" + entry("BF16", "[2,4]", 0, 16) +
                   ",\"w\":" + entry("BF16", "[2,4]", 0, 16) + "}",
               data16),
       "repeats the key 'w'", nullptr},
      {"duplicate field",
       RawFile(
           "{\"w\":{\"dtype\":\"BF16\",\"dtype\":\"F32\",\"shape\":[2,4],\"data_offsets\":[0,16]}}",
           data16),
       "repeats the key 'dtype'", nullptr},
      {"unknown dtype", RawFile("{\"w\":" + entry("BF17", "[2,4]", 0, 16) + "}", data16),
       "unknown dtype 'BF17'", "w"},
      {"sub-byte dtype", RawFile("{\"w\":" + entry("F4", "[32]", 0, 16) + "}", data16),
       "unknown dtype", "w"},
      {"dtype not a string",
       RawFile("{\"w\":{\"dtype\":7,\"shape\":[2,4],\"data_offsets\":[0,16]}}", data16),
       "no string 'dtype'", "w"},
      {"negative dim", RawFile("{\"w\":" + entry("BF16", "[-2,4]", 0, 16) + "}", data16),
       "not a non-negative integer", "w"},
      {"float dim", RawFile("{\"w\":" + entry("BF16", "[2.0,4]", 0, 16) + "}", data16),
       "not a non-negative integer", "w"},
      {"shape missing", RawFile("{\"w\":{\"dtype\":\"BF16\",\"data_offsets\":[0,16]}}", data16),
       "no 'shape' array", "w"},
      {"offsets missing", RawFile("{\"w\":{\"dtype\":\"BF16\",\"shape\":[2,4]}}", data16),
       "data_offsets", "w"},
      {"offsets of three",
       RawFile("{\"w\":{\"dtype\":\"BF16\",\"shape\":[2,4],\"data_offsets\":[0,8,16]}}", data16),
       "data_offsets", "w"},
      {"offsets reversed", RawFile("{\"w\":" + entry("BF16", "[0]", 16, 0) + "}", data16),
       "end before they begin", "w"},
      {"offsets past the end", RawFile("{\"w\":" + entry("BF16", "[2,4]", 8, 24) + "}", data16),
       "run past the data section", "w"},
      {"truncated data", RawFile(good_header, data16.substr(0, 15)), "run past the data section",
       "w"},
      {"size mismatch", RawFile("{\"w\":" + entry("BF16", "[2,3]", 0, 16) + "}", data16),
       "needs 12", "w"},
      {"shape overflow",
       RawFile("{\"w\":" + entry("BF16", "[4294967296,4294967296]", 0, 16) + "}", data16),
       "more than 2^64", "w"},
      {"overlap",
       RawFile(
           "{\"a\":" + entry("U8", "[10]", 0, 10) + ",\"b\":" + entry("U8", "[10]", 6, 16) + "}",
           data16),
       "overlap tensor 'a'", "b"},
      {"same range",
       RawFile(
           "{\"a\":" + entry("U8", "[16]", 0, 16) + ",\"b\":" + entry("U8", "[16]", 0, 16) + "}",
           data16),
       "overlap", nullptr},
      {"entry not an object", RawFile("{\"w\":[1]}", data16), "not an object", "w"},
      {"metadata not an object", RawFile("{\"__metadata__\":[1]}", data16), "__metadata__",
       nullptr},
      {"metadata value not a string", RawFile("{\"__metadata__\":{\"k\":1}}", data16),
       "is not a string", nullptr},
      // A name from the header is quoted escaped: a NUL would end the message where it is
      // printed, a terminal escape rewrite the screen.
      {"a NUL, an escape and a quote in a name",
       RawFile("{\"a\\u0000z\\u001b[2J'\":" + entry("BF17", "[2,4]", 0, 16) + "}", data16),
       "unknown dtype", "a\\x00z\\x1b[2J\\'"},
      {"a control byte in a repeated key",
       RawFile("{\"\\u0007\":" + entry("BF16", "[2,4]", 0, 16) +
                   ",\"\\u0007\":" + entry("BF16", "[2,4]", 0, 16) + "}",
               data16),
       "repeats the key '\\x07'", nullptr},
      {"a C1 control (U+009B, CSI) in a name and in a dtype",
       RawFile("{\"q\\u009b\":" + entry("Q\\u009b", "[2,4]", 0, 16) + "}", data16),
       "unknown dtype 'Q\\xc2\\x9b'", "q\\xc2\\x9b"},
  };
  for (const BadCase& c : cases) {
    const std::string path = dir + "/bad.safetensors";
    WriteAll(path, c.file);
    auto f = SafetensorsFile::Open(path);
    ASSERT_FALSE(f.ok()) << c.name;
    const std::string msg(f.status().message());
    EXPECT_NE(msg.find(c.expected), std::string::npos) << c.name << ": " << msg;
    EXPECT_NE(msg.find(path), std::string::npos) << c.name << ": " << msg;
    EXPECT_EQ(msg.find_first_of(std::string("\0\x07\x1b\x9b", 4)), std::string::npos)
        << c.name << ": a control byte in " << absl::CHexEscape(msg);
    if (c.tensor != nullptr) {
      EXPECT_NE(msg.find(std::string("tensor '") + c.tensor + "'"), std::string::npos)
          << c.name << ": " << msg;
    }
  }
  // The good file they were all derived from does open; so do zero-size tensors sharing an
  // offset and trailing spaces after the header.
  WriteAll(dir + "/good.safetensors", RawFile(good_header + "    ", data16));
  EXPECT_TRUE(SafetensorsFile::Open(dir + "/good.safetensors").ok());
  WriteAll(dir + "/empty.safetensors",
           RawFile("{\"a\":" + entry("U8", "[0]", 16, 16) + ",\"b\":" + entry("U8", "[0]", 16, 16) +
                       ",\"c\":" + entry("U8", "[16]", 0, 16) + "}",
                   data16));
  EXPECT_TRUE(SafetensorsFile::Open(dir + "/empty.safetensors").ok());
  // Not there; a directory.
  auto missing = SafetensorsFile::Open(dir + "/none.safetensors");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(SafetensorsFile::Open(dir).ok());
}

TEST(SafetensorsTest, HeaderAboveTheLimitIsRefused) {
  // A sparse file, so the header length fits inside it without writing 100 MiB.
  const std::string dir = MakeTempDir("safetensors_test");
  const std::string path = dir + "/huge.safetensors";
  WriteAll(path, RawFile("{}", "", kMaxSafetensorsHeaderBytes + 1));
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(kMaxSafetensorsHeaderBytes + 64)), 0);
  auto f = SafetensorsFile::Open(path);
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("limit"), std::string::npos) << f.status();
}

// Flips, overwrites and truncates bytes of the length prefix and the JSON header of a valid file,
// two thousand times. Every outcome must be a clean error or a file whose every tensor lies
// inside it (run under ASan in CI to catch reads outside the mapping).
TEST(SafetensorsTest, FuzzedHeadersGiveCleanErrors) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(seed);
  std::mt19937_64 rng(seed);
  const std::string dir = MakeTempDir("safetensors_test");
  const std::string good_path = dir + "/good.safetensors";
  WriteTensors(good_path, SomeTensors(seed), {{"format", "pt"}});
  const std::string good = ReadAll(good_path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(good[i]);
  const size_t header_end = 8 + n;
  const std::string path = dir + "/fuzz.safetensors";
  const char kInteresting[] = "{}[],:\"0123456789-.e \\";
  int opened = 0, refused = 0;
  for (int iter = 0; iter < 2000; ++iter) {
    std::string bytes = good;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < edits; ++k) {
      const size_t at = rng() % header_end;
      switch (rng() % 4) {
        case 0:
          bytes[at] = static_cast<char>(bytes[at] ^ (1 << (rng() % 8)));
          break;
        case 1:
          bytes[at] = kInteresting[rng() % (sizeof(kInteresting) - 1)];
          break;
        case 2:
          bytes[at] = static_cast<char>(rng());
          break;
        case 3:
          if (rng() % 8 == 0) bytes.resize(at);  // truncation, now and then
          break;
      }
      if (bytes.size() <= at) break;
    }
    WriteAll(path, bytes);
    auto f = SafetensorsFile::Open(path);
    if (!f.ok()) {
      ++refused;
      EXPECT_FALSE(f.status().message().empty());
      EXPECT_NE(f.status().message().find(path), std::string::npos) << f.status();
      continue;
    }
    ++opened;
    // Whatever was accepted must be internally consistent: read every byte of every tensor.
    const uint64_t data_size = (*f)->file_size() - (*f)->data_offset();
    uint64_t sum = 0;
    for (const SafetensorsEntry& e : (*f)->tensors()) {
      ASSERT_LE(e.begin, e.end);
      ASSERT_LE(e.end, data_size);
      ASSERT_EQ(e.end - e.begin, static_cast<uint64_t>(e.numel()) *
                                     static_cast<uint64_t>(*SafetensorsDtypeSize(e.dtype)));
      for (uint64_t i = 0; i < e.end - e.begin; ++i) sum += (*f)->data(e)[i];
    }
    (void)sum;
  }
  // Both outcomes occur (flips inside a name or a metadata value leave the file valid).
  EXPECT_GT(refused, 0);
  EXPECT_GT(opened, 0);
}

}  // namespace
}  // namespace gemvz::internal
