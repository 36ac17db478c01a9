// Classification losses (torch.nn.functional.nll_loss and cross_entropy). nn's NLLLoss and
// CrossEntropyLoss layers and nn::functional's loss functions, which take their options as
// structs and the reduction as a string, are these ops.
#pragma once

#include <cstdint>

#include <ember/tensor/tensor.h>

namespace ember {

/// How a loss reduces its per-element values (torch's `reduction`): kNone keeps one loss per
/// element, kMean averages them (a weighted loss divides by its summed weights), kSum adds them.
enum class Reduction : uint8_t { kNone, kMean, kSum };

/// `loss` reduced as `reduction` says over all its elements (kMean: the plain average).
Tensor reduce_loss(const Tensor& loss, Reduction reduction);

/// Negative log likelihood of log-probabilities input [N, C], [N, C, d1, ...] or [C] at int64
/// class indices target [N], [N, d1, ...] or []: loss_i = -weight[t_i] * input[i, t_i].
/// weight [C] (floating, input's device) may be undefined (all ones); targets equal to
/// ignore_index contribute nothing and do not count in kMean, which divides by the summed
/// weights of the counted targets (NaN when none is). Throws TypeError naming "nll_loss" for a
/// non-floating input or weight or a non-int64 target, ValueError for shapes and devices that do
/// not match, IndexError for a class index outside [0, C) that is not ignore_index (on CUDA the
/// next index op reports it, Note [CUDA index checks]).
Tensor nll_loss(const Tensor& input, const Tensor& target, const Tensor& weight,
                int64_t ignore_index, Reduction reduction);

/// log_softmax over the class dim (1, or 0 for an input [C]) followed by nll_loss, for int64
/// class-index targets (weight and ignore_index as nll_loss). A floating target of input's shape
/// holds class probabilities: loss_i = -sum_c weight[c] * target[i, c] * log_softmax(input)[i, c],
/// kMean divides by the number of samples, and ignore_index must be negative. label_smoothing in
/// [0, 1] turns the target into (1 - s) * target + s / C, combined with weight and ignore_index
/// exactly as torch.nn.functional.cross_entropy. Under autocast runs in float32.
/// A 2-d input with class indices and a weight that needs no gradient is one fused op (Note
/// [Fused cross_entropy] in tensor/ops/loss.cpp): one read of the input forward, a log-sum-exp
/// per row kept (no softmax or log-probabilities), and backward in one pass over [N, C]; under
/// autocast its float16/bfloat16 input is read as it is (computing in float32, the loss float32)
/// instead of being cast. Throws as nll_loss, naming "cross_entropy", and ValueError for
/// label_smoothing outside [0, 1] or probabilities of another shape.
Tensor cross_entropy(const Tensor& input, const Tensor& target, const Tensor& weight,
                     int64_t ignore_index, Reduction reduction, double label_smoothing);

}  // namespace ember
