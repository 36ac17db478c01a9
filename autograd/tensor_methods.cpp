// The autograd methods declared on Tensor (tensor/tensor.h), defined here so that the tensor
// library does not depend on autograd.
#include <algorithm>

#include <ember/autograd/engine.h>
#include <ember/autograd/node.h>
#include <ember/tensor/detail/record.h>

namespace ember {

using autograd::AutogradError;
using autograd::AutogradMeta;
using autograd::ensure_meta;
using autograd::meta_of;

Tensor& Tensor::requires_grad_(bool requires_grad) {
  detail::check_defined("requires_grad_", *this, "self");
  AutogradMeta* m = meta_of(*this);
  if (m != nullptr && m->grad_fn) {
    if (requires_grad) return *this;
    throw AutogradError(detail::str_cat(
        "[requires_grad_] you can only change requires_grad of leaf tensors; this tensor was "
        "made by ", m->grad_fn->name(), ". Use detach() to get a tensor that does not require "
        "grad"));
  }
  if (requires_grad) {
    EMBER_CHECK_TYPE(TypeError, is_floating_point(), "[requires_grad_] only tensors of floating "
                     "point dtype can require gradients, got dtype ", dtype());
  } else if (m == nullptr) {
    return *this;
  }
  AutogradMeta& mm = ensure_meta(*this);
  mm.leaf_requires_grad = requires_grad;
  mm.refresh();
  return *this;
}

bool Tensor::is_leaf() const {
  const AutogradMeta* m = meta_of(*this);
  return m == nullptr || !m->grad_fn;
}

Tensor Tensor::grad() const {
  const AutogradMeta* m = meta_of(*this);
  return m ? m->grad : Tensor();
}

void Tensor::set_grad(const Tensor& g) const {
  detail::check_defined("set_grad", *this, "self");
  if (g.defined()) {
    EMBER_CHECK(g.shape() == shape(), "[set_grad] assigned grad has shape ", g.shape(),
                " but the tensor has shape ", shape());
    EMBER_CHECK_TYPE(TypeError, g.dtype() == dtype(), "[set_grad] assigned grad has dtype ",
                     g.dtype(), " but the tensor has dtype ", dtype());
    EMBER_CHECK(g.device() == device(), "[set_grad] assigned grad is on ", g.device(),
                " but the tensor is on ", device());
  } else if (meta_of(*this) == nullptr) {
    return;
  }
  ensure_meta(*this).grad = g;
}

std::shared_ptr<autograd::Node> Tensor::grad_fn() const {
  const AutogradMeta* m = meta_of(*this);
  return m ? m->grad_fn : nullptr;
}

uint32_t Tensor::output_nr() const {
  const AutogradMeta* m = meta_of(*this);
  return m ? m->output_nr : 0;
}

void Tensor::backward(const Tensor& gradient, std::optional<bool> retain_graph,
                      bool create_graph, const std::vector<Tensor>& inputs) const {
  autograd::backward({*this}, gradient.defined() ? std::vector<Tensor>{gradient}
                                                  : std::vector<Tensor>{},
                     retain_graph, create_graph, inputs);
}

void Tensor::retain_grad() const {
  detail::check_defined("retain_grad", *this, "self");
  AutogradMeta* m = meta_of(*this);
  EMBER_CHECK(m != nullptr && m->requires_grad, "[retain_grad] can't retain_grad on a tensor "
              "that does not require grad");
  if (!m->grad_fn || m->retains_grad) return;  // leaves keep their grad anyway
  autograd::attach_retain_grad(*this);
  m->retains_grad = true;
}

bool Tensor::retains_grad() const {
  const AutogradMeta* m = meta_of(*this);
  return m != nullptr && m->retains_grad;
}

unsigned Tensor::register_hook(std::function<Tensor(const Tensor&)> hook) const {
  detail::check_defined("register_hook", *this, "self");
  AutogradMeta* m = meta_of(*this);
  EMBER_CHECK(m != nullptr && m->requires_grad, "[register_hook] cannot register a hook on a "
              "tensor that doesn't require gradient");
  if (m->grad_fn) {
    const unsigned h = m->grad_fn->add_pre_hook(m->output_nr, std::move(hook));
    m->node_hooks.emplace_back(h, m->grad_fn);
    return h;
  }
  const unsigned h = autograd::new_hook_handle();
  m->hooks.emplace_back(h, std::move(hook));
  return h;
}

void Tensor::remove_hook(unsigned handle) const {
  AutogradMeta* m = meta_of(*this);
  if (m == nullptr) return;
  // A non-leaf's hook is removed from the node it was registered on, which an in-place op may
  // since have replaced as grad_fn. Handles are unique in the process.
  for (auto it = m->node_hooks.begin(); it != m->node_hooks.end(); ++it) {
    if (it->first != handle) continue;
    if (auto node = it->second.lock()) node->remove_pre_hook(handle);
    m->node_hooks.erase(it);
    return;
  }
  std::erase_if(m->hooks, [&](const auto& p) { return p.first == handle; });
  std::erase_if(m->post_accumulate_hooks, [&](const auto& p) { return p.first == handle; });
}

unsigned Tensor::register_post_accumulate_grad_hook(std::function<void(const Tensor&)> hook) const {
  detail::check_defined("register_post_accumulate_grad_hook", *this, "self");
  AutogradMeta* m = meta_of(*this);
  EMBER_CHECK(m != nullptr && m->leaf_requires_grad && !m->grad_fn,
              "[register_post_accumulate_grad_hook] post-accumulate-grad hooks can only be "
              "registered on leaf tensors that require grad");
  const unsigned h = autograd::new_hook_handle();
  m->post_accumulate_hooks.emplace_back(
      h, std::make_shared<const std::function<void(const Tensor&)>>(std::move(hook)));
  return h;
}

Tensor Tensor::detach() const {
  detail::check_defined("detach", *this, "self");
  Tensor d = detail::make_view(*this, shape(), strides(), storage_offset());
  d.impl()->is_view = impl()->is_view;  // a detached view is still a view of its base
  return d;
}

Tensor& Tensor::detach_() {
  detail::check_defined("detach_", *this, "self");
  impl()->autograd.reset();
  return *this;
}

}  // namespace ember
