// Pooling on CUDA: one thread per output element (forward) or input element (backward, which
// gathers), running the shared math of detail/conv_kernels.h. Also the per-channel bias add of
// conv2d. Instantiated for the four floating dtypes only.
#include <cuda_runtime.h>

#include <ember/tensor/cuda/runtime/check.h>
#include <ember/tensor/cuda/loops.cuh>
#include <ember/tensor/detail/conv_kernels.h>

namespace ember::detail {

namespace {

using cuda_loops::blocks_for;
using cuda_loops::kThreads;
using cuda_loops::stream_of;

#define EMBER_GRID_STRIDE(i, n)                                                  \
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; \
       i < (n); i += static_cast<int64_t>(gridDim.x) * blockDim.x)

template <typename T>
__global__ void max_pool_kernel(const T* in, T* out, int64_t* idx, PoolGeom g) {
  const int64_t n = g.planes * g.oh * g.ow;
  EMBER_GRID_STRIDE(i, n) {
    const int64_t ow = i % g.ow, oh = (i / g.ow) % g.oh, p = i / (g.ow * g.oh);
    pool::max_at(in + p * g.h * g.w, g, oh, ow, out + i, idx ? idx + i : nullptr);
  }
}

template <typename T>
__global__ void max_pool_backward_kernel(const T* go, const int64_t* idx, T* gi, PoolGeom g) {
  const int64_t n = g.planes * g.h * g.w;
  EMBER_GRID_STRIDE(i, n) {
    const int64_t iw = i % g.w, ih = (i / g.w) % g.h, p = i / (g.w * g.h);
    const int64_t off = p * g.oh * g.ow;
    gi[i] = pool::max_backward_at(go + off, idx + off, g, ih, iw);
  }
}

template <typename T>
__global__ void avg_pool_kernel(const T* in, T* out, PoolGeom g) {
  const int64_t n = g.planes * g.oh * g.ow;
  EMBER_GRID_STRIDE(i, n) {
    const int64_t ow = i % g.ow, oh = (i / g.ow) % g.oh, p = i / (g.ow * g.oh);
    out[i] = pool::avg_at(in + p * g.h * g.w, g, oh, ow);
  }
}

template <typename T>
__global__ void avg_pool_backward_kernel(const T* go, T* gi, PoolGeom g) {
  const int64_t n = g.planes * g.h * g.w;
  EMBER_GRID_STRIDE(i, n) {
    const int64_t iw = i % g.w, ih = (i / g.w) % g.h, p = i / (g.w * g.h);
    gi[i] = pool::avg_backward_at(go + p * g.oh * g.ow, g, ih, iw);
  }
}

template <typename T>
__global__ void adaptive_avg_kernel(const T* in, T* out, PoolGeom g) {
  const int64_t n = g.planes * g.oh * g.ow;
  EMBER_GRID_STRIDE(i, n) {
    const int64_t ow = i % g.ow, oh = (i / g.ow) % g.oh, p = i / (g.ow * g.oh);
    out[i] = pool::adaptive_avg_at(in + p * g.h * g.w, g, oh, ow);
  }
}

template <typename T>
__global__ void adaptive_avg_backward_kernel(const T* go, T* gi, PoolGeom g) {
  const int64_t n = g.planes * g.h * g.w;
  EMBER_GRID_STRIDE(i, n) {
    const int64_t iw = i % g.w, ih = (i / g.w) % g.h, p = i / (g.w * g.h);
    gi[i] = pool::adaptive_avg_backward_at(go + p * g.oh * g.ow, g, ih, iw);
  }
}

template <typename T>
__global__ void channel_bias_kernel(T* out, const T* bias, int64_t n, int64_t channels,
                                    int64_t plane) {
  EMBER_GRID_STRIDE(i, n) {
    const int64_t c = (i / plane) % channels;
    out[i] = T(static_cast<acc_t<T>>(out[i]) + static_cast<acc_t<T>>(bias[c]));
  }
}

// Launches `launch(blocks, stream)` for n elements on t's device, with T bound to t's dtype.
template <typename Fn>
void launch_on(const char* op, const Tensor& t, int64_t n, Fn&& fn) {
  if (n == 0) return;
  cuda::detail::DeviceGuard guard(t.device().index);
  cudaStream_t s = stream_of(t.device());
  EMBER_DISPATCH_FLOATING(t.dtype(), op, [&]<typename T>() {
    fn.template operator()<T>(blocks_for(n), s);
  });
  EMBER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void max_pool2d_cuda(const Tensor& out, const Tensor& indices, const Tensor& input,
                     const PoolGeom& g) {
  launch_on("max_pool2d", input, out.numel(), [&]<typename T>(int blocks, cudaStream_t s) {
    max_pool_kernel<T><<<blocks, kThreads, 0, s>>>(
        input.data<T>(), out.data<T>(), indices.defined() ? indices.data<int64_t>() : nullptr, g);
  });
}

void max_pool2d_backward_cuda(const Tensor& grad_input, const Tensor& grad_output,
                              const Tensor& indices, const PoolGeom& g) {
  launch_on("max_pool2d_backward", grad_input, grad_input.numel(),
            [&]<typename T>(int blocks, cudaStream_t s) {
              max_pool_backward_kernel<T><<<blocks, kThreads, 0, s>>>(
                  grad_output.data<T>(), indices.data<int64_t>(), grad_input.data<T>(), g);
            });
}

void avg_pool2d_cuda(const Tensor& out, const Tensor& input, const PoolGeom& g) {
  launch_on("avg_pool2d", input, out.numel(), [&]<typename T>(int blocks, cudaStream_t s) {
    avg_pool_kernel<T><<<blocks, kThreads, 0, s>>>(input.data<T>(), out.data<T>(), g);
  });
}

void avg_pool2d_backward_cuda(const Tensor& grad_input, const Tensor& grad_output,
                              const PoolGeom& g) {
  launch_on("avg_pool2d_backward", grad_input, grad_input.numel(),
            [&]<typename T>(int blocks, cudaStream_t s) {
              avg_pool_backward_kernel<T><<<blocks, kThreads, 0, s>>>(grad_output.data<T>(),
                                                                      grad_input.data<T>(), g);
            });
}

void adaptive_avg_pool2d_cuda(const Tensor& out, const Tensor& input, const PoolGeom& g) {
  launch_on("adaptive_avg_pool2d", input, out.numel(),
            [&]<typename T>(int blocks, cudaStream_t s) {
              adaptive_avg_kernel<T><<<blocks, kThreads, 0, s>>>(input.data<T>(), out.data<T>(),
                                                                 g);
            });
}

void adaptive_avg_pool2d_backward_cuda(const Tensor& grad_input, const Tensor& grad_output,
                                       const PoolGeom& g) {
  launch_on("adaptive_avg_pool2d_backward", grad_input, grad_input.numel(),
            [&]<typename T>(int blocks, cudaStream_t s) {
              adaptive_avg_backward_kernel<T><<<blocks, kThreads, 0, s>>>(
                  grad_output.data<T>(), grad_input.data<T>(), g);
            });
}

void add_channel_bias_cuda(const Tensor& out, const Tensor& bias) {
  const int64_t plane = out.size(2) * out.size(3);
  launch_on("conv2d", out, out.numel(), [&]<typename T>(int blocks, cudaStream_t s) {
    channel_bias_kernel<T><<<blocks, kThreads, 0, s>>>(out.data<T>(), bias.data<T>(), out.numel(),
                                                       out.size(1), plane);
  });
}

}  // namespace ember::detail
