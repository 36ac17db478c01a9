// CPU softmax / log_softmax over any dim of a contiguous tensor, viewed as [outer, D, inner], and
// the fused cross_entropy's row passes, which share their max and exp-and-sum.
// inner == 1 (the last dim): each row is reduced with vector loops (max, exp-and-sum, scale).
// inner > 1: tiles of `inner` columns are processed together, vectorised across the columns,
// so no strided scalar loops are needed.
// Like PyTorch's build (-fno-trapping-math): lets GCC turn the NaN-aware selects of max/min and
// exp into branch-free vector code. Must precede every include so inlined helpers match.
#pragma GCC optimize("no-trapping-math")

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <ember/tensor/detail/fast_exp.h>
#include <ember/tensor/detail/lane_sum.h>
#include <ember/tensor/detail/reduce_kernels.h>
#include <ember/tensor/threading.h>

namespace ember::detail {

namespace {

constexpr int64_t kColTile = 256;
constexpr int kLanes = 16;

// The row's max in kLanes lanes, NaN-aware: the lanes take the plain max (b > a ? b : a, one
// vmaxps in AVX-512) and a NaN is noted on the side, so no step waits on a select built from two
// compares of the previous one; a row with a NaN has the max NaN. Inlined into each wide clone
// that calls it.
template <typename T>
[[gnu::always_inline]] inline acc_t<T> row_max(const T* x, int64_t D) {
  using A = acc_t<T>;
  A mx[kLanes];
  int32_t nan[kLanes] = {};
  for (int j = 0; j < kLanes; ++j) mx[j] = lowest_v<A>();
  int64_t i = 0;
  for (; i + kLanes <= D; i += kLanes) {
#pragma GCC unroll 1  // keeps the selects vectorisable (see reduce_leaf)
    for (int j = 0; j < kLanes; ++j) {
      const A v = convert<A>(x[i + j]);
      mx[j] = v > mx[j] ? v : mx[j];
      nan[j] |= v != v;
    }
  }
  for (int j = 0; i + j < D; ++j) {
    const A v = convert<A>(x[i + j]);
    mx[j] = v > mx[j] ? v : mx[j];
    nan[j] |= v != v;
  }
  A m = mx[0];
  int32_t any_nan = nan[0];
  for (int j = 1; j < kLanes; ++j) {
    m = mx[j] > m ? mx[j] : m;
    any_nan |= nan[j];
  }
  return any_nan ? std::numeric_limits<A>::quiet_NaN() : m;
}

// e[k] = exp(x[k] - m) for the row's D elements (a plain loop vectorises best), and their sum:
// float lanes within blocks of 1024, a double total across blocks.
template <typename T>
[[gnu::always_inline]] inline double exp_sum(const T* x, int64_t D, acc_t<T> m, acc_t<T>* e) {
  using A = acc_t<T>;
  double total = 0;
  for (int64_t b = 0; b < D; b += 1024) {
    const T* xb = x + b;
    A* eb = e + b;
    total += static_cast<double>(lane_sum<A>(std::min<int64_t>(1024, D - b), [&](int64_t k) {
      const A v = exp_shifted(convert<A>(xb[k]) - m);
      eb[k] = v;
      return v;
    }));
  }
  return total;
}

// One row of D elements (inner == 1). buf holds D accumulation-type values when T != A.
template <typename T>
EMBER_WIDE_CLONES void softmax_row(const T* x, T* y, int64_t D, bool log, acc_t<T>* buf) {
  using A = acc_t<T>;
  // All -inf: exp(x - m) would be nan; PyTorch gives nan too, so keep m as is.
  const A m = row_max(x, D);

  A* e = nullptr;
  if constexpr (std::is_same_v<T, A>) {
    e = log ? buf : y;
  } else {
    e = buf;
  }
  const double total = exp_sum(x, D, m, e);
  if (log) {
    // (x - m) - log(sum), not x - (m + log(sum)): m + log(sum) would round at m's magnitude.
    const A lse = static_cast<A>(std::log(total));
    for (int64_t k = 0; k < D; ++k) y[k] = convert<T>((convert<A>(x[k]) - m) - lse);
  } else {
    const A inv = static_cast<A>(1.0 / total);
    for (int64_t k = 0; k < D; ++k) y[k] = convert<T>(e[k] * inv);
  }
}

// Columns [0, kn) of a [D, inner] block (row stride `inner`), kn <= kColTile.
template <typename T>
EMBER_WIDE_CLONES void softmax_cols(const T* x, T* y, int64_t D, int64_t inner, int64_t kn,
                                    bool log, acc_t<T>* mx, acc_t<T>* sum) {
  using A = acc_t<T>;
  for (int64_t k = 0; k < kn; ++k) {
    mx[k] = lowest_v<A>();
    sum[k] = A(0);
  }
  for (int64_t d = 0; d < D; ++d) {
    const T* r = x + d * inner;
    for (int64_t k = 0; k < kn; ++k) mx[k] = max_nan(mx[k], convert<A>(r[k]));
  }
  for (int64_t d = 0; d < D; ++d) {
    const T* r = x + d * inner;
    for (int64_t k = 0; k < kn; ++k) sum[k] += exp_shifted(convert<A>(r[k]) - mx[k]);
  }
  if (log) {
    for (int64_t k = 0; k < kn; ++k) sum[k] = std::log(sum[k]);
    for (int64_t d = 0; d < D; ++d) {
      const T* r = x + d * inner;
      T* o = y + d * inner;
      for (int64_t k = 0; k < kn; ++k) o[k] = convert<T>((convert<A>(r[k]) - mx[k]) - sum[k]);
    }
  } else {
    for (int64_t k = 0; k < kn; ++k) sum[k] = A(1) / sum[k];
    for (int64_t d = 0; d < D; ++d) {
      const T* r = x + d * inner;
      T* o = y + d * inner;
      for (int64_t k = 0; k < kn; ++k) {
        o[k] = convert<T>(exp_shifted(convert<A>(r[k]) - mx[k]) * sum[k]);
      }
    }
  }
}

// log sum exp of one row, from softmax_row's max and sum (`e`: D values of scratch).
template <typename T>
EMBER_WIDE_CLONES acc_t<T> row_logsumexp(const T* x, int64_t D, acc_t<T>* e) {
  using A = acc_t<T>;
  const A m = row_max(x, D);
  return m + static_cast<A>(std::log(exp_sum(x, D, m, e)));
}

// One row of the cross_entropy gradient (cross_entropy_rows_backward_cpu's formula) without the
// target's term. exp(x - lse) has x - lse <= 0: lse = max + log(sum) with sum >= 1.
template <typename T>
EMBER_WIDE_CLONES void cross_entropy_grad_row(const T* x, T* dx, int64_t D, acc_t<T> lse,
                                              acc_t<T> scale, acc_t<T> smooth, const acc_t<T>* w) {
  using A = acc_t<T>;
  if (w != nullptr) {
    for (int64_t k = 0; k < D; ++k) {
      dx[k] = convert<T>(scale * exp_shifted(convert<A>(x[k]) - lse) - smooth * w[k]);
    }
  } else {
    for (int64_t k = 0; k < D; ++k) {
      dx[k] = convert<T>(scale * exp_shifted(convert<A>(x[k]) - lse) - smooth);
    }
  }
}

}  // namespace

void cross_entropy_rows_cpu(const Tensor& lse, const Tensor& picked, const Tensor& x,
                            const Tensor& target) {
  EMBER_INTERNAL_ASSERT(x.dim() == 2 && x.is_contiguous() && target.is_contiguous() &&
                            lse.is_contiguous() && picked.is_contiguous(),
                        "cross_entropy_rows_cpu needs dense [N, C], [N] tensors");
  const int64_t N = x.size(0), C = x.size(1);
  if (N == 0 || C == 0) return;
  EMBER_DISPATCH_FLOATING(x.dtype(), "cross_entropy", [&]<typename T>() {
    using A = acc_t<T>;
    const T* xp = x.data<T>();
    const int64_t* t = target.data<int64_t>();
    A* lp = lse.data<A>();
    A* pp = picked.data<A>();
    parallel_for(0, N, std::max<int64_t>(1, kGrainSize / C), [&](int64_t b, int64_t e) {
      std::vector<A> buf(static_cast<size_t>(C));
      for (int64_t i = b; i < e; ++i) {
        lp[i] = row_logsumexp(xp + i * C, C, buf.data());
        pp[i] = convert<A>(xp[i * C + t[i]]);
      }
    });
  });
}

void cross_entropy_rows_backward_cpu(const Tensor& dx, const Tensor& x, const Tensor& lse,
                                     const Tensor& target, const Tensor& scale,
                                     const Tensor& smooth, const Tensor& weight, const Tensor& at) {
  EMBER_INTERNAL_ASSERT(x.dim() == 2 && x.is_contiguous() && dx.is_contiguous(),
                        "cross_entropy_rows_backward_cpu needs dense [N, C] tensors");
  const int64_t N = x.size(0), C = x.size(1);
  if (N == 0 || C == 0) return;
  EMBER_DISPATCH_FLOATING(x.dtype(), "cross_entropy backward", [&]<typename T>() {
    using A = acc_t<T>;
    const T* xp = x.data<T>();
    T* d = dx.data<T>();
    const int64_t* t = target.data<int64_t>();
    const A* l = lse.data<A>();
    const A* s = scale.data<A>();
    const A* sm = smooth.defined() ? smooth.data<A>() : nullptr;
    const A* w = weight.defined() ? weight.data<A>() : nullptr;
    const A* a = at.data<A>();
    parallel_for(0, N, std::max<int64_t>(1, kGrainSize / C), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const A smooth_i = sm != nullptr ? sm[i] : A(0);
        cross_entropy_grad_row(xp + i * C, d + i * C, C, l[i], s[i], smooth_i, w);
        // The target's entry again, with its term, rounded once (as the CUDA kernel does).
        const int64_t ti = t[i];
        d[i * C + ti] = convert<T>(s[i] * exp_shifted(convert<A>(xp[i * C + ti]) - l[i]) -
                                   smooth_i * (w != nullptr ? w[ti] : A(1)) + a[i]);
      }
    });
  });
}

void softmax_cpu(const Tensor& out, const Tensor& in, int64_t dim, bool log) {
  EMBER_INTERNAL_ASSERT(in.is_contiguous() && out.is_contiguous(), "softmax needs dense tensors");
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= in.size(d);
  for (int64_t d = dim + 1; d < in.dim(); ++d) inner *= in.size(d);
  const int64_t D = in.size(dim);
  if (in.numel() == 0) return;
  EMBER_DISPATCH_FLOATING(in.dtype(), log ? "log_softmax" : "softmax", [&]<typename T>() {
    using A = acc_t<T>;
    const T* x = in.data<T>();
    T* y = out.data<T>();
    if (inner == 1) {
      const int64_t grain = std::max<int64_t>(1, kGrainSize / D);
      parallel_for(0, outer, grain, [&](int64_t b, int64_t e) {
        const bool need_buf = !std::is_same_v<T, A> || log;
        std::vector<A> buf(need_buf ? D : 0);
        for (int64_t o = b; o < e; ++o) softmax_row(x + o * D, y + o * D, D, log, buf.data());
      });
      return;
    }
    const int64_t tiles = (inner + kColTile - 1) / kColTile;
    const int64_t grain =
        std::max<int64_t>(1, kGrainSize / std::max<int64_t>(D * std::min(inner, kColTile), 1));
    parallel_for(0, outer * tiles, grain, [&](int64_t b, int64_t e) {
      std::vector<A> mx(kColTile), sum(kColTile);
      for (int64_t t = b; t < e; ++t) {
        const int64_t o = t / tiles, k0 = (t % tiles) * kColTile;
        const int64_t kn = std::min(kColTile, inner - k0);
        const int64_t off = o * D * inner + k0;
        softmax_cols(x + off, y + off, D, inner, kn, log, mx.data(), sum.data());
      }
    });
  });
}

}  // namespace ember::detail
