#include <ember/autograd/function.h>

#include <cxxabi.h>

#include <cstdlib>

namespace ember::autograd {

void Context::save_for_backward(std::vector<Tensor> tensors) { to_save_ = std::move(tensors); }

TensorList Context::saved() const {
  EMBER_CHECK(node_ != nullptr, "[Context::saved] saved tensors can only be read in backward");
  TensorList r;
  r.reserve(saved_.size());
  for (const SavedTensor& s : saved_) r.push_back(s.unpack(*node_));
  return r;
}

bool Context::needs_input_grad(size_t i) const {
  return node_ != nullptr && node_->needs_input_grad(i);
}

FunctionNode::FunctionNode(std::string name, Backward backward)
    : name_(std::move(name)), backward_(backward) {}

TensorList FunctionNode::apply(TensorList&& grads) {
  TensorList r = backward_(&ctx, std::move(grads));
  if (r.size() > num_outputs()) {
    // Extra trailing undefined gradients (e.g. for non-differentiable Tensor args) are fine.
    bool extra_defined = false;
    for (size_t i = num_outputs(); i < r.size(); ++i) extra_defined = extra_defined || r[i].defined();
    if (!extra_defined) r.resize(num_outputs());
  }
  if (r.size() != num_outputs()) {
    throw AutogradError(detail::str_cat("[backward] ", name(), " returned ", r.size(),
                                        " gradients, but forward had ", num_outputs(),
                                        " Tensor arguments: return one per Tensor argument (an "
                                        "undefined Tensor where there is none)"));
  }
  return r;
}

void FunctionNode::release_variables() {
  for (SavedTensor& s : ctx.saved_) s.release();
}

void FunctionNode::finish(const std::shared_ptr<FunctionNode>& node,
                          const std::vector<const Tensor*>& inputs, std::vector<Tensor>& outputs) {
  std::vector<Tensor*> outs;
  for (Tensor& o : outputs) {
    detail::check_defined(node->name(), o, "forward's result");
    // An input returned as is gets a new handle, so its own history is left alone.
    for (const Tensor* in : inputs) {
      if (in->defined() && in->is_same(o)) o = o.detach();
    }
    outs.push_back(&o);
  }
  set_history(node, outs.data(), outs.size());
  node->ctx.node_ = node.get();
  for (const Tensor& t : node->ctx.to_save_) {
    bool is_output = false;
    for (const Tensor& o : outputs) is_output = is_output || o.is_same(t);
    node->ctx.saved_.emplace_back(t, is_output);
  }
  node->ctx.to_save_.clear();
  (void)inputs;
}

std::string function_name(const char* mangled) {
  int status = 0;
  char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string name = status == 0 && d != nullptr ? d : mangled;
  std::free(d);
  return name + "Backward";
}

}  // namespace ember::autograd
