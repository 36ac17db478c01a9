// CPU kernels for binary arithmetic (add, sub, mul, div, pow, maximum, minimum), tensor-tensor
// and tensor-scalar. Comparisons and logical ops are in compare.cpp.
#include "tensor/cpu/elementwise_loops.h"

namespace ember::detail {

using cpu_ew::binary_loop;
using cpu_ew::scalar_loop;

namespace {

bool is_one(const Scalar& s) {
  return s.is_floating() ? s.to_double() == 1.0 : s.to_int() == 1;
}

}  // namespace

void binary_cpu(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b,
                const Scalar& alpha) {
  const Dtype dt = a.dtype();
  switch (op) {
    case BinaryOp::Add:
    case BinaryOp::Sub:
      if (is_one(alpha)) {
        if (op == BinaryOp::Add) {
          EMBER_DISPATCH_ALL(dt, "add", [&]<typename T>() { binary_loop<T, T>(out, a, b, fn::Add{}); });
        } else {
          EMBER_DISPATCH_NUMERIC(dt, "sub", [&]<typename T>() { binary_loop<T, T>(out, a, b, fn::Sub{}); });
        }
      } else {
        EMBER_DISPATCH_ALL(dt, "add", [&]<typename T>() {
          using A = acc_t<T>;
          A al = alpha.to<A>();
          if constexpr (!std::is_same_v<A, bool>) {
            if (op == BinaryOp::Sub) al = static_cast<A>(-al);
          }
          binary_loop<T, T>(out, a, b, fn::AddAlpha<A>{al});
        });
      }
      return;
    case BinaryOp::Mul:
      EMBER_DISPATCH_ALL(dt, "mul", [&]<typename T>() { binary_loop<T, T>(out, a, b, fn::Mul{}); });
      return;
    case BinaryOp::Div:
      EMBER_DISPATCH_FLOATING(dt, "div", [&]<typename T>() { binary_loop<T, T>(out, a, b, fn::Div{}); });
      return;
    case BinaryOp::Pow:
      EMBER_DISPATCH_NUMERIC(dt, "pow", [&]<typename T>() { binary_loop<T, T>(out, a, b, fn::Pow{}); });
      return;
    case BinaryOp::Maximum:
      EMBER_DISPATCH_ALL(dt, "maximum", [&]<typename T>() { binary_loop<T, T>(out, a, b, fn::Maximum{}); });
      return;
    case BinaryOp::Minimum:
      EMBER_DISPATCH_ALL(dt, "minimum", [&]<typename T>() { binary_loop<T, T>(out, a, b, fn::Minimum{}); });
      return;
    default:
      cpu_ew::compare_cpu(op, out, a, b);
      return;
  }
}

void binary_scalar_cpu(BinaryOp op, const Tensor& out, const Tensor& a, const Scalar& s,
                       bool reverse) {
  const Dtype dt = a.dtype();
  switch (op) {
    case BinaryOp::Add:
      EMBER_DISPATCH_ALL(dt, "add", [&]<typename T>() {
        scalar_loop<T, T, false>(out, a, s.to<acc_t<T>>(), fn::Add{});
      });
      return;
    case BinaryOp::Sub:
      EMBER_DISPATCH_NUMERIC(dt, "sub", [&]<typename T>() {
        scalar_loop<T, T>(out, a, s.to<acc_t<T>>(), reverse, fn::Sub{});
      });
      return;
    case BinaryOp::Mul:
      EMBER_DISPATCH_ALL(dt, "mul", [&]<typename T>() {
        scalar_loop<T, T, false>(out, a, s.to<acc_t<T>>(), fn::Mul{});
      });
      return;
    case BinaryOp::Div:
      EMBER_DISPATCH_FLOATING(dt, "div", [&]<typename T>() {
        scalar_loop<T, T>(out, a, s.to<acc_t<T>>(), reverse, fn::Div{});
      });
      return;
    case BinaryOp::Pow:
      EMBER_DISPATCH_NUMERIC(dt, "pow", [&]<typename T>() {
        scalar_loop<T, T>(out, a, s.to<acc_t<T>>(), reverse, fn::Pow{});
      });
      return;
    default:
      cpu_ew::compare_scalar_cpu(op, out, a, s, reverse);
      return;
  }
}

}  // namespace ember::detail
