// Linked instead of tensor/cuda/optim.cu when Ember is built with EMBER_WITH_CUDA=OFF.
#include <ember/tensor/cuda/absent/no_cuda.h>
#include <ember/tensor/detail/optim_kernels.h>
#include <ember/tensor/error.h>

namespace ember::detail {

void adam_update_cuda(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                      const AdamStepArgs&) {
  no_cuda("adam_update_");
}
void sgd_update_cuda(const Tensor&, const Tensor&, const Tensor&, const SgdStepArgs&) {
  no_cuda("sgd_update_");
}

}  // namespace ember::detail
