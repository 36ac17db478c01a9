// Distributed debug mode (torch's TORCH_DISTRIBUTED_DEBUG):
// EMBER_DISTRIBUTED_DEBUG=OFF|INFO|DETAIL.
//
// INFO: DistributedDataParallel logs its bucket layout and, every EMBER_DDP_LOG_EVERY iterations,
// its average forward, backward, communication and overlap times (docs/ddp.md).
// DETAIL: DistributedDataParallel wraps its group in a CheckedProcessGroup, which checks before
// each collective that every rank is about to issue the same collective with the same tensor
// shape and dtype, and throws the same DistError on every rank, naming two ranks that differ
// and what each called, instead of hanging or corrupting data.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ember/distributed/forwarding_process_group.h>
#include <ember/distributed/op_type.h>

namespace ember::dist {

enum class DebugLevel { Off, Info, Detail };

/// The level EMBER_DISTRIBUTED_DEBUG asks for, read at each call: unset, "" or "OFF": Off;
/// "INFO"; "DETAIL" (case-insensitive). Throws ValueError naming the variable and the accepted
/// values for anything else.
DebugLevel debug_level();

/// A ProcessGroup that checks every collective across ranks before running it on `inner`
/// (torch's ProcessGroupWrapper). Before each collective it all-gathers a small fingerprint
/// (its own sequence number, the collective, dtype, shape, root and reduce op) through `inner`
/// (bounded by the group's timeout); if the ranks disagree it throws DistError on every rank:
///   "[CheckedProcessGroup] collective #3 differs across ranks: rank 0 called allreduce(float32
///    [120], sum) but rank 1 called allreduce(float32 [84], sum); ..."
/// and the collective itself is not issued (so nothing hangs). A rank that issues no collective
/// at all while the others do (uneven steps: it left the group, is idle, or issued something on
/// `inner` directly, as an evaluation does) makes the check's all-gather fail, at once or at the
/// group's timeout; the error, of the all-gather's type, then starts "[CheckedProcessGroup]
/// rank 1 of 2: the check before its collective #3, allreduce(float32 [1000], sum), failed: "
/// and goes on with the group's own error (for gloo: where each other rank stands, Note [where
/// a rank stands] in distributed/backends/detail/gloo_agreement.h). send/recv are passed through
/// unchecked, and so is everything else ForwardingProcessGroup forwards (default_device(),
/// ...). Costs one small blocking all-gather per collective: for debugging only. Same
/// threading rules as any group.
class CheckedProcessGroup : public ForwardingProcessGroup {
 public:
  /// `inner` must not be null.
  explicit CheckedProcessGroup(std::shared_ptr<ProcessGroup> inner);

  WorkPtr allreduce(Tensor& tensor, const AllreduceOptions& opts = {}) override;
  WorkPtr allreduce_coalesced(std::vector<Tensor>& tensors,
                              const AllreduceOptions& opts = {}) override;
  WorkPtr broadcast(Tensor& tensor, const BroadcastOptions& opts = {}) override;
  WorkPtr reduce(Tensor& tensor, const ReduceOptions& opts = {}) override;
  WorkPtr allgather(std::vector<Tensor>& outputs, const Tensor& input,
                    const CollectiveOptions& opts = {}) override;
  WorkPtr allgather_into_tensor(Tensor& output, const Tensor& input,
                                const CollectiveOptions& opts = {}) override;
  WorkPtr gather(std::vector<Tensor>& outputs, const Tensor& input,
                 const GatherOptions& opts = {}) override;
  WorkPtr scatter(Tensor& output, const std::vector<Tensor>& inputs,
                  const ScatterOptions& opts = {}) override;
  WorkPtr reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                         const ReduceScatterOptions& opts = {}) override;
  WorkPtr reduce_scatter_tensor(Tensor& output, const Tensor& input,
                                const ReduceScatterOptions& opts = {}) override;
  WorkPtr alltoall(std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                   const CollectiveOptions& opts = {}) override;
  WorkPtr barrier(const CollectiveOptions& opts = {}) override;

 private:
  /// Gathers every rank's fingerprint of the collective about to run and throws on a mismatch.
  /// `t` may be undefined (barrier). `root` and `op` are -1 where they do not apply.
  void check(OpType kind, const Tensor& t, int root, int op);
};

}  // namespace ember::dist
