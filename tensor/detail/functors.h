// Element-wise math, written once for the CPU loops and the CUDA kernels (internal).
//
// Note [Functors compute in acc_t]
// Every functor's operator() takes and returns the *compute* type A = acc_t<T> of the storage
// type T (float for Half/BFloat16, T otherwise); the adapters at the bottom load T, convert to
// A, call the functor and convert the result to the output type. So half-precision math runs
// in float (as PyTorch's opmath), and a scalar operand is kept in A rather than rounded to T
// first (PyTorch keeps `half_tensor * 1.0001` in float the same way). Comparison and logical
// functors return bool. Transcendental functors are only instantiated for float and double:
// the front end promotes integer inputs to float32 before they get here.
#pragma once

#include <math.h>

#include <cstdint>
#include <type_traits>

#include <ember/tensor/detail/fast_exp.h>
#include <ember/tensor/half.h>

namespace ember::detail::fn {

// ---- math on float and double, callable from host and device ---------------------------------
#if defined(__CUDA_ARCH__)
EMBER_HD inline float m_exp(float x) { return ::expf(x); }
#else
inline float m_exp(float x) { return exp_float(x); }  // vectorisable, the same on every loop
#endif
EMBER_HD inline double m_exp(double x) { return ::exp(x); }
EMBER_HD inline float m_log(float x) { return ::logf(x); }
EMBER_HD inline double m_log(double x) { return ::log(x); }
EMBER_HD inline float m_log1p(float x) { return ::log1pf(x); }
EMBER_HD inline double m_log1p(double x) { return ::log1p(x); }
EMBER_HD inline float m_sqrt(float x) { return ::sqrtf(x); }
EMBER_HD inline double m_sqrt(double x) { return ::sqrt(x); }
EMBER_HD inline float m_sin(float x) { return ::sinf(x); }
EMBER_HD inline double m_sin(double x) { return ::sin(x); }
EMBER_HD inline float m_cos(float x) { return ::cosf(x); }
EMBER_HD inline double m_cos(double x) { return ::cos(x); }
#ifdef __CUDA_ARCH__
EMBER_HD inline float m_tanh(float x) { return ::tanhf(x); }
#else
// libm's tanhf is a call GCC cannot vectorise, and GELU's tanh form spends most of a
// transformer MLP's element-wise time in it: a branch-free float tanh instead, within a few
// ulp. Below |x| = 0.625 Cephes' odd polynomial (no cancellation near 0); above it
// (1 - e) / (1 + e) with e = exp(-2|x|) <= 0.29, the sign put back by copysign.
[[gnu::always_inline]] inline float m_tanh(float x) {
  const float ax = ::fabsf(x);
  const float z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const float small = p * z * x + x;
  const float e = ::ember::detail::exp_nonpos(-2.0f * ax);
  const float large = ::copysignf((1.0f - e) / (1.0f + e), x);
  return ax < 0.625f ? small : (x != x ? x : large);
}
#endif
EMBER_HD inline double m_tanh(double x) { return ::tanh(x); }
EMBER_HD inline float m_erf(float x) { return ::erff(x); }
EMBER_HD inline double m_erf(double x) { return ::erf(x); }
EMBER_HD inline float m_pow(float x, float y) { return ::powf(x, y); }
EMBER_HD inline double m_pow(double x, double y) { return ::pow(x, y); }
EMBER_HD inline float m_fabs(float x) { return ::fabsf(x); }
EMBER_HD inline double m_fabs(double x) { return ::fabs(x); }

template <typename A>
inline constexpr bool is_fp_v = std::is_floating_point_v<A>;

template <typename A>
EMBER_HD inline bool nonzero(A a) {
  return a != A(0);
}

// The unary and binary arithmetic functors, each beside its backward rule, are in
// tensor/detail/unary_ops.h and tensor/detail/binary_ops.h.

// ---- comparisons and logic (bool results) -----------------------------------------------------
struct Eq {
  template <typename A> EMBER_HD bool operator()(A a, A b) const { return a == b; }
};
struct Ne {
  template <typename A> EMBER_HD bool operator()(A a, A b) const { return a != b; }
};
struct Lt {
  template <typename A> EMBER_HD bool operator()(A a, A b) const { return a < b; }
};
struct Le {
  template <typename A> EMBER_HD bool operator()(A a, A b) const { return a <= b; }
};
struct Gt {
  template <typename A> EMBER_HD bool operator()(A a, A b) const { return a > b; }
};
struct Ge {
  template <typename A> EMBER_HD bool operator()(A a, A b) const { return a >= b; }
};
struct LogicalAnd {
  template <typename A> EMBER_HD bool operator()(A a, A b) const {
    return nonzero(a) && nonzero(b);
  }
};
struct LogicalOr {
  template <typename A> EMBER_HD bool operator()(A a, A b) const {
    return nonzero(a) || nonzero(b);
  }
};
struct LogicalXor {
  template <typename A> EMBER_HD bool operator()(A a, A b) const {
    return nonzero(a) != nonzero(b);
  }
};

// ---- ternary ----------------------------------------------------------------------------------
/// cond ? a : b on the storage type (no arithmetic, so no conversion).
template <typename T>
struct Where {
  EMBER_HD T operator()(bool c, T a, T b) const { return c ? a : b; }
};
/// min(max(x, lo), hi): NaN stays NaN, and lo > hi gives hi (torch.clamp). Absent bounds are
/// passed as -inf/+inf (floating) or the type's limits (integral).
template <typename A>
struct Clamp {
  A lo, hi;
  EMBER_HD A operator()(A a) const {
    if constexpr (is_fp_v<A>) {
      if (a != a) return a;
    }
    const A m = a < lo ? lo : a;
    return m > hi ? hi : m;
  }
};

// ---- adapters: storage type in, compute type through the functor, output type out ------------
template <typename Out, typename T, typename F>
struct UnaryAdapter {
  F f;
  EMBER_HD Out operator()(T a) const { return Out(f(acc_t<T>(a))); }
};
template <typename Out, typename T, typename F>
struct BinaryAdapter {
  F f;
  EMBER_HD Out operator()(T a, T b) const { return Out(f(acc_t<T>(a), acc_t<T>(b))); }
};
/// One tensor operand and a scalar held in the compute type; Reverse puts the scalar first.
template <typename Out, typename T, typename F, bool Reverse>
struct ScalarAdapter {
  F f;
  acc_t<T> s;
  EMBER_HD Out operator()(T a) const {
    if constexpr (Reverse) {
      return Out(f(s, acc_t<T>(a)));
    } else {
      return Out(f(acc_t<T>(a), s));
    }
  }
};

}  // namespace ember::detail::fn
