// Installs autograd's recording functions into the tensor layer when the library loads.
#include <cstdio>

#include <ember/autograd/detail/functions.h>
#include <ember/tensor/ops.h>

namespace ember::autograd {

namespace {

FactoryTable make_table() {
  FactoryTable t{};
  register_elementwise(t);
  register_reduce(t);
  register_linalg(t);
  register_conv(t);
  register_indexing(t);
  register_views(t);
  register_nn(t);
  return t;
}

const FactoryTable& table() {
  static const FactoryTable t = make_table();
  return t;
}

constexpr bool is_view_op(OpId op) {
  switch (op) {
    case OpId::ViewAs:
    case OpId::Permute:
    case OpId::Slice:
    case OpId::Select:
    case OpId::Split:
    case OpId::Expand:
    case OpId::AsStrided:
      return true;
    default:
      return false;
  }
}

void record(OpId op, const Tensor* const* inputs, size_t n_inputs, Tensor* const* outputs,
            size_t n_outputs, const OpAttrs& attrs) {
  bool any_floating = false;
  for (size_t i = 0; i < n_outputs; ++i) {
    any_floating = any_floating || (outputs[i]->defined() && outputs[i]->is_floating_point());
  }
  if (!any_floating) return;
  const NodeFactory f = table()[static_cast<size_t>(op)];
  EMBER_CHECK_TYPE(NotImplementedError, f != nullptr, "[autograd] no backward rule is registered "
                   "for op #", static_cast<int>(op), "; please report this");
  f(RecordArgs{op, inputs, n_inputs, outputs, n_outputs, attrs});
  if (is_view_op(op)) {
    for (size_t i = 0; i < n_outputs; ++i) {
      if (AutogradMeta* m = meta_of(*outputs[i])) {
        m->is_view = true;
        m->view_version = outputs[i]->version();
      }
    }
  }
}

void check_inplace(const Tensor& self, const char* op) {
  const AutogradMeta* m = meta_of(self);
  if (m != nullptr && m->leaf_requires_grad && !m->grad_fn) {
    throw AutogradError(detail::str_cat(
        "[", op, "] a leaf tensor that requires grad ", describe(self),
        " is being used in an in-place operation; wrap the update in NoGradGuard (as optimizers "
        "do) or work on a clone()"));
  }
  if (self.impl()->is_view && self.storage().use_count() > 1) {
    // Note [In-place ops on views]: PyTorch rewrites the base's history (CopySlices) so that
    // the base, and every other view of it, sees the change. Ember does not track bases yet;
    // recording the op on the view alone would silently give the base no gradient, so refuse.
    // A view whose storage nobody else holds (an op's output reshaped internally, or a view
    // of a temporary) has no base to lose, and is allowed.
    throw NotImplementedError(detail::str_cat(
        "[", op, "] in-place operations on a view are not supported when autograd records "
        "them: ", describe(self), " is a view of another tensor, which would not get the "
        "gradient. Build the result out of place (cat, stack, where, index_add), or clone() the "
        "view first"));
  }
}

const detail::AutogradHooks kHooks{&record, &check_inplace};

struct Installer {
  Installer() { detail::install_autograd_hooks(&kHooks); }
} installer;

}  // namespace

Tensor sum_to(const Tensor& g, const Shape& shape) {
  if (g.shape() == shape) return g;
  const int64_t lead = g.dim() - static_cast<int64_t>(shape.size());
  EMBER_INTERNAL_ASSERT(lead >= 0, "sum_to: shape ", shape, " is not broadcastable to ", g.shape());
  Shape dims;
  for (int64_t d = 0; d < lead; ++d) dims.push_back(d);
  for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) {
    if (shape[d] == 1 && g.size(lead + d) != 1) dims.push_back(lead + d);
  }
  Tensor r = dims.size() == 0 ? g : sum(g, dims, /*keepdim=*/true);
  return lead > 0 || !(r.shape() == shape) ? r.reshape(shape) : r;
}

}  // namespace ember::autograd
