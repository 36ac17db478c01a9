// Custom differentiable functions: the user supplies forward and backward.
//
//   struct Cube : autograd::Function<Cube> {
//     static Tensor forward(autograd::Context* ctx, const Tensor& x) {
//       ctx->save_for_backward({x});
//       return x * x * x;
//     }
//     static autograd::TensorList backward(autograd::Context* ctx, autograd::TensorList g) {
//       const Tensor x = ctx->saved()[0];
//       return {g[0] * 3 * x * x};
//     }
//   };
//   Tensor y = Cube::apply(x);
//
// forward runs with grad mode off and may take any arguments; its Tensor arguments are the
// function's differentiable inputs, in order. It returns a Tensor or a std::vector<Tensor>.
// backward gets one gradient per output (zeros where an output got no gradient) and returns
// one gradient per Tensor argument (an undefined Tensor means zero / not needed).
#pragma once

#include <any>
#include <memory>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ember/autograd/node.h>
#include <ember/tensor/grad_mode.h>

namespace ember::autograd {

/// What forward leaves for backward.
class Context {
 public:
  /// Tensors backward needs; they are checked for in-place changes when backward reads them.
  void save_for_backward(std::vector<Tensor> tensors);
  /// The saved tensors (throws if one was modified in place or the graph was freed).
  TensorList saved() const;
  /// Anything else backward needs (sizes, flags, scalars), by name. Prefer state<S>().
  std::unordered_map<std::string, std::any> saved_data;
  /// Backward's typed state: one struct S of the function's own, made on first use. forward
  /// and backward of one Function use the same S:
  ///   struct State { std::shared_ptr<dist::ProcessGroup> group; int64_t dim; };
  ///   ctx->state<State>().dim = dim;          // forward
  ///   const State& s = ctx->state<State>();   // backward
  template <typename S>
  S& state() {
    if (!state_) state_ = std::make_shared<S>();
    return *static_cast<S*>(state_.get());
  }
  /// True if the Tensor argument number i (counting Tensor arguments only) needs a gradient.
  bool needs_input_grad(size_t i) const;

 private:
  template <typename T> friend class Function;
  friend class FunctionNode;
  std::vector<Tensor> to_save_;
  std::vector<SavedTensor> saved_;
  std::shared_ptr<void> state_;  // state<S>()'s, typed by the one Function that uses it
  const Node* node_ = nullptr;
};

/// The Node behind every custom function call.
class FunctionNode : public Node {
 public:
  using Backward = TensorList (*)(Context*, TensorList);
  FunctionNode(std::string name, Backward backward);
  const char* name() const override { return name_.c_str(); }
  TensorList apply(TensorList&& grads) override;
  void release_variables() override;
  Context ctx;

  /// Wires the call into the graph: next edges from `inputs`, history for `outputs`, and the
  /// tensors forward asked to save (outputs among them are saved as outputs).
  static void finish(const std::shared_ptr<FunctionNode>& node,
                     const std::vector<const Tensor*>& inputs, std::vector<Tensor>& outputs);

 private:
  std::string name_;
  Backward backward_;
};

/// Demangled type name + "Backward", for error messages.
std::string function_name(const char* mangled);

namespace detail_fn {
template <typename A>
void collect(std::vector<const Tensor*>& out, const A& a) {
  if constexpr (std::is_same_v<std::decay_t<A>, Tensor>) out.push_back(&a);
}
inline std::vector<Tensor> as_list(Tensor t) { return {std::move(t)}; }
inline std::vector<Tensor> as_list(std::vector<Tensor> v) { return v; }
}  // namespace detail_fn

template <typename T>
class Function {
 public:
  template <typename... Args>
  static auto apply(Args&&... args) {
    std::vector<const Tensor*> inputs;
    (detail_fn::collect(inputs, args), ...);
    auto node = std::make_shared<FunctionNode>(function_name(typeid(T).name()), &T::backward);
    bool record = GradMode::is_enabled();
    if (record) {
      record = false;
      for (const Tensor* t : inputs) record = record || (t->defined() && t->requires_grad());
    }
    if (record) collect_next_edges(*node, inputs.data(), inputs.size());
    using Result = decltype(T::forward(&node->ctx, std::forward<Args>(args)...));
    Result result;
    {
      GradModeGuard no_grad(false);
      result = T::forward(&node->ctx, std::forward<Args>(args)...);
    }
    if (!record) return result;
    std::vector<Tensor> outs = detail_fn::as_list(std::move(result));
    FunctionNode::finish(node, inputs, outs);
    if constexpr (std::is_same_v<Result, Tensor>) {
      return outs[0];
    } else {
      return outs;
    }
  }
};

}  // namespace ember::autograd
