// Normalisation ops with fused kernels (torch.nn.functional.layer_norm); nn's LayerNorm layer
// and nn::functional::layer_norm are this op.
#pragma once

#include <ember/tensor/tensor.h>

namespace ember {

/// Layer normalisation over the last normalized_shape.size() dims of input, whose trailing dims
/// must equal normalized_shape: y = (x - mean) / sqrt(var + eps) * weight + bias per row, with
/// the biased variance; weight and bias have normalized_shape or are undefined.
/// input must be floating; under autocast it runs in float32. Contiguous float32 and float64
/// tensors of one dtype on the CPU or one CUDA device take fused row kernels (forward saves only
/// the per-row mean and rstd for backward); other inputs compute the same in tensor ops.
/// Differentiable, twice too: under create_graph backward is made of recorded tensor ops.
/// Throws TypeError naming "layer_norm" for a non-floating input, ValueError for an empty
/// normalized_shape, an input whose trailing dims differ from it, or weight/bias of another
/// shape.
Tensor layer_norm(const Tensor& input, IntList normalized_shape, const Tensor& weight = {},
                  const Tensor& bias = {}, double eps = 1e-5);

namespace detail {

/// Whether nn::functional::batch_norm's fused path applies (Note [BatchNorm as one op] in
/// tensor/ops/norm.cpp): a contiguous float32 or float64 CPU input [N, C, *] with at least 16
/// values per (sample, channel), weight and bias contiguous of its dtype or undefined, and
/// (when not training) running statistics defined.
bool batch_norm_fusable(const Tensor& input, const Tensor& weight, const Tensor& bias,
                        const Tensor& running_mean, const Tensor& running_var, bool training);

/// y = (x - mean) * invstd * weight + bias over the channels (dim 1) of input, recorded as one op
/// (BatchNormBackward). training: mean and the biased var are the batch's, returned for the
/// running statistics' update, and the gradient flows through them; otherwise they are
/// running_mean and running_var (constants) and the returned mean and var are undefined.
/// Arguments already checked by nn::functional::batch_norm; batch_norm_fusable must hold.
struct BatchNormFused {
  Tensor y, mean, var;
};
BatchNormFused batch_norm_fused(const Tensor& input, const Tensor& weight, const Tensor& bias,
                                const Tensor& running_mean, const Tensor& running_var,
                                bool training, double eps);

}  // namespace detail

}  // namespace ember
