// Tensor-parallel sharding of packed matrices, without re-packing: output-parallel shards take
// 16-row blocks, input-parallel shards take 64-wide column ranges; each shard carries its own
// corrections and dense rows and shares the parent's window.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "gemvz/format.h"

namespace gemvz {

// Rows [row_begin, row_end) of `packed`; both multiples of 16. Its GEMV output is that slice of
// the parent's output.
absl::StatusOr<PackedMatrix> ShardRows(const PackedMatrix& packed, int64_t row_begin,
                                       int64_t row_end);

// Columns [col_begin, col_end) of `packed`; both multiples of 64. Its GEMV over x[:, cols] is a
// partial output; the parent's output is the sum of all shards' partials (GemvFp32 gives them
// unrounded, for the caller's all-reduce).
absl::StatusOr<PackedMatrix> ShardCols(const PackedMatrix& packed, int64_t col_begin,
                                       int64_t col_end);

// Splits into `parts` contiguous shards as even as the 16-row / 64-column units allow (the first
// shards take the remainder). Refused when there are fewer units than parts.
absl::StatusOr<std::vector<PackedMatrix>> SplitRows(const PackedMatrix& packed, int parts);
absl::StatusOr<std::vector<PackedMatrix>> SplitCols(const PackedMatrix& packed, int parts);

// The [begin, end) ranges SplitRows / SplitCols use: `extent` (a whole number of `unit`s) in
// `parts` contiguous ranges of whole units, the first ones taking the remainder. InvalidArgument
// when unit or parts is below 1, extent is not a multiple of unit, or there are fewer units than
// parts.
absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> SplitRanges(int64_t extent, int64_t unit,
                                                                     int parts);

}  // namespace gemvz
