// The product: out[m, N] = x[m, K] * W[N, K]^T on one GPU, with W in the 12-bit format (or plain
// BF16 where it cannot be compressed). BF16 in, BF16 out, FP32 accumulation, deterministic for
// a given configuration (GemvPlan; a shape's plan changes only when a tuning file is saved or
// GEMVZ_AUTOTUNE first tunes the shape, which no call during a capture does).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gemvz/config.h"
#include "gemvz/format.h"

struct CUstream_st;  // the same type as cudaStream_t and CUstream

namespace gemvz {

namespace internal {
struct DeviceMatrixState;
}

struct UploadOptions {
  // The device order of a 12-bit matrix's weights (WeightOrder, config.h). Unset: the environment
  // variable GEMVZ_WEIGHT_ORDER (block or group; auto or unset: the next rule), else the order of
  // the dispatcher's tuned configurations for this shape on this GPU (PreferredOrder, dispatch.h),
  // else block-major. Plain BF16 matrices have no order.
  std::optional<WeightOrder> order;
};

// A weight matrix resident on one GPU. Cheap to copy (shared ownership); freed with the last copy.
// A CUDA graph that captured Gemv on it holds its device pointers: keep a copy alive for as long
// as the graph may run.
class DeviceMatrix {
 public:
  // Uploads a packed matrix (checked with ValidatePacked first).
  static absl::StatusOr<DeviceMatrix> Upload(const PackedMatrix& packed, int device = 0,
                                             const UploadOptions& options = {});
  // Uploads BF16 weights [rows, cols] (host, row-major): packed to 12 bits when the shape and the
  // values allow, else kept as plain BF16 (a shape Pack refuses, or an Inf or NaN weight);
  // fallback_reason() says why.
  static absl::StatusOr<DeviceMatrix> FromBf16(const uint16_t* host_bf16, int64_t rows,
                                               int64_t cols, int device = 0,
                                               const UploadOptions& options = {});
  // Uploads BF16 weights as plain BF16, uncompressed (any shape).
  static absl::StatusOr<DeviceMatrix> UploadPlain(const uint16_t* host_bf16, int64_t rows,
                                                  int64_t cols, int device = 0);

  DeviceMatrix() = default;
  bool valid() const { return state_ != nullptr; }
  int64_t rows() const;
  int64_t cols() const;
  int device() const;
  WeightFormat format() const;
  // The device order of a 12-bit matrix's weights: the kernels Gemv runs on it take this order
  // (KernelConfig::order). kBlockMajor for plain BF16.
  WeightOrder order() const;
  // The weight bytes one call reads: for 12-bit the packed weights and side tables
  // (PackStats::total_bytes, counted from what was uploaded); for plain BF16 2 x rows x cols (the
  // plain kernel also reads the zeros that pad the matrix to 16 rows and 64 columns).
  int64_t weight_bytes() const;
  // Why the matrix is plain BF16 rather than 12-bit; empty when it is 12-bit or asked plain.
  const std::string& fallback_reason() const;

  const internal::DeviceMatrixState* state() const { return state_.get(); }

 private:
  std::shared_ptr<internal::DeviceMatrixState> state_;
  friend struct internal::DeviceMatrixState;
};

// Programmatic dependent launch (sm_90 and later; plain launches before): the GEMV may start
// while the previous kernel on the stream finishes, and pulls its first weights into L2
// meanwhile; it reads x and writes out only after that kernel has completed. Safe unless the
// previous kernel writes this matrix's weights. It saves launch and tail time when GEMVs and
// other PDL-aware kernels follow one another (a decode step); docs/BENCHMARKS.md measures it.
enum class Pdl {
  kOff,     // plain launches
  kAuto,    // PDL for grids that fill at least 90 % of the GPU's resident CTA slots (a grid that
            // leaves many idle lets the next kernel's early CTAs crowd a few SMs)
  kAlways,  // PDL for every launch: to test chains of dependent kernels, or to experiment
};

struct GemvOptions {
  // Forces a configuration (any valid one; compiled at first use). Else GEMVZ_FORCE_CONFIG, else
  // the dispatcher's choice. A 12-bit configuration forced here must be in the matrix's order
  // (".gm" or none, DeviceMatrix::order()); one from GEMVZ_FORCE_CONFIG runs in it.
  std::optional<KernelConfig> config;
  // Programmatic dependent launch; unset: GEMVZ_PDL decides (1 or auto: kAuto, always: kAlways,
  // unset or 0: kOff). An explicit value wins over the environment.
  std::optional<Pdl> pdl;
};

// out[m, N] (device, BF16, row-major) = x[m, K] (device, BF16, row-major) times W^T, on `stream`
// (nullptr: the legacy default stream, refused with FailedPrecondition while a blocking stream of
// its context is being captured). Any m >= 1: above 32 rows, in ceil(m / 32) launches of
// equal rows (m = 40: two of 20; more where the chosen kernel takes fewer rows, GemvPlan), each
// reading all the weights, so beyond 32 rows a BF16 GEMM is the faster tool (docs/BENCHMARKS.md,
// "Above m = 16"). Asynchronous; capturable in a CUDA graph, where a call needs no more workspace
// than the stream has: the first split-K call of a size on a stream (or on a plain BF16 matrix
// whose K is not a multiple of 64) must run once outside the capture, or the capture gets
// FailedPrecondition saying so. A captured call uses the capture stream's workspace wherever
// the graph is launched: a graph captured on stream A and launched on another must not run at
// the same time as other work of A's workspace (Gemv calls on A, or another graph captured on
// A), since they would share its split-K sums and counters. Safe to call concurrently on
// different streams; each stream's workspace has its own lock, so a thread blocked launching
// into a full stream holds up only that stream's calls. x must be 16-byte aligned (2-byte for a
// plain BF16 matrix whose K is not a multiple of 64) and out aligned to its element; cudaMalloc's
// pointers are. A misaligned one is InvalidArgument, before anything is launched. out must not
// overlap x (a kernel would read rows of x that it had already overwritten).
absl::Status Gemv(const DeviceMatrix& w, const uint16_t* x, int64_t m, uint16_t* out,
                  CUstream_st* stream, const GemvOptions& options = {});

// The same with FP32 output: the unrounded sums, e.g. the partial outputs of an input-parallel
// shard that a caller's all-reduce adds up before rounding.
absl::Status GemvFp32(const DeviceMatrix& w, const uint16_t* x, int64_t m, float* out,
                      CUstream_st* stream, const GemvOptions& options = {});

// The workspace of a stream. Gemv keeps, per (device, stream), the split-K partial sums and
// arrival counters and (plain BF16 with K not a multiple of 64) a padded copy of x, allocated at a
// call's first need and grown at least twofold when a later call needs more (the per-thread
// default stream, cudaStreamPerThread, is another stream in every thread: each thread's calls get
// their own, which these functions report and free for the calling thread: release it before a
// thread that used it ends, or it stays allocated for the process). A grown-out buffer is
// kept, not freed, because CUDA graphs captured on the stream still use it, so the total only
// grows until ReleaseGemvWorkspace (the partials of one split-K call are N/16 x S x NB x 512
// bytes: 640 KiB for a 10240-row matrix at S = 2, m <= 8).
//
// The device bytes held for `stream` on `device`, outgrown buffers included; 0 when none.
absl::StatusOr<int64_t> GemvWorkspaceBytes(CUstream_st* stream, int device = 0);

// Frees all of it, for a stream whose GEMVs are done (before destroying a stream, say): waits for
// the stream's queued work, frees the buffers, and a later Gemv on the stream allocates afresh.
// Graphs captured on the stream before the call use these buffers wherever they are launched: none
// may be running on another stream during the call, nor launched after it. Refused while the
// stream is being captured. A Gemv on the same stream at the same time either launches first, and
// is waited for, or allocates afresh after the release. OK (a no-op but for the wait) when nothing
// is held. nullptr is the legacy default stream.
absl::Status ReleaseGemvWorkspace(CUstream_st* stream, int device = 0);

// How a call would run: the configuration per chunk and where it came from.
struct GemvPlan {
  KernelConfig config;
  std::string source;  // "forced", "env", "tuned", "tuning-file", "heuristic", "autotuned"
  int64_t chunk_m = 0; // activation rows per launch
};
absl::StatusOr<GemvPlan> PlanGemv(const DeviceMatrix& w, int64_t m,
                                  const GemvOptions& options = {});

}  // namespace gemvz
