// A collective's span on the timeline (tensor/observe/trace.h), shared by the process groups that
// run their collectives on a host thread (gloo, MPI): the stamp taken when it is queued and when it
// starts, and the span recorded when it has finished. Off, each costs one predictable branch.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include <ember/tensor/tensor.h>
#include <ember/tensor/observe/trace.h>

namespace ember::dist::tracing {

/// The trace clock now while tracing, else 0 (no clock read): when a collective was queued, or
/// when it started running.
inline int64_t stamp() { return trace::enabled() ? trace::now_us() : 0; }

/// The bytes of a collective's results (its span's `bytes`).
int64_t result_bytes(const std::vector<Tensor>& outputs);

/// Records the span of the collective labelled `label` ("[mpi] allreduce #3 on rank 0 of 2")
/// from `started_us` to now on this thread, when `started_us` is a stamp taken while tracing
/// (non-zero); `queued_us` is the stamp of its submission (0: it was not queued).
inline void record_collective(std::string_view label, int64_t queued_us, int64_t started_us,
                              const std::vector<Tensor>& outputs) {
  if (started_us != 0) trace::collective(label, queued_us, started_us, result_bytes(outputs));
}

}  // namespace ember::dist::tracing
