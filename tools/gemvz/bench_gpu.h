// GPU-side machinery of the gemvz CLI: a device session, raw device buffers, CUDA-graph timing,
// cuBLAS opened at run time (never linked), the read-bandwidth probe, and one shape's workload
// (weights rotated through copies larger than L2, x, the CPU reference) that demo, bench and
// tune measure on.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gemvz/config.h"
#include "gemvz/gemv.h"
#include "runtime/cuda/driver.h"
#include "tools/gemvz/bench_support.h"

namespace gemvz::cli {

// One progress line on stderr, so stdout stays the result.
void Progress(const std::string& line);

// Why no GPU can be used ("" when one can): the driver's load error, or no device.
std::string NoGpuReason();

struct GpuInfo {
  int device = 0;
  std::string name;
  std::string arch;  // what the JIT targets for it, "sm_90"
  int64_t memory_bytes = 0;
  std::string cuda_driver_api;  // "13.0"
  DeviceLimits limits;          // for Validate
};

// Device memory from cuMemAlloc, freed with the object. Needs the device's context current at
// both ends (a GpuSession keeps it so).
class DeviceBuffer {
 public:
  static absl::StatusOr<DeviceBuffer> Allocate(size_t bytes);
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();

  CUdeviceptr ptr() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  uint16_t* bf16() const { return reinterpret_cast<uint16_t*>(ptr_); }

 private:
  void Release();
  CUdeviceptr ptr_ = 0;
  size_t bytes_ = 0;
};

// The primary context of one GPU made current on this thread, and one stream on it.
class GpuSession {
 public:
  static absl::StatusOr<std::unique_ptr<GpuSession>> Open(int device);
  ~GpuSession();
  const GpuInfo& info() const { return info_; }
  CUstream stream() const { return stream_; }
  absl::Status Synchronize() const;

 private:
  GpuSession(internal::ScopedDeviceContext scope, GpuInfo info, CUstream stream)
      : scope_(std::move(scope)), info_(std::move(info)), stream_(stream) {}
  internal::ScopedDeviceContext scope_;
  GpuInfo info_;
  CUstream stream_ = nullptr;
};

struct TimingOptions {
  int replays = 20;        // timed graph replays; the median is reported
  int warmup_replays = 3;  // untimed replays first
  int min_launches = 64;   // launches captured in one graph (rounded up to the rotation)
  bool pdl = false;        // the library's GEMVs launch with Pdl::kAuto (--pdl)
};

// Several captured workloads timed in alternation: warm-up replay w of every graph before
// warm-up replay w + 1 of any, then timed replay r of every graph before replay r + 1 of any.
// Each graph's median therefore sees the same clocks as the others': under a sustained load the
// H200 reaches its 700 W power cap and lowers the SM clock (measured down to 765 MHz at m = 32
// on 8192x28672), which would otherwise penalise whatever is timed last. Each timed round takes
// the graphs in a new order: in the same order every round, a graph's time depended on its place
// in the rotation (a tune sweep in turn on the H200 timed the dispatcher's choice, always first,
// 0.8-3.4 % slower than the same kernel as a candidate in 17 of 21 cases; shuffled, -0.6 to
// +1.3 % in 9 cases).
class GraphTimer {
 public:
  explicit GraphTimer(CUstream stream) : stream_(stream) {}
  ~GraphTimer();
  GraphTimer(const GraphTimer&) = delete;
  GraphTimer& operator=(const GraphTimer&) = delete;

  // Captures enqueue(0) .. enqueue(launches - 1) into one CUDA graph and returns its index.
  // enqueue must only enqueue work (it runs during stream capture, thread-local mode).
  absl::StatusOr<int> Capture(int launches, const std::function<absl::Status(int)>& enqueue);
  // The median time of one launch of each captured graph, in microseconds, in capture order.
  // on_round (if set) is called after each round of every graph, warm-up rounds included, with
  // the rounds done and the rounds in all: long timings (a tune of hundreds of candidates) can
  // show progress.
  absl::StatusOr<std::vector<double>> MedianMicros(
      const TimingOptions& options,
      const std::function<void(int done, int total)>& on_round = nullptr);

 private:
  CUstream stream_;
  std::vector<CUgraphExec> execs_;
  std::vector<int> launches_;
};

// cuBLAS, opened with dlopen at run time: GEMVZ_CUBLAS_LIBRARY if set, else libcublas.so.13 and
// .so.12 from the loader's path, else the toolkit's lib64 ($CUDA_HOME, /usr/local/cuda).
std::vector<std::string> CublasCandidates();
class Cublas {
 public:
  // Loads the library and creates a handle on the current context, bound to `stream`, with its
  // own workspace so that graph capture never allocates.
  static absl::StatusOr<std::unique_ptr<Cublas>> Open(CUstream stream);
  ~Cublas();
  // out[m, n] = x[m, k] * w[n, k]^T, all BF16 row-major, FP32 compute (cublasGemmEx).
  absl::Status GemmBf16(CUdeviceptr w, CUdeviceptr x, CUdeviceptr out, int64_t m, int64_t n,
                        int64_t k) const;
  const std::string& library() const { return library_; }
  int version() const { return version_; }

  struct Api;

 private:
  Cublas() = default;
  std::unique_ptr<Api> api_;
  void* handle_ = nullptr;
  DeviceBuffer workspace_;
  std::string library_;
  int version_ = 0;
};

// The read-only bandwidth kernels (kernel_sources/bandwidth_probe.cuh), compiled at first use:
// a few forms of one grid-stride kernel, since no one form reads fastest at every size (at 25 MB
// two loads in flight per thread beat four by 2-3 %, at 352 MB eight beat four by 0.1-0.5 %;
// docs/BENCHMARKS.md, "The ceiling: how fast can a read kernel go"). The bench times each form
// and takes the fastest. Load checks that every form reads every word.
class BandwidthProbe {
 public:
  static absl::StatusOr<BandwidthProbe> Load(const GpuSession& session);
  int kernel_count() const { return static_cast<int>(kernels_.size()); }
  // "u4.t256.b8": UNROLL loads in flight per thread, threads per block, blocks per SM.
  const std::string& kernel_name(int kernel) const { return kernels_[kernel].name; }
  // Streams floor(bytes / 16) * 16 bytes from `src` once with kernel `kernel`.
  absl::Status Launch(int kernel, CUdeviceptr src, int64_t bytes, CUstream stream) const;
  static int64_t BytesRead(int64_t bytes) { return bytes / 16 * 16; }

 private:
  absl::Status CheckForms(CUstream stream) const;

  struct Kernel {
    std::string name;
    CUfunction function = nullptr;
    int blocks = 0;
    int threads = 0;
  };
  std::vector<Kernel> kernels_;
  std::shared_ptr<DeviceBuffer> sink_;  // one word per block: the XOR of what it read
};

struct WorkloadOptions {
  int64_t rotate_bytes = int64_t{512} << 20;  // each path's copies together reach this
  int threads = 0;                            // host threads (0: all)
  uint64_t seed = 1;
  std::vector<int64_t> zero_rows;  // rows of the weights set to all zeros
  // (row, percent): that share of the row's weights, at evenly spread columns, set to the
  // smallest positive BF16 subnormal (0x0001), far outside any 12-bit window.
  std::vector<std::pair<int64_t, double>> exception_rows;
};

// One shape on the GPU: random weights N(0, 1/K) and x N(0, 1) (BF16, from the seed), the CPU
// reference for max_m tokens, and, made on first use, each path's rotated device copies.
class ShapeWorkload {
 public:
  static absl::StatusOr<std::unique_ptr<ShapeWorkload>> Create(GpuSession* session,
                                                               const MatrixShape& shape,
                                                               int64_t max_m,
                                                               const WorkloadOptions& options);

  const MatrixShape& shape() const { return shape_; }
  const GemvReference& reference() const { return reference_; }
  CUdeviceptr x() const { return x_.ptr(); }
  CUdeviceptr out() const { return out_.ptr(); }
  CUstream stream() const { return session_->stream(); }

  // The dispatcher's path: copy 0 through DeviceMatrix::FromBf16; the rest are uploads of one
  // Pack of the same weights (or plain uploads when FromBf16 kept the matrix plain).
  absl::StatusOr<const std::vector<DeviceMatrix>*> Compressed();
  // DeviceMatrix::UploadPlain copies: the library's plain BF16 kernel.
  absl::StatusOr<const std::vector<DeviceMatrix>*> Plain();
  // Raw BF16 copies of the weights: what cuBLAS and the bandwidth probe read.
  absl::StatusOr<const std::vector<DeviceBuffer>*> Raw();
  // The copies of the format a configuration runs on.
  absl::StatusOr<const std::vector<DeviceMatrix>*> ForFormat(WeightFormat format);

  // Runs `run` once on the poisoned output (NaN everywhere), waits, downloads out[m, n] into
  // `result` and checks it against the reference.
  absl::StatusOr<ErrorCheck> RunAndCheck(int64_t m,
                                         const std::function<absl::Status()>& run,
                                         std::vector<uint16_t>* result);

  // Captures `call(copy)` into `timer`, copy rotating over `copies` copies, at least
  // timing.min_launches launches in whole rotations (*launches says how many); returns the
  // graph's index.
  absl::StatusOr<int> CaptureRotated(GraphTimer* timer, int copies, const TimingOptions& timing,
                                     const std::function<absl::Status(int copy)>& call,
                                     int* launches);

  // Gemv on the copies: runs on copy 0 (and on the last copy, which came another way) and
  // checks the results, then captures the timed launches, rotating over the copies, into `timer`.
  // `options` forces a configuration or leaves the dispatcher to choose; `timing.pdl` sets the
  // launch mode unless `options` does.
  struct GemvRun {
    ErrorCheck check;
    int graph = -1;    // the timed launches' index in the GraphTimer
    int launches = 0;  // launches per timed replay
    std::vector<uint16_t> result;
  };
  absl::StatusOr<GemvRun> CheckAndCaptureGemv(GraphTimer* timer,
                                              const std::vector<DeviceMatrix>& copies, int64_t m,
                                              const GemvOptions& options,
                                              const TimingOptions& timing);

 private:
  ShapeWorkload(GpuSession* session, MatrixShape shape, WorkloadOptions options)
      : session_(session), shape_(std::move(shape)), options_(options) {}
  int CopiesFor(int64_t bytes_per_copy) const;

  GpuSession* session_;
  MatrixShape shape_;
  WorkloadOptions options_;
  std::vector<uint16_t> weights_;  // host [n, k]
  GemvReference reference_;
  DeviceBuffer x_, out_;
  std::optional<std::vector<DeviceMatrix>> compressed_, plain_;
  std::optional<std::vector<DeviceBuffer>> raw_;
};

// `gemvz bench`'s work for one shape: the four paths at each m, side by side. Progress on stderr.
struct BenchTools {
  GpuSession* session = nullptr;
  const Cublas* cublas = nullptr;
  const BandwidthProbe* probe = nullptr;
  TimingOptions timing;
  WorkloadOptions workload;
};
absl::StatusOr<std::vector<BenchCase>> BenchShape(const BenchTools& tools, const MatrixShape& shape,
                                                  const std::vector<int64_t>& ms);

// `gemvz bench --sequence` (SequenceCase): the shapes' GEMVs one after another in one CUDA
// graph, as in a decode step, each path rotating through its copies. Every GEMV of every path is
// checked against the CPU reference first.
absl::StatusOr<std::vector<SequenceCase>> BenchSequence(const BenchTools& tools,
                                                        const std::vector<MatrixShape>& shapes,
                                                        const std::vector<int64_t>& ms);

// The environment part of a report (GPU, driver, cuBLAS, date, settings).
BenchEnvironment DescribeEnvironment(const BenchTools& tools, const std::string& commit);

// Everything `gemvz bench` and the demo's speed table need, opened once.
struct BenchStack {
  std::unique_ptr<GpuSession> session;
  std::unique_ptr<Cublas> cublas;
  std::optional<BandwidthProbe> probe;
  BenchTools tools;
};
absl::StatusOr<std::unique_ptr<BenchStack>> OpenBenchStack(int device, const TimingOptions& timing,
                                                           const WorkloadOptions& workload);

}  // namespace gemvz::cli
