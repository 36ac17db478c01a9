// Sharded checkpoints of a model and its optimizer in any parallel layout, loaded in any other:
// replicated (DDP), fully_shard-ed (FSDP), tensor parallel (parameters parallelize_module laid
// out, found through as_dtensor) and FSDP over tensor parallelism (2-D).
//
//   dist::save_model_checkpoint("ckpt", *model, &opt, *world, {{"step", "100"}});  // collective
//   auto meta = dist::load_model_checkpoint("ckpt", *model, &opt);  // any layout, any world size
//
// Every rank writes the parts it holds (save_sharded, checkpoint/sharded_checkpoint.h): each
// under its whole parameter's name and shape, as the block of the whole its tensor-parallel part
// is (a Box: Shard(1) of a matrix is not one flat range; a fused projection's blocks are boxes of
// its [3, C, C] view) and, under fully_shard, the flat range of that block its piece is. A part
// several ranks hold (a replicated parameter; a tensor-parallel block on every data-parallel
// rank; a LayerNorm weight on every tensor-parallel rank) is written once, by one of them. A job
// of another layout reads what each of its ranks holds now, from whichever files hold it.
//
// Names: the model's tensors under their state_dict() names (so ShardedCheckpoint::consolidate
// writes a file whose model tensors a plain model loads by those names); the optimizer's
// per-parameter state under "optim.<parameter name>.<key>" (e.g.
// "optim.blocks.0.fc.weight.exp_avg", shaped and laid out as the parameter; scalars such as
// "step" whole), so the state follows each parameter to whichever rank holds it at load time.
// The optimizer's type is kept in the metadata ("optim.optimizer"); its hyperparameters are the
// ones it was built with (LR schedules restore their own state).
#pragma once

#include <map>
#include <string>

#include <ember/distributed/process_group.h>
#include <ember/nn/module.h>
#include <ember/nn/optim/optimizer.h>

namespace ember::dist {

/// Collective over pg, which holds every rank with a part of root (the world, for a 2-D
/// layout). `optimizer` (may be null) must step root's parameters or, where fully_shard holds
/// them, fsdp_parameters(root) (in any grouping). Metadata keys starting with "optim." are
/// reserved. Throws save_sharded's errors (parts that do not tile a tensor: a layout the ranks
/// disagree on), and ValueError for an optimizer parameter that is neither a piece of a sharded
/// parameter of root nor one of root's parameters.
void save_model_checkpoint(const std::string& dir, const nn::Module& root,
                           const nn::optim::Optimizer* optimizer, ProcessGroup& pg,
                           const std::map<std::string, std::string>& metadata = {});

/// Not collective: each rank reads the parts it holds now, whatever layout saved them. Returns
/// the user's metadata. Throws ShardedCheckpoint's errors (a missing or truncated rank file,
/// named), ValueError naming the tensor and the directory for a tensor the checkpoint lacks or
/// has in another shape (a checkpoint of another model), or an optimizer of another type than
/// saved.
std::map<std::string, std::string> load_model_checkpoint(const std::string& dir,
                                                         const nn::Module& root,
                                                         nn::optim::Optimizer* optimizer);

}  // namespace ember::dist
