// Overlapping ZeroRedundancyOptimizer's step with DDP's gradient communication
// (torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook.hook_with_zero_step).
//
//   auto ddp = std::make_shared<dist::DistributedDataParallel>(model);
//   dist::ZeroRedundancyOptimizer zero(ddp->parameters(), factory, nullptr,
//                                      dist::ZeroOptions{.overlap_with_ddp = true});
//   ddp->register_comm_hook(dist::hook_with_zero_step(dist::allreduce_hook, *ddp, zero));
//   for (auto& batch : loader) {
//     zero.zero_grad();
//     loss_fn(ddp->forward(batch.data), batch.target).backward();  // reduces AND updates
//     zero.step();  // updates nothing: checks that the backward pass did
//   }
//
// Note [ZeRO overlap]: each bucket's hook runs `inner` (the reduction: allreduce_hook,
// fp16_compress_hook, ...) and queues two deferred steps (GradBucket::defer, so they run on
// DDP's thread, in bucket order on every rank: Note [comm hook ordering]). The first waits for
// the bucket's reduced gradients, steps this rank's parameters of the bucket with them (the
// wrapped optimizer sees only those gradients; its other parameters' are hidden for the call),
// and starts the broadcasts of the bucket's updated parameters from their owners: each large
// parameter where it lies, each owner's small ones packed in one buffer. The second (a round
// later, once every bucket has started its broadcasts) waits for them and copies the packed
// parameters in. So bucket b's optimizer
// step overlaps the all-reduces of the buckets after it and the broadcasts of those before it.
// Ownership is ZeRO's own partition by parameter (Note [ZeRO partition]), not DDP's buckets, so
// DDP's one-time bucket rebuild changes nothing: unlike torch, no iteration is skipped.
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include <ember/distributed/comm_hooks.h>
#include <ember/distributed/zero.h>

namespace ember::dist {

class DistributedDataParallel;

/// A communication hook that runs `hook` on each bucket and then, from its result, updates the
/// bucket's parameters with `zero` (Note [ZeRO overlap]); register it on `ddp`. Checks here:
/// ValueError if `hook` is null, `zero` was built without overlap_with_ddp, `zero` already has a
/// hook for another DDP, the two groups differ in size or rank, or DDP's parameters that
/// require grad are not exactly `zero`'s (naming the first that differs). `zero` must outlive
/// DDP's use of the hook (a hook whose optimizer was destroyed throws ValueError).
CommHook hook_with_zero_step(CommHook hook, DistributedDataParallel& ddp,
                             ZeroRedundancyOptimizer& zero);

}  // namespace ember::dist

// In ember::detail, not ember::dist::detail (distributed/detail/store_util.h says why).
namespace ember::detail {

/// What hook_with_zero_step's hook shares with its ZeroRedundancyOptimizer: the bucket updates
/// and the count of iterations they completed, which step() checks. All methods run on DDP's
/// (the training loop's) thread.
class ZeroOverlap : public std::enable_shared_from_this<ZeroOverlap> {
 public:
  explicit ZeroOverlap(dist::ZeroRedundancyOptimizer& zero);
  /// zero's, or null if it was built without overlap_with_ddp.
  static std::shared_ptr<ZeroOverlap> of(dist::ZeroRedundancyOptimizer& zero);
  /// From hook_with_zero_step: the checks it documents.
  void attach(const dist::DistributedDataParallel& ddp);
  /// The hook: runs `inner` on `bucket`, then queues the update from its result.
  std::shared_ptr<dist::Future> on_bucket(dist::GradBucket& bucket, const dist::CommHook& inner);
  /// zero.step(): throws ValueError unless an iteration completed since the last call.
  void check_step();
  /// The optimizer is being destroyed.
  void detach() { zero_ = nullptr; }

 private:
  struct Sends;  // one bucket's broadcasts, from the first deferred step to the second
  dist::ZeroRedundancyOptimizer& zero() const;
  std::vector<size_t> indices_of(const dist::GradBucket& bucket) const;
  std::shared_ptr<dist::Future> update(const dist::GradBucket& bucket,
                                       const std::vector<size_t>& index, const Tensor& reduced,
                                       Sends& sends);
  void step_local(const dist::GradBucket& bucket, const std::vector<size_t>& index,
                  const Tensor& reduced);
  void count_updated(size_t bucket_index, const std::vector<size_t>& index);

  dist::ZeroRedundancyOptimizer* zero_;
  const void* ddp_ = nullptr;                            // the DDP attach() checked
  std::unordered_map<const TensorImpl*, size_t> index_;  // parameter -> index in zero
  std::vector<char> updated_;                            // per parameter, this iteration
  size_t updated_count_ = 0;
  int64_t iterations_ = 0;          // iterations whose every parameter was updated
  int64_t iterations_at_step_ = 0;  // iterations_ at the last step()
  bool hook_ran_ = false;
};

}  // namespace ember::detail
