// How one PackedMatrix lives inside a safetensors file: six "<name>.z12.<part>" tensors plus a
// "gemvz.z12.<name>" metadata entry (shape, window, CRC32C per part, stats). Shared by the packing
// driver (writing) and PackedCheckpoint (reading). docs/CHECKPOINTS.md describes the layout.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gemvz/format.h"
#include "runtime/checkpoint/safetensors.h"

namespace gemvz::internal {

inline constexpr char kMetaFormatKey[] = "gemvz.format";
inline constexpr char kMetaFormatValue[] = "gemvz-z12-checkpoint";
inline constexpr char kMetaVersionKey[] = "gemvz.version";
inline constexpr char kMetaTensorPrefix[] = "gemvz.z12.";

inline constexpr int kPackedParts = 6;
struct PackedPartSpec {
  const char* suffix;  // appended to "<name>.z12."
  const char* dtype;
};
inline constexpr PackedPartSpec kPackedPartSpecs[kPackedParts] = {
    {"weights", "U8"},    {"row_offsets", "U32"},
    {"entries", "I32"},   {"dense_block_offsets", "U32"},
    {"dense_rows", "U8"}, {"dense_values", "BF16"},
};

std::string PackedPartName(const std::string& tensor, int part);

// What the metadata entry of a packed tensor records.
struct PackedTensorMeta {
  int64_t rows = 0;
  int64_t cols = 0;
  int base = 0;
  uint32_t tl = 0;
  uint32_t th = 0;
  std::array<uint32_t, kPackedParts> crc{};
  PackStats stats;
};

std::string EncodePackedTensorMeta(const PackedTensorMeta& meta);
absl::StatusOr<PackedTensorMeta> DecodePackedTensorMeta(const std::string& json);

// The six part entries of a packed [rows, cols] tensor with every unknown number (offsets, entry
// and dense-row counts) at its longest, and a metadata value at its longest: together an upper
// bound on what the tensor adds to a header.
std::vector<SafetensorsEntry> PlaceholderPackedEntries(const std::string& tensor, int64_t rows,
                                                       int64_t cols);
std::string PlaceholderPackedMeta(int64_t rows, int64_t cols);

// Whether a tensor of `bytes` bytes is written after every tensor whose size is a multiple of 8,
// those last in order of element size, largest first: written in place it would leave the tensors
// after it off their alignment (a U8 part of odd length before a BF16 or F32 one). So every
// tensor of a file gemvz writes starts at a multiple of its element size, as the reference
// writer's files do (it sorts by dtype).
inline bool WritesLast(uint64_t bytes) { return bytes % 8 != 0; }

// A part left for the end of the file (WritesLast), with its own copy of the bytes.
struct DeferredPart {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

// Writes the six parts of `packed` and returns its metadata (CRCs included); the caller stores it
// under kMetaTensorPrefix + name. Parts that WritesLast are appended to `later` for the caller to
// write after the file's other tensors.
absl::StatusOr<PackedTensorMeta> WritePackedTensor(SafetensorsWriter& writer,
                                                   const std::string& tensor,
                                                   const PackedMatrix& packed,
                                                   std::vector<DeferredPart>& later);

// Checks that the six parts exist with the dtypes and shapes `meta` implies (no data is read).
absl::Status CheckPackedParts(const SafetensorsFile& file, const std::string& tensor,
                              const PackedTensorMeta& meta);
// Reads a packed tensor back: parts copied out of the mapping, CRC32C-checked, ValidatePacked.
absl::StatusOr<PackedMatrix> ReadPackedTensor(const SafetensorsFile& file,
                                              const std::string& tensor,
                                              const PackedTensorMeta& meta);

// Rows [row_begin, row_end) (multiples of 16) of `p` as a matrix of their own, for unpacking a
// large matrix piece by piece.
PackedMatrix SlicePackedRows(const PackedMatrix& p, int64_t row_begin, int64_t row_end);

}  // namespace gemvz::internal
