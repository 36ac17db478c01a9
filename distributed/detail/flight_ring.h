// One process group's ring of recent collectives (flight_recorder.h). Internal: ProcessGroup
// records into it (next_op_label, record_flight), flight_recorder.cpp dumps it.
#pragma once

#include <ember/distributed/process_group.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace ember::dist::detail {

enum class FlightState : uint8_t { Enqueued, Started, Completed, Failed };
const char* to_string(FlightState s);

struct FlightEntry {
  uint64_t id = 0;  // 0: an empty slot; else the ring's count of records when it was made
  uint64_t seq = 0;  // the collective's number, or a send's or receive's (p2p)
  bool p2p = false;  // a send or receive: numbered apart from the collectives
  std::string op;
  std::vector<std::vector<int64_t>> sizes;
  std::vector<std::string> dtypes;
  FlightState state = FlightState::Enqueued;
  int64_t enqueued_us = 0;
  int64_t completed_us = 0;  // 0: not seen completing
  std::string error;
  std::weak_ptr<Work> work;  // asked at dump time whether a started collective has finished
  // A started collective's device events (NCCL's end event), kept from its future: asked at
  // dump time too, so that one whose Work was dropped (DDP's) still shows when it finished.
  std::vector<std::shared_ptr<cuda::Event>> device_done;
  // Until complete() runs: its output tensors stay alive only while the collective is pending.
  std::shared_ptr<Future> pending;
};

/// What identifies a group across ranks in a dump.
struct FlightGroupInfo {
  std::string backend;
  int rank = 0;
  int size = 0;
  std::vector<int> global_ranks;
  int ordinal = 0;  // among this rank's groups over the same global ranks, in order of first use
};

class FlightRing : public std::enable_shared_from_this<FlightRing> {
 public:
  explicit FlightRing(size_t capacity);

  /// Records that `pg` issued collective `op` with sequence number `seq` (or a send or receive,
  /// `p2p`, with its own numbering); returns the entry's
  /// id. The first record registers the ring for dumps, with pg's identity.
  uint64_t enqueue(const ProcessGroup& pg, const char* op, uint64_t seq, bool p2p = false);
  /// Adds the tensors' sizes and dtypes to entry `id` and follows `work` to its completion.
  /// Does nothing if the entry has been overwritten meanwhile.
  void attach(uint64_t id, const WorkPtr& work, const std::vector<Tensor>& tensors);

  /// The group's identity (valid once registered).
  FlightGroupInfo info() const;
  /// The entries, oldest first; a started one is marked completed when its Work has finished,
  /// or when a later one of the group has (a group's device work runs in issue order).
  std::vector<FlightEntry> snapshot() const;

 private:
  void complete(uint64_t id, const Future& f);
  FlightEntry* find(uint64_t id);

  mutable std::mutex mu_;
  size_t capacity_;
  std::vector<FlightEntry> slots_;  // sized at the first record: wrappers never record
  uint64_t records_ = 0;
  bool registered_ = false;
  FlightGroupInfo info_;
};

}  // namespace ember::dist::detail
