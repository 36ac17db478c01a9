// Kernels behind tensor/ops/reduce.h (internal): the reduction geometry, the per-element math of
// every reduction as __host__ __device__ functors shared by the CPU and CUDA engines, and the
// backend entry points the front end (tensor/ops/reduce.cpp, tensor/ops/softmax.cpp) dispatches to.
//
// Note [Reduction geometry]
// A reduction maps an input of any strides onto a contiguous output laid out like the input
// with the reduced dims removed (equivalently: keepdim=true, reduced dims of size 1). The
// geometry splits the input dims into kept dims (original order, so the output index is their
// row-major index) and reduced dims (sorted by decreasing stride), drops size-1 dims and merges
// neighbours that are contiguous with each other. The engines then recognise two fast layouts:
//   inner: the reduced block is one run of stride 1 -> each output reduces one dense row;
//   outer: the innermost kept dim has stride 1 -> rows of the reduced dims are accumulated
//          into a vector of outputs, vectorised over that kept dim (e.g. sum over dim 0).
// Anything else is first copied into (kept..., reduced...) order, which makes it `inner`.
//
// Note [Reduction functors]
// A reducer R has `using acc = A` (the accumulation type), `identity()`, `map(x, ctx)` (one
// input element to A), `combine(a, b)` (associative) and `project<O>(a, ctx)` (the final value).
// `ctx` is a per-output value of type A computed by an earlier pass (the mean for var, the max
// for logsumexp); reducers that need none ignore it. Floating sums are pairwise/blocked in the
// engines, so reducers only describe single steps.
#pragma once

#include <math.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <ember/tensor/half.h>
#include <ember/tensor/shape.h>
#include <ember/tensor/tensor.h>

// Hot CPU loops are compiled twice, for AVX2 and for the baseline, and picked at load time
// (GCC function multi-versioning): the build targets baseline x86-64 (SSE2) like Debian's
// PyTorch, whose kernels also dispatch to AVX2 at run time. The lane counts of the loops do not
// depend on the version, so both give bit-identical results.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define EMBER_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define EMBER_SIMD_CLONES
#endif

namespace ember::detail {

/// Kept and reduced dims of a reduction (Note [Reduction geometry]); strides in elements.
struct ReduceGeom {
  int nkeep = 0;
  int nred = 0;
  int64_t keep_sizes[kMaxDims] = {};
  int64_t keep_strides[kMaxDims] = {};
  int64_t red_sizes[kMaxDims] = {};
  int64_t red_strides[kMaxDims] = {};
  int64_t num_out = 1;    ///< number of outputs (product of kept sizes)
  int64_t red_numel = 1;  ///< elements reduced into each output

  /// Every output reduces one dense run of red_numel elements.
  bool inner() const { return nred == 1 && red_strides[0] == 1; }
  /// The innermost kept dim is dense: accumulate reduced rows into a vector of outputs.
  bool outer() const { return nkeep >= 1 && keep_strides[nkeep - 1] == 1; }

  /// Offset (elements) of the first input element of output o.
  EMBER_HD int64_t keep_offset(int64_t o) const {
    int64_t off = 0;
    for (int d = nkeep - 1; d >= 0; --d) {
      off += (o % keep_sizes[d]) * keep_strides[d];
      o /= keep_sizes[d];
    }
    return off;
  }
  /// Offset (elements) of the r-th reduced element relative to its output's first element.
  EMBER_HD int64_t red_offset(int64_t r) const {
    int64_t off = 0;
    for (int d = nred - 1; d >= 0; --d) {
      off += (r % red_sizes[d]) * red_strides[d];
      r /= red_sizes[d];
    }
    return off;
  }
};

// ---- functors (Note [Reduction functors]) -------------------------------------------------

template <typename T>
EMBER_HD inline bool is_nan_v(T v) {
  if constexpr (std::is_floating_point_v<T>) {
    return v != v;
  } else {
    return false;
  }
}

template <typename A>
EMBER_HD inline A lowest_v() {
  if constexpr (std::is_floating_point_v<A>) {
    return -std::numeric_limits<A>::infinity();
  } else {
    return std::numeric_limits<A>::lowest();
  }
}
template <typename A>
EMBER_HD inline A highest_v() {
  if constexpr (std::is_floating_point_v<A>) {
    return std::numeric_limits<A>::infinity();
  } else {
    return std::numeric_limits<A>::max();
  }
}

// C math on float or double, host and device.
template <typename A>
EMBER_HD inline A sqrt_v(A v) {
  if constexpr (std::is_same_v<A, float>) return ::sqrtf(v); else return ::sqrt(v);
}
template <typename A>
EMBER_HD inline A exp_v(A v) {
  if constexpr (std::is_same_v<A, float>) return ::expf(v); else return ::exp(v);
}
template <typename A>
EMBER_HD inline A log_v(A v) {
  if constexpr (std::is_same_v<A, float>) return ::logf(v); else return ::log(v);
}
template <typename A>
EMBER_HD inline A pow_v(A a, A b) {
  if constexpr (std::is_same_v<A, float>) return ::powf(a, b); else return ::pow(a, b);
}

template <typename A>
EMBER_HD inline A abs_v(A v) {
  return v < A(0) ? -v : v;
}

// Largest / smallest of two values; NaN wins (propagates) as in torch.max. Bitwise | rather
// than || keeps the loops that use these branch-free, so they vectorise.
template <typename A>
EMBER_HD inline A max_nan(A a, A b) {
  return ((b > a) | is_nan_v(b)) ? b : a;
}
template <typename A>
EMBER_HD inline A min_nan(A a, A b) {
  return ((b < a) | is_nan_v(b)) ? b : a;
}

/// Accumulation type of sum/prod: int64 for integers and bool, float for 16-bit floats.
template <typename T>
using sum_acc_t = std::conditional_t<std::is_integral_v<T>, int64_t, acc_t<T>>;

template <typename T>
struct SumOp {
  using acc = sum_acc_t<T>;
  EMBER_HD acc identity() const { return acc(0); }
  EMBER_HD acc map(T x, acc) const { return convert<acc>(x); }
  EMBER_HD acc combine(acc a, acc b) const { return a + b; }
  template <typename O>
  EMBER_HD O project(acc a, acc) const { return convert<O>(a); }
};

template <typename T>
struct MeanOp : SumOp<T> {
  using acc = typename SumOp<T>::acc;
  acc n;  ///< elements per output (0 gives nan, as torch.mean of nothing)
  template <typename O>
  EMBER_HD O project(acc a, acc) const { return convert<O>(a / n); }
};

template <typename T>
struct ProdOp {
  using acc = sum_acc_t<T>;
  EMBER_HD acc identity() const { return acc(1); }
  EMBER_HD acc map(T x, acc) const { return convert<acc>(x); }
  EMBER_HD acc combine(acc a, acc b) const { return a * b; }
  template <typename O>
  EMBER_HD O project(acc a, acc) const { return convert<O>(a); }
};

template <typename T>
struct MaxOp {
  using acc = acc_t<T>;
  static constexpr bool kSelect = true;  ///< combine is a select (CPU loop shape hint)
  EMBER_HD acc identity() const { return lowest_v<acc>(); }
  EMBER_HD acc map(T x, acc) const { return convert<acc>(x); }
  EMBER_HD acc combine(acc a, acc b) const { return max_nan(a, b); }
  template <typename O>
  EMBER_HD O project(acc a, acc) const { return convert<O>(a); }
};

template <typename T>
struct MinOp {
  using acc = acc_t<T>;
  static constexpr bool kSelect = true;  ///< combine is a select (CPU loop shape hint)
  EMBER_HD acc identity() const { return highest_v<acc>(); }
  EMBER_HD acc map(T x, acc) const { return convert<acc>(x); }
  EMBER_HD acc combine(acc a, acc b) const { return min_nan(a, b); }
  template <typename O>
  EMBER_HD O project(acc a, acc) const { return convert<O>(a); }
};

// any/all accumulate in uint8 (0/1) rather than bool so SIMD lanes and warp shuffles apply.
template <typename T>
struct AnyOp {
  using acc = uint8_t;
  EMBER_HD acc identity() const { return 0; }
  EMBER_HD acc map(T x, acc) const { return convert<bool>(x) ? 1 : 0; }
  EMBER_HD acc combine(acc a, acc b) const { return a | b; }
  template <typename O>
  EMBER_HD O project(acc a, acc) const { return a != 0; }
};
template <typename T>
struct AllOp {
  using acc = uint8_t;
  EMBER_HD acc identity() const { return 1; }
  EMBER_HD acc map(T x, acc) const { return convert<bool>(x) ? 1 : 0; }
  EMBER_HD acc combine(acc a, acc b) const { return a & b; }
  template <typename O>
  EMBER_HD O project(acc a, acc) const { return a != 0; }
};

// Norms. p = 2, 1, 0, +-inf get their own functors; other p use NormPOp.
template <typename T>
struct Norm2Op : SumOp<T> {
  using acc = acc_t<T>;
  EMBER_HD acc map(T x, acc) const {
    const acc v = convert<acc>(x);
    return v * v;
  }
  template <typename O>
  EMBER_HD O project(acc a, acc) const { return convert<O>(sqrt_v(a)); }
};
template <typename T>
struct Norm1Op : SumOp<T> {
  using acc = acc_t<T>;
  EMBER_HD acc map(T x, acc) const { return abs_v(convert<acc>(x)); }
};
template <typename T>
struct Norm0Op : SumOp<T> {
  using acc = acc_t<T>;
  EMBER_HD acc map(T x, acc) const { return convert<acc>(x) != acc(0) ? acc(1) : acc(0); }
};
template <typename T>
struct NormPOp : SumOp<T> {
  using acc = acc_t<T>;
  acc p;
  EMBER_HD acc map(T x, acc) const { return pow_v(abs_v(convert<acc>(x)), p); }
  template <typename O>
  EMBER_HD O project(acc a, acc) const { return convert<O>(pow_v(a, acc(1) / p)); }
};
template <typename T>
struct NormInfOp : MaxOp<T> {
  using acc = acc_t<T>;
  EMBER_HD acc identity() const { return acc(0); }  // |x| >= 0; the norm of nothing is 0
  EMBER_HD acc map(T x, acc) const { return abs_v(convert<acc>(x)); }
};
template <typename T>
struct NormNegInfOp : MinOp<T> {
  using acc = acc_t<T>;
  EMBER_HD acc map(T x, acc) const { return abs_v(convert<acc>(x)); }
};

/// Calls f(op) with the functor of the p-norm (p = 2, 1, 0, +inf, -inf or any other p): the
/// dispatch the CPU and CUDA reductions and the multi-tensor norms share.
template <typename T, typename F>
void with_norm_op(double p, F&& f) {
  if (p == 2.0) {
    f(Norm2Op<T>{});
  } else if (p == 1.0) {
    f(Norm1Op<T>{});
  } else if (p == 0.0) {
    f(Norm0Op<T>{});
  } else if (std::isinf(p)) {
    if (p > 0) {
      f(NormInfOp<T>{});
    } else {
      f(NormNegInfOp<T>{});
    }
  } else {
    NormPOp<T> r;
    r.p = acc_t<T>(p);
    f(r);
  }
}

/// Second pass of var/std: sum of squared deviations from ctx (the mean).
template <typename T>
struct VarOp : SumOp<T> {
  using acc = acc_t<T>;
  acc divisor;  ///< max(0, n - correction)
  bool take_sqrt;
  EMBER_HD acc map(T x, acc mean) const {
    const acc d = convert<acc>(x) - mean;
    return d * d;
  }
  template <typename O>
  EMBER_HD O project(acc a, acc) const {
    const acc v = a / divisor;
    return convert<O>(take_sqrt ? sqrt_v(v) : v);
  }
};

/// First pass of logsumexp: the max, replaced by 0 when infinite so exp(x - m) stays finite.
template <typename T>
struct LseMaxOp : MaxOp<T> {
  using acc = acc_t<T>;
  template <typename O>
  EMBER_HD O project(acc a, acc) const {
    return (a == highest_v<acc>() || a == lowest_v<acc>()) ? O(0) : convert<O>(a);
  }
};
/// Second pass of logsumexp: log(sum(exp(x - m))) + m, with m = ctx.
template <typename T>
struct LseSumOp : SumOp<T> {
  using acc = acc_t<T>;
  EMBER_HD acc map(T x, acc m) const { return exp_v(convert<acc>(x) - m); }
  template <typename O>
  EMBER_HD O project(acc a, acc m) const { return convert<O>(log_v(a) + m); }
};

/// Whether v beats the current best for argmax (kMax) / argmin. NaN beats any number (and an
/// earlier NaN is kept), as in torch.argmax.
template <bool kMax, typename A>
EMBER_HD inline bool arg_better(A v, A best) {
  if constexpr (kMax) {
    return (v > best) | (is_nan_v(v) & !is_nan_v(best));
  } else {
    return (v < best) | (is_nan_v(v) & !is_nan_v(best));
  }
}
/// Whether (v, i) should replace (best, bi) when merging partial results (ties: lower index).
template <bool kMax, typename A>
EMBER_HD inline bool arg_merge(A v, int64_t i, A best, int64_t bi) {
  if (arg_better<kMax>(v, best)) return true;
  const bool same = v == best || (is_nan_v(v) && is_nan_v(best));
  return same && i < bi;
}

// ---- backend entry points ------------------------------------------------------------------
enum class ReduceKind : uint8_t { Sum, Prod, Mean, Max, Min, Any, All, Norm, Var, LogSumExp };

struct ReduceParams {
  double p = 2.0;          ///< Norm
  int64_t correction = 1;  ///< Var
  bool take_sqrt = false;  ///< Var: std
};

/// Geometry of reducing the dims in `mask` (bit d = dim d) of `in`.
ReduceGeom make_reduce_geom(const Tensor& in, uint32_t mask);

/// The input (and geometry) a kernel reduces: `in` itself when its strides give dense reduced
/// runs (inner) or a dense kept dim (outer), else a copy in (kept..., reduced...) order.
struct ReduceInput {
  Tensor src;
  ReduceGeom g;
};
ReduceInput prepare_reduce(const Tensor& in, uint32_t mask);

/// out[kept] = reduction of in over the dims in mask. out is contiguous with numel equal to the
/// number of kept positions and has the dtype the front end chose: int64 for integer/bool
/// Sum/Prod, bool for Any/All, in's dtype otherwise. in has any strides, same device.
void reduce_cpu(ReduceKind kind, const Tensor& out, const Tensor& in, uint32_t mask,
                const ReduceParams& params);
void reduce_cuda(ReduceKind kind, const Tensor& out, const Tensor& in, uint32_t mask,
                 const ReduceParams& params);

/// Extreme along `dim` (size > 0): indices (int64, contiguous) and, when defined, values (in's
/// dtype, contiguous), both with the kept positions' numel. First occurrence wins; NaN is the
/// extreme.
void arg_reduce_cpu(const Tensor& values, const Tensor& indices, const Tensor& in, int64_t dim,
                    bool is_max);
void arg_reduce_cuda(const Tensor& values, const Tensor& indices, const Tensor& in, int64_t dim,
                     bool is_max);

/// Whether element (v, i) of a row comes before (w, j) in topk's order: the larger first when
/// `largest` (else the smaller), NaN counting as larger than every number (torch.topk), and of
/// equal values the lower index first, so that the order is total and the result deterministic.
template <typename A>
EMBER_HD inline bool topk_before(A v, int64_t i, A w, int64_t j, bool largest) {
  const bool vn = is_nan_v(v), wn = is_nan_v(w);
  if (vn != wn) return largest ? vn : wn;
  if (!vn && v != w) return largest ? v > w : v < w;
  return i < j;
}

/// indices [rows, k] (int64, contiguous) receives, for each row of `in` ([rows, n], contiguous,
/// 0 < k <= n), the positions of its k first elements in topk_before's order, in that order.
void topk_cpu(const Tensor& indices, const Tensor& in, int64_t k, bool largest);
void topk_cuda(const Tensor& indices, const Tensor& in, int64_t k, bool largest);

/// out = softmax (or log_softmax) of in along dim; in and out contiguous, same shape and
/// floating dtype.
void softmax_cpu(const Tensor& out, const Tensor& in, int64_t dim, bool log);
void softmax_cuda(const Tensor& out, const Tensor& in, int64_t dim, bool log);

/// The fused 2-d cross_entropy's row passes (Note [Fused cross_entropy], tensor/ops/loss.cpp),
/// for x [N, C] contiguous and target int64 [N] contiguous. A is the accumulation type (float32
/// for float16 and bfloat16 x, else x's dtype); every [N] and [C] tensor is contiguous in A.
/// Forward: lse[i] = log sum_c exp(x[i, c]) and picked[i] = x[i, target[i]]. Backward, one pass
/// writing dx (x's shape and dtype, contiguous), from that lse, with smooth [N] (undefined: 0)
/// and weight [C] (undefined: 1), each element computed in A and rounded once:
///   dx[i, c] = scale[i] exp(x[i, c] - lse[i]) - smooth[i] weight[c] + (c == target[i]) at[i].
/// Targets must lie in [0, C): the CPU's are checked before; the CUDA forward checks them on the
/// device (Note [CUDA index checks], tensor/cuda/indexing.cu; a bad one's picked value is 0) and
/// the backward never indexes by them.
void cross_entropy_rows_cpu(const Tensor& lse, const Tensor& picked, const Tensor& x,
                            const Tensor& target);
void cross_entropy_rows_backward_cpu(const Tensor& dx, const Tensor& x, const Tensor& lse,
                                     const Tensor& target, const Tensor& scale,
                                     const Tensor& smooth, const Tensor& weight, const Tensor& at);
void cross_entropy_rows_cuda(const Tensor& lse, const Tensor& picked, const Tensor& x,
                             const Tensor& target);
void cross_entropy_rows_backward_cuda(const Tensor& dx, const Tensor& x, const Tensor& lse,
                                      const Tensor& target, const Tensor& scale,
                                      const Tensor& smooth, const Tensor& weight, const Tensor& at);

/// The gradient of softmax (or log_softmax) over the last dim of y, its output, for the output
/// gradient `grad` (same shape, dtype and CUDA device; any strides), as one fused CUDA kernel:
/// y * (grad - sum(grad * y)) or grad - exp(y) * sum(grad), summed over the last dim, in the
/// accumulation type. Returns a new contiguous tensor. Records nothing (the front end
/// softmax_backward calls it with grad mode off).
Tensor softmax_backward_cuda(const Tensor& grad, const Tensor& y, bool log);

}  // namespace ember::detail
