// The pipeline executor (pipeline.h).
//
// Note [running a schedule]
// Each rank walks its own list. A forward keeps its output (and the graph behind it) until the
// micro-batch's backward; a received activation becomes a leaf that requires grad, so the
// backward's gradient for it is what goes back to the previous stage. A send is issued and not
// waited for (the receiver may be busy): the sends that have completed are let go between
// actions, with what they sent, and the rest are waited for when the step ends, so a stage
// holds the input gradients of the micro-batches still on their way back, not of all of them
// (1F1B's last stage would otherwise keep one per micro-batch). A receive is waited for right
// away, since the next action needs it. Transfers are tagged by (sending stage, direction,
// micro-batch), so no two in flight share a tag. Shapes: the first transfer between two
// stages carries a header (send_with_shape) and both sides remember it; later ones must match
// it (PipeliningShapeError at the sender otherwise), unless dynamic_shapes sends a header each
// time.
#include <ember/distributed/pipelining/pipeline.h>

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include <ember/autograd/autograd.h>
#include <ember/distributed/ddp/ddp.h>
#include <ember/distributed/p2p.h>
#include <ember/distributed/sharding/fsdp.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/grad_mode.h>
#include <ember/tensor/ops.h>
#include <ember/tensor/observe/trace.h>

namespace ember::dist::pipelining {

using ember::detail::str_cat;

namespace {
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}
struct Meta {
  Shape shape;
  Dtype dtype = kFloat32;
};
std::string text(const Shape& s, Dtype d) { return str_cat(s, " ", d); }
}  // namespace

struct PipelineSchedule::Impl {
  struct Slot {
    Tensor input, output, loss, out_grad, in_grad;
    Tensor result;  ///< the last stage's output, detached, for step()'s merged output
    autograd::WeightGrad weight_grad;
  };
  std::map<int, std::shared_ptr<PipelineStage>> stages;  // this rank's, by index
  std::map<int, DistributedDataParallel*> ddp;           // stages whose module is DDP
  std::set<int> sharded;                                 // stages with fully_shard-ed modules
  std::map<int, size_t> last_backward;                   // per stage: its last B or W action
  std::shared_ptr<ProcessGroup> group;
  int num_stages = 0;
  std::map<int, std::vector<Slot>> slots;
  std::map<int, Meta> sent, received;  // by sending stage: activations' shape (Note above)
  // By sending stage: whether its output goes with a header each time, as either side of the
  // boundary asks (dynamic_shapes), agreed at construction so both sides do the same.
  std::vector<bool> dynamic_out;
  struct Send {
    WorkPtr work;
    Tensor tensor;  ///< what it sends, kept until it completes
  };
  std::vector<Send> pending;  // sends issued this step and not yet let go
  std::optional<Action> current;  // the action running, for the abort's reason
};

PipelineSchedule::PipelineSchedule(std::vector<std::shared_ptr<PipelineStage>> stages,
                                   int n_microbatches, ScheduleKind kind, ScheduleOptions options)
    : m_(n_microbatches), options_(std::move(options)) {
  EMBER_CHECK(!stages.empty() && stages[0] != nullptr,
              "[PipelineSchedule] expected this rank's stages, got none");
  const int S = stages[0]->num_stages();
  const int p = stages[0]->group()->size();
  EMBER_CHECK(S % p == 0, "[PipelineSchedule] ", to_string(kind), ": ", S,
              " stages do not divide over ", p, " ranks");
  std::vector<int> rank_of(S);
  for (int s = 0; s < S; ++s) rank_of[s] = stage_rank(kind, s, S, p);
  RankActions compute = compute_actions(kind, p, S / p, n_microbatches);
  init(std::move(stages), add_communication(compute, rank_of), rank_of);
}

PipelineSchedule::PipelineSchedule(std::vector<std::shared_ptr<PipelineStage>> stages,
                                   int n_microbatches, RankActions actions,
                                   ScheduleOptions options)
    : m_(n_microbatches), options_(std::move(options)) {
  EMBER_CHECK(!stages.empty() && stages[0] != nullptr,
              "[PipelineSchedule] expected this rank's stages, got none");
  const int S = stages[0]->num_stages();
  std::vector<int> rank_of(S, -1);
  bool has_transfers = false;
  for (size_t r = 0; r < actions.size(); ++r) {
    for (const Action& a : actions[r]) {
      EMBER_CHECK(a.stage >= 0 && a.stage < S, "[PipelineSchedule] rank ", r, "'s action ",
                  to_string(a), " names a stage outside the ", S, " stages");
      EMBER_CHECK(rank_of[a.stage] < 0 || rank_of[a.stage] == static_cast<int>(r),
                  "[PipelineSchedule] stage ", a.stage, " has actions on ranks ", rank_of[a.stage],
                  " and ", r);
      rank_of[a.stage] = static_cast<int>(r);
      has_transfers = has_transfers || a.kind == ActionKind::SendF || a.kind == ActionKind::RecvF ||
                      a.kind == ActionKind::SendB || a.kind == ActionKind::RecvB;
    }
  }
  for (int s = 0; s < S; ++s) {
    EMBER_CHECK(rank_of[s] >= 0, "[PipelineSchedule] no rank runs stage ", s, " in the schedule given");
  }
  if (!has_transfers) actions = add_communication(actions, rank_of);
  init(std::move(stages), std::move(actions), std::move(rank_of));
}

PipelineSchedule::~PipelineSchedule() = default;

void PipelineSchedule::init(std::vector<std::shared_ptr<PipelineStage>> stages,
                            RankActions actions, std::vector<int> rank_of_stage) {
  EMBER_CHECK(options_.loss_fn != nullptr, "[PipelineSchedule] expected a loss_fn (the last "
              "stage's loss of each micro-batch), got none");
  EMBER_CHECK(m_ >= 1, "[PipelineSchedule] expected at least one micro-batch, got ", m_);
  impl_ = std::make_unique<Impl>();
  impl_->group = stages[0]->group();
  impl_->num_stages = stages[0]->num_stages();
  // Note [running a schedule] pairs transfers by tag. NCCL's send and recv ignore the tag and
  // run in issue order on one stream: a schedule whose sends from one rank to another come in
  // another order than the receiver's receives would pair the wrong tensors (zero-bubble's do),
  // and two ranks that each send before they receive (1F1B's steady state) deadlock once a
  // message outgrows NCCL's buffers. Refused until the executor orders and groups its
  // transfers for it (docs/pipeline_parallel.md, "Not yet").
  EMBER_CHECK(impl_->group->backend_name() != "nccl",
              "[PipelineSchedule] the stages' group is "
              "NCCL's, whose send and recv ignore tags and run in issue order, and this executor "
              "pairs transfers by tag: it could pair the wrong tensors or deadlock. Give the "
              "stages a gloo, MPI or threads group (pipelines over NCCL are not supported yet)");
  const int rank = impl_->group->rank();
  EMBER_CHECK(static_cast<int>(actions.size()) == impl_->group->size(), "[PipelineSchedule] the "
              "schedule has ", actions.size(), " ranks but the stages' group has ",
              impl_->group->size());
  for (const auto& st : stages) {
    EMBER_CHECK(st && st->group() == impl_->group && st->num_stages() == impl_->num_stages,
                "[PipelineSchedule] every stage must share one group and one number of stages");
    EMBER_CHECK(rank_of_stage[st->stage_index()] == rank, "[PipelineSchedule] stage ",
                st->stage_index(), " was given to rank ", rank, " but the schedule runs it on rank ",
                rank_of_stage[st->stage_index()]);
    EMBER_CHECK(!impl_->stages.count(st->stage_index()), "[PipelineSchedule] stage ",
                st->stage_index(), " given twice");
    impl_->stages[st->stage_index()] = st;
  }
  for (int s = 0; s < impl_->num_stages; ++s) {
    EMBER_CHECK(rank_of_stage[s] != rank || impl_->stages.count(s), "[PipelineSchedule] the "
                "schedule runs stage ", s, " on rank ", rank, ", which was not given it");
  }
  const ScheduleCheck check = validate(actions, impl_->num_stages, m_, rank_of_stage);
  EMBER_CHECK(check.ok, "[PipelineSchedule] the schedule is not valid: ", check.error);
  // Note [data parallel stages]: a stage's module may be DistributedDataParallel (over the
  // data-parallel group) or fully_shard-ed: its gradients are reduced once per step, in its
  // last backward, not once per micro-batch. DDP's forwards run under no_sync() and its last
  // backward is armed with prepare_for_backward(); FSDP's backwards keep full gradients
  // (set_requires_gradient_sync(false)) until the last.
  bool split = false;
  for (size_t i = 0; i < actions[rank].size(); ++i) {
    const Action& a = actions[rank][i];
    if (a.kind == ActionKind::Backward || a.kind == ActionKind::BackwardWeight) impl_->last_backward[a.stage] = i;
    split = split || a.kind == ActionKind::BackwardInput;
  }
  for (const auto& [s, st] : impl_->stages) {
    if (auto* d = dynamic_cast<DistributedDataParallel*>(st->submodule_ptr().get())) impl_->ddp[s] = d;
    for (const auto& m : st->submodule_ptr()->modules()) {
      if (is_fully_sharded(*m)) impl_->sharded.insert(s);
    }
    EMBER_CHECK(!split || !impl_->sharded.count(s), "[PipelineSchedule] stage ", s,
                " is fully_shard-ed: its backward cannot be split into input and weight halves "
                "yet; use a schedule without them (gpipe, 1f1b, interleaved-1f1b, looped-bfs)");
  }
  actions_ = std::move(actions);
  rank_of_stage_ = std::move(rank_of_stage);
  agree();
}

// Every rank must run the same schedule over the same micro-batches: one small all-gather at
// construction names a rank that differs, instead of a transfer that never matches.
void PipelineSchedule::agree() {
  ProcessGroup& g = *impl_->group;
  const int64_t hash = static_cast<int64_t>(std::hash<std::string>{}(to_csv(actions_)) >> 1);
  // With the schedule, each rank's stages' dynamic_shapes (a bit per stage it runs): the
  // stage count is checked before the bits are read, and at most 62 stages carry them.
  const int S = impl_->num_stages;
  int64_t dynamic = 0;
  for (const auto& [s, st] : impl_->stages) {
    EMBER_CHECK(!st->options().dynamic_shapes || s < 62,
                "[PipelineSchedule] dynamic_shapes is "
                "supported on the first 62 stages, got it on stage ",
                s);
    if (st->options().dynamic_shapes) dynamic |= int64_t{1} << s;
  }
  const Tensor mine =
      from_vector(std::vector<int64_t>{m_, S, hash, dynamic}).to(g.default_device());
  Tensor all = zeros({g.size(), 4}, TensorOptions(kInt64).device(g.default_device()));
  g.allgather_into_tensor(all, mine)->wait();
  const std::vector<int64_t> v = all.to(kCPU).to_vector<int64_t>();
  int64_t dynamic_all = 0;
  for (int r = 0; r < g.size(); ++r) {
    if (v[4 * r] != m_ || v[4 * r + 1] != impl_->num_stages) {
      throw ValueError(str_cat("[PipelineSchedule] the ranks disagree: rank ", r, " runs ",
                               v[4 * r], " micro-batches over ", v[4 * r + 1],
                               " stages, this rank (", g.rank(), ") ", m_, " over ",
                               impl_->num_stages));
    }
    if (v[4 * r + 2] != hash) {
      throw ValueError(str_cat("[PipelineSchedule] the ranks disagree: rank ", r,
                               " has another schedule than this rank (", g.rank(), ")"));
    }
    dynamic_all |= v[4 * r + 3];
  }
  auto dynamic_at = [&](int s) { return s < 62 && ((dynamic_all >> s) & 1) != 0; };
  impl_->dynamic_out.assign(S, false);
  for (int s = 0; s + 1 < S; ++s) impl_->dynamic_out[s] = dynamic_at(s) || dynamic_at(s + 1);
}

std::string PipelineSchedule::table() const {
  return format_table(actions_, impl_->num_stages, m_, rank_of_stage_);
}

namespace {

/// The micro-batches of `batch` along `dim`; throws ValueError naming the sizes.
std::vector<Tensor> split(const char* what, const Tensor& batch, int64_t dim, int m) {
  EMBER_CHECK(batch.defined(), "[PipelineSchedule::step] expected the ", what, " on this rank, got none");
  const int64_t d = dim < 0 ? dim + batch.dim() : dim;
  EMBER_CHECK(d >= 0 && d < batch.dim(), "[PipelineSchedule::step] split_dim ", dim,
              " is out of range for the ", what, " of shape ", batch.shape());
  EMBER_CHECK(batch.size(d) % m == 0, "[PipelineSchedule::step] a ", what, " of ", batch.size(d),
              " along dim ", d, " does not divide into ", m, " micro-batches");
  std::vector<Tensor> out;
  const int64_t n = batch.size(d) / m;
  for (int i = 0; i < m; ++i) out.push_back(batch.narrow(d, i * n, n));
  return out;
}

// An action in words, for errors: "forward", "receiving its input".
const char* describe(ActionKind k) {
  switch (k) {
    case ActionKind::Forward:
      return "forward";
    case ActionKind::Backward:
      return "backward";
    case ActionKind::BackwardInput:
      return "input's backward";
    case ActionKind::BackwardWeight:
      return "weights' backward";
    case ActionKind::SendF:
      return "sending its output";
    case ActionKind::RecvF:
      return "receiving its input";
    case ActionKind::SendB:
      return "sending its input's gradient";
    case ActionKind::RecvB:
      return "receiving its output's gradient";
  }
  return "?";
}

template <typename F>
void with_context(const std::string& what, F&& f) {
  try {
    f();
  } catch (const DistTimeoutError& e) {
    throw DistTimeoutError(str_cat(what, ": ", e.what()));
  } catch (const DistError& e) {
    throw DistBackendError(str_cat(what, ": ", e.what()));
  }
}

}  // namespace

Tensor PipelineSchedule::step(const Tensor& input, const Tensor& target, std::vector<Tensor>* losses) {
  return run(actions_[impl_->group->rank()], input, target, losses, /*training=*/true);
}

// Without backwards a schedule's forwards and their transfers still cannot block: a receive
// waits only for forwards that come before it on every rank (the schedule was valid with the
// backwards' extra dependencies), and sends never wait.
Tensor PipelineSchedule::eval(const Tensor& input, const Tensor& target, std::vector<Tensor>* losses) {
  std::vector<Action> forwards;
  for (const Action& a : actions_[impl_->group->rank()]) {
    if (a.kind == ActionKind::Forward || a.kind == ActionKind::SendF || a.kind == ActionKind::RecvF) {
      forwards.push_back(a);
    }
  }
  NoGradGuard no_grad;
  return run(forwards, input, target, losses, /*training=*/false);
}

// Note [a failed step aborts the group]: a rank whose step throws leaves its peers in receives
// from it (or from ranks that wait on it in turn) until the group's timeout, ten minutes by
// default, as in PyTorch, which says only that a receive timed out. The ranks of a step are out of
// step once one has failed, so the group is no use to them any more: aborting it ends every
// rank's step at once, with this rank's error as the reason. So are the data-parallel groups of
// this rank's stages (DDP or fully_shard over them): this step's gradients will not come from
// this rank, and its replicas would wait in their reductions; their failure then aborts their
// own pipelines. Where the backend cannot abort (ProcessGroup::abort returns false) the peers
// still fail at their timeout. An abort by a peer that reaches this rank as an error is
// re-aborted harmlessly: the first reason stands.
Tensor PipelineSchedule::run(const std::vector<Action>& mine, const Tensor& input,
                             const Tensor& target, std::vector<Tensor>* losses, bool training) {
  auto reason = [this](const std::string& what) {
    // The transfers' errors and the schedule's checks name their place already.
    if (what.rfind("[PipelineSchedule", 0) == 0) return what;
    const int rank = impl_->group->rank();
    if (!impl_->current) return str_cat("[PipelineSchedule] rank ", rank, ": ", what);
    const Action& a = *impl_->current;
    return str_cat("[PipelineSchedule] stage ", a.stage, " (rank ", rank, "), micro-batch ",
                   a.microbatch, ", ", describe(a.kind), ": ", what);
  };
  impl_->current.reset();
  // The stages' group, and the data-parallel groups of this rank's stages (DDP's, fully_shard's):
  // their peers wait for this rank's gradients. The step's error is what the caller gets,
  // whatever an abort does.
  auto abort = [this](const std::string& why) {
    std::vector<std::shared_ptr<ProcessGroup>> groups{impl_->group};
    for (const auto& [s, ddp] : impl_->ddp) groups.push_back(ddp->process_group());
    for (int s : impl_->sharded) {
      for (auto& g : fsdp_process_groups(impl_->stages.at(s)->submodule())) groups.push_back(g);
    }
    for (const auto& g : groups) {
      try {
        if (g != nullptr) g->abort(why);
      } catch (...) {
      }
    }
  };
  try {
    return run_actions(mine, input, target, losses, training);
  } catch (const std::exception& e) {
    abort(reason(e.what()));
    throw;
  } catch (...) {
    abort(reason("an exception that is not a std::exception"));
    throw;
  }
}

Tensor PipelineSchedule::run_actions(const std::vector<Action>& mine, const Tensor& input,
                                     const Tensor& target, std::vector<Tensor>* losses,
                                     bool training) {
  Impl& im = *impl_;
  const auto t0 = Clock::now();
  stats_ = {};
  const int rank = im.group->rank();
  const int S = im.num_stages;
  std::vector<Tensor> inputs, targets;
  if (im.stages.count(0)) inputs = split("input", input, options_.split_dim, m_);
  if (im.stages.count(S - 1) && (training || target.defined())) {
    targets = split("target", target, options_.split_dim, m_);
  }
  im.slots.clear();
  for (const auto& [s, st] : im.stages) im.slots[s].resize(m_);
  im.pending.clear();
  const double scale = options_.scale_grads ? 1.0 / m_ : 1.0;
  auto tag = [&](int sender, int dir, int mb) { return (sender * 2 + dir) * m_ + mb; };
  auto where = [&](int s, int mb) { return str_cat("stage ", s, " (rank ", rank, "), micro-batch ", mb); };
  // Lets go of the sends that have completed (a failed one throws here, naming the rank).
  auto sweep = [&](bool all) {
    std::erase_if(im.pending, [&](const Impl::Send& send) {
      if (!all && !send.work->is_completed()) return false;
      with_context(str_cat("[PipelineSchedule] rank ", rank, " waiting for its sends"),
                   [&] { send.work->wait(); });
      return true;
    });
  };

  // The roots and gradients of a micro-batch's backward at stage s: none when its output needs
  // no gradient (a first stage whose parameters are all frozen), whose backward is then
  // skipped, as PyTorch's stage_backward skips outputs that do not require grad.
  auto roots = [&](int s, Impl::Slot& slot, std::vector<Tensor>& outs, std::vector<Tensor>& grads) {
    outs.clear();
    grads.clear();
    if (s == S - 1) {
      if (slot.loss.requires_grad()) outs = {slot.loss * scale};
    } else {
      EMBER_CHECK(slot.out_grad.defined(), "[PipelineSchedule] ", where(s, 0), ": no gradient for the output");
      if (slot.output.requires_grad()) {
        outs = {slot.output};
        grads = {slot.out_grad};
      }
    }
  };
  // What the micro-batch's backward at stage s leaves: the input's gradient, to send or hand
  // on; the rest of its tensors go now rather than at the end of the step.
  auto after_backward = [&](int s, int mb, Tensor in_grad) {
    Impl::Slot& slot = im.slots[s][mb];
    slot.in_grad = std::move(in_grad);
    slot.output = Tensor();
    slot.input = Tensor();
    slot.out_grad = Tensor();
    slot.loss = Tensor();
    if (s > 0 && im.stages.count(s - 1)) im.slots[s - 1][mb].out_grad = std::move(slot.in_grad);
  };

  for (size_t index = 0; index < mine.size(); ++index) {
    sweep(/*all=*/false);
    const Action& a = mine[index];
    im.current = a;
    const int s = a.stage, mb = a.microbatch;
    Impl::Slot& slot = im.slots[s][mb];
    PipelineStage& stage = *im.stages.at(s);
    DistributedDataParallel* ddp = im.ddp.count(s) ? im.ddp.at(s) : nullptr;
    // Note [data parallel stages].
    if (training && (a.kind == ActionKind::Backward || a.kind == ActionKind::BackwardWeight)) {
      const bool last = im.last_backward.at(s) == index;
      if (ddp && last) ddp->prepare_for_backward();
      if (im.sharded.count(s)) set_requires_gradient_sync(stage.submodule(), last);
    }
    trace::Span span(to_string(a), "pipeline");
    const auto c0 = Clock::now();
    bool compute = true;
    switch (a.kind) {
      case ActionKind::Forward: {
        if (s == 0) slot.input = inputs[mb];  // a batch that requires grad gets its gradient
        const Tensor x = slot.input;
        EMBER_CHECK(x.defined(), "[PipelineSchedule] ", where(s, mb), ": forward without its input");
        // Evaluation skips DDP: its forward prepares a backward that never comes.
        nn::Module& module = ddp && !training ? *ddp->module() : *stage.submodule_ptr();
        Tensor y;
        if (ddp && training) {
          auto no_sync = ddp->no_sync();
          y = module(x);
        } else {
          y = module(x);  // through operator(), so that its hooks (fully_shard's) run
        }
        slot.output = y;
        if (s == S - 1) {
          slot.result = y.detach();
          if (!targets.empty()) {
            slot.loss = options_.loss_fn(y, targets[mb]);
            EMBER_CHECK(slot.loss.numel() == 1, "[PipelineSchedule] loss_fn returned shape ",
                        slot.loss.shape(), " for ", where(s, mb), "; expected one element");
            if (losses) losses->push_back(slot.loss.detach());
          }
        } else if (im.stages.count(s + 1)) {
          Tensor next = y.detach();
          im.slots[s + 1][mb].input = training ? next.requires_grad_() : next;
        }
        break;
      }
      case ActionKind::Backward: {
        std::vector<Tensor> outs, grads;
        roots(s, slot, outs, grads);
        if (!outs.empty()) autograd::backward(outs, grads);
        after_backward(s, mb, s > 0 ? slot.input.grad() : Tensor());
        break;
      }
      case ActionKind::BackwardInput: {
        std::vector<Tensor> outs, grads;
        roots(s, slot, outs, grads);
        std::vector<Tensor> ins, weights;
        if (slot.input.defined() && slot.input.requires_grad()) ins.push_back(slot.input);
        for (const Tensor& w : stage.submodule().parameters()) {
          if (w.requires_grad()) weights.push_back(w);  // frozen ones get no weight backward
        }
        std::vector<Tensor> dx;
        if (!outs.empty()) {
          dx = autograd::backward_input(outs, grads, ins, weights, slot.weight_grad);
        }
        after_backward(s, mb, dx.empty() ? Tensor() : dx[0]);
        break;
      }
      case ActionKind::BackwardWeight:
        if (slot.weight_grad.pending()) slot.weight_grad.run();  // none for a skipped backward
        break;
      case ActionKind::SendF:
      case ActionKind::SendB: {
        compute = false;
        const bool f = a.kind == ActionKind::SendF;
        const int peer_stage = f ? s + 1 : s - 1;
        const int peer = rank_of_stage_[peer_stage];
        Tensor t = (f ? slot.output : slot.in_grad);
        EMBER_CHECK(t.defined(), "[PipelineSchedule] ", where(s, mb), ": nothing to send to stage ", peer_stage);
        t = t.detach().contiguous();
        const std::string what = str_cat("[PipelineSchedule] ", where(s, mb), " ", describe(a.kind),
                                         " to stage ", peer_stage, " (rank ", peer, ")");
        WorkPtr work;
        with_context(what, [&] {
          if (f && (im.dynamic_out[s] || !im.sent.count(s))) {
            im.sent[s] = {t.shape(), t.dtype()};
            work = send_with_shape(*im.group, t, peer, tag(s, 0, mb));
          } else {
            if (f && (im.sent[s].shape != t.shape() || im.sent[s].dtype != t.dtype())) {
              throw PipeliningShapeError(str_cat(what, ": the output is ", text(t.shape(), t.dtype()),
                                                 " but stage ", peer_stage, " takes ",
                                                 text(im.sent[s].shape, im.sent[s].dtype),
                                                 " (the first step's; dynamic_shapes lets it vary)"));
            }
            work = im.group->send(t, peer, tag(s, f ? 0 : 1, mb));
          }
        });
        im.pending.push_back({std::move(work), std::move(t)});
        if (!f) slot.in_grad = Tensor();  // the send holds it now
        break;
      }
      case ActionKind::RecvF: {
        compute = false;
        const int peer = rank_of_stage_[s - 1];
        const std::string what = str_cat("[PipelineSchedule] ", where(s, mb), " ", describe(a.kind),
                                         " from stage ", s - 1, " (rank ", peer, ")");
        Tensor x;
        with_context(what, [&] {
          if (im.dynamic_out[s - 1] || !im.received.count(s - 1)) {
            x = recv_with_shape(*im.group, peer, tag(s - 1, 0, mb), stage.device());
            im.received[s - 1] = {x.shape(), x.dtype()};
          } else {
            const Meta& meta = im.received[s - 1];
            x = empty(meta.shape, TensorOptions(meta.dtype).device(stage.device()));
            im.group->recv(x, peer, tag(s - 1, 0, mb))->wait();
          }
        });
        const auto& want = stage.options().input_shape;
        if (want && !(x.shape() == *want)) {
          throw PipeliningShapeError(str_cat(what, ": stage ", s - 1, " sent ", text(x.shape(), x.dtype()),
                                             " but stage ", s, " takes ", *want));
        }
        slot.input = training ? x.requires_grad_() : x;
        break;
      }
      case ActionKind::RecvB: {
        compute = false;
        const int peer = rank_of_stage_[s + 1];
        EMBER_CHECK(slot.output.defined(), "[PipelineSchedule] ", where(s, mb),
                    ": a gradient arrives before the forward");
        Tensor g = empty(slot.output.shape(), slot.output.options());
        with_context(str_cat("[PipelineSchedule] ", where(s, mb), " ", describe(a.kind),
                             " from stage ", s + 1, " (rank ", peer, ")"),
                     [&] { im.group->recv(g, peer, tag(s + 1, 1, mb))->wait(); });
        slot.out_grad = g;
        break;
      }
    }
    if (compute) stats_.compute_s += seconds_since(c0);
  }
  im.current.reset();
  sweep(/*all=*/true);
  Tensor merged;
  if (im.stages.count(S - 1)) {
    std::vector<Tensor> outs;
    for (auto& slot : im.slots[S - 1]) outs.push_back(slot.result);
    merged = cat(outs, options_.split_dim);
  }
  im.slots.clear();
  im.pending.clear();
  stats_.wall_s = seconds_since(t0);
  return merged;
}

}  // namespace ember::dist::pipelining
