// Fully sharded data parallel (PyTorch 2's `fully_shard`; ZeRO stage 3): each sharded module's
// parameters, gradients and optimizer state are split across the ranks of a group, and the
// parameters are gathered only while the module computes.
//
//   for (auto& block : model->blocks) dist::fully_shard(block);   // submodules first,
//   dist::fully_shard(model);                                      // then the root
//   nn::optim::AdamW opt(dist::fsdp_parameters(*model), {.lr = 3e-4});
//   for (...) {
//     opt.zero_grad();
//     loss_fn((*model)(x), y).backward();  // gathers, computes, reduce-scatters gradients
//     dist::clip_grad_norm_(*model, 1.0);  // optional: the norm over every rank's shards
//     opt.step();                          // each rank updates only its shards
//   }
//
// fully_shard(module) flattens the parameters of `module` that no sharded submodule holds into
// one buffer per dtype (and per requires_grad), pads it to a multiple of the world size, and
// keeps 1/N of it on each rank: fsdp_parameters() returns this rank's piece of each parameter
// (1-D views of that shard), which is what the optimizer steps. The module's own parameter
// tensors (Linear::weight, ...) keep their shapes and handles, but their memory is a view of the
// module's gather buffer, which exists only while they are needed:
//   - before the module's forward (a forward pre-hook: call the module as (*module)(x), or
//     module->call(...) for other signatures; module->forward(x) skips hooks as in PyTorch) the
//     shards are all-gathered into the buffer; the next module's gather is issued right after,
//     so it overlaps this module's compute (prefetch, in the order the previous step ran);
//   - after the forward the buffer is released (reshard_after_forward; the outermost sharded
//     module keeps it, since its backward comes next);
//   - before the module's backward (a hook on its outputs' gradients) it is gathered again;
//   - once all of the module's parameter gradients are accumulated they are reduce-scattered
//     (averaged) into the shards' gradients, the full gradients freed and the buffer released.
// So a rank holds the sharded state plus one or two modules' full parameters at a time.
//
// Every rank must build the model with the same parameter values (same seed), as PyTorch's
// fully_shard assumes, and run the same sharded modules in the same order. Parameters outside
// every sharded module (a root that is not sharded itself) stay replicated: fsdp_parameters()
// returns them too, and their gradients are averaged across the ranks at the end of backward, as
// DDP would. See docs/sharding.md for what is supported and what is refused.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include <ember/distributed/process_group.h>
#include <ember/distributed/sharding/fsdp_options.h>
#include <ember/nn/module.h>

namespace ember::dist {

/// Shards `module` (see above) and returns it. Shard submodules before the modules that contain
/// them. Over options.group (default: the default group), or options.mesh: a 1-D mesh's group, or
/// for a 2-D mesh HSDP, sharded over dimension 1 and replicated over dimension 0 (equally
/// options.replicate_group beside options.group): each gradient shard is then averaged across the
/// copies too. The first module sharded over a group with a replicate group is collective over
/// the replicate group (a check that its ranks hold the same shard; docs/sharding.md, "HSDP").
/// Throws ValueError for a null module, a module sharded twice, a parameter already sharded by
/// another module (an enclosing module sharded first, or a weight tied across modules), or no
/// parameters left to shard; NotImplementedError for parameters on a device other than the CPU or
/// CUDA, or on two devices. On CUDA, move the module to its device first; the gathered parameters
/// then live in device memory mapped on gather and unmapped on reshard (docs/sharding.md, "FSDP on
/// CUDA").
std::shared_ptr<nn::Module> fully_shard(std::shared_ptr<nn::Module> module,
                                        FullyShardOptions options = {});

/// True if fully_shard was applied to `module` itself.
bool is_fully_sharded(const nn::Module& module);

/// What an optimizer steps, in root->named_parameters() order: for a sharded parameter this
/// rank's piece of it (a 1-D view of its module's shard; none when this rank holds no element of
/// it), for a parameter outside every sharded module the parameter itself (replicated: its
/// gradient is from then on averaged across the ranks at the end of each backward). Only those
/// that require grad. Throws ValueError if nothing under root is sharded.
std::vector<Tensor> fsdp_parameters(const nn::Module& root);

/// PyTorch's set_requires_gradient_sync (FSDP's no_sync): with false, backward keeps each
/// module's full gradients and accumulates into them, with no communication; the next backward
/// with true reduce-scatters the sum. Applies to every sharded module under root.
void set_requires_gradient_sync(const nn::Module& root, bool sync);

/// clip_grad_norm_ over the whole model: the norm of all ranks' shard gradients together with the
/// replicated parameters' (counted once), scaled on every rank by the same factor. Collective.
/// Returns the total norm (before clipping), the same on every rank.
Tensor clip_grad_norm_(const nn::Module& root, double max_norm, double norm_type = 2.0);

/// The full state dict of `root` (its state_dict() names, shapes and dtypes, the sharded
/// parameters gathered), on every rank. Collective.
nn::NamedTensors full_state_dict(const nn::Module& root);
/// Loads a full state dict (e.g. one a plain model saved): each rank keeps its part of every
/// sharded parameter. Not collective. Throws ValueError listing missing and unexpected keys and
/// shape mismatches.
void load_full_state_dict(const nn::Module& root, const nn::NamedTensors& state);

/// A sharded parameter and this rank's piece of it: elements [begin, end) of the parameter
/// flattened, as `data`, the 1-D leaf fsdp_parameters() returns for it (undefined when this rank
/// holds none of it; its gradient and optimizer state have its shape).
struct LocalShard {
  std::string name;  ///< root's named_parameters() name
  Shape shape;       ///< the full parameter's
  int64_t begin = 0, end = 0;
  Tensor data;
};
/// Every sharded parameter under root with this rank's piece of it, in named_parameters()
/// order. E.g. AdamW without weight decay on biases and norms:
///   for (auto& s : dist::local_shards(*model))
///     if (s.data.defined()) (s.shape.size() >= 2 ? decay : no_decay).push_back(s.data);
std::vector<LocalShard> local_shards(const nn::Module& root);

/// Memory of the sharded modules' gather buffers in this process, CPU and CUDA together (the
/// bytes the parameters use; a CUDA arena maps them rounded up to the allocation granularity,
/// and cuda::memory_allocated() does not count it: it is not the caching allocator's).
struct FsdpMemoryStats {
  int64_t sharded_bytes = 0;        ///< the shards (what each rank keeps)
  int64_t unsharded_bytes = 0;      ///< gather buffers holding memory now
  int64_t peak_unsharded_bytes = 0; ///< the most they held at once
  int64_t full_bytes = 0;           ///< all gather buffers together (every module gathered)
};
FsdpMemoryStats fsdp_memory_stats();
/// Sets peak_unsharded_bytes to the current unsharded_bytes.
void reset_fsdp_peak_memory_stats();

/// The communication a sharded model's steps did not hide, as DDPStats' exposed_communication
/// counts DDP's: the time this process's host was blocked waiting for the collectives of root's
/// sharded modules (an all-gather not done when its module runs, the reduce-scatters, HSDP's
/// all-reduces, the replicated parameters' average), since fully_shard, forward passes outside
/// training (evaluation) included. Counted per process group: models sharded over the same group
/// count together. Diff two readings for a step. A rank that waits long is waiting for slower ones
/// (dist::straggler_report). With NCCL a wait only orders the GPU's streams, so on CUDA this counts
/// the host's waits only, near 0.
struct FsdpCommStats {
  double wait_ms = 0;
};
FsdpCommStats fsdp_comm_stats(const nn::Module& root);

/// The process groups the fully_shard-ed modules under `root` reduce over (each shard group, and
/// HSDP's replicate groups), each once: what a rank that fails mid-step aborts, so that its
/// data-parallel peers do not wait for its gradients until the timeout (a pipeline's stages).
std::vector<std::shared_ptr<ProcessGroup>> fsdp_process_groups(const nn::Module& root);

}  // namespace ember::dist
