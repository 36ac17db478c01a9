// Fused layer norm on the CPU (tensor/detail/norm_kernels.h): rows in parallel, each row's
// passes (mean, variance, output; backward's parameter sums, two row sums, dx) while it sits in
// the L1 cache.
#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>

#include <ember/tensor/detail/lane_sum.h>
#include <ember/tensor/detail/norm_kernels.h>
#include <ember/tensor/dtype.h>
#include <ember/tensor/error.h>
#include <ember/tensor/threading.h>

namespace ember::detail {

namespace {

// The row loops for AVX-512 and AVX2 too, picked at load time. Their sums run in lane_sum's
// fixed order and the file compiles without contraction (tensor/CMakeLists.txt), so every
// version gives the same bits.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define EMBER_NORM_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define EMBER_NORM_CLONES
#endif

int64_t row_grain(int64_t n) { return std::max<int64_t>(1, kGrainSize / std::max<int64_t>(n, 1)); }

// One row: y = (x - mean) * rstd * w + b (w, b optional), the statistics in double.
template <typename T>
EMBER_NORM_CLONES void forward_row(const T* xr, const T* pw, const T* pb, double eps, int64_t n,
                                   T* yr, T* mean, T* rstd) {
  const double mu = lane_sum<double>(n, [xr](int64_t i) { return static_cast<double>(xr[i]); }) / n;
  const double ss = lane_sum<double>(n, [xr, mu](int64_t i) {
    const double d = xr[i] - mu;
    return d * d;
  });
  const double rs = 1.0 / std::sqrt(ss / n + eps);
  *mean = static_cast<T>(mu);
  *rstd = static_cast<T>(rs);
  const T m = static_cast<T>(mu), q = static_cast<T>(rs);
  if (pw != nullptr && pb != nullptr) {
    for (int64_t i = 0; i < n; ++i) yr[i] = (xr[i] - m) * q * pw[i] + pb[i];
  } else if (pw != nullptr) {
    for (int64_t i = 0; i < n; ++i) yr[i] = (xr[i] - m) * q * pw[i];
  } else if (pb != nullptr) {
    for (int64_t i = 0; i < n; ++i) yr[i] = (xr[i] - m) * q + pb[i];
  } else {
    for (int64_t i = 0; i < n; ++i) yr[i] = (xr[i] - m) * q;
  }
}

template <typename T>
void forward_typed(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                   const Tensor& y, const Tensor& mean, const Tensor& rstd) {
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  const T* px = x.data<T>();
  const T* pw = weight.defined() ? weight.data<T>() : nullptr;
  const T* pb = bias.defined() ? bias.data<T>() : nullptr;
  T* py = y.data<T>();
  T* pm = mean.data<T>();
  T* pr = rstd.data<T>();
  parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      forward_row(px + r * n, pw, pb, eps, n, py + r * n, pm + r, pr + r);
    }
  });
}

// One row's share of dweight and dbias (dw, db: double accumulators over the rows) and, unless
// out is null, its dx.
template <typename T>
EMBER_NORM_CLONES void backward_row(const T* gr, const T* xr, const T* pw, T mu, T rs, int64_t n,
                                    double* dw, double* db, T* out) {
  if (dw != nullptr) {
    for (int64_t i = 0; i < n; ++i) {
      dw[i] += static_cast<double>(gr[i] * ((xr[i] - mu) * rs));
      db[i] += gr[i];
    }
  }
  if (out == nullptr) return;
  auto dxhat = [gr, pw](int64_t i) { return pw != nullptr ? gr[i] * pw[i] : gr[i]; };
  // The means of dxhat and of dxhat * xhat over the row.
  const double a = lane_sum<double>(n, [&](int64_t i) { return static_cast<double>(dxhat(i)); });
  const double b = lane_sum<double>(
      n, [&](int64_t i) { return static_cast<double>(dxhat(i) * ((xr[i] - mu) * rs)); });
  const T ma = static_cast<T>(a / n), mb = static_cast<T>(b / n);
  for (int64_t i = 0; i < n; ++i) out[i] = (dxhat(i) - ma - (xr[i] - mu) * rs * mb) * rs;
}

template <typename T>
void backward_typed(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                    const Tensor& weight, const Tensor& dx, const Tensor& dweight,
                    const Tensor& dbias) {
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  const T* pdy = dy.data<T>();
  const T* px = x.data<T>();
  const T* pm = mean.data<T>();
  const T* pr = rstd.data<T>();
  const T* pw = weight.defined() ? weight.data<T>() : nullptr;
  T* pdx = dx.defined() ? dx.data<T>() : nullptr;
  const bool want_params = dweight.defined() || dbias.defined();
  std::vector<double> dw_total(want_params ? n : 0, 0.0), db_total(want_params ? n : 0, 0.0);
  std::mutex merge;
  parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    std::vector<double> dw(want_params ? n : 0, 0.0), db(want_params ? n : 0, 0.0);
    for (int64_t r = begin; r < end; ++r) {
      backward_row(pdy + r * n, px + r * n, pw, pm[r], pr[r], n, want_params ? dw.data() : nullptr,
                   want_params ? db.data() : nullptr, pdx != nullptr ? pdx + r * n : nullptr);
    }
    if (want_params) {
      std::lock_guard<std::mutex> lock(merge);
      for (int64_t i = 0; i < n; ++i) {
        dw_total[i] += dw[i];
        db_total[i] += db[i];
      }
    }
  });
  if (dweight.defined()) {
    T* p = dweight.data<T>();
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(dw_total[i]);
  }
  if (dbias.defined()) {
    T* p = dbias.data<T>();
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(db_total[i]);
  }
}

}  // namespace

void layer_norm_forward_cpu(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                            const Tensor& y, const Tensor& mean, const Tensor& rstd) {
  if (x.dtype() == kFloat64) {
    forward_typed<double>(x, weight, bias, eps, y, mean, rstd);
  } else {
    EMBER_INTERNAL_ASSERT(x.dtype() == kFloat32, "layer_norm_forward_cpu: dtype ", x.dtype());
    forward_typed<float>(x, weight, bias, eps, y, mean, rstd);
  }
}

void layer_norm_backward_cpu(const Tensor& dy, const Tensor& x, const Tensor& mean,
                             const Tensor& rstd, const Tensor& weight, const Tensor& dx,
                             const Tensor& dweight, const Tensor& dbias) {
  if (x.dtype() == kFloat64) {
    backward_typed<double>(dy, x, mean, rstd, weight, dx, dweight, dbias);
  } else {
    EMBER_INTERNAL_ASSERT(x.dtype() == kFloat32, "layer_norm_backward_cpu: dtype ", x.dtype());
    backward_typed<float>(dy, x, mean, rstd, weight, dx, dweight, dbias);
  }
}

}  // namespace ember::detail
