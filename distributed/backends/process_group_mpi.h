// ProcessGroupMpi: collectives over MPI (torch.distributed's "mpi" backend, c10d's
// ProcessGroupMPI). See docs/distributed_mpi.md.
//
// The job is started by mpirun (or srun); rank and world size come from MPI_COMM_WORLD, not
// from a Store. Every group owns a duplicate of MPI_COMM_WORLD (or a sub-communicator) and one
// worker thread that runs its MPI calls in the order they were issued; Work handles complete
// on that thread. CPU tensors only.
//
// Timeouts: an MPI call cannot be interrupted. Work::wait(timeout) throws DistTimeoutError
// ("[mpi] allreduce #3 on rank 1 of 4 timed out after 100 ms") while the worker may stay inside
// the stuck call; destroying the group then detaches the worker instead of joining it, and at
// process exit Ember calls MPI_Abort (not MPI_Finalize, which would block) so the job ends with
// a non-zero status instead of hanging.
#pragma once

#include <memory>
#include <vector>

#include <ember/distributed/process_group.h>

namespace ember::dist {

class ProcessGroupMpi : public ProcessGroup {
 public:
  /// Creates a group over the given world ranks (all of MPI_COMM_WORLD when empty). Collective
  /// over MPI_COMM_WORLD: every process of the job must call it, in the same order as its other
  /// group creations. Ranks are sorted (group rank i is the i-th smallest world rank, as in
  /// torch's new_group); processes not in `ranks` get nullptr. Initialises MPI on first use
  /// (MPI_Init_thread, asking for MPI_THREAD_MULTIPLE and accepting MPI_THREAD_SERIALIZED) and
  /// finalises it at exit if Ember initialised it.
  /// Throws ValueError for duplicate or out-of-range ranks, DistBackendError when MPI fails or
  /// offers less than MPI_THREAD_SERIALIZED, NotImplementedError in builds without MPI.
  static std::shared_ptr<ProcessGroupMpi> create(std::vector<int> ranks = {},
                                                 ProcessGroup::Options options = {});
  /// Whether this build has the MPI backend.
  static bool is_available();

  /// Runs the queued collectives, then stops the worker. If the worker is stuck in an MPI call
  /// past its Work's timeout it is detached instead (see the file comment).
  ~ProcessGroupMpi() override;

  std::string backend_name() const override { return "mpi"; }

  WorkPtr allreduce(Tensor& tensor, const AllreduceOptions& opts = {}) override;
  WorkPtr broadcast(Tensor& tensor, const BroadcastOptions& opts = {}) override;
  WorkPtr reduce(Tensor& tensor, const ReduceOptions& opts = {}) override;
  WorkPtr allgather(std::vector<Tensor>& outputs, const Tensor& input,
                    const CollectiveOptions& opts = {}) override;
  WorkPtr allgather_into_tensor(Tensor& output, const Tensor& input,
                                const CollectiveOptions& opts = {}) override;
  WorkPtr gather(std::vector<Tensor>& outputs, const Tensor& input,
                 const GatherOptions& opts = {}) override;
  WorkPtr scatter(Tensor& output, const std::vector<Tensor>& inputs,
                  const ScatterOptions& opts = {}) override;
  WorkPtr reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                         const ReduceScatterOptions& opts = {}) override;
  WorkPtr alltoall(std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                   const CollectiveOptions& opts = {}) override;
  WorkPtr barrier(const CollectiveOptions& opts = {}) override;
  /// Non-blocking (MPI_Isend); the Work completes when MPI reports the send done. Sends and
  /// receives between the same pair match in order, by tag. Their timeout is the group's.
  WorkPtr send(const Tensor& tensor, int dst, int tag = 0) override;
  /// Non-blocking (MPI_Irecv) into `tensor` (shape and dtype must match the sender's).
  WorkPtr recv(Tensor& tensor, int src, int tag = 0) override;

  struct Impl;

 private:
  ProcessGroupMpi(int rank, int size, Options options, std::shared_ptr<Impl> impl);
  /// send (is_send) or recv of `tensor` with `peer`: checks and queues the request.
  WorkPtr point_to_point(bool is_send, const Tensor& tensor, int peer, int tag);
  std::shared_ptr<Impl> impl_;
};

}  // namespace ember::dist
