// cuda::spin: a kernel that only burns time, for tests of stream ordering.
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/cuda/runtime/check.h>
#include <ember/tensor/error.h>

namespace ember::cuda {

namespace {
__global__ void spin_kernel(int64_t cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}
}  // namespace

void spin(int64_t cycles, const Stream& s) {
  EMBER_CHECK(cycles >= 0, "[cuda::spin] expected cycles >= 0, got ", cycles);
  detail::DeviceGuard g(s.device());
  spin_kernel<<<1, 1, 0, detail::raw(s.handle())>>>(cycles);
  EMBER_CUDA_CHECK(cudaGetLastError());
}

void spin(int64_t cycles) { spin(cycles, current_stream()); }

}  // namespace ember::cuda
