// Module: the base of every layer and model.
//
// A module owns named parameters (tensors that require grad and that optimizers update),
// named buffers (state that is saved but not trained, e.g. BatchNorm's running mean) and named
// submodules, each kept in registration order, so names and orders are stable:
// `named_parameters()` of a model always lists "0.weight", "0.bias", "2.weight", ... in the
// same order on every rank (DistributedDataParallel relies on that).
//
// Ownership: modules are held by std::shared_ptr (create them with std::make_shared); a parent
// holds its children. Parameters are Tensor handles: the optimizer, the module and the user all
// share the same tensor, and `to()` converts it in place, so handles taken before stay valid.
//
// Threads: a module may be used by one thread at a time.
#pragma once

#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include <ember/autograd/autograd.h>

namespace ember::nn {

/// Named tensors in a fixed order, e.g. a state dict.
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

class Module : public std::enable_shared_from_this<Module> {
 public:
  Module() = default;
  virtual ~Module();
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  /// The module's type name for printing, e.g. "Linear".
  virtual std::string name() const { return "Module"; }
  /// Extra text shown in parentheses when printing, e.g. "in_features=784, out_features=10".
  virtual std::string extra_repr() const { return ""; }

  /// The module's computation for modules that map one tensor to one tensor (all layers in
  /// nn/ do; Sequential needs it). Modules with other signatures add their own methods; calling
  /// this on them throws NotImplementedError.
  virtual Tensor forward(const Tensor& input);
  /// Calls forward(input) between the module's forward hooks (PyTorch's `module(x)`; calling
  /// forward() directly skips the hooks, as `module.forward(x)` does in PyTorch). Containers
  /// call their children this way.
  Tensor operator()(const Tensor& input) {
    return hooks_ ? call_with_hooks(input) : forward(input);
  }

  /// The computation of a module whose forward takes or returns several tensors (an input and
  /// its mask; logits and an auxiliary loss): PyTorch's `forward(*args)` over tensors. The
  /// default serves one-tensor modules: one input goes to forward(input) (or the forward
  /// override) and its output comes back as a one-element list; another count throws
  /// ValueError naming the module. Override it for another signature, e.g.
  ///   std::vector<Tensor> forward_many(const std::vector<Tensor>& in) override {
  ///     Tensor h = encoder->forward(in[0]) * in[1];  // in[1]: the mask
  ///     return {head->forward(h), h.pow(2).mean()};
  ///   }
  virtual std::vector<Tensor> forward_many(const std::vector<Tensor>& inputs);
  /// PyTorch's `module(x, mask, ...)`: forward_many between the forward hooks; the outputs as a
  /// list (one element for a module that returns one tensor). `module({x})` is the one-tensor
  /// call above.
  std::vector<Tensor> operator()(std::vector<Tensor> inputs);
  template <typename... More>
  std::vector<Tensor> operator()(const Tensor& first, const Tensor& second, const More&... more) {
    return (*this)(std::vector<Tensor>{first, second, more...});
  }

  // ---- forward hooks (torch's register_forward_pre_hook / register_forward_hook) ----
  /// Runs before forward with the inputs, which it may replace (e.g. cast).
  using ForwardPreHook = std::function<void(Module&, std::vector<Tensor>& inputs)>;
  /// Runs after forward with the inputs and the outputs, which it may replace.
  using ForwardHook = std::function<void(Module&, const std::vector<Tensor>& inputs,
                                         std::vector<Tensor>& outputs)>;
  /// Returns a handle for remove_forward_hook. Hooks run in registration order.
  unsigned register_forward_pre_hook(ForwardPreHook hook);
  unsigned register_forward_hook(ForwardHook hook);
  void remove_forward_hook(unsigned handle);
  /// Runs `fn` instead of forward() when the module is called through operator() (its forward
  /// hooks still around it), as PyTorch's `module.forward = fn`; null restores forward().
  /// dist::parallelize_module uses it to run a layer on its shards. A parent that calls
  /// forward() directly bypasses it, as it bypasses the hooks: call parallelized modules as
  /// (*m)(x).
  using ForwardOverride = std::function<Tensor(Module&, const Tensor& input)>;
  void set_forward_override(ForwardOverride fn);
  /// Whether a forward override is set.
  bool has_forward_override() const;
  /// For a module whose forward takes or returns other than one tensor: runs `fn` (the module's
  /// computation on the tensors it is given) between the forward hooks, e.g.
  ///   auto out = attn->call({q, k, v}, [&](std::vector<Tensor>& in) {
  ///     return std::vector<Tensor>{attn->forward(in[0], in[1], in[2]).output}; });
  std::vector<Tensor> call(std::vector<Tensor> inputs,
                           const std::function<std::vector<Tensor>(std::vector<Tensor>&)>& fn);

  // ---- registration (call from the subclass's constructor) ----
  /// Adds a parameter; it is made to require grad (unless requires_grad is false). An undefined
  /// tensor registers an empty slot (e.g. a Linear without bias), skipped by parameters().
  Tensor& register_parameter(const std::string& name, Tensor t, bool requires_grad = true);
  /// Adds a buffer; non-persistent buffers are left out of state_dict().
  Tensor& register_buffer(const std::string& name, Tensor t, bool persistent = true);
  /// Makes `t` this module's parameter `name` (PyTorch's `module.weight = other.weight`). With
  /// `t` another module's parameter the two modules share one tensor (weight tying, e.g.
  ///   lm_head->set_parameter("weight", embedding->weight);
  /// ): parameters() and named_parameters() list it once, under its first name (so optimizers
  /// and DistributedDataParallel see it once, and its gradient sums both uses), while
  /// state_dict() lists it under both names, as torch does, and load_state_dict() writes the
  /// same tensor twice, so it stays tied. `t` is made to require grad; it may have any shape.
  /// The module's own handle to the parameter (e.g. Linear::weight) is updated through
  /// on_parameter_set(). Throws ValueError if there is no parameter `name` or `t` is undefined,
  /// NotImplementedError if the module does not support replacing parameters.
  void set_parameter(const std::string& name, Tensor t);

  template <typename M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> m) {
    add_child(name, m);
    return m;
  }

  // ---- access ----
  /// Parameters of this module and (if recurse) all submodules, depth first in registration
  /// order, each tensor once even if shared by two submodules.
  std::vector<Tensor> parameters(bool recurse = true) const;
  NamedTensors named_parameters(bool recurse = true) const;
  std::vector<Tensor> buffers(bool recurse = true) const;
  NamedTensors named_buffers(bool recurse = true) const;
  std::vector<std::shared_ptr<Module>> children() const;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> named_children() const;
  /// This module and every submodule, depth first (this one first).
  std::vector<std::shared_ptr<Module>> modules();
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> named_modules();
  /// The parameter or buffer of this module called `name` (no dots); throws if missing.
  Tensor& tensor(const std::string& name);

  /// Calls fn on every submodule (children first, recursively) and then on this module.
  void apply(const std::function<void(Module&)>& fn);

  // ---- modes ----
  /// Training mode (Dropout drops, BatchNorm uses batch statistics) for this module and all
  /// submodules.
  virtual void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }

  // ---- conversion and gradients ----
  /// Converts every parameter, gradient and buffer in place (the same tensor handles now hold
  /// data on `device` / of `dtype`). Integral buffers keep their dtype.
  void to(Device device);
  void to(Dtype dtype);
  void to(Device device, Dtype dtype);
  /// Clears every parameter's gradient (set_to_none), or fills it with zeros.
  void zero_grad(bool set_to_none = true);

  // ---- state ----
  /// Parameters and persistent buffers by dotted name ("features.0.weight"), in order.
  NamedTensors state_dict() const;
  /// Copies the values from `state` into this module's parameters and buffers (converting
  /// dtype and device; shapes must match). strict: every key must match both ways; otherwise
  /// missing and unexpected keys are ignored. Throws ValueError listing all missing and
  /// unexpected keys and every shape mismatch.
  void load_state_dict(const NamedTensors& state, bool strict = true);

  /// PyTorch-style multi-line description of the module tree.
  std::string str() const;

 protected:
  void add_child(const std::string& name, std::shared_ptr<Module> m);
  /// Called by set_parameter() before the slot changes: a module that keeps its parameters in
  /// member handles (Linear::weight) points the member for `name` at `t` here. The default
  /// throws NotImplementedError, since a member left behind would silently keep the old
  /// tensor in forward; a module that reads its parameters only through tensor(name)
  /// overrides it with an empty body.
  virtual void on_parameter_set(const std::string& name, const Tensor& t);

 private:
  void collect(const std::string& prefix, bool recurse, bool params, NamedTensors& out,
               std::vector<const TensorImpl*>& seen) const;
  void print(std::ostream& os, int indent) const;
  void convert(const std::function<Tensor(const Tensor&)>& f, bool floating_only);
  Tensor call_with_hooks(const Tensor& input);

  struct Hooks;  // module.cpp; allocated on the first registration, so plain modules pay nothing
  std::shared_ptr<Hooks> hooks_;

  struct Slot {
    std::string name;
    Tensor tensor;
    bool persistent = true;
  };
  std::vector<Slot> params_;
  std::vector<Slot> buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  bool training_ = true;
};

std::ostream& operator<<(std::ostream& os, const Module& m);

/// Makes `t`, and so every handle to it, hold `data`'s values, shape, dtype and device (PyTorch's
/// `t.data = data`): `t` keeps its autograd state (requires_grad, hooks); its gradient is
/// dropped. For code that re-lays out a model's parameters in place, as dist::parallelize_module
/// does when it shards them. Throws ValueError for an undefined tensor.
void set_data(const Tensor& t, const Tensor& data);

}  // namespace ember::nn
