// CUDA loops over a Geometry (Note [Element-wise geometry]): the device twin of cpu/loops.h.
// cuda_elementwise<Out, In...>(g, f, stream) applies `Out f(In...)` (a functor whose
// operator() is __host__ __device__) to every element. Dense loops take a flat grid-stride path;
// others compute each operand's byte offset from the linear index.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include <ember/tensor/cuda/runtime/check.h>
#include <ember/tensor/cuda/fast_div.h>
#include <ember/tensor/detail/iter.h>

namespace ember::detail::cuda_loops {

inline constexpr int kThreads = 256;
inline constexpr int kRun = 4;  ///< consecutive elements per thread in strided loops

inline int blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(b < 65535 * 8 ? (b > 0 ? b : 1) : 65535 * 8);
}

// Note [CUDA element-wise loops]
// Dense loops move 16 bytes per operand per access when every pointer is aligned for it (N =
// 16 / the widest operand's size elements at a time, e.g. 4 float32 or 8 bfloat16: fewer, wider
// memory transactions); a misaligned operand or the last n % N elements take the scalar path in
// the same kernel, so each op instantiates one dense kernel. Strided loops (broadcasts,
// transposes) with fewer than 2^31 elements give each thread kRun elements a block width apart,
// so that a warp's accesses to each operand are consecutive (coalesced, as in the dense loop);
// each element's linear index becomes per-operand offsets through FastDiv (a multiply-high
// instead of a 32-bit division per dim; none for the outermost dim), and all kRun inputs are
// loaded before the first store, so their loads are in flight together (a store may alias an
// input, which would otherwise order each load after the previous store). Larger loops give
// each thread runs of kRun consecutive elements: the linear index of the first becomes offsets
// through 64-bit divisions, the next ones add the innermost strides.

template <typename T, int N>
struct alignas(sizeof(T) * N) Packet {
  T v[N];
};

template <typename... T>
inline constexpr int kMaxSize = static_cast<int>(std::max({sizeof(T)...}));

/// A FastDiv per dim of a Geometry (dims 1.. of a loop of fewer than 2^31 elements).
struct FastDivs {
  FastDiv d[kMaxDims];
};

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

  template <typename Out, int N, typename F, typename... P>
  __device__ static Packet<Out, N> apply(const F& f, const P&... in) {
    Packet<Out, N> o;
#pragma unroll
    for (int j = 0; j < N; ++j) o.v[j] = f(in.v[j]...);
    return o;
  }

  // Packet p (elements p*N .. p*N+N-1) of every operand.
  template <typename Out, int N, typename F, size_t... I>
  __device__ static void packet_at(int64_t p, const Geometry& g, const F& f,
                                   std::index_sequence<I...>) {
    reinterpret_cast<Packet<Out, N>*>(g.data[0])[p] =
        apply<Out, N>(f, reinterpret_cast<const Packet<In, N>*>(g.data[I + 1])[p]...);
  }

  // Fills off[] with each operand's byte offset of element i; returns i's innermost index.
  template <typename Index>
  __device__ static Index offsets_of(Index i, const Geometry& g, int64_t* off) {
#pragma unroll
    for (int k = 0; k < kN + 1; ++k) off[k] = 0;
    Index inner = 0;
    for (int d = g.ndim - 1; d >= 0; --d) {
      const Index size = static_cast<Index>(g.sizes[d]);
      const Index idx = i % size;
      i /= size;
      if (d == g.ndim - 1) inner = idx;
#pragma unroll
      for (int k = 0; k < kN + 1; ++k) off[k] += static_cast<int64_t>(idx) * g.strides[k][d];
    }
    return inner;
  }

  // Fills off[] with each operand's byte offset of element i < 2^31.
  __device__ static void offsets_of32(uint32_t i, const Geometry& g, const FastDivs& dv,
                                      int64_t* off) {
#pragma unroll
    for (int k = 0; k < kN + 1; ++k) off[k] = 0;
    for (int d = g.ndim - 1; d >= 0; --d) {
      uint32_t idx = i;  // the outermost dim's index is what is left
      if (d > 0) {
        const uint32_t q = dv.d[d].div(i);
        idx = i - q * dv.d[d].divisor;
        i = q;
      }
#pragma unroll
      for (int k = 0; k < kN + 1; ++k) off[k] += static_cast<int64_t>(idx) * g.strides[k][d];
    }
  }

  // Elements base + j * blockDim.x + threadIdx.x for j < kRun (those below n): every input is
  // loaded and every result computed before the first store.
  template <typename Out, typename F, size_t... I>
  __device__ static void strided_run32(uint32_t base, uint32_t n, const Geometry& g,
                                       const FastDivs& dv, const F& f,
                                       std::index_sequence<I...>) {
    int64_t off[kRun][kN + 1];
    Out r[kRun];
#pragma unroll
    for (int j = 0; j < kRun; ++j) {
      const uint32_t i = base + j * blockDim.x + threadIdx.x;
      if (i < n) {
        offsets_of32(i, g, dv, off[j]);
        r[j] = f(*reinterpret_cast<const In*>(g.data[I + 1] + off[j][I + 1])...);
      }
    }
#pragma unroll
    for (int j = 0; j < kRun; ++j) {
      if (base + j * blockDim.x + threadIdx.x < n) {
        *reinterpret_cast<Out*>(g.data[0] + off[j][0]) = r[j];
      }
    }
  }

  // Elements i .. i + kRun - 1 (those below n): the offsets of the first come from divisions,
  // the next ones step along the innermost dim while they stay in its row.
  template <typename Out, typename Index, typename F, size_t... I>
  __device__ static void strided_run(Index i, Index n, const Geometry& g, const F& f,
                                     std::index_sequence<I...>) {
    int64_t off[kN + 1];
    Index inner = offsets_of(i, g, off);
    const Index inner_size = static_cast<Index>(g.sizes[g.ndim - 1]);
#pragma unroll
    for (int j = 0; j < kRun; ++j) {
      if (i + j >= n) return;
      if (j > 0) {
        if (++inner == inner_size) {
          inner = offsets_of(static_cast<Index>(i + j), g, off);  // the next row
        } else {
#pragma unroll
          for (int k = 0; k < kN + 1; ++k) off[k] += g.strides[k][g.ndim - 1];
        }
      }
      *reinterpret_cast<Out*>(g.data[0] + off[0]) =
          f(*reinterpret_cast<const In*>(g.data[I + 1] + off[I + 1])...);
    }
  }
};

// Packets [0, packets) first, then the scalar elements [packets * N, n).
template <typename Out, typename Types, int N, typename F>
__global__ void dense_kernel(int64_t n, int64_t packets, Geometry g, F f) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  for (int64_t p = first; p < packets; p += stride) {
    Types::template packet_at<Out, N>(p, g, f, std::make_index_sequence<Types::kN>{});
  }
  for (int64_t i = packets * N + first; i < n; i += stride) {
    Types::template dense_at<Out>(i, g, f, std::make_index_sequence<Types::kN>{});
  }
}

// Loops of n < 2^31 elements: each block takes blockDim.x * kRun consecutive elements at a time
// (grid-stride), each thread kRun of them a block width apart. base + the grid's stride stays
// below 2^32: n < 2^31 and the stride is at most kMaxGrid * kThreads * kRun < 2^31.
template <typename Out, typename Types, typename F>
__global__ void strided_kernel32(uint32_t n, Geometry g, FastDivs dv, F f) {
  const auto seq = std::make_index_sequence<Types::kN>{};
  const uint32_t per_block = blockDim.x * kRun;
  for (uint32_t base = blockIdx.x * per_block; base < n; base += gridDim.x * per_block) {
    Types::template strided_run32<Out>(base, n, g, dv, f, seq);
  }
}

// Larger loops: each thread takes runs of kRun consecutive elements.
template <typename Out, typename Types, typename F>
__global__ void strided_kernel(int64_t n, Geometry g, F f) {
  const auto seq = std::make_index_sequence<Types::kN>{};
  for (int64_t i = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) * kRun; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x * kRun) {
    Types::template strided_run<Out, int64_t>(i, n, g, f, seq);
  }
}

/// The FastDivs of g's dims but the outermost (g.numel < 2^31, so every size fits).
inline FastDivs fast_divs_of(const Geometry& g) {
  FastDivs dv;
  for (int d = 1; d < g.ndim; ++d) dv.d[d] = FastDiv::make(static_cast<uint32_t>(g.sizes[d]));
  return dv;
}

template <typename Out, typename... In, typename F>
void cuda_elementwise(const Geometry& g, F f, cudaStream_t stream) {
  if (g.numel == 0) return;
  if (g.is_contiguous()) {
    constexpr int N = std::max(1, 16 / kMaxSize<Out, In...>);
    bool aligned = true;
    for (int k = 0; k < g.nops; ++k) {
      aligned = aligned && reinterpret_cast<uintptr_t>(g.data[k]) % (g.itemsize[k] * N) == 0;
    }
    const int64_t packets = aligned ? g.numel / N : 0;
    const int blocks = blocks_for(packets > 0 ? packets : g.numel);
    dense_kernel<Out, TypeList<In...>, N><<<blocks, kThreads, 0, stream>>>(g.numel, packets, g, f);
  } else if (g.numel < INT32_MAX) {
    strided_kernel32<Out, TypeList<In...>>
        <<<blocks_for((g.numel + kRun - 1) / kRun), kThreads, 0, stream>>>(
            static_cast<uint32_t>(g.numel), g, fast_divs_of(g), f);
  } else {
    strided_kernel<Out, TypeList<In...>>
        <<<blocks_for((g.numel + kRun - 1) / kRun), kThreads, 0, stream>>>(g.numel, g, f);
  }
  EMBER_CUDA_CHECK(cudaGetLastError());
}

/// The current stream of device d, as a raw handle.
cudaStream_t stream_of(Device d);

}  // namespace ember::detail::cuda_loops
