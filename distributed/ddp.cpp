#include "distributed/ddp.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <utility>

#include "autograd/engine.h"
#include "distributed/init.h"
#include "tensor/creation.h"
#include "tensor/grad_mode.h"

namespace ember::dist {

namespace detail {

// Note [DDP reducer]: the per-iteration state machine behind DistributedDataParallel.
// forward() arms it; each parameter's post-accumulate-grad hook copies the gradient into its
// bucket slot; when the lowest not-yet-launched bucket is complete, it and every complete bucket
// after it are launched (all-reduced, or handed to the communication hook); launching strictly
// in bucket order keeps the collective sequence identical on every rank even if gradients arrive
// in a different order. The first hook of the iteration queues an autograd callback (finalize)
// that runs once the backward pass is over: it deals with parameters that got no gradient, runs
// the hooks' deferred steps (Note [comm hook ordering]), waits for every bucket and writes the
// averages back into grad(). Hooks hold a weak_ptr, so they are harmless after the DDP object is
// gone (leaf hooks cannot be removed).
//
// Note [bucket rebuild]: the first synchronised backward pass records the order in which
// gradients became ready. At the next forward (with grad mode on) rank 0 broadcasts its order
// and every rank rebuilds the same buckets from it (torch's _rebuild_buckets), once. Collective:
// every rank reaches it at the same forward because every rank finalizes the same iterations.
struct Reducer {
  struct Param {
    Tensor tensor;
    std::string name;
    size_t index = 0;  // position in module->parameters()
    size_t bucket = 0;
    int64_t offset = 0;  // in elements, into the bucket's flat buffer
    bool ready = false;
  };
  struct Bucket {
    Tensor flat;
    std::vector<size_t> params;  // into Reducer::params
    std::vector<Tensor> tensors;  // the parameters, for GradBucket
    std::vector<size_t> module_indices;
    size_t pending = 0;
    std::shared_ptr<Future> future;  // the all-reduce's or the hook's
    bool launched = false;
  };

  std::shared_ptr<ProcessGroup> group;
  DDPOptions options;
  std::vector<Param> params;  // requiring grad, in registration order
  std::vector<Bucket> buckets;
  bool armed = false;
  bool callback_queued = false;
  size_t next_launch = 0;

  CommHook hook;
  std::shared_ptr<DeferredSteps> deferred;
  bool backward_seen = false;
  int64_t finalized = 0;              // synchronised backward passes finalized (or failed)
  std::vector<size_t> arrival;        // into params, in the order gradients became ready
  bool rebuild_done = false;

  Tensor slot(const Param& p) const {
    return buckets[p.bucket].flat.narrow(0, p.offset, p.tensor.numel()).view(p.tensor.shape());
  }

  void reset() {
    armed = false;
    callback_queued = false;
    next_launch = 0;
    for (auto& p : params) p.ready = false;
    for (auto& b : buckets) {
      b.pending = b.params.size();
      b.future.reset();
      b.launched = false;
    }
  }

  // Buckets from an order of parameters (indices into params): one open bucket per (dtype,
  // device); a bucket closes once it reaches its cap (the first of each kind: the first-bucket
  // cap). Buckets are ordered by the position of their first parameter in `order`.
  std::vector<std::vector<size_t>> assign(const std::vector<size_t>& order) const {
    constexpr double kMiB = 1024.0 * 1024.0;
    const double cap = options.bucket_cap_mb * kMiB;
    const double first_cap = std::min(options.first_bucket_cap_mb, options.bucket_cap_mb) * kMiB;
    struct Open {
      std::vector<size_t> members;
      double bytes = 0;
      size_t closed = 0;
    };
    std::map<std::pair<int, std::string>, Open> open;
    std::vector<std::vector<size_t>> out;
    for (size_t k : order) {
      const Tensor& t = params[k].tensor;
      Open& o = open[std::make_pair(static_cast<int>(t.dtype()), t.device().str())];
      o.members.push_back(k);
      o.bytes += static_cast<double>(t.nbytes());
      if (o.bytes >= (o.closed == 0 ? first_cap : cap)) {
        out.push_back(std::move(o.members));
        o.members.clear();
        o.bytes = 0;
        ++o.closed;
      }
    }
    for (auto& [key, o] : open) {
      if (!o.members.empty()) out.push_back(std::move(o.members));
    }
    std::vector<size_t> position(params.size());
    for (size_t i = 0; i < order.size(); ++i) position[order[i]] = i;
    std::stable_sort(out.begin(), out.end(), [&](const auto& a, const auto& b) {
      return position[a.front()] < position[b.front()];
    });
    return out;
  }

  std::vector<std::vector<size_t>> layout() const {
    std::vector<std::vector<size_t>> out;
    for (const auto& b : buckets) out.push_back(b.params);
    return out;
  }

  // Allocates the buckets of `layout`. With gradient_as_bucket_view, a grad() that is a view
  // into an old bucket moves (values and all) into the new bucket.
  void apply(std::vector<std::vector<size_t>> layout) {
    std::vector<Tensor> moved(params.size());
    if (options.gradient_as_bucket_view) {
      for (size_t k = 0; k < params.size(); ++k) {
        const Tensor g = params[k].tensor.grad();
        if (g.defined() && params[k].bucket < buckets.size() &&
            g.storage() == buckets[params[k].bucket].flat.storage()) {
          moved[k] = g;
        }
      }
    }
    std::vector<Bucket> fresh;
    for (auto& members : layout) {
      Bucket b;
      int64_t numel = 0;
      for (size_t k : members) {
        auto& p = params[k];
        p.bucket = fresh.size();
        p.offset = numel;
        numel += p.tensor.numel();
        b.tensors.push_back(p.tensor);
        b.module_indices.push_back(p.index);
      }
      b.flat = zeros({numel}, params[members.front()].tensor.options());
      b.params = std::move(members);
      b.pending = b.params.size();
      fresh.push_back(std::move(b));
    }
    buckets = std::move(fresh);
    deferred = std::make_shared<DeferredSteps>(buckets.size(), group->timeout());
    NoGradGuard no_grad;
    for (size_t k = 0; k < params.size(); ++k) {
      if (!moved[k].defined()) continue;
      Tensor s = slot(params[k]);
      s.copy_(moved[k]);
      params[k].tensor.set_grad(s);
    }
  }

  // Note [bucket rebuild].
  void rebuild() {
    rebuild_done = true;
    if (options.find_unused_parameters) return;  // the recorded order may lack parameters
    const size_t n = params.size();
    std::vector<int64_t> msg(n + 1, 0);
    if (group->rank() == 0 && arrival.size() == n) {
      msg[0] = 1;
      for (size_t i = 0; i < n; ++i) msg[i + 1] = static_cast<int64_t>(arrival[i]);
    }
    arrival.clear();
    arrival.shrink_to_fit();
    if (group->size() > 1) {
      Tensor t = from_vector(msg);
      group->broadcast(t, BroadcastOptions{})->wait();
      msg = t.to_vector<int64_t>();
    }
    if (msg[0] != 1) return;
    std::vector<size_t> order(n);
    std::vector<char> seen(n, 0);
    for (size_t i = 0; i < n; ++i) {
      const int64_t k = msg[i + 1];
      EMBER_INTERNAL_ASSERT(k >= 0 && static_cast<size_t>(k) < n && !seen[k],
                            "[DistributedDataParallel] rank 0's gradient order is not a "
                            "permutation of the ", n, " parameters");
      seen[k] = 1;
      order[i] = static_cast<size_t>(k);
    }
    auto fresh = assign(order);
    if (fresh != layout()) apply(std::move(fresh));
  }

  void launch(size_t index) {
    Bucket& b = buckets[index];
    b.launched = true;
    if (hook) {
      GradBucket gb(index, buckets.size(), b.flat, b.tensors, b.module_indices, group, deferred);
      b.future = hook(gb);
      EMBER_CHECK(b.future != nullptr, "[DistributedDataParallel] the communication hook returned "
                  "a null future for bucket ", index, "; it must return a Future");
      return;
    }
    if (group->size() == 1) return;  // the average of one rank is its own gradient
    AllreduceOptions o;
    o.op = ReduceOp::Avg;
    b.future = group->allreduce(b.flat, o)->future();
  }

  void launch_ready() {
    while (next_launch < buckets.size() && buckets[next_launch].pending == 0) launch(next_launch++);
  }

  void on_grad_ready(const std::shared_ptr<Reducer>& self, size_t i) {
    backward_seen = true;
    if (!armed) return;
    if (!callback_queued) {
      std::weak_ptr<Reducer> weak = self;
      autograd::queue_callback([weak] {
        if (auto r = weak.lock()) r->finalize();
      });
      callback_queued = true;
    }
    Param& p = params[i];
    EMBER_CHECK(!p.ready, "[DistributedDataParallel] parameter '", p.name,
                "' got its gradient twice in one backward pass; this is not supported (use "
                "no_sync() for several backward passes per step)");
    if (!rebuild_done && finalized == 0) arrival.push_back(i);
    const Tensor g = p.tensor.grad();
    Tensor s = slot(p);
    NoGradGuard no_grad;
    if (!g.defined()) {
      s.zero_();
    } else if (g.data_ptr() != s.data_ptr()) {  // gradient_as_bucket_view: already in place
      s.copy_(g);
    }
    p.ready = true;
    if (--buckets[p.bucket].pending == 0) launch_ready();
  }

  // Waits for every launched bucket (so no collective is left running on a buffer we reuse),
  // remembering the first error. Deferred hook steps still queued (a backward pass that threw)
  // are abandoned: their futures fail instead of waiting forever.
  std::exception_ptr wait_all() {
    if (deferred && !deferred->empty()) {
      deferred->abandon(std::make_exception_ptr(DistError(
          "[DistributedDataParallel] the backward pass ended before the communication hook's "
          "deferred steps could run")));
    }
    std::exception_ptr first;
    for (auto& b : buckets) {
      if (!b.future) continue;
      try {
        b.future->wait(group->timeout());
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    return first;
  }

  // A hook's result, checked and copied into its bucket if it lives elsewhere.
  void take_hook_results() {
    NoGradGuard no_grad;
    for (size_t i = 0; i < buckets.size(); ++i) {
      Bucket& b = buckets[i];
      if (!b.future) continue;
      const std::vector<Tensor>& v = b.future->value();
      EMBER_CHECK(!v.empty() && v[0].defined() && v[0].numel() == b.flat.numel(),
                  "[DistributedDataParallel] the communication hook's future for bucket ", i,
                  " must hold a tensor of ", b.flat.numel(), " elements, got ",
                  v.empty() ? std::string("no tensor")
                  : !v[0].defined() ? std::string("an undefined tensor")
                                    : std::to_string(v[0].numel()) + " elements");
      if (v[0].data_ptr() != b.flat.data_ptr() || v[0].dtype() != b.flat.dtype()) {
        b.flat.copy_(v[0].reshape({-1}));
      }
    }
  }

  void finalize() {
    if (!armed) return;
    ++finalized;
    std::vector<std::string> unused;
    for (const auto& p : params) {
      if (!p.ready) unused.push_back(p.name);
    }
    std::vector<char> locally_used(params.size(), 1);
    if (!unused.empty()) {
      if (!options.find_unused_parameters) {
        // The launched buckets' deferred hook steps still run, so every rank that launched
        // them issues the same collectives.
        if (deferred) deferred->run_all();
        std::exception_ptr err = wait_all();
        reset();
        if (err) std::rethrow_exception(err);
        std::ostringstream names;
        for (size_t k = 0; k < unused.size(); ++k)
          names << (k ? ", " : "") << "'" << unused[k] << "'";
        throw ValueError(ember::detail::str_cat(
            "[DistributedDataParallel] rank ", group->rank(), ": ", unused.size(),
            " parameter(s) received no gradient in this backward pass: ", names.str(),
            ". Every parameter that requires grad must take part in computing the loss; "
            "construct DistributedDataParallel with find_unused_parameters = true if some do "
            "not"));
      }
      // Unused here: contribute zeros, so the buckets still complete in order on every rank.
      NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) {
        Param& p = params[i];
        if (p.ready) continue;
        locally_used[i] = 0;
        slot(p).zero_();
        p.ready = true;
        --buckets[p.bucket].pending;
      }
      try {
        launch_ready();
      } catch (...) {
        (void)wait_all();
        reset();
        throw;
      }
    }
    // With find_unused_parameters, a parameter no rank used keeps its grad() (as in torch):
    // one more small all-reduce counts the ranks that used each parameter.
    Tensor global_used;
    WorkPtr used_work;
    if (options.find_unused_parameters && group->size() > 1) {
      std::vector<float> used(locally_used.begin(), locally_used.end());
      global_used = used.empty() ? zeros({0}, kFloat32) : from_vector(used);
      used_work = group->allreduce(global_used, AllreduceOptions{});
    }
    // The hooks' later collectives, in rounds and bucket order (Note [comm hook ordering]).
    if (deferred) deferred->run_all();
    std::exception_ptr err = wait_all();
    if (used_work && !err) {
      try {
        used_work->wait();
      } catch (...) {
        err = std::current_exception();
      }
    }
    std::vector<float> used_counts;
    if (global_used.defined() && !err) used_counts = global_used.to_vector<float>();
    if (hook && !err) {
      try {
        take_hook_results();
      } catch (...) {
        err = std::current_exception();
      }
    }
    if (err) {
      reset();
      std::rethrow_exception(err);
    }
    NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      Param& p = params[i];
      const bool used_anywhere = used_counts.empty() ? locally_used[i] != 0 : used_counts[i] > 0.5f;
      if (!used_anywhere) continue;
      Tensor s = slot(p);
      const Tensor g = p.tensor.grad();
      if (options.gradient_as_bucket_view) {
        if (!g.defined() || g.data_ptr() != s.data_ptr()) p.tensor.set_grad(s);
      } else if (g.defined()) {
        Tensor dst = g;
        dst.copy_(s);
      } else {
        p.tensor.set_grad(s.clone());
      }
    }
    reset();
  }
};

}  // namespace detail

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
  Tensor len = from_vector(std::vector<int64_t>{static_cast<int64_t>(sig.size())});
  Tensor lens = zeros({n}, kInt64);
  pg.allgather_into_tensor(lens, len)->wait();
  int64_t max_len = 0;
  for (int64_t l : lens.to_vector<int64_t>()) max_len = std::max(max_len, l);
  sig.resize(max_len, -1);
  Tensor mine = from_vector(sig);
  Tensor all = zeros({n * max_len}, kInt64);
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
      throw ValueError(ember::detail::str_cat(
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

void broadcast_from_rank0(ProcessGroup& pg, const std::vector<Tensor>& tensors) {
  if (pg.size() == 1) return;
  NoGradGuard no_grad;
  for (const Tensor& t : tensors) {
    Tensor d = t.detach();
    if (d.is_contiguous()) {
      pg.broadcast(d, BroadcastOptions{})->wait();
    } else {
      Tensor c = d.contiguous();
      pg.broadcast(c, BroadcastOptions{})->wait();
      d.copy_(c);
    }
  }
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
  register_module("module", module_);

  const nn::NamedTensors named = module_->named_parameters();
  check_same_parameters(*group_, named);
  broadcast_from_rank0(*group_, module_->parameters());
  broadcast_from_rank0(*group_, module_->buffers());

  auto reducer = std::make_shared<detail::Reducer>();
  reducer->group = group_;
  reducer->options = options_;
  for (size_t i = 0; i < named.size(); ++i) {
    if (!named[i].second.requires_grad()) continue;
    detail::Reducer::Param p;
    p.tensor = named[i].second;
    p.name = named[i].first;
    p.index = i;
    reducer->params.push_back(std::move(p));
  }

  // Buckets: parameters in reverse registration order (gradients arrive roughly in that
  // order) until the rebuild (Note [bucket rebuild]).
  std::vector<size_t> reverse(reducer->params.size());
  for (size_t k = 0; k < reverse.size(); ++k) reverse[k] = reverse.size() - 1 - k;
  reducer->apply(reducer->assign(reverse));
  reducer_ = reducer;

  std::weak_ptr<detail::Reducer> weak = reducer;
  for (size_t k = 0; k < reducer->params.size(); ++k) {
    reducer->params[k].tensor.register_post_accumulate_grad_hook([weak, k](const Tensor&) {
      if (auto r = weak.lock()) r->on_grad_ready(r, k);
    });
  }
}

// A backward pass that threw before its end leaves launched all-reduces behind: let them finish
// (bounded by the group's timeout) before their buffers are reused or freed.
DistributedDataParallel::~DistributedDataParallel() {
  if (reducer_) (void)reducer_->wait_all();
}

Tensor DistributedDataParallel::forward(const Tensor& input) {
  if (options_.broadcast_buffers && is_training()) {
    broadcast_from_rank0(*group_, module_->buffers());
  }
  (void)reducer_->wait_all();
  reducer_->reset();
  if (!reducer_->rebuild_done && reducer_->finalized > 0 && GradMode::is_enabled()) {
    reducer_->rebuild();
  }
  Tensor out = module_->forward(input);
  reducer_->armed = require_sync_ && GradMode::is_enabled();
  return out;
}

DistributedDataParallel::NoSyncGuard::NoSyncGuard(DistributedDataParallel& ddp)
    : ddp_(ddp), previous_(ddp.require_sync_) {
  ddp_.require_sync_ = false;
}

DistributedDataParallel::NoSyncGuard::~NoSyncGuard() { ddp_.require_sync_ = previous_; }

bool DistributedDataParallel::buckets_rebuilt() const { return reducer_->rebuild_done; }

void DistributedDataParallel::register_comm_hook(CommHook hook) {
  EMBER_CHECK(hook != nullptr, kOp, " register_comm_hook expects a hook, got null");
  EMBER_CHECK(!reducer_->hook, kOp,
              " a communication hook is already registered; register_comm_hook can be called "
              "only once");
  EMBER_CHECK(!reducer_->backward_seen, kOp,
              " register_comm_hook must be called before the first backward pass, got a call "
              "after one had run");
  reducer_->hook = std::move(hook);
}

std::vector<std::vector<size_t>> DistributedDataParallel::bucket_indices() const {
  std::vector<std::vector<size_t>> out;
  for (const auto& b : reducer_->buckets) {
    std::vector<size_t> idx;
    for (size_t k : b.params) idx.push_back(reducer_->params[k].index);
    out.push_back(std::move(idx));
  }
  return out;
}

}  // namespace ember::dist
