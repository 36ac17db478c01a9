// Linked instead of tensor/cuda/conv_cudnn.cpp in a CUDA build without cuDNN (EMBER_WITH_CUDNN=OFF,
// or cudnn.h or libcudnn not found): convolution on CUDA tensors says what the build lacks and how
// to get it. Pooling and every other CUDA op do not need cuDNN.
#include <ember/tensor/gpu/cudnn.h>
#include <ember/tensor/detail/conv_kernels.h>
#include <ember/tensor/error.h>

namespace ember {

bool cuda::cudnn_is_available() { return false; }

namespace detail {
namespace {
[[noreturn]] void no_cudnn(const char* op) {
  throw NotImplementedError(str_cat(
      "[", op, "] convolution on CUDA tensors needs cuDNN, and this build has none (configured "
      "with EMBER_WITH_CUDNN=OFF, or cudnn.h or libcudnn was not found). Install cuDNN (Debian 12: "
      "NVIDIA's libcudnn9-dev-cuda-13, which scripts/install-cuda.sh installs), configure again "
      "and rebuild; or run the convolution on the CPU"));
}
}  // namespace

void conv2d_cuda(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const ConvGeom&) {
  no_cudnn("conv2d");
}
void conv2d_backward_input_cuda(const Tensor&, const Tensor&, const Tensor&, const ConvGeom&) {
  no_cudnn("conv2d_backward_input");
}
void conv2d_backward_weight_cuda(const Tensor&, const Tensor&, const Tensor&, const ConvGeom&) {
  no_cudnn("conv2d_backward_weight");
}

}  // namespace detail
}  // namespace ember
