// ProcessGroupHierarchical: gloo collectives for a job of several nodes with several ranks each,
// that keep the bytes between the ranks of a node off the network.
//
// A flat ring of n ranks over TCP sends every byte between every pair of neighbours, and where
// the ring crosses between nodes each crossing edge carries 2(n-1)/n times the buffer. Here an
// allreduce instead reduces inside each node (over shared memory when the node's ranks share a
// machine: ProcessGroupGloo's shared-memory allreduce), all-reduces between one leader per node
// (the node's lowest rank) over TCP, where each leader sends the buffer about once, and
// broadcasts the result back inside each node. Buffers go in pieces, so that one piece's local
// steps overlap the next piece's network transfer (Note [hierarchical pipeline]).
//
// Three ProcessGroupGloo groups do the moving: the ranks of this node ("local"), the node
// leaders ("leaders", TCP only; other ranks are not members) and every rank ("flat"). allreduce
// (and so allreduce_coalesced, reduce and reduce_scatter, which ProcessGroup builds on it) and
// broadcast take the hierarchical path (unless small: HierarchicalOptions::flat_below_bytes);
// allgather, gather, scatter, alltoall, barrier and send/recv go through the flat group, where a
// hierarchy would not pay.
//
// Results: every rank gets bitwise the same values (the leaders' allreduce gives every leader
// the same bits, the broadcast copies them). ReduceOp::Avg is a sum, divided once by the world
// size (integers: truncating division, as gloo).
//
// Threads and order: the hierarchical collectives run one after another on this group's own
// thread, which issues the inner groups' collectives in one fixed order on every rank; the
// Work a collective returns completes when its last step has. The caller's thread issues the
// flat group's collectives directly; barrier also waits for every hierarchical collective issued
// before it.
//
// Errors: a step that fails or times out fails the collective with the inner group's error,
// prefixed by this group's label ("[gloo] allreduce #3 on rank 2 of 4") and the step, naming the
// inner group's members by their ranks in this group (inner errors name ranks of the inner
// group). Every step waits at most until the collective's deadline (the group's or the call's
// timeout). After a failure the group fails its local and leaders' groups too (they close their
// connections and give up their shared-memory waits), so that peers blocked on this rank fail at
// once rather than at their timeout, and every later hierarchical collective fails naming the
// first error (as ProcessGroupGloo: recreate the group).
//
// Nodes: ranks with equal node keys (NodeLayout) form a node. init_process_group's gloo backend
// builds this group by itself when the ranks span at least two nodes and one node has at least
// two ranks, unless EMBER_GLOO_HIERARCHICAL=0 (docs/distributed.md).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ember/distributed/backends/process_group_gloo.h>
#include <ember/distributed/process_group.h>
#include <ember/distributed/store/store.h>

namespace ember::dist {

/// Which node each rank of a group runs on.
class NodeLayout {
 public:
  /// One node per distinct key of `keys` (keys[r]: rank r's), numbered in the order of their
  /// lowest rank; within a node, ranks in increasing order.
  explicit NodeLayout(const std::vector<std::string>& keys);

  int size() const { return static_cast<int>(node_of_.size()); }
  int nodes() const { return static_cast<int>(members_.size()); }
  /// The node of `rank`.
  int node_of(int rank) const { return node_of_.at(rank); }
  /// The ranks of `node`, increasing; the first is its leader.
  const std::vector<int>& members(int node) const { return members_.at(node); }
  /// The leader (lowest rank) of every node, in node order.
  std::vector<int> leaders() const;
  /// True when a hierarchy moves fewer bytes over the network than a flat ring: at least two
  /// nodes, and at least one of them has at least two ranks.
  bool pays() const;
  /// "2 nodes: [0, 1] [2, 3]", for messages.
  std::string describe() const;

 private:
  std::vector<int> node_of_;
  std::vector<std::vector<int>> members_;
};

/// This process's node key: EMBER_NODE_KEY when set (tests use it to make nodes of processes on
/// one machine), else the boot id (/proc/sys/kernel/random/boot_id) and the network namespace
/// (/proc/self/ns/net): ranks in different network namespaces of one machine talk over a
/// network, as on different machines. "" if neither can be read.
std::string local_node_key();

/// Collective: every rank of a group publishes `key` and `flag` under "ember_node/" in `store`
/// (private to the group) and reads everyone's. Returns the layout of the keys and, in
/// *all_flags, whether every rank passed flag = true (so all ranks take the same decision even
/// when their environments differ). Throws DistTimeoutError naming the missing rank if a rank
/// does not publish within `timeout`.
NodeLayout exchange_node_keys(Store& store, int rank, int size, const std::string& key, bool flag,
                              bool* all_flags, Duration timeout);

class ProcessGroupHierarchical : public ProcessGroup {
 public:
  struct HierarchicalOptions {
    /// Options of the inner gloo groups (timeout, listening address, threads, shared memory for
    /// the local groups; the leaders' group always uses TCP: its members are on different
    /// nodes). gloo.timeout is also this group's default timeout.
    ProcessGroupGloo::GlooOptions gloo;
    /// The largest piece an allreduce moves in (Note [hierarchical pipeline]): a buffer goes
    /// in pieces of an eighth of it, at least 256 KiB (or this, when smaller) and at most this.
    /// 0: in one piece.
    size_t pipeline_bytes = size_t{4} << 20;
    /// allreduce and broadcast of at most this many bytes go through the flat group: their
    /// time is the hand-offs between three steps, not bytes on the network.
    size_t flat_below_bytes = size_t{64} << 10;
  };

  /// Builds the inner groups over prefixes of `store` (private to this group): `layout` must be
  /// the same on every rank (exchange_node_keys gives that). Collective over all ranks. Throws
  /// ValueError if layout.size() != size, and what ProcessGroupGloo's constructor throws.
  ProcessGroupHierarchical(std::shared_ptr<Store> store, int rank, int size,
                           const NodeLayout& layout, HierarchicalOptions options);
  /// Exchanges local_node_key() through `store` first (exchange_node_keys).
  ProcessGroupHierarchical(std::shared_ptr<Store> store, int rank, int size,
                           HierarchicalOptions options);
  /// Stops the group's thread after failing the collectives still queued, then destroys the
  /// inner groups.
  ~ProcessGroupHierarchical() override;

  std::string backend_name() const override { return "gloo"; }
  /// Aborts the inner groups (flat, node and leaders'): the peers fail naming this rank.
  bool abort(const std::string& reason) override;

  const NodeLayout& layout() const;
  /// This rank's node.
  int node() const;
  /// True if the local groups reduce over shared memory (this node's group does).
  bool local_uses_shared_memory() const;

  /// Hierarchical (see the file comment); CUDA tensors are staged through host memory.
  WorkPtr allreduce(Tensor& tensor, const AllreduceOptions& opts = {}) override;
  /// Root's node leader gets root's tensor (inside root's node), the leaders broadcast it, then
  /// each node's leader broadcasts it inside its node.
  WorkPtr broadcast(Tensor& tensor, const BroadcastOptions& opts = {}) override;
  // The flat group's.
  WorkPtr allgather_into_tensor(Tensor& output, const Tensor& input,
                                const CollectiveOptions& opts = {}) override;
  WorkPtr allgather(std::vector<Tensor>& outputs, const Tensor& input,
                    const CollectiveOptions& opts = {}) override;
  WorkPtr gather(std::vector<Tensor>& outputs, const Tensor& input,
                 const GatherOptions& opts = {}) override;
  WorkPtr scatter(Tensor& output, const std::vector<Tensor>& inputs,
                  const ScatterOptions& opts = {}) override;
  WorkPtr alltoall(std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                   const CollectiveOptions& opts = {}) override;
  /// The flat group's barrier, completed only after every hierarchical collective issued before.
  WorkPtr barrier(const CollectiveOptions& opts = {}) override;
  WorkPtr send(const Tensor& tensor, int dst, int tag = 0) override;
  WorkPtr recv(Tensor& tensor, int src, int tag = 0) override;

  class Impl;

 private:
  using FlatOp = std::function<WorkPtr(ProcessGroup& flat, Tensor& tensor)>;
  using StepsOp = std::function<std::vector<Tensor>(
      Impl&, const Tensor& tensor, std::chrono::steady_clock::time_point deadline)>;
  /// allreduce's and broadcast's common part: a CUDA tensor goes through a host copy; a small
  /// one through flat(); others through steps() on the group's thread.
  WorkPtr issue(const char* name, Tensor& tensor, std::optional<Duration> timeout,
                const FlatOp& flat, const StepsOp& steps);

  std::unique_ptr<Impl> impl_;
};

}  // namespace ember::dist
