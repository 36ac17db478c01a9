// Aligns this rank's timeline (tensor/observe/trace.h) with rank 0's clock, so that emberrun can
// merge the ranks' trace files onto one time axis. init_process_group calls it when tracing is on;
// call it on every rank of `pg` after trace::start if tracing starts later.
#pragma once

#include <ember/distributed/process_group.h>

namespace ember::dist {

/// A collective over `pg` (a few rounds of barrier + broadcast of rank 0's clock). Each rank
/// stores its offset to rank 0's clock and the error bound in its trace file. Round k on rank r:
/// rank 0 reads its clock c0 after leaving the barrier, so after rank r entered it (at e on r's
/// clock), and before rank r got the broadcast (at a): c0 happened within [e, a] on r's clock,
/// so offset = (e + a) / 2 - c0 is off by at most (a - e) / 2. The round with the smallest
/// (a - e) is kept. Ranks of one machine share the steady clock, so there the true offset is 0
/// and the measured one is within the bound.
void align_trace_clock(ProcessGroup& pg, int rounds = 5);

}  // namespace ember::dist
