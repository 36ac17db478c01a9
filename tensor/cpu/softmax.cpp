// CPU softmax / log_softmax over any dim of a contiguous tensor, viewed as [outer, D, inner].
// inner == 1 (the last dim): each row is reduced with vector loops (max, exp-and-sum, scale).
// inner > 1: tiles of `inner` columns are processed together, vectorised across the columns,
// so no strided scalar loops are needed.
// Like PyTorch's build (-fno-trapping-math): lets GCC turn the NaN-aware selects of max/min and
// exp into branch-free vector code. Must precede every include so inlined helpers match.
#pragma GCC optimize("no-trapping-math")

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <ember/tensor/detail/fast_exp.h>
#include <ember/tensor/detail/lane_sum.h>
#include <ember/tensor/detail/reduce_kernels.h>
#include <ember/tensor/threading.h>

namespace ember::detail {

namespace {

constexpr int64_t kColTile = 256;
constexpr int kLanes = 16;

// One row of D elements (inner == 1). buf holds D accumulation-type values when T != A.
template <typename T>
EMBER_WIDE_CLONES void softmax_row(const T* x, T* y, int64_t D, bool log, acc_t<T>* buf) {
  using A = acc_t<T>;
  A mx[kLanes];
  for (int j = 0; j < kLanes; ++j) mx[j] = lowest_v<A>();
  int64_t i = 0;
  for (; i + kLanes <= D; i += kLanes) {
#pragma GCC unroll 1  // keeps the NaN-aware select vectorisable (see reduce_leaf)
    for (int j = 0; j < kLanes; ++j) mx[j] = max_nan(mx[j], convert<A>(x[i + j]));
  }
  for (int j = 0; i + j < D; ++j) mx[j] = max_nan(mx[j], convert<A>(x[i + j]));
  A m = mx[0];
  for (int j = 1; j < kLanes; ++j) m = max_nan(m, mx[j]);
  // All -inf: exp(x - m) would be nan; PyTorch gives nan too, so keep m as is.

  A* e = nullptr;
  if constexpr (std::is_same_v<T, A>) {
    e = log ? buf : y;
  } else {
    e = buf;
  }
  // Exponentials first (a plain loop vectorises best), then their sum: float lanes within
  // blocks, a double total across blocks.
  for (int64_t k = 0; k < D; ++k) e[k] = exp_shifted(convert<A>(x[k]) - m);
  double total = 0;
  for (int64_t b = 0; b < D; b += 1024) {
    total += static_cast<double>(lane_sum(e + b, std::min<int64_t>(1024, D - b)));
  }
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

}  // namespace

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
