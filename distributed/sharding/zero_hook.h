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

#include <ember/distributed/ddp/comm_hooks.h>
#include <ember/distributed/sharding/zero.h>

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
