// The flight recorder: every process group keeps a ring of its last collectives, dumped when
// a collective fails so that the ranks of a hung job can be compared afterwards (PyTorch's
// TORCH_NCCL_TRACE_BUFFER_SIZE and its dump, for every backend).
//
// Each entry holds the collective's op, its sequence number in the group (the "#12" of the
// group's errors), the sizes and dtypes of its tensors, its state (enqueued: issued by this
// rank; started: queued on the device, for backends whose futures complete at that point
// (NCCL); completed; failed, with the error) and the wall-clock times (microseconds since
// the Unix epoch) of its issue and completion.
//
// Settings:
//   EMBER_FLIGHT_RECORDER_SIZE   entries per group (default kDefaultFlightRecorderSize; 0: off;
//                                TORCH_FR_BUFFER_SIZE and TORCH_NCCL_TRACE_BUFFER_SIZE are
//                                read when it is unset). Read when a group is made.
//   EMBER_FLIGHT_RECORDER_DIR    where a failure dumps the rings (unset: no automatic dump).
//
// Dumps: when a collective's wait throws (its timeout, its error, a peer's failure) or the
// NCCL watchdog aborts a group, every ring of the process is written to
// EMBER_FLIGHT_RECORDER_DIR as flight_rank<R>.json, one file per global rank R (several with
// the threads backend, whose ranks share a process). A failure that follows another with no
// collective recorded in between writes nothing new. ember_flight_analyze DIR reads the files
// of all ranks and names the first collective where they diverge (docs/reliability.md).
//
// Thread safety: recording and dumping may run on any threads at once.
#pragma once

#include <string>
#include <vector>

namespace ember::dist {

/// Entries per group when no variable sets the size: a few steps' collectives of a DDP loop.
constexpr int kDefaultFlightRecorderSize = 256;

/// The ring size groups made now get (see the settings above). Throws ValueError naming the
/// variable for a value that is not an integer in [0, 1000000].
int flight_recorder_size();

/// EMBER_FLIGHT_RECORDER_DIR, or "" when unset.
std::string flight_recorder_dir();

/// Writes the rings of every live group of this process to `dir` (created if missing), one
/// file per global rank, flight_rank<R>.json, each replaced atomically; returns their paths
/// (none when no group has recorded anything). `reason` is stored in the files. Throws
/// ValueError for an empty `dir`, ember::Error naming the path when a file cannot be written.
std::vector<std::string> dump_flight_recorder(const std::string& dir,
                                              const std::string& reason = "requested");

namespace detail {
/// A collective failed (`what` says how): dumps every ring to flight_recorder_dir() unless it
/// is unset or nothing was recorded since the last such dump. Never throws (a failed dump is
/// logged): it runs on the failure path, before the collective's own error is rethrown.
void flight_recorder_on_failure(const std::string& what) noexcept;
}  // namespace detail

}  // namespace ember::dist
