// The reducer's bucket layout: the initial assignment, the one-time rebuild, and the layout log.
#include <algorithm>
#include <iostream>
#include <map>
#include <sstream>
#include <utility>

#include <ember/distributed/ddp/detail/reducer.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/grad_mode.h>
#include <ember/tensor/observe/log.h>

namespace ember::dist::detail {

Reducer::Reducer(std::shared_ptr<dist::ProcessGroup> group, const dist::DDPOptions& options,
                 std::vector<ReducerParam> params, bool info, int64_t log_every)
    : group_(std::move(group)), options_(options), info_(info), log_every_(log_every) {
  for (auto& p : params) {
    Param q;
    q.tensor = std::move(p.tensor);
    q.name = std::move(p.name);
    q.index = p.index;
    params_.push_back(std::move(q));
  }
  // Parameters in reverse registration order (gradients arrive roughly in that order) until
  // the rebuild (Note [bucket rebuild]).
  std::vector<size_t> reverse(params_.size());
  for (size_t k = 0; k < reverse.size(); ++k) reverse[k] = reverse.size() - 1 - k;
  apply(assign(reverse));
  if (info_) log_layout("at construction (reverse registration order)");
}

Tensor Reducer::slot(const Param& p) const {
  return buckets_[p.bucket].flat.narrow(0, p.offset, p.tensor.numel()).view(p.tensor.shape());
}

void Reducer::log(const std::string& line) const {
  logging::info("[ddp rank ", group_->rank(), "] ", line);
}

// One line: every bucket's size, dtype and parameter names (at most 8 shown per bucket).
void Reducer::log_layout(const std::string& when) const {
  std::ostringstream os;
  os << buckets_.size() << " bucket(s) " << when << ":";
  for (size_t i = 0; i < buckets_.size(); ++i) {
    const Bucket& b = buckets_[i];
    os << (i ? ";" : "") << " [" << i << "] " << b.flat.nbytes() << " B " << b.flat.dtype() << " "
       << b.flat.device() << " {";
    for (size_t k = 0; k < b.params.size(); ++k) {
      if (k == 8) {
        os << ", ... " << b.params.size() - 8 << " more";
        break;
      }
      os << (k ? ", " : "") << params_[b.params[k]].name;
    }
    os << "}";
  }
  log(os.str());
}

// Buckets from an order of parameters (indices into params_): one open bucket per (dtype,
// device); a bucket closes once it reaches its cap (the first of each kind: the first-bucket
// cap). Buckets are ordered by the position of their first parameter in `order`.
std::vector<std::vector<size_t>> Reducer::assign(const std::vector<size_t>& order) const {
  constexpr double kMiB = 1024.0 * 1024.0;
  const double cap = options_.bucket_cap_mb * kMiB;
  const double first_cap = std::min(options_.first_bucket_cap_mb, options_.bucket_cap_mb) * kMiB;
  struct Open {
    std::vector<size_t> members;
    double bytes = 0;
    size_t closed = 0;
  };
  std::map<std::pair<int, std::string>, Open> open;
  std::vector<std::vector<size_t>> out;
  for (size_t k : order) {
    const Tensor& t = params_[k].tensor;
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
  std::vector<size_t> position(params_.size());
  for (size_t i = 0; i < order.size(); ++i) position[order[i]] = i;
  std::stable_sort(out.begin(), out.end(), [&](const auto& a, const auto& b) {
    return position[a.front()] < position[b.front()];
  });
  return out;
}

std::vector<std::vector<size_t>> Reducer::layout() const {
  std::vector<std::vector<size_t>> out;
  for (const auto& b : buckets_) out.push_back(b.params);
  return out;
}

std::vector<std::vector<size_t>> Reducer::bucket_indices() const {
  std::vector<std::vector<size_t>> out;
  for (const auto& b : buckets_) {
    std::vector<size_t> idx;
    for (size_t k : b.params) idx.push_back(params_[k].index);
    out.push_back(std::move(idx));
  }
  return out;
}

// Allocates the buckets of `layout`. With gradient_as_bucket_view, a grad() that is a view
// into an old bucket moves (values and all) into the new bucket.
void Reducer::apply(std::vector<std::vector<size_t>> layout) {
  std::vector<Tensor> moved(params_.size());
  if (options_.gradient_as_bucket_view) {
    for (size_t k = 0; k < params_.size(); ++k) {
      const Tensor g = params_[k].tensor.grad();
      if (g.defined() && params_[k].bucket < buckets_.size() &&
          g.storage() == buckets_[params_[k].bucket].flat.storage()) {
        moved[k] = g;
      }
    }
  }
  std::vector<Bucket> fresh;
  for (auto& members : layout) {
    Bucket b;
    int64_t numel = 0;
    for (size_t k : members) {
      auto& p = params_[k];
      p.bucket = fresh.size();
      p.offset = numel;
      numel += p.tensor.numel();
      b.tensors.push_back(p.tensor);
      b.module_indices.push_back(p.index);
    }
    // From the group: over gloo's shared memory, memory the peers' reductions map.
    b.flat = group_->zeros_for_collectives({numel}, params_[members.front()].tensor.options());
    b.params = std::move(members);
    b.pending = b.params.size();
    fresh.push_back(std::move(b));
  }
  buckets_ = std::move(fresh);
  deferred_ = std::make_shared<DeferredSteps>(buckets_.size(), group_->timeout());
  NoGradGuard no_grad;
  for (size_t k = 0; k < params_.size(); ++k) {
    if (!moved[k].defined()) continue;
    Tensor s = slot(params_[k]);
    s.copy_(moved[k]);
    params_[k].tensor.set_grad(s);
  }
}

// Note [bucket rebuild]: the first synchronised backward pass records the order in which
// gradients became ready. At the next forward (with grad mode on) rank 0 broadcasts its order
// and every rank rebuilds the same buckets from it (torch's _rebuild_buckets), once. Collective:
// every rank reaches it at the same forward because every rank finalizes the same iterations
// (under join(), a joined rank counts the iterations it shadows, and follows the others' plan).
void Reducer::rebuild() {
  rebuild_done_ = true;
  // With find_unused_parameters the recorded order may lack parameters (static_graph
  // completes it at the end of the first backward).
  if (options_.find_unused_parameters && !options_.static_graph) return;
  const size_t n = params_.size();
  std::vector<int64_t> msg(n + 1, 0);
  if (group_->rank() == 0 && arrival_.size() == n) {
    msg[0] = 1;
    for (size_t i = 0; i < n; ++i) msg[i + 1] = static_cast<int64_t>(arrival_[i]);
  }
  arrival_.clear();
  arrival_.shrink_to_fit();
  if (group_->size() > 1) {
    Tensor t = from_vector(msg).to(group_->default_device());
    group_->broadcast(t, dist::BroadcastOptions{})->wait();
    msg = t.to_vector<int64_t>();
  }
  if (msg[0] != 1) {
    if (info_) log("bucket rebuild skipped (rank 0's first backward did not see every parameter)");
    return;
  }
  std::vector<size_t> order(n);
  std::vector<char> seen(n, 0);
  for (size_t i = 0; i < n; ++i) {
    const int64_t k = msg[i + 1];
    EMBER_INTERNAL_ASSERT(k >= 0 && static_cast<size_t>(k) < n && !seen[k],
                          "[DistributedDataParallel] rank 0's gradient order is not a "
                          "permutation of the ",
                          n, " parameters");
    seen[k] = 1;
    order[i] = static_cast<size_t>(k);
  }
  auto fresh = assign(order);
  const bool changed = fresh != layout();
  if (changed) apply(std::move(fresh));
  if (info_)
    log_layout(changed ? "after the rebuild (rank 0's gradient order)"
                       : "after the rebuild (unchanged)");
}

}  // namespace ember::dist::detail
