// Optimizer: the base of SGD, Adam and AdamW (torch.optim.Optimizer).
//
// An optimizer holds parameter groups: lists of parameter tensors, each group with its own
// hyperparameters ("lr", "weight_decay", ...). The tensors are the module's own handles
// (Module::parameters()), so step() updates the model in place. Per-parameter state
// (momentum buffers, Adam moments, step counts) is created lazily on the first step that sees a
// parameter's gradient and is reachable through state_dict() in PyTorch's layout.
//
// Hyperparameters are doubles by name, as in PyTorch's group dicts; flags (nesterov, amsgrad,
// maximize) are 0 or 1, and Adam's betas are "beta1" and "beta2". LR schedulers change "lr"
// (and OneCycleLR "momentum" / "beta1") and add their own keys ("initial_lr", "max_lr", ...).
//
// Threads: an optimizer may be used by one thread at a time. CUDA updates are asynchronous on
// the current stream; step() itself never waits for the device.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ember/nn/module.h>

namespace ember::nn::optim {

/// One group's hyperparameters by name ("lr", "momentum", "beta1", ...).
using GroupOptions = std::map<std::string, double>;

/// A list of parameters with their own hyperparameters. When passed to an optimizer, `options`
/// holds only overrides (e.g. {{"lr", 0.01}}); the optimizer fills in its defaults.
struct ParamGroup {
  std::vector<Tensor> params;
  GroupOptions options;

  ParamGroup() = default;
  ParamGroup(std::vector<Tensor> params, GroupOptions options = {})  // NOLINT
      : params(std::move(params)), options(std::move(options)) {}

  /// The option called key; throws ValueError naming it (and the keys there are) if absent.
  double get(const std::string& key) const;
  bool has(const std::string& key) const { return options.count(key) != 0; }
  void set(const std::string& key, double value) { options[key] = value; }
  double lr() const { return get("lr"); }
  void set_lr(double lr) { set("lr", lr); }
};

/// An optimizer's state in PyTorch's state_dict layout, as data a safetensors checkpoint holds
/// (named tensors plus string metadata).
struct OptimizerState {
  /// The optimizer's name ("SGD", "Adam", "AdamW"); load_state_dict checks it.
  std::string type;
  /// Per-parameter state named "state.<param index>.<key>" ("state.0.exp_avg", "state.0.step"),
  /// where the index counts parameters across all groups in order (PyTorch's packing).
  NamedTensors state;
  /// The groups as JSON: [{"lr": 0.1, "momentum": 0.9, ..., "params": [0, 1]}, ...]. Flags are
  /// JSON booleans; numbers round-trip exactly.
  std::string param_groups;

  /// {"optimizer": type, "param_groups": param_groups}: safetensors metadata.
  std::map<std::string, std::string> metadata() const;
  /// The inverse of (state, metadata()); throws ValueError naming a missing metadata key.
  static OptimizerState from(NamedTensors state, const std::map<std::string, std::string>& meta);
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  /// "SGD", "Adam", "AdamW".
  virtual std::string name() const = 0;

  /// One update of every parameter that has a gradient (parameters without one are skipped),
  /// in place, without recording autograd history.
  virtual void step() = 0;
  /// Runs closure() with grad mode on (it should zero the grads, compute the loss and call
  /// backward), then step(); returns the closure's loss.
  Tensor step(const std::function<Tensor()>& closure);
  /// step() unless `found_inf` (a float32 tensor of one element, GradScaler's) is non-zero. The
  /// base reads the flag on the host; an optimizer that supports_found_inf() decides on the
  /// device where its update runs there, so nothing waits and a CUDA graph can hold the step
  /// (the capturable GradScaler needs this).
  virtual void step_unless(const Tensor& found_inf);
  virtual bool supports_found_inf() const { return false; }

  /// Clears every parameter's gradient (set_to_none) or zeroes it in place (detaching it from
  /// any graph it was built in, as PyTorch does).
  void zero_grad(bool set_to_none = true);

  /// Adds a group (e.g. layers unfrozen later). Missing options take the defaults. Throws
  /// ValueError for an unknown option key, a bad value (negative lr, ...), a parameter that is
  /// undefined, not a leaf, is repeated, or is already in another group, and TypeError for one
  /// that is not floating point; the message names the group and parameter index. A parameter
  /// that does not require grad is taken (as torch takes it): it has no gradient to step.
  void add_param_group(ParamGroup group);

  std::vector<ParamGroup>& param_groups() { return groups_; }
  const std::vector<ParamGroup>& param_groups() const { return groups_; }
  /// The default hyperparameters (what add_param_group fills in).
  const GroupOptions& defaults() const { return defaults_; }

  /// The state of one parameter ("momentum_buffer", "exp_avg", ...), empty before its first
  /// step. The tensors are the optimizer's own (writing to them changes its state).
  const NamedTensors& state(const Tensor& param) const;

  /// The state in PyTorch's layout. The tensors are the optimizer's own buffers, not copies
  /// (as in PyTorch): save them before the next step(), or clone them.
  OptimizerState state_dict() const;
  /// Replaces the state and every group's hyperparameters with the saved ones (the parameters
  /// stay). State tensors are copied, converted to each parameter's dtype and device ("step"
  /// keeps its own). Throws ValueError, before changing anything, for another optimizer type,
  /// a different number of groups or of parameters per group, malformed JSON or names, an
  /// index out of range, or a state tensor whose shape differs from its parameter's; the
  /// message lists every mismatch.
  /// `copy` false: a parameter-shaped tensor already on the parameter's device and dtype is
  /// taken as it is (shared, not copied), for a caller that made it for this purpose (a
  /// checkpoint loader reading straight into fresh tensors).
  void load_state_dict(const OptimizerState& state, bool copy = true);

 protected:
  /// Throws ValueError naming this optimizer unless `found_inf` is a float32 tensor of one
  /// element (step_unless's argument).
  void check_found_inf(const Tensor& found_inf) const;
  /// defaults: every option the optimizer knows (a missing "lr" means each group must give
  /// one). flags: the option keys that are booleans (written as JSON booleans). The subclass's
  /// constructor then calls add_param_groups (virtual checks do not reach it from here).
  Optimizer(GroupOptions defaults, std::vector<std::string> flags = {});
  /// add_param_group for each; throws ValueError if `groups` holds no parameter at all.
  void add_param_groups(std::vector<ParamGroup> groups);

  /// Validates one group's complete options; throws ValueError "[Name] ..." naming the group.
  virtual void check_options(const GroupOptions& options, size_t group_index) const = 0;
  /// Whether state `key` has the parameter's shape (checked on load, converted to its dtype).
  virtual bool is_param_shaped(const std::string& key) const { return key != "step"; }

  /// The mutable state of a parameter (created empty on first use).
  NamedTensors& mutable_state(const Tensor& param) { return state_[param.impl()]; }
  /// The tensor `key` of a state, or nullptr.
  static Tensor* find(NamedTensors& state, const std::string& key);

 private:
  std::vector<ParamGroup> groups_;
  GroupOptions defaults_;
  std::vector<std::string> flags_;
  std::unordered_map<const TensorImpl*, NamedTensors> state_;
};

}  // namespace ember::nn::optim
