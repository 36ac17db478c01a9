// Activation checkpointing (torch.utils.checkpoint.checkpoint): trade compute for memory by
// recomputing a segment's activations in backward instead of keeping them from forward.
//
//   // a stack of blocks: only each block's input is kept, its insides are recomputed
//   for (auto& block : blocks) x = nn::checkpoint(block, x);
//
// Unrelated to nn/io/checkpoint.h (saving and resuming training state).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include <ember/nn/module.h>

namespace ember::nn {

/// A checkpointed segment: tensors in, tensors out.
using CheckpointFunction = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

/// Runs fn(inputs) without recording its graph and keeps only `inputs` (and the global random
/// generator's state when preserve_rng_state). In backward, fn runs again with grad mode on,
/// on detached copies of the inputs and, with preserve_rng_state, from the generator state of
/// the forward call (restored afterwards), so dropout draws the same masks; the gradients then
/// flow back through that recomputation. Ember has one global generator for CPU and CUDA ops,
/// so this covers both devices.
///
/// Gradients reach the inputs through the autograd graph (a node "CheckpointBackward"), and the
/// parameters fn uses without taking them as inputs (a module's weights) as found in the
/// recomputed graph: their gradients are accumulated into grad(), running their hooks, while
/// the enclosing backward pass runs, so DistributedDataParallel's hooks fire in that pass. A
/// tensor with history that fn captures instead of taking it as an input makes backward throw
/// ValueError (its gradient could not flow back): pass it in `inputs`. Like torch's reentrant
/// checkpoint, a parameter used both inside and outside the segment gets two accumulations in
/// one backward pass (correct alone, refused by DistributedDataParallel), and autograd::grad()
/// through a checkpoint still accumulates the parameters' grad(). Backward with create_graph
/// (double backward) throws NotImplementedError; torch's reentrant checkpoint does not support
/// it either.
///
/// fn must compute the same thing both times (the same shapes and ops; it may use dropout) and
/// must stay valid until backward (it is copied; what it captures by reference must outlive
/// the backward pass). With grad mode off, or no input requiring grad, fn just runs (in the
/// latter case with its graph recorded, so parameters still get their gradients; nothing is
/// saved). Throws ValueError for an undefined input or when the recomputation returns a
/// different number of outputs; fn's own errors pass through.
std::vector<Tensor> checkpoint(const CheckpointFunction& fn, const std::vector<Tensor>& inputs,
                               bool preserve_rng_state = true);

/// One tensor in, one out: checkpoint({fn(x)}, {input}).
Tensor checkpoint(const std::function<Tensor(const Tensor&)>& fn, const Tensor& input,
                  bool preserve_rng_state = true);

/// (*module)(input), its forward hooks included, checkpointed; the module is kept alive until
/// backward.
Tensor checkpoint(std::shared_ptr<Module> module, const Tensor& input,
                  bool preserve_rng_state = true);

}  // namespace ember::nn
