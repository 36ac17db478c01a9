// Linked instead of the element-wise CUDA kernels when Ember is built with EMBER_WITH_CUDA=OFF.
#include <ember/tensor/cuda/absent/no_cuda.h>
#include <ember/tensor/detail/elementwise_kernels.h>
#include <ember/tensor/error.h>

namespace ember::detail {

void unary_cuda(UnaryOp, const Tensor&, const Tensor&) { no_cuda("unary_cuda"); }
void binary_cuda(BinaryOp, const Tensor&, const Tensor&, const Tensor&, const Scalar&) {
  no_cuda("binary_cuda");
}
void binary_scalar_cuda(BinaryOp, const Tensor&, const Tensor&, const Scalar&, bool) {
  no_cuda("binary_scalar_cuda");
}
void where_cuda(const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  no_cuda("where_cuda");
}
void clamp_cuda(const Tensor&, const Tensor&, const std::optional<Scalar>&,
                const std::optional<Scalar>&) {
  no_cuda("clamp_cuda");
}

}  // namespace ember::detail
