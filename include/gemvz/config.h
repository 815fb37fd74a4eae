// Kernel configurations: which kernel, with which template arguments, split over how many CTAs.
// A configuration is a value: printable ("z12.nw8.ug2.nb2.pipe3.s1"), parseable from that text,
// comparable, hashable, and checked against a shape by Validate, which names the rule it breaks.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace gemvz {

enum class WeightFormat {
  kZ12,   // the 12-bit lossless format (format.h)
  kBf16,  // plain row-major BF16, for matrices that cannot or should not be compressed
};
std::string_view FormatName(WeightFormat format);  // "z12" / "bf16"
// How a 12-bit matrix's 1536-byte (16-row block, 64-wide group) units lie in device memory.
// Block-major (the packed format's own order, format.h): a row block's groups one after another.
// Group-major: a group's row blocks one after another, so that CTAs streaming the same group of
// neighbouring row blocks read neighbouring bytes (docs/BENCHMARKS.md: 0.5-4.6 % faster on the
// suite's large shapes at m = 8 and 16 once re-tuned, but some configurations run much slower).
// A DeviceMatrix is uploaded in one order and runs only the kernels compiled for it.
enum class WeightOrder {
  kBlockMajor,
  kGroupMajor,
};
std::string_view OrderName(WeightOrder order);  // "block" / "group"

// The largest PIPE a format's kernel takes: 13 for z12 (4..8 are its register-capped loops,
// 9..13 the same caps with the rolling loop), 3 for bf16.
constexpr int MaxPipe(WeightFormat format) { return format == WeightFormat::kZ12 ? 13 : 3; }

// Template arguments of one kernel (compiled as such by NVRTC) plus the split-K factor, which is a
// run-time argument of the same kernel.
struct KernelConfig {
  WeightFormat format = WeightFormat::kZ12;
  int nw = 8;  // streaming warps per CTA (z12 adds one exception warp)
  int ug = 2;  // 64-wide K groups per loop trip
  int nb = 2;  // 8-token blocks per launch: up to 8 * nb activation rows
  // 0/3 plain loop (3: minBlocks 1), 1/2 software-pipelined (2: minBlocks 2); z12 only: 4..8 plain
  // loop with minBlocks PIPE - 2 (a register cap for more CTAs per SM) and two accumulator chains;
  // 9..13 the rolling loop (each group's registers take the next trip's load once its mma are
  // done) with minBlocks PIPE - 7 and the same chains.
  int pipe = 3;
  int splits = 1;  // S: CTAs sharing one row block's K range (split-K)
  // z12 only: row blocks per CTA, 1, 2 or 4 (4 with S = 1 only). With 2 or 4 every streaming warp
  // streams that many 16-row blocks at once and feeds them all from one load of x's fragments
  // (fewer registers per byte in flight). Written ".rb2"/".rb4" before ".s" in the text form; RB 1
  // is written by leaving the field out.
  int rb = 1;
  // z12 only: the device order of the weights the kernel reads (WeightOrder). Written ".gm" after
  // RB and before ".s" for group-major; block-major is written by leaving the field out.
  WeightOrder order = WeightOrder::kBlockMajor;

  // "z12.nw8.ug2.nb2.pipe3.s1", "z12.nw4.ug1.nb2.pipe3.rb2.s1", "z12.nw3.ug4.nb2.pipe7.gm.s1"
  std::string ToString() const;
  // The compiled kernel's identity: everything but `splits` ("z12.nw8.ug2.nb2.pipe3").
  std::string KernelName() const;
  static absl::StatusOr<KernelConfig> Parse(std::string_view text);

  int threads() const { return (nw + (format == WeightFormat::kZ12 ? 1 : 0)) * 32; }
  int tokens_per_launch() const { return nb * 8; }
  // Static shared memory of the kernel, in bytes.
  int64_t shared_bytes() const;

  friend bool operator==(const KernelConfig& a, const KernelConfig& b) {
    return a.format == b.format && a.nw == b.nw && a.ug == b.ug && a.nb == b.nb &&
           a.pipe == b.pipe && a.splits == b.splits && a.rb == b.rb && a.order == b.order;
  }
  friend bool operator!=(const KernelConfig& a, const KernelConfig& b) { return !(a == b); }
  template <typename H>
  friend H AbslHashValue(H h, const KernelConfig& c) {
    return H::combine(std::move(h), static_cast<int>(c.format), c.nw, c.ug, c.nb, c.pipe, c.splits,
                      c.rb, static_cast<int>(c.order));
  }
};

// One launch's problem: m activation rows (1..8*nb), an [n, k] weight matrix.
struct GemvShape {
  int64_t m = 1;
  int64_t n = 0;
  int64_t k = 0;
  std::string ToString() const;  // "m8.n4096.k8192"
};

// The static shared memory any kernel may declare (ptxas's limit on every architecture).
constexpr int64_t kMaxStaticSharedBytes = 48 * 1024;
// The threads any GPU launches in one block (every architecture CUDA 13 targets).
constexpr int kMaxThreadsPerBlock = 1024;

// What Validate needs to know about the target GPU.
struct DeviceLimits {
  int max_threads_per_block = 1024;
  int64_t max_shared_per_block = kMaxStaticSharedBytes;  // static shared memory
  int64_t max_grid_x = 2147483647;
  int64_t max_grid_y = 65535;
  int sm_count = 132;
  int cc_major = 9;
  int cc_minor = 0;
};
// An H200's limits, for validating without a GPU.
DeviceLimits DefaultDeviceLimits();

// The configuration alone: value ranges, NW >= NB, NW + 1 >= RB * NB except at RB 4 (the first
// RB*NB*32 threads do the final reduction; RB 4's combine takes the fragments in turns), RB 4 with
// S = 1 only, threads per block within kMaxThreadsPerBlock (z12's exception warp included: its
// NW is at most 31) and static shared memory within kMaxStaticSharedBytes.
absl::Status ValidateConfig(const KernelConfig& config);
// The configuration against a shape and a device. The message names the rule that fails.
absl::Status Validate(const KernelConfig& config, const GemvShape& shape,
                      const DeviceLimits& limits = DefaultDeviceLimits());

}  // namespace gemvz
