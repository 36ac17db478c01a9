// Operations over lists of tensors (PyTorch's torch._foreach_* family and
// torch.nn.utils.get_total_norm). On CUDA one kernel launch covers many tensors (Note
// [Multi-tensor launches] in tensor/cuda/foreach.cu), where a loop over the list launches one or
// more kernels per tensor: for the ~100 gradients of a transformer, launches are what a step
// would otherwise wait on. Other layouts and devices take the per-tensor ops, with the same
// results.
#pragma once

#include <vector>

#include <ember/tensor/tensor.h>

namespace ember {

/// The p-norm of all elements of `tensors` taken together (the norm of their concatenation):
/// the norm of the per-tensor norms, as torch.nn.utils.get_total_norm computes it; the largest
/// |x| for p = +inf. A 0-d tensor on the first tensor's device, of the tensors' dtype (promoted
/// when they differ); a float32 zero on the CPU for an empty list. Tensors on several devices
/// have their norms gathered on the first one's. Throws ValueError for an undefined tensor or a
/// p that is not > 0 (or +inf), and TypeError for a tensor that is not floating point.
Tensor total_norm(const std::vector<Tensor>& tensors, double p = 2.0);

/// Multiplies every tensor in place by `scale`, a one-element floating tensor (on the tensors'
/// device when they are on a GPU, so nothing waits for it), as t.mul_(scale) would for each.
/// Throws ValueError for an undefined tensor or a scale of more than one element, TypeError for
/// a non-floating tensor, and RuntimeError for a tensor that requires grad while grad mode is on.
void foreach_mul_(const std::vector<Tensor>& tensors, const Tensor& scale);

}  // namespace ember
