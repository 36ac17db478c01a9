// Linked instead of tensor/cuda/{blas,conv_cudnn}.cpp and pool.cu when Ember is built with
// EMBER_WITH_CUDA=OFF: the CUDA side of matrix products, convolution and pooling.
#include <ember/tensor/cuda/absent/no_cuda.h>
#include <ember/tensor/gpu/cudnn.h>
#include <ember/tensor/detail/conv_kernels.h>
#include <ember/tensor/detail/linalg_kernels.h>
#include <ember/tensor/error.h>

namespace ember {
bool cuda::cudnn_is_available() { return false; }
}  // namespace ember

namespace ember::detail {

void gemm_cuda(const Tensor&, const Tensor&, const Tensor&, double, double) { no_cuda("matmul"); }
bool gemm_bias_cuda(const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  no_cuda("addmm");
}

void conv2d_cuda(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const ConvGeom&) {
  no_cuda("conv2d");
}
void conv2d_backward_input_cuda(const Tensor&, const Tensor&, const Tensor&, const ConvGeom&) {
  no_cuda("conv2d_backward_input");
}
void conv2d_backward_weight_cuda(const Tensor&, const Tensor&, const Tensor&, const ConvGeom&) {
  no_cuda("conv2d_backward_weight");
}
void add_channel_bias_cuda(const Tensor&, const Tensor&) { no_cuda("conv2d"); }
void max_pool2d_cuda(const Tensor&, const Tensor&, const Tensor&, const PoolGeom&) {
  no_cuda("max_pool2d");
}
void max_pool2d_backward_cuda(const Tensor&, const Tensor&, const Tensor&, const PoolGeom&) {
  no_cuda("max_pool2d_backward");
}
void avg_pool2d_cuda(const Tensor&, const Tensor&, const PoolGeom&) { no_cuda("avg_pool2d"); }
void avg_pool2d_backward_cuda(const Tensor&, const Tensor&, const PoolGeom&) {
  no_cuda("avg_pool2d_backward");
}
void adaptive_avg_pool2d_cuda(const Tensor&, const Tensor&, const PoolGeom&) {
  no_cuda("adaptive_avg_pool2d");
}
void adaptive_avg_pool2d_backward_cuda(const Tensor&, const Tensor&, const PoolGeom&) {
  no_cuda("adaptive_avg_pool2d_backward");
}

}  // namespace ember::detail
