// The backward engine.
//
// Note [How a backward pass runs]
// 1. Discover: walk next_edges from the roots once, counting for every node how many edges
//    point at it. The per-pass state (dependency count, gradient buffer, filter flags) lives
//    in the node itself when the node is free, claimed with one compare-and-swap of its
//    task_id_, so discovery allocates nothing per node beyond the gradient buffer. A node
//    another pass owns at the same time (a parameter's accumulator shared by backward passes
//    on two threads, or a reentrant backward from inside a hook) gets its state in this pass's
//    own map instead.
// 2. Filter (only for grad() and backward(inputs=...)): a node runs only if one of the wanted
//    inputs lies below it. Next nodes are always older than the node that points at them
//    (an op's inputs exist before it runs), so one pass in creation order settles this.
// 3. Execute: ready nodes (all incoming gradients summed into their buffer) run newest first,
//    AccumulateGrad before anything else, so leaf gradients (and the post-accumulate hooks
//    DistributedDataParallel hangs its communication on) come as early as possible. Each
//    gradient a node returns is checked against what the next node expects: dtype converted,
//    broadcast dims summed away, anything else an error naming the node.
// 4. Finish: run callbacks queued during the pass, then clear every node's buffer. Without
//    retain_graph each node frees its saved tensors right after it ran.
//
// Note [Split backward]
// backward_input() and WeightGrad::run() are one backward pass in two halves. The input half is
// filtered to the inputs (as grad()), and Node::needs_input_grad asks the pass, so a node on
// the way to the inputs computes only the gradients the pass needs: a linear computes dX and
// leaves dW. Where the paths part (a node the half runs with an edge towards the weights that
// it does not run: the linear's node, whose weight edge leads to the weight's accumulator) it
// keeps the node's incoming gradients and saved tensors. The weight half starts from those
// nodes with those gradients, filtered to the weights; every node the input half ran is cut:
// it does not run again, and nothing is sent to it, so no gradient is counted twice. A root that
// does not lead to the inputs but to a weight is kept whole. Pre-hooks run once, in the half
// that first sees the gradient.
#include <ember/autograd/engine.h>

#include <algorithm>
#include <atomic>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include <ember/autograd/detail/functions.h>
#include <ember/tensor/detail/record.h>
#include <ember/tensor/ops.h>
#include <ember/tensor/observe/trace.h>

namespace ember::autograd {

struct GraphTask {
  uint64_t id = 0;
  bool retain_graph = false;
  bool create_graph = false;
  bool filtered = false;
  std::vector<Node*> nodes;
  std::vector<std::function<void()>> callbacks;
  struct Capture {
    Node* node;
    uint32_t input_nr;
    size_t index;
  };
  std::vector<Capture> captures;
  std::vector<Tensor> captured;
  std::unordered_map<Node*, Node::TaskState> shared;  ///< nodes owned by another pass
  // Note [Split backward]
  WeightGrad* split = nullptr;           ///< the input half: what it keeps goes here
  std::vector<Node*> split_weights;      ///< the input half: the weights' accumulators
  bool resuming = false;                 ///< the weight half: roots are kept gradients
  std::unordered_set<Node*> cut;         ///< the weight half: nodes the input half ran

  bool is_cut(Node* n) const { return !cut.empty() && cut.count(n) != 0; }

  bool contains(Node* n) const {
    return n->task_id_.load(std::memory_order_relaxed) == id || shared.count(n) != 0;
  }
  Node::TaskState& state(Node* n) {
    if (!shared.empty()) {
      auto it = shared.find(n);
      if (it != shared.end()) return it->second;
    }
    return n->task_id_.load(std::memory_order_relaxed) == id ? n->state_ : shared.at(n);
  }
};

namespace {
std::atomic<uint64_t> g_next_task_id{1};
thread_local std::vector<GraphTask*> t_tasks;

/// True if `shape` broadcasts to `target` (so a gradient of shape target sums down to it).
bool expandable_to(const Shape& shape, const Shape& target) {
  const int64_t lead = static_cast<int64_t>(target.size()) - static_cast<int64_t>(shape.size());
  if (lead < 0) return false;
  for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) {
    if (shape[d] != 1 && shape[d] != target[lead + d]) return false;
  }
  return true;
}
}  // namespace

class Engine {
 public:
  static void execute(GraphTask& task, const std::vector<Edge>& roots,
                      std::vector<Tensor> root_grads, const std::vector<Edge>& exec_targets);

 private:
  static bool claim(GraphTask& task, Node* n);
  static void discover(GraphTask& task, const std::vector<Edge>& roots);
  static void filter(GraphTask& task, const std::vector<Edge>& exec_targets);
  static void mark_split(GraphTask& task, const std::vector<Edge>& roots);
  static Tensor validate(Tensor g, const Node& from, size_t index, const Node& to, uint32_t slot);
  static void run(GraphTask& task, Node* n,
                  std::priority_queue<Node*, std::vector<Node*>, bool (*)(Node*, Node*)>& ready);
};

bool Engine::claim(GraphTask& task, Node* n) {
  // Claimed already through the shared map (another pass owned the node then): that pass may
  // have ended since and freed the node, but this pass's state for it stays in the map, where
  // state() looks first; claiming the node's own slot now would give it a second, fresh state.
  if (!task.shared.empty() && task.shared.count(n) != 0) return false;
  uint64_t owner = 0;
  Node::TaskState* st = &n->state_;
  if (!n->task_id_.compare_exchange_strong(owner, task.id, std::memory_order_acq_rel)) {
    if (owner == task.id) return false;
    auto [it, fresh] = task.shared.try_emplace(n);
    if (!fresh) return false;
    st = &it->second;
  }
  st->deps = 0;
  st->buffer.assign(n->num_inputs(), Tensor());
  st->exec = st->reach = !task.filtered;
  st->capture = false;
  st->keep = st->resumed = false;
  task.nodes.push_back(n);
  return true;
}

void Engine::discover(GraphTask& task, const std::vector<Edge>& roots) {
  std::vector<Node*> stack;
  for (const Edge& e : roots) {
    if (claim(task, e.fn.get())) stack.push_back(e.fn.get());
  }
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const Edge& e : n->next_edges_) {
      Node* c = e.fn.get();
      if (c == nullptr) continue;
      if (claim(task, c)) stack.push_back(c);
      ++task.state(c).deps;
    }
  }
}

void Engine::filter(GraphTask& task, const std::vector<Edge>& exec_targets) {
  for (const Edge& e : exec_targets) {
    if (task.contains(e.fn.get())) task.state(e.fn.get()).exec = true;
  }
  for (const GraphTask::Capture& c : task.captures) {
    if (task.contains(c.node)) task.state(c.node).capture = true;
  }
  // Accumulators (and other nodes without next edges) are settled by the marks alone; they
  // sort last by sequence number, so settle them before the pass.
  for (Node* n : task.nodes) {
    Node::TaskState& st = task.state(n);
    st.reach = st.exec || st.capture;
  }
  std::vector<Node*> order = task.nodes;
  std::sort(order.begin(), order.end(),
            [](Node* a, Node* b) { return a->sequence_nr_ < b->sequence_nr_; });
  for (Node* n : order) {
    Node::TaskState& st = task.state(n);
    if (task.is_cut(n)) {  // the weight half: the input half ran it
      st.exec = st.resumed;
      st.reach = false;
      continue;
    }
    if (!st.exec) {
      for (const Edge& e : n->next_edges_) {
        if (e.fn && task.state(e.fn.get()).reach) {
          st.exec = true;
          break;
        }
      }
    }
    st.reach = st.exec || st.capture;
  }
}

void Engine::mark_split(GraphTask& task, const std::vector<Edge>& roots) {
  std::vector<Node*> order = task.nodes;
  std::sort(order.begin(), order.end(),
            [](Node* a, Node* b) { return a->sequence_nr_ < b->sequence_nr_; });
  const std::unordered_set<Node*> weights(task.split_weights.begin(), task.split_weights.end());
  // Nodes with a weight below them; accumulators sort last (see filter), so they seed it.
  std::unordered_set<Node*> to_weights = weights;
  for (Node* n : order) {
    bool below = false;
    for (const Edge& e : n->next_edges_) below = below || (e.fn && to_weights.count(e.fn.get()));
    if (below) to_weights.insert(n);
  }
  for (Node* n : order) {
    Node::TaskState& st = task.state(n);
    if (!st.exec) continue;
    for (const Edge& e : n->next_edges_) {
      if (e.fn && to_weights.count(e.fn.get()) && !task.state(e.fn.get()).exec) st.keep = true;
    }
  }
  for (const Edge& e : roots) {
    Node::TaskState& st = task.state(e.fn.get());
    if (!st.exec && to_weights.count(e.fn.get())) st.keep = true;
  }
}

Tensor Engine::validate(Tensor g, const Node& from, size_t index, const Node& to, uint32_t slot) {
  const GradMeta& m = to.grad_meta()[slot];
  if (g.device() != m.device) {
    throw AutogradError(detail::str_cat("[backward] ", from.name(),
                                        " returned a gradient on the wrong device at index ",
                                        index, ": expected ", m.device, ", got ", g.device()));
  }
  if (!(g.shape() == m.shape)) {
    if (!expandable_to(m.shape, g.shape())) {
      throw AutogradError(detail::str_cat(
          "[backward] ", from.name(), " returned an invalid gradient at index ", index,
          ": got shape ", g.shape(), " but expected shape compatible with ", m.shape));
    }
    g = sum_to(g, m.shape);
  }
  if (g.dtype() != m.dtype) g = g.to(m.dtype);
  return g;
}

void Engine::run(GraphTask& task, Node* n,
                 std::priority_queue<Node*, std::vector<Node*>, bool (*)(Node*, Node*)>& ready) {
  Node::TaskState& st = task.state(n);
  TensorList grads = std::move(st.buffer);
  st.buffer.clear();
  // Hooks run for nodes the pass executes or captures at, as PyTorch's: not for one it only
  // passes through (the split backward's input half reaches the weights' accumulators, whose
  // hooks the weight half runs).
  if (!st.resumed && (st.exec || st.capture)) n->call_pre_hooks(grads);
  if (task.split && st.exec) task.split->cut_.push_back(n->shared_from_this());
  if (st.capture) {
    for (const GraphTask::Capture& c : task.captures) {
      if (c.node == n) task.captured[c.index] = grads[c.input_nr];
    }
  }
  TensorList outs;
  bool any = false;
  for (const Tensor& g : grads) any = any || g.defined();
  if (st.exec && any) {
    const auto& gm = n->grad_meta();
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!grads[i].defined()) grads[i] = zeros(gm[i].shape, TensorOptions(gm[i].dtype).device(gm[i].device));
    }
    if (st.keep) task.split->kept_.push_back({n->shared_from_this(), grads});
    trace::Span span(n->name(), "autograd", {}, trace::Level::Ops);
    outs = n->apply(std::move(grads));
    if (!task.retain_graph && !st.keep) n->release_variables();
    EMBER_INTERNAL_ASSERT(outs.empty() || outs.size() == n->next_edges_.size(), n->name(),
                          " returned ", outs.size(), " gradients for ", n->next_edges_.size(),
                          " inputs");
  } else if (st.keep && any) {
    task.split->kept_.push_back({n->shared_from_this(), std::move(grads)});
  }
  for (size_t i = 0; i < n->next_edges_.size(); ++i) {
    const Edge& e = n->next_edges_[i];
    Node* c = e.fn.get();
    if (c == nullptr) continue;
    Node::TaskState& cs = task.state(c);
    if (i < outs.size() && outs[i].defined() && !task.is_cut(c)) {
      Tensor g = validate(std::move(outs[i]), *n, i, *c, e.input_nr);
      Tensor& slot = cs.buffer[e.input_nr];
      slot = slot.defined() ? slot + g : std::move(g);
    }
    if (--cs.deps == 0) ready.push(c);
  }
}

void Engine::execute(GraphTask& task, const std::vector<Edge>& roots,
                     std::vector<Tensor> root_grads, const std::vector<Edge>& exec_targets) {
  trace::Span span("backward", "autograd");
  task.id = g_next_task_id.fetch_add(1, std::memory_order_relaxed);
  t_tasks.push_back(&task);
  struct Cleanup {
    GraphTask& task;
    ~Cleanup() {
      for (Node* n : task.nodes) {
        if (n->task_id_.load(std::memory_order_relaxed) == task.id) {
          n->state_.buffer.clear();
          n->task_id_.store(0, std::memory_order_release);
        }
      }
      t_tasks.pop_back();
    }
  } cleanup{task};

  discover(task, roots);
  if (task.resuming) {
    for (const Edge& e : roots) task.state(e.fn.get()).resumed = true;
  }
  if (task.filtered) filter(task, exec_targets);
  if (task.split) mark_split(task, roots);
  for (size_t i = 0; i < roots.size(); ++i) {
    Tensor& slot = task.state(roots[i].fn.get()).buffer[roots[i].input_nr];
    Tensor g = validate(std::move(root_grads[i]), *roots[i].fn, i, *roots[i].fn, roots[i].input_nr);
    slot = slot.defined() ? slot + g : std::move(g);
  }
  std::priority_queue<Node*, std::vector<Node*>, bool (*)(Node*, Node*)> ready(
      [](Node* a, Node* b) { return a->sequence_nr_ < b->sequence_nr_; });
  for (const Edge& e : roots) {
    Node::TaskState& st = task.state(e.fn.get());
    if (st.deps == 0) {
      st.deps = -1;  // queued once even if several roots share it
      ready.push(e.fn.get());
    }
  }
  GradModeGuard grad_mode(task.create_graph);
  while (!ready.empty()) {
    Node* n = ready.top();
    ready.pop();
    run(task, n, ready);
  }
  // Callbacks may queue further callbacks.
  for (size_t i = 0; i < task.callbacks.size(); ++i) {
    auto cb = std::move(task.callbacks[i]);
    cb();
  }
}

// ---- public entry points ----------------------------------------------------------------------

namespace {

void make_roots(const char* op, const std::vector<Tensor>& tensors,
                const std::vector<Tensor>& grads, std::vector<Edge>& roots,
                std::vector<Tensor>& root_grads) {
  EMBER_CHECK(!tensors.empty(), "[", op, "] expected at least one output tensor, got none");
  EMBER_CHECK(grads.empty() || grads.size() == tensors.size(), "[", op, "] got ", grads.size(),
              " gradients for ", tensors.size(), " outputs");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    detail::check_defined(op, t, "tensors");
    Edge e = gradient_edge(t);
    if (!e.valid()) {
      throw AutogradError(detail::str_cat("[", op, "] element ", i,
                                          " of tensors does not require grad and does not have "
                                          "a grad_fn"));
    }
    Tensor g = grads.empty() ? Tensor() : grads[i];
    if (!g.defined()) {
      if (t.numel() != 1) {
        throw AutogradError(detail::str_cat(
            "[", op, "] grad can be implicitly created only for one-element outputs; output ", i,
            " has shape ", t.shape(), ": pass a gradient of that shape"));
      }
      g = ones(t.shape(), t.options());
    } else {
      EMBER_CHECK(g.shape() == t.shape(), "[", op, "] mismatch in shape: gradient ", i,
                  " has shape ", g.shape(), " and output ", i, " has shape ", t.shape());
      EMBER_CHECK(g.device() == t.device(), "[", op, "] gradient ", i, " is on ", g.device(),
                  " but output ", i, " is on ", t.device());
    }
    roots.push_back(std::move(e));
    root_grads.push_back(std::move(g));
  }
}

/// Marks `inputs` for capture (grad(), backward_input()); returns their edges, which hold
/// accumulators created here alive for the pass. Throws naming `op` for an input without grad.
std::vector<Edge> capture_inputs(const char* op, const std::vector<Tensor>& inputs,
                                 GraphTask& task) {
  std::vector<Edge> keep;
  for (size_t i = 0; i < inputs.size(); ++i) {
    detail::check_defined(op, inputs[i], "inputs");
    Edge e = gradient_edge(inputs[i]);
    if (!e.valid()) {
      throw AutogradError(
          detail::str_cat("[", op, "] inputs[", i, "] does not require grad; every input must"));
    }
    task.captures.push_back({e.fn.get(), e.input_nr, i});
    keep.push_back(std::move(e));
  }
  task.captured.resize(inputs.size());
  return keep;
}

}  // namespace

void backward(const std::vector<Tensor>& tensors, const std::vector<Tensor>& grad_tensors,
              std::optional<bool> retain_graph, bool create_graph,
              const std::vector<Tensor>& inputs) {
  GraphTask task;
  task.retain_graph = retain_graph.value_or(create_graph);
  task.create_graph = create_graph;
  std::vector<Edge> roots, targets;
  std::vector<Tensor> root_grads;
  make_roots("backward", tensors, grad_tensors, roots, root_grads);
  for (size_t i = 0; i < inputs.size(); ++i) {
    Edge e = gradient_edge(inputs[i]);
    EMBER_CHECK(e.valid() && inputs[i].is_leaf(), "[backward] inputs[", i,
                "] must be a leaf tensor that requires grad");
    targets.push_back(std::move(e));
  }
  task.filtered = !targets.empty();
  Engine::execute(task, roots, std::move(root_grads), targets);
}

std::vector<Tensor> grad(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& grad_outputs,
                         std::optional<bool> retain_graph, bool create_graph,
                         bool allow_unused) {
  EMBER_CHECK(!inputs.empty(), "[grad] expected at least one input, got none");
  GraphTask task;
  task.retain_graph = retain_graph.value_or(create_graph);
  task.create_graph = create_graph;
  task.filtered = true;
  std::vector<Edge> roots;
  std::vector<Tensor> root_grads;
  make_roots("grad", outputs, grad_outputs, roots, root_grads);
  std::vector<Edge> keep = capture_inputs("grad", inputs, task);
  Engine::execute(task, roots, std::move(root_grads), {});
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!task.captured[i].defined() && !allow_unused) {
      throw AutogradError(detail::str_cat(
          "[grad] inputs[", i, "] ", describe(inputs[i]),
          " was not used to compute the outputs (or no gradient reached it); pass "
          "allow_unused=true to get an undefined gradient for it"));
    }
  }
  return std::move(task.captured);
}

std::vector<Tensor> backward_input(const std::vector<Tensor>& outputs,
                                   const std::vector<Tensor>& grad_outputs,
                                   const std::vector<Tensor>& inputs,
                                   const std::vector<Tensor>& weights, WeightGrad& rest) {
  EMBER_CHECK(!rest.pending(),
              "[backward_input] the WeightGrad given still holds the weight half of an earlier "
              "pass: run() it first");
  GraphTask task;
  task.filtered = true;
  task.split = &rest;
  std::vector<Edge> roots;
  std::vector<Tensor> root_grads;
  make_roots("backward_input", outputs, grad_outputs, roots, root_grads);
  std::vector<Edge> keep = capture_inputs("backward_input", inputs, task);
  for (size_t i = 0; i < weights.size(); ++i) {
    detail::check_defined("backward_input", weights[i], "weights");
    Edge e = gradient_edge(weights[i]);
    if (!e.valid() || !weights[i].is_leaf()) {
      throw AutogradError(detail::str_cat("[backward_input] weights[", i,
                                          "] must be a leaf tensor that requires grad"));
    }
    task.split_weights.push_back(e.fn.get());
    keep.push_back(std::move(e));
  }
  try {
    Engine::execute(task, roots, std::move(root_grads), {});
  } catch (...) {
    rest.kept_.clear();
    rest.cut_.clear();
    throw;
  }
  rest.weights_ = weights;
  rest.pending_ = true;
  return std::move(task.captured);
}

void WeightGrad::run() {
  EMBER_CHECK(pending_,
              "[WeightGrad::run] nothing to run: it runs once, after backward_input");
  pending_ = false;
  std::vector<Kept> kept = std::move(kept_);
  std::vector<std::shared_ptr<Node>> cut = std::move(cut_);
  std::vector<Tensor> weights = std::move(weights_);
  kept_.clear();
  cut_.clear();
  weights_.clear();
  if (kept.empty()) return;
  GraphTask task;
  task.filtered = true;
  task.resuming = true;
  for (const auto& n : cut) task.cut.insert(n.get());
  std::vector<Edge> roots, targets;
  std::vector<Tensor> root_grads;
  for (Kept& k : kept) {
    for (size_t i = 0; i < k.grads.size(); ++i) {
      if (!k.grads[i].defined()) continue;
      roots.push_back({k.node, static_cast<uint32_t>(i)});
      root_grads.push_back(std::move(k.grads[i]));
    }
  }
  for (const Tensor& w : weights) targets.push_back(gradient_edge(w));
  Engine::execute(task, roots, std::move(root_grads), targets);
}

bool Node::pass_wants(const Edge& e) const {
  if (t_tasks.empty()) return true;
  GraphTask& t = *t_tasks.back();
  Node* self = const_cast<Node*>(this);
  if (!t.filtered || !t.contains(self) || !t.contains(e.fn.get())) return true;
  return t.state(e.fn.get()).reach;
}

void queue_callback(std::function<void()> callback) {
  EMBER_CHECK(!t_tasks.empty(),
              "[queue_callback] can only be called during a backward pass (from a hook or a "
              "node's backward)");
  t_tasks.back()->callbacks.push_back(std::move(callback));
}

bool in_backward() { return !t_tasks.empty(); }

}  // namespace ember::autograd
