// Mixed precision under data parallelism: making GradScaler's inf/NaN check agree across ranks.
//
//   nn::amp::GradScaler scaler({.found_inf_sync = dist::found_inf_allreduce(group)});
//
// After DDP's default allreduce every rank holds the same gradients, so every rank already
// finds the same infs and skips the same steps. With a comm hook that is not an exact average
// (or local steps without DDP) the ranks' gradients may differ; then one rank could skip a step
// another takes, and the replicas drift apart. found_inf_allreduce makes the decision global:
// a step is skipped everywhere if any rank saw an inf or NaN.
#pragma once

#include <memory>

#include <ember/distributed/process_group.h>
#include <ember/nn/amp/grad_scaler.h>

namespace ember::dist {

/// A GradScalerOptions::found_inf_sync that all-reduces the found-inf flag with ReduceOp::Max
/// over `group` (null: the default group) and waits for it, bounded by the group's timeout.
/// Collective: every rank's scaler must unscale the same number of times per iteration (one
/// allreduce per device holding gradients). Errors are the group's (rank, collective,
/// sequence number, timeout).
nn::amp::FoundInfSync found_inf_allreduce(std::shared_ptr<ProcessGroup> group = nullptr);

}  // namespace ember::dist
