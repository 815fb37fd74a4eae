#include "tests/support/gpu_util.h"

#include <cmath>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gemvz/format.h"
#include "runtime/cuda/driver.h"

namespace gemvz::testing {
namespace {

const internal::DriverApi& Api() { return **internal::Driver(); }

void Check(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS) {
    const char* name = "?";
    Api().cuGetErrorName(r, &name);
    ADD_FAILURE() << what << " failed: " << name;
  }
}

// Device 0's primary context, made current on this thread; null (the test failed) if it cannot
// be had.
CUcontext MakeDevice0Current() {
  auto ctx = internal::PrimaryContext(0);
  if (!ctx.ok()) {
    ADD_FAILURE() << ctx.status();
    return nullptr;
  }
  Check(Api().cuCtxSetCurrent(*ctx), "cuCtxSetCurrent");
  return *ctx;
}

}  // namespace

std::string NoGpuReason() {
  auto d = internal::Driver();
  if (!d.ok()) return std::string(d.status().message());
  return "the driver reports no CUDA device";
}

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (MakeDevice0Current() == nullptr) return;
  Check(Api().cuMemAlloc(&ptr_, std::max<size_t>(bytes, 16)), "cuMemAlloc");
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != 0) Api().cuMemFree(ptr_);
}

void DeviceBuffer::Upload(const void* src, size_t bytes) {
  Check(Api().cuMemcpyHtoD(ptr_, src, bytes), "cuMemcpyHtoD");
}

void DeviceBuffer::Download(void* dst, size_t bytes) const {
  Check(Api().cuCtxSynchronize(), "cuCtxSynchronize");
  Check(Api().cuMemcpyDtoH(dst, ptr_, bytes), "cuMemcpyDtoH");
}

void DeviceBuffer::Fill16(uint16_t value) {
  Check(Api().cuMemsetD16(ptr_, value, bytes_ / 2), "cuMemsetD16");
}

TestStream::TestStream(unsigned flags) : context_(MakeDevice0Current()) {
  if (context_ == nullptr) return;
  if (const CUresult r = Api().cuStreamCreate(&stream_, flags); r != CUDA_SUCCESS) {
    Check(r, "cuStreamCreate");
    stream_ = nullptr;
  }
}

TestStream::~TestStream() {
  if (stream_ == nullptr) return;
  if (const absl::Status st = ReleaseGemvWorkspace(stream_); !st.ok()) {
    ADD_FAILURE() << "releasing a test stream's workspace: " << st;
  }
  Api().cuStreamDestroy(stream_);
}

void Synchronize() { Check(Api().cuCtxSynchronize(), "cuCtxSynchronize"); }

bool IsAllocationStart(CUdeviceptr p) {
  if (MakeDevice0Current() == nullptr) return false;
  CUdeviceptr start = 0;
  return Api().cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, p) ==
             CUDA_SUCCESS &&
         start == p;
}

void ReferenceGemv(const std::vector<uint16_t>& w, const std::vector<uint16_t>& x, int64_t m,
                   int64_t n, int64_t k, std::vector<double>* out, std::vector<double>* abs_sum) {
  out->assign(static_cast<size_t>(m * n), 0.0);
  abs_sum->assign(static_cast<size_t>(m * n), 0.0);
  std::vector<double> xd(x.size());
  for (size_t i = 0; i < x.size(); ++i) xd[i] = Bf16ToFloat(x[i]);
  const int threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      std::vector<double> row(static_cast<size_t>(k));
      for (int64_t r = n * t / threads; r < n * (t + 1) / threads; ++r) {
        for (int64_t c = 0; c < k; ++c) row[c] = Bf16ToFloat(w[r * k + c]);
        for (int64_t i = 0; i < m; ++i) {
          double s = 0, a = 0;
          const double* xr = xd.data() + i * k;
          for (int64_t c = 0; c < k; ++c) {
            s += row[c] * xr[c];
            a += std::abs(row[c] * xr[c]);
          }
          (*out)[i * n + r] = s;
          (*abs_sum)[i * n + r] = a;
        }
      }
    });
  }
  for (auto& th : pool) th.join();
}

std::string CompareToReference(const std::vector<uint16_t>& got, const std::vector<double>& ref,
                               const std::vector<double>& abs_sum, int64_t m, int64_t n) {
  std::ostringstream os;
  int bad = 0;
  for (int64_t i = 0; i < m * n; ++i) {
    const double g = Bf16ToFloat(got[i]);
    const double tol = std::ldexp(std::abs(ref[i]), -8) + std::ldexp(abs_sum[i], -16) + 1e-30;
    if (!(std::abs(g - ref[i]) <= tol)) {
      if (bad < 5) {
        os << "out[" << i / n << "][" << i % n << "] = " << g << " (bits 0x" << std::hex << got[i]
           << std::dec << "), reference " << ref[i] << ", tolerance " << tol << "\n";
      }
      ++bad;
    }
  }
  if (bad > 0) os << bad << " of " << m * n << " outputs wrong\n";
  return os.str();
}

std::string CheckGemv(const DeviceMatrix& dm, const std::vector<uint16_t>& w,
                      const std::vector<uint16_t>& x, int64_t m, const GemvOptions& opt,
                      CUstream stream) {
  const int64_t n = dm.rows(), k = dm.cols(), guard = n + 64;
  DeviceBuffer dx(x.size() * 2), dout(static_cast<size_t>((m * n + guard) * 2));
  dx.Upload(x.data(), x.size() * 2);
  dout.Fill16(kPoison);
  if (stream != nullptr) Synchronize();  // a non-blocking stream would not wait
  absl::Status st = Gemv(dm, dx.as<uint16_t>(), m, dout.as<uint16_t>(), stream, opt);
  if (!st.ok()) return std::string(st.message());
  if (stream != nullptr) Synchronize();  // nor would the download wait for it
  std::vector<uint16_t> got(static_cast<size_t>(m * n + guard));
  dout.Download(got.data(), got.size() * 2);
  std::string err;
  for (int64_t i = m * n; i < m * n + guard; ++i) {
    if (got[i] != kPoison) {
      err = absl::StrCat("a store past the output: value ", i - m * n, " after the last (bits 0x",
                         absl::Hex(got[i]), ")\n");
      break;
    }
  }
  got.resize(static_cast<size_t>(m * n));
  std::vector<double> ref, abs_sum;
  ReferenceGemv(w, x, m, n, k, &ref, &abs_sum);
  return err + CompareToReference(got, ref, abs_sum, m, n);
}

}  // namespace gemvz::testing
