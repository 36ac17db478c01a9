// Fused layer norm on the CPU (tensor/detail/norm_kernels.h): rows in parallel; forward reads x
// twice (mean, then variance and output), backward reads dy and x twice per row.
#include <cmath>
#include <mutex>
#include <vector>

#include <ember/tensor/detail/norm_kernels.h>
#include <ember/tensor/dtype.h>
#include <ember/tensor/error.h>
#include <ember/tensor/threading.h>

namespace ember::detail {

namespace {

int64_t row_grain(int64_t n) { return std::max<int64_t>(1, kGrainSize / std::max<int64_t>(n, 1)); }

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
      const T* xr = px + r * n;
      double s = 0;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < n; ++i) s += xr[i];
      const double mu = s / n;
      double ss = 0;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) {
        const double d = xr[i] - mu;
        ss += d * d;
      }
      const double rs = 1.0 / std::sqrt(ss / n + eps);
      pm[r] = static_cast<T>(mu);
      pr[r] = static_cast<T>(rs);
      const T m = static_cast<T>(mu), q = static_cast<T>(rs);
      T* yr = py + r * n;
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
  });
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
      const T* xr = px + r * n;
      const T* gr = pdy + r * n;
      const T mu = pm[r], rs = pr[r];
      if (want_params) {
        for (int64_t i = 0; i < n; ++i) {
          dw[i] += static_cast<double>(gr[i] * ((xr[i] - mu) * rs));
          db[i] += gr[i];
        }
      }
      if (pdx == nullptr) continue;
      double a = 0, b = 0;  // sums of dxhat and dxhat * xhat over the row
#pragma omp simd reduction(+ : a, b)
      for (int64_t i = 0; i < n; ++i) {
        const T dxh = pw != nullptr ? gr[i] * pw[i] : gr[i];
        a += dxh;
        b += dxh * ((xr[i] - mu) * rs);
      }
      const T ma = static_cast<T>(a / n), mb = static_cast<T>(b / n);
      T* out = pdx + r * n;
      for (int64_t i = 0; i < n; ++i) {
        const T dxh = pw != nullptr ? gr[i] * pw[i] : gr[i];
        out[i] = (dxh - ma - (xr[i] - mu) * rs * mb) * rs;
      }
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
