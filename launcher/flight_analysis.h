// Reading the flight recorder's dumps (distributed/flight_recorder.h) of every rank of a job
// and naming the first collective where the ranks diverge: the analysis behind
// ember_flight_analyze (launcher/tools/). Uses no tensors, as the rest of the launcher.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace ember::launcher {

/// A dump that cannot be used: missing, unreadable, not JSON, or not in the recorder's layout.
/// what() names the file and what is wrong with it.
class FlightDumpError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// One divergence found in one group.
struct FlightFinding {
  enum class Kind {
    Skipped,   // a rank's collectives are one behind the others' from `seq` on
    Mismatch,  // the ranks called different collectives, or with different sizes or dtypes
    Missing,   // some ranks never issued `seq`, which the others did
    Failed,    // every rank issued `seq` alike, and it failed on some
    Stuck,     // every rank issued `seq` alike, and some have not completed it
    NoDump,    // a member of the group left no dump
  };
  Kind kind;
  std::string group;     // the group's name in the dumps ("ranks [0,1,2] #0")
  uint64_t seq = 0;      // the collective's sequence number in the group
  std::string op;        // the collective ("allreduce")
  std::vector<int> ranks;  // the global ranks at fault (the one that skipped, the stuck ones...)
  std::string message;   // one line naming all of the above
};

struct FlightReport {
  std::vector<std::string> files;  // the dumps read, by rank
  /// At most one per group (its first divergence), plus one per member without a dump.
  std::vector<FlightFinding> findings;
};

/// Reads every flight_rank<R>.json in `dir` and compares the ranks' collectives group by group,
/// by sequence number, from the oldest one every member still holds. Throws FlightDumpError
/// naming the folder when it has no dump, or the file when one is bad.
FlightReport analyze_flight_dumps(const std::string& dir);

}  // namespace ember::launcher
