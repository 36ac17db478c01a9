// CUDA kernels for comparisons and logical ops: inputs of one compute dtype, bool output.
#include <ember/tensor/cuda/elementwise_launch.cuh>

namespace ember::detail::cuda_ew {

namespace {
template <typename Body>
void compare_dispatch(BinaryOp op, const Body& body) {
  switch (op) {
    case BinaryOp::Eq: return body(fn::Eq{});
    case BinaryOp::Ne: return body(fn::Ne{});
    case BinaryOp::Lt: return body(fn::Lt{});
    case BinaryOp::Le: return body(fn::Le{});
    case BinaryOp::Gt: return body(fn::Gt{});
    case BinaryOp::Ge: return body(fn::Ge{});
    case BinaryOp::LogicalAnd: return body(fn::LogicalAnd{});
    case BinaryOp::LogicalOr: return body(fn::LogicalOr{});
    case BinaryOp::LogicalXor: return body(fn::LogicalXor{});
    default: EMBER_INTERNAL_ASSERT(false, "not a comparison or logical op");
  }
}
}  // namespace

void compare(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  compare_dispatch(op, [&](auto f) {
    EMBER_DISPATCH_ALL(a.dtype(), "compare", [&]<typename T>() { binary<bool, T>(out, a, b, f); });
  });
}

void compare_scalar(BinaryOp op, const Tensor& out, const Tensor& a, const Scalar& s) {
  compare_dispatch(op, [&](auto f) {
    EMBER_DISPATCH_ALL(a.dtype(), "compare", [&]<typename T>() {
      scalar<bool, T, false>(out, a, static_cast<acc_t<T>>(s.to<T>()), f);
    });
  });
}

}  // namespace ember::detail::cuda_ew
