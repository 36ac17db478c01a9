// cuDNN handles shared by the CUDA ops that use cuDNN (convolutions, attention's SDPA graphs).
// Internal to tensor/cuda: only .cpp files compiled with cuDNN's include folder include it.
#pragma once

#include <cudnn.h>

#include <ember/tensor/device.h>

namespace ember::detail {

/// This thread's cuDNN handle for `device`, bound to the device's current stream
/// (Note [Per-thread library handles]). Throws CudaError naming `op` when cuDNN fails, or
/// OutOfMemoryError when it cannot allocate.
cudnnHandle_t cudnn_handle(Device device, const char* op);

}  // namespace ember::detail
