// CUDA softmax / log_softmax over any dim of a contiguous tensor viewed as [outer, D, inner].
// inner == 1, D <= 1024: one warp per row holding the row in registers (D / 32 values a lane),
//   so x is read from memory once and only warp shuffles combine (attention's rows).
// inner == 1, longer rows: one block per row (max, sum of exp, write), combined with warp
//   shuffles and shared memory.
// inner > 1: one thread per (outer, column), reading coalesced along inner.
// The backward over the last dim (softmax_backward_cuda) is one warp per row as well: one pass
// for the row's sum, one to write, instead of the four element-wise and reduction kernels of
// its composite form.
// The fused cross_entropy's row passes (cross_entropy_rows_cuda and its backward) are one block
// per row, reading x in 16-byte vectors where the rows allow: forward reads x once (the online
// max and sum of softmax_inner_kernel), backward reads it once and writes dx once.
#include <algorithm>
#include <cstdint>

#include <ember/tensor/cuda/runtime/check.h>
#include <ember/tensor/cuda/index_check.cuh>
#include <ember/tensor/cuda/loops.cuh>
#include <ember/tensor/cuda/warp_rows.cuh>
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

// A row's max m and sum s of exp(v - m), one pass over its values (online: the sum is rescaled
// when the max grows), so x is read once for both: add() takes a thread's values, block()
// combines the block's threads, leaving every thread the row's m and s.
template <typename A>
struct OnlineSumExp {
  A m = lowest_v<A>(), s = 0;
  __device__ void add(A v) {
    if (v > m) {
      s = s * exp_v(m - v) + A(1);
      m = v;
    } else {
      // v == m: 1 even for -inf (scaled to 0 below unless the whole row is -inf, whose
      // result is NaN as in the three-pass form); a NaN v makes s NaN, as it should.
      s += v == m ? A(1) : exp_v(v - m);
    }
  }
  __device__ void block(A* smem) {
    const A row_max = block_all_reduce(m, [](A a, A b) { return max_nan(a, b); }, smem);
    s = block_all_reduce(s == A(0) ? A(0) : s * exp_v(m - row_max),
                         [](A a, A b) { return a + b; }, smem);
    m = row_max;
  }
};

template <typename T>
__global__ void softmax_inner_kernel(const T* x, T* y, int64_t rows, int64_t D, bool log) {
  using A = acc_t<T>;
  __shared__ A smem[32];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * D;
    T* yr = y + row * D;
    // One pass for the max and the sum, one to write: x is read twice instead of three times.
    OnlineSumExp<A> r;
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x) r.add(convert<A>(xr[i]));
    r.block(smem);
    const A m = r.m, s = r.s;
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

constexpr int kWarpRowMax = 1024;  // longest row the warp kernel holds in registers
namespace wr = warp_rows;

// Rows of D <= 32 * kPerLane: lane l holds elements l, l + 32, ... The same NaN and -inf
// results as the block kernel: a NaN makes the row max NaN and so every output; a row of -inf
// only gives exp(-inf - -inf) = NaN.
template <typename T, int kPerLane>
__global__ void softmax_warp_kernel(const T* x, T* y, int64_t rows, int D, bool log) {
  using A = acc_t<T>;
  const int lane = threadIdx.x % 32;
  wr::for_each_row(rows, [&](int64_t row) {
    const T* xr = x + row * D;
    T* yr = y + row * D;
    A v[kPerLane];
    A m = lowest_v<A>();
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int i = lane + 32 * j;
      v[j] = i < D ? convert<A>(xr[i]) : lowest_v<A>();
      if (i < D) m = max_nan(m, v[j]);
    }
    m = wr::all_reduce(m, [](A a, A b) { return max_nan(a, b); });
    A s = 0;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      if (lane + 32 * j < D) {
        v[j] -= m;
        if (!log) v[j] = exp_v(v[j]);
        s += log ? exp_v(v[j]) : v[j];
      }
    }
    s = wr::sum(s);
    const A scale = log ? log_v(s) : A(1) / s;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int i = lane + 32 * j;
      if (i < D) yr[i] = convert<T>(log ? v[j] - scale : v[j] * scale);
    }
  });
}

// dx = y * (dy - sum(dy * y)) (softmax) or dy - exp(y) * sum(dy) (log_softmax, y its output)
// over rows of D, one warp per row.
template <typename T>
__global__ void softmax_backward_warp_kernel(const T* dy, const T* y, T* dx, int64_t rows,
                                             int64_t D, bool log) {
  using A = acc_t<T>;
  const int lane = threadIdx.x % 32;
  wr::for_each_row(rows, [&](int64_t row) {
    const T* gr = dy + row * D;
    const T* yr = y + row * D;
    T* out = dx + row * D;
    A s = 0;
    for (int64_t i = lane; i < D; i += 32) {
      s += log ? convert<A>(gr[i]) : convert<A>(gr[i]) * convert<A>(yr[i]);
    }
    s = wr::sum(s);
    for (int64_t i = lane; i < D; i += 32) {
      const A g = convert<A>(gr[i]), v = convert<A>(yr[i]);
      out[i] = convert<T>(log ? g - exp_v(v) * s : v * (g - s));
    }
  });
}

template <typename T>
void launch_softmax_warp(const T* x, T* y, int64_t rows, int D, bool log, cudaStream_t s) {
  const int grid = wr::grid_for(rows);
  constexpr int kThreads = wr::kThreads;
  if (D <= 32) {
    softmax_warp_kernel<T, 1><<<grid, kThreads, 0, s>>>(x, y, rows, D, log);
  } else if (D <= 64) {
    softmax_warp_kernel<T, 2><<<grid, kThreads, 0, s>>>(x, y, rows, D, log);
  } else if (D <= 128) {
    softmax_warp_kernel<T, 4><<<grid, kThreads, 0, s>>>(x, y, rows, D, log);
  } else if (D <= 256) {
    softmax_warp_kernel<T, 8><<<grid, kThreads, 0, s>>>(x, y, rows, D, log);
  } else if (D <= 512) {
    softmax_warp_kernel<T, 16><<<grid, kThreads, 0, s>>>(x, y, rows, D, log);
  } else {
    softmax_warp_kernel<T, 32><<<grid, kThreads, 0, s>>>(x, y, rows, D, log);
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

// ---- the fused cross_entropy's rows (Note [Fused cross_entropy], tensor/ops/loss.cpp) ----------

// Elements per 16-byte load.
template <typename T>
constexpr int kVecOf = 16 / static_cast<int>(sizeof(T));

// Calls f(i, v) for the elements i of row xr (C of them) this thread owns, v = xr[i] in the
// accumulation type. kVec > 1: the row starts on 16 bytes and C is a multiple of kVec, and
// thread k owns vectors k, k + blockDim.x, ...
template <typename T, int kVec, typename F>
__device__ void for_each_in_row(const T* xr, int64_t C, F f) {
  using A = acc_t<T>;
  if constexpr (kVec == 1) {
    for (int64_t i = threadIdx.x; i < C; i += blockDim.x) f(i, convert<A>(xr[i]));
  } else {
    const uint4* v = reinterpret_cast<const uint4*>(xr);
    for (int64_t j = threadIdx.x; j < C / kVec; j += blockDim.x) {
      const uint4 raw = v[j];
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int k = 0; k < kVec; ++k) f(j * kVec + k, convert<A>(e[k]));
    }
  }
}

// lse[row] = log sum exp(x[row]) (NaN where a logit is +inf, as the CPU's) and picked[row] =
// x[row, target[row]]; a target outside [0, C) goes to the slot and its picked value is 0.
template <typename T, int kVec>
__global__ void cross_entropy_rows_kernel(const T* x, const int64_t* target, acc_t<T>* lse,
                                          acc_t<T>* picked, int64_t rows, int64_t C,
                                          unsigned long long* err) {
  using A = acc_t<T>;
  __shared__ A smem[32];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * C;
    OnlineSumExp<A> r;
    for_each_in_row<T, kVec>(xr, C, [&](int64_t, A v) { r.add(v); });
    r.block(smem);
    const A row_max = r.m, s = r.s;
    if (threadIdx.x == 0) {
      lse[row] = row_max == highest_v<A>() ? row_max - row_max : row_max + log_v(s);
      const int64_t t = target[row];
      if (static_cast<uint64_t>(t) >= static_cast<uint64_t>(C)) {
        cuda_index::report_bad_index(err, t);
        picked[row] = A(0);
      } else {
        picked[row] = convert<A>(xr[t]);
      }
    }
  }
}

// dx[row, i] = scale exp(x - lse) - smooth w[i] + (i == target) at, computed in the
// accumulation type and rounded once (smooth, w: null for 0 and 1).
template <typename T, int kVec>
__global__ void cross_entropy_rows_backward_kernel(const T* x, T* dx, const int64_t* target,
                                                   const acc_t<T>* lse, const acc_t<T>* scale,
                                                   const acc_t<T>* smooth, const acc_t<T>* w,
                                                   const acc_t<T>* at, int64_t rows, int64_t C) {
  using A = acc_t<T>;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const A l = lse[row], sc = scale[row], sm = smooth != nullptr ? smooth[row] : A(0), a = at[row];
    const int64_t t = target[row];
    auto grad = [&](int64_t i, A v) {
      A g = sc * exp_v(v - l) - (w != nullptr ? sm * w[i] : sm);
      if (i == t) g += a;
      return convert<T>(g);
    };
    const T* xr = x + row * C;
    T* dr = dx + row * C;
    if constexpr (kVec == 1) {
      for_each_in_row<T, 1>(xr, C, [&](int64_t i, A v) { dr[i] = grad(i, v); });
    } else {
      const uint4* xv = reinterpret_cast<const uint4*>(xr);
      uint4* dv = reinterpret_cast<uint4*>(dr);
      for (int64_t j = threadIdx.x; j < C / kVec; j += blockDim.x) {
        const uint4 raw = xv[j];
        const T* e = reinterpret_cast<const T*>(&raw);
        uint4 out;
        T* o = reinterpret_cast<T*>(&out);
#pragma unroll
        for (int k = 0; k < kVec; ++k) o[k] = grad(j * kVec + k, convert<A>(e[k]));
        dv[j] = out;
      }
    }
  }
}

// The launch shape of the row kernels: threads for C / kVec vectors (32 to 512), a block per row.
struct RowLaunch {
  int grid, threads;
};
RowLaunch row_launch(int64_t rows, int64_t per_row) {
  int threads = 32;
  while (threads < 512 && threads < per_row) threads *= 2;
  return {static_cast<int>(std::min<int64_t>(rows, kMaxGrid)), threads};
}

// Whether rows of C elements at these addresses can be read (and written) in 16-byte vectors.
template <typename T>
bool rows_vectorize(int64_t C, std::initializer_list<const void*> ptrs) {
  if (C % kVecOf<T> != 0) return false;
  for (const void* p : ptrs) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
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
    if (inner == 1 && D <= kWarpRowMax) {
      launch_softmax_warp(x, y, outer, static_cast<int>(D), log, s);
    } else if (inner == 1) {
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

Tensor softmax_backward_cuda(const Tensor& grad, const Tensor& y, bool log) {
  EMBER_INTERNAL_ASSERT(y.is_cuda() && grad.device() == y.device() && grad.dtype() == y.dtype() &&
                            grad.shape() == y.shape() && y.dim() >= 1,
                        "[softmax backward] expected a gradient of the output's shape, dtype "
                        "and device");
  const Tensor g = grad.contiguous(), out = y.contiguous();
  Tensor dx = make_empty(out.shape(), out.dtype(), out.device());
  if (out.numel() == 0) return dx;
  DeviceGuard guard(out.device().index);
  const int64_t D = out.size(-1), rows = out.numel() / D;
  EMBER_DISPATCH_FLOATING(out.dtype(), log ? "log_softmax backward" : "softmax backward",
                          [&]<typename T>() {
                            softmax_backward_warp_kernel<T>
                                <<<wr::grid_for(rows), wr::kThreads, 0,
                                   stream_of(out.device())>>>(g.data<T>(), out.data<T>(),
                                                              dx.data<T>(), rows, D, log);
                          });
  EMBER_CUDA_CHECK(cudaGetLastError());
  return dx;
}

void cross_entropy_rows_cuda(const Tensor& lse, const Tensor& picked, const Tensor& x,
                             const Tensor& target) {
  EMBER_INTERNAL_ASSERT(x.dim() == 2 && x.is_contiguous() && target.is_contiguous() &&
                            lse.is_contiguous() && picked.is_contiguous(),
                        "cross_entropy_rows_cuda needs dense [N, C], [N] tensors");
  cuda_index::report_bad_indices();
  const int64_t N = x.size(0), C = x.size(1);
  if (N == 0 || C == 0) return;
  DeviceGuard guard(x.device().index);
  cudaStream_t s = stream_of(x.device());
  cuda_index::BadIndexSlot slot(x.device(), s);
  EMBER_DISPATCH_FLOATING(x.dtype(), "cross_entropy", [&]<typename T>() {
    using A = acc_t<T>;
    const T* xp = x.data<T>();
    const int64_t* t = target.data<int64_t>();
    A* l = lse.data<A>();
    A* p = picked.data<A>();
    if (rows_vectorize<T>(C, {xp})) {
      const RowLaunch r = row_launch(N, C / kVecOf<T>);
      cross_entropy_rows_kernel<T, kVecOf<T>>
          <<<r.grid, r.threads, 0, s>>>(xp, t, l, p, N, C, slot.ptr());
    } else {
      const RowLaunch r = row_launch(N, C);
      cross_entropy_rows_kernel<T, 1><<<r.grid, r.threads, 0, s>>>(xp, t, l, p, N, C, slot.ptr());
    }
  });
  EMBER_CUDA_CHECK(cudaGetLastError());
  slot.queue_check(IndexBound{"cross_entropy", 1, C});
}

void cross_entropy_rows_backward_cuda(const Tensor& dx, const Tensor& x, const Tensor& lse,
                                      const Tensor& target, const Tensor& scale,
                                      const Tensor& smooth, const Tensor& weight,
                                      const Tensor& at) {
  EMBER_INTERNAL_ASSERT(x.dim() == 2 && x.is_contiguous() && dx.is_contiguous(),
                        "cross_entropy_rows_backward_cuda needs dense [N, C] tensors");
  const int64_t N = x.size(0), C = x.size(1);
  if (N == 0 || C == 0) return;
  DeviceGuard guard(x.device().index);
  cudaStream_t s = stream_of(x.device());
  EMBER_DISPATCH_FLOATING(x.dtype(), "cross_entropy backward", [&]<typename T>() {
    using A = acc_t<T>;
    const T* xp = x.data<T>();
    T* d = dx.data<T>();
    const int64_t* t = target.data<int64_t>();
    const A* sm = smooth.defined() ? smooth.data<A>() : nullptr;
    const A* w = weight.defined() ? weight.data<A>() : nullptr;
    if (rows_vectorize<T>(C, {xp, d})) {
      const RowLaunch r = row_launch(N, C / kVecOf<T>);
      cross_entropy_rows_backward_kernel<T, kVecOf<T>><<<r.grid, r.threads, 0, s>>>(
          xp, d, t, lse.data<A>(), scale.data<A>(), sm, w, at.data<A>(), N, C);
    } else {
      const RowLaunch r = row_launch(N, C);
      cross_entropy_rows_backward_kernel<T, 1><<<r.grid, r.threads, 0, s>>>(
          xp, d, t, lse.data<A>(), scale.data<A>(), sm, w, at.data<A>(), N, C);
    }
  });
  EMBER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ember::detail
