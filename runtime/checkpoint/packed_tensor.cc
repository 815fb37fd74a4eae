// A PackedMatrix as safetensors parts plus a metadata entry; see packed_tensor.h.
#include "runtime/checkpoint/packed_tensor.h"

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gemvz/checkpoint.h"
#include "nlohmann/json.hpp"
#include "runtime/common/hash.h"
#include "runtime/common/json_check.h"
#include "runtime/common/log.h"
#include "runtime/common/status_macros.h"

namespace gemvz::internal {
namespace {

using Json = nlohmann::json;

constexpr const char* kStatInts[] = {"weights",           "outside_window", "sparse_entries",
                                     "residual_entries",  "dense_rows",     "total_bytes",
                                     "padded_table_bytes"};
constexpr const char* kStatDoubles[] = {"bits_per_weight", "exception_rate", "window_coverage"};

std::array<int64_t*, 7> StatInts(PackStats& s) {
  return {&s.weights,    &s.outside_window, &s.sparse_entries,    &s.residual_entries,
          &s.dense_rows, &s.total_bytes,    &s.padded_table_bytes};
}
std::array<double*, 3> StatDoubles(PackStats& s) {
  return {&s.bits_per_weight, &s.exception_rate, &s.window_coverage};
}

// The longest text a double can dump to (17 significant digits, sign, 3-digit exponent).
constexpr double kLongestDouble = -1.2345678901234567e+300;

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Raw bytes of each part, in kPackedPartSpecs order.
struct PartBytes {
  const void* data;
  size_t size;
};
std::array<PartBytes, kPackedParts> PartsOf(const PackedMatrix& p) {
  return {{{p.weights.data(), p.weights.size()},
           {p.row_offsets.data(), p.row_offsets.size() * 4},
           {p.entries.data(), p.entries.size() * sizeof(ExceptionEntry)},
           {p.dense_block_offsets.data(), p.dense_block_offsets.size() * 4},
           {p.dense_rows.data(), p.dense_rows.size()},
           {p.dense_values.data(), p.dense_values.size() * 2}}};
}

std::vector<std::vector<int64_t>> PartShapes(int64_t rows, int64_t cols, int64_t entries,
                                             int64_t dense) {
  return {{rows / kRowBlock, cols / kColGroup, 3, 32, 16},
          {rows + 1},
          {entries, 2},
          {rows / kRowBlock + 1},
          {dense},
          {dense, cols}};
}

template <typename T>
absl::Status CopyPart(const SafetensorsFile& file, const SafetensorsEntry& e, uint32_t crc,
                      const std::string& tensor, std::vector<T>& out) {
  const size_t bytes = e.end - e.begin;
  out.resize(bytes / sizeof(T));
  if (bytes > 0) std::memcpy(out.data(), file.data(e), bytes);
  file.Release(e.begin, bytes);
  const uint32_t actual = Crc32c(out.data(), bytes);
  if (actual != crc) {
    return absl::DataLossError(absl::StrCat("safetensors file '", file.path(), "', tensor '",
                                            Escaped(tensor), "': part '", Escaped(e.name),
                                            "' fails its checksum (stored crc32c ", crc,
                                            ", computed ", actual, "): the file is corrupt"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string PackedPartName(const std::string& tensor, int part) {
  return absl::StrCat(tensor, ".z12.", kPackedPartSpecs[part].suffix);
}

std::string EncodePackedTensorMeta(const PackedTensorMeta& m) {
  Json j = Json::object();
  j["format"] = "z12";
  j["version"] = kCheckpointFormatVersion;
  j["rows"] = m.rows;
  j["cols"] = m.cols;
  j["base"] = m.base;
  j["tl"] = m.tl;
  j["th"] = m.th;
  Json crc = Json::object();
  for (int i = 0; i < kPackedParts; ++i) crc[kPackedPartSpecs[i].suffix] = m.crc[i];
  j["crc32c"] = std::move(crc);
  Json stats = Json::object();
  PackStats s = m.stats;
  const auto ints = StatInts(s);
  const auto doubles = StatDoubles(s);
  for (int i = 0; i < 7; ++i) stats[kStatInts[i]] = *ints[i];
  for (int i = 0; i < 3; ++i) stats[kStatDoubles[i]] = *doubles[i];
  j["stats"] = std::move(stats);
  return j.dump();
}

absl::StatusOr<PackedTensorMeta> DecodePackedTensorMeta(const std::string& text) {
  if (absl::Status st = CheckJsonText(text, kMaxJsonDepth, /*refuse_duplicate_keys=*/false);
      !st.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("packed-tensor metadata is not valid JSON: ", st.message()));
  }
  Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("packed-tensor metadata is not a JSON object");
  }
  auto get_int = [&](const Json& obj, const char* key, int64_t lo, int64_t hi,
                     int64_t* out) -> absl::Status {
    auto it = obj.find(key);
    if (it == obj.end() || !it->is_number_integer()) {
      return absl::InvalidArgumentError(
          absl::StrCat("packed-tensor metadata has no integer '", key, "'"));
    }
    int64_t v;
    if (it->is_number_unsigned()) {
      if (it->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return absl::InvalidArgumentError(
            absl::StrCat("packed-tensor metadata '", key, "' is out of range"));
      }
      v = static_cast<int64_t>(it->get<uint64_t>());
    } else {
      v = it->get<int64_t>();
    }
    if (v < lo || v > hi) {
      return absl::InvalidArgumentError(absl::StrCat("packed-tensor metadata '", key, "' = ", v,
                                                     " is outside [", lo, ", ", hi, "]"));
    }
    *out = v;
    return absl::OkStatus();
  };
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  constexpr int64_t kU32 = std::numeric_limits<uint32_t>::max();
  auto format = j.find("format");
  if (format == j.end() || !format->is_string() || format->get<std::string>() != "z12") {
    return absl::InvalidArgumentError("packed-tensor metadata: 'format' is not \"z12\"");
  }
  int64_t version = 0;
  RETURN_IF_ERROR(get_int(j, "version", 0, kMax, &version));
  if (version > kCheckpointFormatVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "packed tensor of format version ", version, ", newer than this build of gemvz reads (",
        kCheckpointFormatVersion, "); upgrade gemvz"));
  }
  if (version < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("packed-tensor version ", version, " is unknown"));
  }
  PackedTensorMeta m;
  int64_t v;
  RETURN_IF_ERROR(get_int(j, "rows", 0, kMax, &m.rows));
  RETURN_IF_ERROR(get_int(j, "cols", 0, kMax, &m.cols));
  RETURN_IF_ERROR(get_int(j, "base", 0, 120, &v));
  m.base = static_cast<int>(v);
  RETURN_IF_ERROR(get_int(j, "tl", 0, kU32, &v));
  m.tl = static_cast<uint32_t>(v);
  RETURN_IF_ERROR(get_int(j, "th", 0, kU32, &v));
  m.th = static_cast<uint32_t>(v);
  auto crc = j.find("crc32c");
  if (crc == j.end() || !crc->is_object()) {
    return absl::InvalidArgumentError("packed-tensor metadata has no 'crc32c' object");
  }
  for (int i = 0; i < kPackedParts; ++i) {
    RETURN_IF_ERROR(get_int(*crc, kPackedPartSpecs[i].suffix, 0, kU32, &v));
    m.crc[i] = static_cast<uint32_t>(v);
  }
  auto stats = j.find("stats");
  if (stats == j.end() || !stats->is_object()) {
    return absl::InvalidArgumentError("packed-tensor metadata has no 'stats' object");
  }
  const auto ints = StatInts(m.stats);
  const auto doubles = StatDoubles(m.stats);
  for (int i = 0; i < 7; ++i) RETURN_IF_ERROR(get_int(*stats, kStatInts[i], kMin, kMax, ints[i]));
  for (int i = 0; i < 3; ++i) {
    auto it = stats->find(kStatDoubles[i]);
    if (it == stats->end() || !it->is_number()) {
      return absl::InvalidArgumentError(
          absl::StrCat("packed-tensor metadata has no number 'stats.", kStatDoubles[i], "'"));
    }
    *doubles[i] = it->get<double>();
  }
  return m;
}

std::vector<SafetensorsEntry> PlaceholderPackedEntries(const std::string& tensor, int64_t rows,
                                                       int64_t cols) {
  constexpr int64_t kLongest = std::numeric_limits<int64_t>::max();  // 19 digits
  const auto shapes = PartShapes(rows, cols, kLongest, kLongest);
  std::vector<SafetensorsEntry> out;
  for (int i = 0; i < kPackedParts; ++i) {
    SafetensorsEntry e;
    e.name = PackedPartName(tensor, i);
    e.dtype = kPackedPartSpecs[i].dtype;
    e.shape = shapes[i];
    e.begin = e.end = kMaxHeaderNumber;
    out.push_back(std::move(e));
  }
  return out;
}

std::string PlaceholderPackedMeta(int64_t rows, int64_t cols) {
  PackedTensorMeta m;
  m.rows = rows;
  m.cols = cols;
  m.base = std::numeric_limits<int>::min();
  m.tl = m.th = std::numeric_limits<uint32_t>::max();
  m.crc.fill(std::numeric_limits<uint32_t>::max());
  for (int64_t* p : StatInts(m.stats)) *p = std::numeric_limits<int64_t>::min();
  for (double* p : StatDoubles(m.stats)) *p = kLongestDouble;
  return EncodePackedTensorMeta(m);
}

absl::StatusOr<PackedTensorMeta> WritePackedTensor(SafetensorsWriter& writer,
                                                   const std::string& tensor, const PackedMatrix& p,
                                                   std::vector<DeferredPart>& later) {
  PackedTensorMeta m;
  m.rows = p.rows;
  m.cols = p.cols;
  m.base = p.base;
  m.tl = p.tl;
  m.th = p.th;
  m.stats = p.stats;
  const auto parts = PartsOf(p);
  const auto shapes = PartShapes(p.rows, p.cols, static_cast<int64_t>(p.entries.size()),
                                 static_cast<int64_t>(p.dense_rows.size()));
  for (int i = 0; i < kPackedParts; ++i) {
    m.crc[i] = Crc32c(parts[i].data, parts[i].size);
    if (WritesLast(parts[i].size)) {
      later.push_back({PackedPartName(tensor, i), kPackedPartSpecs[i].dtype, shapes[i],
                       std::string(static_cast<const char*>(parts[i].data), parts[i].size)});
      continue;
    }
    RETURN_IF_ERROR(writer.AddTensor(PackedPartName(tensor, i), kPackedPartSpecs[i].dtype,
                                     shapes[i], parts[i].data, parts[i].size));
  }
  return m;
}

absl::Status CheckPackedParts(const SafetensorsFile& file, const std::string& tensor,
                              const PackedTensorMeta& meta) {
  const std::string where =
      absl::StrCat("safetensors file '", file.path(), "', packed tensor '", Escaped(tensor), "'");
  if (absl::Status st = CheckPackableShape(meta.rows, meta.cols); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", st.message()));
  }
  const SafetensorsEntry* entries = file.Find(PackedPartName(tensor, 2));
  const SafetensorsEntry* dense = file.Find(PackedPartName(tensor, 4));
  const int64_t n_entries = entries != nullptr && !entries->shape.empty() ? entries->shape[0] : -1;
  const int64_t n_dense = dense != nullptr && dense->shape.size() == 1 ? dense->shape[0] : -1;
  const auto shapes = PartShapes(meta.rows, meta.cols, n_entries, n_dense);
  for (int i = 0; i < kPackedParts; ++i) {
    const std::string part = PackedPartName(tensor, i);
    const SafetensorsEntry* e = file.Find(part);
    if (e == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": part '", Escaped(part), "' is missing"));
    }
    if (e->dtype != kPackedPartSpecs[i].dtype || e->shape != shapes[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": part '", Escaped(part), "' is ", e->dtype, " ",
                       ShapeString(e->shape), ", expected ", kPackedPartSpecs[i].dtype, " ",
                       ShapeString(shapes[i]), " for a [", meta.rows, ", ", meta.cols, "] matrix"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<PackedMatrix> ReadPackedTensor(const SafetensorsFile& file,
                                              const std::string& tensor,
                                              const PackedTensorMeta& meta) {
  RETURN_IF_ERROR(CheckPackedParts(file, tensor, meta));
  PackedMatrix p;
  p.rows = meta.rows;
  p.cols = meta.cols;
  p.base = meta.base;
  p.tl = meta.tl;
  p.th = meta.th;
  p.stats = meta.stats;
  auto part = [&](int i) -> const SafetensorsEntry& {
    return *file.Find(PackedPartName(tensor, i));
  };
  RETURN_IF_ERROR(CopyPart(file, part(0), meta.crc[0], tensor, p.weights));
  RETURN_IF_ERROR(CopyPart(file, part(1), meta.crc[1], tensor, p.row_offsets));
  RETURN_IF_ERROR(CopyPart(file, part(2), meta.crc[2], tensor, p.entries));
  RETURN_IF_ERROR(CopyPart(file, part(3), meta.crc[3], tensor, p.dense_block_offsets));
  RETURN_IF_ERROR(CopyPart(file, part(4), meta.crc[4], tensor, p.dense_rows));
  RETURN_IF_ERROR(CopyPart(file, part(5), meta.crc[5], tensor, p.dense_values));
  if (absl::Status st = ValidatePacked(p); !st.ok()) {
    return absl::Status(st.code(),
                        absl::StrCat("safetensors file '", file.path(), "', packed tensor '",
                                     Escaped(tensor), "': ", st.message()));
  }
  return p;
}

PackedMatrix SlicePackedRows(const PackedMatrix& p, int64_t row_begin, int64_t row_end) {
  PackedMatrix s;
  s.rows = row_end - row_begin;
  s.cols = p.cols;
  s.base = p.base;
  s.tl = p.tl;
  s.th = p.th;
  const int64_t block_bytes = p.cols / kColGroup * kGroupBytes;
  const int64_t b0 = row_begin / kRowBlock, b1 = row_end / kRowBlock;
  s.weights.assign(p.weights.begin() + b0 * block_bytes, p.weights.begin() + b1 * block_bytes);
  const uint32_t e0 = p.row_offsets[row_begin];
  for (int64_t r = row_begin; r <= row_end; ++r) s.row_offsets.push_back(p.row_offsets[r] - e0);
  s.entries.assign(p.entries.begin() + e0, p.entries.begin() + p.row_offsets[row_end]);
  const uint32_t d0 = p.dense_block_offsets[b0], d1 = p.dense_block_offsets[b1];
  for (int64_t b = b0; b <= b1; ++b) s.dense_block_offsets.push_back(p.dense_block_offsets[b] - d0);
  s.dense_rows.assign(p.dense_rows.begin() + d0, p.dense_rows.begin() + d1);
  s.dense_values.assign(p.dense_values.begin() + static_cast<int64_t>(d0) * p.cols,
                        p.dense_values.begin() + static_cast<int64_t>(d1) * p.cols);
  return s;
}

}  // namespace gemvz::internal
