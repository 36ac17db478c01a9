// DistributedDataParallel::join()'s rounds (Note [DDP join] in ddp_join.cpp). Internal to
// DistributedDataParallel: not part of the public API.
#pragma once

#include <functional>
#include <vector>

#include <ember/distributed/ddp/ddp_options.h>
#include <ember/distributed/ddp/detail/reducer.h>

namespace ember::dist::detail {

/// Broadcasts `tensors` from `root` in place, one broadcast per (dtype, device) with the
/// tensors packed together (Note [coalesced broadcast] in ddp.cpp); nothing at world size 1.
/// DDP's construction, its buffer sync before a training forward, and join() use it.
void broadcast_tensors(dist::ProcessGroup& pg, const std::vector<Tensor>& tensors, int root = 0);

/// One round of join()'s all-reduce: who still has data, and what their iteration does.
struct JoinRound {
  IterationPlan plan;          ///< what the ranks with data do in this iteration
  std::vector<char> has_data;  ///< per rank
  int with_data = 0;           ///< ranks with data (0: every rank has run out)
  int source = -1;             ///< lowest rank with data: the buffer broadcast's root
};

/// The per-iteration all-reduce of join(). `plan`: this rank's iteration, or null for a rank
/// that has run out. Throws the same ValueError on every rank if the ranks with data disagree.
JoinRound join_round(dist::ProcessGroup& group, const IterationPlan* plan);

/// The state of one join() call.
class JoinContext {
 public:
  explicit JoinContext(const dist::JoinOptions& options) : options_(options) {}

  /// A forward of a rank with data: one round, the reducer's averaging for the iteration.
  /// Returns the root of the buffer broadcast. Throws DistError if some rank has run out and
  /// throw_on_early_termination.
  int enter_iteration(dist::ProcessGroup& group, const IterationPlan& plan, Reducer& reducer);
  /// After this rank's loop: shadows the others' iterations until no rank has data.
  /// `broadcast_buffers(root)` broadcasts the module's buffers.
  void shadow_others(dist::ProcessGroup& group, Reducer& reducer,
                     const std::function<void(int)>& broadcast_buffers);
  /// The rank whose parameters and buffers every rank takes at the end: the highest rank among
  /// the last ones with data (torch's tie-break); -1 if no round had data.
  int authoritative_rank() const;

 private:
  /// Records `round`, throws for throw_on_early_termination, sets the reducer's averaging.
  void take(const JoinRound& round, int size, Reducer& reducer);

  dist::JoinOptions options_;
  std::vector<char> last_with_data_;  // per rank, from the last round anyone had data in
};

}  // namespace ember::dist::detail
