// Linked instead of tensor/cuda/attention_cudnn.cpp where there is no cuDNN frontend to build it
// with: a CPU-only build, and a CUDA build without cuDNN or its frontend headers
// (scripts/install-cudnn-frontend.sh), where attention on CUDA runs Ember's own kernels
// (tensor/cuda/attention.cu) or the written-out path.
#include <ember/tensor/detail/attention_kernels.h>

namespace ember::detail {

bool attention_cudnn_supported(Dtype, Device, const AttentionParams&, bool) { return false; }
bool attention_cudnn_backward_supported(Dtype, Device, const AttentionParams&) { return false; }
bool attention_cudnn_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                             const Tensor&, const AttentionParams&) {
  return false;
}
bool attention_cudnn_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              const Tensor&, const AttentionParams&) {
  return false;
}

}  // namespace ember::detail
