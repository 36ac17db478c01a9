// Loss parallelism (torch.distributed.tensor.parallel.loss_parallel): the cross-entropy of
// logits sharded on the class dimension, without gathering them. PyTorch's is a context manager
// that changes what F.cross_entropy does on a DTensor; here it is the function itself:
//
//   DTensor logits = ...;                                   // [B, T, V], Shard(-1) over tp
//   Tensor loss = dist::loss_parallel::cross_entropy(logits, targets);   // targets [B, T]
//   loss.backward();                                        // each rank: its vocabulary's part
//
// Per row, each rank takes the maximum, the sum of exponentials and the target's logit over its
// own classes, and three all-reduces of one value per row combine them (max, sum, sum): with
// logits [N, V] over n ranks it moves 3N values instead of gathering N x V.
#pragma once

#include <string>

#include <ember/distributed/dtensor/dtensor.h>

namespace ember::dist::loss_parallel {

/// Cross-entropy of `logits` [..., V] (Shard on the last dim of a 1-D mesh; Replicate is
/// accepted too) against class indices `target` [...] (int64, the same on every rank), with
/// `reduction` "mean" (over the rows whose target is not ignore_index), "sum" or "none" ([...]).
/// Returns a plain tensor, the same on every rank. Differentiable in `logits`. Throws
/// ValueError for other placements, a target whose shape is not logits' without the last dim,
/// or a target outside [0, V) other than ignore_index.
Tensor cross_entropy(const DTensor& logits, const Tensor& target,
                     const std::string& reduction = "mean", int64_t ignore_index = -100);

}  // namespace ember::dist::loss_parallel
