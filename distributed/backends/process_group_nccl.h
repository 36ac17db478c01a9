// ProcessGroupNccl: collectives on CUDA tensors over NCCL (torch.distributed's
// ProcessGroupNCCL).
//
// One group drives one device (NcclOptions::device) through one NCCL communicator, created at
// construction: rank 0 makes an ncclUniqueId and publishes it in the group's Store, the others
// read it, and every rank joins within the group's timeout (a non-blocking communicator, so a
// rank that never joins gives DistTimeoutError instead of a hang).
//
// Streams (as c10d): the group has its own CUDA stream. A collective first makes that stream
// wait for the caller's current stream (an event), so it sees every write queued before the
// call, then runs there and records an end event. Tensors are marked used on the group's
// stream (cuda::record_stream), so freeing them early does not let the caching allocator hand
// their memory out before the collective is done.
//
// Work and Future are stream-ordered (c10d's CUDA futures; Note [NCCL stream-ordered work] in
// the .cpp): the Future completes as soon as the collective is queued, with the end event as
// its ready event, so nothing waits on the host. Work::wait() (and Future::wait(), value())
// makes the caller's current stream wait for the end event and returns at once; then()
// callbacks run on the calling thread with their current stream ordered after the collective.
// Work::is_completed() is completion on the device (or failure). Two calls block the CPU until
// the device is done: barrier()'s wait(), and wait(timeout) given an explicit timeout, which
// throws DistTimeoutError when it passes (the collective stays queued; the watchdog aborts it
// at its own deadline).
//
// Failures: a watchdog thread polls the end events and the communicator's asynchronous error;
// on a timeout (the group's or the call's), an NCCL error or a device error it aborts the
// communicator (ncclCommAbort) and records the failure. From then on every collective throws it
// when called, and every Work's wait() (whether issued before or after) throws it too: the
// timed-out collective's own Work a DistTimeoutError naming "[nccl]", the collective, its
// sequence number, the rank and the timeout, every other one DistBackendError("... the group
// is unusable after an earlier failure: <that error>"). Recreate the group, as in c10d. Errors
// thus reach the caller at its next collective or wait(), not at the one that failed.
//
// Collectives must be issued from the thread that owns the group's order, never from a Future
// callback (refused, see process_group.h).
//
// Every operation is queued on the one stream in issue order, send and recv included: a pair
// of ranks that both send before they receive can deadlock for large messages (as in NCCL);
// order them, or use alltoall (one grouped NCCL call). `tag` is ignored (NCCL has no tags).
//
// Tensors: contiguous CUDA tensors on the group's device; float32, float64, float16,
// bfloat16, int32, int64, uint8. ReduceOp::Avg is ncclAvg (integers: truncating division).
// reduce_scatter packs its inputs into one buffer and runs ncclReduceScatter
// (reduce_scatter_tensor runs it on its input as it lies); alltoall is
// one ncclGroupStart/End of sends and receives (per-rank sizes may differ).
#pragma once

#include <memory>
#include <optional>
#include <string>

#include <ember/distributed/process_group.h>
#include <ember/distributed/store/store.h>
#include <ember/tensor/gpu/cuda.h>

namespace ember::dist {

/// True if this build has the nccl backend (EMBER_WITH_NCCL=ON with CUDA, NCCL found). Says
/// nothing about devices: see cuda::is_available().
bool nccl_available();

class ProcessGroupNccl : public ProcessGroup {
 public:
  struct NcclOptions {
    /// Default timeout of every operation (10 minutes, as PyTorch's for NCCL).
    Duration timeout = kDefaultNcclTimeout;
    /// The limit on creating the communicator (rank 0's ncclUniqueId reaching every rank, and
    /// every rank joining). Shorter than `timeout` by default: the rendezvous has already seen
    /// every rank, so a creation that takes long means the ranks cannot reach each other over
    /// the network NCCL chose, and the error names it. Unset: EMBER_NCCL_INIT_TIMEOUT (whole
    /// seconds) when set, else the smaller of `timeout` and 5 minutes.
    std::optional<Duration> init_timeout;
    /// The CUDA device of this rank. -1: the local rank (dist::local_cuda_device(): LOCAL_RANK,
    /// OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID or SLURM_LOCALID) when a launcher set one,
    /// else the group rank; either way an error, not a shared GPU, when it is not below the
    /// number of visible devices. The constructing thread's current device becomes it.
    int device = -1;
  };

  /// Creates the communicator with the other size-1 ranks through `store` (private to this
  /// group, e.g. a PrefixStore). Throws ValueError for a bad rank/size or device,
  /// NotImplementedError naming why when no CUDA device is usable, DistTimeoutError if the
  /// peers do not join within options.timeout, DistBackendError with NCCL's message if NCCL
  /// fails, or, in builds without NCCL, NotImplementedError "nccl is not available: built
  /// with EMBER_WITH_NCCL=OFF".
  ProcessGroupNccl(std::shared_ptr<Store> store, int rank, int size, NcclOptions options);
  ProcessGroupNccl(std::shared_ptr<Store> store, int rank, int size)
      : ProcessGroupNccl(std::move(store), rank, size, NcclOptions{}) {}
  /// Waits (up to the timeout, at most 60 s) for queued work, then destroys the communicator;
  /// aborts it instead if work is still running or the group failed. If work was still
  /// running, every Work's wait() then throws DistBackendError ("... the process group was
  /// destroyed while ... was still running").
  ~ProcessGroupNccl() override;

  /// Same as nccl_available().
  static bool is_available() { return nccl_available(); }

  /// A group of `ranks` (ranks of this group, distinct) from this group's communicator
  /// (ncclCommSplit, as c10d's new_group): on this group's device, with its own stream; the new
  /// group's rank i is the i-th smallest of `ranks`. Collective over this group: every rank calls
  /// it with the same ranks, those not in them get nullptr. Throws ValueError for bad ranks and
  /// the creation's errors (DistTimeoutError within options' init timeout, DistBackendError).
  std::shared_ptr<ProcessGroupNccl> split(const std::vector<int>& ranks, NcclOptions options);

  std::string backend_name() const override { return "nccl"; }
  /// Note [NCCL in a CUDA graph] (process_group_nccl.cpp).
  bool supports_graph_capture() const override { return true; }
  Device default_device() const override { return cuda_device(device()); }
  /// This rank's CUDA device.
  int device() const;
  /// The stream the group's operations run on.
  cuda::Stream stream() const;

  WorkPtr allreduce(Tensor& tensor, const AllreduceOptions& opts = {}) override;
  WorkPtr broadcast(Tensor& tensor, const BroadcastOptions& opts = {}) override;
  /// Native ncclReduce: only root's tensor is written.
  WorkPtr reduce(Tensor& tensor, const ReduceOptions& opts = {}) override;
  WorkPtr allgather_into_tensor(Tensor& output, const Tensor& input,
                                const CollectiveOptions& opts = {}) override;
  WorkPtr reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                         const ReduceScatterOptions& opts = {}) override;
  /// Native ncclReduceScatter on `input` where it lies (no packing copy).
  WorkPtr reduce_scatter_tensor(Tensor& output, const Tensor& input,
                                const ReduceScatterOptions& opts = {}) override;
  /// outputs[r] receives rank r's inputs[rank()]; sizes may differ per rank (dtypes may not).
  WorkPtr alltoall(std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                   const CollectiveOptions& opts = {}) override;
  /// An allreduce of one element; its Work's wait() also blocks the CPU until the device is
  /// done (up to the group's timeout).
  WorkPtr barrier(const CollectiveOptions& opts = {}) override;
  /// ncclSend to dst (not this rank); completes when the data has left. `tag` is ignored.
  WorkPtr send(const Tensor& tensor, int dst, int tag = 0) override;
  /// ncclRecv from src (not this rank). `tag` is ignored.
  WorkPtr recv(Tensor& tensor, int src, int tag = 0) override;
  /// One NCCL group of every send and receive (ncclGroupStart/End): one Work for all.
  std::vector<WorkPtr> batch_isend_irecv(const std::vector<P2POp>& ops) override;

  class Impl;

 private:
  ProcessGroupNccl(int rank, int size, std::unique_ptr<Impl> impl, const NcclOptions& options);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ember::dist
