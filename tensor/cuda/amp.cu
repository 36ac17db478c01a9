// CUDA kernel of the fused unscale (tensor/ops/amp.h): a grid-stride loop applying the functor of
// tensor/detail/amp_kernels.h, so the GPU runs the math the CPU tests check. Threads that see a
// non-finite value all store 1.0f into the flag; the race is benign (same value, as in torch).
#include <ember/tensor/cuda/loops.cuh>
#include <ember/tensor/detail/amp_kernels.h>
#include <ember/tensor/dtype.h>

namespace ember::detail {

namespace {

template <typename T, typename A>
__global__ void unscale_kernel(UnscaleFunctor<A> f, const float* inv_dev, T* g, float* found_inf,
                               int64_t n) {
  if (inv_dev != nullptr) f.inv_scale = static_cast<A>(*inv_dev);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (f(g[i])) *found_inf = 1.0f;
  }
}

__global__ void update_scale_kernel(float* scale, int32_t* growth_tracker, const float* found_inf,
                                    double growth_factor, double backoff_factor, int64_t interval) {
  amp_update_scale(scale, growth_tracker, *found_inf, growth_factor, backoff_factor, interval);
}

}  // namespace

void amp_update_scale_cuda(const Tensor& scale, const Tensor& growth_tracker,
                           const Tensor& found_inf, double growth_factor, double backoff_factor,
                           int64_t interval) {
  cuda::detail::DeviceGuard guard(scale.device().index);
  update_scale_kernel<<<1, 1, 0, cuda_loops::stream_of(scale.device())>>>(
      static_cast<float*>(scale.data_ptr()), static_cast<int32_t*>(growth_tracker.data_ptr()),
      static_cast<const float*>(found_inf.data_ptr()), growth_factor, backoff_factor, interval);
  EMBER_CUDA_CHECK(cudaGetLastError());
}

void amp_unscale_cuda(const Tensor& grad, const Tensor& found_inf, double inv_scale,
                      const float* inv_scale_dev) {
  cuda::detail::DeviceGuard guard(grad.device().index);
  cudaStream_t stream = cuda_loops::stream_of(grad.device());
  const int64_t n = grad.numel();
  EMBER_DISPATCH_FLOATING(grad.dtype(), "amp_unscale_", [&]<typename T>() {
    using A = acc_t<T>;
    unscale_kernel<T, A><<<cuda_loops::blocks_for(n), cuda_loops::kThreads, 0, stream>>>(
        UnscaleFunctor<A>{static_cast<A>(inv_scale)}, inv_scale_dev,
        static_cast<T*>(grad.data_ptr()), static_cast<float*>(found_inf.data_ptr()), n);
  });
  EMBER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ember::detail
