// Functional forms of the layers and losses (torch.nn.functional). Each is written with
// differentiable tensor ops, so autograd differentiates it (twice, too) on every device.
// Activations, softmax, pooling, conv2d, embedding lookups, layer_norm and the fused ops behind
// the classification losses are tensor ops already (tensor/ops.h); this header adds what needs
// more than one op, and the losses' option structs.
//
// Losses take a `reduction`: "mean" (the default), "sum" or "none" (one loss per element,
// the shape of the target). Every function throws ValueError / TypeError / IndexError naming
// the op, what was expected and what was got.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include <ember/tensor/ops/loss.h>
#include <ember/tensor/ops/norm.h>
#include <ember/tensor/ops.h>

namespace ember::nn::functional {

/// input [*, in] @ weight[out, in]^T + bias[out] -> [*, out]. bias may be undefined.
Tensor linear(const Tensor& input, const Tensor& weight, const Tensor& bias = {});

/// Inverted dropout: in training, zeroes each element with probability p (drawn from `gen`,
/// default the global generator) and scales the rest by 1 / (1 - p); otherwise (or p == 0)
/// returns input itself. inplace writes the result into input. Throws for p outside [0, 1].
Tensor dropout(const Tensor& input, double p = 0.5, bool training = true, bool inplace = false,
               Generator* gen = nullptr);

/// Batch normalisation over input [N, C, *] per channel C. training: normalises with the batch
/// mean and biased variance and, if running_mean/running_var are defined, updates them in place
/// (running = (1 - momentum) * running + momentum * batch, with the unbiased variance) without
/// recording history. Otherwise normalises with the running statistics (which must then be
/// defined). weight and bias [C] may be undefined. Throws if training sees one value per channel.
Tensor batch_norm(const Tensor& input, const Tensor& running_mean, const Tensor& running_var,
                  const Tensor& weight = {}, const Tensor& bias = {}, bool training = false,
                  double momentum = 0.1, double eps = 1e-5);

/// Layer normalisation (torch.nn.functional.layer_norm): the tensor-layer op, documented in
/// tensor/ops/norm.h.
using ember::layer_norm;

/// Rows of weight [V, D] for int64/int32 indices of any shape -> [*indices.shape, D]. With
/// padding_idx (negative counts from V), positions holding it pass no gradient to weight.
Tensor embedding(const Tensor& input, const Tensor& weight,
                 std::optional<int64_t> padding_idx = std::nullopt);

// ---- losses ----------------------------------------------------------------------------------

struct NLLLossOptions {
  /// Per-class weight [C] (undefined = all ones). "mean" divides by the summed weights of the
  /// targets that are not ignored.
  Tensor weight = {};
  /// Targets equal to this contribute nothing (and do not count in "mean").
  int64_t ignore_index = -100;
  std::string reduction = "mean";
};

/// Negative log likelihood of log-probabilities input [N, C], [N, C, d1, ...] or [C] at
/// int64 class indices target [N], [N, d1, ...] or []: loss_i = -weight[t_i] * input[i, t_i].
/// Throws TypeError for a non-int64 target, ValueError for shape mismatches, IndexError for a
/// class index outside [0, C) that is not ignore_index. "mean" over no counted target is NaN.
/// The tensor-layer op ember::nll_loss (tensor/ops/loss.h) with these options.
Tensor nll_loss(const Tensor& input, const Tensor& target, const NLLLossOptions& opts = {});

struct CrossEntropyOptions {
  Tensor weight = {};           ///< per-class weight [C], as NLLLossOptions::weight
  int64_t ignore_index = -100;  ///< as NLLLossOptions::ignore_index (class-index targets only)
  std::string reduction = "mean";
  /// In [0, 1]: the target becomes (1 - s) * target + s / C, PyTorch's formulation (with
  /// weight and ignore_index combined exactly as torch.nn.functional.cross_entropy).
  double label_smoothing = 0.0;
};

/// log_softmax over the class dim (1, or 0 for an input [C]) followed by nll_loss, for int64
/// class-index targets. A floating target of input's shape is taken as class probabilities:
/// loss_i = -sum_c weight[c] * target[i, c] * log_softmax(input)[i, c]; "mean" divides by
/// the number of samples (ignore_index must then be negative, as in PyTorch). The tensor-layer
/// op ember::cross_entropy (tensor/ops/loss.h, with its fused 2-d form) with these options.
Tensor cross_entropy(const Tensor& input, const Tensor& target,
                     const CrossEntropyOptions& opts = {});

/// (input - target)^2; input and target must have the same shape (PyTorch would broadcast with a
/// warning; a shape mismatch is nearly always a bug, so Ember refuses it).
Tensor mse_loss(const Tensor& input, const Tensor& target, std::string_view reduction = "mean");

struct BCEWithLogitsOptions {
  /// Rescales each element's loss; broadcasts to the input's shape.
  Tensor weight = {};
  /// Weight of the positive term, broadcast along the last dim (e.g. [C] for input [N, C]).
  Tensor pos_weight = {};
  std::string reduction = "mean";
};

/// Binary cross entropy on logits: -w * (pos_weight * t * log(sigmoid(x)) + (1 - t) *
/// log(1 - sigmoid(x))), computed stably for any |x| (PyTorch's formulation). target must have
/// input's shape and a floating dtype.
Tensor binary_cross_entropy_with_logits(const Tensor& input, const Tensor& target,
                                        const BCEWithLogitsOptions& opts = {});

}  // namespace ember::nn::functional
