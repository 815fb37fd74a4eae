// Uploading weights: a packed matrix's arrays, or plain BF16 padded to the kernel's tiles.
#include <cstring>
#include <memory>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gemvz/dispatch.h"
#include "runtime/common/env.h"
#include "runtime/common/per_thread_cache.h"
#include "runtime/common/status_macros.h"
#include "runtime/cuda/driver.h"
#include "runtime/format/z12_layout.h"
#include "runtime/gemv/device_state.h"
#include "runtime/jit/kernel_cache.h"

namespace gemvz {
namespace internal {

DeviceMatrixState::~DeviceMatrixState() {
  auto d = Driver();
  if (!d.ok() || allocations.empty()) return;
  auto ctx = ScopedDeviceContext::Enter(device);
  if (!ctx.ok()) return;
  const RelaxedCaptureMode relaxed;  // frees beside another thread's capture
  for (CUdeviceptr p : allocations) (*d)->cuMemFree(p);
}

namespace {

// The device's facts, queried at the first call and kept for the process.
absl::StatusOr<DeviceInfo> QueriedDeviceInfo(int device) {
  static absl::Mutex mu(absl::kConstInit);
  static auto* cache = new std::vector<std::optional<DeviceInfo>>();
  {
    absl::ReaderMutexLock lock(&mu);
    if (device >= 0 && static_cast<size_t>(device) < cache->size() && (*cache)[device]) {
      return *(*cache)[device];
    }
  }
  ASSIGN_OR_RETURN(auto ctx, ScopedDeviceContext::Enter(device));
  absl::MutexLock lock(&mu);
  if (cache->size() <= static_cast<size_t>(device)) cache->resize(device + 1);
  if ((*cache)[device]) return *(*cache)[device];
  CUdevice dev;
  CU_RETURN_IF_ERROR(cuDeviceGet(&dev, device));
  auto attr = [&](CUdevice_attribute a) -> absl::StatusOr<int> {
    int v = 0;
    CU_RETURN_IF_ERROR(cuDeviceGetAttribute(&v, a, dev));
    return v;
  };
  DeviceInfo info;
  ASSIGN_OR_RETURN(info.limits.max_threads_per_block,
                   attr(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK));
  ASSIGN_OR_RETURN(int smem, attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK));
  info.limits.max_shared_per_block = smem;
  ASSIGN_OR_RETURN(int gx, attr(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X));
  ASSIGN_OR_RETURN(int gy, attr(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y));
  info.limits.max_grid_x = gx;
  info.limits.max_grid_y = gy;
  ASSIGN_OR_RETURN(info.limits.sm_count, attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT));
  ASSIGN_OR_RETURN(info.limits.cc_major, attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR));
  ASSIGN_OR_RETURN(info.limits.cc_minor, attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR));
  if (info.limits.cc_major < 8) {
    return absl::FailedPreconditionError(absl::StrCat(
        "device ", device, " has compute capability ", info.limits.cc_major, ".",
        info.limits.cc_minor, "; the kernels need BF16 tensor cores (8.0 or newer)"));
  }
  ASSIGN_OR_RETURN(info.arch, LaunchArch(device));
  char name[256] = {0};
  CU_RETURN_IF_ERROR(cuDeviceGetName(name, sizeof(name), dev));
  info.name = name;
  (*cache)[device] = info;
  return info;
}

}  // namespace

absl::StatusOr<DeviceInfo> GetDeviceInfo(int device) {
  // Every Gemv asks: a known device's answer is each thread's own copy, found with no lock.
  static auto* front = new PerThreadCache<int, DeviceInfo>();
  return front->FindOrAsk(device, [device] { return QueriedDeviceInfo(device); });
}

absl::Status CheckDenseRowGrid(int64_t rows, int64_t n_dense, const DeviceLimits& limits) {
  if (rows / kRowBlock + n_dense > limits.max_grid_x) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot upload a ", rows, "-row matrix with ", n_dense, " dense rows: its ",
        rows / kRowBlock, " row blocks and one CTA a dense row exceed the grid's x limit (",
        limits.max_grid_x, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<WeightOrder> ResolveOrder(const std::optional<WeightOrder>& requested,
                                         const std::string& arch, int64_t rows, int64_t cols,
                                         const std::string& device) {
  if (requested) return *requested;
  const std::optional<std::string> env = GetEnv("GEMVZ_WEIGHT_ORDER");
  if (env && *env == "block") return WeightOrder::kBlockMajor;
  if (env && *env == "group") return WeightOrder::kGroupMajor;
  if (env && !env->empty() && *env != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("GEMVZ_WEIGHT_ORDER must be block, group or auto, not '", *env, "'"));
  }
  return PreferredOrder(arch, rows, cols, device);
}

namespace {

// The copies of one upload, on a stream of their own. A copy from pageable host memory returns
// once its bytes are staged, before its DMA has landed (cuMemcpyHtoD's documented behaviour), and
// a Gemv on the caller's non-blocking stream would not wait for the legacy stream it ran on: the
// upload waits for its copies, and only for them, before it returns.
class UploadStream {
 public:
  static absl::StatusOr<std::unique_ptr<UploadStream>> Create() {
    auto u = std::unique_ptr<UploadStream>(new UploadStream());
    CU_RETURN_IF_ERROR(cuStreamCreate(&u->stream_, CU_STREAM_NON_BLOCKING));
    return u;
  }
  ~UploadStream() {
    if (stream_ == nullptr) return;
    const DriverApi* d = *Driver();
    d->cuStreamSynchronize(stream_);  // nothing may still read a host buffer we are done with
    d->cuStreamDestroy(stream_);
  }
  CUstream get() const { return stream_; }
  absl::Status Finish() {
    CU_RETURN_IF_ERROR(cuStreamSynchronize(stream_));
    return absl::OkStatus();
  }

 private:
  UploadStream() = default;
  CUstream stream_ = nullptr;
};

// Allocates and fills one device array; an empty array still gets a small allocation so every
// pointer the kernel sees is valid.
absl::StatusOr<CUdeviceptr> UploadArray(DeviceMatrixState& s, const void* data, size_t bytes,
                                        CUstream stream) {
  CUdeviceptr p = 0;
  CU_RETURN_IF_ERROR(cuMemAlloc(&p, std::max<size_t>(bytes, 256)));
  s.allocations.push_back(p);
  if (bytes > 0) CU_RETURN_IF_ERROR(cuMemcpyHtoDAsync(p, data, bytes, stream));
  return p;
}

template <typename T>
absl::StatusOr<CUdeviceptr> UploadVector(DeviceMatrixState& s, const std::vector<T>& v,
                                         CUstream stream) {
  return UploadArray(s, v.data(), v.size() * sizeof(T), stream);
}

}  // namespace
}  // namespace internal

absl::StatusOr<DeviceMatrix> DeviceMatrix::Upload(const PackedMatrix& packed, int device,
                                                  const UploadOptions& options) {
  RETURN_IF_ERROR(ValidatePacked(packed));
  ASSIGN_OR_RETURN(auto info, internal::GetDeviceInfo(device));
  RETURN_IF_ERROR(internal::CheckDenseRowGrid(
      packed.rows, static_cast<int64_t>(packed.dense_rows.size()), info.limits));
  ASSIGN_OR_RETURN(
      const WeightOrder order,
      internal::ResolveOrder(options.order, info.arch, packed.rows, packed.cols, info.name));
  ASSIGN_OR_RETURN(auto ctx, internal::ScopedDeviceContext::Enter(device));
  // Its allocations, copies and wait touch only its own stream: allowed beside another thread's
  // capture.
  const internal::RelaxedCaptureMode relaxed;
  auto s = std::make_shared<internal::DeviceMatrixState>();
  // After `s`: on an early return its copies are waited for before its memory is freed.
  ASSIGN_OR_RETURN(const std::unique_ptr<internal::UploadStream> copies,
                   internal::UploadStream::Create());
  const CUstream cs = copies->get();
  s->device = device;
  s->format = WeightFormat::kZ12;
  s->rows = packed.rows;
  s->cols = packed.cols;
  s->tl = packed.tl;
  s->th = packed.th;
  s->order = order;
  if (order == WeightOrder::kGroupMajor) {
    // Reordered on the host, into memory that nothing writes first (no zero fill). A copy from
    // pageable memory is staged before it returns, so the buffer may go at the end of the block.
    const std::unique_ptr<uint8_t[]> reordered(new uint8_t[packed.weights.size()]);
    internal::ToGroupMajor(packed.weights.data(), packed.rows, packed.cols, reordered.get());
    ASSIGN_OR_RETURN(s->weights,
                     internal::UploadArray(*s, reordered.get(), packed.weights.size(), cs));
  } else {
    ASSIGN_OR_RETURN(s->weights, internal::UploadVector(*s, packed.weights, cs));
  }
  ASSIGN_OR_RETURN(s->row_offsets, internal::UploadVector(*s, packed.row_offsets, cs));
  ASSIGN_OR_RETURN(s->entries, internal::UploadVector(*s, packed.entries, cs));
  ASSIGN_OR_RETURN(s->dense_block_offsets,
                   internal::UploadVector(*s, packed.dense_block_offsets, cs));
  ASSIGN_OR_RETURN(s->dense_rows, internal::UploadVector(*s, packed.dense_rows, cs));
  ASSIGN_OR_RETURN(s->dense_values, internal::UploadVector(*s, packed.dense_values, cs));
  // Each dense row gets a CTA of its own; it needs to know which row it computes.
  std::vector<int32_t> dense_global_rows;
  dense_global_rows.reserve(packed.dense_rows.size());
  for (size_t b = 0; b + 1 < packed.dense_block_offsets.size(); ++b) {
    for (uint32_t d = packed.dense_block_offsets[b]; d < packed.dense_block_offsets[b + 1]; ++d) {
      dense_global_rows.push_back(static_cast<int32_t>(b * kRowBlock + packed.dense_rows[d]));
    }
  }
  s->n_dense = static_cast<int64_t>(dense_global_rows.size());
  ASSIGN_OR_RETURN(s->dense_global_rows, internal::UploadVector(*s, dense_global_rows, cs));
  RETURN_IF_ERROR(copies->Finish());
  s->weight_bytes = internal::KernelBytes(packed);  // not the file's stats: what was uploaded
  return internal::DeviceMatrixState::Wrap(std::move(s));
}

absl::StatusOr<DeviceMatrix> DeviceMatrix::UploadPlain(const uint16_t* host, int64_t rows,
                                                       int64_t cols, int device) {
  if (host == nullptr) return absl::InvalidArgumentError("UploadPlain: the weight pointer is null");
  if (rows <= 0 || cols <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("UploadPlain: empty matrix [", rows, ", ", cols, "]"));
  }
  ASSIGN_OR_RETURN(auto info, internal::GetDeviceInfo(device));
  (void)info;
  ASSIGN_OR_RETURN(auto ctx, internal::ScopedDeviceContext::Enter(device));
  // Its allocations, copies and wait touch only its own stream: allowed beside another thread's
  // capture.
  const internal::RelaxedCaptureMode relaxed;
  auto s = std::make_shared<internal::DeviceMatrixState>();
  s->device = device;
  s->format = WeightFormat::kBf16;
  s->rows = rows;
  s->cols = cols;
  s->rows16 = (rows + 15) / 16 * 16;
  s->cols64 = (cols + 63) / 64 * 64;
  s->ldw = s->cols64;
  const size_t bytes = static_cast<size_t>(s->rows16 * s->ldw * 2);
  ASSIGN_OR_RETURN(const std::unique_ptr<internal::UploadStream> copies,
                   internal::UploadStream::Create());
  CUdeviceptr p = 0;
  CU_RETURN_IF_ERROR(cuMemAlloc(&p, bytes));
  s->allocations.push_back(p);
  s->plain = p;
  if (s->ldw == cols && s->rows16 == rows) {
    CU_RETURN_IF_ERROR(cuMemcpyHtoDAsync(p, host, bytes, copies->get()));
  } else {
    CU_RETURN_IF_ERROR(cuMemsetD8Async(p, 0, bytes, copies->get()));
    CUDA_MEMCPY2D c;
    std::memset(&c, 0, sizeof(c));
    c.srcMemoryType = CU_MEMORYTYPE_HOST;
    c.srcHost = host;
    c.srcPitch = static_cast<size_t>(cols) * 2;
    c.dstMemoryType = CU_MEMORYTYPE_DEVICE;
    c.dstDevice = p;
    c.dstPitch = static_cast<size_t>(s->ldw) * 2;
    c.WidthInBytes = static_cast<size_t>(cols) * 2;
    c.Height = static_cast<size_t>(rows);
    CU_RETURN_IF_ERROR(cuMemcpy2DAsync(&c, copies->get()));
  }
  RETURN_IF_ERROR(copies->Finish());
  s->weight_bytes = rows * cols * 2;
  return internal::DeviceMatrixState::Wrap(std::move(s));
}

absl::StatusOr<DeviceMatrix> DeviceMatrix::FromBf16(const uint16_t* host, int64_t rows,
                                                    int64_t cols, int device,
                                                    const UploadOptions& options) {
  if (host == nullptr) return absl::InvalidArgumentError("FromBf16: the weight pointer is null");
  absl::Status why_plain = CheckPackableShape(rows, cols);
  if (why_plain.ok()) {
    absl::StatusOr<PackedMatrix> packed = Pack(host, rows, cols);
    if (packed.ok()) return Upload(*packed, device, options);
    // Weights the format cannot hold (Inf, NaN) stay plain, as an unpackable shape does; a failed
    // self-check is a bug and is not hidden behind a slower path.
    if (packed.status().code() == absl::StatusCode::kInternal) return packed.status();
    why_plain = packed.status();
  } else if (rows <= 0 || cols <= 0) {
    return why_plain;
  }
  ASSIGN_OR_RETURN(DeviceMatrix m, UploadPlain(host, rows, cols, device));
  m.state_->fallback_reason = std::string(why_plain.message());
  return m;
}

int64_t DeviceMatrix::rows() const { return state_ ? state_->rows : 0; }
int64_t DeviceMatrix::cols() const { return state_ ? state_->cols : 0; }
int DeviceMatrix::device() const { return state_ ? state_->device : -1; }
WeightFormat DeviceMatrix::format() const { return state_ ? state_->format : WeightFormat::kZ12; }
WeightOrder DeviceMatrix::order() const {
  return state_ ? state_->order : WeightOrder::kBlockMajor;
}
int64_t DeviceMatrix::weight_bytes() const { return state_ ? state_->weight_bytes : 0; }
const std::string& DeviceMatrix::fallback_reason() const {
  static const std::string kEmpty;
  return state_ ? state_->fallback_reason : kEmpty;
}

}  // namespace gemvz
