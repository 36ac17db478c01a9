// Error checking for CUDA runtime calls (internal to tensor/cuda/).
#pragma once

#include <cuda_runtime_api.h>

#include <ember/tensor/error.h>

namespace ember::cuda::detail {
/// For the errors a kernel leaves behind (illegal address, device assert, launch failure...),
/// which CUDA reports at whatever call comes next: the call named may not be the culprit.
inline const char* async_error_hint(cudaError_t e) {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorAssert:
    case cudaErrorLaunchFailure:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorHardwareStackError:
    case cudaErrorLaunchTimeout:
      return " (CUDA reports a kernel's error at a later call, so an earlier kernel may have "
             "caused it; run with CUDA_LAUNCH_BLOCKING=1 to have it reported at its launch)";
    default:
      return "";
  }
}
}  // namespace ember::cuda::detail

#define EMBER_CUDA_CHECK(expr)                                                                   \
  do {                                                                                           \
    cudaError_t ember_err_ = (expr);                                                             \
    if (ember_err_ != cudaSuccess) {                                                             \
      (void)cudaGetLastError();                                                                  \
      if (ember_err_ == cudaErrorMemoryAllocation) {                                             \
        throw ::ember::OutOfMemoryError(::ember::detail::str_cat(                                \
            "CUDA out of memory in ", #expr, ": ", cudaGetErrorString(ember_err_)));             \
      }                                                                                          \
      throw ::ember::CudaError(::ember::detail::str_cat(                                         \
          "CUDA error in ", #expr, " at ", __FILE__, ":", __LINE__, ": ",                        \
          cudaGetErrorString(ember_err_), ::ember::cuda::detail::async_error_hint(ember_err_))); \
    }                                                                                            \
  } while (0)

namespace ember::cuda {
bool has_context(int device);
}

namespace ember::cuda::detail {
/// Sets the device for the scope and restores the previous one after, unless the previous one
/// has no context yet: since CUDA 12 cudaSetDevice creates the primary context, so restoring
/// device 0 in a rank that only ever used device 3 would cost every rank a context on GPU 0
/// (PyTorch's guards skip it the same way). Work after the scope then stays on `device`.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    EMBER_CUDA_CHECK(cudaGetDevice(&prev_));
    if (device != prev_) EMBER_CUDA_CHECK(cudaSetDevice(device));
    cur_ = device;
  }
  ~DeviceGuard() {
    if (cur_ != prev_ && has_context(prev_)) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0, cur_ = 0;
};
inline cudaStream_t raw(void* h) { return static_cast<cudaStream_t>(h); }
}  // namespace ember::cuda::detail
