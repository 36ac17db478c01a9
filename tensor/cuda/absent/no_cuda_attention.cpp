// Linked instead of tensor/cuda/attention.cu when Ember is built with EMBER_WITH_CUDA=OFF.
#include <ember/tensor/detail/attention_kernels.h>
#include <ember/tensor/error.h>

namespace ember::detail {

namespace {
[[noreturn]] void no_cuda() {
  throw NotImplementedError(
      "[scaled_dot_product_attention] CUDA is not available: Ember was built with "
      "EMBER_WITH_CUDA=OFF");
}
}  // namespace

bool attention_tf32_supported(Dtype, Device, const AttentionParams&, bool) { return false; }
void attention_forward_cuda(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                            const Tensor&, const Tensor&, const AttentionParams&) {
  no_cuda();
}
void attention_backward_cuda(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                             const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                             const Tensor&, const Tensor&, const AttentionParams&) {
  no_cuda();
}

}  // namespace ember::detail
