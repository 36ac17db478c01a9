// CPU kernels for comparisons and logical ops: inputs of one compute dtype, bool output.
#include <ember/tensor/cpu/elementwise_loops.h>

namespace ember::detail::cpu_ew {

namespace {

template <typename F>
void compare_dispatch(BinaryOp op, Dtype dt, const F& body) {
  switch (op) {
    case BinaryOp::Eq: return body(fn::Eq{}, dt);
    case BinaryOp::Ne: return body(fn::Ne{}, dt);
    case BinaryOp::Lt: return body(fn::Lt{}, dt);
    case BinaryOp::Le: return body(fn::Le{}, dt);
    case BinaryOp::Gt: return body(fn::Gt{}, dt);
    case BinaryOp::Ge: return body(fn::Ge{}, dt);
    case BinaryOp::LogicalAnd: return body(fn::LogicalAnd{}, dt);
    case BinaryOp::LogicalOr: return body(fn::LogicalOr{}, dt);
    case BinaryOp::LogicalXor: return body(fn::LogicalXor{}, dt);
    default: EMBER_INTERNAL_ASSERT(false, "not a comparison or logical op");
  }
}

}  // namespace

void compare_cpu(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  compare_dispatch(op, a.dtype(), [&](auto f, Dtype dt) {
    EMBER_DISPATCH_ALL(dt, "compare", [&]<typename T>() { binary_loop<bool, T>(out, a, b, f); });
  });
}

void compare_scalar_cpu(BinaryOp op, const Tensor& out, const Tensor& a, const Scalar& s,
                        bool reverse) {
  // s < a is a > s: mirror the op instead of instantiating reversed loops. The scalar is
  // compared at the tensor's dtype, as PyTorch does: bfloat16's 0.1 == 0.1 (the scalar rounded
  // to bfloat16 too), where the unrounded float32 0.1 would differ.
  if (reverse) op = mirrored(op);
  compare_dispatch(op, a.dtype(), [&](auto f, Dtype dt) {
    EMBER_DISPATCH_ALL(dt, "compare", [&]<typename T>() {
      scalar_loop<bool, T, false>(out, a, static_cast<acc_t<T>>(s.to<T>()), f);
    });
  });
}

}  // namespace ember::detail::cpu_ew
