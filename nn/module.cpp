#include <ember/nn/module.h>

#include <algorithm>
#include <sstream>

#include <ember/autograd/node.h>

namespace ember::nn {

Tensor Module::forward(const Tensor&) {
  throw NotImplementedError(detail::str_cat("[", name(), "] has no forward(Tensor); call its own "
                                            "methods, or override forward to use it in a "
                                            "Sequential"));
}

Module::~Module() = default;

// ---- forward hooks ----------------------------------------------------------------------------

struct Module::Hooks {
  std::vector<std::pair<unsigned, ForwardPreHook>> pre;
  std::vector<std::pair<unsigned, ForwardHook>> post;
  unsigned next = 0;
  ForwardOverride forward;  // set_forward_override's
};

void Module::set_forward_override(ForwardOverride fn) {
  if (!hooks_) hooks_ = std::make_shared<Hooks>();
  hooks_->forward = std::move(fn);
}

bool Module::has_forward_override() const { return hooks_ && hooks_->forward; }

unsigned Module::register_forward_pre_hook(ForwardPreHook hook) {
  EMBER_CHECK(hook != nullptr, "[register_forward_pre_hook] ", name(), ": the hook is empty");
  if (!hooks_) hooks_ = std::make_shared<Hooks>();
  hooks_->pre.emplace_back(hooks_->next, std::move(hook));
  return hooks_->next++;
}

unsigned Module::register_forward_hook(ForwardHook hook) {
  EMBER_CHECK(hook != nullptr, "[register_forward_hook] ", name(), ": the hook is empty");
  if (!hooks_) hooks_ = std::make_shared<Hooks>();
  hooks_->post.emplace_back(hooks_->next, std::move(hook));
  return hooks_->next++;
}

void Module::remove_forward_hook(unsigned handle) {
  if (!hooks_) return;
  std::erase_if(hooks_->pre, [&](const auto& h) { return h.first == handle; });
  std::erase_if(hooks_->post, [&](const auto& h) { return h.first == handle; });
}

std::vector<Tensor> Module::call(
    std::vector<Tensor> inputs, const std::function<std::vector<Tensor>(std::vector<Tensor>&)>& fn) {
  if (!hooks_) return fn(inputs);
  // Snapshots: a hook may add or remove hooks while it runs.
  const auto pre = hooks_->pre;
  for (const auto& [h, hook] : pre) hook(*this, inputs);
  std::vector<Tensor> outputs = fn(inputs);
  const auto post = hooks_->post;
  for (const auto& [h, hook] : post) hook(*this, inputs, outputs);
  return outputs;
}

std::vector<Tensor> Module::forward_many(const std::vector<Tensor>& inputs) {
  if (inputs.size() != 1) {
    throw ValueError(detail::str_cat(
        "[", name(), "] was called with ", inputs.size(), " tensors, but its forward takes one; "
        "override forward_many(const std::vector<Tensor>&) for a forward of several"));
  }
  if (hooks_ && hooks_->forward) return {hooks_->forward(*this, inputs[0])};
  return {forward(inputs[0])};
}

std::vector<Tensor> Module::operator()(std::vector<Tensor> inputs) {
  return call(std::move(inputs), [this](std::vector<Tensor>& in) { return forward_many(in); });
}

Tensor Module::call_with_hooks(const Tensor& input) {
  std::vector<Tensor> out = call({input}, [this](std::vector<Tensor>& in) {
    EMBER_CHECK(in.size() == 1, "[", name(), "] a forward pre-hook left ", in.size(),
                " inputs; forward(Tensor) takes 1");
    if (hooks_->forward) return std::vector<Tensor>{hooks_->forward(*this, in[0])};
    return std::vector<Tensor>{forward(in[0])};
  });
  EMBER_CHECK(out.size() == 1, "[", name(), "] a forward hook left ", out.size(),
              " outputs; forward(Tensor) returns 1");
  return out[0];
}

// ---- registration -----------------------------------------------------------------------------

namespace {
void check_name(const char* what, const std::string& name) {
  EMBER_CHECK(!name.empty() && name.find('.') == std::string::npos, "[register_", what, "] ",
              what, " name must be non-empty and contain no '.', got '", name, "'");
}
}  // namespace

Tensor& Module::register_parameter(const std::string& name, Tensor t, bool requires_grad) {
  check_name("parameter", name);
  for (const Slot& s : params_) {
    EMBER_CHECK(s.name != name, "[register_parameter] ", this->name(), " already has a parameter '",
                name, "'");
  }
  if (t.defined() && requires_grad) t.requires_grad_();
  params_.push_back({name, std::move(t), true});
  return params_.back().tensor;
}

Tensor& Module::register_buffer(const std::string& name, Tensor t, bool persistent) {
  check_name("buffer", name);
  for (const Slot& s : buffers_) {
    EMBER_CHECK(s.name != name, "[register_buffer] ", this->name(), " already has a buffer '",
                name, "'");
  }
  buffers_.push_back({name, std::move(t), persistent});
  return buffers_.back().tensor;
}

void Module::set_parameter(const std::string& name, Tensor t) {
  auto it = std::find_if(params_.begin(), params_.end(), [&](const Slot& s) { return s.name == name; });
  EMBER_CHECK(it != params_.end(), "[set_parameter] ", this->name(), " has no parameter '", name,
              "'");
  EMBER_CHECK(t.defined(), "[set_parameter] ", this->name(), ".", name,
              ": expected a defined tensor, got an undefined one");
  if (!t.requires_grad()) t.requires_grad_();
  on_parameter_set(name, t);
  it->tensor = std::move(t);
}

void Module::on_parameter_set(const std::string& name, const Tensor&) {
  throw NotImplementedError(detail::str_cat(
      "[set_parameter] ", this->name(), " does not support replacing its parameter '", name,
      "': it keeps its parameters in member handles that would go stale (override "
      "Module::on_parameter_set to update them)"));
}

void Module::add_child(const std::string& name, std::shared_ptr<Module> m) {
  check_name("module", name);
  EMBER_CHECK(m != nullptr, "[register_module] module '", name, "' is null");
  for (const auto& [n, c] : children_) {
    EMBER_CHECK(n != name, "[register_module] ", this->name(), " already has a submodule '", name,
                "'");
  }
  children_.emplace_back(name, std::move(m));
}

// ---- access -----------------------------------------------------------------------------------

void Module::collect(const std::string& prefix, bool recurse, bool params, NamedTensors& out,
                     std::vector<const TensorImpl*>& seen) const {
  for (const Slot& s : params ? params_ : buffers_) {
    if (!s.tensor.defined()) continue;
    if (std::find(seen.begin(), seen.end(), s.tensor.impl()) != seen.end()) continue;
    seen.push_back(s.tensor.impl());
    out.emplace_back(prefix + s.name, s.tensor);
  }
  if (!recurse) return;
  for (const auto& [n, c] : children_) c->collect(prefix + n + ".", true, params, out, seen);
}

NamedTensors Module::named_parameters(bool recurse) const {
  NamedTensors out;
  std::vector<const TensorImpl*> seen;
  collect("", recurse, true, out, seen);
  return out;
}

std::vector<Tensor> Module::parameters(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& [n, t] : named_parameters(recurse)) out.push_back(t);
  return out;
}

NamedTensors Module::named_buffers(bool recurse) const {
  NamedTensors out;
  std::vector<const TensorImpl*> seen;
  collect("", recurse, false, out, seen);
  return out;
}

std::vector<Tensor> Module::buffers(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& [n, t] : named_buffers(recurse)) out.push_back(t);
  return out;
}

std::vector<std::shared_ptr<Module>> Module::children() const {
  std::vector<std::shared_ptr<Module>> out;
  for (const auto& [n, c] : children_) out.push_back(c);
  return out;
}

std::vector<std::pair<std::string, std::shared_ptr<Module>>> Module::named_children() const {
  return children_;
}

std::vector<std::pair<std::string, std::shared_ptr<Module>>> Module::named_modules() {
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> out;
  std::shared_ptr<Module> self = weak_from_this().lock();
  EMBER_CHECK(self != nullptr, "[named_modules] ", name(), " is not owned by a std::shared_ptr; "
              "create modules with std::make_shared to list them as shared pointers");
  out.emplace_back("", std::move(self));
  for (const auto& [n, c] : children_) {
    for (auto& [sub, m] : c->named_modules()) out.emplace_back(sub.empty() ? n : n + "." + sub, m);
  }
  return out;
}

std::vector<std::shared_ptr<Module>> Module::modules() {
  std::vector<std::shared_ptr<Module>> out;
  for (auto& [n, m] : named_modules()) out.push_back(m);
  return out;
}

Tensor& Module::tensor(const std::string& name) {
  for (Slot& s : params_) {
    if (s.name == name) return s.tensor;
  }
  for (Slot& s : buffers_) {
    if (s.name == name) return s.tensor;
  }
  throw ValueError(detail::str_cat("[Module::tensor] ", this->name(),
                                   " has no parameter or buffer '", name, "'"));
}

void Module::apply(const std::function<void(Module&)>& fn) {
  for (const auto& [n, c] : children_) c->apply(fn);
  fn(*this);
}

void Module::train(bool on) {
  training_ = on;
  for (const auto& [n, c] : children_) c->train(on);
}

// ---- conversion -------------------------------------------------------------------------------

namespace {
/// Makes `t`'s own TensorImpl hold `v`'s data (same handle, new storage/dtype/device).
void assign_in_place(const Tensor& t, const Tensor& v) {
  TensorImpl* impl = t.impl();
  impl->storage = v.storage();
  impl->sizes = v.shape();
  impl->strides = v.strides();
  impl->offset = v.storage_offset();
  impl->dtype = v.dtype();
  impl->refresh();
}
}  // namespace

void set_data(const Tensor& t, const Tensor& data) {
  EMBER_CHECK(t.defined() && data.defined(), "[set_data] expected defined tensors");
  NoGradGuard no_grad;
  assign_in_place(t, data.is_same(t) ? data.clone() : data);
  if (auto* m = autograd::meta_of(t)) {
    m->grad = Tensor();
    std::lock_guard<std::mutex> lock(m->accumulator_mutex);
    m->grad_accumulator.reset();  // its recorded shape/dtype/device are stale
  }
}

void Module::convert(const std::function<Tensor(const Tensor&)>& f, bool floating_only) {
  NoGradGuard no_grad;
  auto one = [&](const Tensor& t) {
    if (!t.defined()) return;
    if (floating_only && !t.is_floating_point()) return;
    const Tensor v = f(t);
    if (v.is_same(t)) return;
    assign_in_place(t, v);
    if (auto* m = autograd::meta_of(t)) {
      if (m->grad.defined()) m->grad = f(m->grad);
      std::lock_guard<std::mutex> lock(m->accumulator_mutex);
      m->grad_accumulator.reset();  // its recorded shape/dtype/device are stale
    }
  };
  std::function<void(Module&)> walk = [&](Module& m) {
    for (Slot& s : m.params_) one(s.tensor);
    for (Slot& s : m.buffers_) one(s.tensor);
    for (auto& [n, c] : m.children_) walk(*c);
  };
  walk(*this);
}

void Module::to(Device device) {
  convert([&](const Tensor& t) { return t.to(device); }, false);
}
void Module::to(Dtype dtype) {
  EMBER_CHECK_TYPE(TypeError, is_floating(dtype), "[Module::to] expected a floating dtype, got ",
                   dtype);
  convert([&](const Tensor& t) { return t.to(dtype); }, true);
}
void Module::to(Device device, Dtype dtype) {
  to(device);
  to(dtype);
}

void Module::zero_grad(bool set_to_none) {
  for (const Tensor& p : parameters()) {
    const Tensor g = p.grad();
    if (!g.defined()) continue;
    if (set_to_none) {
      p.set_grad({});
    } else {
      NoGradGuard no_grad;
      Tensor z(g);
      // A gradient built with create_graph carries history: cut it, as Optimizer::zero_grad
      // and PyTorch's Module.zero_grad do, or the next double backward reaches the last graph.
      if (z.requires_grad()) z.detach_();
      z.zero_();
    }
  }
}

// ---- state ------------------------------------------------------------------------------------

NamedTensors Module::state_dict() const {
  // PyTorch's order: each module's parameters, then its persistent buffers, then its children.
  // A tensor shared by two modules appears under both names.
  NamedTensors out;
  std::function<void(const Module&, const std::string&)> walk = [&](const Module& m,
                                                                     const std::string& prefix) {
    for (const Slot& s : m.params_) {
      if (s.tensor.defined()) out.emplace_back(prefix + s.name, s.tensor.detach());
    }
    for (const Slot& s : m.buffers_) {
      if (s.tensor.defined() && s.persistent) out.emplace_back(prefix + s.name, s.tensor.detach());
    }
    for (const auto& [n, c] : m.children_) walk(*c, prefix + n + ".");
  };
  walk(*this, "");
  return out;
}

void Module::load_state_dict(const NamedTensors& state, bool strict) {
  NamedTensors own = state_dict();
  std::vector<std::string> missing, unexpected, mismatched;
  std::vector<std::pair<Tensor, const Tensor*>> copies;
  for (const auto& [name, dst] : own) {
    auto it = std::find_if(state.begin(), state.end(), [&](const auto& p) { return p.first == name; });
    if (it == state.end()) {
      missing.push_back(name);
      continue;
    }
    if (!(it->second.shape() == dst.shape())) {
      mismatched.push_back(detail::str_cat(name, ": checkpoint has shape ", it->second.shape(),
                                           ", the module has ", dst.shape()));
      continue;
    }
    copies.emplace_back(dst, &it->second);
  }
  for (const auto& [name, t] : state) {
    if (std::none_of(own.begin(), own.end(), [&](const auto& p) { return p.first == name; })) {
      unexpected.push_back(name);
    }
  }
  auto join = [](const std::vector<std::string>& v) {
    std::string s;
    for (const auto& x : v) s += (s.empty() ? "\"" : ", \"") + x + "\"";
    return s;
  };
  std::string err;
  if (strict && !missing.empty()) err += "\n  missing keys: " + join(missing);
  if (strict && !unexpected.empty()) err += "\n  unexpected keys: " + join(unexpected);
  for (const auto& m : mismatched) err += "\n  size mismatch for " + m;
  if (!err.empty()) {
    throw ValueError(detail::str_cat("[load_state_dict] error(s) loading the state dict into ",
                                     name(), ":", err));
  }
  NoGradGuard no_grad;
  for (auto& [dst, src] : copies) Tensor(dst).copy_(*src);
}

// ---- printing ---------------------------------------------------------------------------------

void Module::print(std::ostream& os, int indent) const {
  os << name() << "(" << extra_repr();
  if (!children_.empty()) {
    os << "\n";
    for (const auto& [n, c] : children_) {
      os << std::string(indent + 2, ' ') << "(" << n << "): ";
      c->print(os, indent + 2);
      os << "\n";
    }
    os << std::string(indent, ' ');
  }
  os << ")";
}

std::string Module::str() const {
  std::ostringstream os;
  print(os, 0);
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Module& m) { return os << m.str(); }

}  // namespace ember::nn
