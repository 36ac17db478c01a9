#include <ember/nn/activation_checkpoint.h>

#include <functional>
#include <memory>
#include <unordered_set>

#include <ember/autograd/engine.h>
#include <ember/autograd/function.h>
#include <ember/nn/detail/thread_generator.h>
#include <ember/tensor/ops/random.h>
#include <ember/tensor/autocast.h>

namespace ember::nn {

namespace {

constexpr const char* kOp = "checkpoint";

/// A generator position: the same seed and offset give the same draws.
struct RngState {
  uint64_t seed = 0;
  uint64_t offset = 0;
};

RngState rng_state() {
  const Generator::Draw d = default_generator().reserve(0);  // seed and offset read together
  return {d.seed, d.offset};
}

// Note [Checkpoint generators]: the segment's random ops draw from a private generator that
// starts where the calling thread's default one stands, in the forward and again in the
// recomputation, so both see the same numbers (and, on one thread, the numbers an unchecked run
// would draw); the forward then moves the default generator past what the segment drew. The
// shared generator is never rewound: rewinding it (as torch's fork_rng does) let another thread
// that drew in between (a data loader's worker) shift the forward's numbers away from the
// recomputation's, a silently different dropout mask in backward, and handed the other
// thread's numbers out twice.

/// Runs `f` with the calling thread's default generator a private one at `at`; returns how many
/// counter values it drew.
uint64_t run_with_generator_at(const RngState& at, const std::function<void()>& f) {
  Generator local(at.seed);
  local.set_offset(at.offset);
  {
    detail::ThreadGeneratorScope scope(local);
    f();
  }
  return local.offset() - at.offset;
}

/// What forward leaves for backward besides the saved inputs.
struct Segment {
  CheckpointFunction fn;
  bool preserve_rng_state = true;
  RngState rng;
  // The autocast state of the forward call (CPU and CUDA), re-entered for the recomputation so
  // that it runs in the precision the forward ran in (torch's checkpoint does the same).
  struct Autocast {
    Device device;
    bool enabled = false;
    Dtype dtype = kBFloat16;
  };
  std::vector<Autocast> autocast;
  size_t num_outputs = 0;
};

/// fn again, with grad mode on, from the generator position of the forward call (Note
/// [Checkpoint generators]).
std::vector<Tensor> recompute(const Segment& seg, const std::vector<Tensor>& inputs) {
  std::vector<Tensor> out;
  auto run = [&] {
    GradModeGuard grad(true);
    std::vector<std::unique_ptr<AutocastGuard>> amp;
    for (const Segment::Autocast& a : seg.autocast) {
      amp.push_back(std::make_unique<AutocastGuard>(a.device, a.dtype, a.enabled));
    }
    out = seg.fn(inputs);
  };
  if (seg.preserve_rng_state) {
    run_with_generator_at(seg.rng, run);
  } else {
    run();
  }
  return out;
}

/// The leaves below `outputs` in the recomputed graph, other than `inputs`: the parameters fn
/// captured. Returned as their accumulator nodes, which hold them. Every node the
/// recomputation recorded is numbered `first` or later; an older one that is not a leaf's
/// accumulator belongs to the graph outside: fn used a tensor with history that it did not
/// take as an input. Its gradient cannot be delivered (the checkpoint node has no edge to it),
/// and differentiating into that graph here would free it under the enclosing pass: refused.
std::vector<std::shared_ptr<autograd::AccumulateGrad>> captured_leaves(
    const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs, uint64_t first) {
  std::unordered_set<const TensorImpl*> own;
  for (const Tensor& t : inputs) own.insert(t.impl());
  std::unordered_set<const autograd::Node*> seen;
  std::vector<std::shared_ptr<autograd::Node>> stack;
  std::vector<std::shared_ptr<autograd::AccumulateGrad>> leaves;
  for (const Tensor& o : outputs) {
    autograd::Edge e = autograd::gradient_edge(o);
    if (e.valid()) stack.push_back(std::move(e.fn));
  }
  while (!stack.empty()) {
    std::shared_ptr<autograd::Node> n = std::move(stack.back());
    stack.pop_back();
    if (!seen.insert(n.get()).second) continue;
    if (auto acc = std::dynamic_pointer_cast<autograd::AccumulateGrad>(n)) {
      if (own.count(acc->leaf().get()) == 0) leaves.push_back(std::move(acc));
      continue;
    }
    EMBER_CHECK(n->sequence_nr() >= first, "[", kOp, "] the checkpointed function uses a tensor "
                "computed outside it that requires grad (made by ", n->name(),
                ") without taking it as an input; pass it in `inputs` so its gradient can "
                "flow back");
    for (const autograd::Edge& e : n->next_edges()) {
      if (e.valid()) stack.push_back(e.fn);
    }
  }
  return leaves;
}

// Note [Checkpoint gradients reach captured parameters in the enclosing pass]
// The node's next edges are only the inputs: fn ran without a graph, so the parameters it uses
// were unknown at forward. backward recomputes, asks autograd::grad (a nested pass that
// accumulates nothing) for the gradients of the inputs and of every leaf found below the
// recomputed outputs, returns the inputs' ones to the engine and accumulates the leaves' ones
// itself through their AccumulateGrad nodes. That runs while the enclosing pass is the current
// one, so post-accumulate hooks (DistributedDataParallel's) and the callbacks they queue belong
// to it, not to a nested pass that would end before the rest of the model's gradients arrive.
autograd::TensorList checkpoint_backward(autograd::Context* ctx, autograd::TensorList grads) {
  // Grad mode is on in a node's backward only under create_graph. The recomputation runs on
  // detached inputs, so gradients with history would not lead back to the real ones: refuse
  // rather than return gradients that are silently constant for double backward.
  if (GradMode::is_enabled()) {
    throw NotImplementedError(detail::str_cat(
        "[", kOp, "] backward with create_graph (double backward) through a checkpoint is not "
        "supported; run the segment without checkpoint to differentiate twice"));
  }
  const std::shared_ptr<Segment> seg = ctx->state<std::shared_ptr<Segment>>();
  const autograd::TensorList saved = ctx->saved();
  std::vector<Tensor> inputs;
  for (size_t i = 0; i < saved.size(); ++i) {
    Tensor d = saved[i].detach();
    if (ctx->needs_input_grad(i)) d.requires_grad_();
    inputs.push_back(std::move(d));
  }
  // Nodes are numbered in creation order: this one precedes everything recompute records.
  const uint64_t first = autograd::FunctionNode("CheckpointMarker", nullptr).sequence_nr();
  const std::vector<Tensor> outputs = recompute(*seg, inputs);
  EMBER_CHECK(outputs.size() == seg->num_outputs, "[", kOp, "] the recomputation in backward "
              "returned ", outputs.size(), " tensors, forward returned ", seg->num_outputs,
              ": the checkpointed function must compute the same thing both times");
  std::vector<Tensor> roots, root_grads;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i].defined() && outputs[i].requires_grad() && grads[i].defined()) {
      roots.push_back(outputs[i]);
      root_grads.push_back(grads[i]);
    }
  }
  autograd::TensorList result(inputs.size());
  if (roots.empty()) return result;
  std::vector<Tensor> wanted;
  for (const Tensor& t : inputs) {
    if (t.requires_grad()) wanted.push_back(t);
  }
  const auto leaves = captured_leaves(roots, inputs, first);
  for (const auto& acc : leaves) wanted.push_back(Tensor(acc->leaf()));
  std::vector<Tensor> g = autograd::grad(roots, wanted, root_grads, /*retain_graph=*/false,
                                         /*create_graph=*/false, /*allow_unused=*/true);
  size_t k = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].requires_grad()) result[i] = std::move(g[k++]);
  }
  NoGradGuard no_grad;
  for (const auto& acc : leaves) {
    autograd::TensorList one{std::move(g[k++])};
    if (!one[0].defined()) continue;
    acc->call_pre_hooks(one);
    acc->apply(std::move(one));
  }
  return result;
}

}  // namespace

std::vector<Tensor> checkpoint(const CheckpointFunction& fn, const std::vector<Tensor>& inputs,
                               bool preserve_rng_state) {
  EMBER_CHECK(fn != nullptr, "[", kOp, "] expected a function, got an empty one");
  bool record = GradMode::is_enabled() && !inputs.empty();
  for (size_t i = 0; i < inputs.size(); ++i) {
    EMBER_CHECK(inputs[i].defined(), "[", kOp, "] input ", i, " is undefined");
  }
  bool any_grad = false;
  for (const Tensor& t : inputs) any_grad = any_grad || t.requires_grad();
  // Without an input that requires grad the node would not be recorded and the parameters
  // inside would get no gradient (torch warns and drops them); running fn plainly keeps the
  // gradients right at the cost of this segment's memory.
  if (!record || !any_grad) return fn(inputs);

  auto seg = std::make_shared<Segment>();
  seg->fn = fn;
  seg->preserve_rng_state = preserve_rng_state;
  if (preserve_rng_state) seg->rng = rng_state();
  for (Device d : {kCPU, Device{DeviceType::CUDA, 0}}) {
    seg->autocast.push_back({d, is_autocast_enabled(d), get_autocast_dtype(d)});
  }
  auto node = std::make_shared<autograd::FunctionNode>("CheckpointBackward", &checkpoint_backward);
  std::vector<const Tensor*> ptrs;
  for (const Tensor& t : inputs) ptrs.push_back(&t);
  autograd::collect_next_edges(*node, ptrs.data(), ptrs.size());
  std::vector<Tensor> outputs;
  {
    NoGradGuard no_grad;
    if (preserve_rng_state) {
      const uint64_t drawn = run_with_generator_at(seg->rng, [&] { outputs = fn(inputs); });
      default_generator().advance(drawn);  // as if the segment had drawn from it
    } else {
      outputs = fn(inputs);
    }
  }
  seg->num_outputs = outputs.size();
  node->ctx.save_for_backward(inputs);
  node->ctx.state<std::shared_ptr<Segment>>() = seg;
  autograd::FunctionNode::finish(node, ptrs, outputs);
  return outputs;
}

Tensor checkpoint(const std::function<Tensor(const Tensor&)>& fn, const Tensor& input,
                  bool preserve_rng_state) {
  EMBER_CHECK(fn != nullptr, "[", kOp, "] expected a function, got an empty one");
  CheckpointFunction f = [fn](const std::vector<Tensor>& in) {
    return std::vector<Tensor>{fn(in[0])};
  };
  return checkpoint(f, std::vector<Tensor>{input}, preserve_rng_state)[0];
}

Tensor checkpoint(std::shared_ptr<Module> module, const Tensor& input, bool preserve_rng_state) {
  EMBER_CHECK(module != nullptr, "[", kOp, "] expected a module, got null");
  // Through operator(), so the module's forward hooks (e.g. FSDP's) run, in the recomputation too.
  return checkpoint([m = std::move(module)](const Tensor& x) { return (*m)(x); }, input,
                    preserve_rng_state);
}

}  // namespace ember::nn
