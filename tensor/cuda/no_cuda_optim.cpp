// Linked instead of tensor/cuda/optim.cu when Ember is built with EMBER_WITH_CUDA=OFF.
#include <ember/tensor/detail/optim_kernels.h>
#include <ember/tensor/error.h>

namespace ember::detail {

namespace {
[[noreturn]] void no_cuda(const char* what) {
  throw NotImplementedError(str_cat("[", what,
                                    "] CUDA is not available: Ember was built with "
                                    "EMBER_WITH_CUDA=OFF"));
}
}  // namespace

void adam_update_cuda(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                      const AdamStepArgs&) {
  no_cuda("adam_update_");
}
void sgd_update_cuda(const Tensor&, const Tensor&, const Tensor&, const SgdStepArgs&) {
  no_cuda("sgd_update_");
}

}  // namespace ember::detail
