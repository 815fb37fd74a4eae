// Pack and Unpack of the 12-bit format (seed chapter 7), with compact exception storage.
#include <algorithm>
#include <atomic>
#include <cfenv>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "absl/strings/str_cat.h"
#include "gemvz/format.h"
#include "runtime/common/parallel.h"
#include "runtime/common/status_macros.h"
#include "runtime/format/z12_layout.h"

namespace gemvz {
namespace {

using internal::CodeWordOffset;
using internal::GroupSlots;
using internal::kSignBit;
using internal::LowByteOffset;

inline int E7(uint16_t bits) { return (bits >> 8) & 0x7F; }
inline bool IsFinite(uint16_t bits) { return (bits & 0x7F80) != 0x7F80; }

// The bits the decoder produces for `bits` under window `base`.
inline uint16_t Decoded(uint16_t bits, int base) {
  const int code = std::clamp(E7(bits) - base, 0, 7);
  return static_cast<uint16_t>((bits & 0x8000) | ((base + code) << 8) | (bits & 0xFF));
}

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Reconstructs a weight from its decoded value and its corrections, exactly. Two entries where the
// first is -decoded are the fallback form (decoded cancels exactly, the second is the original).
inline uint16_t Reconstruct(uint16_t dec_bits, const uint32_t* vals, int n, bool sign) {
  const double dec = Bf16ToFloat(dec_bits);
  double v;
  if (n == 2 && BitsFloat(vals[0]) == -dec) {
    v = BitsFloat(vals[1]);
  } else {
    double corr = 0;
    for (int i = 0; i < n; ++i) corr += BitsFloat(vals[i]);  // exact: the sum is a double
    v = dec + corr;  // exact: the result is a BF16 value
  }
  if (v == 0) return sign ? 0x8000 : 0x0000;  // the stored sign restores -0.0
  return FloatToBf16(static_cast<float>(v));
}

// FP32 corrections c with decoded + sum(c) == original exactly: one entry when FP32 holds the
// difference, else the FP32 residual as a second entry (seed 7.3, line 675), else (differences
// wider than a double, e.g. a subnormal far below the window) -decoded and the original.
int Corrections(uint16_t orig, uint16_t dec, uint32_t out[2]) {
  const double a = Bf16ToFloat(orig), b = -static_cast<double>(Bf16ToFloat(dec));
  const double s = a + b;
  const double bb = s - a;
  const double err = (a - (s - bb)) + (b - bb);  // TwoSum: s + err == a + b exactly
  if (err == 0) {
    const float c1 = static_cast<float>(s);
    const double r = s - static_cast<double>(c1);  // exact: the low bits of s
    if (r == 0) {
      out[0] = FloatBits(c1);
      return 1;
    }
    const float c2 = static_cast<float>(r);
    if (static_cast<double>(c2) == r) {
      out[0] = FloatBits(c1);
      out[1] = FloatBits(c2);
      return 2;
    }
  }
  out[0] = FloatBits(static_cast<float>(b));
  out[1] = FloatBits(static_cast<float>(a));
  return 2;
}

// Corrections and reconstruction are exact only in default IEEE arithmetic, and threads inherit
// the caller's modes: under flush-to-zero / denormals-are-zero (torch.set_flush_denormal,
// -ffast-math binaries) a subnormal weight or correction reads as zero; under a directed rounding
// mode TwoSum is not exact. Called in each packing worker (ParallelRanges).
void UseIeeeArithmetic() {
  std::fesetround(FE_TONEAREST);
#if defined(__x86_64__) || defined(__i386__)
  _mm_setcsr(_mm_getcsr() & ~0x8040u);  // FTZ (bit 15) and DAZ (bit 6) off
#elif defined(__aarch64__)
  uint64_t fpcr;
  asm volatile("mrs %0, fpcr" : "=r"(fpcr));
  asm volatile("msr fpcr, %0" : : "r"(fpcr & ~(uint64_t{1} << 24)));  // FZ off
#endif
}

// Default IEEE arithmetic on this thread while it lives (UseIeeeArithmetic); the thread's own
// modes back afterwards, also when an exception passes.
class IeeeArithmetic {
 public:
  IeeeArithmetic() {
    std::fegetenv(&modes_);
    UseIeeeArithmetic();
  }
  ~IeeeArithmetic() { std::fesetenv(&modes_); }
  IeeeArithmetic(const IeeeArithmetic&) = delete;
  IeeeArithmetic& operator=(const IeeeArithmetic&) = delete;

 private:
  std::fenv_t modes_;
};

// Runs fn(begin, end, worker) over [0, n) split into `threads` contiguous ranges (RunWorkers:
// range 0, and any whose thread cannot start, on the calling thread), each in IEEE arithmetic.
template <typename Fn>
void ParallelRanges(int64_t n, int threads, Fn fn) {
  internal::RunWorkers(threads, [&](int w) {
    const IeeeArithmetic ieee;
    fn(n * w / threads, n * (w + 1) / threads, w);
  });
}


}  // namespace

absl::Status CheckPackableShape(int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot pack an empty matrix [", rows, ", ", cols, "]"));
  }
  if (rows % kRowBlock != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot pack [", rows, ", ", cols, "]: N % 16 != 0 (rows come in 16-row blocks)"));
  }
  if (cols % kColGroup != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot pack [", rows, ", ", cols, "]: K % 64 != 0 (columns come in 64-wide groups)"));
  }
  // Rows below 2^31 (at most 2^31 - 16): a GEMV takes N as an int32, so that every packed
  // matrix can be multiplied whole.
  if (cols > (int64_t{1} << 30) || rows >= (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot pack [", rows, ", ", cols, "]: dimensions above 2^31 - 16 rows / 2^30 columns"));
  }
  return absl::OkStatus();
}

absl::StatusOr<PackedMatrix> Pack(const uint16_t* w, int64_t rows, int64_t cols,
                                  const PackOptions& options) {
  if (w == nullptr) return absl::InvalidArgumentError("cannot pack: the weight pointer is null");
  RETURN_IF_ERROR(CheckPackableShape(rows, cols));
  const int64_t nblocks = rows / kRowBlock, ngroups = cols / kColGroup;
  const int threads = internal::WorkerCount(options.threads, nblocks);

  // Pass 1: histogram of e7 and the first non-finite weight (in row-major order).
  std::vector<std::array<int64_t, 128>> hist(threads);
  std::vector<int64_t> first_bad(threads, -1);
  ParallelRanges(rows, threads, [&](int64_t r0, int64_t r1, int wk) {
    auto& h = hist[wk];
    h.fill(0);
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* row = w + r * cols;
      for (int64_t c = 0; c < cols; ++c) {
        const uint16_t b = row[c];
        if (!IsFinite(b)) {
          first_bad[wk] = r * cols + c;
          return;
        }
        ++h[E7(b)];
      }
    }
  });
  for (int wk = 0; wk < threads; ++wk) {
    if (first_bad[wk] >= 0) {
      const int64_t i = first_bad[wk];
      const uint16_t b = w[i];
      return absl::InvalidArgumentError(absl::StrCat(
          "cannot pack: weight at (row ", i / cols, ", col ", i % cols, ") is ",
          (b & 0x7F) ? "NaN" : ((b & 0x8000) ? "-Inf" : "+Inf"), " (BF16 bits 0x",
          absl::Hex(b, absl::kZeroPad4), "); only finite weights can be packed"));
    }
  }
  std::array<int64_t, 128> total{};
  for (const auto& h : hist) {
    for (int i = 0; i < 128; ++i) total[i] += h[i];
  }
  // Window: the 8 consecutive e7 values covering the most weights (first maximum).
  int base = 0;
  int64_t best = -1;
  for (int b = 0; b + 8 <= 128; ++b) {
    int64_t cover = 0;
    for (int i = 0; i < 8; ++i) cover += total[b + i];
    if (cover > best) {
      best = cover;
      base = b;
    }
  }

  PackedMatrix p;
  p.rows = rows;
  p.cols = cols;
  p.base = base;
  p.tl = static_cast<uint32_t>(base) | (static_cast<uint32_t>(base + 1) << 8) |
         (static_cast<uint32_t>(base + 2) << 16) | (static_cast<uint32_t>(base + 3) << 24);
  p.th = p.tl + 0x04040404u;
  p.weights.resize(static_cast<size_t>(nblocks * ngroups * kGroupBytes));

  // Pass 2, per row block: the packed groups, and each row's corrections.
  // More outside-window weights than this, or more entries than kMaxRowEntries: a dense row.
  const int64_t dense_threshold = cols / 8;
  struct WorkerOut {
    std::vector<ExceptionEntry> entries;
    std::vector<uint32_t> row_counts;  // per row of the worker's range
    std::vector<uint8_t> dense_rows;   // row in block
    std::vector<uint32_t> dense_per_block;
    std::vector<int64_t> dense_row_ids;  // global row
    int64_t outside = 0, residual = 0, max_row_entries = 0;
  };
  std::vector<WorkerOut> outs(threads);
  std::atomic<bool> self_check_failed{false};
  const auto& slots = GroupSlots();
  ParallelRanges(nblocks, threads, [&](int64_t b0, int64_t b1, int wk) {
    WorkerOut& o = outs[wk];
    std::vector<uint32_t> row_vals;
    std::vector<ExceptionEntry> row_entries;
    for (int64_t rb = b0; rb < b1; ++rb) {
      uint8_t* blk = p.weights.data() + rb * ngroups * kGroupBytes;
      for (int64_t gi = 0; gi < ngroups; ++gi) {
        uint8_t* grp = blk + gi * kGroupBytes;
        const uint16_t* src = w + rb * kRowBlock * cols + gi * kColGroup;
        for (int f = 0; f < 4; ++f) {
          for (int lane = 0; lane < 32; ++lane) {
            uint32_t q = 0;
            for (int i = 0; i < 8; ++i) {
              const auto s = slots[f][lane][i];
              const uint16_t bits = src[s.row * cols + s.col];
              const uint32_t code = static_cast<uint32_t>(std::clamp(E7(bits) - base, 0, 7));
              q |= code << (4 * i);
              q |= static_cast<uint32_t>(bits >> 15) << kSignBit[i];
              grp[LowByteOffset(f, lane, i)] = static_cast<uint8_t>(bits & 0xFF);
            }
            std::memcpy(grp + CodeWordOffset(f, lane), &q, 4);  // little-endian host
          }
        }
      }
      uint32_t dense_here = 0;
      for (int r = 0; r < kRowBlock; ++r) {
        const int64_t row = rb * kRowBlock + r;
        const uint16_t* src = w + row * cols;
        row_entries.clear();
        int64_t outside = 0, residual = 0;
        for (int64_t c = 0; c < cols; ++c) {
          const uint16_t bits = src[c];
          if (internal::InWindow(bits, base)) continue;
          ++outside;
          const uint16_t dec = Decoded(bits, base);
          uint32_t vals[2];
          const int n = Corrections(bits, dec, vals);
          if (Reconstruct(dec, vals, n, bits >> 15) != bits) self_check_failed = true;
          residual += n - 1;
          for (int i = 0; i < n; ++i) {
            row_entries.push_back(ExceptionEntry{static_cast<int32_t>(c), vals[i]});
          }
        }
        o.outside += outside;
        if (outside > dense_threshold || outside + residual > kMaxRowEntries) {
          o.dense_rows.push_back(static_cast<uint8_t>(r));
          o.dense_row_ids.push_back(row);
          o.row_counts.push_back(0);
          ++dense_here;
        } else {
          o.residual += residual;
          o.row_counts.push_back(static_cast<uint32_t>(row_entries.size()));
          o.entries.insert(o.entries.end(), row_entries.begin(), row_entries.end());
        }
        o.max_row_entries = std::max<int64_t>(o.max_row_entries, outside + residual);
      }
      o.dense_per_block.push_back(dense_here);
    }
  });
  if (self_check_failed) {
    return absl::InternalError("pack self-check failed: a correction does not restore its weight");
  }

  // Concatenate the workers' side tables in row order.
  p.row_offsets.reserve(rows + 1);
  p.row_offsets.push_back(0);
  p.dense_block_offsets.reserve(nblocks + 1);
  p.dense_block_offsets.push_back(0);
  int64_t n_entries = 0, n_dense = 0, outside = 0, residual = 0, capr = 1;
  for (const auto& o : outs) {
    n_entries += static_cast<int64_t>(o.entries.size());
    n_dense += static_cast<int64_t>(o.dense_rows.size());
  }
  if (n_entries > std::numeric_limits<uint32_t>::max()) {
    return absl::ResourceExhaustedError("more than 2^32 correction entries in one matrix");
  }
  p.entries.reserve(n_entries);
  p.dense_rows.reserve(n_dense);
  p.dense_values.reserve(n_dense * cols);
  for (const auto& o : outs) {
    for (uint32_t cnt : o.row_counts) p.row_offsets.push_back(p.row_offsets.back() + cnt);
    for (uint32_t d : o.dense_per_block) {
      p.dense_block_offsets.push_back(p.dense_block_offsets.back() + d);
    }
    p.entries.insert(p.entries.end(), o.entries.begin(), o.entries.end());
    p.dense_rows.insert(p.dense_rows.end(), o.dense_rows.begin(), o.dense_rows.end());
    for (int64_t row : o.dense_row_ids) {
      p.dense_values.insert(p.dense_values.end(), w + row * cols, w + (row + 1) * cols);
    }
    outside += o.outside;
    residual += o.residual;
    capr = std::max(capr, o.max_row_entries);
  }

  PackStats& s = p.stats;
  s.weights = rows * cols;
  s.outside_window = outside;
  s.sparse_entries = n_entries;
  s.residual_entries = residual;
  s.dense_rows = n_dense;
  s.total_bytes = internal::KernelBytes(p);
  s.bits_per_weight = 8.0 * static_cast<double>(s.total_bytes) / static_cast<double>(s.weights);
  s.exception_rate = static_cast<double>(outside) / static_cast<double>(s.weights);
  s.window_coverage = 1.0 - s.exception_rate;
  s.padded_table_bytes = rows * capr * 8;
  return p;
}

namespace {

// Unpack of a matrix ValidatePacked has accepted.
void UnpackValidated(const PackedMatrix& p, uint16_t* out) {
  const int64_t cols = p.cols, nblocks = p.rows / kRowBlock, ngroups = cols / kColGroup;
  const int threads = internal::WorkerCount(0, nblocks);
  ParallelRanges(nblocks, threads, [&](int64_t b0, int64_t b1, int) {
    for (int64_t rb = b0; rb < b1; ++rb) {
      // Decoded values, straight from the bytes (what decz produces).
      for (int64_t gi = 0; gi < ngroups; ++gi) {
        const uint8_t* grp = p.weights.data() + (rb * ngroups + gi) * kGroupBytes;
        uint16_t* dst = out + rb * kRowBlock * cols + gi * kColGroup;
        internal::ForEachDecodedWeight(grp, p.base, [&](internal::GroupSlot s, uint16_t bits) {
          dst[s.row * cols + s.col] = bits;
        });
      }
      // Corrections: entries of one weight are adjacent (same col).
      for (int r = 0; r < kRowBlock; ++r) {
        const int64_t row = rb * kRowBlock + r;
        uint16_t* dst = out + row * cols;
        internal::ForEachCorrectedWeight(p, row, [&](int32_t c, const uint32_t* vals, int n) {
          dst[c] = Reconstruct(dst[c], vals, n, dst[c] >> 15);
        });
      }
      for (uint32_t d = p.dense_block_offsets[rb]; d < p.dense_block_offsets[rb + 1]; ++d) {
        std::memcpy(out + (rb * kRowBlock + p.dense_rows[d]) * cols,
                    p.dense_values.data() + static_cast<int64_t>(d) * cols, 2 * cols);
      }
    }
  });
}

}  // namespace

absl::Status Unpack(const PackedMatrix& p, uint16_t* out) {
  if (out == nullptr) return absl::InvalidArgumentError("Unpack: the output pointer is null");
  RETURN_IF_ERROR(ValidatePacked(p));
  UnpackValidated(p, out);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint16_t>> Unpack(const PackedMatrix& p) {
  // Validated before the buffer is sized from rows * cols: a negative or huge shape would throw.
  RETURN_IF_ERROR(ValidatePacked(p));
  std::vector<uint16_t> out(static_cast<size_t>(p.rows * p.cols));
  UnpackValidated(p, out.data());
  return out;
}

namespace internal {

uint16_t RestoredWeight(uint16_t decoded, const uint32_t* values, int n) {
  return Reconstruct(decoded, values, n, decoded >> 15);
}

int64_t CorrectionEntries(const uint16_t* weights, int64_t n, int base) {
  const IeeeArithmetic ieee;
  int64_t entries = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (InWindow(weights[i], base)) continue;
    uint32_t vals[2];
    entries += Corrections(weights[i], Decoded(weights[i], base), vals);
  }
  return entries;
}

}  // namespace internal
}  // namespace gemvz
