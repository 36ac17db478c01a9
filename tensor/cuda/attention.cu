#include "tensor/detail/attention_kernels.h"
#include "tensor/error.h"
namespace ember::detail {
void attention_forward_cuda(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                            const Tensor&, const Tensor&, const AttentionParams&) {
  throw NotImplementedError("[scaled_dot_product_attention] the CUDA kernel is not written yet");
}
void attention_backward_cuda(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                             const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                             const Tensor&, const Tensor&, const AttentionParams&) {
  throw NotImplementedError("[scaled_dot_product_attention] the CUDA kernel is not written yet");
}
}
