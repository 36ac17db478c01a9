// CUDA loops over a Geometry (Note [Element-wise geometry]): the device twin of cpu/loops.h.
// cuda_elementwise<Out, In...>(g, f, stream) applies `Out f(In...)` (a functor whose
// operator() is __host__ __device__) to every element. Dense loops take a flat grid-stride path;
// others compute each operand's byte offset from the linear index.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "tensor/cuda/check.h"
#include "tensor/detail/iter.h"

namespace ember::detail::cuda_loops {

inline constexpr int kThreads = 256;

inline int blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(b < 65535 * 8 ? (b > 0 ? b : 1) : 65535 * 8);
}

// __global__ templates may have one parameter pack, last; so the input types travel as a
// TypeList and the per-element work lives in its __device__ members.
template <typename... In>
struct TypeList {
  static constexpr int kN = sizeof...(In);

  template <typename Out, typename F, size_t... I>
  __device__ static void dense_at(int64_t i, const Geometry& g, const F& f,
                                  std::index_sequence<I...>) {
    reinterpret_cast<Out*>(g.data[0])[i] = f(reinterpret_cast<const In*>(g.data[I + 1])[i]...);
  }

  template <typename Out, typename F, size_t... I>
  __device__ static void strided_at(int64_t i, const Geometry& g, const F& f,
                                    std::index_sequence<I...>) {
    int64_t off[kN + 1] = {};
    int64_t rem = i;
    for (int d = g.ndim - 1; d >= 0; --d) {
      const int64_t idx = rem % g.sizes[d];
      rem /= g.sizes[d];
#pragma unroll
      for (int k = 0; k < kN + 1; ++k) off[k] += idx * g.strides[k][d];
    }
    *reinterpret_cast<Out*>(g.data[0] + off[0]) =
        f(*reinterpret_cast<const In*>(g.data[I + 1] + off[I + 1])...);
  }
};

template <typename Out, typename Types, typename F>
__global__ void dense_kernel(int64_t n, Geometry g, F f) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    Types::template dense_at<Out>(i, g, f, std::make_index_sequence<Types::kN>{});
  }
}

template <typename Out, typename Types, typename F>
__global__ void strided_kernel(int64_t n, Geometry g, F f) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    Types::template strided_at<Out>(i, g, f, std::make_index_sequence<Types::kN>{});
  }
}

template <typename Out, typename... In, typename F>
void cuda_elementwise(const Geometry& g, F f, cudaStream_t stream) {
  if (g.numel == 0) return;
  const int blocks = blocks_for(g.numel);
  if (g.is_contiguous()) {
    dense_kernel<Out, TypeList<In...>><<<blocks, kThreads, 0, stream>>>(g.numel, g, f);
  } else {
    strided_kernel<Out, TypeList<In...>><<<blocks, kThreads, 0, stream>>>(g.numel, g, f);
  }
  EMBER_CUDA_CHECK(cudaGetLastError());
}

/// The current stream of device d, as a raw handle.
cudaStream_t stream_of(Device d);

}  // namespace ember::detail::cuda_loops
