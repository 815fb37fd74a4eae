// GPU test helpers: RAII device buffers over the dlopen'ed driver, the skip-without-GPU guard,
// and the double-precision reference GEMV with the BF16-output error check.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gemvz/gemv.h"
#include "gtest/gtest.h"

namespace gemvz::testing {

// Skips the test (with the reason) when there is no driver or no GPU.
#define GEMVZ_REQUIRE_GPU()                                          \
  do {                                                               \
    if (::gemvz::internal::DeviceCount() == 0) {                     \
      GTEST_SKIP() << "no GPU: " << ::gemvz::testing::NoGpuReason(); \
    }                                                                \
  } while (0)

// Skips the test (with the reason) unless at least `n` GPUs are present.
#define GEMVZ_REQUIRE_GPUS(n)                                                                 \
  do {                                                                                        \
    GEMVZ_REQUIRE_GPU();                                                                      \
    if (::gemvz::internal::DeviceCount() < (n)) {                                             \
      GTEST_SKIP() << "needs " << (n) << " GPUs, found " << ::gemvz::internal::DeviceCount(); \
    }                                                                                         \
  } while (0)

std::string NoGpuReason();

// Device memory on device 0's primary context.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T>
  T* as() const {
    return reinterpret_cast<T*>(ptr_);
  }
  CUdeviceptr ptr() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  void Upload(const void* src, size_t bytes);
  void Download(void* dst, size_t bytes) const;
  void Fill16(uint16_t value);  // poison

 private:
  CUdeviceptr ptr_ = 0;
  size_t bytes_ = 0;
};

// A stream of device 0's primary context, the context the library's calls enter (made current on
// this thread first: cuStreamCreate makes the stream in the current context). It converts to
// CUstream, to go where a stream goes. On destruction, also when an assertion returns early: the
// stream's Gemv workspace released (a later stream may get the same handle) and the stream
// destroyed. A failure to make it fails the test, and leaves ok() false: a test should assert
// ok(), since a null stream would go on as the legacy default stream.
class TestStream {
 public:
  explicit TestStream(unsigned flags = CU_STREAM_NON_BLOCKING);
  ~TestStream();
  TestStream(const TestStream&) = delete;
  TestStream& operator=(const TestStream&) = delete;
  operator CUstream() const { return stream_; }  // NOLINT(google-explicit-constructor)
  CUcontext context() const { return context_; }
  bool ok() const { return stream_ != nullptr; }

 private:
  CUcontext context_ = nullptr;
  CUstream stream_ = nullptr;
};

// out[m][n] = sum_k w[n][k] * x[m][k], in double, multithreaded. Also returns sum |w x| per
// output (the scale of FP32 accumulation error).
void ReferenceGemv(const std::vector<uint16_t>& w, const std::vector<uint16_t>& x, int64_t m,
                   int64_t n, int64_t k, std::vector<double>* out, std::vector<double>* abs_sum);

// Checks BF16 results against the reference: |got - ref| <= 2^-8 |ref| + 2^-16 sum|w x| (BF16
// output rounding is 2^-9 relative; FP32 accumulation in a different order adds a little).
// Returns "" when all match, else a description of the first few mismatches.
std::string CompareToReference(const std::vector<uint16_t>& got, const std::vector<double>& ref,
                               const std::vector<double>& abs_sum, int64_t m, int64_t n);

void Synchronize();

// Whether `p` is the start of a live device allocation (what a freed buffer no longer is), asked
// in device 0's primary context, made current first whatever a test left current.
bool IsAllocationStart(CUdeviceptr p);

// A NaN: any output a GEMV leaves unwritten fails the comparison with the reference.
inline constexpr uint16_t kPoison = 0x7FC1;

// Runs Gemv on `dm` (uploaded from the BF16 weights w) with x (m rows) on `stream` (nullptr: the
// legacy default stream) and compares with the double reference of w; returns the error text,
// "" when right. The output is poisoned and followed by a poisoned guard of one more token row
// and 64 values, which must stay untouched: a store past the last token (a kernel's token block
// reaches past m when the last launch is short) or past the last row lands there, where the
// allocation's own slack would have hidden it.
std::string CheckGemv(const DeviceMatrix& dm, const std::vector<uint16_t>& w,
                      const std::vector<uint16_t>& x, int64_t m, const GemvOptions& opt = {},
                      CUstream stream = nullptr);

}  // namespace gemvz::testing
