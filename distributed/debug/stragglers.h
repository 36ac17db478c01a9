// Straggler reports: where each rank's step time went, gathered to every rank through one small
// collective (not the store), so a job can name its slowest rank while it runs.
//
//   dist::StepTimes mine{step_ms, data_ms, comm_wait_ms};        // this rank's means per step
//   auto all = dist::gather_step_times(*pg, mine);                // collective
//   if (pg->rank() == 0) std::puts(dist::straggler_report(all).c_str());
#pragma once

#include <string>
#include <vector>

#include <ember/distributed/process_group.h>

namespace ember::dist {

/// One rank's mean time per step over a window of steps, in milliseconds. Compute is what is
/// left of the step once data loading and the wait for communication are taken out.
struct StepTimes {
  double step_ms = 0;       ///< wall time per step
  double data_ms = 0;       ///< waiting for the next batch
  double comm_wait_ms = 0;  ///< blocked on communication (DDPStats::exposed_communication)
  double compute_ms() const;
  double busy_ms() const { return step_ms - comm_wait_ms; }  ///< data + compute
};

/// Collective: every rank of `pg` passes its own; returns every rank's, indexed by group rank.
/// One all-gather of three doubles per rank, on pg's default device. Throws ValueError for a
/// negative or non-finite time, and the group's errors.
std::vector<StepTimes> gather_step_times(ProcessGroup& pg, const StepTimes& mine);

/// One line: the spread of step time across ranks (fastest, median, slowest) and where the
/// slowest rank's time went, with how much longer it was busy than the median rank, e.g.
///   step time over 4 ranks: min 13.0 ms (rank 2), median 13.1 ms, max 13.1 ms (rank 3);
///   slowest rank 1: busy 12.9 ms (+24.8% over the median), data 0.3 ms, compute 12.6 ms,
///   waiting on communication 0.2 ms
/// Throws ValueError for an empty list.
std::string straggler_report(const std::vector<StepTimes>& ranks);

/// The rank busy longest per step (data + compute; the lowest such rank on a tie). In
/// synchronous data-parallel training every rank's step takes about as long, since the others
/// wait in their collectives for the slowest: the straggler is the rank that waits least.
int slowest_rank(const std::vector<StepTimes>& ranks);

}  // namespace ember::dist
