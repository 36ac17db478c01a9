// The kinds of operation a process group runs (c10d's OpType): one enum, named in errors, in the
// debug mode's fingerprints (debug/debug.h), in gloo's agreement check (backends/) and in the
// threads group's rendezvous.
#pragma once

#include <cstdint>

namespace ember::dist {

/// One per ProcessGroup method that issues an operation. Values are stable within a build only
/// (ranks of one job run one build): they travel in fingerprints between ranks.
enum class OpType : uint8_t {
  Allreduce,
  AllreduceCoalesced,
  Broadcast,
  Reduce,
  Allgather,
  AllgatherIntoTensor,
  Gather,
  Scatter,
  ReduceScatter,
  ReduceScatterTensor,
  Alltoall,
  Barrier,
  Send,
  Recv,
};
/// The number of OpType values.
inline constexpr int kOpTypeCount = static_cast<int>(OpType::Recv) + 1;

/// The method's name: "allreduce", "allgather_into_tensor", ...; "?" for a value out of range.
const char* to_string(OpType op);

/// True for the operations that reduce (take a ReduceOp).
constexpr bool reduces(OpType op) {
  return op == OpType::Allreduce || op == OpType::AllreduceCoalesced || op == OpType::Reduce ||
         op == OpType::ReduceScatter || op == OpType::ReduceScatterTensor;
}

/// True for the operations with a root rank.
constexpr bool has_root(OpType op) {
  return op == OpType::Broadcast || op == OpType::Reduce || op == OpType::Gather ||
         op == OpType::Scatter;
}

}  // namespace ember::dist
