// Linked instead of tensor/cuda/amp.cu when Ember is built with EMBER_WITH_CUDA=OFF.
#include <ember/tensor/detail/amp_kernels.h>
#include <ember/tensor/error.h>

namespace ember::detail {

void amp_unscale_cuda(const Tensor&, const Tensor&, double) {
  throw NotImplementedError(
      "[amp_unscale_] CUDA is not available: Ember was built with EMBER_WITH_CUDA=OFF");
}

}  // namespace ember::detail
