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

/// Runs `callback` once the backward pass running on this thread has finished (all gradients
/// accumulated). Only callable from inside a backward pass (a hook or a node).
void queue_callback(std::function<void()> callback);

/// True while a backward pass runs on this thread.
bool in_backward();

}  // namespace ember::autograd
