// Invariant checks for PackedMatrix and its versioned, checksummed file format (Save/Load and
// their in-memory twins Serialize/Deserialize). The layout is written down in kHeaderBytes below.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gemvz/format.h"
#include "runtime/common/file_util.h"
#include "runtime/common/hash.h"
#include "runtime/common/status_macros.h"
#include "runtime/format/z12_layout.h"

namespace gemvz {
namespace {

// Sections are written as the host's memory; only little-endian hosts are supported.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "gemvz files are little-endian");
static_assert(sizeof(ExceptionEntry) == 8 && std::is_trivially_copyable_v<ExceptionEntry>,
              "ExceptionEntry is written as 8 raw bytes (col, value_bits)");

// File layout, version 1 (little-endian; the header is fixed-size and checksummed on its own so a
// corrupt length can never drive an allocation):
//   0   magic "GEMVZ12\n" (8)      | 8  version u32 | 12 header bytes u32 (= kHeaderBytes)
//   16  rows i64 | 24 cols i64 | 32 base i32 | 36 tl u32 | 40 th u32 | 44 section count u32 (= 6)
//   48  6 section records of 24 bytes: id u32, element size u32, count u64, crc32c u32, 0 u32
//   192 stats: weights, outside_window, sparse_entries, residual_entries, dense_rows, total_bytes,
//       padded_table_bytes (i64 each), bits_per_weight, exception_rate, window_coverage (f64 bits)
//   272 crc32c of bytes [0, 272)
//   276 section data, back to back in record order, nothing after the last one.
constexpr char kMagic[8] = {'G', 'E', 'M', 'V', 'Z', '1', '2', '\n'};
constexpr uint32_t kVersion = 1;
constexpr size_t kPreambleBytes = 16;  // magic, version, header size: readable by every version
constexpr size_t kSectionCount = 6;
constexpr size_t kSectionRecordBytes = 24;
constexpr size_t kSectionTableOffset = 48;
constexpr size_t kStatsOffset = kSectionTableOffset + kSectionCount * kSectionRecordBytes;
constexpr size_t kHeaderCrcOffset = kStatsOffset + 80;
constexpr size_t kHeaderBytes = kHeaderCrcOffset + 4;

struct SectionSpec {
  uint32_t id;
  uint32_t element_size;
  const char* name;
};
constexpr SectionSpec kSections[kSectionCount] = {
    {1, 1, "weights"},    {2, 4, "row_offsets"},  {3, 8, "entries"}, {4, 4, "dense_block_offsets"},
    {5, 1, "dense_rows"}, {6, 2, "dense_values"},
};

// Raw byte views of the six vectors, in file order.
struct ConstSection {
  const void* data;
  uint64_t count;
};
std::array<ConstSection, kSectionCount> SectionsOf(const PackedMatrix& p) {
  return {{{p.weights.data(), p.weights.size()},
           {p.row_offsets.data(), p.row_offsets.size()},
           {p.entries.data(), p.entries.size()},
           {p.dense_block_offsets.data(), p.dense_block_offsets.size()},
           {p.dense_rows.data(), p.dense_rows.size()},
           {p.dense_values.data(), p.dense_values.size()}}};
}

template <typename T>
void Put(uint8_t* dst, size_t offset, T value) {
  static_assert(std::is_trivially_copyable_v<T>);
  std::memcpy(dst + offset, &value, sizeof(T));
}
template <typename T>
T Get(const uint8_t* src, size_t offset) {
  T value;
  std::memcpy(&value, src + offset, sizeof(T));
  return value;
}
uint64_t DoubleBits(double d) {
  uint64_t u;
  std::memcpy(&u, &d, 8);
  return u;
}
double BitsDouble(uint64_t u) {
  double d;
  std::memcpy(&d, &u, 8);
  return d;
}

using Sink = std::function<absl::Status(const void*, size_t)>;

// Writes header then sections through `sink`, straight from the matrix's own vectors.
absl::Status WritePacked(const PackedMatrix& p, const Sink& sink) {
  uint8_t h[kHeaderBytes] = {};
  std::memcpy(h, kMagic, 8);
  Put<uint32_t>(h, 8, kVersion);
  Put<uint32_t>(h, 12, static_cast<uint32_t>(kHeaderBytes));
  Put<int64_t>(h, 16, p.rows);
  Put<int64_t>(h, 24, p.cols);
  Put<int32_t>(h, 32, p.base);
  Put<uint32_t>(h, 36, p.tl);
  Put<uint32_t>(h, 40, p.th);
  Put<uint32_t>(h, 44, static_cast<uint32_t>(kSectionCount));
  const auto sections = SectionsOf(p);
  for (size_t i = 0; i < kSectionCount; ++i) {
    const size_t o = kSectionTableOffset + i * kSectionRecordBytes;
    const size_t bytes = sections[i].count * kSections[i].element_size;
    Put<uint32_t>(h, o, kSections[i].id);
    Put<uint32_t>(h, o + 4, kSections[i].element_size);
    Put<uint64_t>(h, o + 8, sections[i].count);
    Put<uint32_t>(h, o + 16, internal::Crc32c(sections[i].data, bytes));
  }
  const PackStats& s = p.stats;
  const int64_t ints[7] = {s.weights,    s.outside_window, s.sparse_entries,    s.residual_entries,
                           s.dense_rows, s.total_bytes,    s.padded_table_bytes};
  for (int i = 0; i < 7; ++i) Put<int64_t>(h, kStatsOffset + 8 * i, ints[i]);
  Put<uint64_t>(h, kStatsOffset + 56, DoubleBits(s.bits_per_weight));
  Put<uint64_t>(h, kStatsOffset + 64, DoubleBits(s.exception_rate));
  Put<uint64_t>(h, kStatsOffset + 72, DoubleBits(s.window_coverage));
  Put<uint32_t>(h, kHeaderCrcOffset, internal::Crc32c(h, kHeaderCrcOffset));

  RETURN_IF_ERROR(sink(h, kHeaderBytes));
  for (size_t i = 0; i < kSectionCount; ++i) {
    const size_t bytes = sections[i].count * kSections[i].element_size;
    if (bytes > 0) RETURN_IF_ERROR(sink(sections[i].data, bytes));
  }
  return absl::OkStatus();
}

// Where the bytes come from: a memory buffer or an open file. Reads are bounds-checked by the
// parser before they are issued.
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  virtual uint64_t size() const = 0;
  virtual absl::Status Read(uint64_t offset, void* dst, size_t n) = 0;
};

class MemorySource : public ByteSource {
 public:
  MemorySource(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint64_t size() const override { return size_; }
  absl::Status Read(uint64_t offset, void* dst, size_t n) override {
    if (n > 0) std::memcpy(dst, data_ + offset, n);
    return absl::OkStatus();
  }

 private:
  const uint8_t* data_;
  size_t size_;
};

class FileSource : public ByteSource {
 public:
  FileSource(int fd, uint64_t size, std::string path)
      : fd_(fd), size_(size), path_(std::move(path)) {}
  ~FileSource() override { ::close(fd_); }
  uint64_t size() const override { return size_; }
  absl::Status Read(uint64_t offset, void* dst, size_t n) override {
    char* p = static_cast<char*>(dst);
    while (n > 0) {
      // Bounded chunks: some kernels cap a single pread at 2 GiB.
      const ssize_t got =
          ::pread(fd_, p, std::min<size_t>(n, size_t{1} << 30), static_cast<off_t>(offset));
      if (got < 0) {
        if (errno == EINTR) continue;
        return absl::DataLossError(absl::StrCat("read error: ", std::strerror(errno)));
      }
      if (got == 0) return absl::DataLossError("the file shrank while being read");
      p += got;
      offset += static_cast<uint64_t>(got);
      n -= static_cast<size_t>(got);
    }
    return absl::OkStatus();
  }

 private:
  int fd_;
  uint64_t size_;
  std::string path_;
};

template <typename T>
absl::Status ReadSection(ByteSource& src, uint64_t offset, uint64_t count, uint32_t crc,
                         const char* name, std::vector<T>& out) {
  // Lengths were checked against the source size before this is called.
  out.resize(static_cast<size_t>(count));
  const size_t bytes = static_cast<size_t>(count) * sizeof(T);
  RETURN_IF_ERROR(src.Read(offset, out.data(), bytes));
  const uint32_t actual = internal::Crc32c(out.data(), bytes);
  if (actual != crc) {
    return absl::DataLossError(absl::StrFormat(
        "section '%s' (%d bytes at offset %d) fails its checksum (stored crc32c %08x, computed "
        "%08x): the file is corrupt",
        name, bytes, offset, crc, actual));
  }
  return absl::OkStatus();
}

absl::StatusOr<PackedMatrix> ParsePacked(ByteSource& src) {
  const uint64_t size = src.size();
  // Preamble: the part every version shares, so a newer file is recognised as such.
  if (size < kPreambleBytes) {
    return absl::DataLossError(absl::StrCat("truncated: ", size, " bytes, smaller than the ",
                                            kPreambleBytes, "-byte preamble"));
  }
  uint8_t h[kHeaderBytes];
  RETURN_IF_ERROR(src.Read(0, h, kPreambleBytes));
  if (std::memcmp(h, kMagic, 8) != 0) {
    return absl::InvalidArgumentError(
        "not a gemvz packed-matrix file (bad magic; expected \"GEMVZ12\\n\")");
  }
  const uint32_t version = Get<uint32_t>(h, 8);
  if (version > kVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "format version ", version, " is newer than this build of gemvz reads (version ", kVersion,
        "); upgrade gemvz, or repack the matrix with this version"));
  }
  if (version != kVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "unsupported format version ", version, " (this build reads version ", kVersion, ")"));
  }
  const uint32_t header_bytes = Get<uint32_t>(h, 12);
  if (header_bytes != kHeaderBytes) {
    return absl::DataLossError(absl::StrCat("corrupt header: header size ", header_bytes,
                                            ", version 1 headers are ", kHeaderBytes, " bytes"));
  }
  if (size < kHeaderBytes) {
    return absl::DataLossError(absl::StrCat("truncated: ", size, " bytes, smaller than the ",
                                            kHeaderBytes, "-byte header"));
  }
  RETURN_IF_ERROR(src.Read(kPreambleBytes, h + kPreambleBytes, kHeaderBytes - kPreambleBytes));
  const uint32_t stored_crc = Get<uint32_t>(h, kHeaderCrcOffset);
  const uint32_t header_crc = internal::Crc32c(h, kHeaderCrcOffset);
  if (stored_crc != header_crc) {
    return absl::DataLossError(absl::StrFormat(
        "header fails its checksum (stored crc32c %08x, computed %08x): the file is corrupt",
        stored_crc, header_crc));
  }

  PackedMatrix p;
  p.rows = Get<int64_t>(h, 16);
  p.cols = Get<int64_t>(h, 24);
  p.base = Get<int32_t>(h, 32);
  p.tl = Get<uint32_t>(h, 36);
  p.th = Get<uint32_t>(h, 40);
  if (Get<uint32_t>(h, 44) != kSectionCount) {
    return absl::DataLossError(absl::StrCat("corrupt header: ", Get<uint32_t>(h, 44),
                                            " sections, version 1 has ", kSectionCount));
  }

  // Every length against the bytes that are really there, before anything is allocated.
  uint64_t counts[kSectionCount], crcs[kSectionCount];
  uint64_t remaining = size - kHeaderBytes;
  for (size_t i = 0; i < kSectionCount; ++i) {
    const size_t o = kSectionTableOffset + i * kSectionRecordBytes;
    const SectionSpec& spec = kSections[i];
    if (Get<uint32_t>(h, o) != spec.id || Get<uint32_t>(h, o + 4) != spec.element_size ||
        Get<uint32_t>(h, o + 20) != 0) {
      return absl::DataLossError(absl::StrCat("corrupt header: section record ", i, " is not the '",
                                              spec.name, "' section"));
    }
    counts[i] = Get<uint64_t>(h, o + 8);
    crcs[i] = Get<uint32_t>(h, o + 16);
    if (counts[i] > remaining / spec.element_size) {
      return absl::DataLossError(absl::StrCat(
          "truncated: section '", spec.name, "' needs ", counts[i], " x ", spec.element_size,
          " bytes but only ", remaining, " bytes remain in the file"));
    }
    remaining -= counts[i] * spec.element_size;
  }
  if (remaining != 0) {
    return absl::DataLossError(
        absl::StrCat("corrupt file: ", remaining, " unexpected bytes after the last section"));
  }

  PackStats& s = p.stats;
  int64_t* ints[7] = {&s.weights,    &s.outside_window, &s.sparse_entries,    &s.residual_entries,
                      &s.dense_rows, &s.total_bytes,    &s.padded_table_bytes};
  for (int i = 0; i < 7; ++i) *ints[i] = Get<int64_t>(h, kStatsOffset + 8 * i);
  s.bits_per_weight = BitsDouble(Get<uint64_t>(h, kStatsOffset + 56));
  s.exception_rate = BitsDouble(Get<uint64_t>(h, kStatsOffset + 64));
  s.window_coverage = BitsDouble(Get<uint64_t>(h, kStatsOffset + 72));

  uint64_t offset = kHeaderBytes;
  auto next = [&](size_t i) {
    const uint64_t at = offset;
    offset += counts[i] * kSections[i].element_size;
    return at;
  };
  RETURN_IF_ERROR(ReadSection(src, next(0), counts[0], crcs[0], kSections[0].name, p.weights));
  RETURN_IF_ERROR(ReadSection(src, next(1), counts[1], crcs[1], kSections[1].name, p.row_offsets));
  RETURN_IF_ERROR(ReadSection(src, next(2), counts[2], crcs[2], kSections[2].name, p.entries));
  RETURN_IF_ERROR(
      ReadSection(src, next(3), counts[3], crcs[3], kSections[3].name, p.dense_block_offsets));
  RETURN_IF_ERROR(ReadSection(src, next(4), counts[4], crcs[4], kSections[4].name, p.dense_rows));
  RETURN_IF_ERROR(ReadSection(src, next(5), counts[5], crcs[5], kSections[5].name, p.dense_values));

  if (absl::Status st = ValidatePacked(p); !st.ok()) {
    return absl::Status(st.code(),
                        absl::StrCat("checksums match but the matrix is invalid: ", st.message()));
  }
  return p;
}

absl::Status Annotate(const absl::Status& st, const std::string& what) {
  return absl::Status(st.code(), absl::StrCat(what, ": ", st.message()));
}

inline bool FiniteFloatBits(uint32_t u) { return (u & 0x7F800000u) != 0x7F800000u; }
inline bool FiniteBf16Bits(uint16_t u) { return (u & 0x7F80u) != 0x7F80u; }

// Where weight (r, c) of a 16 x 64 group lives: the inverse of internal::GroupSlots.
struct WeightSlot {
  uint8_t f, lane, i;
};
using WeightSlotTable = std::array<std::array<WeightSlot, kColGroup>, kRowBlock>;
const WeightSlotTable& WeightSlots() {
  static const WeightSlotTable table = [] {
    WeightSlotTable t{};
    const auto& slots = internal::GroupSlots();
    for (int f = 0; f < 4; ++f) {
      for (int lane = 0; lane < 32; ++lane) {
        for (int i = 0; i < 8; ++i) {
          const internal::GroupSlot s = slots[f][lane][i];
          t[s.row][s.col] = WeightSlot{static_cast<uint8_t>(f), static_cast<uint8_t>(lane),
                                       static_cast<uint8_t>(i)};
        }
      }
    }
    return t;
  }();
  return table;
}

// The BF16 bits the decoder produces for weight (row, col) of a matrix whose sizes are checked.
uint16_t DecodedWeight(const PackedMatrix& p, int64_t row, int64_t col) {
  const uint8_t* grp =
      p.weights.data() + ((row / kRowBlock) * (p.cols / kColGroup) + col / kColGroup) * kGroupBytes;
  const WeightSlot s = WeightSlots()[row % kRowBlock][col % kColGroup];
  uint32_t q;
  std::memcpy(&q, grp + internal::CodeWordOffset(s.f, s.lane), 4);
  return internal::DecodedBits(grp, q, p.base, s.f, s.lane, s.i);
}

}  // namespace

// NOTES: a correction whose value is zero (+0.0 or -0.0) is refused: Pack never emits one (a weight
// outside the window always differs from its decoded value), the kernel would spend work on it,
// and refusing it catches corrupted tables. Stats are informational and not checked here.
absl::Status ValidatePacked(const PackedMatrix& p) {
  RETURN_IF_ERROR(CheckPackableShape(p.rows, p.cols));
  const int64_t rows = p.rows, cols = p.cols, nblocks = rows / kRowBlock;
  auto invalid = [&](auto&&... parts) {
    return absl::InvalidArgumentError(
        absl::StrCat("packed [", rows, ", ", cols, "] matrix: ", parts...));
  };

  // Window.
  if (p.base < 0 || p.base > 120) {
    return invalid("window base ", p.base, " outside 0..120 (base + 7 must be a 7-bit e7)");
  }
  const uint32_t b = static_cast<uint32_t>(p.base);
  const uint32_t tl = b | (b + 1) << 8 | (b + 2) << 16 | (b + 3) << 24;
  const uint32_t th = (b + 4) | (b + 5) << 8 | (b + 6) << 16 | (b + 7) << 24;
  if (p.tl != tl || p.th != th) {
    return invalid(
        absl::StrFormat("window words tl=%08x th=%08x do not hold base %d..%d "
                        "(expected tl=%08x th=%08x)",
                        p.tl, p.th, p.base, p.base + 7, tl, th));
  }

  // Packed groups.
  const uint64_t weight_bytes =
      static_cast<uint64_t>(nblocks) * static_cast<uint64_t>(cols / kColGroup) * kGroupBytes;
  if (p.weights.size() != weight_bytes) {
    return invalid("weights hold ", p.weights.size(),
                   " bytes, expected rows/16 * cols/64 * 1536 = ", weight_bytes);
  }

  // Sparse corrections (CSR).
  if (p.row_offsets.size() != static_cast<uint64_t>(rows) + 1) {
    return invalid("row_offsets has ", p.row_offsets.size(),
                   " entries, expected rows + 1 = ", rows + 1);
  }
  if (p.row_offsets[0] != 0) return invalid("row_offsets[0] is ", p.row_offsets[0], ", not 0");
  if (p.row_offsets.back() != p.entries.size()) {
    return invalid("row_offsets ends at ", p.row_offsets.back(), " but there are ",
                   p.entries.size(), " entries");
  }
  // Offsets first, all of them: with them monotonic and ending at the size, every range below
  // stays inside its vector.
  for (int64_t r = 0; r < rows; ++r) {
    if (p.row_offsets[r + 1] < p.row_offsets[r]) {
      return invalid("row_offsets decreases at row ", r, " (", p.row_offsets[r], " then ",
                     p.row_offsets[r + 1], ")");
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const uint32_t e0 = p.row_offsets[r], e1 = p.row_offsets[r + 1];
    int32_t prev_col = -1;
    int same_col = 0;
    for (uint32_t e = e0; e < e1; ++e) {
      const ExceptionEntry& x = p.entries[e];
      if (x.col < 0 || x.col >= cols) {
        return invalid("entry ", e, " of row ", r, " has col ", x.col, " outside [0, ", cols, ")");
      }
      if (x.col < prev_col) {
        return invalid("entries of row ", r, " are not sorted by col (", prev_col, " then ", x.col,
                       " at entry ", e, ")");
      }
      same_col = (x.col == prev_col) ? same_col + 1 : 1;
      if (same_col > 2) {
        return invalid("row ", r, " col ", x.col, " has more than two correction entries");
      }
      if (!FiniteFloatBits(x.value_bits)) {
        return invalid(
            absl::StrFormat("entry %d (row %d, col %d) has a non-finite value "
                            "(FP32 bits %08x)",
                            e, r, x.col, x.value_bits));
      }
      if ((x.value_bits & 0x7FFFFFFFu) == 0) {
        return invalid("entry ", e, " (row ", r, ", col ", x.col,
                       ") has a zero value; corrections are never zero");
      }
      prev_col = x.col;
    }
  }

  // Dense rows.
  if (p.dense_block_offsets.size() != static_cast<uint64_t>(nblocks) + 1) {
    return invalid("dense_block_offsets has ", p.dense_block_offsets.size(),
                   " entries, expected rows/16 + 1 = ", nblocks + 1);
  }
  if (p.dense_block_offsets[0] != 0) {
    return invalid("dense_block_offsets[0] is ", p.dense_block_offsets[0], ", not 0");
  }
  if (p.dense_block_offsets.back() != p.dense_rows.size()) {
    return invalid("dense_block_offsets ends at ", p.dense_block_offsets.back(), " but there are ",
                   p.dense_rows.size(), " dense rows");
  }
  for (int64_t rb = 0; rb < nblocks; ++rb) {
    if (p.dense_block_offsets[rb + 1] < p.dense_block_offsets[rb]) {
      return invalid("dense_block_offsets decreases at block ", rb, " (", p.dense_block_offsets[rb],
                     " then ", p.dense_block_offsets[rb + 1], ")");
    }
  }
  for (int64_t rb = 0; rb < nblocks; ++rb) {
    const uint32_t d0 = p.dense_block_offsets[rb], d1 = p.dense_block_offsets[rb + 1];
    if (d1 - d0 > kRowBlock) {
      return invalid("block ", rb, " claims ", d1 - d0, " dense rows, more than 16");
    }
    int prev = -1;
    for (uint32_t d = d0; d < d1; ++d) {
      const int r = p.dense_rows[d];
      if (r >= kRowBlock) {
        return invalid("dense row ", d, " of block ", rb, " is row ", r, ", outside 0..15");
      }
      if (r <= prev) {
        return invalid("dense rows of block ", rb, " are not strictly increasing (", prev, " then ",
                       r, ")");
      }
      prev = r;
      const int64_t row = rb * kRowBlock + r;
      if (p.row_offsets[row] != p.row_offsets[row + 1]) {
        return invalid("row ", row, " is dense but also has ",
                       p.row_offsets[row + 1] - p.row_offsets[row], " sparse entries");
      }
    }
  }
  if (p.dense_values.size() != static_cast<uint64_t>(p.dense_rows.size()) * cols) {
    return invalid("dense_values has ", p.dense_values.size(), " values, expected dense rows (",
                   p.dense_rows.size(), ") * cols = ", p.dense_rows.size() * cols);
  }
  for (size_t i = 0; i < p.dense_values.size(); ++i) {
    if (!FiniteBf16Bits(p.dense_values[i])) {
      return invalid(absl::StrFormat("dense row %d col %d holds a non-finite BF16 (bits %04x)",
                                     i / cols, i % cols, p.dense_values[i]));
    }
  }

  // A decoded weight is Inf or NaN only at e7 127 with a low byte of 0x80 or more (all eight
  // exponent bits set): code 7 of window base 120. Pack never writes one; in a sparse row the
  // kernel multiplies it and Unpack returns it (no correction makes it finite), in a dense row
  // both ignore it.
  if (p.base + 7 == 127) {
    std::vector<bool> dense(static_cast<size_t>(rows), false);
    for (int64_t rb = 0; rb < nblocks; ++rb) {
      for (uint32_t d = p.dense_block_offsets[rb]; d < p.dense_block_offsets[rb + 1]; ++d) {
        dense[rb * kRowBlock + p.dense_rows[d]] = true;
      }
    }
    const int64_t ngroups = cols / kColGroup;
    for (int64_t g = 0; g < nblocks * ngroups; ++g) {
      absl::Status st;  // the group's first such weight
      internal::ForEachDecodedWeight(
          p.weights.data() + g * kGroupBytes, p.base, [&](internal::GroupSlot s, uint16_t bits) {
            if (!st.ok() || FiniteBf16Bits(bits)) return;
            const int64_t row = g / ngroups * kRowBlock + s.row;
            const int64_t col = g % ngroups * kColGroup + s.col;
            if (dense[row]) return;
            st = invalid(absl::StrFormat(
                "row %d col %d decodes to a non-finite BF16 (bits %04x: window base 120's top "
                "value with a low byte of 0x80 or more) in a row that is not dense",
                row, col, bits));
          });
      RETURN_IF_ERROR(st);
    }
  }

  // Each corrected weight as Unpack restores it: finite corrections can still sum past FP32's
  // range with the decoded value (two entries of FLT_MAX), and then the matrix holds an Inf weight,
  // which Pack never writes, and the kernel adds value * x to a row that it should not.
  for (int64_t r = 0; r < rows; ++r) {
    absl::Status st;
    internal::ForEachCorrectedWeight(p, r, [&](int32_t c, const uint32_t* vals, int n) {
      const uint16_t dec = DecodedWeight(p, r, c);
      const uint16_t w = internal::RestoredWeight(dec, vals, n);
      if (st.ok() && !FiniteBf16Bits(w)) {
        st = invalid(absl::StrFormat(
            "row %d col %d: its %d correction entries restore a non-finite weight (BF16 bits "
            "%04x from decoded %04x); a weight and its corrections must restore a finite BF16",
            r, c, n, w, dec));
      }
    });
    RETURN_IF_ERROR(st);
  }
  return absl::OkStatus();
}

std::vector<uint8_t> Serialize(const PackedMatrix& packed) {
  std::vector<uint8_t> out;
  size_t total = kHeaderBytes;
  for (size_t i = 0; i < kSectionCount; ++i) {
    total += SectionsOf(packed)[i].count * kSections[i].element_size;
  }
  out.reserve(total);
  WritePacked(packed, [&](const void* data, size_t n) {
    const uint8_t* p = static_cast<const uint8_t*>(data);
    out.insert(out.end(), p, p + n);
    return absl::OkStatus();
  }).IgnoreError();  // the sink cannot fail
  return out;
}

absl::StatusOr<PackedMatrix> Deserialize(const uint8_t* data, size_t size) {
  if (data == nullptr && size > 0) {
    return absl::InvalidArgumentError("cannot deserialize a packed matrix: null buffer");
  }
  static const uint8_t kEmpty = 0;
  MemorySource src(data != nullptr ? data : &kEmpty, size);
  absl::StatusOr<PackedMatrix> p = ParsePacked(src);
  if (!p.ok()) return Annotate(p.status(), "cannot deserialize a packed matrix");
  return p;
}

absl::Status Save(const PackedMatrix& packed, const std::string& path) {
  const std::string what = absl::StrCat("cannot save packed matrix to '", path, "'");
  if (absl::Status st = ValidatePacked(packed); !st.ok()) return Annotate(st, what);
  absl::Status st = internal::AtomicWriteFileStreamed(
      path, [&](const std::function<absl::Status(const void*, size_t)>& sink) {
        return WritePacked(packed, sink);
      });
  if (!st.ok()) return Annotate(st, what);
  return absl::OkStatus();
}

absl::StatusOr<PackedMatrix> Load(const std::string& path) {
  const std::string what = absl::StrCat("cannot load packed matrix '", path, "'");
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer (fstat refuses it).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int e = errno;
    const std::string msg = absl::StrCat(what, ": ", std::strerror(e));
    if (e == ENOENT) return absl::NotFoundError(msg);
    if (e == EACCES || e == EPERM) return absl::PermissionDeniedError(msg);
    return absl::InternalError(msg);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(what, ": not a regular file"));
  }
  FileSource src(fd, static_cast<uint64_t>(st.st_size), path);
  absl::StatusOr<PackedMatrix> p = ParsePacked(src);
  if (!p.ok()) return Annotate(p.status(), what);
  return p;
}

}  // namespace gemvz
