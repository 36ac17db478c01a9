// Fused layer-norm kernels over rows (internal): used by the front end layer_norm
// (tensor/ops/norm.cpp) and its backward node (autograd/functions_nn.cpp), on the CPU and on CUDA.
//
// x is viewed as [rows, n] (contiguous); weight and bias are [n] or undefined. Statistics are
// accumulated in double, so float32 results match a float64 reference to float rounding.
#pragma once

#include <ember/tensor/tensor.h>

namespace ember::detail {

/// y = (x - mean) * rstd * weight + bias per row; mean and rstd ([rows], x's dtype) are
/// written for backward. float32 and float64 CPU tensors only.
void layer_norm_forward_cpu(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                            const Tensor& y, const Tensor& mean, const Tensor& rstd);

/// With xhat = (x - mean) * rstd and dxhat = dy * weight:
///   dx = rstd * (dxhat - mean_row(dxhat) - xhat * mean_row(dxhat * xhat)),
///   dweight = sum_rows(dy * xhat), dbias = sum_rows(dy).
/// Outputs that are undefined are not computed.
void layer_norm_backward_cpu(const Tensor& dy, const Tensor& x, const Tensor& mean,
                             const Tensor& rstd, const Tensor& weight, const Tensor& dx,
                             const Tensor& dweight, const Tensor& dbias);

/// The CUDA twins of the two above (tensor/cuda/norm.cu): contiguous float32 and float64 CUDA
/// tensors on one device, accumulating in float for float32. Queued on the current stream.
void layer_norm_forward_cuda(const Tensor& x, const Tensor& weight, const Tensor& bias,
                             double eps, const Tensor& y, const Tensor& mean, const Tensor& rstd);
void layer_norm_backward_cuda(const Tensor& dy, const Tensor& x, const Tensor& mean,
                              const Tensor& rstd, const Tensor& weight, const Tensor& dx,
                              const Tensor& dweight, const Tensor& dbias);

/// Batch norm over the channels of x viewed as [N, C, L] (contiguous), float32 or float64 CPU
/// tensors of one dtype; weight and bias [C] or undefined. training: writes the batch's mean,
/// biased variance and invstd = 1 / sqrt(var + eps) ([C]) first; otherwise reads mean and
/// invstd (the running statistics'), and var is undefined. Then
/// y = x * (invstd * weight) + (bias - mean * invstd * weight). Statistics in double.
void batch_norm_forward_cpu(const Tensor& x, const Tensor& weight, const Tensor& bias,
                            bool training, double eps, const Tensor& mean, const Tensor& var,
                            const Tensor& invstd, const Tensor& y);

/// With xhat = (x - mean) * invstd and M = N * L values per channel: dbias = sum(dy),
/// dweight = sum(dy * xhat); training: dx = weight * invstd * (dy - mean(dy) - xhat *
/// mean(dy * xhat)), otherwise dx = dy * weight * invstd. Outputs that are undefined are not
/// computed.
void batch_norm_backward_cpu(const Tensor& dy, const Tensor& x, const Tensor& weight,
                             const Tensor& mean, const Tensor& invstd, bool training,
                             const Tensor& dx, const Tensor& dweight, const Tensor& dbias);

/// xhat = (x - mean) * rstd over the last normalized_dims dims, and rstd (dims kept): what
/// layer_norm's tensor-op paths compute, recorded when grad mode is on (tensor/ops/norm.cpp).
struct LayerNormStats {
  Tensor xhat, rstd;
};
LayerNormStats layer_norm_stats(const Tensor& x, int64_t normalized_dims, double eps);

}  // namespace ember::detail
