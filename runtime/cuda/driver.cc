#include "runtime/cuda/driver.h"

#include <dlfcn.h>

#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "runtime/common/per_thread_cache.h"

namespace gemvz::internal {
namespace {

#define GEMVZ_STR_(x) #x
#define GEMVZ_XSTR_(x) GEMVZ_STR_(x)

absl::StatusOr<const DriverApi*> LoadDriver() {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* err = dlerror();
    return absl::FailedPreconditionError(absl::StrCat(
        "no CUDA driver: cannot open libcuda.so.1 (", err ? err : "unknown error",
        "); GPU operations need an NVIDIA driver, everything else works without one"));
  }
  auto* api = new DriverApi();  // lives for the process
#define GEMVZ_LOAD_DRIVER_FN(name)                                                        \
  api->name = reinterpret_cast<decltype(api->name)>(dlsym(lib, GEMVZ_XSTR_(name)));       \
  if (api->name == nullptr) {                                                             \
    return absl::FailedPreconditionError(absl::StrCat(                                    \
        "the CUDA driver in libcuda.so.1 lacks ", GEMVZ_XSTR_(name), "; update the driver")); \
  }
  GEMVZ_DRIVER_FUNCTIONS(GEMVZ_LOAD_DRIVER_FN)
#undef GEMVZ_LOAD_DRIVER_FN
#define GEMVZ_LOAD_OPTIONAL_DRIVER_FN(name) \
  api->name = reinterpret_cast<decltype(api->name)>(dlsym(lib, GEMVZ_XSTR_(name)));
  GEMVZ_OPTIONAL_DRIVER_FUNCTIONS(GEMVZ_LOAD_OPTIONAL_DRIVER_FN)
#undef GEMVZ_LOAD_OPTIONAL_DRIVER_FN
  const CUresult r = api->cuInit(0);
  if (r != CUDA_SUCCESS) {
    const char* name = nullptr;
    api->cuGetErrorName(r, &name);
    return absl::FailedPreconditionError(
        absl::StrCat("cuInit failed: ", name ? name : "unknown error", " (no usable GPU?)"));
  }
  return api;
}

}  // namespace

absl::StatusOr<const DriverApi*> Driver() {
  static const absl::StatusOr<const DriverApi*>* const result =
      new absl::StatusOr<const DriverApi*>(LoadDriver());
  return *result;
}

RelaxedCaptureMode::RelaxedCaptureMode() {
  if (auto d = Driver(); d.ok()) {
    exchanged_ = (*d)->cuThreadExchangeStreamCaptureMode(&saved_) == CUDA_SUCCESS;
  }
}

RelaxedCaptureMode::~RelaxedCaptureMode() {
  if (exchanged_) (*Driver())->cuThreadExchangeStreamCaptureMode(&saved_);
}

absl::Status CuResultToStatus(CUresult result, const char* call, const char* file, int line) {
  const char* name = "unknown";
  const char* text = "";
  if (auto d = Driver(); d.ok()) {
    (*d)->cuGetErrorName(result, &name);
    (*d)->cuGetErrorString(result, &text);
  }
  const std::string msg =
      absl::StrCat(call, " failed at ", file, ":", line, ": ", name ? name : "unknown", " (",
                   text ? text : "", ")");
  switch (result) {
    case CUDA_ERROR_OUT_OF_MEMORY:
      return absl::ResourceExhaustedError(msg);
    case CUDA_ERROR_INVALID_VALUE:
    case CUDA_ERROR_INVALID_HANDLE:
    case CUDA_ERROR_INVALID_DEVICE:
      return absl::InvalidArgumentError(msg);
    default:
      return absl::InternalError(msg);
  }
}

int DeviceCount() {
  auto d = Driver();
  if (!d.ok()) return 0;
  int n = 0;
  if ((*d)->cuDeviceGetCount(&n) != CUDA_SUCCESS) return 0;
  return n;
}

namespace {

// The device's primary context, retained at the first call and kept for the process.
absl::StatusOr<CUcontext> RetainedPrimaryContext(int device) {
  static absl::Mutex mu(absl::kConstInit);
  static std::vector<CUcontext>* contexts = new std::vector<CUcontext>();
  if (device >= 0) {
    absl::ReaderMutexLock lock(&mu);
    if (static_cast<size_t>(device) < contexts->size() && (*contexts)[device] != nullptr) {
      return (*contexts)[device];
    }
  }
  auto d = Driver();
  if (!d.ok()) return d.status();
  const int count = DeviceCount();
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("device ", device, " does not exist (", count, " visible)"));
  }
  absl::MutexLock lock(&mu);
  if (contexts->size() < static_cast<size_t>(count)) contexts->resize(count, nullptr);
  if ((*contexts)[device] == nullptr) {
    CUdevice dev;
    CU_RETURN_IF_ERROR(cuDeviceGet(&dev, device));
    CUcontext ctx;
    CU_RETURN_IF_ERROR(cuDevicePrimaryCtxRetain(&ctx, dev));
    (*contexts)[device] = ctx;
  }
  return (*contexts)[device];
}

}  // namespace

absl::StatusOr<CUcontext> PrimaryContext(int device) {
  // Every Gemv enters its device's context: once retained, each thread finds it in its own copy.
  static auto* front = new PerThreadCache<int, CUcontext>();
  return front->FindOrAsk(device, [device] { return RetainedPrimaryContext(device); });
}

absl::StatusOr<ScopedDeviceContext> ScopedDeviceContext::Enter(int device) {
  auto ctx = PrimaryContext(device);
  if (!ctx.ok()) return ctx.status();
  CUcontext current = nullptr;
  CU_RETURN_IF_ERROR(cuCtxGetCurrent(&current));
  if (current == *ctx) return ScopedDeviceContext(*ctx, false);
  CU_RETURN_IF_ERROR(cuCtxPushCurrent(*ctx));
  return ScopedDeviceContext(*ctx, true);
}

ScopedDeviceContext::ScopedDeviceContext(ScopedDeviceContext&& other) noexcept
    : ctx_(other.ctx_), pushed_(other.pushed_) {
  other.pushed_ = false;
}

ScopedDeviceContext::~ScopedDeviceContext() {
  if (!pushed_) return;
  CUcontext popped;
  (*Driver())->cuCtxPopCurrent(&popped);
}

}  // namespace gemvz::internal
