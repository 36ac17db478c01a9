// Block-level reduction pieces shared by the CUDA reductions (reduce.cu) and the multi-tensor
// norms (foreach.cu): internal to tensor/cuda/. Each takes a functor of
// tensor/detail/reduce_kernels.h (identity, map, combine, project).
#pragma once

#include <cstdint>
#include <type_traits>

namespace ember::detail::cuda_reduce {

template <typename A>
__device__ A shfl_down(A v, int off) {
  if constexpr (sizeof(A) < 4) {
    return static_cast<A>(__shfl_down_sync(0xffffffffu, static_cast<int>(v), off));
  } else if constexpr (std::is_same_v<A, int64_t>) {
    return static_cast<int64_t>(
        __shfl_down_sync(0xffffffffu, static_cast<long long>(v), off));
  } else {
    return __shfl_down_sync(0xffffffffu, v, off);
  }
}

// Combines v over the block (blockDim.x a multiple of 32, at most 1024); the result is valid in
// thread 0. `smem` holds 32 values.
template <typename Red>
__device__ typename Red::acc block_reduce(typename Red::acc v, const Red& r,
                                          typename Red::acc* smem) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int off = 16; off > 0; off /= 2) v = r.combine(v, shfl_down(v, off));
  if (blockDim.x <= 32) return v;
  __syncthreads();  // smem may still be read from a previous call
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x / 32) ? smem[lane] : r.identity();
    for (int off = 16; off > 0; off /= 2) v = r.combine(v, shfl_down(v, off));
  }
  return v;
}

// Combines r.map(x[at(i)], c) for i = b, b + step, ... < e, four loads in flight per thread
// (independent accumulators, combined at the end: a bandwidth-bound loop needs the parallelism).
template <typename T, typename Red, typename At>
__device__ typename Red::acc fold(const T* x, int64_t b, int64_t e, int64_t step, const Red& r,
                                  typename Red::acc c, At at) {
  using A = typename Red::acc;
  A v0 = r.identity(), v1 = r.identity(), v2 = r.identity(), v3 = r.identity();
  int64_t i = b;
  for (; i + 3 * step < e; i += 4 * step) {
    const T x0 = x[at(i)], x1 = x[at(i + step)], x2 = x[at(i + 2 * step)],
            x3 = x[at(i + 3 * step)];
    v0 = r.combine(v0, r.map(x0, c));
    v1 = r.combine(v1, r.map(x1, c));
    v2 = r.combine(v2, r.map(x2, c));
    v3 = r.combine(v3, r.map(x3, c));
  }
  for (; i < e; i += step) v0 = r.combine(v0, r.map(x[at(i)], c));
  return r.combine(r.combine(v0, v1), r.combine(v2, v3));
}

template <typename T, typename Red>
__device__ typename Red::acc fold(const T* x, int64_t b, int64_t e, int64_t step, const Red& r,
                                  typename Red::acc c) {
  return fold(x, b, e, step, r, c, [](int64_t i) { return i; });
}

// Combines the cpr partial values of each row.
template <typename O, typename Red>
__global__ void reduce_partials_kernel(int64_t rows, const typename Red::acc* partial, O* out,
                                       Red r, const typename Red::acc* ctx, int64_t cpr) {
  using A = typename Red::acc;
  __shared__ A smem[32];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    A v = r.identity();
    for (int64_t i = threadIdx.x; i < cpr; i += blockDim.x) v = r.combine(v, partial[row * cpr + i]);
    v = block_reduce(v, r, smem);
    if (threadIdx.x == 0) out[row] = r.template project<O>(v, ctx ? ctx[row] : A{});
  }
}

}  // namespace ember::detail::cuda_reduce
