// Gradient clipping (torch.nn.utils.clip_grad_norm_ / clip_grad_value_).
#pragma once

#include <limits>
#include <vector>

#include <ember/tensor/tensor.h>

namespace ember::nn {

/// The infinity norm for clip_grad_norm_'s norm_type.
inline constexpr double kInfNorm = std::numeric_limits<double>::infinity();

/// Scales the gradients of `params` in place so that their total norm, taken as if all were
/// one vector, is at most max_norm: total = norm of the per-tensor norms (the largest |g| for
/// norm_type = kInfNorm), and every gradient is multiplied by min(1, max_norm / (total + 1e-6)).
/// Parameters without a gradient are skipped. The scale stays a device tensor, so nothing waits
/// for the GPU unless error_if_nonfinite is set. Returns the total norm before clipping: a 0-dim
/// tensor on the first gradient's device (a float32 zero on the CPU when no parameter has a
/// gradient). Throws ValueError for a negative or NaN max_norm or a norm_type <= 0 (no norm), and,
/// with error_if_nonfinite, when the total norm is NaN or infinite (leaving the gradients as
/// they were).
Tensor clip_grad_norm_(const std::vector<Tensor>& params, double max_norm,
                       double norm_type = 2.0, bool error_if_nonfinite = false);

/// The norm of `tensors` taken as one vector (torch.nn.utils.get_total_norm): what
/// clip_grad_norm_ computes, one multi-tensor reduction on a GPU (ember::total_norm). With
/// error_if_nonfinite, throws ValueError when it is NaN or infinite (waiting for the device).
Tensor get_total_norm(const std::vector<Tensor>& tensors, double norm_type = 2.0,
                      bool error_if_nonfinite = false);

/// Multiplies the gradients of `params` by min(1, max_norm / (total_norm + 1e-6)) in place
/// (torch.nn.utils.clip_grads_with_norm_): the second half of clip_grad_norm_, for a total norm
/// computed another way, e.g. summed over the shards of a sharded model.
void clip_grads_with_norm_(const std::vector<Tensor>& params, double max_norm,
                           const Tensor& total_norm);

/// Clamps every gradient of `params` into [-clip_value, clip_value] in place. Parameters
/// without a gradient are skipped. Throws ValueError for a negative or NaN clip_value.
void clip_grad_value_(const std::vector<Tensor>& params, double clip_value);

}  // namespace ember::nn
