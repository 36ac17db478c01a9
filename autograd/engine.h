// The backward engine and the functions users call: backward(), grad(), queue_callback().
#pragma once

#include <functional>
#include <optional>
#include <vector>

#include <ember/autograd/node.h>

namespace ember::autograd {

/// Computes the gradients of `tensors` (weighted by `grad_tensors`, which may be omitted for
/// one-element tensors) and accumulates them into the grad() of the graph's leaves. If `inputs`
/// is given, only those leaves accumulate. The graph's saved tensors are freed afterwards unless
/// retain_graph (which defaults to create_graph). With create_graph the backward pass is itself
/// recorded, so the gradients can be differentiated again.
void backward(const std::vector<Tensor>& tensors, const std::vector<Tensor>& grad_tensors = {},
              std::optional<bool> retain_graph = {}, bool create_graph = false,
              const std::vector<Tensor>& inputs = {});

/// The gradients of `outputs` with respect to `inputs`, returned instead of accumulated (no
/// grad() is touched). An input the outputs do not depend on is an error unless allow_unused,
/// in which case its gradient is an undefined tensor.
std::vector<Tensor> grad(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& grad_outputs = {},
                         std::optional<bool> retain_graph = {}, bool create_graph = false,
                         bool allow_unused = false);

/// The weight half of a backward pass that backward_input() split in two.
class WeightGrad {
 public:
  WeightGrad() = default;
  WeightGrad(WeightGrad&&) = default;
  WeightGrad& operator=(WeightGrad&&) = default;
  /// True between backward_input() and run().
  bool pending() const { return pending_; }
  /// Accumulates into the weights' grad() what backward() of the same outputs would have put
  /// there, their hooks included (DistributedDataParallel's reductions start here), and frees
  /// what the first half kept. Runs once; throws AutogradError if nothing is pending.
  void run();

 private:
  friend std::vector<Tensor> backward_input(const std::vector<Tensor>&,
                                            const std::vector<Tensor>&,
                                            const std::vector<Tensor>&,
                                            const std::vector<Tensor>&, WeightGrad&);
  friend class Engine;
  struct Kept {
    std::shared_ptr<Node> node;
    TensorList grads;
  };
  bool pending_ = false;
  std::vector<Kept> kept_;                  ///< where the input and weight paths part
  std::vector<std::shared_ptr<Node>> cut_;  ///< nodes the first half ran
  std::vector<Tensor> weights_;
};

/// The first half of a backward pass split in two (the zero-bubble pipeline schedules'
/// "backward for inputs", then "backward for weights" later to fill the bubble): returns the
/// gradients of `outputs` (weighted by `grad_outputs`, as grad()) with respect to `inputs`, and
/// computes no gradient that only `weights` need (a linear's weight gradient waits). `rest`
/// gets what the second half needs: the gradients arriving at each node where the paths to the
/// inputs and to the weights part, and those nodes' saved tensors. Outputs that do not depend
/// on `inputs` defer the whole pass to rest.run(). `inputs` and `weights` must require grad;
/// leaves other than `weights` get no gradient.
std::vector<Tensor> backward_input(const std::vector<Tensor>& outputs,
                                   const std::vector<Tensor>& grad_outputs,
                                   const std::vector<Tensor>& inputs,
                                   const std::vector<Tensor>& weights, WeightGrad& rest);

/// Runs `callback` once the backward pass running on this thread has finished (all gradients
/// accumulated). Only callable from inside a backward pass (a hook or a node).
void queue_callback(std::function<void()> callback);

/// True while a backward pass runs on this thread.
bool in_backward();

}  // namespace ember::autograd
