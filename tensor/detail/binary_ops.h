// The binary element-wise ops, each in one place: its row in EMBER_BINARY_OPS, and its functor,
// whose operator() is the forward math (run by the CPU loops and the CUDA kernels alike) and
// whose static vjp() is the backward rule for both operands, written with tensor ops so it runs
// on every device.
//
// Everything else is generated from the table: the OpId enumerators and the OpIds of the
// tensor-scalar forms (tensor/detail/record.h), the kernel enum BinaryOp and its dtype dispatch,
// tensor-tensor and tensor-scalar (elementwise_dispatch.h), the compute dtype (elementwise.cpp),
// the front-end definitions of the Plain rows, and autograd's backward nodes ("<Op>Backward",
// autograd/functions_elementwise.cpp), which save what the row says. Adding a binary op with its
// gradient: a row and a functor here, a declaration in tensor/ops/elementwise.h, a test
// (docs/autograd.md, "Adding an op").
//
// Internal: included by the kernels (.cu too), so it pulls in declarations only.
#pragma once

#include <cstdint>
#include <type_traits>

#include <ember/tensor/detail/functors.h>
#include <ember/tensor/detail/unary_ops.h>
#include <ember/tensor/ops/elementwise.h>

namespace ember::detail {

/// For which gradients a binary op's backward rule reads a tensor (input a, input b or the
/// output): autograd saves the tensor only when one of those gradients is wanted. As for the
/// unary ops, the choice follows PyTorch's derivatives.yaml.
enum class SavedFor : uint8_t {
  Never = 0,
  GradA = 1,   ///< read for a's gradient only
  GradB = 2,   ///< read for b's gradient only
  Either = 3,  ///< read for either gradient
};

// X(Op, name, domain, save_a, save_b, save_out, scalar, front):
//   Op        fn::Op (forward functor + vjp), BinaryOp::Op, OpId::Op, node "<Op>Backward"
//   name      the front-end function `Tensor name(const Tensor&, const Tensor&)`, also the op's
//             name in errors
//   domain    a Domain (unary_ops.h): the dtypes dispatched; Real promotes integer and bool
//             operands to float32, Numeric refuses bool
//   save_a, save_b, save_out   SavedFor: when backward saves a, b and the output
//   scalar    the tensor-scalar forms x op s and s op x (their front ends are Custom):
//               NoScalar               none
//               Commutes(S)            both record OpId::S and share one kernel (s op x = x op s)
//               Scalars(S, R)          x op s records OpId::S, s op x records OpId::R
//             Their backward nodes are in autograd/functions_elementwise.cpp.
//   front     Plain: the front end is generated; Custom: elementwise.cpp writes it by hand
// Add and Sub also take alpha (a + alpha * b, a - alpha * b), recorded as their ScalarAttrs.
#define EMBER_BINARY_OPS(X)                                                           \
  X(Add, add, Any, Never, Never, Never, Commutes(AddScalar), Custom)                  \
  X(Sub, sub, Numeric, Never, Never, Never, Scalars(AddScalar, RSubScalar), Custom)   \
  X(Mul, mul, Any, GradB, GradA, Never, Commutes(MulScalar), Custom)                  \
  X(Div, div, Real, GradB, Either, Never, Scalars(DivScalar, RDivScalar), Custom)     \
  X(Pow, pow, Numeric, Either, Either, GradB, Scalars(PowScalar, RPowScalar), Custom) \
  X(Maximum, maximum, Any, Either, Either, Never, NoScalar, Plain)                    \
  X(Minimum, minimum, Any, Either, Either, Never, NoScalar, Plain)                    \
  X(Atan2, atan2, Real, Either, Either, Never, NoScalar, Plain)

// Kernels that are no op of the table: gradients computed in one pass, which autograd's unary
// nodes call (not recorded themselves). X(Op, name, domain) as above.
#define EMBER_BINARY_KERNEL_ONLY(X) \
  X(ReluGrad, relu_backward, Real)  \
  X(GeluTanhGrad, gelu_tanh_backward, Real)

#define EMBER_BINARY_ENUM_(Op, ...) Op,
/// The binary kernels: the ops of the table (in its order, which OpId keeps, checked in
/// record.h), the kernel-only entries, then the comparisons and logical ops.
enum class BinaryOp : uint8_t {
  EMBER_BINARY_OPS(EMBER_BINARY_ENUM_) EMBER_BINARY_KERNEL_ONLY(EMBER_BINARY_ENUM_)
  // bool results:
  Eq, Ne, Lt, Le, Gt, Ge, LogicalAnd, LogicalOr, LogicalXor,
};
#undef EMBER_BINARY_ENUM_

#define EMBER_BINARY_COUNT_(...) +1
/// How many ops the table lists: BinaryOp's values below this are ops of the table.
constexpr int kNumBinaryOps = 0 EMBER_BINARY_OPS(EMBER_BINARY_COUNT_);
#undef EMBER_BINARY_COUNT_

/// True for the ops of EMBER_BINARY_OPS.
constexpr bool is_table_op(BinaryOp op) { return static_cast<int>(op) < kNumBinaryOps; }

#define EMBER_BINARY_DOMAIN_(Op, name, dom, ...) \
  case BinaryOp::Op:                             \
    return Domain::dom;
/// The dtypes an arithmetic kernel accepts; Any for the comparisons and logical ops.
constexpr Domain domain_of(BinaryOp op) {
  switch (op) {
    EMBER_BINARY_OPS(EMBER_BINARY_DOMAIN_)
    EMBER_BINARY_KERNEL_ONLY(EMBER_BINARY_DOMAIN_)
    default:
      return Domain::Any;
  }
}
#undef EMBER_BINARY_DOMAIN_

/// What a binary op's vjp() gets. g has the broadcast output's shape; the engine sums each
/// gradient back to its input's shape. a, b and out are the saved tensors, undefined where the
/// row does not save them for the wanted gradients.
struct BinaryVjpArgs {
  const Tensor& g;
  const Tensor& a;
  const Tensor& b;
  const Tensor& out;
  bool need_a, need_b;  ///< which gradients are wanted
  const Scalar& alpha;  ///< Add and Sub: alpha; 1 for the other ops
};

/// The gradients for a and b; an undefined one means zero (or not wanted).
struct BinaryGrads {
  Tensor a, b;
};

/// -s, keeping its kind.
inline Scalar negated(const Scalar& s) {
  return s.is_floating() ? Scalar(-s.to_double()) : Scalar(-s.to_int());
}

/// g * s, or g itself when s is 1.
inline Tensor scaled(const Tensor& g, const Scalar& s) {
  return s.to_double() == 1.0 ? g : mul(g, s);
}

}  // namespace ember::detail

namespace ember::detail::fn {

// Functors compute in acc_t (Note [Functors compute in acc_t], functors.h).

struct Add {
  template <typename A> EMBER_HD A operator()(A a, A b) const {
    if constexpr (std::is_same_v<A, bool>) {
      return a || b;
    } else {
      return static_cast<A>(a + b);
    }
  }
  // a + alpha * b: the gradient passes through (scaled for b).
  static BinaryGrads vjp(const BinaryVjpArgs& x) {
    BinaryGrads r;
    if (x.need_a) r.a = x.g;
    if (x.need_b) r.b = scaled(x.g, x.alpha);
    return r;
  }
};
/// a + alpha * b: add and sub (with -alpha) when alpha is not 1.
template <typename A>
struct AddAlpha {
  A alpha;
  EMBER_HD A operator()(A a, A b) const {
    if constexpr (std::is_same_v<A, bool>) {
      return a || (alpha && b);
    } else {
      return static_cast<A>(a + alpha * b);
    }
  }
};
struct Sub {
  template <typename A> EMBER_HD A operator()(A a, A b) const { return static_cast<A>(a - b); }
  // a - alpha * b
  static BinaryGrads vjp(const BinaryVjpArgs& x) {
    BinaryGrads r;
    if (x.need_a) r.a = x.g;
    if (x.need_b) r.b = scaled(x.g, negated(x.alpha));
    return r;
  }
};
struct Mul {
  template <typename A> EMBER_HD A operator()(A a, A b) const {
    if constexpr (std::is_same_v<A, bool>) {
      return a && b;
    } else {
      return static_cast<A>(a * b);
    }
  }
  static BinaryGrads vjp(const BinaryVjpArgs& x) {
    BinaryGrads r;
    if (x.need_a) r.a = mul(x.g, x.b);
    if (x.need_b) r.b = mul(x.g, x.a);
    return r;
  }
};
struct Div {
  template <typename A> EMBER_HD A operator()(A a, A b) const { return a / b; }
  // g / b and -g a / b^2, computed as (a / b) / b (as PyTorch) to delay overflow.
  static BinaryGrads vjp(const BinaryVjpArgs& x) {
    BinaryGrads r;
    if (x.need_a) r.a = div(x.g, x.b);
    if (x.need_b) r.b = mul(neg(x.g), div(div(x.a, x.b), x.b));
    return r;
  }
};

/// Integer power by squaring (in unsigned arithmetic, so overflow wraps instead of being UB).
/// Negative exponents give 1 / base^-e truncated: 1 for base 1, +-1 for base -1, else 0.
template <typename A>
EMBER_HD inline A int_pow(A base, A e) {
  if constexpr (std::is_signed_v<A>) {
    if (e < 0) {
      if (base == 1) return 1;
      if (base == -1) return (e & 1) ? A(-1) : A(1);
      return 0;
    }
  }
  using U = std::make_unsigned_t<A>;
  U r = 1, b = static_cast<U>(base);
  for (U n = static_cast<U>(e); n != 0; n >>= 1) {
    if (n & 1) r = static_cast<U>(r * b);
    b = static_cast<U>(b * b);
  }
  return static_cast<A>(r);
}

struct Pow {
  template <typename A> EMBER_HD A operator()(A a, A b) const {
    if constexpr (is_fp_v<A>) {
      return m_pow(a, b);
    } else {
      return int_pow(a, b);
    }
  }
  // For a: b a^(b-1), zero where b == 0. For b: y log(a), zero where a == 0 and b >= 0
  // (PyTorch's pow_backward_self / pow_backward_exponent).
  static BinaryGrads vjp(const BinaryVjpArgs& x) {
    BinaryGrads r;
    if (x.need_a) r.a = masked_fill(mul(x.g, mul(x.b, pow(x.a, sub(x.b, 1)))), eq(x.b, 0), 0);
    if (x.need_b) {
      const Tensor d = mul(x.out, log(x.a));
      r.b = mul(x.g, masked_fill(d, logical_and(eq(x.a, 0), ge(x.b, 0)), 0));
    }
    return r;
  }
};

/// The gradient goes to the selected input; ties give half to each (as PyTorch).
template <bool kMax>
inline BinaryGrads max_min_vjp(const BinaryVjpArgs& x) {
  BinaryGrads r;
  const Tensor shared = where(eq(x.a, x.b), mul(x.g, 0.5), x.g);
  // a loses where it is smaller (maximum) / larger (minimum), b the other way round.
  if (x.need_a) r.a = masked_fill(shared, kMax ? lt(x.a, x.b) : gt(x.a, x.b), 0);
  if (x.need_b) r.b = masked_fill(shared, kMax ? gt(x.a, x.b) : lt(x.a, x.b), 0);
  return r;
}

/// Element-wise max/min; a NaN on either side gives NaN (torch.maximum).
struct Maximum {
  template <typename A> EMBER_HD A operator()(A a, A b) const {
    if constexpr (is_fp_v<A>) {
      if (a != a) return a;
      if (b != b) return b;
    }
    return a > b ? a : b;
  }
  static BinaryGrads vjp(const BinaryVjpArgs& x) { return max_min_vjp<true>(x); }
};
struct Minimum {
  template <typename A> EMBER_HD A operator()(A a, A b) const {
    if constexpr (is_fp_v<A>) {
      if (a != a) return a;
      if (b != b) return b;
    }
    return a < b ? a : b;
  }
  static BinaryGrads vjp(const BinaryVjpArgs& x) { return max_min_vjp<false>(x); }
};

/// The angle of the point (b, a) in radians, in [-pi, pi] (torch.atan2(input=a, other=b)),
/// signed zeros and infinities as C's atan2.
struct Atan2 {
  template <typename A> EMBER_HD A operator()(A a, A b) const {
    if constexpr (std::is_same_v<A, float>) {
      return ::atan2f(a, b);
    } else {
      return ::atan2(a, b);
    }
  }
  // b / (a^2 + b^2) and -a / (a^2 + b^2) (PyTorch's atan2_backward; NaN at the origin).
  static BinaryGrads vjp(const BinaryVjpArgs& x) {
    BinaryGrads r;
    const Tensor recip = reciprocal(add(mul(x.a, x.a), mul(x.b, x.b)));
    if (x.need_a) r.a = mul(mul(x.g, x.b), recip);
    if (x.need_b) r.b = mul(mul(x.g, neg(x.a)), recip);
    return r;
  }
};

// ---- kernel-only entries ------------------------------------------------------------------------

/// relu's gradient from its output: g where y > 0, else 0 (torch's threshold_backward at 0;
/// a NaN output passes no gradient).
struct ReluGrad {
  template <typename A> EMBER_HD A operator()(A g, A y) const { return y > A(0) ? g : A(0); }
};
/// GELU's tanh form's gradient g * d/dx[0.5 x (1 + tanh(inner))] at input x, in one pass, with
/// PyTorch's GeluBackward formula (left + right derivative); float on the CPU in the forward's
/// sigmoid form (below).
struct GeluTanhGrad {
  // Inlined by force: GCC otherwise calls it per element from the binary loop, unvectorised.
  template <typename A> [[gnu::always_inline]] EMBER_HD A operator()(A g, A x) const {
    constexpr A kBeta = A(0.79788456080286535588);  // sqrt(2 / pi)
    constexpr A kKappa = A(0.044715);
    const A x_sq = x * x;
    const A inner = kBeta * (x + kKappa * x_sq * x);
#ifndef __CUDA_ARCH__
    // float on the CPU through the forward's form (fn::GeluTanh): with e = e^(-2 inner) and
    // s = 1 / (1 + e) = (1 + t) / 2, left = s and right = 2 x s (1 - s) d(inner)/dx, as
    // 1 - t^2 = 4 s (1 - s); and 1 - s = e s, which keeps its digits where s is near 1 (1 - t^2
    // and 1 - s lose them). Where e overflows s is 0 and 1 - s is 1 (not inf * 0).
    if constexpr (std::is_same_v<A, float>) {
      const float e = m_exp(-2.0f * inner);
      const float s = 1.0f / (1.0f + e);
      const float one_minus_s = s == 0.0f ? 1.0f : e * s;
      return g * (s + 2.0f * x * s * one_minus_s * kBeta * (1.0f + 3.0f * kKappa * x_sq));
    }
#endif
    const A t = m_tanh(inner);
    const A left = A(0.5) * (A(1) + t);
    const A right = A(0.5) * x * (A(1) - t * t) * kBeta * (A(1) + A(3) * kKappa * x_sq);
    return g * (left + right);
  }
};

}  // namespace ember::detail::fn
