// Tests of checkpoint packing and reading: a synthetic sharded checkpoint (several dtypes, 1-D
// and 2-D tensors, an all-zero row, NaN) packed, verified and reloaded; every bad input refused
// with the file and tensor named and nothing left behind; corrupt packed files caught; the CLI.
#include "gemvz/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "runtime/checkpoint/packed_tensor.h"
#include "runtime/checkpoint/safetensors.h"
#include "runtime/cuda/driver.h"
#include "tests/support/fail_readdir.h"
#include "tests/support/gpu_util.h"
#include "tests/support/random_weights.h"
#include "tests/support/temp_files.h"

namespace gemvz {
namespace {

using ::gemvz::testing::Exists;
using ::gemvz::testing::ListDir;
using ::gemvz::testing::MakeTempDir;
using ::gemvz::testing::ReadAll;
using ::gemvz::testing::WriteAll;
using ::gemvz::testing::Distribution;
using ::gemvz::testing::FreshSeed;
using ::gemvz::testing::RandomMatrix;
using internal::SafetensorsEntry;
using internal::SafetensorsFile;
using internal::SafetensorsWriter;

struct Tensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::string bytes;
  bool expect_packed = false;
  std::string expect_reason;  // substring of the skip reason
};

std::string Bf16Bytes(const std::vector<uint16_t>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 2);
}

template <typename T>
std::string PodBytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

// Every field, the doubles bit for bit: the metadata's JSON carries them exactly.
void ExpectSameStats(const PackStats& a, const PackStats& b, const std::string& what) {
  EXPECT_EQ(a.weights, b.weights) << what;
  EXPECT_EQ(a.outside_window, b.outside_window) << what;
  EXPECT_EQ(a.sparse_entries, b.sparse_entries) << what;
  EXPECT_EQ(a.residual_entries, b.residual_entries) << what;
  EXPECT_EQ(a.dense_rows, b.dense_rows) << what;
  EXPECT_EQ(a.total_bytes, b.total_bytes) << what;
  EXPECT_EQ(a.padded_table_bytes, b.padded_table_bytes) << what;
  EXPECT_EQ(a.bits_per_weight, b.bits_per_weight) << what;
  EXPECT_EQ(a.exception_rate, b.exception_rate) << what;
  EXPECT_EQ(a.window_coverage, b.window_coverage) << what;
}

void WriteCheckpoint(const std::string& path, const std::vector<Tensor>& ts,
                     const std::map<std::string, std::string>& meta = {{"format", "pt"}}) {
  std::vector<SafetensorsEntry> bound;
  for (const auto& t : ts)
    bound.push_back(
        {t.name, t.dtype, t.shape, internal::kMaxHeaderNumber, internal::kMaxHeaderNumber});
  auto w = SafetensorsWriter::Create(path, internal::SafetensorsHeaderJson(bound, meta).size());
  ASSERT_TRUE(w.ok()) << w.status();
  for (const auto& t : ts) {
    ASSERT_TRUE((*w)->AddTensor(t.name, t.dtype, t.shape, t.bytes.data(), t.bytes.size()).ok())
        << t.name;
  }
  for (const auto& [k, v] : meta) (*w)->SetMetadata(k, v);
  ASSERT_TRUE((*w)->Finish().ok());
  ASSERT_TRUE((*w)->Publish().ok());
}

// Two shards of a small model: packable matrices of several distributions (one with an all-zero
// row), and tensors that must be kept: 1-D, other dtypes, odd shapes, a scalar, an empty tensor,
// an F32 holding NaN and Inf.
std::vector<std::vector<Tensor>> SyntheticShards(uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto embed = RandomMatrix(128, 256, Distribution::kNormal, seed + 1);
  std::fill(embed.begin() + 7 * 256, embed.begin() + 8 * 256, 0);  // padded vocabulary row
  std::vector<float> bias(256);
  for (auto& b : bias) b = static_cast<float>(rng() % 1000) / 1000.f;
  bias[3] = std::nanf("");
  bias[9] = -INFINITY;
  std::vector<uint16_t> f16(64 * 128);
  for (auto& v : f16) v = static_cast<uint16_t>(rng() & 0x7BFF);
  std::vector<int64_t> step = {static_cast<int64_t>(rng())};
  std::vector<uint8_t> mask(16);
  for (auto& m : mask) m = rng() & 1;
  std::vector<int8_t> i8(16);
  for (auto& v : i8) v = static_cast<int8_t>(rng());
  std::vector<Tensor> a = {
      {"model.embed_tokens.weight", "BF16", {128, 256}, Bf16Bytes(embed), true, ""},
      {"model.layers.0.mlp.down_proj.weight",
       "BF16",
       {64, 512},
       Bf16Bytes(RandomMatrix(64, 512, Distribution::kStudentT3, seed + 2)),
       true,
       ""},
      {"model.layers.0.self_attn.q_proj.weight",
       "BF16",
       {32, 128},
       Bf16Bytes(RandomMatrix(32, 128, Distribution::kTiny, seed + 3)),
       true,
       ""},
      {"model.layers.0.input_layernorm.weight",
       "BF16",
       {256},
       Bf16Bytes(RandomMatrix(1, 256, Distribution::kNormal, seed + 4)),
       false,
       "1-D"},
      {"model.layers.0.bias", "F32", {256}, PodBytes(bias), false, "dtype F32"},
      {"model.step", "I64", {}, PodBytes(step), false, "dtype I64"},
  };
  std::vector<Tensor> b = {
      {"lm_head.weight", "F16", {64, 128}, PodBytes(f16), false, "dtype F16"},
      {"model.layers.1.odd_rows.weight",
       "BF16",
       {20, 64},
       Bf16Bytes(RandomMatrix(20, 64, Distribution::kNormal, seed + 5)),
       false,
       "N % 16"},
      {"model.layers.1.odd_cols.weight",
       "BF16",
       {16, 96},
       Bf16Bytes(RandomMatrix(16, 96, Distribution::kNormal, seed + 6)),
       false,
       "K % 64"},
      {"model.layers.1.conv.weight",
       "BF16",
       {16, 4, 64},
       Bf16Bytes(RandomMatrix(16, 256, Distribution::kNormal, seed + 7)),
       false,
       "3-D"},
      {"model.layers.1.mlp.up_proj.weight",
       "BF16",
       {48, 192},
       Bf16Bytes(RandomMatrix(48, 192, Distribution::kFullRange, seed + 8)),
       true,
       ""},
      {"model.empty", "F32", {0}, "", false, "dtype F32"},
      {"model.empty_matrix", "BF16", {0, 64}, "", false, "empty"},
      {"model.mask", "BOOL", {16}, PodBytes(mask), false, "dtype BOOL"},
      {"model.i8", "I8", {4, 4}, PodBytes(i8), false, "dtype I8"},
  };
  return {a, b};
}

TEST(CheckpointTest, PacksVerifiesAndReloadsASyntheticCheckpoint) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(seed);
  const std::string dir = MakeTempDir("checkpoint_test");
  const auto shards = SyntheticShards(seed);
  const std::vector<std::string> inputs = {dir + "/model-00001-of-00002.safetensors",
                                           dir + "/model-00002-of-00002.safetensors"};
  WriteCheckpoint(inputs[0], shards[0]);
  WriteCheckpoint(inputs[1], shards[1]);

  CheckpointPackOptions options;
  options.verify = true;
  options.threads = 2;
  int64_t calls = 0, last_done = -1;
  bool monotonic = true;
  options.progress = [&](const PackProgress& p) {
    ++calls;
    monotonic &= p.bytes_done >= last_done && p.bytes_done <= p.bytes_total;
    last_done = p.bytes_done;
  };
  const std::string out = dir + "/packed";
  absl::StatusOr<CheckpointPackReport> report = PackCheckpoint(inputs, out, options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_GT(calls, 0);
  EXPECT_TRUE(monotonic);
  EXPECT_TRUE(report->verified);
  EXPECT_EQ(report->outputs, (std::vector<std::string>{out + "/model-00001-of-00002.safetensors",
                                                       out + "/model-00002-of-00002.safetensors",
                                                       out + "/model.safetensors.index.json"}));
  EXPECT_EQ(ListDir(out), (std::vector<std::string>{"model-00001-of-00002.safetensors",
                                                    "model-00002-of-00002.safetensors",
                                                    "model.safetensors.index.json"}));

  // The report: what was packed, what was kept and why.
  std::map<std::string, const Tensor*> expected;
  for (const auto& s : shards) {
    for (const auto& t : s) expected[t.name] = &t;
  }
  ASSERT_EQ(report->tensors.size(), expected.size());
  int64_t packed = 0;
  std::map<std::string, const TensorPackReport*> reported;
  for (const TensorPackReport& r : report->tensors) {
    reported[r.name] = &r;
    const Tensor& t = *expected.at(r.name);
    EXPECT_EQ(r.packed, t.expect_packed) << r.name << ": " << r.skip_reason;
    EXPECT_TRUE(r.verified) << r.name;
    EXPECT_EQ(r.input_bytes, static_cast<int64_t>(t.bytes.size())) << r.name;
    if (r.packed) {
      ++packed;
      EXPECT_EQ(r.stats.weights, t.shape[0] * t.shape[1]);
      EXPECT_GT(r.stats.bits_per_weight, 11.9);
      EXPECT_NEAR(r.stats.window_coverage + r.stats.exception_rate, 1.0, 1e-12);
      EXPECT_GE(r.output_bytes, t.shape[0] * t.shape[1] * 3 / 2);
    } else {
      EXPECT_NE(r.skip_reason.find(t.expect_reason), std::string::npos)
          << r.name << ": '" << r.skip_reason << "' lacks '" << t.expect_reason << "'";
    }
    if (r.name == "model.embed_tokens.weight") EXPECT_GE(r.stats.dense_rows, 1);  // zero row
  }
  EXPECT_EQ(report->packed_tensors, packed);
  EXPECT_EQ(packed, 4);

  // Every output is a safetensors file any reader takes: contiguous data, metadata of strings.
  for (const std::string& path : report->outputs) {
    if (path == out + "/model.safetensors.index.json") continue;
    auto f = SafetensorsFile::Open(path);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ((*f)->data_offset() % 8, 0u);
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    for (const auto& e : (*f)->tensors()) ranges.emplace_back(e.begin, e.end);
    std::sort(ranges.begin(), ranges.end());
    uint64_t at = 0;
    for (auto [b, e] : ranges) {
      EXPECT_EQ(b, at);
      at = e;
    }
    EXPECT_EQ(at, (*f)->file_size() - (*f)->data_offset());
    // Every tensor starts at a multiple of its element size, as in the reference writer's files,
    // though the embedding's one dense row makes a U8 part of odd length and kept tensors have
    // odd sizes: a reader may take each as an array of its type in place.
    for (const auto& e : (*f)->tensors()) {
      absl::StatusOr<int> size = internal::SafetensorsDtypeSize(e.dtype);
      ASSERT_TRUE(size.ok()) << e.dtype;
      EXPECT_EQ(((*f)->data_offset() + e.begin) % *size, 0u)
          << e.name << " (" << e.dtype << ") at " << e.begin;
    }
    EXPECT_EQ((*f)->metadata().at("format"), "pt");  // the input's metadata is kept
    EXPECT_EQ((*f)->metadata().at("gemvz.version"), "1");
  }
  auto f0 = SafetensorsFile::Open(report->outputs[0]);
  ASSERT_TRUE(f0.ok());
  const SafetensorsEntry* w = (*f0)->Find("model.embed_tokens.weight.z12.weights");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->dtype, "U8");
  EXPECT_EQ(w->shape, (std::vector<int64_t>{8, 4, 3, 32, 16}));
  const nlohmann::json meta =
      nlohmann::json::parse((*f0)->metadata().at("gemvz.z12.model.embed_tokens.weight"));
  EXPECT_EQ(meta["format"], "z12");
  EXPECT_EQ(meta["version"], 1);
  EXPECT_EQ(meta["rows"], 128);
  EXPECT_EQ(meta["cols"], 256);
  EXPECT_TRUE(meta.contains("base") && meta.contains("tl") && meta.contains("th"));

  // Reloaded through the library: every tensor bit for bit, packed or kept.
  absl::StatusOr<PackedCheckpoint> ckpt = PackedCheckpoint::Open(out);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  ASSERT_EQ(ckpt->tensors().size(), expected.size());
  bool tables_reported = false;
  for (const TensorInfo& info : ckpt->tensors()) {
    ASSERT_TRUE(expected.count(info.name)) << "unexpected tensor " << info.name;
    const Tensor& t = *expected.at(info.name);
    EXPECT_EQ(info.packed, t.expect_packed) << info.name;
    EXPECT_EQ(info.dtype, t.dtype);
    EXPECT_EQ(info.shape, t.shape);
    if (t.expect_packed) {
      absl::StatusOr<PackedMatrix> p = ckpt->GetPacked(info.name);
      ASSERT_TRUE(p.ok()) << p.status();
      EXPECT_EQ(p->rows, t.shape[0]);
      // The statistics come back from the metadata as Pack computed them, the last one too
      // (nonzero where the matrix has corrections).
      ExpectSameStats(p->stats, reported.at(info.name)->stats, info.name);
      tables_reported |= p->stats.padded_table_bytes > 0;
      absl::StatusOr<std::vector<uint16_t>> back = Unpack(*p);
      ASSERT_TRUE(back.ok());
      EXPECT_EQ(Bf16Bytes(*back), t.bytes) << info.name;
      EXPECT_FALSE(ckpt->GetRaw(info.name).ok());
    } else {
      absl::StatusOr<TensorView> v = ckpt->GetRaw(info.name);
      ASSERT_TRUE(v.ok()) << v.status();
      EXPECT_EQ(std::string(reinterpret_cast<const char*>(v->data), v->size), t.bytes)
          << info.name;  // the NaN and -Inf of the F32 bias included
      EXPECT_FALSE(ckpt->GetPacked(info.name).ok());
    }
    if (t.dtype == "BF16") {
      absl::StatusOr<std::vector<uint16_t>> bits = ckpt->GetBf16(info.name);
      ASSERT_TRUE(bits.ok()) << bits.status();
      EXPECT_EQ(Bf16Bytes(*bits), t.bytes) << info.name;
    } else {
      EXPECT_FALSE(ckpt->GetBf16(info.name).ok());
    }
  }
  EXPECT_TRUE(tables_reported) << "no packed tensor with corrections: padded_table_bytes untested";
  EXPECT_EQ(ckpt->Info("nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ckpt->GetPacked("nope").status().code(), absl::StatusCode::kNotFound);
  // One file of the directory opens on its own too.
  absl::StatusOr<PackedCheckpoint> one = PackedCheckpoint::Open(report->outputs[1]);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->tensors().size(), shards[1].size());
  // So does a plain (unpacked) checkpoint: everything is kept.
  absl::StatusOr<PackedCheckpoint> plain = PackedCheckpoint::Open(inputs[0]);
  ASSERT_TRUE(plain.ok()) << plain.status();
  absl::StatusOr<std::vector<uint16_t>> e = plain->GetBf16("model.embed_tokens.weight");
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(Bf16Bytes(*e), shards[0][0].bytes);
}

// PackedCheckpoint is thread-safe (checkpoint.h), and its readers give back what they read to the
// kernel as they go (madvise on the shared mapping): copies of one checkpoint read by 8 threads
// at once, each tensor many times over, packed and kept, every read bit for bit the original.
TEST(CheckpointTest, ReadersOnManyThreadsAtOnce) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(seed);
  const std::string dir = MakeTempDir("checkpoint_test");
  const auto shards = SyntheticShards(seed);
  const std::vector<std::string> inputs = {dir + "/a.safetensors", dir + "/b.safetensors"};
  WriteCheckpoint(inputs[0], shards[0]);
  WriteCheckpoint(inputs[1], shards[1]);
  const std::string out = dir + "/packed";
  ASSERT_TRUE(PackCheckpoint(inputs, out, {}).ok());
  absl::StatusOr<PackedCheckpoint> opened = PackedCheckpoint::Open(out);
  ASSERT_TRUE(opened.ok()) << opened.status();
  std::map<std::string, const Tensor*> expected;
  for (const auto& shard : shards) {
    for (const auto& t : shard) expected[t.name] = &t;
  }
  ASSERT_EQ(opened->tensors().size(), expected.size());
  for (const TensorInfo& info : opened->tensors()) ASSERT_EQ(expected.count(info.name), 1u);
  constexpr int kThreads = 8, kRounds = 6;
  std::atomic<int> reads{0};
  std::vector<std::string> failures(kThreads);
  std::vector<std::thread> pool;
  for (int i = 0; i < kThreads; ++i) {
    pool.emplace_back([&, i, ckpt = *opened] {  // a copy each: shared state
      auto fail = [&](const std::string& what) {
        if (failures[i].empty()) failures[i] = what;
      };
      for (int round = 0; round < kRounds; ++round) {
        // Each thread walks the tensors from its own starting point.
        const auto& all = ckpt.tensors();
        for (size_t j = 0; j < all.size(); ++j) {
          const TensorInfo& info = all[(j + static_cast<size_t>(i)) % all.size()];
          const Tensor& t = *expected.at(info.name);
          if (t.expect_packed) {
            absl::StatusOr<PackedMatrix> p = ckpt.GetPacked(info.name);
            absl::StatusOr<std::vector<uint16_t>> back =
                p.ok() ? Unpack(*p) : absl::StatusOr<std::vector<uint16_t>>(p.status());
            if (!back.ok() || Bf16Bytes(*back) != t.bytes) fail("GetPacked " + info.name);
          } else {
            absl::StatusOr<TensorView> v = ckpt.GetRaw(info.name);
            if (!v.ok() ||
                std::string(reinterpret_cast<const char*>(v->data), v->size) != t.bytes) {
              fail("GetRaw " + info.name);
            }
          }
          if (t.dtype == "BF16") {
            absl::StatusOr<std::vector<uint16_t>> bits = ckpt.GetBf16(info.name);
            if (!bits.ok() || Bf16Bytes(*bits) != t.bytes) fail("GetBf16 " + info.name);
          }
          reads.fetch_add(1);
        }
      }
    });
  }
  for (std::thread& th : pool) th.join();
  for (int i = 0; i < kThreads; ++i) EXPECT_EQ(failures[i], "") << "thread " << i;
  EXPECT_EQ(reads.load(), kThreads * kRounds * static_cast<int>(expected.size()));
}

// A packed checkpoint's tensors on the GPU (PackedCheckpoint::GetDevice): each the tensor named
// (two of one shape, one with an all-zero (dense) row, so that a mix-up shows), in the weight
// order asked (UploadOptions, each order in turn: the options must reach the upload), and a GEMV
// with it matches the double reference of the original BF16 weights, every value of its poisoned
// output written and nothing past it.
TEST(CheckpointTest, DeviceMatrixFromAPackedCheckpoint) {
  if (internal::DeviceCount() == 0) GTEST_SKIP() << "no GPU: DeviceMatrix::Upload needs one";
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const std::string dir = MakeTempDir("checkpoint_test");
  const int64_t n = 256, k = 512, m = 5;
  const auto w = RandomMatrix(n, k, Distribution::kNormal, seed);
  auto v = RandomMatrix(n, k, Distribution::kStudentT3, seed + 1);
  std::fill(v.begin() + 37 * k, v.begin() + 38 * k, uint16_t{0});
  WriteCheckpoint(dir + "/m.safetensors", {{"w", "BF16", {n, k}, Bf16Bytes(w), true, ""},
                                           {"v", "BF16", {n, k}, Bf16Bytes(v), true, ""}});
  ASSERT_TRUE(PackCheckpoint({dir + "/m.safetensors"}, dir + "/out").ok());
  absl::StatusOr<PackedCheckpoint> ckpt = PackedCheckpoint::Open(dir + "/out");
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  const std::vector<uint16_t> x = ::gemvz::testing::RandomActivations(m, k, seed + 2);
  for (const auto& [name, bits] : {std::pair<const char*, const std::vector<uint16_t>*>{"w", &w},
                                   {"v", &v}}) {
    for (const WeightOrder order : {WeightOrder::kBlockMajor, WeightOrder::kGroupMajor}) {
      SCOPED_TRACE(::testing::Message() << name << ", " << OrderName(order) << "-major");
      absl::StatusOr<DeviceMatrix> d = ckpt->GetDevice(name, 0, UploadOptions{order});
      ASSERT_TRUE(d.ok()) << d.status();
      EXPECT_EQ(d->rows(), n);
      EXPECT_EQ(d->cols(), k);
      EXPECT_EQ(d->format(), WeightFormat::kZ12);
      EXPECT_EQ(d->device(), 0);
      EXPECT_EQ(d->order(), order);
      EXPECT_EQ(::gemvz::testing::CheckGemv(*d, *bits, x, m), "");
    }
  }
  EXPECT_EQ(ckpt->GetDevice("nope").status().code(), absl::StatusCode::kNotFound);
}

TEST(CheckpointTest, NonFiniteWeightsAreRefusedOrKeptOnRequest) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(seed);
  std::mt19937_64 rng(seed);
  const std::string dir = MakeTempDir("checkpoint_test");
  for (uint16_t bad : {uint16_t{0x7FC0}, uint16_t{0x7F80}, uint16_t{0xFF80}, uint16_t{0xFFC1}}) {
    auto w = RandomMatrix(32, 128, Distribution::kNormal, seed);
    const int64_t row = static_cast<int64_t>(rng() % 32), col = static_cast<int64_t>(rng() % 128);
    w[row * 128 + col] = bad;
    const std::string in = dir + "/nan.safetensors";
    WriteCheckpoint(in, {{"ok",
                          "BF16",
                          {16, 64},
                          Bf16Bytes(RandomMatrix(16, 64, Distribution::kNormal, seed)),
                          true,
                          ""},
                         {"bad.weight", "BF16", {32, 128}, Bf16Bytes(w), true, ""}});
    // Two levels that do not exist yet: a failed pack takes back both.
    const std::string new_dir = dir + "/new" + std::to_string(bad);
    const std::string out = new_dir + "/out";
    absl::StatusOr<CheckpointPackReport> r = PackCheckpoint({in}, out);
    ASSERT_FALSE(r.ok());
    const std::string msg(r.status().message());
    EXPECT_NE(msg.find(in), std::string::npos) << msg;
    EXPECT_NE(msg.find("'bad.weight'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("row " + std::to_string(row) + ", col " + std::to_string(col)),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find((bad & 0x7F) ? "NaN" : "Inf"), std::string::npos) << msg;
    EXPECT_FALSE(Exists(new_dir)) << "a failed pack left the directories it made";

    CheckpointPackOptions keep;
    keep.keep_nonfinite = true;
    keep.verify = true;
    r = PackCheckpoint({in}, out, keep);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->tensors.size(), 2u);
    const TensorPackReport& t = r->tensors[1].name == "bad.weight" ? r->tensors[1] : r->tensors[0];
    EXPECT_FALSE(t.packed);
    EXPECT_NE(t.skip_reason.find("non-finite"), std::string::npos) << t.skip_reason;
    absl::StatusOr<PackedCheckpoint> c = PackedCheckpoint::Open(out);
    ASSERT_TRUE(c.ok());
    absl::StatusOr<std::vector<uint16_t>> back = c->GetBf16("bad.weight");
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, w);  // the NaN's payload too
    EXPECT_TRUE(c->Info("ok")->packed);
  }
}

// A raw safetensors file from a header text and data.
std::string RawFile(const std::string& header, const std::string& data, int64_t claimed = -1) {
  const uint64_t n = claimed >= 0 ? static_cast<uint64_t>(claimed) : header.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return out + header + data;
}

TEST(CheckpointTest, BadInputsAreRefusedAndLeaveNothing) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(seed);
  const std::string dir = MakeTempDir("checkpoint_test");
  const std::string good = dir + "/good.safetensors";
  const auto m = RandomMatrix(16, 64, Distribution::kNormal, seed);
  WriteCheckpoint(good, {{"w", "BF16", {16, 64}, Bf16Bytes(m), true, ""}});
  const std::string good_bytes = ReadAll(good);
  const std::string data(2048, '\x3c');
  auto entry = [](const char* name, const char* dtype, const std::string& shape, uint64_t b,
                  uint64_t e) {
    return "\"" + std::string(name) + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape +
           ",\"data_offsets\":[" + std::to_string(b) + "," + std::to_string(e) + "]}";
  };
  struct Case {
    const char* name;
    std::string bytes;
    const char* expected;
    const char* tensor;
  };
  const std::vector<Case> cases = {
      {"truncated file", good_bytes.substr(0, good_bytes.size() - 100), "run past", "w"},
      {"truncated header", good_bytes.substr(0, 30), "runs past the end", nullptr},
      {"wrong header length", RawFile("{" + entry("w", "BF16", "[16,64]", 0, 2048) + "}", data, 4),
       "not valid JSON", nullptr},
      {"header length too long",
       RawFile("{" + entry("w", "BF16", "[16,64]", 0, 2048) + "}", data, 5000), "runs past the end",
       nullptr},
      {"offsets outside the file",
       RawFile("{" + entry("w", "BF16", "[16,64]", 1024, 3072) + "}", data), "run past the data",
       "w"},
      {"overlapping tensors",
       RawFile("{" + entry("a", "BF16", "[16,32]", 0, 1024) + "," +
                   entry("b", "BF16", "[16,32]", 1000, 2024) + "}",
               data),
       "overlap", "b"},
      {"unknown dtype", RawFile("{" + entry("w", "BF15", "[16,64]", 0, 2048) + "}", data),
       "unknown dtype 'BF15'", "w"},
      {"size mismatch", RawFile("{" + entry("w", "BF16", "[16,63]", 0, 2048) + "}", data),
       "needs 2016", "w"},
  };
  for (const Case& c : cases) {
    const std::string bad = dir + "/bad.safetensors";
    WriteAll(bad, c.bytes);
    const std::string out = dir + "/out_" + std::to_string(&c - cases.data());
    // The bad file second, so that a good one has been fully processed first... or not even
    // started: either way nothing may be published.
    absl::StatusOr<CheckpointPackReport> r = PackCheckpoint({good, bad}, out);
    ASSERT_FALSE(r.ok()) << c.name;
    const std::string msg(r.status().message());
    EXPECT_NE(msg.find(bad), std::string::npos) << c.name << ": " << msg;
    EXPECT_NE(msg.find(c.expected), std::string::npos) << c.name << ": " << msg;
    if (c.tensor != nullptr) {
      EXPECT_NE(msg.find(std::string("tensor '") + c.tensor + "'"), std::string::npos)
          << c.name << ": " << msg;
    }
    EXPECT_TRUE(ListDir(out).empty()) << c.name;
  }
}

TEST(CheckpointTest, ConflictingInputsAreRefused) {
  const uint64_t seed = FreshSeed();
  const std::string dir = MakeTempDir("checkpoint_test");
  const std::string m = Bf16Bytes(RandomMatrix(16, 64, Distribution::kNormal, seed));
  ::mkdir((dir + "/a").c_str(), 0755);
  ::mkdir((dir + "/b").c_str(), 0755);
  WriteCheckpoint(dir + "/a/x.safetensors", {{"w", "BF16", {16, 64}, m, true, ""}});
  WriteCheckpoint(dir + "/b/x.safetensors", {{"v", "BF16", {16, 64}, m, true, ""}});
  WriteCheckpoint(dir + "/y.safetensors", {{"w", "BF16", {16, 64}, m, true, ""}});
  // Same file name twice.
  absl::StatusOr<CheckpointPackReport> r =
      PackCheckpoint({dir + "/a/x.safetensors", dir + "/b/x.safetensors"}, dir + "/o1");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("both be written"), std::string::npos) << r.status();
  // Same tensor in two files.
  r = PackCheckpoint({dir + "/a/x.safetensors", dir + "/y.safetensors"}, dir + "/o2");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("tensor 'w' is in both"), std::string::npos) << r.status();
  // A tensor named like a packed part of another.
  WriteCheckpoint(dir + "/z.safetensors", {{"w", "BF16", {16, 64}, m, true, ""},
                                           {"w.z12.weights", "U8", {4}, "abcd", false, ""}});
  r = PackCheckpoint({dir + "/z.safetensors"}, dir + "/o3");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("'w.z12.weights'"), std::string::npos) << r.status();
  // ... or of a packed tensor in another input: the outputs would hold that name twice.
  WriteCheckpoint(dir + "/p.safetensors", {{"w.z12.weights", "U8", {4}, "abcd", false, ""}});
  // Found before any work: no tensor of y is packed first.
  int progress_calls = 0;
  CheckpointPackOptions counted;
  counted.progress = [&](const PackProgress&) { ++progress_calls; };
  r = PackCheckpoint({dir + "/y.safetensors", dir + "/p.safetensors"}, dir + "/o8", counted);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(progress_calls, 0) << "the collision was found after packing had begun";
  EXPECT_NE(r.status().message().find("'w.z12.weights'"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find(dir + "/y.safetensors"), std::string::npos) << r.status();
  r = PackCheckpoint({dir + "/p.safetensors", dir + "/y.safetensors"}, dir + "/o9");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("'w.z12.weights'"), std::string::npos) << r.status();
  // With keep_nonfinite a packable tensor holding a NaN is kept under its own name: a tensor
  // named like another's packed part is refused before any work, not by the writer halfway
  // (without the option it is packed, its own name never written, and the pair packs).
  const std::string part = internal::PackedPartName("k", 0);
  std::string nan = m;
  nan[0] = '\xc0';
  nan[1] = '\x7f';  // BF16 0x7FC0
  WriteCheckpoint(dir + "/k.safetensors",
                  {{"k", "BF16", {16, 64}, m, true, ""}, {part, "BF16", {16, 64}, nan, true, ""}});
  CheckpointPackOptions keep = counted;
  keep.keep_nonfinite = true;
  progress_calls = 0;
  r = PackCheckpoint({dir + "/k.safetensors"}, dir + "/o10", keep);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(progress_calls, 0) << "the collision was found after packing had begun: " << r.status();
  EXPECT_NE(r.status().message().find("'" + part + "' would be used twice"), std::string::npos)
      << r.status();
  EXPECT_NE(r.status().message().find("keep_nonfinite"), std::string::npos) << r.status();
  std::string finite = m;
  finite[0] = '\x00';
  WriteCheckpoint(dir + "/k2.safetensors", {{"k", "BF16", {16, 64}, m, true, ""},
                                            {part, "BF16", {16, 64}, finite, true, ""}});
  r = PackCheckpoint({dir + "/k2.safetensors"}, dir + "/o11");
  EXPECT_TRUE(r.ok()) << r.status();
  // Names and keys from a file are quoted escaped: a terminal escape would act on the screen.
  const std::string esc = "q\x1b[2J";
  WriteCheckpoint(dir + "/e.safetensors", {{esc, "BF16", {16, 64}, m, true, ""},
                                           {esc + ".z12.weights", "U8", {4}, "abcd", false, ""}});
  r = PackCheckpoint({dir + "/e.safetensors"}, dir + "/o12");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("'q\\x1b[2J.z12.weights'"), std::string::npos) << r.status();
  EXPECT_EQ(r.status().message().find('\x1b'), std::string::npos) << r.status();
  WriteCheckpoint(dir + "/e2.safetensors", {{"w", "BF16", {16, 64}, m, true, ""}},
                  {{"gemvz." + esc, "{}"}});
  r = PackCheckpoint({dir + "/e2.safetensors"}, dir + "/o13");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("'gemvz.q\\x1b[2J' is reserved"), std::string::npos)
      << r.status();
  EXPECT_EQ(r.status().message().find('\x1b'), std::string::npos) << r.status();
  // An already packed checkpoint.
  ASSERT_TRUE(PackCheckpoint({dir + "/y.safetensors"}, dir + "/o4").ok());
  r = PackCheckpoint({dir + "/o4/y.safetensors"}, dir + "/o5");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("already a gemvz packed checkpoint"), std::string::npos);
  // Reserved metadata keys; an output directory that would overwrite the input.
  WriteCheckpoint(dir + "/r.safetensors", {{"w", "BF16", {16, 64}, m, true, ""}},
                  {{"gemvz.z12.w", "{}"}});
  r = PackCheckpoint({dir + "/r.safetensors"}, dir + "/o7");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("reserved"), std::string::npos) << r.status();
  const std::string y_before = ReadAll(dir + "/y.safetensors");
  r = PackCheckpoint({dir + "/y.safetensors"}, dir);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("is the input itself"), std::string::npos) << r.status();
  EXPECT_EQ(ReadAll(dir + "/y.safetensors"), y_before);
  // No inputs, a missing input, an output that is a file.
  EXPECT_FALSE(PackCheckpoint({}, dir + "/o6").ok());
  r = PackCheckpoint({dir + "/missing.safetensors"}, dir + "/o6");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("missing.safetensors"), std::string::npos);
  EXPECT_FALSE(PackCheckpoint({dir + "/y.safetensors"}, dir + "/y.safetensors").ok());
  for (const char* o :
       {"/o1", "/o2", "/o3", "/o5", "/o6", "/o7", "/o8", "/o9", "/o10", "/o12", "/o13"}) {
    EXPECT_TRUE(ListDir(dir + o).empty()) << o;
  }
}

// Two inputs in `dir`, a.safetensors and b.safetensors, each one packable 16 x 64 BF16 matrix
// ("wa", "wb") drawn from `seed`: their paths.
std::vector<std::string> WriteTwoInputs(const std::string& dir, uint64_t seed) {
  const std::string m = Bf16Bytes(RandomMatrix(16, 64, Distribution::kNormal, seed));
  WriteCheckpoint(dir + "/a.safetensors", {{"wa", "BF16", {16, 64}, m, true, ""}});
  WriteCheckpoint(dir + "/b.safetensors", {{"wb", "BF16", {16, 64}, m, true, ""}});
  return {dir + "/a.safetensors", dir + "/b.safetensors"};
}

// A failure while publishing several outputs leaves the output directory as it was: outputs
// published before the failing one are taken back, and the files they replaced restored.
TEST(CheckpointTest, PublishingIsAllOrNothing) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(seed);
  const std::string dir = MakeTempDir("checkpoint_test");
  const std::vector<std::string> inputs = WriteTwoInputs(dir, seed);
  const std::string out = dir + "/out";
  ASSERT_EQ(::mkdir(out.c_str(), 0755), 0);
  // An earlier pack's a.safetensors (a stand-in): a failed pack must not lose it.
  WriteAll(out + "/a.safetensors", "the previous a");

  // `sabotage` runs once, when every tensor is written but nothing is published yet.
  auto pack_with = [&](const std::function<void()>& sabotage) {
    CheckpointPackOptions options;
    bool done = false;
    options.progress = [&](const PackProgress& p) {
      if (!done && p.tensors_done == p.tensors_total && p.current.empty()) {
        done = true;
        sabotage();
      }
    };
    return PackCheckpoint(inputs, out, options);
  };

  // A directory appears where b goes after the up-front checks: found before any rename.
  absl::StatusOr<CheckpointPackReport> r =
      pack_with([&] { ASSERT_EQ(::mkdir((out + "/b.safetensors").c_str(), 0755), 0); });
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(out + "/b.safetensors"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("directory"), std::string::npos) << r.status();
  EXPECT_EQ(ListDir(out), (std::vector<std::string>{"a.safetensors", "b.safetensors"}));
  EXPECT_TRUE(ReadAll(out + "/a.safetensors") == "the previous a") << "the previous a is lost";
  ASSERT_EQ(::rmdir((out + "/b.safetensors").c_str()), 0);

  // b's rename fails after a's has replaced the previous a: a is restored.
  r = pack_with([&] {
    for (const std::string& n : ListDir(out)) {
      if (n.rfind("b.safetensors.tmp.", 0) == 0) ::unlink((out + "/" + n).c_str());
    }
  });
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("cannot rename"), std::string::npos) << r.status();
  EXPECT_EQ(r.status().message().find("rolling back failed"), std::string::npos) << r.status();
  EXPECT_EQ(ListDir(out), (std::vector<std::string>{"a.safetensors"}));
  EXPECT_TRUE(ReadAll(out + "/a.safetensors") == "the previous a") << "the previous a is lost";

  // A directory in the way from the start fails before any work.
  const std::string out2 = dir + "/out2";
  ASSERT_EQ(::mkdir(out2.c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((out2 + "/b.safetensors").c_str(), 0755), 0);
  CheckpointPackOptions options;
  int progress_calls = 0;
  options.progress = [&](const PackProgress&) { ++progress_calls; };
  r = PackCheckpoint(inputs, out2, options);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("is a directory"), std::string::npos) << r.status();
  EXPECT_EQ(progress_calls, 0);
  EXPECT_EQ(ListDir(out2), (std::vector<std::string>{"b.safetensors"}));

  // With nothing in the way both are published with their index, the previous a replaced,
  // nothing else left.
  r = PackCheckpoint(inputs, out);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(ListDir(out), (std::vector<std::string>{"a.safetensors", "b.safetensors",
                                                    "model.safetensors.index.json"}));
  EXPECT_TRUE(PackedCheckpoint::Open(out).ok());
}

// The index `dir` holds under `name`, parsed; every field of it checked against `weight_map` and
// the outputs `files` (their tensor bytes are total_size), and its bytes those of a deterministic
// dump: keys sorted, two-space indentation, a final newline.
void ExpectIndex(const std::string& dir, const std::string& name,
                 const std::map<std::string, std::string>& weight_map) {
  const std::string text = ReadAll(dir + "/" + name);
  ASSERT_FALSE(text.empty()) << "no index '" << name << "' in " << dir;
  const nlohmann::json index = nlohmann::json::parse(text, nullptr, false);
  ASSERT_TRUE(index.is_object()) << text;
  EXPECT_EQ(text, index.dump(2) + "\n");
  EXPECT_EQ(index.value("weight_map", nlohmann::json()), nlohmann::json(weight_map)) << text;
  uint64_t data_bytes = 0;
  std::set<std::string> files;
  for (const auto& [tensor, file] : weight_map) files.insert(file);
  for (const std::string& file : files) {
    auto f = SafetensorsFile::Open(dir + "/" + file);
    ASSERT_TRUE(f.ok()) << f.status();
    data_bytes += (*f)->file_size() - (*f)->data_offset();
  }
  const nlohmann::json meta = index.value("metadata", nlohmann::json());
  EXPECT_EQ(meta.value("total_size", uint64_t{0}), data_bytes) << text;
  EXPECT_EQ(meta.value("gemvz.format", ""), "gemvz-z12-checkpoint") << text;
  EXPECT_EQ(meta.value("gemvz.version", ""), std::to_string(kCheckpointFormatVersion)) << text;
  EXPECT_EQ(index.size(), 2u) << text;
}

// Two or more outputs get Hugging Face's index beside them, named after the inputs'
// "<prefix>-NNNNN-of-NNNNN.safetensors" (else "model"), mapping every logical tensor (a packed one
// under its own name) to its output: the directory then opens, and is refused, naming the file,
// once an output is gone. One output gets none.
TEST(CheckpointTest, SeveralOutputsGetAnIndexThatOpenChecks) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(seed);
  const std::string dir = MakeTempDir("checkpoint_test");
  const std::string m = Bf16Bytes(RandomMatrix(16, 64, Distribution::kNormal, seed));
  const std::vector<float> norm(8, 1.f);
  auto write_pair = [&](const std::string& first, const std::string& second) {
    WriteCheckpoint(dir + "/" + first, {{"wa", "BF16", {16, 64}, m, true, ""},
                                        {"norm", "F32", {8}, PodBytes(norm), false, "F32"}});
    WriteCheckpoint(dir + "/" + second, {{"wb", "BF16", {16, 64}, m, true, ""}});
    return std::vector<std::string>{dir + "/" + first, dir + "/" + second};
  };
  const struct {
    std::string first, second, index;
  } cases[] = {
      {"llama-00001-of-00002.safetensors", "llama-00002-of-00002.safetensors",
       "llama.safetensors.index.json"},
      {"a.safetensors", "b.safetensors", "model.safetensors.index.json"},
      // Two prefixes, or four digits, are not Hugging Face's shards of one checkpoint.
      {"x-00001-of-00002.safetensors", "y-00002-of-00002.safetensors",
       "model.safetensors.index.json"},
      {"m-0001-of-0002.safetensors", "m-0002-of-0002.safetensors", "model.safetensors.index.json"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.index + " for " + c.first);
    const std::string out = MakeTempDir("checkpoint_test");
    for (const bool verify : {false, true}) {
      CheckpointPackOptions options;
      options.verify = verify;
      absl::StatusOr<CheckpointPackReport> r =
          PackCheckpoint(write_pair(c.first, c.second), out, options);
      ASSERT_TRUE(r.ok()) << r.status();
      std::vector<std::string> listed = {c.first, c.second, c.index};
      std::sort(listed.begin(), listed.end());
      EXPECT_EQ(ListDir(out), listed);
      EXPECT_EQ(r->outputs, (std::vector<std::string>{out + "/" + c.first, out + "/" + c.second,
                                                      out + "/" + c.index}));
      int64_t file_bytes = 0;
      for (const std::string& f : r->outputs) file_bytes += static_cast<int64_t>(ReadAll(f).size());
      EXPECT_EQ(r->output_bytes, file_bytes);
      ExpectIndex(out, c.index, {{"norm", c.first}, {"wa", c.first}, {"wb", c.second}});
    }
    absl::StatusOr<PackedCheckpoint> opened = PackedCheckpoint::Open(out);
    ASSERT_TRUE(opened.ok()) << opened.status();
    EXPECT_EQ(opened->tensors().size(), 3u);
    ASSERT_EQ(::unlink((out + "/" + c.second).c_str()), 0);
    absl::Status st = PackedCheckpoint::Open(out).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_NE(st.message().find("its index '" + c.index +
                                "' names 1 file that the directory "
                                "lacks: '" +
                                c.second + "'"),
              std::string::npos)
        << st;
  }

  // One output: no index, as Hugging Face writes none for one file.
  const std::string one = MakeTempDir("checkpoint_test");
  absl::StatusOr<CheckpointPackReport> r = PackCheckpoint(
      {write_pair("model-00001-of-00001.safetensors", "unused.safetensors")[0]}, one);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(ListDir(one), (std::vector<std::string>{"model-00001-of-00001.safetensors"}));
  EXPECT_EQ(r->outputs, (std::vector<std::string>{one + "/model-00001-of-00001.safetensors"}));

  // The same inputs give the same index, byte for byte.
  const std::vector<std::string> inputs = write_pair("a.safetensors", "b.safetensors");
  const std::string again1 = MakeTempDir("checkpoint_test"),
                    again2 = MakeTempDir("checkpoint_test");
  ASSERT_TRUE(PackCheckpoint(inputs, again1).ok());
  ASSERT_TRUE(PackCheckpoint(inputs, again2).ok());
  EXPECT_EQ(ReadAll(again1 + "/model.safetensors.index.json"),
            ReadAll(again2 + "/model.safetensors.index.json"));
}

// The index is one more file of the all-or-none publish: a failure leaves no index and no
// temporary file, and puts back an index it would have replaced; a directory in its way fails
// before any work, or, appearing later, before any rename; a successful pack replaces an older
// index by a rename (a link to the old one keeps the old bytes). With --verify, an index that
// does not read back as written fails the pack.
TEST(CheckpointTest, TheIndexIsPublishedWithTheOutputsAllOrNothing) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(seed);
  const std::string dir = MakeTempDir("checkpoint_test");
  const std::vector<std::string> inputs = WriteTwoInputs(dir, seed);
  const std::string index = "model.safetensors.index.json";

  // `sabotage` runs once, when every tensor is written but nothing is published yet; `late`
  // runs on every progress call after that.
  auto pack_with = [&](const std::string& out, const std::function<void()>& sabotage,
                       const std::function<void()>& late = nullptr, bool verify = false) {
    CheckpointPackOptions options;
    options.verify = verify;
    bool done = false;
    options.progress = [&](const PackProgress& p) {
      if (done && late) late();
      if (!done && p.tensors_done == p.tensors_total && p.current.empty()) {
        done = true;
        sabotage();
      }
    };
    return PackCheckpoint(inputs, out, options);
  };

  // A directory where the index goes, from the start: refused before any work.
  const std::string fresh = dir + "/fresh";
  ASSERT_EQ(::mkdir(fresh.c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((fresh + "/" + index).c_str(), 0755), 0);
  int progress_calls = 0;
  CheckpointPackOptions counting;
  counting.progress = [&](const PackProgress&) { ++progress_calls; };
  absl::StatusOr<CheckpointPackReport> r = PackCheckpoint(inputs, fresh, counting);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("output '" + fresh + "/" + index + "' is a directory"),
            std::string::npos)
      << r.status();
  EXPECT_EQ(progress_calls, 0);
  ASSERT_EQ(::rmdir((fresh + "/" + index).c_str()), 0);

  // ... or appearing after the checks: the publish refuses it before any rename.
  r = pack_with(fresh, [&] { ASSERT_EQ(::mkdir((fresh + "/" + index).c_str(), 0755), 0); });
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(fresh + "/" + index), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("directory"), std::string::npos) << r.status();
  EXPECT_EQ(ListDir(fresh), (std::vector<std::string>{index}));
  ASSERT_EQ(::rmdir((fresh + "/" + index).c_str()), 0);

  // b's rename fails, after the index's and a's: in a fresh directory neither stays.
  auto remove_b_temp = [](const std::string& out) {
    return [out] {
      for (const std::string& n : ListDir(out)) {
        if (n.rfind("b.safetensors.tmp.", 0) == 0) ::unlink((out + "/" + n).c_str());
      }
    };
  };
  r = pack_with(fresh, remove_b_temp(fresh));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("cannot rename"), std::string::npos) << r.status();
  EXPECT_TRUE(ListDir(fresh).empty()) << ListDir(fresh).size() << " entries left";

  // Over an earlier pack's files: the previous index and a are put back.
  const std::string out = dir + "/out";
  ASSERT_EQ(::mkdir(out.c_str(), 0755), 0);
  WriteAll(out + "/a.safetensors", "the previous a");
  WriteAll(out + "/" + index, "the previous index");
  ASSERT_EQ(::link((out + "/" + index).c_str(), (dir + "/old_index").c_str()), 0);
  r = pack_with(out, remove_b_temp(out));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message().find("rolling back failed"), std::string::npos) << r.status();
  EXPECT_EQ(ListDir(out), (std::vector<std::string>{"a.safetensors", index}));
  EXPECT_TRUE(ReadAll(out + "/a.safetensors") == "the previous a") << "the previous a is lost";
  EXPECT_TRUE(ReadAll(out + "/" + index) == "the previous index") << "the previous index is lost";

  // --verify reads the index back: one changed on disk after it was written (the temporary
  // file rewritten at the verify's last progress call) fails the pack, naming the tensor.
  bool rewrote = false;
  r = pack_with(
      out, [] {},
      [&] {
        for (const std::string& n : ListDir(out)) {
          if (!rewrote && n.rfind(index + ".tmp.", 0) == 0) {
            WriteAll(out + "/" + n,
                     R"({"weight_map": {"wa": "b.safetensors", "wb": "b.safetensors"}})");
            rewrote = true;
          }
        }
      },
      /*verify=*/true);
  ASSERT_TRUE(rewrote) << "no progress call came once the index was written";
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find("verify of the index '" + index + "' (written to '" + out +
                                      "/" + index + ".tmp."),
            std::string::npos)
      << r.status();
  EXPECT_NE(r.status().message().find(
                "tensor 'wa' is in 'a.safetensors', the index gives 'b.safetensors'"),
            std::string::npos)
      << r.status();
  EXPECT_EQ(ListDir(out), (std::vector<std::string>{"a.safetensors", index}));
  EXPECT_TRUE(ReadAll(out + "/" + index) == "the previous index") << "the previous index is lost";

  // Nothing in the way: the index replaces the previous one by a rename, nothing else left.
  r = PackCheckpoint(inputs, out);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(ListDir(out), (std::vector<std::string>{"a.safetensors", "b.safetensors", index}));
  ExpectIndex(out, index, {{"wa", "a.safetensors"}, {"wb", "b.safetensors"}});
  EXPECT_EQ(ReadAll(dir + "/old_index"), "the previous index") << "written through, not renamed";
  EXPECT_TRUE(PackedCheckpoint::Open(out).ok());
}

// An output name taken by a device, FIFO or socket, or a link to one, is refused before any work,
// as a directory is: the publish would replace it with a regular file.
TEST(CheckpointTest, AnOutputNameTakenByASpecialFileFailsBeforeAnyWork) {
  const std::string dir = MakeTempDir("checkpoint_test");
  const std::string m = Bf16Bytes(RandomMatrix(16, 64, Distribution::kNormal, FreshSeed()));
  WriteCheckpoint(dir + "/a.safetensors", {{"wa", "BF16", {16, 64}, m, true, ""}});
  const std::string out = dir + "/out";
  ASSERT_EQ(::mkdir(out.c_str(), 0755), 0);
  ASSERT_EQ(::mkfifo((dir + "/fifo").c_str(), 0644), 0);
  for (const bool link : {false, true}) {
    const std::string to = out + "/a.safetensors";
    if (link) {
      ASSERT_EQ(::symlink((dir + "/fifo").c_str(), to.c_str()), 0);
    } else {
      ASSERT_EQ(::mkfifo(to.c_str(), 0644), 0);
    }
    CheckpointPackOptions options;
    int progress_calls = 0;
    options.progress = [&](const PackProgress&) { ++progress_calls; };
    absl::StatusOr<CheckpointPackReport> r = PackCheckpoint({dir + "/a.safetensors"}, out, options);
    ASSERT_FALSE(r.ok()) << (link ? "a link to a FIFO" : "a FIFO") << " was replaced";
    EXPECT_NE(r.status().message().find("'" + to + "' is not a regular file"), std::string::npos)
        << r.status();
    EXPECT_EQ(progress_calls, 0);
    EXPECT_EQ(ListDir(out), (std::vector<std::string>{"a.safetensors"}));
    struct stat info;
    ASSERT_EQ(::lstat(to.c_str(), &info), 0);
    EXPECT_TRUE(link ? S_ISLNK(info.st_mode) : S_ISFIFO(info.st_mode));
    ASSERT_EQ(::unlink(to.c_str()), 0);
  }
}

// Verify compares every unpacked weight with the input, and a difference fails the pack before
// anything is published. The output is hard to get wrong on purpose (its parts carry checksums,
// which fail before any comparison), so the input changes instead: its last weight, rewritten in
// place once the tensor is packed, when its verify begins. The packer maps the input, so it reads
// the new value; a verify that compared only part of each slice (the last weight is in the second
// half of the last) would let it through.
TEST(CheckpointTest, VerifyFindsAWeightThatDiffersFromTheInput) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(seed);
  const std::string dir = MakeTempDir("checkpoint_test");
  const int64_t rows = 64, cols = 256;
  const auto w = RandomMatrix(rows, cols, Distribution::kNormal, seed);
  const std::string in = dir + "/m.safetensors";
  WriteCheckpoint(in, {{"w", "BF16", {rows, cols}, Bf16Bytes(w), true, ""}});
  uint64_t last_at = 0;  // the last weight's offset in the file
  {
    auto f = SafetensorsFile::Open(in);
    ASSERT_TRUE(f.ok()) << f.status();
    ASSERT_NE((*f)->Find("w"), nullptr);
    last_at = (*f)->data_offset() + (*f)->Find("w")->end - 2;
  }
  const uint16_t changed = w.back() ^ 0x0001;  // another finite value
  CheckpointPackOptions options;
  options.verify = true;
  bool rewritten = false;
  options.progress = [&](const PackProgress& p) {
    if (rewritten || p.stage != "verify" || p.current != "w") return;
    rewritten = true;
    const int fd = ::open(in.c_str(), O_WRONLY | O_CLOEXEC);  // in place: the same file
    ASSERT_GE(fd, 0) << in;
    EXPECT_EQ(::pwrite(fd, &changed, 2, static_cast<off_t>(last_at)), 2);
    ::close(fd);
  };
  absl::StatusOr<CheckpointPackReport> r = PackCheckpoint({in}, dir + "/out", options);
  ASSERT_TRUE(rewritten) << "verify never began";
  ASSERT_FALSE(r.ok()) << "verify missed a weight that differs from the input";
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  const std::string expected = absl::StrFormat(
      "tensor 'w' (row %d, col %d) unpacks to BF16 0x%04x, the input holds 0x%04x", rows - 1,
      cols - 1, w.back(), changed);
  EXPECT_NE(r.status().message().find(expected), std::string::npos) << r.status();
  // Nothing published, no temporary file, the directory it made taken back.
  EXPECT_EQ(ListDir(dir), (std::vector<std::string>{"m.safetensors"}));
}

// Opening a checkpoint checks each file's format version (kCheckpointFormatVersion and older
// read; 0, a non-number or the next version do not, naming the file), refuses a tensor two files
// of a directory both hold, and looks a name up exactly: Info of a name between two stored ones,
// or before them all, is NotFound, never its neighbour.
TEST(CheckpointTest, OpeningChecksVersionsDuplicatesAndExactNames) {
  const std::string dir = MakeTempDir("checkpoint_test");
  const std::string m = Bf16Bytes(RandomMatrix(16, 64, Distribution::kNormal, FreshSeed()));
  const std::string path = dir + "/v.safetensors";
  const std::string current = std::to_string(kCheckpointFormatVersion);
  const std::string next = std::to_string(kCheckpointFormatVersion + 1);
  for (const std::string& version : {std::string("1"), current, std::string("0"), std::string("-1"),
                                     std::string("x"), std::string("\x1b[2J"), next}) {
    SCOPED_TRACE("gemvz.version = " + absl::CHexEscape(version));
    ::unlink(path.c_str());
    WriteCheckpoint(path, {{"w", "BF16", {16, 64}, m, false, ""}},
                    {{"format", "pt"}, {internal::kMetaVersionKey, version}});
    absl::StatusOr<PackedCheckpoint> c = PackedCheckpoint::Open(path);
    if (version == "1" || version == current) {
      EXPECT_TRUE(c.ok()) << c.status();
      continue;
    }
    ASSERT_FALSE(c.ok()) << "version " << version << " accepted";
    EXPECT_NE(c.status().message().find(path), std::string::npos) << c.status();
    if (version == next) {
      EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition) << c.status();
      EXPECT_NE(c.status().message().find("newer"), std::string::npos) << c.status();
    } else {
      EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
      EXPECT_NE(c.status().message().find("is not a version number"), std::string::npos)
          << c.status();
      EXPECT_EQ(c.status().message().find('\x1b'), std::string::npos) << "quoted raw";
    }
  }

  ASSERT_EQ(::mkdir((dir + "/dup").c_str(), 0755), 0);
  WriteCheckpoint(dir + "/dup/a.safetensors", {{"w", "BF16", {16, 64}, m, false, ""}});
  WriteCheckpoint(dir + "/dup/b.safetensors", {{"w", "BF16", {16, 64}, m, false, ""}});
  absl::StatusOr<PackedCheckpoint> dup = PackedCheckpoint::Open(dir + "/dup");
  ASSERT_FALSE(dup.ok()) << "a tensor in two files accepted";
  EXPECT_NE(dup.status().message().find("tensor 'w' appears twice"), std::string::npos)
      << dup.status();
  EXPECT_NE(dup.status().message().find(dir + "/dup/a.safetensors"), std::string::npos)
      << dup.status();

  WriteCheckpoint(dir + "/names.safetensors", {{"b.weight", "BF16", {16, 64}, m, false, ""},
                                               {"d.weight", "BF16", {8, 128}, m, false, ""}});
  absl::StatusOr<PackedCheckpoint> c = PackedCheckpoint::Open(dir + "/names.safetensors");
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<TensorInfo> d = c->Info("d.weight");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->name, "d.weight");
  EXPECT_EQ(d->shape, (std::vector<int64_t>{8, 128}));
  for (const char* missing : {"a.weight", "c.weight", "b.weigh", "e.weight"}) {
    absl::StatusOr<TensorInfo> info = c->Info(missing);
    EXPECT_EQ(info.status().code(), absl::StatusCode::kNotFound)
        << missing << " found as " << (info.ok() ? info->name : "");
  }
}

// A *.safetensors entry of a checkpoint directory that is not a file (a directory, a FIFO, a
// socket, a link whose target is gone, as an unfinished download leaves in a cache of links) is
// refused, named with what it is, before anything is opened: skipped, the checkpoint would open
// without that shard's tensors. A FIFO is not waited on. A link to a file is read as the file; so
// is a link to a packed checkpoint's file. The packer names such an input the same way.
TEST(CheckpointTest, AnEntryThatIsNoFileIsRefusedNamedAndALinkToAFileRead) {
  const std::string dir = MakeTempDir("checkpoint_test");
  const std::string m = Bf16Bytes(RandomMatrix(16, 64, Distribution::kNormal, FreshSeed()));
  WriteCheckpoint(dir + "/blob", {{"w", "BF16", {16, 64}, m, false, ""}});
  const struct {
    const char* kind;
    std::function<int(const std::string&)> make;
  } cases[] = {
      {"a directory", [](const std::string& p) { return ::mkdir(p.c_str(), 0755); }},
      {"a FIFO", [](const std::string& p) { return ::mkfifo(p.c_str(), 0644); }},
      {"a symbolic link to 'gone', which does not exist",
       [](const std::string& p) { return ::symlink("gone", p.c_str()); }},
      {"a symbolic link to 'ab\\x1b[2J', which does not exist",
       [](const std::string& p) { return ::symlink("ab\x1b[2J", p.c_str()); }},
  };
  int n = 0;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.kind);
    const std::string ckpt = dir + "/c" + std::to_string(n++);
    ASSERT_EQ(::mkdir(ckpt.c_str(), 0755), 0);
    ASSERT_EQ(::symlink((dir + "/blob").c_str(), (ckpt + "/a.safetensors").c_str()), 0);
    const std::string bad = ckpt + "/model-2.safetensors";
    ASSERT_EQ(c.make(bad), 0) << std::strerror(errno);
    absl::Status st;
    ASSERT_TRUE(::gemvz::testing::ReturnsWithoutAWriter(bad, [&] {
      st = PackedCheckpoint::Open(ckpt).status();
    })) << "waited for a writer";
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_NE(st.message().find("checkpoint directory '" + ckpt +
                                "': its entry 'model-2.safetensors' is " + c.kind + ":"),
              std::string::npos)
        << st;
    EXPECT_EQ(st.message().find('\x1b'), std::string::npos) << "a link's target quoted raw";
    // Given as an input to pack, the same entry is named the same way.
    absl::StatusOr<CheckpointPackReport> r = PackCheckpoint({bad}, dir + "/out");
    ASSERT_FALSE(r.ok());
    EXPECT_NE(
        r.status().message().find("safetensors file '" + bad + "': not a regular file: " + c.kind),
        std::string::npos)
        << r.status();
    EXPECT_FALSE(Exists(dir + "/out"));
    ASSERT_EQ(::remove(bad.c_str()), 0);
    // Without it, the link to a file reads as the file.
    absl::StatusOr<PackedCheckpoint> ok = PackedCheckpoint::Open(ckpt);
    ASSERT_TRUE(ok.ok()) << ok.status();
    absl::StatusOr<std::vector<uint16_t>> w = ok->GetBf16("w");
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ(Bf16Bytes(*w), m);
  }
  // A link to a packed file, as a cache of links holds one, opens packed.
  absl::StatusOr<CheckpointPackReport> r = PackCheckpoint({dir + "/c0/a.safetensors"}, dir + "/p");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(::mkdir((dir + "/links").c_str(), 0755), 0);
  ASSERT_EQ(::symlink((dir + "/p/a.safetensors").c_str(), (dir + "/links/x.safetensors").c_str()),
            0);
  absl::StatusOr<PackedCheckpoint> p = PackedCheckpoint::Open(dir + "/links");
  ASSERT_TRUE(p.ok()) << p.status();
  absl::StatusOr<TensorInfo> info = p->Info("w");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->packed);
  absl::StatusOr<std::vector<uint16_t>> w = p->GetBf16("w");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(Bf16Bytes(*w), m);
}

// A directory listing that fails part way (EIO from a network or FUSE file system) is an error
// naming the directory, not the end of the listing: the checkpoint would open without the
// shards not yet listed, and their tensors would be "not in the checkpoint".
TEST(CheckpointTest, AListingThatFailsPartWayIsAnErrorNotTheEnd) {
  const std::string dir = MakeTempDir("checkpoint_test");
  const std::string m = Bf16Bytes(RandomMatrix(16, 64, Distribution::kNormal, FreshSeed()));
  WriteCheckpoint(dir + "/a.safetensors", {{"a", "BF16", {16, 64}, m, false, ""}});
  WriteCheckpoint(dir + "/b.safetensors", {{"b", "BF16", {16, 64}, m, false, ""}});
  absl::StatusOr<PackedCheckpoint> whole = PackedCheckpoint::Open(dir);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->tensors().size(), 2u);
  // ".", ".." and the two files: failing after each of the first three entries.
  for (int read = 0; read < 4; ++read) {
    SCOPED_TRACE(absl::StrCat("fails after ", read, " entries"));
    g_readdir_error = EIO;
    g_readdir_entries_left = read;
    absl::StatusOr<PackedCheckpoint> c = PackedCheckpoint::Open(dir);
    g_readdir_entries_left = -1;
    ASSERT_FALSE(c.ok()) << "opened with " << c->tensors().size() << " of 2 tensors";
    EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable) << c.status();
    EXPECT_NE(c.status().message().find("cannot list checkpoint directory '" + dir +
                                        "': " + std::strerror(EIO)),
              std::string::npos)
        << c.status();
  }
  // The end of a listing leaves errno as it was: an error left there before is not the listing's.
  errno = EIO;
  absl::StatusOr<PackedCheckpoint> c = PackedCheckpoint::Open(dir);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->tensors().size(), 2u);
}

// A Hugging Face index of a sharded checkpoint: {"metadata": {...}, "weight_map": {tensor: file}}.
std::string IndexJson(const std::map<std::string, std::string>& weight_map) {
  const nlohmann::json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}};
  return index.dump(2);
}

// A directory of `shards` files "model-0000<i>-of-0000<n>.safetensors", shard i holding the
// 16 x 64 BF16 matrix "w<i>", and its index "model.safetensors.index.json" naming them all.
std::map<std::string, std::string> WriteIndexedCheckpoint(const std::string& dir, int shards,
                                                          const std::string& m) {
  EXPECT_EQ(::mkdir(dir.c_str(), 0755), 0) << dir;
  std::map<std::string, std::string> weight_map;
  for (int i = 1; i <= shards; ++i) {
    const std::string shard = absl::StrFormat("model-%05d-of-%05d.safetensors", i, shards);
    WriteCheckpoint(dir + "/" + shard, {{absl::StrCat("w", i), "BF16", {16, 64}, m, true, ""}});
    weight_map[absl::StrCat("w", i)] = shard;
  }
  WriteAll(dir + "/model.safetensors.index.json", IndexJson(weight_map));
  return weight_map;
}

// A directory with a *.safetensors.index.json opens when it holds every file its weight_map
// names: plain, or packed (an index copied beside `gemvz pack`'s output names logical tensors),
// with tensors the index does not name accepted. One file missing (an unfinished download) is
// refused before anything is opened, naming the directory, the index and the first few missing
// files with their count; without the index the same directory opens as it always did, and a
// single file given to Open reads no index.
TEST(CheckpointTest, AnIndexedDirectoryOpensWholeAndIsRefusedWithoutAShard) {
  const std::string dir = MakeTempDir("checkpoint_test");
  const std::string m = Bf16Bytes(RandomMatrix(16, 64, Distribution::kNormal, FreshSeed()));
  const std::string ckpt = dir + "/ckpt";
  const std::map<std::string, std::string> weight_map = WriteIndexedCheckpoint(ckpt, 2, m);
  WriteCheckpoint(ckpt + "/extra.safetensors", {{"unindexed", "BF16", {64}, m.substr(0, 128)}});
  absl::StatusOr<PackedCheckpoint> whole = PackedCheckpoint::Open(ckpt);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->tensors().size(), 3u);

  std::vector<std::string> inputs;
  for (const auto& [tensor, shard] : weight_map) inputs.push_back(ckpt + "/" + shard);
  absl::StatusOr<CheckpointPackReport> r = PackCheckpoint(inputs, dir + "/packed");
  ASSERT_TRUE(r.ok()) << r.status();
  WriteAll(dir + "/packed/model.safetensors.index.json", IndexJson(weight_map));
  absl::StatusOr<PackedCheckpoint> packed = PackedCheckpoint::Open(dir + "/packed");
  ASSERT_TRUE(packed.ok()) << packed.status();
  absl::StatusOr<TensorInfo> w2 = packed->Info("w2");
  ASSERT_TRUE(w2.ok()) << w2.status();
  EXPECT_TRUE(w2->packed);

  const std::string gone = ckpt + "/model-00002-of-00002.safetensors";
  ASSERT_EQ(::unlink(gone.c_str()), 0);
  absl::StatusOr<PackedCheckpoint> c = PackedCheckpoint::Open(ckpt);
  ASSERT_FALSE(c.ok()) << "opened with " << c->tensors().size() << " tensors";
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition) << c.status();
  EXPECT_NE(c.status().message().find(
                "checkpoint directory '" + ckpt +
                "': its index 'model.safetensors.index.json' names 1 file that the directory "
                "lacks: 'model-00002-of-00002.safetensors'"),
            std::string::npos)
      << c.status();
  EXPECT_NE(c.status().message().find("nothing was opened"), std::string::npos) << c.status();
  absl::StatusOr<PackedCheckpoint> one =
      PackedCheckpoint::Open(ckpt + "/model-00001-of-00002.safetensors");
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->tensors().size(), 1u);

  // Only the index left (every shard missing): the first three named, and the count of the rest.
  const std::string bare = dir + "/bare";
  ASSERT_EQ(::mkdir(bare.c_str(), 0755), 0);
  std::map<std::string, std::string> many;
  for (int i = 1; i <= 5; ++i) many[absl::StrCat("w", i)] = absl::StrCat("s", i, ".safetensors");
  WriteAll(bare + "/model.safetensors.index.json", IndexJson(many));
  absl::Status st = PackedCheckpoint::Open(bare).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("names 5 files that the directory lacks: 's1.safetensors', "
                              "'s2.safetensors', 's3.safetensors' and 2 more"),
            std::string::npos)
      << st;

  ASSERT_EQ(::unlink((ckpt + "/model.safetensors.index.json").c_str()), 0);
  absl::StatusOr<PackedCheckpoint> unindexed = PackedCheckpoint::Open(ckpt);
  ASSERT_TRUE(unindexed.ok()) << unindexed.status();
  EXPECT_EQ(unindexed->tensors().size(), 2u);
  EXPECT_EQ(unindexed->Info("w2").status().code(), absl::StatusCode::kNotFound);
}

// An index that cannot be read as one (not JSON, a repeated key, no weight_map object, a value
// that is no string, a file name that is no *.safetensors entry of the directory itself, not a
// file, too large) is refused naming the index and what is wrong, before anything is opened.
// Every index of the directory is read: a good one beside does not hide a bad one.
TEST(CheckpointTest, AMalformedIndexIsRefusedNamed) {
  const std::string dir = MakeTempDir("checkpoint_test");
  const std::string m = Bf16Bytes(RandomMatrix(16, 64, Distribution::kNormal, FreshSeed()));
  const std::string ckpt = dir + "/ckpt";
  WriteIndexedCheckpoint(ckpt, 1, m);
  const std::string index = ckpt + "/model.safetensors.index.json";
  ASSERT_EQ(::rename(index.c_str(), (ckpt + "/a.safetensors.index.json").c_str()), 0);
  const std::string shard = "model-00001-of-00001.safetensors";
  const struct {
    const char* what;
    std::string text;
    const char* expected;
  } cases[] = {
      {"not JSON", "{\"weight_map\": {", "is not valid JSON"},
      {"text after the value", "{\"weight_map\": {}} {}", "is not valid JSON"},
      {"a repeated key", "{\"weight_map\": {\"w1\": \"" + shard + "\", \"w1\": \"" + shard + "\"}}",
       "is not valid JSON: an object repeats the key 'w1'"},
      {"an array", "[]", "has no \"weight_map\" object"},
      {"no weight_map", "{\"metadata\": {}}", "has no \"weight_map\" object"},
      {"a weight_map array", "{\"weight_map\": [\"" + shard + "\"]}",
       "has no \"weight_map\" object"},
      {"a number", "{\"weight_map\": {\"w1\": 1}}",
       "maps tensor 'w1' to a value of type number, not a file name"},
      {"null", "{\"weight_map\": {\"w\\u001b\": null}}",
       "maps tensor 'w\\x1b' to a value of type null"},
      {"a path", "{\"weight_map\": {\"w1\": \"../ckpt/" + shard + "\"}}",
       "maps tensor 'w1' to '../ckpt/model-00001-of-00001.safetensors', which is not the name of "
       "a *.safetensors file of the directory"},
      {"a subdirectory", "{\"weight_map\": {\"w1\": \"sub/x.safetensors\"}}",
       "maps tensor 'w1' to 'sub/x.safetensors', which is not the name"},
      {"..", "{\"weight_map\": {\"w1\": \"..\"}}",
       "maps tensor 'w1' to '..', which is not the name"},
      {"another kind of file", "{\"weight_map\": {\"w1\": \"model.bin\"}}",
       "maps tensor 'w1' to 'model.bin', which is not the name"},
      {"a NUL", "{\"weight_map\": {\"w1\": \"a\\u0000.safetensors\"}}",
       "maps tensor 'w1' to 'a\\x00.safetensors', which is not the name"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    WriteAll(index, c.text);
    absl::Status st = PackedCheckpoint::Open(ckpt).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("checkpoint directory '" + ckpt +
                                "': its index 'model.safetensors.index.json' " + c.expected),
              std::string::npos)
        << st;
    EXPECT_NE(st.message().find("nothing was opened"), std::string::npos) << st;
    EXPECT_EQ(st.message().find('\x1b'), std::string::npos) << "a tensor's name quoted raw";
  }
  ASSERT_EQ(::unlink(index.c_str()), 0);
  ASSERT_EQ(::mkdir(index.c_str(), 0755), 0);
  absl::Status st = PackedCheckpoint::Open(ckpt).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("its index 'model.safetensors.index.json' cannot be read: '" + index +
                              "' is not a regular file"),
            std::string::npos)
      << st;
  ASSERT_EQ(::rmdir(index.c_str()), 0);
  // Sparse: above the cap without writing it.
  WriteAll(index, "");
  ASSERT_EQ(::truncate(index.c_str(), static_cast<off_t>(internal::kMaxSafetensorsHeaderBytes + 1)),
            0);
  st = PackedCheckpoint::Open(ckpt).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find(absl::StrCat("more than the ", internal::kMaxSafetensorsHeaderBytes,
                                           " it may hold")),
            std::string::npos)
      << st;
}

// A tensor the index names that is not in the file it gives (in no file, or in another) is
// refused after the files are opened, naming the directory, the index, the tensor and the file.
TEST(CheckpointTest, ATensorTheIndexNamesOutsideItsFileIsRefused) {
  const std::string dir = MakeTempDir("checkpoint_test");
  const std::string m = Bf16Bytes(RandomMatrix(16, 64, Distribution::kNormal, FreshSeed()));
  const std::string ckpt = dir + "/ckpt";
  std::map<std::string, std::string> weight_map = WriteIndexedCheckpoint(ckpt, 2, m);
  const std::string index = ckpt + "/model.safetensors.index.json";
  const std::string prefix = "checkpoint directory '" + ckpt +
                             "': its index 'model.safetensors.index.json' names 1 tensor that "
                             "the file it gives does not hold: ";
  weight_map["lm_head.weight"] = "model-00001-of-00002.safetensors";
  WriteAll(index, IndexJson(weight_map));
  absl::Status st = PackedCheckpoint::Open(ckpt).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(
      st.message().find(prefix + "'lm_head.weight' (not in 'model-00001-of-00002.safetensors')"),
      std::string::npos)
      << st;

  weight_map.erase("lm_head.weight");
  weight_map["w2"] = "model-00001-of-00002.safetensors";
  WriteAll(index, IndexJson(weight_map));
  st = PackedCheckpoint::Open(ckpt).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find(prefix + "'w2' (not in 'model-00001-of-00002.safetensors'; in "
                                       "'model-00002-of-00002.safetensors')"),
            std::string::npos)
      << st;
}

// A checkpoint of more shards than the process may hold open descriptors (ulimit -n, 1024 by
// default, against models of hundreds of shards and a server opening several) packs and opens:
// a mapped file needs no descriptor once it is mapped.
TEST(CheckpointTest, ShardsBeyondTheOpenFileLimitPackAndOpen) {
  const std::string dir = MakeTempDir("checkpoint_test");
  ASSERT_EQ(::mkdir((dir + "/in").c_str(), 0755), 0);
  constexpr int kShards = 48;
  std::vector<std::string> inputs;
  std::vector<std::string> weights;
  for (int i = 0; i < kShards; ++i) {
    weights.push_back(Bf16Bytes(RandomMatrix(16, 64, Distribution::kNormal, FreshSeed())));
    inputs.push_back(absl::StrFormat("%s/in/model-%05d.safetensors", dir, i));
    WriteCheckpoint(
        inputs.back(),
        {{absl::StrCat("w", i), "BF16", {16, 64}, weights.back(), true, ""},
         {absl::StrCat("n", i), "BF16", {64}, weights.back().substr(0, 128), false, ""}});
  }
  // Room for what is open now and a few more, far fewer than the shards.
  int open_now = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d) != nullptr) ++open_now;
    ::closedir(d);
  }
  if (open_now == 0) GTEST_SKIP() << "no /proc/self/fd to count open descriptors";
  struct rlimit old_limit;
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &old_limit), 0);
  struct rlimit low = old_limit;
  low.rlim_cur = static_cast<rlim_t>(open_now + 16);
  if (low.rlim_cur >= old_limit.rlim_cur) GTEST_SKIP() << "the open file limit is already low";
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  struct Restore {
    struct rlimit limit;
    ~Restore() { ::setrlimit(RLIMIT_NOFILE, &limit); }
  } restore{old_limit};

  CheckpointPackOptions options;
  options.threads = 1;
  options.verify = true;
  absl::StatusOr<CheckpointPackReport> report = PackCheckpoint(inputs, dir + "/out", options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->packed_tensors, kShards);
  for (const std::string& source : {dir + "/in", dir + "/out"}) {
    SCOPED_TRACE(source);
    absl::StatusOr<PackedCheckpoint> c = PackedCheckpoint::Open(source);
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_EQ(c->tensors().size(), 2u * kShards);
    for (int i = 0; i < kShards; ++i) {
      absl::StatusOr<std::vector<uint16_t>> w = c->GetBf16(absl::StrCat("w", i));
      ASSERT_TRUE(w.ok()) << w.status();
      EXPECT_EQ(Bf16Bytes(*w), weights[i]) << i;
      absl::StatusOr<TensorView> n = c->GetRaw(absl::StrCat("n", i));
      ASSERT_TRUE(n.ok()) << n.status();
      EXPECT_EQ(std::string(reinterpret_cast<const char*>(n->data), n->size),
                weights[i].substr(0, 128));
    }
  }
}

TEST(CheckpointTest, CorruptPackedFilesAreCaught) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(seed);
  std::mt19937_64 rng(seed);
  const std::string dir = MakeTempDir("checkpoint_test");
  auto w = RandomMatrix(64, 256, Distribution::kTiny, seed);
  std::fill(w.begin(), w.begin() + 256, 0);
  WriteCheckpoint(dir + "/m.safetensors", {{"w", "BF16", {64, 256}, Bf16Bytes(w), true, ""}});
  ASSERT_TRUE(PackCheckpoint({dir + "/m.safetensors"}, dir + "/out").ok());
  const std::string path = dir + "/out/m.safetensors";
  const std::string good = ReadAll(path);
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok());
  const uint64_t data_offset = (*f)->data_offset();
  // A flipped bit inside each part's data: that part's checksum fails, naming file and tensor.
  for (int part = 0; part < internal::kPackedParts; ++part) {
    const SafetensorsEntry* e = (*f)->Find(internal::PackedPartName("w", part));
    ASSERT_NE(e, nullptr);
    if (e->end == e->begin) continue;
    std::string bytes = good;
    bytes[data_offset + e->begin + rng() % (e->end - e->begin)] ^=
        static_cast<char>(1 << (rng() % 8));
    WriteAll(path, bytes);
    absl::StatusOr<PackedCheckpoint> c = PackedCheckpoint::Open(path);
    ASSERT_TRUE(c.ok()) << c.status();  // the header is intact
    absl::StatusOr<PackedMatrix> p = c->GetPacked("w");
    ASSERT_FALSE(p.ok()) << "corrupt part " << e->name << " accepted";
    EXPECT_NE(p.status().message().find("checksum"), std::string::npos) << p.status();
    EXPECT_NE(p.status().message().find(path), std::string::npos) << p.status();
    EXPECT_NE(p.status().message().find("'w'"), std::string::npos) << p.status();
  }
  // A newer version is refused with a clear message.
  {
    std::string bytes = good;
    const size_t at = bytes.find("\"gemvz.version\":\"1\"");
    ASSERT_NE(at, std::string::npos);
    bytes[at + std::strlen("\"gemvz.version\":\"")] = '7';
    WriteAll(path, bytes);
    absl::StatusOr<PackedCheckpoint> c = PackedCheckpoint::Open(path);
    ASSERT_FALSE(c.ok());
    EXPECT_NE(c.status().message().find("newer"), std::string::npos) << c.status();
    EXPECT_NE(c.status().message().find(path), std::string::npos) << c.status();
  }
  // Fuzzed headers (the metadata JSON strings included): clean errors, never a crash; whatever
  // opens either reads back exactly or fails cleanly.
  const size_t header_end = static_cast<size_t>(data_offset);
  int opened = 0;
  for (int iter = 0; iter < 1500; ++iter) {
    std::string bytes = good;
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < edits; ++k) {
      const size_t at = 8 + rng() % (header_end - 8);
      if (rng() % 2) {
        bytes[at] = static_cast<char>(bytes[at] ^ (1 << (rng() % 8)));
      } else {
        bytes[at] = "0123456789{}[],:\"\\ -e."[rng() % 22];
      }
    }
    WriteAll(path, bytes);
    absl::StatusOr<PackedCheckpoint> c = PackedCheckpoint::Open(path);
    if (!c.ok()) {
      EXPECT_NE(c.status().message().find(path), std::string::npos) << c.status();
      continue;
    }
    ++opened;
    for (const TensorInfo& t : c->tensors()) {
      if (!t.packed) continue;
      absl::StatusOr<std::vector<uint16_t>> back = c->GetBf16(t.name);
      if (back.ok()) EXPECT_EQ(*back, w) << "a corrupt header changed the weights silently";
    }
  }
  EXPECT_GT(opened, 0);
}

std::string ToolPath() { return GEMVZ_TOOL_PATH; }

// Runs the CLI; returns its exit status and fills stdout/stderr (files in `dir`). With `cwd`, it
// runs there (an absolute path, so that `dir` and the arguments mean the same there).
int RunTool(const std::string& args, std::string* out, std::string* err, const std::string& dir,
            const std::string& cwd = "") {
  const std::string o = dir + "/stdout.txt", e = dir + "/stderr.txt";
  const std::string in = cwd.empty() ? "" : "cd " + cwd + " && ";
  const int rc = std::system((in + ToolPath() + " " + args + " >" + o + " 2>" + e).c_str());
  *out = ReadAll(o);
  *err = ReadAll(e);
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

// Runs the CLI with its stderr on a new pseudo-terminal (stdout to `dir`/stdout.txt), as a user at
// a terminal has it; returns its exit status and fills `terminal` with all the terminal received.
// kNoTerminal: this machine gave no pseudo-terminal.
constexpr int kNoTerminal = -2;
int RunToolOnATerminal(const std::string& args, std::string* terminal, const std::string& dir) {
  int master = -1, slave = -1;
  if (::openpty(&master, &slave, nullptr, nullptr, nullptr) != 0) return kNoTerminal;
  const std::string command = ToolPath() + " " + args + " >" + dir + "/stdout.txt";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(slave, 2);
    ::close(master);
    ::close(slave);
    ::execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(slave);
  char buf[4096];
  for (;;) {  // until EIO: every holder of the terminal's other side has closed it
    const ssize_t n = ::read(master, buf, sizeof(buf));
    if (n > 0) {
      terminal->append(buf, static_cast<size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      break;
    }
  }
  ::close(master);
  int status = 0;
  if (pid < 0 || ::waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// A `gemvz pack --json` report (schema gemvz.pack/1) of a pack of `shards`: every field there,
// the totals those of the tensors, `verified` as asked.
void ExpectPackReport(const nlohmann::json& report, const std::vector<std::vector<Tensor>>& shards,
                      bool verified) {
  for (const char* key : {"schema", "outputs", "input_bytes", "output_bytes", "packed_tensors",
                          "packed_weights", "packed_input_bytes", "packed_output_bytes",
                          "verified", "seconds", "tensors"}) {
    EXPECT_TRUE(report.contains(key)) << "the report has no '" << key << "'";
  }
  EXPECT_EQ(report.value("schema", ""), "gemvz.pack/1");
  EXPECT_EQ(report.value("verified", !verified), verified);
  EXPECT_GE(report.value("seconds", -1.0), 0.0);
  std::map<std::string, const Tensor*> expected;
  for (const auto& s : shards) {
    for (const auto& t : s) expected[t.name] = &t;
  }
  const nlohmann::json tensors = report.value("tensors", nlohmann::json::array());
  ASSERT_EQ(tensors.size(), expected.size());
  int64_t input = 0, packed = 0, packed_weights = 0, packed_input = 0, packed_output = 0;
  for (const nlohmann::json& t : tensors) {
    for (const char* key : {"name", "file", "dtype", "shape", "packed", "input_bytes",
                            "output_bytes", "seconds", "verified"}) {
      EXPECT_TRUE(t.contains(key)) << "no '" << key << "' in " << t.dump();
    }
    const std::string name = t.value("name", "");
    ASSERT_TRUE(expected.count(name)) << t.dump();
    const Tensor& e = *expected.at(name);
    EXPECT_EQ(t.value("dtype", ""), e.dtype) << name;
    EXPECT_EQ(t.value("shape", std::vector<int64_t>{-1}), e.shape) << name;
    EXPECT_EQ(t.value("packed", !e.expect_packed), e.expect_packed) << name;
    EXPECT_EQ(t.value("verified", !verified), verified) << name;
    const int64_t bytes = t.value("input_bytes", int64_t{-1});
    EXPECT_EQ(bytes, static_cast<int64_t>(e.bytes.size())) << name;
    input += bytes;
    if (e.expect_packed) {
      for (const char* key : {"bits_per_weight", "exception_rate", "window_coverage",
                              "outside_window", "sparse_entries", "residual_entries",
                              "dense_rows", "padded_table_bytes"}) {
        EXPECT_TRUE(t.contains(key)) << "no '" << key << "' in " << t.dump();
      }
      ++packed;
      packed_weights += e.shape[0] * e.shape[1];
      packed_input += bytes;
      packed_output += t.value("output_bytes", int64_t{-1});
    } else {
      EXPECT_NE(t.value("skip_reason", "").find(e.expect_reason), std::string::npos) << t.dump();
    }
  }
  EXPECT_EQ(report.value("input_bytes", int64_t{-1}), input);
  EXPECT_EQ(report.value("packed_tensors", int64_t{-1}), packed);
  EXPECT_EQ(report.value("packed_weights", int64_t{-1}), packed_weights);
  EXPECT_EQ(report.value("packed_input_bytes", int64_t{-1}), packed_input);
  EXPECT_EQ(report.value("packed_output_bytes", int64_t{-1}), packed_output);
}

TEST(CheckpointTest, CommandLine) {
  if (ToolPath().empty() || ::access(ToolPath().c_str(), X_OK) != 0) {
    GTEST_SKIP() << "the gemvz CLI was not built";
  }
  const uint64_t seed = FreshSeed();
  const std::string dir = MakeTempDir("checkpoint_test");
  const auto shards = SyntheticShards(seed);
  WriteCheckpoint(dir + "/a.safetensors", shards[0]);
  WriteCheckpoint(dir + "/b.safetensors", shards[1]);
  std::string out, err;
  int rc = RunTool("pack " + dir + "/a.safetensors " + dir + "/b.safetensors -o " + dir +
                       "/packed --verify --j=2 --json=" + dir + "/report.json",
                   &out, &err, dir);
  ASSERT_EQ(rc, 0) << out << err;
  EXPECT_NE(out.find("model.embed_tokens.weight"), std::string::npos) << out;
  EXPECT_NE(out.find("packed"), std::string::npos) << out;
  EXPECT_NE(out.find("dtype F32 (only BF16 is packed)"), std::string::npos) << out;
  EXPECT_NE(out.find("total: packed 4 of 15 tensors"), std::string::npos) << out;
  EXPECT_NE(out.find("every bit matches"), std::string::npos) << out;
  EXPECT_NE(out.find(" written to 3 file(s) "), std::string::npos) << out;  // the index too
  EXPECT_NE(err.find("100%"), std::string::npos) << err;
  const nlohmann::json report = nlohmann::json::parse(ReadAll(dir + "/report.json"));
  ExpectPackReport(report, shards, true);
  // The total line's bits per weight are the packed tensors' output bytes over their weights
  // (about 12.x, not the 16 of their BF16 input), as the JSON report's fields give them.
  const double bits = 8.0 * report.value("packed_output_bytes", int64_t{0}) /
                      report.value("packed_weights", int64_t{1});
  EXPECT_LT(bits, 16.0);
  EXPECT_NE(out.find(absl::StrFormat(", %.4f bits per weight, ", bits)), std::string::npos)
      << out;
  EXPECT_EQ(report.value("outputs", nlohmann::json()),
            nlohmann::json({dir + "/packed/a.safetensors", dir + "/packed/b.safetensors",
                            dir + "/packed/model.safetensors.index.json"}));
  int64_t file_bytes = 0;
  for (const char* name :
       {"/packed/a.safetensors", "/packed/b.safetensors", "/packed/model.safetensors.index.json"}) {
    file_bytes += static_cast<int64_t>(ReadAll(dir + name).size());
  }
  EXPECT_EQ(report.value("output_bytes", int64_t{-1}), file_bytes);
  EXPECT_TRUE(PackedCheckpoint::Open(dir + "/packed").ok());

  // A bad input: exit 1, the file named, nothing written.
  WriteAll(dir + "/bad.safetensors", RawFile("{\"w\":{\"dtype\":\"Q8\",\"shape\":[1],"
                                             "\"data_offsets\":[0,1]}}",
                                             "x"));
  rc = RunTool("pack " + dir + "/bad.safetensors -o " + dir + "/packed2", &out, &err, dir);
  EXPECT_EQ(rc, 1);
  EXPECT_NE(err.find(dir + "/bad.safetensors"), std::string::npos) << err;
  EXPECT_NE(err.find("unknown dtype 'Q8'"), std::string::npos) << err;
  EXPECT_TRUE(ListDir(dir + "/packed2").empty());
  // A directory where the second output goes: exit 1, and the first output not put in place.
  ASSERT_EQ(::mkdir((dir + "/packed3").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((dir + "/packed3/b.safetensors").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((dir + "/packed3/b.safetensors/x").c_str(), 0755), 0);
  rc = RunTool("pack " + dir + "/a.safetensors " + dir + "/b.safetensors -o " + dir + "/packed3",
               &out, &err, dir);
  EXPECT_EQ(rc, 1);
  EXPECT_NE(err.find(dir + "/packed3/b.safetensors"), std::string::npos) << err;
  EXPECT_EQ(ListDir(dir + "/packed3"), (std::vector<std::string>{"b.safetensors"}));
  // A --json report that could not be written once the outputs are published: refused first.
  rc = RunTool(
      "pack " + dir + "/a.safetensors -o " + dir + "/packed4 --json=" + dir + "/no/such/dir/r.json",
      &out, &err, dir);
  EXPECT_EQ(rc, 2);
  EXPECT_NE(err.find("its directory '" + dir + "/no/such/dir' does not exist"), std::string::npos)
      << err;
  EXPECT_TRUE(ListDir(dir + "/packed4").empty());
  // ... but the report may go into the output directory that the pack itself creates.
  rc = RunTool("pack " + dir + "/a.safetensors -o " + dir + "/packed5/ --json=" + dir +
                   "/packed5/report.json",
               &out, &err, dir);
  EXPECT_EQ(rc, 0) << err;
  EXPECT_EQ(ListDir(dir + "/packed5"), (std::vector<std::string>{"a.safetensors", "report.json"}));
  ExpectPackReport(nlohmann::json::parse(ReadAll(dir + "/packed5/report.json")), {shards[0]},
                   false);  // without --verify
  // Usage errors: exit 2.
  EXPECT_EQ(RunTool("pack " + dir + "/a.safetensors", &out, &err, dir), 2);
  EXPECT_NE(err.find("-o"), std::string::npos) << err;
  EXPECT_EQ(RunTool("pack -o " + dir + "/x", &out, &err, dir), 2);
  EXPECT_EQ(RunTool("pack --help", &out, &err, dir), 0);
  EXPECT_NE(out.find("usage: gemvz pack"), std::string::npos);
}

// A tensor's name is the file's to choose: a NUL or a terminal escape in it is shown escaped in
// pack's table (a NUL cut the row, an escape reached the terminal), and the name is kept whole in
// the packed file and the JSON report.
TEST(CheckpointTest, CommandLineShowsNamesEscapedAndKeepsThemWhole) {
  if (ToolPath().empty() || ::access(ToolPath().c_str(), X_OK) != 0) {
    GTEST_SKIP() << "the gemvz CLI was not built";
  }
  const std::string dir = MakeTempDir("checkpoint_test");
  const std::string name("evil\x1b[2J\0name", 13);
  WriteAll(dir + "/in.safetensors",
           RawFile("{\"evil\\u001b[2J\\u0000name\":{\"dtype\":\"BF16\",\"shape\":[2,4],"
                   "\"data_offsets\":[0,16]}}",
                   std::string(16, '\x11')));
  std::string out, err;
  const int rc =
      RunTool("pack " + dir + "/in.safetensors -o " + dir + "/packed --json=" + dir + "/r.json",
              &out, &err, dir);
  ASSERT_EQ(rc, 0) << absl::CHexEscape(out + err);
  EXPECT_NE(out.find("evil\\x1b[2J\\x00name "), std::string::npos) << absl::CHexEscape(out);
  EXPECT_EQ(out.find_first_of(std::string("\0\x1b", 2)), std::string::npos)
      << absl::CHexEscape(out);
  EXPECT_EQ(err.find_first_of(std::string("\0\x1b", 2)), std::string::npos)
      << absl::CHexEscape(err);
  const nlohmann::json report = nlohmann::json::parse(ReadAll(dir + "/r.json"));
  ASSERT_EQ(report.value("tensors", nlohmann::json()).size(), 1u) << report.dump();
  EXPECT_EQ(report["tensors"][0].value("name", std::string()), name);
  auto packed = internal::SafetensorsFile::Open(dir + "/packed/in.safetensors");
  ASSERT_TRUE(packed.ok()) << packed.status();
  EXPECT_NE((*packed)->Find(name), nullptr);
}

// On a terminal `pack` draws its progress bar in place, naming the tensor at work: a name's control
// bytes are escaped there too (a name that clears the screen must not clear the user's), and the
// bar reaches 100 % and leaves the cursor on a new line.
TEST(CheckpointTest, CommandLineProgressBarOnATerminalShowsNamesEscaped) {
  if (ToolPath().empty() || ::access(ToolPath().c_str(), X_OK) != 0) {
    GTEST_SKIP() << "the gemvz CLI was not built";
  }
  const std::string dir = MakeTempDir("checkpoint_test");
  WriteAll(dir + "/in.safetensors",
           RawFile("{\"evil\\u001b[2J\\u0000name\":{\"dtype\":\"BF16\",\"shape\":[2,4],"
                   "\"data_offsets\":[0,16]}}",
                   std::string(16, '\x11')));
  std::string terminal;
  const int rc =
      RunToolOnATerminal("pack " + dir + "/in.safetensors -o " + dir + "/packed", &terminal, dir);
  if (rc == kNoTerminal) GTEST_SKIP() << "no pseudo-terminal here: " << std::strerror(errno);
  ASSERT_EQ(rc, 0) << absl::CHexEscape(terminal);
  EXPECT_NE(terminal.find("\r["), std::string::npos)
      << "no bar drawn: " << absl::CHexEscape(terminal);
  EXPECT_NE(terminal.find("100%"), std::string::npos) << absl::CHexEscape(terminal);
  EXPECT_NE(terminal.find("evil\\x1b[2J\\x00name"), std::string::npos)
      << absl::CHexEscape(terminal);
  EXPECT_EQ(terminal.find_first_of(std::string("\0\x1b", 2)), std::string::npos)
      << absl::CHexEscape(terminal);
  const size_t last_bar = terminal.rfind("\r[");
  ASSERT_NE(last_bar, std::string::npos);
  EXPECT_NE(terminal.find("100%", last_bar), std::string::npos) << absl::CHexEscape(terminal);
  EXPECT_NE(terminal.find('\n', last_bar), std::string::npos)
      << "the bar leaves the cursor on its line: " << absl::CHexEscape(terminal);
}

// --json may not replace an input nor a packed output, however it is spelt (a link, "./",
// an output directory that exists or is still to be made), and -o must be a directory: usage
// errors (exit 2) before any work, every file as it was.
TEST(CheckpointTest, CommandLineRefusesAReportOverAnInputOrAnOutput) {
  if (ToolPath().empty() || ::access(ToolPath().c_str(), X_OK) != 0) {
    GTEST_SKIP() << "the gemvz CLI was not built";
  }
  // Absolute (TMPDIR may be relative): one case runs the tool in `dir` with relative paths.
  char real[PATH_MAX];
  ASSERT_NE(::realpath(MakeTempDir("checkpoint_test").c_str(), real), nullptr);
  const std::string dir = real;
  const std::string a = dir + "/a.safetensors";
  WriteCheckpoint(a, SyntheticShards(FreshSeed())[0]);
  const std::string b = dir + "/b.safetensors";
  WriteCheckpoint(b, SyntheticShards(FreshSeed())[1]);
  const std::string original = ReadAll(a);
  std::string out, err;
  ASSERT_EQ(RunTool("pack " + a + " -o " + dir + "/packed", &out, &err, dir), 0) << err;
  const std::string packed = ReadAll(dir + "/packed/a.safetensors");
  ASSERT_EQ(::symlink(a.c_str(), (dir + "/link.json").c_str()), 0);
  ASSERT_EQ(::symlink(dir.c_str(), (dir + "/here").c_str()), 0);
  ASSERT_EQ(::mkdir((dir + "/sub").c_str(), 0755), 0);
  const struct {
    std::string args, message, cwd;
  } cases[] = {
      {a + " -o " + dir + "/p1 --json=" + a, "is the input '" + a + "'"},
      {a + " -o " + dir + "/p1 --json=" + dir + "/./a.safetensors", "is the input '" + a + "'"},
      {a + " -o " + dir + "/p1 --json=" + dir + "/link.json", "is the input '" + a + "'"},
      {a + " -o " + dir + "/packed --json=" + dir + "/packed/a.safetensors",
       "is where '" + a + "' is packed to"},
      {a + " -o " + dir + "/p2/ --json=" + dir + "/p2/a.safetensors",
       "is where '" + a + "' is packed to"},
      // -o still to be made, the report's path spelt another way: through a link to its parent,
      // through "..", through ".." after a directory still to be made, relative (the tool run
      // in `dir`) against absolute.
      {a + " -o " + dir + "/p2 --json=" + dir + "/here/p2/a.safetensors",
       "is where '" + a + "' is packed to"},
      {a + " -o " + dir + "/p2 --json=" + dir + "/sub/../p2/a.safetensors",
       "is where '" + a + "' is packed to"},
      {a + " -o " + dir + "/sub/x/.. --json=" + dir + "/sub/a.safetensors",
       "is where '" + a + "' is packed to"},
      {"a.safetensors -o p2 --json=" + dir + "/p2/a.safetensors",
       "is where 'a.safetensors' is packed to", dir},
      {a + " " + dir + "/./a.safetensors -o " + dir + "/p3",
       "the input '" + a + "' is given twice"},
      {a + " -o " + a, "-o " + a + " is not a directory"},
      // Two inputs: the index written beside them is an output too.
      {a + " " + b + " -o " + dir + "/p4 --json=" + dir + "/p4/model.safetensors.index.json",
       "is the index of the packed files"},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(RunTool("pack " + c.args, &out, &err, dir, c.cwd), 2) << c.args << "\n" << err;
    EXPECT_NE(err.find(c.message), std::string::npos) << c.args << "\n" << err;
  }
  EXPECT_EQ(ReadAll(a), original);
  EXPECT_EQ(ReadAll(dir + "/packed/a.safetensors"), packed);
  for (const char* made : {"/p1", "/p2", "/p3", "/p4", "/sub/x", "/sub/a.safetensors"}) {
    EXPECT_FALSE(Exists(dir + made)) << made;
  }
}

// Each input is packed to OUT_DIR/<its file name>: two inputs of one name, or an -o that puts an
// output in an input's place (however -o is spelt), are usage errors (exit 2) that name the
// paths, before anything is written (the library refused them as failures, exit 1).
TEST(CheckpointTest, CommandLineRefusesOutputsThatCollideOrReplaceAnInput) {
  if (ToolPath().empty() || ::access(ToolPath().c_str(), X_OK) != 0) {
    GTEST_SKIP() << "the gemvz CLI was not built";
  }
  char real[PATH_MAX];
  ASSERT_NE(::realpath(MakeTempDir("checkpoint_test").c_str(), real), nullptr);
  const std::string dir = real;
  const std::vector<std::vector<Tensor>> shards = SyntheticShards(FreshSeed());
  ASSERT_EQ(::mkdir((dir + "/a").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((dir + "/b").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((dir + "/sub").c_str(), 0755), 0);
  ASSERT_EQ(::symlink(dir.c_str(), (dir + "/here").c_str()), 0);
  const std::string ax = dir + "/a/x.safetensors", bx = dir + "/b/x.safetensors";
  const std::string y = dir + "/y.safetensors";
  WriteCheckpoint(ax, shards[0]);
  WriteCheckpoint(bx, shards[1]);
  WriteCheckpoint(y, shards[0]);
  const std::string ax_bytes = ReadAll(ax), bx_bytes = ReadAll(bx), y_bytes = ReadAll(y);
  const struct {
    std::string args, message, cwd;
  } cases[] = {
      {ax + " " + bx + " -o " + dir + "/p1", "the inputs '" + ax + "' and '" + bx +
                                                 "' would both be packed to '" + dir +
                                                 "/p1/x.safetensors'"},
      {"a/x.safetensors " + y + " b/x.safetensors -o p2",
       "the inputs 'a/x.safetensors' and 'b/x.safetensors' would both be packed to "
       "'p2/x.safetensors'",
       dir},
      {y + " -o " + dir,
       "'" + dir + "/y.safetensors', where '" + y + "' is packed to, is the input"},
      {y + " -o " + dir + "/", "where '" + y + "' is packed to, is the input '" + y + "'"},
      {y + " -o " + dir + "/sub/..", "where '" + y + "' is packed to, is the input '" + y + "'"},
      {y + " -o " + dir + "/here", "where '" + y + "' is packed to, is the input '" + y + "'"},
      {ax + " y.safetensors -o .", "where 'y.safetensors' is packed to, is the input", dir},
      {"x.safetensors -o .", "'./x.safetensors', where 'x.safetensors' is packed to, is the input",
       dir + "/a"},
  };
  std::string out, err;
  for (const auto& c : cases) {
    EXPECT_EQ(RunTool("pack " + c.args, &out, &err, dir, c.cwd), 2) << c.args << "\n" << err;
    EXPECT_NE(err.find(c.message), std::string::npos) << c.args << "\n" << err;
    EXPECT_EQ(out, "") << c.args;
  }
  EXPECT_EQ(ReadAll(ax), ax_bytes);
  EXPECT_EQ(ReadAll(bx), bx_bytes);
  EXPECT_EQ(ReadAll(y), y_bytes);
  for (const char* made : {"/p1", "/p2"}) EXPECT_FALSE(Exists(dir + made)) << made;
  std::vector<std::string> left = ListDir(dir);
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"a", "b", "here", "stderr.txt", "stdout.txt", "sub",
                                            "y.safetensors"}));
}

// Two inputs of different file names do not collide, even where the files already in -o under
// their names are one file (a link, or a hard link): each output replaces its name by a rename.
// They were refused as "would both be packed to" one output, exit 2.
TEST(CheckpointTest, CommandLinePacksInputsWhoseOldOutputsAreLinked) {
  if (ToolPath().empty() || ::access(ToolPath().c_str(), X_OK) != 0) {
    GTEST_SKIP() << "the gemvz CLI was not built";
  }
  const std::string dir = MakeTempDir("checkpoint_test");
  const std::vector<std::vector<Tensor>> shards = SyntheticShards(FreshSeed());
  const std::string a = dir + "/a.safetensors", b = dir + "/b.safetensors";
  WriteCheckpoint(a, shards[0]);
  WriteCheckpoint(b, shards[1]);
  ASSERT_EQ(::mkdir((dir + "/out").c_str(), 0755), 0);
  std::string out, err;
  for (const bool hard : {false, true}) {
    ::unlink((dir + "/out/a.safetensors").c_str());
    ::unlink((dir + "/out/b.safetensors").c_str());
    WriteAll(dir + "/out/a.safetensors", "old");
    ASSERT_EQ(
        hard ? ::link((dir + "/out/a.safetensors").c_str(), (dir + "/out/b.safetensors").c_str())
             : ::symlink("a.safetensors", (dir + "/out/b.safetensors").c_str()),
        0);
    EXPECT_EQ(RunTool("pack " + a + " " + b + " -o " + dir + "/out", &out, &err, dir), 0)
        << hard << "\n"
        << err;
    for (const char* name : {"/out/a.safetensors", "/out/b.safetensors"}) {
      struct stat st;
      ASSERT_EQ(::lstat((dir + name).c_str(), &st), 0) << name;
      EXPECT_TRUE(S_ISREG(st.st_mode)) << name;
      EXPECT_EQ(st.st_nlink, 1u) << name;
    }
  }
}

// An input that is no file (missing, a directory, a name ending in '/') is named as the library
// opens it, exit 1, as before: it is neither an output that collides nor an input that an output
// would replace. The checks for those said "it would be replaced" of a missing file, and "would
// both be packed to 'OUT/'" of two directories, exit 2.
TEST(CheckpointTest, CommandLineNamesAnInputThatIsNoFileAsBefore) {
  if (ToolPath().empty() || ::access(ToolPath().c_str(), X_OK) != 0) {
    GTEST_SKIP() << "the gemvz CLI was not built";
  }
  const std::string dir = MakeTempDir("checkpoint_test");
  ASSERT_EQ(::mkdir((dir + "/d").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((dir + "/e").c_str(), 0755), 0);
  const struct {
    std::string args, message;
  } cases[] = {
      {"missing.safetensors -o .",
       "cannot open safetensors file 'missing.safetensors': No such file or directory"},
      {"a/x.safetensors b/x.safetensors -o out", "cannot open safetensors file 'a/x.safetensors'"},
      {"d -o .", "safetensors file 'd': not a regular file"},
      {"d/ e/ -o out", "safetensors file 'd/': not a regular file"},
  };
  std::string out, err;
  for (const auto& c : cases) {
    EXPECT_EQ(RunTool("pack " + c.args, &out, &err, dir, dir), 1) << c.args << "\n" << err;
    EXPECT_NE(err.find(c.message), std::string::npos) << c.args << "\n" << err;
  }
  EXPECT_FALSE(Exists(dir + "/out"));
}

// File names are bytes, not UTF-8: such an input's --json report is written (with U+FFFD in
// place of the bad byte), and the command does not abort once its outputs are published.
TEST(CheckpointTest, CommandLineJsonReportOfANonUtf8FileName) {
  if (ToolPath().empty() || ::access(ToolPath().c_str(), X_OK) != 0) {
    GTEST_SKIP() << "the gemvz CLI was not built";
  }
  const std::string dir = MakeTempDir("checkpoint_test");
  const std::string input = dir + "/w\xff.safetensors";
  WriteCheckpoint(input, {SyntheticShards(FreshSeed())[0][0]});
  std::string out, err;
  const int rc = RunTool("pack '" + input + "' -o " + dir + "/packed --json=" + dir + "/r.json",
                         &out, &err, dir);
  EXPECT_EQ(rc, 0) << out << err;
  const nlohmann::json report = nlohmann::json::parse(ReadAll(dir + "/r.json"));
  ASSERT_EQ(report["tensors"].size(), 1u);
  EXPECT_NE(report["tensors"][0]["file"].get<std::string>().find("w\xef\xbf\xbd.safetensors"),
            std::string::npos)
      << report.dump();
}

// An input truncated by another process while `gemvz pack` has it mapped: reading the lost pages
// raises SIGBUS. The CLI must say what happened, remove its temporary output, and die by that
// signal. To cut the input at the right moment, gemvz's stderr is a pipe filled up beforehand:
// its first progress line (20 %, once tensor a of a and b is packed) blocks it until the test has
// truncated the file at b and starts reading the pipe.
TEST(CheckpointTest, CommandLineInputTruncatedMidPackIsExplainedAndLeavesNothing) {
  if (ToolPath().empty() || ::access(ToolPath().c_str(), X_OK) != 0) {
    GTEST_SKIP() << "the gemvz CLI was not built";
  }
  const uint64_t seed = FreshSeed();
  const std::string dir = MakeTempDir("checkpoint_test");
  const std::string input = dir + "/m.safetensors", out_dir = dir + "/packed";
  WriteCheckpoint(input, {{"a", "BF16", {256, 512},
                           Bf16Bytes(RandomMatrix(256, 512, Distribution::kNormal, seed)), true, ""},
                          {"b", "BF16", {1024, 512},
                           Bf16Bytes(RandomMatrix(1024, 512, Distribution::kNormal, seed + 1)),
                           true, ""}});
  uint64_t b_offset = 0;
  {
    auto f = SafetensorsFile::Open(input);
    ASSERT_TRUE(f.ok()) << f.status();
    ASSERT_NE((*f)->Find("b"), nullptr);
    b_offset = (*f)->data_offset() + (*f)->Find("b")->begin;
    ASSERT_LT(b_offset + 4 * 4096, (*f)->file_size()) << "b must span pages past the cut";
  }

  // Both ends closed however the test ends.
  struct Pipe {
    int fd[2] = {-1, -1};
    void Close(int end) {
      if (fd[end] >= 0) ::close(fd[end]);
      fd[end] = -1;
    }
    ~Pipe() {
      Close(0);
      Close(1);
    }
  } err_pipe;
  ASSERT_EQ(::pipe2(err_pipe.fd, O_CLOEXEC), 0);
  // Full: 4 KiB writes until the pipe refuses them, then single bytes until it takes no more.
  ASSERT_EQ(::fcntl(err_pipe.fd[1], F_SETFL, O_NONBLOCK), 0);
  const std::string chunk(4096, '.');
  size_t filler = 0;
  for (size_t n : {chunk.size(), size_t{1}}) {
    ssize_t w;
    while ((w = ::write(err_pipe.fd[1], chunk.data(), n)) > 0) filler += static_cast<size_t>(w);
    ASSERT_EQ(errno, EAGAIN);
  }
  ASSERT_EQ(::fcntl(err_pipe.fd[1], F_SETFL, 0), 0);

  const std::string out_path = dir + "/stdout.txt";
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const struct rlimit none = {0, 0};
    ::setrlimit(RLIMIT_CORE, &none);
    const int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (out < 0 || ::dup2(out, STDOUT_FILENO) < 0 || ::dup2(err_pipe.fd[1], STDERR_FILENO) < 0) {
      ::_exit(126);
    }
    ::execl(ToolPath().c_str(), "gemvz", "pack", input.c_str(), "-o", out_dir.c_str(), "--j=2",
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  err_pipe.Close(1);
  // The input is mapped (and checked) once the temporary output exists. A gemvz that ends first,
  // or stalls on the full pipe before it (an early error), is seen within 30 s.
  bool started = false, ended = false;
  int status = 0;
  for (int i = 0; i < 3000 && !started && !ended; ++i) {
    for (const std::string& name : ListDir(out_dir)) {
      if (name.rfind("m.safetensors.tmp.", 0) == 0) started = true;
    }
    ended = ::waitpid(pid, &status, WNOHANG) == pid;
    if (!started && !ended) ::usleep(10000);
  }
  EXPECT_TRUE(started) << "no temporary output appeared (gemvz " << (ended ? "ended" : "stalled")
                       << ")";
  EXPECT_EQ(::truncate(input.c_str(), static_cast<off_t>(b_offset)), 0);
  // Reading stderr lets gemvz go on; it ends (the pipe closes) or is killed after 60 s.
  std::string err;
  bool timed_out = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (char buf[4096];;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                          deadline - std::chrono::steady_clock::now())
                          .count();
    struct pollfd pfd = {err_pipe.fd[0], POLLIN, 0};
    if (left <= 0 || ::poll(&pfd, 1, static_cast<int>(left)) == 0) {
      timed_out = true;
      break;
    }
    const ssize_t got = ::read(err_pipe.fd[0], buf, sizeof buf);
    if (got <= 0) break;
    err.append(buf, static_cast<size_t>(got));
  }
  if (!ended) {
    if (timed_out) ::kill(pid, SIGKILL);
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  }
  err = err.substr(std::min(filler, err.size()));
  ASSERT_FALSE(timed_out) << "gemvz did not end within 60 s of the truncation; stderr:\n" << err;
  ASSERT_TRUE(WIFSIGNALED(status))
      << "exit status " << (WIFEXITED(status) ? WEXITSTATUS(status) : -1) << "; stderr:\n" << err;
  EXPECT_EQ(WTERMSIG(status), SIGBUS) << err;
  EXPECT_NE(err.find("gemvz pack: 20%"), std::string::npos) << "a was packed first:\n" << err;
  EXPECT_NE(err.find("gemvz: SIGBUS"), std::string::npos) << err;
  EXPECT_EQ(err.find("gemvz: SIGBUS"), err.rfind("gemvz: SIGBUS")) << "said once:\n" << err;
  EXPECT_NE(err.find("memory-mapped input file could not be read"), std::string::npos) << err;
  EXPECT_NE(err.find("temporary files were removed"), std::string::npos) << err;
  EXPECT_EQ(ListDir(out_dir), std::vector<std::string>{}) << "nothing published, nothing left";
}

// Not a test: writes the ~2 GB synthetic checkpoint that docs/CHECKPOINTS.md measures, to the
// path in GEMVZ_BIG_CHECKPOINT, one tensor at a time. Run with --gtest_also_run_disabled_tests
// --gtest_filter='*MakeBigCheckpoint*'.
TEST(CheckpointTest, DISABLED_MakeBigCheckpoint) {
  const char* path = std::getenv("GEMVZ_BIG_CHECKPOINT");
  if (path == nullptr) GTEST_SKIP() << "set GEMVZ_BIG_CHECKPOINT to the output path";
  // Llama-3-8B-like layers (N(0, 1/K) BF16) and their norms: whole layers up to >= 2 GB.
  struct Spec {
    std::string name;
    int64_t n, k;  // n == 1: a 1-D norm of k values
  };
  std::vector<Spec> specs;
  int64_t total = 0;
  for (int layer = 0; total < int64_t{2000000000}; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    for (const Spec& s : {Spec{p + "self_attn.qkv_proj.weight", 6144, 4096},
                          Spec{p + "self_attn.o_proj.weight", 4096, 4096},
                          Spec{p + "mlp.gate_proj.weight", 14336, 4096},
                          Spec{p + "mlp.down_proj.weight", 4096, 14336},
                          Spec{p + "input_layernorm.weight", 1, 4096}}) {
      specs.push_back(s);
      total += s.n * s.k * 2;
    }
  }
  std::vector<SafetensorsEntry> bound;
  for (const Spec& s : specs) {
    bound.push_back({s.name, "BF16",
                     s.n == 1 ? std::vector<int64_t>{s.k} : std::vector<int64_t>{s.n, s.k},
                     internal::kMaxHeaderNumber, internal::kMaxHeaderNumber});
  }
  auto w = SafetensorsWriter::Create(path, internal::SafetensorsHeaderJson(bound, {}).size());
  ASSERT_TRUE(w.ok()) << w.status();
  uint64_t seed = 1234;
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto m = RandomMatrix(specs[i].n, specs[i].k, Distribution::kNormal, ++seed);
    ASSERT_TRUE(
        (*w)->AddTensor(bound[i].name, "BF16", bound[i].shape, m.data(), m.size() * 2).ok());
  }
  ASSERT_TRUE((*w)->Finish().ok());
  ASSERT_TRUE((*w)->Publish().ok());
  std::printf("wrote %s: %zu tensors, %lld bytes of tensor data\n", path, specs.size(),
              static_cast<long long>(total));
}

}  // namespace
}  // namespace gemvz
