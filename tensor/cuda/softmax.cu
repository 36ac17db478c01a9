// CUDA softmax / log_softmax over any dim of a contiguous tensor viewed as [outer, D, inner].
// inner == 1: one block per row (max, sum of exp, write), combined with warp shuffles and
// shared memory. inner > 1: one thread per (outer, column), reading coalesced along inner.
#include <algorithm>

#include <ember/tensor/cuda/check.h>
#include <ember/tensor/cuda/loops.cuh>
#include <ember/tensor/detail/reduce_kernels.h>

namespace ember::detail {

namespace {

using cuda::detail::DeviceGuard;
using cuda_loops::stream_of;

constexpr int kMaxGrid = 65535 * 8;

template <typename A, typename F>
__device__ A block_all_reduce(A v, F combine, A* smem) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int off = 16; off > 0; off /= 2) v = combine(v, __shfl_down_sync(0xffffffffu, v, off));
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  const int nw = blockDim.x / 32;
  A r = smem[0];
  for (int w = 1; w < nw; ++w) r = combine(r, smem[w]);
  return r;
}

template <typename T>
__global__ void softmax_inner_kernel(const T* x, T* y, int64_t rows, int64_t D, bool log) {
  using A = acc_t<T>;
  __shared__ A smem[32];
  auto mx = [](A a, A b) { return max_nan(a, b); };
  auto add = [](A a, A b) { return a + b; };
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * D;
    T* yr = y + row * D;
    // One pass for the row's max and sum of exp (online: the sum is rescaled when the max
    // grows), so x is read twice instead of three times.
    A m = lowest_v<A>(), s = 0;
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
      const A v = convert<A>(xr[i]);
      if (v > m) {
        s = s * exp_v(m - v) + A(1);
        m = v;
      } else {
        // v == m: 1 even for -inf (scaled to 0 below unless the whole row is -inf, whose
        // result is NaN as in the three-pass form); a NaN v makes s NaN, as it should.
        s += v == m ? A(1) : exp_v(v - m);
      }
    }
    const A row_max = block_all_reduce(m, mx, smem);
    s = block_all_reduce(s == A(0) ? A(0) : s * exp_v(m - row_max), add, smem);
    m = row_max;
    if (log) {
      const A lse = log_v(s);
      for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
        yr[i] = convert<T>((convert<A>(xr[i]) - m) - lse);
      }
    } else {
      const A inv = A(1) / s;
      for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
        yr[i] = convert<T>(exp_v(convert<A>(xr[i]) - m) * inv);
      }
    }
  }
}

template <typename T>
__global__ void softmax_outer_kernel(const T* x, T* y, int64_t outer, int64_t D, int64_t inner,
                                     bool log) {
  using A = acc_t<T>;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < outer * inner;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t o = t / inner, k = t % inner;
    const T* xc = x + o * D * inner + k;
    T* yc = y + o * D * inner + k;
    A m = lowest_v<A>();
    for (int64_t d = 0; d < D; ++d) m = max_nan(m, convert<A>(xc[d * inner]));
    A s = 0;
    for (int64_t d = 0; d < D; ++d) s += exp_v(convert<A>(xc[d * inner]) - m);
    if (log) {
      const A lse = log_v(s);
      for (int64_t d = 0; d < D; ++d) {
        yc[d * inner] = convert<T>((convert<A>(xc[d * inner]) - m) - lse);
      }
    } else {
      const A inv = A(1) / s;
      for (int64_t d = 0; d < D; ++d) {
        yc[d * inner] = convert<T>(exp_v(convert<A>(xc[d * inner]) - m) * inv);
      }
    }
  }
}

}  // namespace

void softmax_cuda(const Tensor& out, const Tensor& in, int64_t dim, bool log) {
  DeviceGuard guard(in.device().index);
  cudaStream_t s = stream_of(in.device());
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= in.size(d);
  for (int64_t d = dim + 1; d < in.dim(); ++d) inner *= in.size(d);
  const int64_t D = in.size(dim);
  if (in.numel() == 0) return;
  EMBER_DISPATCH_FLOATING(in.dtype(), log ? "log_softmax" : "softmax", [&]<typename T>() {
    const T* x = in.data<T>();
    T* y = out.data<T>();
    if (inner == 1) {
      int threads = 32;
      while (threads < 512 && threads < D) threads *= 2;
      const int grid = static_cast<int>(std::min<int64_t>(outer, kMaxGrid));
      softmax_inner_kernel<<<grid, threads, 0, s>>>(x, y, outer, D, log);
    } else {
      const int64_t n = outer * inner;
      const int grid = static_cast<int>(std::min<int64_t>((n + 255) / 256, kMaxGrid));
      softmax_outer_kernel<<<grid, 256, 0, s>>>(x, y, outer, D, inner, log);
    }
    EMBER_CUDA_CHECK(cudaGetLastError());
  });
}

}  // namespace ember::detail
