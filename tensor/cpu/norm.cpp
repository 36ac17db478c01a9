// Fused layer norm and batch norm on the CPU (tensor/detail/norm_kernels.h). Layer norm: rows in
// parallel, each row's passes (mean, variance, output; backward's parameter sums, two row sums,
// dx) while it sits in the L1 cache. Batch norm: the per-channel sums over the N runs of a
// channel in parallel over channels, then the element-wise pass over all runs.
#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <vector>

#include <ember/tensor/detail/lane_sum.h>
#include <ember/tensor/detail/norm_kernels.h>
#include <ember/tensor/dtype.h>
#include <ember/tensor/error.h>
#include <ember/tensor/threading.h>

namespace ember::detail {

namespace {

int64_t row_grain(int64_t n) { return std::max<int64_t>(1, kGrainSize / std::max<int64_t>(n, 1)); }

// One row: y = (x - mean) * rstd * w + b (w, b optional), the statistics in double.
template <typename T>
EMBER_WIDE_CLONES void forward_row(const T* xr, const T* pw, const T* pb, double eps, int64_t n,
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
EMBER_WIDE_CLONES void backward_row(const T* gr, const T* xr, const T* pw, T mu, T rs, int64_t n,
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
  // Each chunk's partial sums, merged in row order after the loop: merged as the threads
  // finished, the double sums (so dweight's last bit) changed from run to run.
  std::map<int64_t, std::pair<std::vector<double>, std::vector<double>>> parts;
  std::mutex merge;
  parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    std::vector<double> dw(want_params ? n : 0, 0.0), db(want_params ? n : 0, 0.0);
    for (int64_t r = begin; r < end; ++r) {
      backward_row(pdy + r * n, px + r * n, pw, pm[r], pr[r], n, want_params ? dw.data() : nullptr,
                   want_params ? db.data() : nullptr, pdx != nullptr ? pdx + r * n : nullptr);
    }
    if (want_params) {
      std::lock_guard<std::mutex> lock(merge);
      parts.emplace(begin, std::make_pair(std::move(dw), std::move(db)));
    }
  });
  std::vector<double> dw_total(want_params ? n : 0, 0.0), db_total(want_params ? n : 0, 0.0);
  for (const auto& [begin, part] : parts) {
    for (int64_t i = 0; i < n; ++i) {
      dw_total[i] += part.first[i];
      db_total[i] += part.second[i];
    }
  }
  if (dweight.defined()) {
    T* p = dweight.data<T>();
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(dw_total[i]);
  }
  if (dbias.defined()) {
    T* p = dbias.data<T>();
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(db_total[i]);
  }
}

// ---- batch norm: channels of [N, C, L] ----------------------------------------------------------

template <typename T>
EMBER_WIDE_CLONES double run_sum(const T* x, int64_t n) {
  return lane_sum<double>(n, [x](int64_t i) { return static_cast<double>(x[i]); });
}

// sum((x - mu)^2) over one run.
template <typename T>
EMBER_WIDE_CLONES double run_sq_dev(const T* x, int64_t n, double mu) {
  return lane_sum<double>(n, [x, mu](int64_t i) {
    const double d = x[i] - mu;
    return d * d;
  });
}

// sum(g * (x - mu)) over one run.
template <typename T>
EMBER_WIDE_CLONES double run_dot_dev(const T* g, const T* x, int64_t n, double mu) {
  return lane_sum<double>(n, [g, x, mu](int64_t i) {
    return static_cast<double>(g[i]) * (static_cast<double>(x[i]) - mu);
  });
}

template <typename T>
EMBER_WIDE_CLONES void run_affine(const T* x, T* y, int64_t n, T scale, T shift) {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * scale + shift;
}

// dx = (g - a - (x - mu) * b) * k over one run.
template <typename T>
EMBER_WIDE_CLONES void run_bn_dx(const T* g, const T* x, T* dx, int64_t n, T a, T mu, T b, T k) {
  for (int64_t i = 0; i < n; ++i) dx[i] = (g[i] - a - (x[i] - mu) * b) * k;
}

template <typename T>
EMBER_WIDE_CLONES void run_scale(const T* g, T* dx, int64_t n, T k) {
  for (int64_t i = 0; i < n; ++i) dx[i] = g[i] * k;
}

// [N, C, L] of a contiguous x whose dim 1 is C.
struct ChannelRuns {
  int64_t N, C, L;
  explicit ChannelRuns(const Tensor& x)
      : N(x.size(0)), C(x.size(1)), L(x.numel() / std::max<int64_t>(x.size(0) * x.size(1), 1)) {}
  int64_t offset(int64_t n, int64_t c) const { return (n * C + c) * L; }
  // Grain of a loop over channels, each N runs of L.
  int64_t channel_grain() const {
    return std::max<int64_t>(1, kGrainSize / std::max<int64_t>(N * L, 1));
  }
  // Grain of a loop over the N * C runs.
  int64_t run_grain() const { return row_grain(L); }
};

template <typename T>
void bn_forward_typed(const Tensor& x, const Tensor& weight, const Tensor& bias, bool training,
                      double eps, const Tensor& mean, const Tensor& var, const Tensor& invstd,
                      const Tensor& y) {
  const ChannelRuns r(x);
  const T* px = x.data<T>();
  T* pm = mean.data<T>();
  T* pi = invstd.data<T>();
  if (training) {
    T* pv = var.data<T>();
    const double count = static_cast<double>(r.N * r.L);
    parallel_for(0, r.C, r.channel_grain(), [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        double s = 0;
        for (int64_t n = 0; n < r.N; ++n) s += run_sum(px + r.offset(n, c), r.L);
        const double mu = s / count;
        double ss = 0;
        for (int64_t n = 0; n < r.N; ++n) ss += run_sq_dev(px + r.offset(n, c), r.L, mu);
        const double v = ss / count;
        pm[c] = static_cast<T>(mu);
        pv[c] = static_cast<T>(v);
        pi[c] = static_cast<T>(1.0 / std::sqrt(v + eps));
      }
    });
  }
  // The form PyTorch's CPU kernel computes: y = x * scale + shift.
  std::vector<T> scale(r.C), shift(r.C);
  const T* pw = weight.defined() ? weight.data<T>() : nullptr;
  const T* pb = bias.defined() ? bias.data<T>() : nullptr;
  for (int64_t c = 0; c < r.C; ++c) {
    scale[c] = pw != nullptr ? pi[c] * pw[c] : pi[c];
    shift[c] = (pb != nullptr ? pb[c] : T(0)) - pm[c] * scale[c];
  }
  T* py = y.data<T>();
  parallel_for(0, r.N * r.C, r.run_grain(), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t c = i % r.C;
      run_affine(px + i * r.L, py + i * r.L, r.L, scale[c], shift[c]);
    }
  });
}

template <typename T>
void bn_backward_typed(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& mean,
                       const Tensor& invstd, bool training, const Tensor& dx, const Tensor& dweight,
                       const Tensor& dbias) {
  const ChannelRuns r(x);
  const T* pg = dy.data<T>();
  const T* px = x.data<T>();
  const T* pw = weight.defined() ? weight.data<T>() : nullptr;
  const T* pm = mean.data<T>();
  const T* pi = invstd.data<T>();
  // Per channel: sum(dy) and sum(dy * (x - mean)), needed by dweight, dbias and training's dx.
  const bool sums = dweight.defined() || dbias.defined() || (dx.defined() && training);
  std::vector<double> sum_g(sums ? r.C : 0), sum_gx(sums ? r.C : 0);
  if (sums) {
    parallel_for(0, r.C, r.channel_grain(), [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        double g = 0, gx = 0;
        for (int64_t n = 0; n < r.N; ++n) {
          g += run_sum(pg + r.offset(n, c), r.L);
          gx += run_dot_dev(pg + r.offset(n, c), px + r.offset(n, c), r.L,
                            static_cast<double>(pm[c]));
        }
        sum_g[c] = g;
        sum_gx[c] = gx;
      }
    });
  }
  if (dbias.defined()) {
    T* p = dbias.data<T>();
    for (int64_t c = 0; c < r.C; ++c) p[c] = static_cast<T>(sum_g[c]);
  }
  if (dweight.defined()) {
    T* p = dweight.data<T>();
    for (int64_t c = 0; c < r.C; ++c) p[c] = static_cast<T>(sum_gx[c] * static_cast<double>(pi[c]));
  }
  if (!dx.defined()) return;
  T* pdx = dx.data<T>();
  const double count = static_cast<double>(r.N * r.L);
  // dx = (dy - a - (x - mean) * b) * k: a = mean(dy), b = mean(dy * xhat) * invstd,
  // k = weight * invstd; in evaluation a = b = 0.
  std::vector<T> a(r.C), b(r.C), k(r.C);
  for (int64_t c = 0; c < r.C; ++c) {
    const double is = pi[c];
    k[c] = static_cast<T>((pw != nullptr ? static_cast<double>(pw[c]) : 1.0) * is);
    a[c] = training ? static_cast<T>(sum_g[c] / count) : T(0);
    b[c] = training ? static_cast<T>(sum_gx[c] / count * is * is) : T(0);
  }
  parallel_for(0, r.N * r.C, r.run_grain(), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t c = i % r.C;
      if (training) {
        run_bn_dx(pg + i * r.L, px + i * r.L, pdx + i * r.L, r.L, a[c], pm[c], b[c], k[c]);
      } else {
        run_scale(pg + i * r.L, pdx + i * r.L, r.L, k[c]);
      }
    }
  });
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

void batch_norm_forward_cpu(const Tensor& x, const Tensor& weight, const Tensor& bias,
                            bool training, double eps, const Tensor& mean, const Tensor& var,
                            const Tensor& invstd, const Tensor& y) {
  if (x.dtype() == kFloat64) {
    bn_forward_typed<double>(x, weight, bias, training, eps, mean, var, invstd, y);
  } else {
    EMBER_INTERNAL_ASSERT(x.dtype() == kFloat32, "batch_norm_forward_cpu: dtype ", x.dtype());
    bn_forward_typed<float>(x, weight, bias, training, eps, mean, var, invstd, y);
  }
}

void batch_norm_backward_cpu(const Tensor& dy, const Tensor& x, const Tensor& weight,
                             const Tensor& mean, const Tensor& invstd, bool training,
                             const Tensor& dx, const Tensor& dweight, const Tensor& dbias) {
  if (x.dtype() == kFloat64) {
    bn_backward_typed<double>(dy, x, weight, mean, invstd, training, dx, dweight, dbias);
  } else {
    EMBER_INTERNAL_ASSERT(x.dtype() == kFloat32, "batch_norm_backward_cpu: dtype ", x.dtype());
    bn_backward_typed<float>(dy, x, weight, mean, invstd, training, dx, dweight, dbias);
  }
}
}  // namespace ember::detail
