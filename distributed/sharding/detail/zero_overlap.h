// The hook's side of ZeroRedundancyOptimizer's overlap with DDP (Note [ZeRO overlap] in
// sharding/zero_hook.h): made by ZeroRedundancyOptimizer with overlap_with_ddp, driven by
// hook_with_zero_step's hook, defined in zero_hook.cpp. Internal.
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include <ember/distributed/ddp/comm_hooks.h>

namespace ember::dist {
class DistributedDataParallel;
class ZeroRedundancyOptimizer;
}  // namespace ember::dist

namespace ember::dist::detail {

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

}  // namespace ember::dist::detail
