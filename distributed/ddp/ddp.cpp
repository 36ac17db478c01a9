#include <ember/distributed/ddp/ddp.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <utility>

#include <ember/distributed/ddp/detail/ddp_join.h>
#include <ember/distributed/ddp/detail/reducer.h>
#include <ember/distributed/debug/debug.h>
#include <ember/distributed/init.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/grad_mode.h>
#include <ember/tensor/ops.h>

namespace ember::dist::detail {

// Note [coalesced broadcast]: DDP's parameters at construction and its buffers before every
// training forward go out as one broadcast per (dtype, device), packed into one flat buffer
// (c10d's _sync_module_states broadcasts coalesced buckets too), not one broadcast and one
// wait per tensor. Every rank groups the same way: the model is the same on every rank. The
// waits are the backend's: NCCL's only order the current stream after the broadcast, so the
// copies back are queued without the host waiting; gloo's block the CPU, as copying back from a
// CPU buffer needs anyway.
void broadcast_tensors(dist::ProcessGroup& pg, const std::vector<Tensor>& tensors, int root) {
  if (pg.size() == 1) return;
  NoGradGuard no_grad;
  std::vector<std::vector<Tensor>> groups;  // by (dtype, device), in order of first appearance
  for (const Tensor& t : tensors) {
    if (t.numel() == 0) continue;
    auto same = [&](const std::vector<Tensor>& g) {
      return g.front().dtype() == t.dtype() && g.front().device() == t.device();
    };
    auto it = std::find_if(groups.begin(), groups.end(), same);
    if (it == groups.end()) {
      groups.push_back({t.detach()});
    } else {
      it->push_back(t.detach());
    }
  }
  dist::BroadcastOptions o;
  o.root = root;
  std::vector<Tensor> flats;
  std::vector<dist::WorkPtr> works;
  for (const auto& g : groups) {
    std::vector<Tensor> parts;
    for (const Tensor& t : g) parts.push_back(t.reshape({-1}));
    flats.push_back(cat(parts, 0));
    works.push_back(pg.broadcast(flats.back(), o));
  }
  for (size_t i = 0; i < groups.size(); ++i) {
    works[i]->wait();
    if (pg.rank() == root) continue;  // its tensors already hold the values
    int64_t at = 0;
    for (Tensor& t : groups[i]) {
      t.copy_(flats[i].narrow(0, at, t.numel()).view(t.shape()));
      at += t.numel();
    }
  }
}

}  // namespace ember::dist::detail

namespace ember::dist {

using dist::detail::broadcast_tensors;

namespace {

constexpr const char* kOp = "[DistributedDataParallel]";

// One parameter's description, as exchanged at construction.
struct ParamSig {
  int64_t dtype = 0;
  int64_t requires_grad = 0;
  std::vector<int64_t> shape;
  bool operator==(const ParamSig&) const = default;
};

std::string describe(const ParamSig& s) {
  std::ostringstream os;
  os << "shape [";
  for (size_t i = 0; i < s.shape.size(); ++i) os << (i ? ", " : "") << s.shape[i];
  os << "] " << static_cast<Dtype>(s.dtype) << (s.requires_grad ? "" : " (no grad)");
  return os.str();
}

// Parses a signature [count, (dtype, requires_grad, ndim, dims...)*] (padded with -1).
std::vector<ParamSig> decode(const int64_t* v, int64_t len) {
  std::vector<ParamSig> out;
  if (len < 1) return out;
  const int64_t count = v[0];
  int64_t k = 1;
  for (int64_t i = 0; i < count && k + 3 <= len; ++i) {
    ParamSig s;
    s.dtype = v[k];
    s.requires_grad = v[k + 1];
    const int64_t nd = v[k + 2];
    k += 3;
    for (int64_t d = 0; d < nd && k < len; ++d) s.shape.push_back(v[k++]);
    out.push_back(std::move(s));
  }
  return out;
}

// The positions in `named` (a module's named_parameters()) of the parameters DDP synchronises:
// all but the ignored ones, each of which must be one of them.
std::vector<size_t> synchronised_positions(const nn::NamedTensors& named,
                                           const std::vector<std::string>& ignored) {
  for (const std::string& name : ignored) {
    EMBER_CHECK(
        std::any_of(named.begin(), named.end(), [&](const auto& p) { return p.first == name; }),
        kOp, " ignored_parameters names '", name, "', which is not a parameter of the module");
  }
  std::vector<size_t> kept;
  for (size_t i = 0; i < named.size(); ++i) {
    if (std::find(ignored.begin(), ignored.end(), named[i].first) == ignored.end()) {
      kept.push_back(i);
    }
  }
  return kept;
}

// Every rank must hold the same parameters: gathers each rank's signature and throws the same
// ValueError on every rank, naming the first parameter that differs and a rank that differs.
void check_same_parameters(ProcessGroup& pg, const nn::NamedTensors& named) {
  std::vector<int64_t> sig{static_cast<int64_t>(named.size())};
  for (const auto& [name, t] : named) {
    sig.push_back(static_cast<int64_t>(t.dtype()));
    sig.push_back(t.requires_grad() ? 1 : 0);
    sig.push_back(t.dim());
    for (int64_t d : t.shape()) sig.push_back(d);
  }
  const int n = pg.size();
  const Device dev = pg.default_device();
  Tensor len = from_vector(std::vector<int64_t>{static_cast<int64_t>(sig.size())}).to(dev);
  Tensor lens = zeros({n}, TensorOptions(kInt64).device(dev));
  pg.allgather_into_tensor(lens, len)->wait();
  int64_t max_len = 0;
  for (int64_t l : lens.to_vector<int64_t>()) max_len = std::max(max_len, l);
  sig.resize(max_len, -1);
  Tensor mine = from_vector(sig).to(dev);
  Tensor all = zeros({n * max_len}, TensorOptions(kInt64).device(dev));
  pg.allgather_into_tensor(all, mine)->wait();
  const std::vector<int64_t> v = all.to_vector<int64_t>();
  std::vector<std::vector<ParamSig>> sigs;
  for (int r = 0; r < n; ++r) sigs.push_back(decode(v.data() + r * max_len, max_len));
  // The first parameter index at which some rank differs from rank 0, then the first such rank.
  size_t common = sigs[0].size();
  for (const auto& s : sigs) common = std::min(common, s.size());
  for (size_t i = 0; i < common; ++i) {
    for (int r = 1; r < n; ++r) {
      if (sigs[r][i] == sigs[0][i]) continue;
      const std::string name = i < named.size() ? named[i].first : "?";
      throw ValueError(dist::detail::str_cat(
          kOp, " parameter ", i, " ('", name, "' on rank ", pg.rank(),
          ") differs across ranks: rank 0 has ", describe(sigs[0][i]), ", rank ", r, " has ",
          describe(sigs[r][i]), "; every rank must wrap the same model"));
    }
  }
  for (int r = 1; r < n; ++r) {
    EMBER_CHECK(sigs[r].size() == sigs[0].size(), kOp, " rank 0 has ", sigs[0].size(),
                " parameters but rank ", r, " has ", sigs[r].size(),
                "; every rank must wrap the same model");
  }
}

int64_t log_every_from_env() {
  const char* env = std::getenv("EMBER_DDP_LOG_EVERY");
  if (env == nullptr || *env == '\0') return 100;
  char* end = nullptr;
  const long long v = std::strtoll(env, &end, 10);
  EMBER_CHECK(end != env && *end == '\0' && v > 0,
              "[EMBER_DDP_LOG_EVERY] expected a positive "
              "number of iterations, got '",
              env, "'");
  return v;
}

}  // namespace

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<nn::Module> module,
                                                 std::shared_ptr<ProcessGroup> group,
                                                 DDPOptions options)
    : module_(std::move(module)), group_(std::move(group)), options_(options) {
  EMBER_CHECK(module_ != nullptr, kOp, " expected a module, got null");
  EMBER_CHECK(options_.bucket_cap_mb > 0, kOp, " bucket_cap_mb must be > 0, got ",
              options_.bucket_cap_mb);
  EMBER_CHECK(options_.first_bucket_cap_mb > 0, kOp, " first_bucket_cap_mb must be > 0, got ",
              options_.first_bucket_cap_mb);
  if (!group_) group_ = default_group();
  const DebugLevel level = debug_level();
  comm_ = level == DebugLevel::Detail ? std::make_shared<CheckedProcessGroup>(group_) : group_;
  register_module("module", module_);

  // Positions stay the module's (ReducerParam::index, bucket_indices()) when some are ignored.
  const nn::NamedTensors all = module_->named_parameters();
  const std::vector<size_t> kept = synchronised_positions(all, options_.ignored_parameters);
  nn::NamedTensors named;
  std::vector<Tensor> tensors;
  for (size_t i : kept) {
    named.push_back(all[i]);
    tensors.push_back(all[i].second);
  }
  check_same_parameters(*comm_, named);
  broadcast_tensors(*comm_, tensors);
  broadcast_tensors(*comm_, module_->buffers());

  std::vector<dist::detail::ReducerParam> params;
  for (size_t i : kept) {
    if (all[i].second.requires_grad()) params.push_back({all[i].first, all[i].second, i});
  }
  const bool info = level != DebugLevel::Off;
  reducer_ = std::make_shared<dist::detail::Reducer>(comm_, options_, std::move(params), info,
                                                      info ? log_every_from_env() : 100);
  reducer_->register_hooks();  // last: nothing after it may throw
}

DistributedDataParallel::~DistributedDataParallel() {
  if (!reducer_) return;
  reducer_->remove_hooks();
  // A backward pass that threw before its end leaves launched all-reduces behind: let them
  // finish before their buffers are freed.
  (void)reducer_->wait_all();
}

template <typename Run>
auto DistributedDataParallel::run_forward(Run&& run) {
  dist::detail::Reducer& r = *reducer_;
  const bool grad = GradMode::is_enabled();
  // A forward without autograd (an evaluation between a training forward and its backward)
  // leaves the reducer as it is, so that pending backward stays synchronised (PyTorch touches
  // the reducer only when grad is enabled too).
  if (grad) r.prepare_for_forward();
  dist::detail::IterationPlan plan;
  plan.sync = r.sync_enabled() && grad;
  plan.rebuild = r.rebuild_due() && grad;
  plan.buffers = options_.broadcast_buffers && is_training();
  plan.used_map = plan.sync && r.uses_used_map();
  int source = 0;
  if (join_) source = join_->enter_iteration(*comm_, plan, r);
  if (plan.rebuild) r.rebuild();
  if (plan.buffers) broadcast_tensors(*comm_, module_->buffers(), source);
  if (grad) r.forward_started();
  auto out = run();
  if (grad) r.prepare_for_backward(plan.sync);
  return out;
}

Tensor DistributedDataParallel::forward(const Tensor& input) {
  return run_forward([&] { return module_->forward(input); });
}

std::vector<Tensor> DistributedDataParallel::forward_many(const std::vector<Tensor>& inputs) {
  return run_forward([&] { return module_->forward_many(inputs); });
}

void DistributedDataParallel::prepare_for_backward() {
  dist::detail::Reducer& r = *reducer_;
  EMBER_CHECK(r.sync_enabled(), "[DistributedDataParallel::prepare_for_backward] called under "
              "no_sync(): leave the guard's scope first");
  EMBER_CHECK(!join_, "[DistributedDataParallel::prepare_for_backward] not supported inside join()");
  r.prepare_for_forward();
  r.prepare_for_backward(true);
}

DistributedDataParallel::NoSyncGuard::NoSyncGuard(DistributedDataParallel& ddp)
    : ddp_(ddp), previous_(ddp.reducer_->sync_enabled()) {
  ddp_.reducer_->set_sync_enabled(false);
}

DistributedDataParallel::NoSyncGuard::~NoSyncGuard() { ddp_.reducer_->set_sync_enabled(previous_); }

bool DistributedDataParallel::buckets_rebuilt() const { return reducer_->buckets_rebuilt(); }

std::vector<std::vector<size_t>> DistributedDataParallel::bucket_indices() const {
  return reducer_->bucket_indices();
}

namespace {

// The name stats() reports for a hook registered without one.
std::string builtin_hook_name(const CommHook& hook) {
  using Fn = std::shared_ptr<Future> (*)(GradBucket&);
  const Fn* fn = hook.target<Fn>();
  if (fn == nullptr) return "custom";
  if (*fn == &allreduce_hook) return "allreduce";
  if (*fn == &fp16_compress_hook) return "fp16_compress";
  if (*fn == &bf16_compress_hook) return "bf16_compress";
  if (*fn == &noop_hook) return "noop";
  return "custom";
}

}  // namespace

void DistributedDataParallel::register_comm_hook(CommHook hook, std::string name) {
  EMBER_CHECK(hook != nullptr, kOp, " register_comm_hook expects a hook, got null");
  if (name.empty()) name = builtin_hook_name(hook);
  reducer_->set_comm_hook(std::move(hook), std::move(name));
}

DDPStats DistributedDataParallel::stats() const {
  DDPStats s;
  s.world_size = group_->size();
  s.rank = group_->rank();
  s.backend = group_->backend_name();
  s.bucket_cap_mb = options_.bucket_cap_mb;
  s.find_unused_parameters = options_.find_unused_parameters;
  s.static_graph = options_.static_graph;
  s.gradient_as_bucket_view = options_.gradient_as_bucket_view;
  reducer_->fill_stats(s);
  return s;
}

void DistributedDataParallel::join(const std::function<void()>& body, JoinOptions options) {
  EMBER_CHECK(body != nullptr, "[DistributedDataParallel] join expects a body, got null");
  EMBER_CHECK(!join_, "[DistributedDataParallel] join: already inside join(); it cannot be nested");
  if (!options.enable || group_->size() == 1) {
    body();
    return;
  }
  join_ = std::make_unique<dist::detail::JoinContext>(options);
  struct Leave {
    DistributedDataParallel& ddp;
    ~Leave() {
      ddp.join_.reset();
      ddp.reducer_->set_averaging(dist::detail::Averaging());
    }
  } leave{*this};
  body();
  // Out of data: shadow the others until a round finds nobody with data.
  reducer_->prepare_for_forward();
  join_->shadow_others(*comm_, *reducer_,
                       [this](int root) { broadcast_tensors(*comm_, module_->buffers(), root); });
  // Every rank saw the same rounds, so all agree on the authoritative copy. No round with
  // data: nothing to sync.
  const int source = join_->authoritative_rank();
  if (source >= 0) {
    const nn::NamedTensors all = module_->named_parameters();
    std::vector<Tensor> params;
    for (size_t i : synchronised_positions(all, options_.ignored_parameters)) {
      params.push_back(all[i].second);
    }
    broadcast_tensors(*comm_, params, source);
    broadcast_tensors(*comm_, module_->buffers(), source);
  }
}

}  // namespace ember::dist
