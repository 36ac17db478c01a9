// CUDA kernels for binary arithmetic (add, sub, mul, div, pow, maximum, minimum), tensor-tensor
// and tensor-scalar. Comparisons and logical ops are in compare.cu.
#include "tensor/cuda/elementwise_launch.cuh"

namespace ember::detail {

namespace {
bool is_one(const Scalar& s) { return s.is_floating() ? s.to_double() == 1.0 : s.to_int() == 1; }
}  // namespace

void binary_cuda(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b,
                 const Scalar& alpha) {
  const Dtype dt = a.dtype();
  switch (op) {
    case BinaryOp::Add:
    case BinaryOp::Sub:
      if (is_one(alpha)) {
        if (op == BinaryOp::Add) {
          EMBER_DISPATCH_ALL(dt, "add", [&]<typename T>() { cuda_ew::binary<T, T>(out, a, b, fn::Add{}); });
        } else {
          EMBER_DISPATCH_NUMERIC(dt, "sub", [&]<typename T>() { cuda_ew::binary<T, T>(out, a, b, fn::Sub{}); });
        }
      } else {
        EMBER_DISPATCH_ALL(dt, "add", [&]<typename T>() {
          using A = acc_t<T>;
          A al = alpha.to<A>();
          if constexpr (!std::is_same_v<A, bool>) {
            if (op == BinaryOp::Sub) al = static_cast<A>(-al);
          }
          cuda_ew::binary<T, T>(out, a, b, fn::AddAlpha<A>{al});
        });
      }
      return;
    case BinaryOp::Mul:
      EMBER_DISPATCH_ALL(dt, "mul", [&]<typename T>() { cuda_ew::binary<T, T>(out, a, b, fn::Mul{}); });
      return;
    case BinaryOp::Div:
      EMBER_DISPATCH_FLOATING(dt, "div", [&]<typename T>() { cuda_ew::binary<T, T>(out, a, b, fn::Div{}); });
      return;
    case BinaryOp::Pow:
      EMBER_DISPATCH_NUMERIC(dt, "pow", [&]<typename T>() { cuda_ew::binary<T, T>(out, a, b, fn::Pow{}); });
      return;
    case BinaryOp::Maximum:
      EMBER_DISPATCH_ALL(dt, "maximum", [&]<typename T>() { cuda_ew::binary<T, T>(out, a, b, fn::Maximum{}); });
      return;
    case BinaryOp::Minimum:
      EMBER_DISPATCH_ALL(dt, "minimum", [&]<typename T>() { cuda_ew::binary<T, T>(out, a, b, fn::Minimum{}); });
      return;
    default:
      cuda_ew::compare(op, out, a, b);
      return;
  }
}

void binary_scalar_cuda(BinaryOp op, const Tensor& out, const Tensor& a, const Scalar& s,
                        bool reverse) {
  const Dtype dt = a.dtype();
  switch (op) {
    case BinaryOp::Add:
      EMBER_DISPATCH_ALL(dt, "add", [&]<typename T>() {
        cuda_ew::scalar<T, T, false>(out, a, s.to<acc_t<T>>(), fn::Add{});
      });
      return;
    case BinaryOp::Sub:
      EMBER_DISPATCH_NUMERIC(dt, "sub", [&]<typename T>() {
        cuda_ew::scalar<T, T>(out, a, s.to<acc_t<T>>(), reverse, fn::Sub{});
      });
      return;
    case BinaryOp::Mul:
      EMBER_DISPATCH_ALL(dt, "mul", [&]<typename T>() {
        cuda_ew::scalar<T, T, false>(out, a, s.to<acc_t<T>>(), fn::Mul{});
      });
      return;
    case BinaryOp::Div:
      EMBER_DISPATCH_FLOATING(dt, "div", [&]<typename T>() {
        cuda_ew::scalar<T, T>(out, a, s.to<acc_t<T>>(), reverse, fn::Div{});
      });
      return;
    case BinaryOp::Pow:
      EMBER_DISPATCH_NUMERIC(dt, "pow", [&]<typename T>() {
        cuda_ew::scalar<T, T>(out, a, s.to<acc_t<T>>(), reverse, fn::Pow{});
      });
      return;
    default:
      // s < a is a > s: mirror the comparison instead of instantiating reversed kernels.
      cuda_ew::compare_scalar(reverse ? mirrored(op) : op, out, a, s);
      return;
  }
}

}  // namespace ember::detail
