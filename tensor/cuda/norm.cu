// Fused layer norm on CUDA (tensor/detail/norm_kernels.h), the twin of cpu/norm.cpp: the op
// is a handful of passes over memory instead of the dozen element-wise and reduction kernels of
// its composite form.
//   forward:  one warp per row; the row is read for the mean, again for the centred variance
//             (two passes, as the CPU: no cancellation) and once more to write y. A row of a
//             transformer's width is a few KiB, so the re-reads hit L1/L2, not DRAM.
//   backward: one warp per row for dx (two passes over dy and x); dweight and dbias are column
//             sums over rows: blocks of 32 columns x 8 row groups, the rows also split over
//             gridDim.y blocks whose partial sums a second small kernel adds up, in a fixed
//             order (deterministic, no atomics).
// Accumulation is in acc_t<T> (float for float32, double for float64).
#include <algorithm>
#include <initializer_list>

#include <ember/tensor/cuda/runtime/check.h>
#include <ember/tensor/cuda/loops.cuh>
#include <ember/tensor/cuda/warp_rows.cuh>
#include <ember/tensor/detail/norm_kernels.h>
#include <ember/tensor/dtype.h>
#include <ember/tensor/error.h>

namespace ember::detail {

namespace {

using cuda::detail::DeviceGuard;
using cuda_loops::stream_of;

namespace wr = warp_rows;

// Column-sum blocks: 32 columns x kRowGroups row groups; aim for about this many blocks so that
// every SM of a large GPU has several.
constexpr int kRowGroups = 8;
constexpr int64_t kParamBlocks = 1024;

// y = (x - mean) * rstd * w + b per row of n; mean and rstd stored per row in T.
template <typename T>
__global__ void ln_forward_kernel(const T* x, const T* w, const T* b, T* y, T* mean, T* rstd,
                                  int64_t rows, int64_t n, acc_t<T> eps) {
  using A = acc_t<T>;
  const int lane = threadIdx.x % 32;
  wr::for_each_row(rows, [&](int64_t r) {
    const T* xr = x + r * n;
    A s = 0;
    for (int64_t i = lane; i < n; i += 32) s += static_cast<A>(xr[i]);
    const A mu = wr::sum(s) / static_cast<A>(n);
    A ss = 0;
    for (int64_t i = lane; i < n; i += 32) {
      const A d = static_cast<A>(xr[i]) - mu;
      ss += d * d;
    }
    const A rs = A(1) / sqrt(wr::sum(ss) / static_cast<A>(n) + eps);
    if (lane == 0) {
      mean[r] = static_cast<T>(mu);
      rstd[r] = static_cast<T>(rs);
    }
    T* yr = y + r * n;
    for (int64_t i = lane; i < n; i += 32) {
      A v = (static_cast<A>(xr[i]) - mu) * rs;
      if (w != nullptr) v *= static_cast<A>(w[i]);
      if (b != nullptr) v += static_cast<A>(b[i]);
      yr[i] = static_cast<T>(v);
    }
  });
}

// dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) per row, dxhat = dy * w.
template <typename T>
__global__ void ln_backward_dx_kernel(const T* dy, const T* x, const T* mean, const T* rstd,
                                      const T* w, T* dx, int64_t rows, int64_t n) {
  using A = acc_t<T>;
  const int lane = threadIdx.x % 32;
  wr::for_each_row(rows, [&](int64_t r) {
    const T* xr = x + r * n;
    const T* gr = dy + r * n;
    const A mu = static_cast<A>(mean[r]), rs = static_cast<A>(rstd[r]);
    A a = 0, b = 0;
    for (int64_t i = lane; i < n; i += 32) {
      const A dxh = static_cast<A>(gr[i]) * (w != nullptr ? static_cast<A>(w[i]) : A(1));
      a += dxh;
      b += dxh * ((static_cast<A>(xr[i]) - mu) * rs);
    }
    const A ma = wr::sum(a) / static_cast<A>(n), mb = wr::sum(b) / static_cast<A>(n);
    T* out = dx + r * n;
    for (int64_t i = lane; i < n; i += 32) {
      const A dxh = static_cast<A>(gr[i]) * (w != nullptr ? static_cast<A>(w[i]) : A(1));
      const A xh = (static_cast<A>(xr[i]) - mu) * rs;
      out[i] = static_cast<T>((dxh - ma - xh * mb) * rs);
    }
  });
}

// Block (32, kRowGroups) at (column tile blockIdx.x, row split blockIdx.y): partial sums over
// its rows of dy * xhat and dy for 32 columns, written to pw/pb[blockIdx.y * n + col].
template <typename T>
__global__ void ln_param_partials_kernel(const T* dy, const T* x, const T* mean, const T* rstd,
                                         int64_t rows, int64_t n, int64_t rows_per_split,
                                         acc_t<T>* pw, acc_t<T>* pb) {
  using A = acc_t<T>;
  __shared__ A sw[kRowGroups][33], sb[kRowGroups][33];  // 33: no bank conflicts
  const int64_t col = blockIdx.x * static_cast<int64_t>(32) + threadIdx.x;
  const int64_t r0 = blockIdx.y * rows_per_split;
  const int64_t r1 = min(rows, r0 + rows_per_split);
  A accw = 0, accb = 0;
  if (col < n) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowGroups) {
      const A g = static_cast<A>(dy[r * n + col]);
      accw += g * ((static_cast<A>(x[r * n + col]) - static_cast<A>(mean[r])) *
                   static_cast<A>(rstd[r]));
      accb += g;
    }
  }
  sw[threadIdx.y][threadIdx.x] = accw;
  sb[threadIdx.y][threadIdx.x] = accb;
  __syncthreads();
  if (threadIdx.y == 0 && col < n) {
    for (int k = 1; k < kRowGroups; ++k) {
      accw += sw[k][threadIdx.x];
      accb += sb[k][threadIdx.x];
    }
    pw[blockIdx.y * n + col] = accw;
    pb[blockIdx.y * n + col] = accb;
  }
}

// dweight[col] and dbias[col] (either may be null): the splits' partial sums, in split order.
template <typename T>
__global__ void ln_param_finish_kernel(const acc_t<T>* pw, const acc_t<T>* pb, int64_t splits,
                                       int64_t n, T* dweight, T* dbias) {
  using A = acc_t<T>;
  for (int64_t col = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; col < n;
       col += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    A w = 0, b = 0;
    for (int64_t s = 0; s < splits; ++s) {
      w += pw[s * n + col];
      b += pb[s * n + col];
    }
    if (dweight != nullptr) dweight[col] = static_cast<T>(w);
    if (dbias != nullptr) dbias[col] = static_cast<T>(b);
  }
}

template <typename T>
const T* ptr_or_null(const Tensor& t) {
  return t.defined() ? t.data<T>() : nullptr;
}

template <typename T>
T* mut_ptr_or_null(const Tensor& t) {
  return t.defined() ? t.data<T>() : nullptr;
}

void check_operands(const char* op, const Tensor& x, std::initializer_list<const Tensor*> ts) {
  EMBER_INTERNAL_ASSERT(x.is_cuda() && x.is_contiguous() && x.dim() == 2, "[", op,
                        "] expected a contiguous 2-d CUDA tensor, got shape ", x.shape());
  EMBER_INTERNAL_ASSERT(x.dtype() == kFloat32 || x.dtype() == kFloat64, "[", op,
                        "] expected float32 or float64, got ", x.dtype());
  for (const Tensor* t : ts) {
    if (!t->defined()) continue;
    EMBER_INTERNAL_ASSERT(t->device() == x.device() && t->dtype() == x.dtype() &&
                              t->is_contiguous(),
                          "[", op, "] operands must be contiguous ", x.dtype(), " on ",
                          x.device());
  }
}

}  // namespace

void layer_norm_forward_cuda(const Tensor& x, const Tensor& weight, const Tensor& bias,
                             double eps, const Tensor& y, const Tensor& mean, const Tensor& rstd) {
  check_operands("layer_norm", x, {&weight, &bias, &y, &mean, &rstd});
  const int64_t rows = x.size(0), n = x.size(1);
  if (rows == 0 || n == 0) return;
  DeviceGuard guard(x.device().index);
  cudaStream_t s = stream_of(x.device());
  auto go = [&]<typename T>() {
    ln_forward_kernel<T><<<wr::grid_for(rows), wr::kThreads, 0, s>>>(
        x.data<T>(), ptr_or_null<T>(weight), ptr_or_null<T>(bias), y.data<T>(), mean.data<T>(),
        rstd.data<T>(), rows, n, static_cast<acc_t<T>>(eps));
  };
  if (x.dtype() == kFloat32) {
    go.template operator()<float>();
  } else {
    go.template operator()<double>();
  }
  EMBER_CUDA_CHECK(cudaGetLastError());
}

void layer_norm_backward_cuda(const Tensor& dy, const Tensor& x, const Tensor& mean,
                              const Tensor& rstd, const Tensor& weight, const Tensor& dx,
                              const Tensor& dweight, const Tensor& dbias) {
  check_operands("layer_norm backward", x, {&dy, &mean, &rstd, &weight, &dx, &dweight, &dbias});
  const int64_t rows = x.size(0), n = x.size(1);
  if (rows == 0 || n == 0) return;
  DeviceGuard guard(x.device().index);
  cudaStream_t s = stream_of(x.device());
  auto go = [&]<typename T>() {
    using A = acc_t<T>;
    if (dx.defined()) {
      ln_backward_dx_kernel<T><<<wr::grid_for(rows), wr::kThreads, 0, s>>>(
          dy.data<T>(), x.data<T>(), mean.data<T>(), rstd.data<T>(), ptr_or_null<T>(weight),
          dx.data<T>(), rows, n);
      EMBER_CUDA_CHECK(cudaGetLastError());
    }
    if (!dweight.defined() && !dbias.defined()) return;
    const int64_t tiles = (n + 31) / 32;
    // Split the rows so that the grid has about kParamBlocks blocks, each row group of a block
    // still summing at least 4 rows.
    const int64_t max_splits = std::max<int64_t>(1, rows / (4 * kRowGroups));
    const int64_t splits = std::clamp<int64_t>((kParamBlocks + tiles - 1) / tiles, 1,
                                               std::min<int64_t>(max_splits, 65535));
    const int64_t rows_per_split = (rows + splits - 1) / splits;
    Tensor partial = make_empty({2 * splits * n}, dtype_of<A>, x.device());
    A* pw = partial.data<A>();
    A* pb = pw + splits * n;
    ln_param_partials_kernel<T>
        <<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(splits)),
           dim3(32, kRowGroups), 0, s>>>(dy.data<T>(), x.data<T>(), mean.data<T>(),
                                         rstd.data<T>(), rows, n, rows_per_split, pw, pb);
    EMBER_CUDA_CHECK(cudaGetLastError());
    ln_param_finish_kernel<T>
        <<<static_cast<int>(std::min<int64_t>((n + 255) / 256, wr::kMaxGrid)), 256, 0, s>>>(
            pw, pb, splits, n, mut_ptr_or_null<T>(dweight), mut_ptr_or_null<T>(dbias));
    EMBER_CUDA_CHECK(cudaGetLastError());
  };
  if (x.dtype() == kFloat32) {
    go.template operator()<float>();
  } else {
    go.template operator()<double>();
  }
}

}  // namespace ember::detail
