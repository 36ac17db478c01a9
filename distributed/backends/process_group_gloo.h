// ProcessGroupGloo: collectives over Gloo's TCP transport, on CPU tensors
// (torch.distributed's ProcessGroupGloo).
//
// Ranks rendezvous through a Store (each publishes its address; Gloo connects a full mesh).
// Collectives start in issue order on the group's worker threads (two by default, as c10d's
// gloo backend: while one waits on the network the next collective already moves data; each
// carries its own Gloo tag, its sequence number, so concurrent ones never mix); send and recv
// are posted at once from the calling thread and completed by another thread, so a rank may
// send and receive concurrently without deadlock (that thread reports completions in the order
// the operations were posted). Every operation carries a deadline (the
// group's timeout or the call's): a collective that cannot finish, or whose peer died (its
// connection closed), fails with an error naming "[gloo]", the collective, its sequence
// number, this rank and the timeout; a dead peer is named by its rank (Gloo names only an
// address). Ranks that issue a collective with different sizes, dtypes, ops or roots fail on
// every rank naming the peer and what each issued, over shared memory and over TCP, where Gloo
// itself would abort the process (Note [ranks that disagree over TCP]); a send and a recv of
// different sizes fail on both ranks naming both (Note [send/recv sizes]), and the pair's
// next messages still arrive whole. A failed collective's error also says where each other
// rank stands ("rank 0 left the group after issuing 3 operations (the last: allreduce #2)",
// "rank 0 was at barrier #3 when it failed"; Note [where a rank stands]): ranks that ran
// uneven numbers of steps are named with both sequence numbers. After a failed collective the
// group closes its connections, so peers blocked on this rank fail at once rather than at
// their timeout, and the group cannot be used again (as in c10d: recreate it). It also writes
// an abort record into the group's store (Note [abort through the store]): every other rank's
// blocked or later operation of the group, even one waiting on a third rank that is busy
// elsewhere, fails within moments with an error naming the rank that aborted, its collective
// and why ("rank 0 aborted the group at its allreduce #3: ... timed out after 2000 ms").
//
// Dtypes: float32, float64, float16, bfloat16, int32, int64, uint8; tensors must be contiguous
// CPU tensors. float16/bfloat16 reductions compute each pairwise step in float32 and round
// back. ReduceOp::Avg is sum then division by the group size (integers: truncating division).
//
// SIGPIPE: a group of more than one rank sets SIGPIPE to SIG_IGN if it still has its default
// action, so that writing to a dead peer's socket reports the peer instead of killing this
// process (as Python does for every torch program).
//
// Ranks on one machine: every collective (not send/recv) goes through shared memory rather
// than loopback TCP (GlooOptions::shared_memory); every rank gets bitwise the same result, and
// errors read as they do over TCP (a dead peer is named, with its pid).
//
// Over shared memory, a small allreduce, allreduce_coalesced, reduce, broadcast,
// allgather_into_tensor, reduce_scatter_tensor or barrier issued while none of this rank's
// collectives is in flight runs on the calling thread: the call returns once every rank has
// joined it, with its Work already completed (or failed), which saves the hand-off to a worker
// thread.
//
// World size 1 never touches the network: every collective completes inline.
#pragma once

#include <memory>
#include <string>

#include <ember/distributed/process_group.h>
#include <ember/distributed/store/store.h>

namespace ember::dist {

/// True if this build has the gloo backend (EMBER_WITH_GLOO=ON and libgloo found).
bool gloo_available();

class ProcessGroupGloo : public ProcessGroup {
 public:
  struct GlooOptions {
    /// Default timeout of every operation, and the limit on the rendezvous.
    Duration timeout = kDefaultCollectiveTimeout;
    /// Address (host name or IP) this rank listens on for its peers. Empty: the environment's
    /// EMBER_GLOO_HOSTNAME, else the interface named by GLOO_SOCKET_IFNAME, else this
    /// machine's host name (as c10d).
    std::string hostname;
    /// Threads that run collectives (c10d's ProcessGroupGloo::Options::threads, also 2). With
    /// more than one, a collective may start before the previous one has finished, so two
    /// collectives in flight must not write the same tensor (wait for the first).
    int threads = 2;
    /// When every rank of the group runs on this machine, the collectives (not barrier,
    /// send or recv) move data through one shared-memory segment instead of loopback TCP
    /// (Note [shared-memory allreduce], Note [shared-memory collectives]). Off, or when a
    /// rank is elsewhere (another host or network namespace), everything goes through Gloo. EMBER_GLOO_SHM=0 turns it off for
    /// groups made by init_process_group.
    bool shared_memory = true;
    /// Over TCP, alltoall and allgather_into_tensor post each step's receives before its sends
    /// for pieces of this many bytes and more (alltoall: the chunk for one peer;
    /// allgather_into_tensor: one rank's input) (Note [receives first over TCP]): over a link
    /// slower than the CPUs a large exchange then moves both ways at once instead of taking
    /// turns; smaller messages keep Gloo's order, which is quicker on a fast link. Every rank of
    /// a group should use the same value (mixed values still work). EMBER_GLOO_RECEIVES_FIRST_BYTES
    /// sets it for groups made by init_process_group.
    size_t receives_first_bytes = size_t{512} << 10;
  };

  /// Rendezvous with the other size-1 ranks through `store` (which should be private to this
  /// group, e.g. a PrefixStore) and connect. Throws ValueError for a bad rank/size,
  /// DistTimeoutError if the peers do not show up within options.timeout, DistBackendError
  /// (naming the address) if Gloo cannot listen or connect, or, in builds without gloo,
  /// NotImplementedError "gloo is not available: built with EMBER_WITH_GLOO=OFF".
  ProcessGroupGloo(std::shared_ptr<Store> store, int rank, int size, GlooOptions options);
  ProcessGroupGloo(std::shared_ptr<Store> store, int rank, int size)
      : ProcessGroupGloo(std::move(store), rank, size, GlooOptions{}) {}
  /// Fails every queued operation (DistBackendError "process group destroyed"), waits for the
  /// running one to end (bounded by its timeout) and closes the connections.
  ~ProcessGroupGloo() override;

  /// Same as gloo_available().
  static bool is_available() { return gloo_available(); }

  /// Breaks the group for `reason`, as a failed collective does (ThreadWorld::abort()'s
  /// counterpart across processes): this rank's running and later operations fail with
  /// "rank R aborted the group: <reason>", and through the group's store (Note [abort through
  /// the store]) so do the other ranks', within moments rather than at their timeout. For a
  /// rank that fails outside the group (a wrapper whose other group failed, a user's error
  /// handler) and must not leave its peers waiting. Does not wait for running operations; the
  /// first failure or abort stands. Thread-safe; no-op at world size 1.
  bool abort(const std::string& reason) override;

  std::string backend_name() const override { return "gloo"; }

  /// True if the collectives go through shared memory (GlooOptions::shared_memory was on and
  /// every rank runs on this machine); false at world size 1.
  bool uses_shared_memory() const;
  /// Which shared-memory paths this rank's collectives took so far (all zero without shared
  /// memory): how many copied straight between the ranks' buffers (Note [single-copy
  /// collectives]) and how many reduced straight from the peers' shareable tensors (Note
  /// [mapped reductions], dist::empty_shareable()).
  struct SharedMemoryStats {
    uint64_t single_copies = 0;
    uint64_t mapped_reductions = 0;
  };
  SharedMemoryStats shared_memory_stats() const;

  WorkPtr allreduce(Tensor& tensor, const AllreduceOptions& opts = {}) override;
  /// Over shared memory: reduces CPU tensors where they lie, one collective; otherwise packs
  /// them (ProcessGroup's default).
  WorkPtr allreduce_coalesced(std::vector<Tensor>& tensors,
                              const AllreduceOptions& opts = {}) override;
  bool coalesced_without_copies(const Device& device) const override {
    return device.is_cpu() && uses_shared_memory();
  }
  /// CPU tensors from dist::empty_shareable() when the group uses shared memory.
  Tensor zeros_for_collectives(IntList shape, TensorOptions opts) const override;
  WorkPtr broadcast(Tensor& tensor, const BroadcastOptions& opts = {}) override;
  WorkPtr reduce(Tensor& tensor, const ReduceOptions& opts = {}) override;
  WorkPtr allgather_into_tensor(Tensor& output, const Tensor& input,
                                const CollectiveOptions& opts = {}) override;
  /// Over shared memory: straight into the outputs; otherwise ProcessGroup's default.
  WorkPtr allgather(std::vector<Tensor>& outputs, const Tensor& input,
                    const CollectiveOptions& opts = {}) override;
  /// Over shared memory: each rank reduces its own block, no allreduce of the whole list;
  /// otherwise ProcessGroup's default (an allreduce of the packed inputs).
  WorkPtr reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                         const ReduceScatterOptions& opts = {}) override;
  WorkPtr reduce_scatter_tensor(Tensor& output, const Tensor& input,
                                const ReduceScatterOptions& opts = {}) override;
  WorkPtr gather(std::vector<Tensor>& outputs, const Tensor& input,
                 const GatherOptions& opts = {}) override;
  WorkPtr scatter(Tensor& output, const std::vector<Tensor>& inputs,
                  const ScatterOptions& opts = {}) override;
  WorkPtr alltoall(std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                   const CollectiveOptions& opts = {}) override;
  WorkPtr barrier(const CollectiveOptions& opts = {}) override;
  /// Posts the send at once; the Work completes when the data has left (the receiver posted
  /// its recv). Times out after the group's timeout. `tag` must match the receiver's.
  WorkPtr send(const Tensor& tensor, int dst, int tag = 0) override;
  WorkPtr recv(Tensor& tensor, int src, int tag = 0) override;

  class Impl;

 private:
  /// send (is_send) or recv of `tensor` with `peer`: checks, posts and submits the wait.
  WorkPtr point_to_point(bool is_send, const Tensor& tensor, int peer, int tag);
  struct ShmTicket;
  /// The next collective's label, and its shared-memory ticket if the group has the segment.
  ShmTicket take_ticket(const char* collective);
  /// reduce_scatter over shared memory: `blocks` (one per rank, in `inputs`) into output.
  WorkPtr shm_reduce_scatter(const char* name, Tensor& output, std::vector<Tensor> inputs,
                             std::vector<const void*> blocks, const ReduceScatterOptions& opts);

  std::unique_ptr<Impl> impl_;
};

}  // namespace ember::dist
