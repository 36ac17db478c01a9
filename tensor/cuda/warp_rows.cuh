// One warp per row: the launch shape and helpers shared by the row kernels of norm.cu and
// softmax.cu (internal to tensor/cuda/). Every lane of a warp takes the same rows, so warp
// shuffles inside a row's work are safe.
#pragma once

#include <algorithm>
#include <cstdint>

namespace ember::detail::warp_rows {

inline constexpr int kWarpsPerBlock = 8;
inline constexpr int kThreads = 32 * kWarpsPerBlock;
inline constexpr int64_t kMaxGrid = 65535 * 8;

/// Blocks of kThreads for `rows` rows (beyond kMaxGrid blocks, warps take several rows).
inline int grid_for(int64_t rows) {
  return static_cast<int>(
      std::clamp<int64_t>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock, 1, kMaxGrid));
}

/// Calls f(row) for each row of [0, rows) that this thread's warp takes.
template <typename F>
__device__ void for_each_row(int64_t rows, F f) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t r = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / 32; r < rows;
       r += step) {
    f(r);
  }
}

/// Combines v over the warp; every lane holds the result.
template <typename A, typename F>
__device__ A all_reduce(A v, F combine) {
  for (int off = 16; off > 0; off /= 2) v = combine(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

template <typename A>
__device__ A sum(A v) {
  return all_reduce(v, [](A a, A b) { return a + b; });
}

}  // namespace ember::detail::warp_rows
