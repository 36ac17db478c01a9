// The backward graph: Nodes joined by Edges, and the per-tensor AutogradMeta.
//
// A recorded op makes one Node. Its *inputs* (in autograd's sense) are the gradients of the
// op's outputs; its *outputs* are gradients for the op's inputs, sent along `next_edges()` to
// the nodes that produced those inputs (or to a leaf's AccumulateGrad). A Node holds strong
// references to the next nodes, so a tensor's grad_fn keeps its whole history alive; saved
// tensors are freed by release_variables() after a backward pass without retain_graph.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ember/autograd/small_vec.h>
#include <ember/tensor/error.h>
#include <ember/tensor/tensor.h>

namespace ember::autograd {

/// Misuse of autograd found while building or running the backward graph (PyTorch raises
/// RuntimeError for these): a freed graph, a modified saved tensor, a missing gradient.
class AutogradError : public Error {
 public:
  using Error::Error;
};

using TensorList = std::vector<Tensor>;

/// Where a gradient goes: input slot `input_nr` of node `fn`. An edge without a node means
/// "this input does not need a gradient".
struct Edge {
  std::shared_ptr<Node> fn;
  uint32_t input_nr = 0;
  bool valid() const { return fn != nullptr; }
};

/// What a node knows about each gradient it receives (= each output of the forward op): used to
/// make zeros for missing gradients and to check, cast and un-broadcast incoming gradients.
struct GradMeta {
  Shape shape;
  Dtype dtype = kFloat32;
  Device device;
};

/// A tensor saved for backward. Saving remembers the storage's version; unpacking checks it,
/// so an in-place change to a saved tensor is reported instead of giving a wrong gradient.
/// A node's own outputs are saved without their autograd state (which points back at the node)
/// so that a node and its outputs do not keep each other alive.
class SavedTensor {
 public:
  SavedTensor() = default;
  SavedTensor(const Tensor& t, bool is_output);
  /// The saved tensor. `owner` is the node that saved it (used in error messages and, under
  /// create_graph, to give a saved output its history back).
  Tensor unpack(const Node& owner) const;
  /// Frees the tensor; a later unpack() explains that the graph was already freed.
  void release();
  bool defined() const { return data_.defined() || released_; }

 private:
  Tensor data_;
  uint32_t version_ = 0;
  uint32_t output_nr_ = 0;
  bool is_output_ = false;
  bool released_ = false;
};

/// A gradient hook: sees a gradient, returns a replacement or an undefined tensor to keep it.
using GradHook = std::function<Tensor(const Tensor&)>;

class Node : public std::enable_shared_from_this<Node> {
 public:
  Node();
  virtual ~Node();
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  /// E.g. "MulBackward".
  virtual const char* name() const = 0;
  /// Gradients for the next edges, given the gradients of this node's inputs (one per
  /// grad_meta() entry, zeros filled in where only some are known). An undefined result means
  /// "zero" and is allowed for any edge; results for invalid edges are ignored.
  virtual TensorList apply(TensorList&& grads) = 0;
  /// Frees saved tensors (called after backward unless retain_graph).
  virtual void release_variables() {}

  using EdgeList = SmallVec<Edge, 2>;
  using GradMetaList = SmallVec<GradMeta, 1>;
  const EdgeList& next_edges() const { return next_edges_; }
  EdgeList& mutable_next_edges() { return next_edges_; }
  const Edge& next_edge(size_t i) const { return next_edges_[i]; }
  size_t num_outputs() const { return next_edges_.size(); }
  /// True when the gradient for next edge i is wanted: the edge leads somewhere and, while a
  /// backward pass that wants only some gradients runs this node (grad(), backward(inputs=),
  /// either half of a split backward), the pass needs what lies along it.
  bool needs_input_grad(size_t i) const {
    return i < next_edges_.size() && next_edges_[i].valid() && pass_wants(next_edges_[i]);
  }

  const GradMetaList& grad_meta() const { return grad_meta_; }
  GradMetaList& mutable_grad_meta() { return grad_meta_; }
  size_t num_inputs() const { return grad_meta_.size(); }

  /// Order of creation; the engine runs ready nodes newest first.
  uint64_t sequence_nr() const { return sequence_nr_; }

  /// Hooks on the gradient of this node's input `input_nr` (= the tensor that is output
  /// input_nr of the forward op). Called before apply(). Handles are unique in the process
  /// (new_hook_handle), so a handle never names another tensor's hook.
  unsigned add_pre_hook(uint32_t input_nr, GradHook hook);
  void remove_pre_hook(unsigned handle);
  /// The retain_grad hook runs after all other hooks, on the final gradient.
  void set_retain_grad_hook(uint32_t input_nr, std::function<void(const Tensor&)> hook);
  void clear_retain_grad_hook(uint32_t input_nr);
  /// Runs the hooks on `grads` (replacing entries where a hook returns a tensor).
  virtual void call_pre_hooks(TensorList& grads);

 protected:
  explicit Node(uint64_t sequence_nr);

 private:
  friend class Engine;
  friend struct GraphTask;
  /// Whether the backward pass running on this thread needs the gradient along `e` (true
  /// outside a pass, or for a node the pass does not own: one recorded inside a hook).
  bool pass_wants(const Edge& e) const;
  EdgeList next_edges_;
  GradMetaList grad_meta_;
  uint64_t sequence_nr_;
  struct PreHook {
    unsigned handle;
    uint32_t input_nr;
    GradHook fn;
  };
  std::vector<PreHook> pre_hooks_;
  std::vector<std::pair<uint32_t, std::function<void(const Tensor&)>>> retain_hooks_;

  // State of the backward pass running over this node (Note [How a backward pass runs] in
  // engine.cpp). task_id_ names the pass that owns state_ (0: none); a second pass reaching
  // the node at the same time keeps its state in a map of its own.
  struct TaskState {
    int64_t deps = 0;
    bool exec = true;
    bool reach = true;
    bool capture = false;
    bool keep = false;     ///< split backward, input half: save this node's gradients
    bool resumed = false;  ///< split backward, weight half: gradients saved by the first half
    TensorList buffer;
  };
  std::atomic<uint64_t> task_id_{0};
  TaskState state_;
};

/// Per-tensor autograd state (TensorImpl::autograd).
struct AutogradMeta : AutogradMetaBase {
  Tensor grad;
  std::shared_ptr<Node> grad_fn;
  std::weak_ptr<Node> grad_accumulator;  ///< leaves only; created on first use
  std::mutex accumulator_mutex;           ///< guards grad_accumulator (ops on several threads)
  uint32_t output_nr = 0;
  bool leaf_requires_grad = false;
  bool retains_grad = false;
  bool is_view = false;            ///< output of a recorded view op
  uint32_t view_version = 0;       ///< storage version when the view was made
  std::vector<std::pair<unsigned, GradHook>> hooks;  ///< leaf tensor hooks
  /// A non-leaf's hooks: the node each was registered on, which an in-place op may since have
  /// replaced as grad_fn (remove_hook removes it from there).
  std::vector<std::pair<unsigned, std::weak_ptr<Node>>> node_hooks;
  /// Shared so that a pass runs a snapshot of the list without copying the functions (a hook
  /// may remove hooks while it runs).
  std::vector<std::pair<unsigned, std::shared_ptr<const std::function<void(const Tensor&)>>>>
      post_accumulate_hooks;

  void refresh() { requires_grad = leaf_requires_grad || grad_fn != nullptr; }
};

/// A hook handle no other hook in the process has.
unsigned new_hook_handle();

/// Installs `t`'s retain_grad hook on its grad_fn (retain_grad(); set_history moves it to the
/// node of an in-place op, as PyTorch does).
void attach_retain_grad(const Tensor& t);

/// The tensor's AutogradMeta, or null.
inline AutogradMeta* meta_of(const Tensor& t) {
  return t.defined() ? static_cast<AutogradMeta*>(t.impl()->autograd.get()) : nullptr;
}
/// The tensor's AutogradMeta, created if missing.
AutogradMeta& ensure_meta(const Tensor& t);

/// Accumulates incoming gradients into a leaf's grad() and runs its hooks.
/// Accumulation is serialised per leaf, so backward passes on several threads may share
/// parameters.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(std::shared_ptr<TensorImpl> leaf);
  const char* name() const override { return "AccumulateGrad"; }
  TensorList apply(TensorList&& grads) override;
  void call_pre_hooks(TensorList& grads) override;
  const std::shared_ptr<TensorImpl>& leaf() const { return leaf_; }

 private:
  std::shared_ptr<TensorImpl> leaf_;
  std::mutex mutex_;
};

/// The edge along which a gradient for `t` travels: its grad_fn, or its leaf accumulator
/// (created on first use), or an invalid edge when t does not require grad.
Edge gradient_edge(const Tensor& t);

/// Makes `outputs` the outputs of `node`: fills the node's grad_meta and points each output's
/// autograd state at it (replacing any history an in-place output had).
void set_history(const std::shared_ptr<Node>& node, Tensor* const* outputs, size_t n_outputs);

/// Appends the gradient edges of `inputs` to the node's next edges.
void collect_next_edges(Node& node, const Tensor* const* inputs, size_t n_inputs);

/// Describes `t` for error messages: "[float32 tensor of shape [3]]".
std::string describe(const Tensor& t);

}  // namespace ember::autograd
