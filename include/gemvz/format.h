// The lossless 12-bit weight format ("z12"): packing BF16 matrices, restoring them bit for bit,
// and saving them to files. Host-only; nothing here needs a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace gemvz {

// Rows are packed in blocks of 16 and columns in groups of 64 (one mma A-fragment quad).
inline constexpr int64_t kRowBlock = 16;
inline constexpr int64_t kColGroup = 64;
// Bytes of one 16 x 64 group: two 512-byte sections of low bytes and one of code/sign words.
inline constexpr int64_t kGroupBytes = 1536;
// A row keeps its corrections as a list up to this many entries (and K/8 weights outside the
// window); above, it is a dense row, computed by a CTA of its own from its BF16 values. In the
// kernel two lanes walk a row's list entry after entry, about 0.12 us an entry at m = 1 and
// 0.2-0.3 us at m = 16 on an H200: one row of 1 % outliers (164 entries at K = 8192) made a
// 13.5 us GEMV take 33 us at m = 1 and 62 us at m = 16, where a dense row costs under 1 %.
inline constexpr int64_t kMaxRowEntries = 16;

// One exact correction for an out-of-window weight: the kernel adds value * x[col] to the row.
// A weight has one entry, or two when FP32 cannot hold the difference in one number.
struct ExceptionEntry {
  int32_t col;          // k
  uint32_t value_bits;  // FP32 bits of the correction
};

struct PackStats {
  int64_t weights = 0;            // N * K
  int64_t outside_window = 0;     // weights whose high byte the window cannot produce
  int64_t sparse_entries = 0;     // correction entries (a weight may need two)
  int64_t residual_entries = 0;   // second entries, needed where FP32 cannot hold the difference
  int64_t dense_rows = 0;         // rows stored whole: > K/8 weights outside or > kMaxRowEntries
  int64_t total_bytes = 0;        // every byte the kernel may read, side tables included
  double bits_per_weight = 0;     // total_bytes * 8 / weights
  double exception_rate = 0;      // outside_window / weights
  double window_coverage = 0;     // 1 - exception_rate
  int64_t padded_table_bytes = 0; // what the seed's [N, capr] layout would have needed
};

// A BF16 [rows, cols] matrix in the 12-bit format. Layout (bit-compatible with seed chapter 7):
//   weights: [rows/16][cols/64][3 sections][32 lanes][16 bytes]. Sections 0 and 1 hold the low
//     bytes of fragments 0-1 and 2-3 in mma A-fragment order; section 2 holds one code/sign word
//     per fragment per lane.
//   Corrections are compact (memory proportional to their number):
//     row_offsets[r] .. row_offsets[r+1] index `entries` for row r (CSR, sorted by col);
//     rows with more than cols/8 out-of-window weights, or more than kMaxRowEntries entries, are
//     "dense": they have no entries, and
//     their original BF16 values are kept in dense_values instead; the kernel computes such a row
//     from them and ignores its decoded weights.
//     dense_block_offsets[b] .. [b+1] index dense_rows / dense_values for row block b.
struct PackedMatrix {
  int64_t rows = 0;  // N
  int64_t cols = 0;  // K
  int base = 0;      // first of the 8 window values of e7 (sign-less top byte of a BF16)
  uint32_t tl = 0;   // window values base..base+3, one per byte (decoder lookup words)
  uint32_t th = 0;   // window values base+4..base+7
  std::vector<uint8_t> weights;
  std::vector<uint32_t> row_offsets;         // rows + 1
  std::vector<ExceptionEntry> entries;
  std::vector<uint32_t> dense_block_offsets; // rows / 16 + 1
  std::vector<uint8_t> dense_rows;           // row within its block, 0..15, sorted
  std::vector<uint16_t> dense_values;        // [dense_rows.size()][cols], original BF16 bits
  PackStats stats;
};

struct PackOptions {
  int threads = 0;  // 0: all hardware threads; at most one a 16-row block and 1024 are used
};

// Checks that a [rows, cols] matrix can be packed: rows % 16 == 0, cols % 64 == 0, both positive,
// at most 2^31 - 16 rows (below 2^31, as one GEMV's N) and 2^30 columns.
absl::Status CheckPackableShape(int64_t rows, int64_t cols);

// Packs BF16 (raw bits, row-major [rows, cols]). Refuses Inf/NaN, naming the first (row, col).
absl::StatusOr<PackedMatrix> Pack(const uint16_t* bf16, int64_t rows, int64_t cols,
                                  const PackOptions& options = {});

// Restores the original BF16 bits, row-major [rows, cols], bit for bit.
absl::Status Unpack(const PackedMatrix& packed, uint16_t* out);
absl::StatusOr<std::vector<uint16_t>> Unpack(const PackedMatrix& packed);

// Checks every internal invariant (sizes, offsets, sorted entries, window words, finite restored
// weights); what Load and the upload path run before trusting a matrix.
absl::Status ValidatePacked(const PackedMatrix& packed);

// File I/O. Save publishes atomically (temporary file, fsync, rename): a failed save never leaves
// a partial file under `path`. Load refuses truncated, corrupted or wrong-version files.
absl::Status Save(const PackedMatrix& packed, const std::string& path);
absl::StatusOr<PackedMatrix> Load(const std::string& path);
// The same as bytes in memory (the file's contents).
std::vector<uint8_t> Serialize(const PackedMatrix& packed);
absl::StatusOr<PackedMatrix> Deserialize(const uint8_t* data, size_t size);

// BF16 helpers on raw bits.
inline float Bf16ToFloat(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
// Round to nearest even, NaN kept quiet.
inline uint16_t FloatToBf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace gemvz
