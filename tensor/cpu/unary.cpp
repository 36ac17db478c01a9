// CPU kernels for unary element-wise ops, where and clamp.
#include <limits>

#include "tensor/cpu/elementwise_loops.h"

namespace ember::detail {

using cpu_ew::unary_loop;

void unary_cpu(UnaryOp op, const Tensor& out, const Tensor& in) {
  const Dtype dt = in.dtype();
// Floating-only ops (the front end promotes integer inputs to float32 first).
#define EMBER_UNARY_FLOAT_(OP, NAME)                                                        \
  case UnaryOp::OP:                                                                         \
    EMBER_DISPATCH_FLOATING(dt, NAME, [&]<typename T>() { unary_loop<T, T>(out, in, fn::OP{}); }); \
    return;
  switch (op) {
    case UnaryOp::Neg:
      EMBER_DISPATCH_NUMERIC(dt, "neg", [&]<typename T>() { unary_loop<T, T>(out, in, fn::Neg{}); });
      return;
    case UnaryOp::Abs:
      EMBER_DISPATCH_NUMERIC(dt, "abs", [&]<typename T>() { unary_loop<T, T>(out, in, fn::Abs{}); });
      return;
    case UnaryOp::Sign:
      EMBER_DISPATCH_ALL(dt, "sign", [&]<typename T>() { unary_loop<T, T>(out, in, fn::Sign{}); });
      return;
    case UnaryOp::Square:
      EMBER_DISPATCH_NUMERIC(dt, "square", [&]<typename T>() { unary_loop<T, T>(out, in, fn::Square{}); });
      return;
    case UnaryOp::Relu:
      EMBER_DISPATCH_NUMERIC(dt, "relu", [&]<typename T>() { unary_loop<T, T>(out, in, fn::Relu{}); });
      return;
    case UnaryOp::LogicalNot:
      EMBER_DISPATCH_ALL(dt, "logical_not", [&]<typename T>() {
        unary_loop<bool, T>(out, in, fn::LogicalNot{});
      });
      return;
    EMBER_UNARY_FLOAT_(Exp, "exp")
    EMBER_UNARY_FLOAT_(Log, "log")
    EMBER_UNARY_FLOAT_(Log1p, "log1p")
    EMBER_UNARY_FLOAT_(Sqrt, "sqrt")
    EMBER_UNARY_FLOAT_(Rsqrt, "rsqrt")
    EMBER_UNARY_FLOAT_(Reciprocal, "reciprocal")
    EMBER_UNARY_FLOAT_(Sin, "sin")
    EMBER_UNARY_FLOAT_(Cos, "cos")
    EMBER_UNARY_FLOAT_(Tanh, "tanh")
    EMBER_UNARY_FLOAT_(Sigmoid, "sigmoid")
    EMBER_UNARY_FLOAT_(GeluErf, "gelu")
    EMBER_UNARY_FLOAT_(GeluTanh, "gelu")
    EMBER_UNARY_FLOAT_(Silu, "silu")
  }
#undef EMBER_UNARY_FLOAT_
}

void where_cpu(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b) {
  if (out.numel() == 0) return;
  Geometry g = make_geometry(out.shape(), {&out, &cond, &a, &b});
  EMBER_DISPATCH_ALL(out.dtype(), "where", [&]<typename T>() {
    cpu::cpu_elementwise<T, bool, T, T>(g, fn::Where<T>{});
  });
}

void clamp_cpu(const Tensor& out, const Tensor& in, const std::optional<Scalar>& lo,
               const std::optional<Scalar>& hi) {
  EMBER_DISPATCH_ALL(in.dtype(), "clamp", [&]<typename T>() {
    using A = acc_t<T>;
    using L = std::numeric_limits<A>;
    const A lo_v = lo ? lo->to<A>() : (L::has_infinity ? -L::infinity() : L::lowest());
    const A hi_v = hi ? hi->to<A>() : (L::has_infinity ? L::infinity() : L::max());
    unary_loop<T, T>(out, in, fn::Clamp<A>{lo_v, hi_v});
  });
}

}  // namespace ember::detail
