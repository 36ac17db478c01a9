// CUDA kernels of the fused optimizer updates (tensor/ops/optim.h): a grid-stride loop applying the
// functors of tensor/detail/optim_kernels.h, so the GPU runs the math the CPU tests check.
#include <ember/tensor/cuda/loops.cuh>
#include <ember/tensor/detail/optim_kernels.h>
#include <ember/tensor/dtype.h>

namespace ember::detail {

namespace {

template <typename T, typename A>
__global__ void adam_kernel(AdamFunctor<A> f, AdamStepArgs s, T* p, const T* g, T* m, T* v, T* vmax,
                            int64_t n) {
  if (s.found_inf_dev != nullptr && *s.found_inf_dev != 0.0f) return;
  if (s.step_dev != nullptr) f = make_adam_functor<A>(s, *s.lr_dev, *s.step_dev);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    f(p[i], g[i], m[i], v[i], vmax ? vmax + i : nullptr);
  }
}

template <typename T, typename A>
__global__ void sgd_kernel(SgdFunctor<A> f, T* p, const T* g, T* buf, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    f(p[i], g[i], buf ? buf + i : nullptr);
  }
}

}  // namespace

void adam_update_cuda(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                      const Tensor& exp_avg_sq, const Tensor& max_exp_avg_sq,
                      const AdamStepArgs& args) {
  cuda::detail::DeviceGuard guard(param.device().index);
  cudaStream_t stream = cuda_loops::stream_of(param.device());
  const int64_t n = param.numel();
  EMBER_DISPATCH_FLOATING(param.dtype(), "adam_update_", [&]<typename T>() {
    using A = acc_t<T>;
    T* vmax = args.amsgrad ? static_cast<T*>(max_exp_avg_sq.data_ptr()) : nullptr;
    adam_kernel<T, A><<<cuda_loops::blocks_for(n), cuda_loops::kThreads, 0, stream>>>(
        make_adam_functor<A>(args), args, static_cast<T*>(param.data_ptr()),
        static_cast<const T*>(grad.data_ptr()), static_cast<T*>(exp_avg.data_ptr()),
        static_cast<T*>(exp_avg_sq.data_ptr()), vmax, n);
  });
  EMBER_CUDA_CHECK(cudaGetLastError());
}

void sgd_update_cuda(const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer,
                     const SgdStepArgs& args) {
  cuda::detail::DeviceGuard guard(param.device().index);
  cudaStream_t stream = cuda_loops::stream_of(param.device());
  const int64_t n = param.numel();
  EMBER_DISPATCH_FLOATING(param.dtype(), "sgd_update_", [&]<typename T>() {
    using A = acc_t<T>;
    T* buf = args.momentum != 0 ? static_cast<T*>(momentum_buffer.data_ptr()) : nullptr;
    sgd_kernel<T, A><<<cuda_loops::blocks_for(n), cuda_loops::kThreads, 0, stream>>>(
        make_sgd_functor<A>(args), static_cast<T*>(param.data_ptr()),
        static_cast<const T*>(grad.data_ptr()), buf, n);
  });
  EMBER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ember::detail
