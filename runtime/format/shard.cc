// Sharding packed matrices by row blocks and column groups: byte copies of whole groups, the
// corrections that fall inside, the dense rows' slices. Nothing is decoded or re-packed.
#include "gemvz/shard.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "runtime/common/status_macros.h"
#include "runtime/format/z12_layout.h"

namespace gemvz {
namespace {

// Statistics of a packed matrix from its own tables (a shard has no original to count from).
void RecomputeStats(PackedMatrix& p) {
  PackStats& s = p.stats;
  s = PackStats{};
  s.weights = p.rows * p.cols;
  s.sparse_entries = static_cast<int64_t>(p.entries.size());
  int64_t outside = 0, residual = 0, capr = 1;
  for (int64_t r = 0; r < p.rows; ++r) {
    const uint32_t b = p.row_offsets[r], e = p.row_offsets[r + 1];
    capr = std::max<int64_t>(capr, e - b);
    for (uint32_t i = b; i < e; ++i) {
      if (i > b && p.entries[i].col == p.entries[i - 1].col) {
        ++residual;
      } else {
        ++outside;
      }
    }
  }
  for (size_t d = 0; d < p.dense_rows.size(); ++d) {
    const uint16_t* row = &p.dense_values[d * p.cols];
    int64_t row_outside = 0;
    for (int64_t c = 0; c < p.cols; ++c) row_outside += !internal::InWindow(row[c], p.base);
    outside += row_outside;
    // Its entries in the padded table, as Pack counts them: a weight may need two.
    capr = std::max(capr, internal::CorrectionEntries(row, p.cols, p.base));
  }
  s.outside_window = outside;
  s.residual_entries = residual;
  s.dense_rows = static_cast<int64_t>(p.dense_rows.size());
  s.total_bytes = internal::KernelBytes(p);
  s.bits_per_weight = s.weights ? 8.0 * s.total_bytes / s.weights : 0;
  s.exception_rate = s.weights ? static_cast<double>(outside) / s.weights : 0;
  s.window_coverage = 1 - s.exception_rate;
  s.padded_table_bytes = p.rows * capr * 8;
}

PackedMatrix EmptyLike(const PackedMatrix& p, int64_t rows, int64_t cols) {
  PackedMatrix s;
  s.rows = rows;
  s.cols = cols;
  s.base = p.base;
  s.tl = p.tl;
  s.th = p.th;
  return s;
}

}  // namespace

absl::StatusOr<PackedMatrix> ShardRows(const PackedMatrix& p, int64_t r0, int64_t r1) {
  RETURN_IF_ERROR(ValidatePacked(p));
  if (r0 < 0 || r1 > p.rows || r0 >= r1 || r0 % kRowBlock != 0 || r1 % kRowBlock != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ShardRows: rows [", r0, ", ", r1, ") must be a non-empty range of 16-row blocks inside [0, ",
        p.rows, ")"));
  }
  PackedMatrix s = EmptyLike(p, r1 - r0, p.cols);
  const int64_t block_bytes = p.cols / kColGroup * kGroupBytes;
  const int64_t b0 = r0 / kRowBlock, b1 = r1 / kRowBlock;
  s.weights.assign(p.weights.begin() + b0 * block_bytes, p.weights.begin() + b1 * block_bytes);
  const uint32_t e0 = p.row_offsets[r0], e1 = p.row_offsets[r1];
  s.entries.assign(p.entries.begin() + e0, p.entries.begin() + e1);
  s.row_offsets.reserve(s.rows + 1);
  for (int64_t r = r0; r <= r1; ++r) s.row_offsets.push_back(p.row_offsets[r] - e0);
  const uint32_t d0 = p.dense_block_offsets[b0], d1 = p.dense_block_offsets[b1];
  for (int64_t b = b0; b <= b1; ++b) s.dense_block_offsets.push_back(p.dense_block_offsets[b] - d0);
  s.dense_rows.assign(p.dense_rows.begin() + d0, p.dense_rows.begin() + d1);
  s.dense_values.assign(p.dense_values.begin() + static_cast<int64_t>(d0) * p.cols,
                        p.dense_values.begin() + static_cast<int64_t>(d1) * p.cols);
  RecomputeStats(s);
  return s;
}

absl::StatusOr<PackedMatrix> ShardCols(const PackedMatrix& p, int64_t c0, int64_t c1) {
  RETURN_IF_ERROR(ValidatePacked(p));
  if (c0 < 0 || c1 > p.cols || c0 >= c1 || c0 % kColGroup != 0 || c1 % kColGroup != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ShardCols: columns [", c0, ", ", c1,
        ") must be a non-empty range of 64-wide groups inside [0, ", p.cols, ")"));
  }
  PackedMatrix s = EmptyLike(p, p.rows, c1 - c0);
  const int64_t groups = p.cols / kColGroup, g0 = c0 / kColGroup, g1 = c1 / kColGroup;
  const int64_t nblocks = p.rows / kRowBlock;
  s.weights.resize(static_cast<size_t>(nblocks * (g1 - g0) * kGroupBytes));
  for (int64_t b = 0; b < nblocks; ++b) {
    std::memcpy(s.weights.data() + b * (g1 - g0) * kGroupBytes,
                p.weights.data() + (b * groups + g0) * kGroupBytes, (g1 - g0) * kGroupBytes);
  }
  s.row_offsets.reserve(p.rows + 1);
  s.row_offsets.push_back(0);
  for (int64_t r = 0; r < p.rows; ++r) {
    for (uint32_t e = p.row_offsets[r]; e < p.row_offsets[r + 1]; ++e) {
      const int32_t c = p.entries[e].col;
      if (c >= c0 && c < c1) {
        s.entries.push_back(ExceptionEntry{static_cast<int32_t>(c - c0), p.entries[e].value_bits});
      }
    }
    s.row_offsets.push_back(static_cast<uint32_t>(s.entries.size()));
  }
  s.dense_block_offsets = p.dense_block_offsets;
  s.dense_rows = p.dense_rows;
  s.dense_values.reserve(p.dense_rows.size() * s.cols);
  for (size_t d = 0; d < p.dense_rows.size(); ++d) {
    const auto* row = p.dense_values.data() + d * p.cols;
    s.dense_values.insert(s.dense_values.end(), row + c0, row + c1);
  }
  RecomputeStats(s);
  return s;
}

absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> SplitRanges(int64_t extent, int64_t unit,
                                                                     int parts) {
  if (unit < 1) return absl::InvalidArgumentError(absl::StrCat("SplitRanges: unit ", unit, " < 1"));
  if (parts < 1) {
    return absl::InvalidArgumentError(absl::StrCat("SplitRanges: parts ", parts, " < 1"));
  }
  if (extent < 0 || extent % unit != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("SplitRanges: extent ", extent, " is not a whole number of units of ", unit));
  }
  const int64_t units = extent / unit;
  if (units < parts) {
    return absl::InvalidArgumentError(absl::StrCat("SplitRanges: cannot split ", units,
                                                   " units of ", unit, " into ", parts, " parts"));
  }
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t at = 0;
  for (int i = 0; i < parts; ++i) {
    const int64_t n = units / parts + (i < units % parts ? 1 : 0);
    out.emplace_back(at * unit, (at + n) * unit);
    at += n;
  }
  return out;
}

namespace {

// Splits `extent` (rows or columns) into `parts` shards of whole `unit`s, each made by `shard`.
template <typename ShardFn>
absl::StatusOr<std::vector<PackedMatrix>> Split(const PackedMatrix& p, int parts, int64_t extent,
                                                int64_t unit, const char* what, ShardFn shard) {
  if (parts < 1 || extent / unit < parts) {
    return absl::InvalidArgumentError(absl::StrCat("cannot split ", extent / unit, " ", what,
                                                   " into ", parts, " shards"));
  }
  ASSIGN_OR_RETURN(const auto ranges, SplitRanges(extent, unit, parts));
  std::vector<PackedMatrix> out;
  for (auto [b, e] : ranges) {
    ASSIGN_OR_RETURN(PackedMatrix s, shard(p, b, e));
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<PackedMatrix>> SplitRows(const PackedMatrix& p, int parts) {
  return Split(p, parts, p.rows, kRowBlock, "row blocks", ShardRows);
}

absl::StatusOr<std::vector<PackedMatrix>> SplitCols(const PackedMatrix& p, int parts) {
  return Split(p, parts, p.cols, kColGroup, "column groups", ShardCols);
}

}  // namespace gemvz
