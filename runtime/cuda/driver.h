// The CUDA Driver API, opened from libcuda.so.1 at run time and never linked, so that everything
// that needs no GPU (packing, NVRTC, warm-up, CPU tests) works on machines without a driver.
#pragma once

#include <cuda.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace gemvz::internal {

// X-macro list of every driver entry point the library uses. The names are cuda.h's macros, so
// they expand to the versioned symbols (cuMemAlloc -> cuMemAlloc_v2) before being looked up.
#define GEMVZ_DRIVER_FUNCTIONS(X) \
  X(cuInit)                       \
  X(cuDriverGetVersion)           \
  X(cuGetErrorName)               \
  X(cuGetErrorString)             \
  X(cuDeviceGet)                  \
  X(cuDeviceGetCount)             \
  X(cuDeviceGetName)              \
  X(cuDeviceGetAttribute)         \
  X(cuDeviceTotalMem)             \
  X(cuDevicePrimaryCtxRetain)     \
  X(cuDevicePrimaryCtxRelease)    \
  X(cuCtxGetCurrent)              \
  X(cuCtxSetCurrent)              \
  X(cuCtxPushCurrent)             \
  X(cuCtxPopCurrent)              \
  X(cuCtxGetDevice)               \
  X(cuCtxSynchronize)             \
  X(cuMemAlloc)                   \
  X(cuMemFree)                    \
  X(cuMemGetInfo)                 \
  X(cuMemcpyHtoD)                 \
  X(cuMemcpyDtoH)                 \
  X(cuMemcpyDtoD)                 \
  X(cuMemcpyHtoDAsync)            \
  X(cuMemcpyDtoHAsync)            \
  X(cuMemcpyDtoDAsync)            \
  X(cuMemcpy2DAsync)              \
  X(cuMemsetD8)                   \
  X(cuMemsetD8Async)              \
  X(cuMemsetD16)                  \
  X(cuMemsetD16Async)             \
  X(cuPointerGetAttribute)        \
  X(cuModuleLoadData)             \
  X(cuModuleUnload)               \
  X(cuModuleGetFunction)          \
  X(cuFuncGetAttribute)           \
  X(cuFuncSetAttribute)           \
  X(cuOccupancyMaxActiveBlocksPerMultiprocessor) \
  X(cuLaunchKernel)               \
  X(cuStreamCreate)               \
  X(cuStreamDestroy)              \
  X(cuStreamSynchronize)          \
  X(cuStreamGetCtx)               \
  X(cuStreamIsCapturing)          \
  X(cuStreamBeginCapture)         \
  X(cuStreamEndCapture)           \
  X(cuThreadExchangeStreamCaptureMode) \
  X(cuEventCreate)                \
  X(cuEventDestroy)               \
  X(cuEventRecord)                \
  X(cuEventSynchronize)           \
  X(cuEventElapsedTime)           \
  X(cuGraphInstantiate)           \
  X(cuGraphLaunch)                \
  X(cuGraphDestroy)               \
  X(cuGraphExecDestroy)           \
  X(cuGraphGetNodes)              \
  X(cuGraphKernelNodeGetParams)

// Entry points the library can do without: null when the driver lacks them (cuLaunchKernelEx
// needs a CUDA 12 driver; without it GEMVs launch without programmatic dependent launch).
#define GEMVZ_OPTIONAL_DRIVER_FUNCTIONS(X) X(cuLaunchKernelEx)

struct DriverApi {
#define GEMVZ_DECLARE_DRIVER_FN(name) decltype(&::name) name = nullptr;
  GEMVZ_DRIVER_FUNCTIONS(GEMVZ_DECLARE_DRIVER_FN)
  GEMVZ_OPTIONAL_DRIVER_FUNCTIONS(GEMVZ_DECLARE_DRIVER_FN)
#undef GEMVZ_DECLARE_DRIVER_FN
};

// The loaded and initialised driver (cuInit done), or why there is none: libcuda.so.1 missing,
// a symbol missing, or cuInit failing (no device). The result is computed once.
absl::StatusOr<const DriverApi*> Driver();

// Turns a CUresult into a Status naming the call, its place, the error's name and description.
absl::Status CuResultToStatus(CUresult result, const char* call, const char* file, int line);

// Number of visible GPUs; 0 when there is no driver or no device.
int DeviceCount();

// Makes the primary context of `device` current on this thread for the scope's lifetime and
// restores the previous one after.
class ScopedDeviceContext {
 public:
  static absl::StatusOr<ScopedDeviceContext> Enter(int device);
  ScopedDeviceContext(ScopedDeviceContext&& other) noexcept;
  ScopedDeviceContext& operator=(ScopedDeviceContext&&) = delete;
  ~ScopedDeviceContext();
  CUcontext context() const { return ctx_; }

 private:
  ScopedDeviceContext(CUcontext ctx, bool pushed) : ctx_(ctx), pushed_(pushed) {}
  CUcontext ctx_ = nullptr;
  bool pushed_ = false;
};

// While it lives, this thread's stream-capture mode is relaxed: the library's own allocations,
// module loads and synchronisations on its own streams are then neither refused nor allowed to
// invalidate a graph that another thread is capturing in the default (global) mode. Only for
// calls that touch no stream being captured.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode();
  ~RelaxedCaptureMode();
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  CUstreamCaptureMode saved_ = CU_STREAM_CAPTURE_MODE_RELAXED;
  bool exchanged_ = false;
};

// The primary context of `device`, retained once for the process's lifetime.
absl::StatusOr<CUcontext> PrimaryContext(int device);

}  // namespace gemvz::internal

// Runs a driver call through the loaded table and returns a Status from the enclosing function on
// failure: CU_RETURN_IF_ERROR(cuMemAlloc(&p, bytes));
#define CU_RETURN_IF_ERROR(call)                                                           \
  do {                                                                                     \
    auto _gemvz_drv = ::gemvz::internal::Driver();                                         \
    if (!_gemvz_drv.ok()) return _gemvz_drv.status();                                      \
    const CUresult _gemvz_res = (*_gemvz_drv)->call;                                       \
    if (_gemvz_res != CUDA_SUCCESS)                                                        \
      return ::gemvz::internal::CuResultToStatus(_gemvz_res, #call, __FILE__, __LINE__);   \
  } while (0)
