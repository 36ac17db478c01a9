// The rounds of DistributedDataParallel::join() (ddp.cpp): training with uneven inputs.
#include <ember/distributed/ddp/detail/ddp_join.h>

#include <iterator>
#include <sstream>

#include <ember/tensor/ops/creation.h>

namespace ember::dist::detail {

// Note [DDP join]: inside join(), every forward of a rank that still has data and every round
// of a rank that has run out all-reduce one small vector (join_round): a 1 in each rank's own
// slot if it has data, and the IterationPlan's flags (synchronise the backward, rebuild,
// broadcast buffers, all-reduce the used-parameter map). A rank that has run out learns from it
// which collectives the others are about to issue and issues the same ones
// (Reducer::shadow), with zero gradients; the sum of the slots is the number of ranks with
// data, and 0 ends the loop.

namespace {

constexpr const char* kOp = "[DistributedDataParallel]";

// The plan's flags, in the order they follow the per-rank slots, and what each one means.
struct Flag {
  bool IterationPlan::*member;
  const char* what;
};
constexpr Flag kFlags[] = {
    {&IterationPlan::sync,
     "run a synchronised backward (the others are under no_sync() or have grad mode off)"},
    {&IterationPlan::rebuild, "rebuild the buckets"},
    {&IterationPlan::buffers, "broadcast buffers (training mode)"},
    {&IterationPlan::used_map, "all-reduce the used-parameter map"},
};

std::string early_termination_message(const std::vector<char>& has_data) {
  std::ostringstream joined;
  int k = 0;
  for (size_t i = 0; i < has_data.size(); ++i) {
    if (!has_data[i]) joined << (k++ ? ", " : "") << i;
  }
  return str_cat(kOp, " join: rank(s) ", joined.str(), " of ", has_data.size(),
                 " ran out of inputs; stopping every rank (throw_on_early_termination = true)");
}

}  // namespace

JoinRound join_round(dist::ProcessGroup& group, const IterationPlan* plan) {
  const int n = group.size();
  constexpr size_t kNumFlags = std::size(kFlags);
  std::vector<float> v(n + kNumFlags, 0.0f);
  if (plan != nullptr) {
    v[group.rank()] = 1;
    for (size_t f = 0; f < kNumFlags; ++f) v[n + f] = plan->*kFlags[f].member ? 1.0f : 0.0f;
  }
  Tensor t = from_vector(v).to(group.default_device());
  group.allreduce(t, dist::AllreduceOptions{})->wait();
  v = t.to_vector<float>();
  JoinRound r;
  r.has_data.resize(n);
  for (int k = 0; k < n; ++k) {
    r.has_data[k] = v[k] > 0.5f;
    r.with_data += r.has_data[k];
    if (r.has_data[k] && r.source < 0) r.source = k;
  }
  for (size_t f = 0; f < kNumFlags; ++f) {
    const int count = static_cast<int>(v[n + f] + 0.5f);
    EMBER_CHECK(count == 0 || count == r.with_data,
                "[DistributedDataParallel.join] the ranks with data disagree: ", count, " of the ",
                r.with_data, " ranks still training in this iteration ", kFlags[f].what,
                "; every rank must run the same kind of iteration");
    r.plan.*kFlags[f].member = count > 0;
  }
  return r;
}

void JoinContext::take(const JoinRound& round, int size, Reducer& reducer) {
  last_with_data_ = round.has_data;
  if (options_.throw_on_early_termination && round.with_data < size) {
    throw dist::DistError(early_termination_message(round.has_data));
  }
  reducer.set_averaging(
      Averaging::for_join(options_.divide_by_initial_world_size, round.with_data, size));
}

int JoinContext::enter_iteration(dist::ProcessGroup& group, const IterationPlan& plan,
                                 Reducer& reducer) {
  const JoinRound round = join_round(group, &plan);
  take(round, group.size(), reducer);
  return round.source;
}

void JoinContext::shadow_others(dist::ProcessGroup& group, Reducer& reducer,
                                const std::function<void(int)>& broadcast_buffers) {
  for (;;) {
    const JoinRound round = join_round(group, nullptr);
    if (round.with_data == 0) break;
    take(round, group.size(), reducer);
    reducer.shadow(round.plan, [&] { broadcast_buffers(round.source); });
  }
  reducer.set_averaging(Averaging());
}

int JoinContext::authoritative_rank() const {
  int source = -1;
  for (size_t k = 0; k < last_with_data_.size(); ++k) {
    if (last_with_data_[k]) source = static_cast<int>(k);
  }
  return source;
}

// A joined rank's part of one iteration of the others: the same collectives, with zeros.
void Reducer::shadow(const IterationPlan& plan, const std::function<void()>& broadcast_buffers) {
  if (plan.rebuild) rebuild();
  if (plan.buffers) broadcast_buffers();
  if (!plan.sync) return;
  std::exception_ptr err;
  try {
    for (size_t i = 0; i < buckets_.size(); ++i) launch(i, /*shadow=*/true);
  } catch (...) {
    err = std::current_exception();
  }
  std::optional<UsedMap> used_map;
  if (!err && plan.used_map && group_->size() > 1) {
    used_map = start_used_map(std::vector<char>(params_.size(), 0));
  }
  if (!err && deferred_) deferred_->run_all();
  std::exception_ptr waited = wait_all();
  if (!err) err = waited;
  if (!err && used_map) {
    try {
      const std::vector<char> global = used_map->wait();
      // A rank that ran out before its first static_graph iteration adopts the others' used
      // set, so its later iterations match theirs.
      if (options_.static_graph && !static_graph_) learn_static_graph(global, global);
    } catch (...) {
      err = std::current_exception();
    }
  }
  ++finalized_;
  reset_iteration(state_);
  if (err) std::rethrow_exception(err);
}

}  // namespace ember::dist::detail
