// Nodes, saved tensors, leaf accumulation and the helpers that wire a recorded op into the graph.
#include <ember/autograd/node.h>

#include <algorithm>
#include <atomic>
#include <limits>

#include <ember/tensor/detail/record.h>
#include <ember/tensor/ops.h>

namespace ember::autograd {

namespace {
std::atomic<uint64_t> g_next_sequence_nr{0};

constexpr const char* kFreedHint =
    "Saved intermediate values of the graph are freed when you call backward() or "
    "autograd::grad(); specify retain_graph=true on the first call if you need to backward "
    "through the graph a second time or to read saved tensors after backward.";

/// A new TensorImpl over t's storage and geometry, without autograd state.
Tensor alias(const Tensor& t) {
  return detail::make_view(t, t.shape(), t.strides(), t.storage_offset());
}
}  // namespace

std::string describe(const Tensor& t) {
  if (!t.defined()) return "[undefined tensor]";
  return detail::str_cat("[", t.dtype(), " tensor of shape ", t.shape(),
                         t.is_cpu() ? "" : detail::str_cat(" on ", t.device()), "]");
}

// ---- SavedTensor ------------------------------------------------------------------------------

SavedTensor::SavedTensor(const Tensor& t, bool is_output) : is_output_(is_output) {
  if (!t.defined()) return;
  version_ = t.version();
  if (is_output) {
    data_ = alias(t);
    if (const AutogradMeta* m = meta_of(t)) output_nr_ = m->output_nr;
  } else {
    data_ = t;
  }
}

Tensor SavedTensor::unpack(const Node& owner) const {
  if (released_) {
    throw AutogradError(detail::str_cat(
        "[backward] trying to backward through the graph a second time (", owner.name(),
        " has already freed its saved tensors). ", kFreedHint));
  }
  if (!data_.defined()) return data_;
  if (data_.version() != version_) {
    throw AutogradError(detail::str_cat(
        "[backward] one of the tensors needed for gradient computation has been modified by an "
        "in-place operation: ", describe(data_), ", which is ",
        is_output_ ? detail::str_cat("output ", output_nr_) : std::string("an input"), " of ",
        owner.name(), ", is at version ", data_.version(), "; expected version ", version_,
        " instead.\n  Hint: use the out-of-place op, or clone() the tensor before changing it."));
  }
  if (is_output_ && GradMode::is_enabled()) {
    // create_graph: give the output its history back so the backward formula is differentiable.
    Tensor t = alias(data_);
    AutogradMeta& m = ensure_meta(t);
    m.grad_fn = std::const_pointer_cast<Node>(owner.shared_from_this());
    m.output_nr = output_nr_;
    m.refresh();
    return t;
  }
  return data_;
}

void SavedTensor::release() {
  if (!data_.defined()) return;
  data_ = Tensor();
  released_ = true;
}

// ---- Node -------------------------------------------------------------------------------------

Node::Node() : sequence_nr_(g_next_sequence_nr.fetch_add(1, std::memory_order_relaxed)) {}
Node::Node(uint64_t sequence_nr) : sequence_nr_(sequence_nr) {}
// Note [Iterative graph teardown]
// A node owns its next nodes, so dropping the last reference to a long chain (an RNN unrolled
// over 100k steps) would destroy it recursively, one stack frame per node, and overflow the
// stack. Instead, a dying node hands next nodes that it alone keeps alive to a per-thread list,
// and the outermost destructor releases them one at a time.
namespace {
thread_local std::vector<std::shared_ptr<Node>> t_graveyard;
thread_local bool t_draining = false;
}  // namespace

Node::~Node() {
  for (Edge& e : next_edges_) {
    if (e.fn && e.fn.use_count() == 1) t_graveyard.push_back(std::move(e.fn));
  }
  if (t_draining) return;
  t_draining = true;
  while (!t_graveyard.empty()) {
    std::shared_ptr<Node> n = std::move(t_graveyard.back());
    t_graveyard.pop_back();
    n.reset();
  }
  t_draining = false;
}

unsigned new_hook_handle() {
  static std::atomic<unsigned> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

unsigned Node::add_pre_hook(uint32_t input_nr, GradHook hook) {
  const unsigned h = new_hook_handle();
  pre_hooks_.push_back({h, input_nr, std::move(hook)});
  return h;
}

void Node::remove_pre_hook(unsigned handle) {
  pre_hooks_.erase(std::remove_if(pre_hooks_.begin(), pre_hooks_.end(),
                                  [&](const PreHook& p) { return p.handle == handle; }),
                   pre_hooks_.end());
}

void Node::set_retain_grad_hook(uint32_t input_nr, std::function<void(const Tensor&)> hook) {
  for (auto& [nr, fn] : retain_hooks_) {
    if (nr == input_nr) {
      fn = std::move(hook);
      return;
    }
  }
  retain_hooks_.emplace_back(input_nr, std::move(hook));
}

void Node::clear_retain_grad_hook(uint32_t input_nr) {
  std::erase_if(retain_hooks_, [&](const auto& e) { return e.first == input_nr; });
}

void attach_retain_grad(const Tensor& t) {
  AutogradMeta& m = *meta_of(t);
  std::weak_ptr<AutogradMetaBase> weak = t.impl()->autograd;
  m.grad_fn->set_retain_grad_hook(m.output_nr, [weak](const Tensor& g) {
    auto base = weak.lock();
    if (!base) return;
    auto* mm = static_cast<AutogradMeta*>(base.get());
    if (!mm->retains_grad) return;
    if (!mm->grad.defined()) {
      mm->grad = GradMode::is_enabled() ? g.clone() : g.detach().clone();  // as AccumulateGrad
    } else if (GradMode::is_enabled()) {
      mm->grad = mm->grad + g;
    } else {
      mm->grad.add_(g);
    }
  });
}

void Node::call_pre_hooks(TensorList& grads) {
  // A snapshot: a hook may register or remove hooks (itself included) while the list runs.
  const std::vector<PreHook> hooks = pre_hooks_;
  for (const PreHook& h : hooks) {
    if (h.input_nr >= grads.size() || !grads[h.input_nr].defined()) continue;
    Tensor r = h.fn(grads[h.input_nr]);
    if (r.defined()) grads[h.input_nr] = std::move(r);
  }
  for (const auto& [nr, fn] : retain_hooks_) {
    if (nr < grads.size() && grads[nr].defined()) fn(grads[nr]);
  }
}

// ---- AccumulateGrad ---------------------------------------------------------------------------

AccumulateGrad::AccumulateGrad(std::shared_ptr<TensorImpl> leaf)
    : Node(std::numeric_limits<uint64_t>::max()), leaf_(std::move(leaf)) {
  const Tensor t(leaf_);
  mutable_grad_meta().push_back({t.shape(), t.dtype(), t.device()});
}

void AccumulateGrad::call_pre_hooks(TensorList& grads) {
  Node::call_pre_hooks(grads);
  AutogradMeta* m = meta_of(Tensor(leaf_));
  if (m == nullptr || !grads[0].defined()) return;
  const auto hooks = m->hooks;  // a snapshot, as above
  for (const auto& [handle, fn] : hooks) {
    Tensor r = fn(grads[0]);
    if (r.defined()) grads[0] = std::move(r);
  }
}

TensorList AccumulateGrad::apply(TensorList&& grads) {
  Tensor g = std::move(grads[0]);
  if (!g.defined()) return {};
  const Tensor leaf(leaf_);
  std::lock_guard<std::mutex> lock(mutex_);
  AutogradMeta& m = ensure_meta(leaf);
  if (!m.grad.defined()) {
    if (GradMode::is_enabled()) {
      // create_graph: a copy that keeps the gradient's history. g itself may be another
      // tensor's gradient too (an add hands one tensor to both inputs) or the caller's, and a
      // later backward accumulates into .grad in place (PyTorch's AccumulateGrad clones too).
      m.grad = g.clone();
    } else if (g.is_contiguous() && g.impl_ptr().use_count() == 1 &&
               g.storage().use_count() == 1 && !g.requires_grad()) {
      m.grad = std::move(g);  // nobody else sees this buffer: take it without a copy
    } else {
      m.grad = g.detach().clone();
    }
  } else if (GradMode::is_enabled()) {
    m.grad = m.grad + g;
  } else {
    m.grad.add_(g);
  }
  if (!m.post_accumulate_hooks.empty()) {
    // A hook may remove hooks of this tensor (itself included): run a snapshot of the list.
    SmallVec<std::shared_ptr<const std::function<void(const Tensor&)>>, 2> hooks;
    for (const auto& entry : m.post_accumulate_hooks) hooks.push_back(entry.second);
    for (const auto& fn : hooks) (*fn)(leaf);
  }
  return {};
}

// ---- wiring -----------------------------------------------------------------------------------

AutogradMeta& ensure_meta(const Tensor& t) {
  auto& slot = t.impl()->autograd;
  if (!slot) slot = std::make_shared<AutogradMeta>();
  return *static_cast<AutogradMeta*>(slot.get());
}

Edge gradient_edge(const Tensor& t) {
  AutogradMeta* m = meta_of(t);
  if (m == nullptr) return {};
  if (m->grad_fn) {
    if (m->is_view && t.version() != m->view_version) {
      throw NotImplementedError(detail::str_cat(
          "[autograd] ", describe(t), " is a view (made by ", m->grad_fn->name(),
          ") whose data was modified in place after the view was taken; its recorded history "
          "no longer describes its values. Take the view again after the in-place operation"));
    }
    return {m->grad_fn, m->output_nr};
  }
  if (!m->leaf_requires_grad) return {};
  std::lock_guard<std::mutex> lock(m->accumulator_mutex);
  std::shared_ptr<Node> acc = m->grad_accumulator.lock();
  if (!acc) {
    acc = std::make_shared<AccumulateGrad>(t.impl_ptr());
    m->grad_accumulator = acc;
  }
  return {std::move(acc), 0};
}

void collect_next_edges(Node& node, const Tensor* const* inputs, size_t n_inputs) {
  auto& edges = node.mutable_next_edges();
  edges.reserve(edges.size() + n_inputs);
  for (size_t i = 0; i < n_inputs; ++i) {
    const Tensor* t = inputs[i];
    edges.push_back(t != nullptr && t->defined() ? gradient_edge(*t) : Edge{});
  }
}

void set_history(const std::shared_ptr<Node>& node, Tensor* const* outputs, size_t n_outputs) {
  auto& gm = node->mutable_grad_meta();
  gm.resize(n_outputs);
  for (size_t i = 0; i < n_outputs; ++i) {
    Tensor& out = *outputs[i];
    if (!out.defined()) continue;
    gm[i] = {out.shape(), out.dtype(), out.device()};
    if (!out.is_floating_point()) continue;
    AutogradMeta& m = ensure_meta(out);
    // An in-place op gives the tensor a new grad_fn: a retained gradient is then the new
    // value's, so the retain_grad hook moves to the new node (PyTorch's too).
    const std::shared_ptr<Node> retained_on = m.retains_grad ? m.grad_fn : nullptr;
    const uint32_t retained_nr = m.output_nr;
    m.grad_fn = node;
    m.output_nr = static_cast<uint32_t>(i);
    m.leaf_requires_grad = false;
    m.grad_accumulator.reset();
    m.refresh();
    // The history now describes the data as it is (an in-place op on a view that nobody else
    // holds, Note [In-place ops on views] in record.cpp).
    if (m.is_view) m.view_version = out.version();
    if (retained_on && retained_on != node) {
      retained_on->clear_retain_grad_hook(retained_nr);
      attach_retain_grad(out);
    }
  }
}

}  // namespace ember::autograd
