// CUDA reductions (Note [Reduction geometry], Note [Reduction functors] in
// detail/reduce_kernels.h): the same functors as the CPU, folded by
//   inner: blocks over dense rows; each thread strides over its row piece, then warp shuffles
//          and shared memory combine the block. Long rows with few outputs are split over
//          several blocks whose partial results a second launch combines.
//   outer: threads over the dense kept dim (coalesced loads), blockDim.y threads splitting the
//          reduced rows, combined through shared memory.
// Any other layout is first copied to (kept..., reduced...) order on the device.
#include <algorithm>
#include <vector>

#include <ember/tensor/cuda/runtime/check.h>
#include <ember/tensor/cuda/loops.cuh>
#include <ember/tensor/cuda/reduce_block.cuh>
#include <ember/tensor/detail/reduce_kernels.h>

namespace ember::detail {

namespace {

using cuda::detail::DeviceGuard;
using cuda_loops::stream_of;
using cuda_reduce::block_reduce;
using cuda_reduce::fold;
using cuda_reduce::reduce_partials_kernel;
using cuda_reduce::shfl_down;

constexpr int kMaxBlock = 256;
constexpr int kMaxGrid = 65535 * 8;
// Blocks that keep every SM of a large GPU busy (an H100 has 132 SMs, each holding up to
// 8 blocks of 256 threads).
constexpr int64_t kOuterFillBlocks = 1024;

// Work item w = (row, piece): piece `piece` of row `row` (cpr pieces per row of `plen`).
template <typename T, typename O, typename Red>
__global__ void reduce_inner_kernel(ReduceGeom g, const T* in, O* out,
                                    typename Red::acc* partial, Red r,
                                    const typename Red::acc* ctx, int64_t cpr, int64_t plen) {
  using A = typename Red::acc;
  __shared__ A smem[32];
  const int64_t R = g.red_numel;
  const int64_t items = g.num_out * cpr;
  for (int64_t w = blockIdx.x; w < items; w += gridDim.x) {
    const int64_t row = w / cpr, piece = w % cpr;
    const T* x = in + g.keep_offset(row);
    const A c = ctx ? ctx[row] : A{};
    const int64_t b = piece * plen, e = min(R, b + plen);
    A v = fold(x, b + threadIdx.x, e, blockDim.x, r, c);
    v = block_reduce(v, r, smem);
    if (threadIdx.x == 0) {
      if (cpr == 1) {
        out[row] = r.template project<O>(v, c);
      } else {
        partial[w] = v;
      }
    }
  }
}

constexpr int kOuterX = 32, kOuterY = 8;

// blockDim (32, 8): x over the dense kept dim, y splitting the reduced rows. With rsplit > 1 the
// reduced rows are also split over rsplit blocks (when there are too few column tiles to fill
// the GPU); each writes its un-projected value to partial[chunk * num_out + o], and
// reduce_outer_partials_kernel finishes.
template <typename T, typename O, typename Red>
__global__ void reduce_outer_kernel(ReduceGeom g, const T* in, O* out, typename Red::acc* partial,
                                    Red r, const typename Red::acc* ctx, int64_t rsplit) {
  using A = typename Red::acc;
  __shared__ A smem[kOuterY][kOuterX];
  const int64_t K = g.keep_sizes[g.nkeep - 1];
  const int64_t outer = g.num_out / K;
  const int64_t ktiles = (K + kOuterX - 1) / kOuterX;
  const int64_t rlen = (g.red_numel + rsplit - 1) / rsplit;
  ReduceGeom og = g;
  og.nkeep -= 1;
  for (int64_t blk = blockIdx.x; blk < outer * ktiles * rsplit; blk += gridDim.x) {
    const int64_t chunk = blk / (outer * ktiles), tile = blk % (outer * ktiles);
    const int64_t ob = tile / ktiles;
    const int64_t k = (tile % ktiles) * kOuterX + threadIdx.x;
    const int64_t o = ob * K + k;
    A v = r.identity();
    A c{};
    if (k < K) {
      c = ctx ? ctx[o] : A{};
      const T* x = in + og.keep_offset(ob) + k;
      const int64_t e = min(g.red_numel, (chunk + 1) * rlen);
      const int64_t b = chunk * rlen + threadIdx.y;
      if (g.nred == 1) {  // one reduced dim (the common case): no 64-bit division per row
        const int64_t st = g.red_strides[0];
        v = fold(x, b, e, kOuterY, r, c, [st](int64_t row) { return row * st; });
      } else {
        v = fold(x, b, e, kOuterY, r, c, [&g](int64_t row) { return g.red_offset(row); });
      }
    }
    smem[threadIdx.y][threadIdx.x] = v;
    __syncthreads();
    if (threadIdx.y == 0 && k < K) {
      for (int y = 1; y < kOuterY; ++y) v = r.combine(v, smem[y][threadIdx.x]);
      if (rsplit == 1) {
        out[o] = r.template project<O>(v, c);
      } else {
        partial[chunk * g.num_out + o] = v;
      }
    }
    __syncthreads();
  }
}

// The outer case with one kept dim and one reduced dim ([rows, K] with dense columns, e.g. a
// bias gradient summed over the batch): each thread takes V consecutive columns, loaded as one
// 16-byte packet per row, so a warp reads 32 * V consecutive elements of a row at a time where
// reduce_outer_kernel reads 32, and two packets are in flight per thread. Partial results as in
// reduce_outer_kernel (partial[chunk * K + k] when rsplit > 1).
template <typename T, typename O, typename Red, int V>
__global__ void reduce_cols_kernel(int64_t K, int64_t rows, int64_t st, const T* in, O* out,
                                   typename Red::acc* partial, Red r,
                                   const typename Red::acc* ctx, int64_t rsplit) {
  using A = typename Red::acc;
  using P = cuda_loops::Packet<T, V>;
  __shared__ A smem[kOuterY * V][kOuterX];  // [y * V + j][x]: no bank conflicts
  const int64_t ktiles = (K + kOuterX * V - 1) / (kOuterX * V);
  const int64_t rlen = (rows + rsplit - 1) / rsplit;
  for (int64_t blk = blockIdx.x; blk < ktiles * rsplit; blk += gridDim.x) {
    const int64_t chunk = blk / ktiles, tile = blk % ktiles;
    const int64_t k = (tile * kOuterX + threadIdx.x) * V;
    A v[V], c[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      v[j] = r.identity();
      c[j] = A{};
    }
    if (k < K) {
      if (ctx) {
#pragma unroll
        for (int j = 0; j < V; ++j) c[j] = ctx[k + j];
      }
      const int64_t e = min(rows, (chunk + 1) * rlen);
      int64_t row = chunk * rlen + threadIdx.y;
      const T* x = in + k;
      for (; row + kOuterY < e; row += 2 * kOuterY) {
        const P p0 = *reinterpret_cast<const P*>(x + row * st);
        const P p1 = *reinterpret_cast<const P*>(x + (row + kOuterY) * st);
#pragma unroll
        for (int j = 0; j < V; ++j) v[j] = r.combine(v[j], r.map(p0.v[j], c[j]));
#pragma unroll
        for (int j = 0; j < V; ++j) v[j] = r.combine(v[j], r.map(p1.v[j], c[j]));
      }
      if (row < e) {
        const P p0 = *reinterpret_cast<const P*>(x + row * st);
#pragma unroll
        for (int j = 0; j < V; ++j) v[j] = r.combine(v[j], r.map(p0.v[j], c[j]));
      }
    }
#pragma unroll
    for (int j = 0; j < V; ++j) smem[threadIdx.y * V + j][threadIdx.x] = v[j];
    __syncthreads();
    if (threadIdx.y == 0 && k < K) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        A w = v[j];
        for (int y = 1; y < kOuterY; ++y) w = r.combine(w, smem[y * V + j][threadIdx.x]);
        if (rsplit == 1) {
          out[k + j] = r.template project<O>(w, c[j]);
        } else {
          partial[chunk * K + k + j] = w;
        }
      }
    }
    __syncthreads();
  }
}

// Output o combines partial[0 * num_out + o], partial[1 * num_out + o], ... (coalesced over o).
template <typename O, typename Red>
__global__ void reduce_outer_partials_kernel(int64_t num_out, const typename Red::acc* partial,
                                             O* out, Red r, const typename Red::acc* ctx,
                                             int64_t rsplit) {
  using A = typename Red::acc;
  for (int64_t o = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; o < num_out;
       o += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    A v = partial[o];
    for (int64_t c = 1; c < rsplit; ++c) v = r.combine(v, partial[c * num_out + o]);
    out[o] = r.template project<O>(v, ctx ? ctx[o] : A{});
  }
}

int grid_for(int64_t items) { return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(items, kMaxGrid))); }

int block_for(int64_t n) {
  int b = 32;
  while (b < kMaxBlock && b < n) b *= 2;
  return b;
}

// reduce_cols_kernel's launch: enough blocks to fill the GPU (splitting the rows into rsplit
// chunks of at least 16 rows per thread row), then reduce_outer_partials_kernel when split.
template <int V, typename T, typename O, typename Red>
void run_reduce_cols(int64_t K, int64_t rows, int64_t st, const T* in, O* out, const Red& r,
                     Device dev, const typename Red::acc* ctx) {
  using A = typename Red::acc;
  cudaStream_t s = stream_of(dev);
  const int64_t ktiles = (K + kOuterX * V - 1) / (kOuterX * V);
  const int64_t rsplit = std::clamp<int64_t>((kOuterFillBlocks + ktiles - 1) / ktiles, 1,
                                             std::max<int64_t>(1, rows / (16 * kOuterY)));
  Tensor partial;
  A* pp = nullptr;
  if (rsplit > 1) {
    partial = make_empty({rsplit * K * static_cast<int64_t>(sizeof(A))}, kUInt8, dev);
    pp = static_cast<A*>(partial.data_ptr());
  }
  reduce_cols_kernel<T, O, Red, V><<<grid_for(ktiles * rsplit), dim3(kOuterX, kOuterY), 0, s>>>(
      K, rows, st, in, out, pp, r, ctx, rsplit);
  EMBER_CUDA_CHECK(cudaGetLastError());
  if (rsplit > 1) {
    reduce_outer_partials_kernel<<<grid_for((K + 255) / 256), 256, 0, s>>>(K, pp, out, r, ctx,
                                                                          rsplit);
    EMBER_CUDA_CHECK(cudaGetLastError());
  }
}

template <typename T, typename O, typename Red>
void run_reduce(const ReduceGeom& g, const T* in, O* out, const Red& r, Device dev,
                const typename Red::acc* ctx = nullptr) {
  using A = typename Red::acc;
  if (g.num_out == 0) return;
  cudaStream_t s = stream_of(dev);
  if (g.inner()) {
    const int64_t R = g.red_numel;
    // Split long rows when there are too few rows to fill the GPU.
    int64_t cpr = 1;
    if (g.num_out < 1024 && R > 16 * kMaxBlock) {
      cpr = std::min<int64_t>((R + 4 * kMaxBlock - 1) / (4 * kMaxBlock), std::max<int64_t>(1, 2048 / g.num_out));
    }
    const int64_t plen = (R + cpr - 1) / cpr;
    const int threads = block_for(plen);
    Tensor partial;
    A* pp = nullptr;
    if (cpr > 1) {
      partial = make_empty({g.num_out * cpr * static_cast<int64_t>(sizeof(A))}, kUInt8, dev);
      pp = static_cast<A*>(partial.data_ptr());
    }
    reduce_inner_kernel<<<grid_for(g.num_out * cpr), threads, 0, s>>>(g, in, out, pp, r, ctx, cpr,
                                                                      plen);
    EMBER_CUDA_CHECK(cudaGetLastError());
    if (cpr > 1) {
      reduce_partials_kernel<<<grid_for(g.num_out), block_for(cpr), 0, s>>>(g.num_out, pp, out, r,
                                                                           ctx, cpr);
      EMBER_CUDA_CHECK(cudaGetLastError());
    }
    return;
  }
  EMBER_INTERNAL_ASSERT(g.outer(), "reduction geometry is neither inner nor outer");
  const int64_t K = g.keep_sizes[g.nkeep - 1];
  if constexpr (sizeof(T) >= 2 && sizeof(T) <= 8) {
    constexpr int V = 16 / sizeof(T);
    if (g.nkeep == 1 && g.nred == 1 && K % V == 0 && g.red_strides[0] % V == 0 &&
        reinterpret_cast<uintptr_t>(in) % 16 == 0) {
      run_reduce_cols<V>(K, g.red_numel, g.red_strides[0], in, out, r, dev, ctx);
      return;
    }
  }
  const int64_t tiles = (g.num_out / K) * ((K + kOuterX - 1) / kOuterX);
  // Too few column tiles to fill the GPU (e.g. a [8192, 8192] sum over dim 0 has 256): split
  // the reduced rows too, keeping at least 64 rows per thread row.
  int64_t rsplit = 1;
  if (tiles < kOuterFillBlocks) {
    rsplit = std::max<int64_t>(1, std::min<int64_t>((kOuterFillBlocks + tiles - 1) / tiles,
                                                    g.red_numel / (64 * kOuterY)));
  }
  Tensor partial;
  A* pp = nullptr;
  if (rsplit > 1) {
    partial = make_empty({rsplit * g.num_out * static_cast<int64_t>(sizeof(A))}, kUInt8, dev);
    pp = static_cast<A*>(partial.data_ptr());
  }
  reduce_outer_kernel<<<grid_for(tiles * rsplit), dim3(kOuterX, kOuterY), 0, s>>>(g, in, out, pp,
                                                                                 r, ctx, rsplit);
  EMBER_CUDA_CHECK(cudaGetLastError());
  if (rsplit > 1) {
    reduce_outer_partials_kernel<<<grid_for((g.num_out + 255) / 256), 256, 0, s>>>(
        g.num_out, pp, out, r, ctx, rsplit);
    EMBER_CUDA_CHECK(cudaGetLastError());
  }
}


template <typename T>
using sum_out_t = std::conditional_t<std::is_integral_v<T>, int64_t, T>;

// A device scratch tensor of n values of the accumulation type A.
template <typename A>
Tensor scratch(int64_t n, Device dev) {
  return make_empty({n}, dtype_of<A>, dev);
}

template <typename T>
void reduce_floating(ReduceKind kind, const Tensor& out, const ReduceGeom& g, const T* x,
                     const ReduceParams& params, Device dev) {
  using A = acc_t<T>;
  T* o = out.data<T>();
  const int64_t M = g.num_out, R = g.red_numel;
  switch (kind) {
    case ReduceKind::Mean: {
      MeanOp<T> r;
      r.n = A(R);
      run_reduce(g, x, o, r, dev);
      return;
    }
    case ReduceKind::Norm:
      with_norm_op<T>(params.p, [&](const auto& r) { run_reduce(g, x, o, r, dev); });
      return;
    case ReduceKind::Var: {
      Tensor mean = scratch<A>(M, dev);
      MeanOp<T> m;
      m.n = A(R);
      run_reduce(g, x, mean.data<A>(), m, dev);
      VarOp<T> v;
      v.divisor = A(std::max<int64_t>(0, R - params.correction));
      v.take_sqrt = params.take_sqrt;
      run_reduce(g, x, o, v, dev, mean.data<A>());
      return;
    }
    case ReduceKind::LogSumExp: {
      Tensor m = scratch<A>(M, dev);
      run_reduce(g, x, m.data<A>(), LseMaxOp<T>{}, dev);
      run_reduce(g, x, o, LseSumOp<T>{}, dev, m.data<A>());
      return;
    }
    default:
      EMBER_INTERNAL_ASSERT(false, "not a floating-only reduction");
  }
}

}  // namespace

void reduce_cuda(ReduceKind kind, const Tensor& out, const Tensor& in, uint32_t mask,
                 const ReduceParams& params) {
  DeviceGuard guard(in.device().index);
  const ReduceInput p = prepare_reduce(in, mask);
  const ReduceGeom& g = p.g;
  const Device dev = in.device();
  const void* data = p.src.data_ptr();
  EMBER_DISPATCH_ALL(in.dtype(), "reduce", [&]<typename T>() {
    const T* x = static_cast<const T*>(data);
    switch (kind) {
      case ReduceKind::Sum:
        run_reduce(g, x, out.data<sum_out_t<T>>(), SumOp<T>{}, dev);
        return;
      case ReduceKind::Prod:
        run_reduce(g, x, out.data<sum_out_t<T>>(), ProdOp<T>{}, dev);
        return;
      case ReduceKind::Max:
        run_reduce(g, x, out.data<T>(), MaxOp<T>{}, dev);
        return;
      case ReduceKind::Min:
        run_reduce(g, x, out.data<T>(), MinOp<T>{}, dev);
        return;
      case ReduceKind::Any:
        run_reduce(g, x, out.data<bool>(), AnyOp<T>{}, dev);
        return;
      case ReduceKind::All:
        run_reduce(g, x, out.data<bool>(), AllOp<T>{}, dev);
        return;
      default:
        if constexpr (std::is_floating_point_v<T> || is_reduced_float_v<T>) {
          reduce_floating(kind, out, g, x, params, dev);
        } else {
          EMBER_INTERNAL_ASSERT(false, "floating-only reduction on ", in.dtype());
        }
    }
  });
}

// ---- argmax / argmin -------------------------------------------------------------------------

namespace {

template <bool kMax, typename T>
__global__ void arg_inner_kernel(ReduceGeom g, const T* in, T* values, int64_t* indices) {
  using A = acc_t<T>;
  __shared__ A sv[32];
  __shared__ int64_t si[32];
  const int64_t R = g.red_numel;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t row = blockIdx.x; row < g.num_out; row += gridDim.x) {
    const T* x = in + g.keep_offset(row);
    A bv = convert<A>(x[0]);
    int64_t bi = 0;
    for (int64_t i = threadIdx.x; i < R; i += blockDim.x) {
      const A v = convert<A>(x[i]);
      if (arg_better<kMax>(v, bv)) {
        bv = v;
        bi = i;
      }
    }
    for (int off = 16; off > 0; off /= 2) {
      const A ov = shfl_down(bv, off);
      const int64_t oi = shfl_down(bi, off);
      if (arg_merge<kMax>(ov, oi, bv, bi)) {
        bv = ov;
        bi = oi;
      }
    }
    if (blockDim.x > 32) {
      __syncthreads();
      if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
      }
      __syncthreads();
      if (warp == 0) {
        const int nw = blockDim.x / 32;
        bv = sv[lane < nw ? lane : 0];
        bi = si[lane < nw ? lane : 0];
        for (int off = 16; off > 0; off /= 2) {
          const A ov = shfl_down(bv, off);
          const int64_t oi = shfl_down(bi, off);
          if (arg_merge<kMax>(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
          }
        }
      }
    }
    if (threadIdx.x == 0) {
      if (values) values[row] = convert<T>(bv);
      indices[row] = bi;
    }
  }
}

template <bool kMax, typename T>
__global__ void arg_outer_kernel(ReduceGeom g, const T* in, T* values, int64_t* indices) {
  using A = acc_t<T>;
  const int64_t K = g.keep_sizes[g.nkeep - 1];
  const int64_t rs = g.red_strides[0];
  ReduceGeom og = g;
  og.nkeep -= 1;
  for (int64_t o = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; o < g.num_out;
       o += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const T* x = in + og.keep_offset(o / K) + o % K;
    A bv = convert<A>(x[0]);
    int64_t bi = 0;
    for (int64_t r = 1; r < g.red_numel; ++r) {
      const A v = convert<A>(x[r * rs]);
      if (arg_better<kMax>(v, bv)) {
        bv = v;
        bi = r;
      }
    }
    if (values) values[o] = convert<T>(bv);
    indices[o] = bi;
  }
}

}  // namespace

void arg_reduce_cuda(const Tensor& values, const Tensor& indices, const Tensor& in, int64_t dim,
                     bool is_max) {
  DeviceGuard guard(in.device().index);
  const ReduceInput p = prepare_reduce(in, 1u << dim);
  const ReduceGeom& g = p.g;
  cudaStream_t s = stream_of(in.device());
  const void* data = p.src.data_ptr();
  EMBER_DISPATCH_ALL(in.dtype(), is_max ? "argmax" : "argmin", [&]<typename T>() {
    const T* x = static_cast<const T*>(data);
    T* v = values.defined() ? values.data<T>() : nullptr;
    int64_t* idx = indices.data<int64_t>();
    auto go = [&]<bool kMax>() {
      if (g.inner()) {
        arg_inner_kernel<kMax, T>
            <<<grid_for(g.num_out), block_for(g.red_numel), 0, s>>>(g, x, v, idx);
      } else {
        arg_outer_kernel<kMax, T>
            <<<grid_for((g.num_out + kMaxBlock - 1) / kMaxBlock), kMaxBlock, 0, s>>>(g, x, v, idx);
      }
      EMBER_CUDA_CHECK(cudaGetLastError());
    };
    if (is_max) {
      go.template operator()<true>();
    } else {
      go.template operator()<false>();
    }
  });
}

// ---- topk ------------------------------------------------------------------------------------

namespace {

// v of lane 0, on every lane.
template <typename A>
__device__ A shfl_first(A v) {
  if constexpr (sizeof(A) < 4) {
    return static_cast<A>(__shfl_sync(0xffffffffu, static_cast<int>(v), 0));
  } else if constexpr (std::is_same_v<A, int64_t>) {
    return static_cast<int64_t>(__shfl_sync(0xffffffffu, static_cast<long long>(v), 0));
  } else {
    return __shfl_sync(0xffffffffu, v, 0);
  }
}

// A warp per row, k passes: in each, the lanes stride over the row for the first element (in
// topk_before's order) after the one the previous pass chose, and shuffles pick the warp's.
// k n reads a row, no scratch memory; k is small where topk is used per row (a router's
// experts, sampling's candidates).
template <typename T>
__global__ void topk_kernel(const T* in, int64_t* out, int64_t rows, int64_t n, int64_t k,
                            bool largest) {
  using A = acc_t<T>;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32; r < rows;
       r += warps) {
    const T* x = in + r * n;
    A pv{};
    int64_t pi = -1;
    for (int64_t s = 0; s < k; ++s) {
      A bv{};
      int64_t bi = -1;
      for (int64_t i = lane; i < n; i += 32) {
        const A v = convert<A>(x[i]);
        if (pi >= 0 && !topk_before(pv, pi, v, i, largest)) continue;
        if (bi < 0 || topk_before(v, i, bv, bi, largest)) {
          bv = v;
          bi = i;
        }
      }
      for (int off = 16; off > 0; off /= 2) {
        const A ov = shfl_down(bv, off);
        const int64_t oi = shfl_down(bi, off);
        if (oi >= 0 && (bi < 0 || topk_before(ov, oi, bv, bi, largest))) {
          bv = ov;
          bi = oi;
        }
      }
      bv = shfl_first(bv);
      bi = shfl_first(bi);
      if (lane == 0) out[r * k + s] = bi;
      pv = bv;
      pi = bi;
    }
  }
}

}  // namespace

void topk_cuda(const Tensor& indices, const Tensor& in, int64_t k, bool largest) {
  DeviceGuard guard(in.device().index);
  cudaStream_t s = stream_of(in.device());
  const int64_t rows = in.size(0), n = in.size(1);
  constexpr int kWarpsPerBlock = kMaxBlock / 32;
  const int64_t blocks = std::min<int64_t>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock, kMaxGrid);
  EMBER_DISPATCH_ALL(in.dtype(), "topk", [&]<typename T>() {
    topk_kernel<T><<<static_cast<unsigned>(blocks), kMaxBlock, 0, s>>>(
        in.data<T>(), indices.data<int64_t>(), rows, n, k, largest);
    EMBER_CUDA_CHECK(cudaGetLastError());
  });
}

}  // namespace ember::detail
