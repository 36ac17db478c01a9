// Linked instead of tensor/cuda/norm.cu when Ember is built with EMBER_WITH_CUDA=OFF.
#include <ember/tensor/detail/norm_kernels.h>
#include <ember/tensor/error.h>

namespace ember::detail {

void layer_norm_forward_cuda(const Tensor&, const Tensor&, const Tensor&, double, const Tensor&,
                             const Tensor&, const Tensor&) {
  throw NotImplementedError(
      "[layer_norm] CUDA is not available: Ember was built with EMBER_WITH_CUDA=OFF");
}
void layer_norm_backward_cuda(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  throw NotImplementedError(
      "[layer_norm] CUDA is not available: Ember was built with EMBER_WITH_CUDA=OFF");
}

}  // namespace ember::detail
