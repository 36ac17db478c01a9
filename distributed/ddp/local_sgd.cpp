#include <ember/distributed/ddp/local_sgd.h>

#include <algorithm>
#include <optional>
#include <string>

#include <ember/distributed/ddp/detail/state_entries.h>
#include <ember/distributed/environment.h>
#include <ember/distributed/init.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/grad_mode.h>
#include <ember/tensor/ops/indexing.h>
#include <ember/tensor/observe/log.h>

namespace ember::dist {

namespace {

std::vector<Tensor> params_of(const std::vector<nn::optim::ParamGroup>& groups) {
  std::vector<Tensor> out;
  for (const auto& g : groups) out.insert(out.end(), g.params.begin(), g.params.end());
  return out;
}

using detail::int_entry;
using detail::read_int;

}  // namespace

// ---- new_subgroups --------------------------------------------------------------------------

Subgroups new_subgroups(int group_size, std::shared_ptr<ProcessGroup> group) {
  constexpr const char* kOp = "[new_subgroups]";
  if (group == nullptr) group = default_group();
  const int n = group->size();
  EMBER_CHECK(group_size >= 1, kOp, " group_size must be >= 1, got ", group_size);
  EMBER_CHECK(group_size <= n, kOp, " group_size must not exceed the group's size ", n, ", got ",
              group_size);
  EMBER_CHECK(n % group_size == 0, kOp, " group_size must divide the group's size ", n, ", got ",
              group_size);
  const int world = get_world_size();
  EMBER_CHECK(n == world, kOp, " expected a group of the whole world (", world,
              " ranks), got one of ", n,
              " ranks: new_group is collective over the world, so the ranks outside the group "
              "could not take part");
  Subgroups out;
  for (int first = 0; first < n; first += group_size) {
    std::vector<int> ranks;
    for (int r = first; r < first + group_size; ++r) ranks.push_back(get_global_rank(*group, r));
    auto g = new_group(ranks);
    if (g != nullptr) out.group = std::move(g);
    out.ranks.push_back(std::move(ranks));
  }
  EMBER_INTERNAL_ASSERT(out.group != nullptr, kOp, " this rank is in none of the subgroups");
  return out;
}

// ---- average_parameters ---------------------------------------------------------------------

void average_parameters(const std::vector<Tensor>& params, ProcessGroup& group) {
  // One flat buffer per (dtype, device), in order of first appearance, which is the same on
  // every rank since every rank passes the same parameters.
  struct Kind {
    Dtype dtype;
    Device device;
    std::vector<Tensor> params;
  };
  std::vector<Kind> kinds;
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& p = params[i];
    EMBER_CHECK(p.defined(), "[average_parameters] parameter ", i, " is undefined");
    if (!p.grad().defined()) continue;
    auto it = std::find_if(kinds.begin(), kinds.end(), [&](const Kind& k) {
      return k.dtype == p.dtype() && k.device == p.device();
    });
    if (it == kinds.end()) it = kinds.insert(kinds.end(), Kind{p.dtype(), p.device(), {}});
    it->params.push_back(p.detach());
  }
  if (group.size() == 1) return;
  NoGradGuard no_grad;
  for (Kind& k : kinds) {
    std::vector<Tensor> flat;
    flat.reserve(k.params.size());
    for (const Tensor& p : k.params) flat.push_back(p.reshape({-1}));
    Tensor buffer = cat(flat, 0);
    AllreduceOptions o;
    o.op = ReduceOp::Avg;
    group.allreduce(buffer, o)->wait();
    int64_t offset = 0;
    for (Tensor& p : k.params) {
      p.copy_(buffer.narrow(0, offset, p.numel()).view(p.shape()));
      offset += p.numel();
    }
  }
}

void average_parameters(const std::vector<nn::optim::ParamGroup>& groups, ProcessGroup& group) {
  average_parameters(params_of(groups), group);
}

// ---- averagers ------------------------------------------------------------------------------

ModelAverager::ModelAverager(std::shared_ptr<ProcessGroup> group)
    : group_(group ? std::move(group) : default_group()) {}

void ModelAverager::average_parameters(const std::vector<nn::optim::ParamGroup>& groups) {
  average_parameters(params_of(groups));
}

void ModelAverager::set_step(int64_t step) {
  EMBER_CHECK(step >= 0, "[ModelAverager] set_step expects a step >= 0, got ", step);
  step_ = step;
}

PeriodicModelAverager::PeriodicModelAverager(int64_t period, int64_t warmup_steps,
                                             std::shared_ptr<ProcessGroup> group)
    : ModelAverager(std::move(group)), period_(period), warmup_steps_(warmup_steps) {
  constexpr const char* kOp = "[PeriodicModelAverager]";
  EMBER_CHECK(warmup_steps >= 0, kOp, " warmup_steps must be >= 0, got ", warmup_steps);
  EMBER_CHECK(period >= 1, kOp, " period must be >= 1, got ", period);
  if (period == 1) {
    logging::warn(kOp, " with period 1 averaging parameters costs at least as much as ",
                  "averaging gradients in DDP's backward pass: use DDP alone");
  }
}

void PeriodicModelAverager::average_parameters(const std::vector<Tensor>& params) {
  const int64_t s = step();
  if (s >= warmup_steps_ && (s - warmup_steps_) % period_ == 0) {
    dist::average_parameters(params, *process_group());
  }
  advance();
}

HierarchicalModelAverager::HierarchicalModelAverager(
    std::vector<std::pair<int64_t, int>> period_group_sizes, int64_t warmup_steps,
    std::shared_ptr<ProcessGroup> group)
    : ModelAverager(std::move(group)), warmup_steps_(warmup_steps) {
  constexpr const char* kOp = "[HierarchicalModelAverager]";
  // Everything is checked before the first new_subgroups, so a bad argument fails on every
  // rank before any of them enters a collective.
  EMBER_CHECK(!period_group_sizes.empty(), kOp,
              " period_group_sizes must not be empty, got no (period, group size) pair");
  for (size_t i = 0; i < period_group_sizes.size(); ++i) {
    const int64_t period = period_group_sizes[i].first;
    EMBER_CHECK(period >= 1, kOp, " periods must be >= 1, got ", period, " at position ", i);
    EMBER_CHECK(i == 0 || period > period_group_sizes[i - 1].first, kOp,
                " periods must be strictly increasing, got ", period_group_sizes[i - 1].first,
                " then ", period, " at position ", i);
  }
  const int overall = process_group()->size();
  EMBER_CHECK(period_group_sizes.back().second == overall, kOp,
              " the last group size must be the size of the process group, ", overall, ", got ",
              period_group_sizes.back().second);
  EMBER_CHECK(warmup_steps >= 0, kOp, " warmup_steps must be >= 0, got ", warmup_steps);
  if (period_group_sizes.back().first == 1) {
    logging::warn(kOp, " with a largest period of 1 averaging parameters costs at least as much ",
                  "as averaging gradients in DDP's backward pass: use DDP alone");
  }
  for (const auto& [period, size] : period_group_sizes) {
    levels_.emplace_back(
        period, size == overall ? process_group() : new_subgroups(size, process_group()).group);
  }
}

std::shared_ptr<ProcessGroup> HierarchicalModelAverager::group_at(int64_t step) const {
  for (auto it = levels_.rbegin(); it != levels_.rend(); ++it) {
    if (step % it->first == 0) return it->second;
  }
  return nullptr;
}

void HierarchicalModelAverager::average_parameters(const std::vector<Tensor>& params) {
  if (step() >= warmup_steps_) {
    if (auto g = group_at(step())) dist::average_parameters(params, *g);
  }
  advance();
}

// ---- post-local SGD hook --------------------------------------------------------------------

namespace {
constexpr const char* kStateOp = "[PostLocalSGDState]";
}  // namespace

PostLocalSGDState::PostLocalSGDState(std::shared_ptr<ProcessGroup> process_group,
                                     std::shared_ptr<ProcessGroup> subgroup,
                                     int64_t start_localSGD_iter,
                                     bool post_local_gradient_allreduce)
    : subgroup_(std::move(subgroup)),
      start_(start_localSGD_iter),
      post_local_allreduce_(post_local_gradient_allreduce) {
  EMBER_CHECK(start_ >= 0, kStateOp, " start_localSGD_iter must be >= 0, got ", start_);
  group_ = process_group ? std::move(process_group) : default_group();
  if (subgroup_ == nullptr && post_local_allreduce_) {
    const std::optional<int> per_node = local_world_size();
    EMBER_CHECK(per_node.has_value(), kStateOp,
                " expected a subgroup, or the number of ranks per node in LOCAL_WORLD_SIZE "
                "(or OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS) to make one, got neither: "
                "pass new_subgroups(ranks_per_node).group");
    subgroup_ = new_subgroups(*per_node).group;
  }
}

nn::NamedTensors PostLocalSGDState::state_dict() const {
  return {{"iteration", int_entry(iter_)},
          {"start_localSGD_iter", int_entry(start_)},
          {"post_local_gradient_allreduce", int_entry(post_local_allreduce_ ? 1 : 0)}};
}

void PostLocalSGDState::load_state_dict(const nn::NamedTensors& state) {
  std::optional<int64_t> iter;
  for (const auto& [name, t] : state) {
    if (name == "iteration") {
      iter = read_int(kStateOp, name, t);
    } else if (name == "start_localSGD_iter") {
      const int64_t saved = read_int(kStateOp, name, t);
      EMBER_CHECK(saved == start_, kStateOp, " the state was saved with start_localSGD_iter ",
                  saved, " but this one has ", start_);
    } else if (name == "post_local_gradient_allreduce") {
      const bool saved = read_int(kStateOp, name, t) != 0;
      EMBER_CHECK(saved == post_local_allreduce_, kStateOp,
                  " the state was saved with post_local_gradient_allreduce ",
                  saved ? "true" : "false", " but this one has ",
                  post_local_allreduce_ ? "true" : "false");
    } else {
      EMBER_CHECK(false, kStateOp, " load_state_dict got an unknown entry '", name,
                  "' (expected iteration, start_localSGD_iter, post_local_gradient_allreduce)");
    }
  }
  EMBER_CHECK(iter.has_value(), kStateOp, " load_state_dict expects an entry 'iteration', got ",
              state.size(), " entries without it");
  EMBER_CHECK(*iter >= 0 && *iter <= start_, kStateOp, " 'iteration' must be in [0, ", start_,
              "] (it stops counting at start_localSGD_iter), got ", *iter);
  iter_ = *iter;
}

std::shared_ptr<Future> post_localSGD_hook(PostLocalSGDState& state, GradBucket& bucket) {
  Tensor buffer = bucket.buffer();
  AllreduceOptions o;
  o.op = ReduceOp::Avg;
  if (state.iter_ < state.start_) {
    if (bucket.is_last() && ++state.iter_ == state.start_) {
      logging::info("[post_localSGD_hook] local SGD starts after ", state.iter_, " iterations");
    }
    bucket.record_bytes_sent(ring_allreduce_bytes(buffer.nbytes(), state.group_->size()));
    return state.group_->allreduce(buffer, o)->future();
  }
  if (!state.post_local_allreduce_) {
    bucket.record_bytes_sent(0);
    return completed_future({buffer});
  }
  bucket.record_bytes_sent(ring_allreduce_bytes(buffer.nbytes(), state.subgroup_->size()));
  return state.subgroup_->allreduce(buffer, o)->future();
}

// ---- PostLocalSGDOptimizer ------------------------------------------------------------------

namespace {
constexpr const char* kOptOp = "[PostLocalSGDOptimizer]";
constexpr const char* kStepEntry = "step";
}  // namespace

PostLocalSGDOptimizer::PostLocalSGDOptimizer(std::shared_ptr<nn::optim::Optimizer> optimizer,
                                             std::shared_ptr<ModelAverager> averager)
    : optimizer_(std::move(optimizer)), averager_(std::move(averager)) {
  EMBER_CHECK(optimizer_ != nullptr, kOptOp, " expected an optimizer to wrap, got null");
  EMBER_CHECK(averager_ != nullptr, kOptOp, " expected a model averager, got null");
}

void PostLocalSGDOptimizer::step() {
  optimizer_->step();
  averager_->average_parameters(optimizer_->param_groups());
}

void PostLocalSGDOptimizer::zero_grad(bool set_to_none) { optimizer_->zero_grad(set_to_none); }

nn::optim::OptimizerState PostLocalSGDOptimizer::state_dict() const {
  nn::optim::OptimizerState out = optimizer_->state_dict();
  out.state.emplace_back(kStepEntry, int_entry(averager_->step()));
  return out;
}

void PostLocalSGDOptimizer::load_state_dict(const nn::optim::OptimizerState& state) {
  nn::optim::OptimizerState inner = state;
  std::optional<int64_t> step;
  inner.state.clear();
  for (const auto& [name, t] : state.state) {
    if (name == kStepEntry) {
      step = read_int(kOptOp, name, t);
      EMBER_CHECK(*step >= 0, kOptOp, " load_state_dict expects a 'step' >= 0, got ", *step);
    } else {
      inner.state.emplace_back(name, t);
    }
  }
  optimizer_->load_state_dict(inner);
  if (!step) {
    logging::warn(kOptOp, " the loaded state has no 'step' for the model averager: ",
                  "setting its step to 0");
  }
  averager_->set_step(step.value_or(0));
}

}  // namespace ember::dist
