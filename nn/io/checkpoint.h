// Checkpoints of a training state: a model's state dict, optionally an optimizer's state, and
// string metadata, in one safetensors file written atomically.
//
// Layout: the model's tensors under their state-dict names ("0.weight", "1.running_mean"),
// the optimizer's under "optim." + its names ("optim.state.0.exp_avg"), extra tensors under
// "extra." + theirs; metadata holds the user's keys plus "optim.optimizer" and
// "optim.param_groups" when an optimizer is saved. load_checkpoint also reads optimizer state
// keyed by parameter name, "optim.<parameter name>.<key>" (metadata "optim.state_keys" =
// "parameter_names"): the layout of a sharded FSDP checkpoint and of its consolidated file
// (distributed/checkpoint/model_checkpoint.h), whose indices would not survive resharding. A
// file without an optimizer is a plain safetensors state dict in PyTorch's names and layouts
// (scripts/to_torch.py turns it into a torch state_dict).
#pragma once

#include <map>
#include <string>

#include <ember/nn/module.h>
#include <ember/nn/optim/optimizer.h>

namespace ember::nn {

/// Saves model (and optimizer, if given) with `metadata` to `path` atomically: an existing file
/// is replaced only by a complete new one. Metadata keys starting with "optim." are reserved.
/// `extra` tensors (e.g. a communication hook's state) are stored under "extra." + their name.
void save_checkpoint(const std::string& path, const Module& model,
                     const optim::Optimizer* optimizer = nullptr,
                     const std::map<std::string, std::string>& metadata = {},
                     const NamedTensors& extra = {});

/// Loads a checkpoint written by save_checkpoint into model (strict key and shape checking)
/// and, if given, optimizer (which must be of the type saved); returns the user's metadata.
/// Throws ValueError for a file without optimizer state when an optimizer is given, and
/// whatever load_safetensors / load_state_dict throw for bad or mismatched files (a bad model
/// state leaves model and optimizer untouched; a bad optimizer state is found after the model
/// was loaded).
/// `extra`, if given, receives the extra tensors saved with the checkpoint (names without the
/// "extra." prefix; empty if there were none); without it they are ignored.
std::map<std::string, std::string> load_checkpoint(const std::string& path, Module& model,
                                                   optim::Optimizer* optimizer = nullptr,
                                                   NamedTensors* extra = nullptr);

/// Metadata key and value (after the "optim." prefix) of optimizer state keyed by parameter name.
inline constexpr const char* kStateKeysKey = "state_keys";
inline constexpr const char* kStateKeysByName = "parameter_names";

/// A saved optimizer's param_groups JSON with `mine`'s "params" lists: the saved hyperparameters
/// (lr as a schedule left it, betas, ...) for an optimizer whose parameters are numbered
/// differently (another world size, another layout). Throws ValueError, naming `op`, when the
/// group counts differ.
std::string merge_param_groups(const std::string& saved, const std::string& mine, const char* op);

}  // namespace ember::nn
