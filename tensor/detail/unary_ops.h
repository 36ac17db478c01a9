// The unary element-wise ops, each in one place: its row in EMBER_UNARY_OPS, and its functor,
// whose operator() is the forward math (run by the CPU loops and the CUDA kernels alike) and
// whose static vjp() is the backward rule, written with tensor ops so it runs on every device.
//
// Everything else is generated from the table: the OpId enumerators (tensor/detail/record.h),
// the kernel enum UnaryOp and its dtype dispatch (elementwise_dispatch.h), the front-end
// definitions (elementwise.cpp) and autograd's backward nodes ("<Op>Backward",
// autograd/functions_elementwise.cpp). Adding a unary op with its gradient: a row and a functor
// here, a declaration in tensor/ops/elementwise.h, a test (docs/autograd.md, "Adding an op").
//
// Internal: included by the kernels (.cu too), so it pulls in declarations only.
#pragma once

#include <cstdint>
#include <type_traits>

#include <ember/tensor/ops/creation.h>
#include <ember/tensor/detail/functors.h>
#include <ember/tensor/ops/elementwise.h>
#include <ember/tensor/grad_mode.h>

namespace ember::detail {

/// Which input dtypes an op accepts, and the dtype it computes in.
enum class Domain : uint8_t {
  Real,     ///< floating only: integer and bool inputs compute in float32
  Numeric,  ///< any dtype but bool
  Any,
};

/// What the backward rule reads besides the incoming gradient. It decides which later in-place
/// changes backward survives, so it follows PyTorch's derivatives.yaml.
enum class Saves : uint8_t { Nothing, Input, Output };

// X(Op, name, domain, saves, front):
//   Op      fn::Op (forward functor + vjp), OpId::Op, UnaryOp::Op, node "<Op>Backward"
//   name    the front-end function `Tensor name(const Tensor&)`
//   domain  a Domain: the dtypes accepted (and dispatched)
//   saves   a Saves: the tensor vjp() gets as `saved`
//   front   Plain: the front end is generated; Custom: elementwise.cpp writes it by hand
#define EMBER_UNARY_OPS(X)                         \
  X(Neg, neg, Numeric, Nothing, Custom)            \
  X(Abs, abs, Numeric, Input, Plain)               \
  X(Sign, sign, Any, Nothing, Plain)               \
  X(Exp, exp, Real, Output, Plain)                 \
  X(Log, log, Real, Input, Plain)                  \
  X(Log1p, log1p, Real, Input, Plain)              \
  X(Sqrt, sqrt, Real, Output, Plain)               \
  X(Rsqrt, rsqrt, Real, Output, Plain)             \
  X(Reciprocal, reciprocal, Real, Output, Plain)   \
  X(Square, square, Numeric, Input, Custom)        \
  X(Sin, sin, Real, Input, Plain)                  \
  X(Cos, cos, Real, Input, Plain)                  \
  X(Tanh, tanh, Real, Output, Plain)               \
  X(Sigmoid, sigmoid, Real, Output, Plain)         \
  X(Relu, relu, Numeric, Output, Plain)            \
  X(Silu, silu, Real, Input, Plain)                \
  X(Erf, erf, Real, Input, Plain)

// Kernels that are not an op of the table above: the two forms of gelu (one op, OpId::Gelu,
// whose attribute picks the kernel) and logical_not (bool result, not differentiable).
#define EMBER_UNARY_KERNEL_ONLY(X) \
  X(GeluErf, gelu, Real)           \
  X(GeluTanh, gelu, Real)          \
  X(LogicalNot, logical_not, Any)

#define EMBER_UNARY_ENUM_(Op, ...) Op,
/// The unary kernels: the ops of the table (in its order, so they share OpId's values), then
/// the kernel-only entries.
enum class UnaryOp : uint8_t {
  EMBER_UNARY_OPS(EMBER_UNARY_ENUM_) EMBER_UNARY_KERNEL_ONLY(EMBER_UNARY_ENUM_)
};
#undef EMBER_UNARY_ENUM_

#define EMBER_UNARY_COUNT_(...) +1
/// How many ops the table lists: UnaryOp's values below this are ops, the rest kernel-only.
constexpr int kNumUnaryOps = 0 EMBER_UNARY_OPS(EMBER_UNARY_COUNT_);
#undef EMBER_UNARY_COUNT_

#define EMBER_UNARY_DOMAIN_(Op, name, dom, ...) \
  case UnaryOp::Op:                             \
    return Domain::dom;
constexpr Domain domain_of(UnaryOp op) {
  switch (op) {
    EMBER_UNARY_OPS(EMBER_UNARY_DOMAIN_)
    EMBER_UNARY_KERNEL_ONLY(EMBER_UNARY_DOMAIN_)
  }
  return Domain::Any;
}
#undef EMBER_UNARY_DOMAIN_

}  // namespace ember::detail

namespace ember::detail::fn {

// g: the output's shape (= the input's shape); `x` is the saved input, `y` the saved output.

struct Neg {
  template <typename A> EMBER_HD A operator()(A a) const { return static_cast<A>(-a); }
  static Tensor vjp(const Tensor& g, const Tensor&) { return neg(g); }
};
struct Abs {
  template <typename A> EMBER_HD A operator()(A a) const {
    if constexpr (is_fp_v<A>) {
      return m_fabs(a);
    } else if constexpr (std::is_unsigned_v<A>) {
      return a;
    } else {
      return a < 0 ? static_cast<A>(-a) : a;
    }
  }
  // abs'(0) = sign(0) = 0
  static Tensor vjp(const Tensor& g, const Tensor& x) { return mul(g, sign(x)); }
};
/// -1, 0 or 1; NaN gives 0 (as PyTorch 1.13); bool is unchanged.
struct Sign {
  template <typename A> EMBER_HD A operator()(A a) const {
    if constexpr (std::is_same_v<A, bool> || std::is_unsigned_v<A>) {
      return static_cast<A>(a > A(0));
    } else {
      return static_cast<A>((A(0) < a) - (a < A(0)));
    }
  }
  static Tensor vjp(const Tensor& g, const Tensor&) { return zeros_like(g); }
};
struct Exp {
  template <typename A> EMBER_HD A operator()(A a) const { return m_exp(a); }
  static Tensor vjp(const Tensor& g, const Tensor& y) { return mul(g, y); }
};
struct Log {
  template <typename A> EMBER_HD A operator()(A a) const { return m_log(a); }
  static Tensor vjp(const Tensor& g, const Tensor& x) { return div(g, x); }
};
struct Log1p {
  template <typename A> EMBER_HD A operator()(A a) const { return m_log1p(a); }
  static Tensor vjp(const Tensor& g, const Tensor& x) { return div(g, add(x, 1)); }
};
struct Sqrt {
  template <typename A> EMBER_HD A operator()(A a) const { return m_sqrt(a); }
  static Tensor vjp(const Tensor& g, const Tensor& y) { return div(g, mul(y, 2)); }
};
struct Rsqrt {
  template <typename A> EMBER_HD A operator()(A a) const { return A(1) / m_sqrt(a); }
  // -1/2 x^-3/2 = -y^3 / 2
  static Tensor vjp(const Tensor& g, const Tensor& y) { return mul(g, mul(pow(y, 3), -0.5)); }
};
struct Reciprocal {
  template <typename A> EMBER_HD A operator()(A a) const { return A(1) / a; }
  // -1/x^2 = -y^2
  static Tensor vjp(const Tensor& g, const Tensor& y) { return mul(neg(g), square(y)); }
};
struct Square {
  template <typename A> EMBER_HD A operator()(A a) const { return static_cast<A>(a * a); }
  static Tensor vjp(const Tensor& g, const Tensor& x) { return mul(g, mul(x, 2)); }
};
struct Sin {
  template <typename A> EMBER_HD A operator()(A a) const { return m_sin(a); }
  static Tensor vjp(const Tensor& g, const Tensor& x) { return mul(g, cos(x)); }
};
struct Cos {
  template <typename A> EMBER_HD A operator()(A a) const { return m_cos(a); }
  static Tensor vjp(const Tensor& g, const Tensor& x) { return neg(mul(g, sin(x))); }
};
struct Tanh {
  template <typename A> EMBER_HD A operator()(A a) const { return m_tanh(a); }
  // 1 - y^2
  static Tensor vjp(const Tensor& g, const Tensor& y) { return mul(g, rsub(mul(y, y), 1)); }
};
/// 1 / (1 + e^-x), evaluated so that exp never overflows: for x < 0 as e^x / (1 + e^x).
struct Sigmoid {
  template <typename A> EMBER_HD A operator()(A a) const {
    if (a >= A(0)) return A(1) / (A(1) + m_exp(-a));
    const A e = m_exp(a);
    return e / (A(1) + e);
  }
  // y (1 - y)
  static Tensor vjp(const Tensor& g, const Tensor& y) { return mul(g, mul(y, rsub(y, 1))); }
};
/// max(x, 0); NaN stays NaN (PyTorch's relu is clamp_min(x, 0)).
struct Relu {
  template <typename A> EMBER_HD A operator()(A a) const {
    if constexpr (std::is_unsigned_v<A>) {
      return a;
    } else {
      return a < A(0) ? A(0) : a;
    }
  }
  // relu'(0) = 0 (threshold_backward)
  static Tensor vjp(const Tensor& g, const Tensor& y) {
    // One fused pass, unless create_graph needs a differentiable result.
    if (!GradMode::is_enabled() && is_floating(g.dtype()) && g.dtype() == y.dtype()) {
      return relu_backward(g, y);
    }
    return masked_fill(g, le(y, 0), 0);
  }
};
/// x * sigmoid(x) = x / (1 + e^-x); for very negative x, e^-x = inf gives -0, not NaN.
struct Silu {
  template <typename A> EMBER_HD A operator()(A a) const { return a / (A(1) + m_exp(-a)); }
  // s (1 + x (1 - s)), s = sigmoid(x)
  static Tensor vjp(const Tensor& g, const Tensor& x) {
    const Tensor s = sigmoid(x);
    return mul(g, mul(s, add(mul(x, rsub(s, 1)), 1)));
  }
};

/// The error function, 2/sqrt(pi) times the integral of e^(-t^2) from 0 to x.
struct Erf {
  template <typename A> EMBER_HD A operator()(A a) const { return m_erf(a); }
  // 2/sqrt(pi) e^(-x^2)
  static Tensor vjp(const Tensor& g, const Tensor& x) {
    constexpr double k2OverSqrtPi = 1.12837916709551257390;
    return mul(g, mul(exp(neg(square(x))), k2OverSqrtPi));
  }
};

// ---- kernel-only entries ------------------------------------------------------------------------

/// x * Phi(x) with the exact normal CDF: 0.5 x (1 + erf(x / sqrt(2))).
struct GeluErf {
  template <typename A> EMBER_HD A operator()(A a) const {
    constexpr A kSqrt1_2 = A(0.70710678118654752440);
    return A(0.5) * a * (A(1) + m_erf(a * kSqrt1_2));
  }
  /// d/dx x Phi(x) = Phi(x) + x phi(x), with the normal CDF Phi(x) = (1 + erf(x / sqrt 2)) / 2
  /// and density phi (PyTorch's GeluBackward).
  static Tensor vjp(const Tensor& g, const Tensor& x) {
    constexpr double kSqrt1_2 = 0.70710678118654752440;
    constexpr double kInvSqrt2Pi = 0.39894228040143267794;  // 1 / sqrt(2 pi)
    const Tensor cdf = mul(add(erf(mul(x, kSqrt1_2)), 1), 0.5);
    const Tensor pdf = mul(exp(mul(square(x), -0.5)), kInvSqrt2Pi);
    return mul(g, add(cdf, mul(x, pdf)));
  }
};
/// The tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
struct GeluTanh {
  template <typename A> EMBER_HD A operator()(A a) const {
    constexpr A kBeta = A(0.79788456080286535588);  // sqrt(2 / pi)
    constexpr A kKappa = A(0.044715);
    const A inner = kBeta * (a + kKappa * a * a * a);
#ifndef __CUDA_ARCH__
    // float on the CPU as x / (1 + e^(-2 inner)), the same value: one exp and one division
    // where tanh takes a polynomial, an exp, a division and selects (GELU is a transformer
    // MLP's longest element-wise pass), and no cancellation in 1 + tanh for negative x.
    if constexpr (std::is_same_v<A, float>) return a / (1.0f + m_exp(-2.0f * inner));
#endif
    return A(0.5) * a * (A(1) + m_tanh(inner));
  }
  /// The derivative written as PyTorch's GeluBackward does: one fused pass unless create_graph
  /// needs a differentiable result.
  static Tensor vjp(const Tensor& g, const Tensor& x) {
    if (!GradMode::is_enabled() && is_floating(g.dtype()) && g.dtype() == x.dtype()) {
      return gelu_tanh_backward(g, x);
    }
    constexpr double kBeta = 0.79788456080286535588;  // sqrt(2 / pi)
    constexpr double kKappa = 0.044715;
    const Tensor x_sq = square(x);
    const Tensor t = tanh(mul(add(mul(mul(x_sq, x), kKappa), x), kBeta));
    const Tensor left_derivative = mul(add(t, 1), 0.5);
    const Tensor dinner = mul(add(mul(x_sq, 3 * kKappa), 1), kBeta);
    const Tensor right_derivative = mul(mul(mul(x, 0.5), rsub(square(t), 1)), dinner);
    return mul(g, add(left_derivative, right_derivative));
  }
};
struct LogicalNot {
  template <typename A> EMBER_HD bool operator()(A a) const { return !nonzero(a); }
};

}  // namespace ember::detail::fn
