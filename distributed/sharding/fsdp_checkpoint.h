// Sharded checkpoints of a fully_shard-ed model and its optimizer: every rank writes its own
// pieces (save_sharded, distributed/sharding/sharded_checkpoint.h), and a job of any world size loads them.
//
//   dist::save_fsdp_checkpoint("ckpt", *model, &opt, *pg, {{"step", "100"}});   // collective
//   auto meta = dist::load_fsdp_checkpoint("ckpt", *model, &opt);                // any world size
//
// Names: the model's tensors under their state_dict() names (so ShardedCheckpoint::consolidate
// writes a file whose model tensors a plain model loads by those names);
// the optimizer's per-parameter state under "optim.<parameter name>.<key>" (e.g.
// "optim.blocks.0.fc.weight.exp_avg", shaped as the parameter; scalars such as "step" whole), so
// the state follows each parameter to whichever rank holds it at load time. The optimizer's
// type is kept in the metadata ("optim.optimizer"); its hyperparameters are the ones it was
// built with (LR schedules restore their own state).
#pragma once

#include <map>
#include <string>

#include <ember/distributed/process_group.h>
#include <ember/nn/module.h>
#include <ember/nn/optim/optimizer.h>

namespace ember::dist {

/// Collective over pg (the sharded modules' group). `optimizer` (may be null) must step
/// fsdp_parameters(root) (in any grouping). Metadata keys starting with "optim." are reserved.
/// Throws save_sharded's errors, and ValueError for an optimizer parameter that is neither a
/// piece of a sharded parameter of root nor one of root's parameters.
void save_fsdp_checkpoint(const std::string& dir, const nn::Module& root,
                          const nn::optim::Optimizer* optimizer, ProcessGroup& pg,
                          const std::map<std::string, std::string>& metadata = {});

/// Not collective: each rank reads the pieces it holds now. Returns the user's metadata. Throws
/// ShardedCheckpoint's errors, ValueError for a tensor the checkpoint lacks or of another shape,
/// or an optimizer of another type than saved.
std::map<std::string, std::string> load_fsdp_checkpoint(const std::string& dir,
                                                        const nn::Module& root,
                                                        nn::optim::Optimizer* optimizer);

}  // namespace ember::dist
