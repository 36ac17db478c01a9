#include <ember/distributed/sharding/zero_hook.h>

#include <numeric>

#include <ember/distributed/ddp/ddp.h>
#include <ember/distributed/errors.h>
#include <ember/distributed/sharding/detail/zero_overlap.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/grad_mode.h>
#include <ember/tensor/ops/indexing.h>

namespace ember::dist::detail {

constexpr const char* kHook = "[hook_with_zero_step]";

namespace {

constexpr const char* kZero = "[ZeroRedundancyOptimizer]";

// Every gradient of the wrapped optimizer's parameters but those of one bucket hidden for one
// step(), so it updates only that bucket's parameters (optimizers skip parameters without a
// gradient); what DDP left in grad() comes back afterwards, also if the step throws.
class OnlyTheseGradients {
 public:
  OnlyTheseGradients(const std::vector<Tensor>& params, std::vector<Tensor> grads) {
    for (size_t k = 0; k < params.size(); ++k) {
      saved_.emplace_back(params[k], params[k].grad());
      params[k].set_grad(grads[k]);
    }
  }
  ~OnlyTheseGradients() {
    for (auto& [p, g] : saved_) p.set_grad(g);
  }
  OnlyTheseGradients(const OnlyTheseGradients&) = delete;
  OnlyTheseGradients& operator=(const OnlyTheseGradients&) = delete;

 private:
  std::vector<std::pair<Tensor, Tensor>> saved_;
};

// A parameter at least this large is broadcast where it lies, into every rank's parameter; the
// smaller ones of a rank (biases, norms) travel packed in one buffer, since one call each would
// cost more in latency than their bytes. Packing everything would hold a second copy of the
// model while the broadcasts of every bucket are in flight: as much memory as ZeRO saves at 2
// ranks.
constexpr int64_t kPackBelowBytes = int64_t{64} << 10;

// The element counts of params[i] for i in `which`, in order: a packed broadcast's layout.
std::vector<int64_t> numels(const std::vector<Tensor>& params, const std::vector<size_t>& which) {
  std::vector<int64_t> n;
  for (size_t i : which) n.push_back(params[i].numel());
  return n;
}

}  // namespace

// One bucket's broadcasts, from the first deferred step to the second: per sending rank, its
// small parameters of the bucket (indices into zero) and the buffer they travel in.
struct ZeroOverlap::Sends {
  std::vector<std::vector<size_t>> packed;  // [rank] -> parameter indices, in bucket order
  std::vector<Tensor> buffers;              // [rank], undefined where nothing is packed
  std::vector<dist::WorkPtr> works;
};

ZeroOverlap::ZeroOverlap(dist::ZeroRedundancyOptimizer& zero)
    : zero_(&zero), updated_(zero.params_.size(), 0) {
  for (size_t i = 0; i < zero.params_.size(); ++i) index_.emplace(zero.params_[i].impl(), i);
}

std::shared_ptr<ZeroOverlap> ZeroOverlap::of(dist::ZeroRedundancyOptimizer& zero) {
  return zero.overlap_;
}

dist::ZeroRedundancyOptimizer& ZeroOverlap::zero() const {
  EMBER_CHECK(zero_ != nullptr, kHook,
              " the ZeroRedundancyOptimizer this hook updates was destroyed while DDP still "
              "uses the hook: keep the optimizer alive as long as the DDP model trains");
  return *zero_;
}

void ZeroOverlap::attach(const dist::DistributedDataParallel& ddp) {
  dist::ZeroRedundancyOptimizer& z = zero();
  EMBER_CHECK(ddp_ == nullptr || ddp_ == &ddp, kHook,
              " this ZeroRedundancyOptimizer already has a hook for another "
              "DistributedDataParallel: one optimizer updates the parameters of one DDP model");
  const dist::ProcessGroup& g = *ddp.process_group();
  EMBER_CHECK(g.size() == z.group_->size() && g.rank() == z.group_->rank(), kHook,
              " DDP's process group (rank ", g.rank(), " of ", g.size(),
              ") is not the ZeroRedundancyOptimizer's (rank ", z.group_->rank(), " of ",
              z.group_->size(), "): build both over the same group");
  std::vector<char> in_ddp(z.params_.size(), 0);
  for (const auto& [name, p] : ddp.named_parameters()) {
    if (!p.requires_grad()) continue;
    auto it = index_.find(p.impl());
    EMBER_CHECK(it != index_.end(), kHook, " DDP's parameter '", name,
                "' is not one of the ZeroRedundancyOptimizer's: it would be reduced but never "
                "updated. Build the optimizer over ddp.parameters() (those requiring grad)");
    in_ddp[it->second] = 1;
  }
  for (size_t i = 0; i < in_ddp.size(); ++i) {
    EMBER_CHECK(in_ddp[i], kHook, " the ZeroRedundancyOptimizer's parameter ", i, " (shape ",
                z.params_[i].shape(),
                ") is not a parameter of the DDP model that requires grad: no bucket would "
                "update it. Build the optimizer over ddp.parameters()");
  }
  ddp_ = &ddp;
}

std::vector<size_t> ZeroOverlap::indices_of(const dist::GradBucket& bucket) const {
  std::vector<size_t> out;
  for (const Tensor& p : bucket.parameters()) {
    auto it = index_.find(p.impl());
    EMBER_CHECK(it != index_.end(), kHook, " bucket ", bucket.index(),
                " holds a parameter (shape ", p.shape(),
                ") that the ZeroRedundancyOptimizer does not hold");
    out.push_back(it->second);
  }
  return out;
}

std::shared_ptr<dist::Future> ZeroOverlap::on_bucket(dist::GradBucket& bucket,
                                                     const dist::CommHook& inner) {
  (void)zero();  // before the inner hook's collective: every rank fails alike, nothing in flight
  std::shared_ptr<dist::Future> reduced = inner(bucket);
  EMBER_CHECK(reduced != nullptr, kHook, " the wrapped hook returned a null future for bucket ",
              bucket.index());
  hook_ran_ = true;
  auto self = shared_from_this();
  auto index = std::make_shared<const std::vector<size_t>>(indices_of(bucket));
  auto sends = std::make_shared<Sends>();
  const dist::GradBucket b = bucket;  // deferred steps outlive the hook's argument
  auto sent = bucket.defer(reduced, [self, b, index, sends](dist::Future& f) {
    const std::vector<Tensor>& v = f.value();
    return self->update(b, *index, v.empty() ? Tensor() : v[0], *sends);
  });
  return bucket.defer(sent, [self, index, sends, reduced](dist::Future&) {
    dist::ZeroRedundancyOptimizer& z = self->zero();
    const int me = z.group_->rank();
    NoGradGuard no_grad;
    for (auto& w : sends->works) w->wait();
    for (size_t r = 0; r < sends->packed.size(); ++r) {
      const std::vector<size_t>& small = sends->packed[r];
      if (static_cast<int>(r) == me || small.empty()) continue;
      const std::vector<Tensor> parts = split_with_sizes(sends->buffers[r], numels(z.params_, small));
      for (size_t k = 0; k < small.size(); ++k) {
        z.params_[small[k]].detach().view({-1}).copy_(parts[k]);
      }
    }
    return dist::completed_future({reduced->value()[0]});
  });
}

// The first deferred step of a bucket: this rank's update of its parameters in the bucket, then
// every owner's broadcast of its updated parameters (the same sequence on every rank).
std::shared_ptr<dist::Future> ZeroOverlap::update(const dist::GradBucket& bucket,
                                                  const std::vector<size_t>& index,
                                                  const Tensor& reduced, Sends& sends) {
  dist::ZeroRedundancyOptimizer& z = zero();
  const int world = z.group_->size(), me = z.group_->rank();
  EMBER_CHECK(reduced.defined() && reduced.numel() == bucket.buffer().numel(), kHook,
              " the wrapped hook's result for bucket ", bucket.index(), " must hold ",
              bucket.buffer().numel(), " elements, got ",
              reduced.defined() ? std::to_string(reduced.numel()) : std::string("none"));
  step_local(bucket, index, reduced);
  count_updated(bucket.index(), index);
  if (world == 1) return dist::completed_future({});
  // DDP's group (under EMBER_DISTRIBUTED_DEBUG=DETAIL its checked wrapper), so the broadcasts
  // take their place in the sequence DDP's checks see; attach() made sure the ranks agree.
  dist::ProcessGroup& group = bucket.process_group();
  NoGradGuard no_grad;
  sends.packed.assign(static_cast<size_t>(world), {});
  sends.buffers.assign(static_cast<size_t>(world), Tensor());
  std::vector<std::vector<size_t>> direct(static_cast<size_t>(world));
  for (size_t i : index) {
    const Tensor& p = z.params_[i];
    const bool pack = p.nbytes() < kPackBelowBytes || !p.is_contiguous();
    (pack ? sends.packed : direct)[static_cast<size_t>(z.owner_[i])].push_back(i);
  }
  for (int r = 0; r < world; ++r) {
    dist::BroadcastOptions o;
    o.root = r;
    if (const auto& small = sends.packed[static_cast<size_t>(r)]; !small.empty()) {
      Tensor buffer;
      if (r == me) {
        std::vector<Tensor> flat;
        for (size_t i : small) flat.push_back(z.params_[i].detach().reshape({-1}));
        buffer = cat(flat);
      } else {
        const std::vector<int64_t> n = numels(z.params_, small);
        buffer = empty({std::accumulate(n.begin(), n.end(), int64_t{0})},
                       z.params_[small.front()].options());
      }
      sends.works.push_back(group.broadcast(buffer, o));
      sends.buffers[static_cast<size_t>(r)] = buffer;
    }
    for (size_t i : direct[static_cast<size_t>(r)]) {
      Tensor p = z.params_[i].detach();
      sends.works.push_back(group.broadcast(p, o));
    }
  }
  return sends.works.back()->future();
}

// The wrapped optimizer's step over this rank's parameters of the bucket, each with its slice of
// the reduced bucket as gradient.
void ZeroOverlap::step_local(const dist::GradBucket& bucket, const std::vector<size_t>& index,
                             const Tensor& reduced) {
  dist::ZeroRedundancyOptimizer& z = zero();
  const int me = z.group_->rank();
  std::unordered_map<size_t, Tensor> grad_of;  // zero index -> its reduced gradient
  const Tensor flat = reduced.reshape({-1});
  int64_t at = 0;
  for (size_t k = 0; k < index.size(); ++k) {
    const Tensor& p = bucket.parameters()[k];
    const int64_t n = p.numel();
    if (z.owner_[index[k]] == me) {
      Tensor g = flat.narrow(0, at, n).view(p.shape());
      if (g.dtype() != p.dtype()) g = g.to(p.dtype());
      grad_of.emplace(index[k], g);
    }
    at += n;
  }
  if (grad_of.empty()) return;
  std::vector<Tensor> params, grads;
  for (size_t i : z.local_) {
    params.push_back(z.params_[i]);
    auto it = grad_of.find(i);
    grads.push_back(it == grad_of.end() ? Tensor() : it->second);
  }
  OnlyTheseGradients only(params, std::move(grads));
  z.local_opt_->step();
}

// Bucket 0's update starts an iteration (the buckets' first deferred steps run in bucket order);
// the update that completes the set of parameters completes it.
void ZeroOverlap::count_updated(size_t bucket_index, const std::vector<size_t>& index) {
  if (bucket_index == 0) {
    std::fill(updated_.begin(), updated_.end(), 0);
    updated_count_ = 0;
  }
  for (size_t i : index) {
    if (!updated_[i]) ++updated_count_;
    updated_[i] = 1;
  }
  if (updated_count_ < updated_.size()) return;
  ++iterations_;
  ++zero().steps_;
  std::fill(updated_.begin(), updated_.end(), 0);
  updated_count_ = 0;
}

void ZeroOverlap::check_step() {
  if (iterations_ > iterations_at_step_) {
    iterations_at_step_ = iterations_;
    return;
  }
  const int rank = zero().group_->rank();
  EMBER_CHECK(hook_ran_, kZero, " step() on rank ", rank,
              ": built with overlap_with_ddp, the parameters are updated by DDP's communication "
              "hook during backward, but no backward pass has run that hook.\n  Register it before "
              "the first backward: ddp.register_comm_hook(dist::hook_with_zero_step("
              "dist::allreduce_hook, ddp, zero)) (distributed/sharding/zero_hook.h), or build the "
              "optimizer without overlap_with_ddp");
  EMBER_CHECK(false, kZero, " step() on rank ", rank,
              ": no synchronised backward pass has updated the parameters since the last "
              "step().\n  With overlap_with_ddp the update happens in DDP's backward; a backward "
              "under no_sync() only accumulates gradients, so call step() after the backward "
              "outside no_sync() that ends the accumulation (and once per such backward)");
}

}  // namespace ember::dist::detail

namespace ember::dist {

CommHook hook_with_zero_step(CommHook hook, DistributedDataParallel& ddp,
                             ZeroRedundancyOptimizer& zero) {
  using dist::detail::kHook;
  EMBER_CHECK(hook != nullptr, kHook, " expects a hook to wrap (e.g. dist::allreduce_hook), got "
              "null");
  std::shared_ptr<dist::detail::ZeroOverlap> overlap = dist::detail::ZeroOverlap::of(zero);
  EMBER_CHECK(overlap != nullptr, kHook,
              " the ZeroRedundancyOptimizer was built without overlap_with_ddp: build it with "
              "ZeroOptions{.overlap_with_ddp = true} (otherwise its step() would update the "
              "parameters a second time), or register the plain hook without it");
  overlap->attach(ddp);
  return [overlap, hook = std::move(hook)](GradBucket& bucket) {
    return overlap->on_bucket(bucket, hook);
  };
}

}  // namespace ember::dist
