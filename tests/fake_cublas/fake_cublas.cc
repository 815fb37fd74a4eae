// A stand-in for libcublas that `gemvz bench` and `gemvz demo` load through GEMVZ_CUBLAS_LIBRARY
// (their documented way to name the library), for tests/cli_test.cc: it exports the functions the
// CLI resolves, and its cublasGemmEx enqueues a memset of the output to zeros on the handle's
// stream instead of the product. A wrong result, finite and on the GPU, captured into a CUDA
// graph like the real one: the CLI's checks must call it wrong, and its exit status and reports
// must say so.
#include <cublas_api.h>
#include <cuda.h>
#include <dlfcn.h>

#include <cstddef>

namespace {

struct FakeHandle {
  cudaStream_t stream = nullptr;
};

using MemsetD16Async = CUresult (*)(CUdeviceptr, unsigned short, size_t, CUstream);

// The driver the CLI has already loaded (dlopen returns the same library).
MemsetD16Async DriverMemset() {
  static MemsetD16Async fn = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    return lib == nullptr ? nullptr
                          : reinterpret_cast<MemsetD16Async>(dlsym(lib, "cuMemsetD16Async"));
  }();
  return fn;
}

}  // namespace

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  *handle = reinterpret_cast<cublasHandle_t>(new FakeHandle());
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
  delete reinterpret_cast<FakeHandle*>(handle);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  reinterpret_cast<FakeHandle*>(handle)->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t, void*, size_t) { return CUBLAS_STATUS_SUCCESS; }

cublasStatus_t cublasSetMathMode(cublasHandle_t, cublasMath_t) { return CUBLAS_STATUS_SUCCESS; }

cublasStatus_t cublasGetVersion_v2(cublasHandle_t, int* version) {
  *version = 1;
  return CUBLAS_STATUS_SUCCESS;
}

const char* cublasGetStatusString(cublasStatus_t status) {
  return status == CUBLAS_STATUS_SUCCESS ? "fake success" : "fake failure";
}

// C [m, n] column-major with leading dimension ldc (the CLI's out^T, N x tokens): all zeros.
cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t, cublasOperation_t, int m,
                            int n, int, const void*, const void*, cudaDataType, int, const void*,
                            cudaDataType, int, const void*, void* C, cudaDataType, int ldc,
                            cublasComputeType_t, cublasGemmAlgo_t) {
  const MemsetD16Async memset = DriverMemset();
  if (memset == nullptr || ldc < m) return CUBLAS_STATUS_EXECUTION_FAILED;
  const CUresult r = memset(reinterpret_cast<CUdeviceptr>(C), 0,
                            static_cast<size_t>(ldc) * static_cast<size_t>(n),
                            reinterpret_cast<FakeHandle*>(handle)->stream);
  return r == CUDA_SUCCESS ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}

}  // extern "C"
