#include "distributed/ddp.h"

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
// after it are all-reduced (launching strictly in bucket order keeps the collective sequence
// identical on every rank even if gradients arrive in a different order). The first hook of the
// iteration queues an autograd callback (finalize) that runs once the backward pass is over:
// it deals with parameters that got no gradient, waits for every bucket and writes the averages
// back into grad(). Hooks hold a weak_ptr, so they are harmless after the DDP object is gone
// (leaf hooks cannot be removed).
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
    size_t pending = 0;
    WorkPtr work;
    bool launched = false;
  };

  std::shared_ptr<ProcessGroup> group;
  DDPOptions options;
  std::vector<Param> params;  // requiring grad, in registration order
  std::vector<Bucket> buckets;
  bool armed = false;
  bool callback_queued = false;
  size_t next_launch = 0;

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
      b.work.reset();
      b.launched = false;
    }
  }

  void launch(Bucket& b) {
    b.launched = true;
    if (group->size() == 1) return;  // the average of one rank is its own gradient
    AllreduceOptions o;
    o.op = ReduceOp::Avg;
    b.work = group->allreduce(b.flat, o);
  }

  void launch_ready() {
    while (next_launch < buckets.size() && buckets[next_launch].pending == 0) {
      launch(buckets[next_launch++]);
    }
  }

  void on_grad_ready(const std::shared_ptr<Reducer>& self, size_t i) {
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
  // remembering the first error.
  std::exception_ptr wait_all() {
    std::exception_ptr first;
    for (auto& b : buckets) {
      if (!b.work) continue;
      try {
        b.work->wait();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    return first;
  }

  void finalize() {
    if (!armed) return;
    std::vector<std::string> unused;
    for (const auto& p : params) {
      if (!p.ready) unused.push_back(p.name);
    }
    std::vector<char> locally_used(params.size(), 1);
    if (!unused.empty()) {
      if (!options.find_unused_parameters) {
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
      launch_ready();
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
  // order), one open bucket per (dtype, device); a bucket closes once it reaches the cap.
  const double cap_bytes = options_.bucket_cap_mb * 1024 * 1024;
  std::vector<std::vector<size_t>> closed;
  std::map<std::pair<int, std::string>, std::vector<size_t>> open;
  std::vector<std::pair<int, std::string>> open_order;
  std::map<std::pair<int, std::string>, double> open_bytes;
  for (size_t k = reducer->params.size(); k-- > 0;) {
    const Tensor& t = reducer->params[k].tensor;
    const auto key = std::make_pair(static_cast<int>(t.dtype()), t.device().str());
    if (!open.count(key)) open_order.push_back(key);
    open[key].push_back(k);
    open_bytes[key] += static_cast<double>(t.nbytes());
    if (open_bytes[key] >= cap_bytes) {
      closed.push_back(std::move(open[key]));
      open.erase(key);
      open_bytes.erase(key);
      std::erase(open_order, key);
    }
  }
  for (const auto& key : open_order) closed.push_back(std::move(open[key]));
  for (auto& members : closed) {
    detail::Reducer::Bucket b;
    int64_t numel = 0;
    for (size_t k : members) {
      auto& p = reducer->params[k];
      p.bucket = reducer->buckets.size();
      p.offset = numel;
      numel += p.tensor.numel();
    }
    const Tensor& first = reducer->params[members.front()].tensor;
    b.flat = zeros({numel}, first.options());
    b.params = std::move(members);
    b.pending = b.params.size();
    reducer->buckets.push_back(std::move(b));
  }
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
  Tensor out = module_->forward(input);
  reducer_->armed = require_sync_ && GradMode::is_enabled();
  return out;
}

DistributedDataParallel::NoSyncGuard::NoSyncGuard(DistributedDataParallel& ddp)
    : ddp_(ddp), previous_(ddp.require_sync_) {
  ddp_.require_sync_ = false;
}

DistributedDataParallel::NoSyncGuard::~NoSyncGuard() { ddp_.require_sync_ = previous_; }

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
