// Linked instead of tensor/cuda/amp.cu when Ember is built with EMBER_WITH_CUDA=OFF.
#include <ember/tensor/detail/amp_kernels.h>
#include <ember/tensor/error.h>

namespace ember::detail {

void amp_unscale_cuda(const Tensor&, const Tensor&, double, const float*) {
  throw NotImplementedError(
      "[amp_unscale_] CUDA is not available: Ember was built with EMBER_WITH_CUDA=OFF");
}
void amp_update_scale_cuda(const Tensor&, const Tensor&, const Tensor&, double, double, int64_t) {
  throw NotImplementedError(
      "[amp_update_scale_] CUDA is not available: Ember was built with EMBER_WITH_CUDA=OFF");
}

}  // namespace ember::detail
