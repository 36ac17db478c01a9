// Collectives that autograd differentiates (torch.distributed.nn.functional, and Megatron-LM's
// f and g operators): each returns a new tensor and records a node whose backward runs the
// adjoint collective on the gradient, over the same group. With them a user writes a
// tensor-parallel layer by hand:
//
//   // Megatron's column-parallel then row-parallel MLP, weights already split across `tp`:
//   Tensor h = gelu(linear(dist::functional::copy_to_group(x, tp), w1_shard));  // f
//   Tensor y = dist::functional::reduce_from_group(linear(h, w2_shard), tp);     // g
//
// Named dist::functional (PyTorch: torch.distributed.nn.functional) so that `nn::` keeps naming
// Ember's nn layer inside ember::dist. Every function is collective over `group` (null: the
// default group): every rank calls it in the same order with tensors of the same shape and
// dtype, and backward runs the adjoint collectives in the reverse order on every rank. They
// block until the result is there (the collective's Work is waited for), on the group's
// timeout; errors are the group's (rank, collective, sequence number).
#pragma once

#include <memory>
#include <vector>

#include <ember/distributed/process_group.h>

namespace ember::dist::functional {

/// Every rank gets the reduction of all ranks' `t`. Backward: the gradient all-reduced with the
/// same op (Sum: the sum of every rank's gradient; Avg: their mean). Min, Max and Product are
/// not differentiated (ValueError when a gradient reaches them).
Tensor all_reduce(const Tensor& t, ReduceOp op = ReduceOp::Sum,
                  std::shared_ptr<ProcessGroup> group = nullptr);

/// The ranks' `t` concatenated along `dim` in rank order (every rank's t the same shape).
/// Backward: the gradient reduce-scattered (summed) along `dim`: each rank gets the sum over
/// ranks of its own block.
Tensor all_gather(const Tensor& t, int64_t dim, std::shared_ptr<ProcessGroup> group = nullptr);

/// `t` split along `dim` into size() equal blocks (ValueError naming the sizes when dim is not
/// divisible); rank r gets the reduction over ranks of block r. Backward: the gradient
/// all-gathered along `dim` (Sum; Avg divides it by the group's size).
Tensor reduce_scatter(const Tensor& t, int64_t dim, ReduceOp op = ReduceOp::Sum,
                      std::shared_ptr<ProcessGroup> group = nullptr);

/// `t` split along `split_dim` into size() equal blocks, block j sent to rank j; the blocks
/// received are concatenated along `concat_dim` in rank order. Backward: the reverse all-to-all
/// (split along concat_dim, concatenate along split_dim).
Tensor all_to_all(const Tensor& t, int64_t split_dim, int64_t concat_dim,
                  std::shared_ptr<ProcessGroup> group = nullptr);

/// Rows of `t` (along dim 0) exchanged with uneven counts (torch.distributed.nn.functional.
/// all_to_all_single with split sizes): the first input_split_sizes[0] rows go to rank 0, the
/// next input_split_sizes[1] to rank 1, and so on; the result holds output_split_sizes[r] rows
/// from each rank r, in rank order. Empty sizes mean equal splits of dim 0. Every rank's
/// output_split_sizes[r] must be rank r's input_split_sizes for it: a mismatch between two
/// non-zero sizes fails the receive (gloo and threads name both sizes), but one side expecting
/// rows the other does not send waits until the group's timeout. Pairs with nothing to move
/// exchange no message. Backward: the gradient sent back the same way reversed. Used to dispatch
/// tokens to experts (expert_parallel.h). Throws ValueError naming the sizes when they do not
/// fit `t` or the group.
Tensor all_to_all_single(const Tensor& t, std::vector<int64_t> output_split_sizes,
                         std::vector<int64_t> input_split_sizes,
                         std::shared_ptr<ProcessGroup> group = nullptr);

/// Every rank gets rank `src`'s `t`. `src` is a rank of `group` (its rank there, as in every
/// ProcessGroup call; PyTorch's torch.distributed.nn.functional.broadcast takes the global rank:
/// map one with get_group_rank). Backward: the gradients summed onto `src` (the others' inputs
/// get zero gradient).
Tensor broadcast(const Tensor& t, int src, std::shared_ptr<ProcessGroup> group = nullptr);

/// Megatron's f: forward returns `t` as is (a replicated input entering a sharded computation);
/// backward all-reduces (sums) the gradient, since each rank's part of the computation gives
/// only part of it.
Tensor copy_to_group(const Tensor& t, std::shared_ptr<ProcessGroup> group = nullptr);

/// Megatron's g: forward all-reduces (sums) the ranks' partial results; backward passes the
/// gradient on as is (every rank's part saw the whole sum).
Tensor reduce_from_group(const Tensor& t, std::shared_ptr<ProcessGroup> group = nullptr);

}  // namespace ember::dist::functional
