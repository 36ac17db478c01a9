// ProcessGroupThreads: a process group whose ranks are threads of one process (as PyTorch's
// multi-threaded process group of torch.testing, but a library feature), so DDP and the
// collectives can run at 2 to 8 ranks in one test binary, on CPU tensors (CI) or with every
// rank on one GPU (NCCL refuses two ranks on one device).
//
//   auto world = dist::ThreadWorld::create(4);
//   dist::run_rank_threads(world, [&](int rank) {
//     auto pg = std::make_shared<dist::ProcessGroupThreads>(world, rank);
//     pg->allreduce(t)->wait();
//   });
//
// Exchange is through memory: each collective is a rendezvous of the rank threads in the
// world; the last rank to arrive hands the ranks' tensors to the world's worker thread, which
// reduces them with tensor ops (add_, copy_, ...) and completes every rank's Work.
//  - CPU tensors: the Work completes once the data is reduced (asynchronously, on the worker;
//    Future::then callbacks run there); Work::wait() blocks the CPU.
//  - CUDA tensors (every rank on the same device): each rank records an input-ready event on
//    its current stream at the call; the worker queues the exchange on the world's collective
//    stream for that device after waiting for every rank's event, records one ready event, and
//    completes the Futures at once (Future::set_value(value, {event}), as the NCCL group:
//    then() callbacks run on the worker with the collective stream current). Work::wait() makes
//    the caller's current stream wait for the event; it blocks the CPU only until every rank
//    has called the collective. Tensors are marked used on the collective stream
//    (cuda::record_stream), so freeing them early is safe.
// Every rendezvous is bounded by the group's timeout (or the call's): when a rank never calls,
// the others fail with DistTimeoutError "[threads] allreduce #k on rank r of N timed out after
// T ms: rank(s) 2 did not call it" (Work::wait() without a timeout allows 2 s more, so that
// this error, rather than a bare timeout, reaches the caller). ThreadWorld::abort() fails every pending and later
// collective at once (run_rank_threads does it when a rank throws, so no rank hangs).
// Mismatched collectives, roots, ops, dtypes or shapes across ranks fail every rank's Work with
// ValueError naming the collective and both ranks' tensors.
//
// Also init_process_group's backend "threads": each rank thread calls init_process_group with
// the same store (a HashStore they share) and gets a default group of its own (the backend's
// default group is per thread), and new_group makes sub-groups as over any backend:
//   auto store = std::make_shared<dist::HashStore>();
//   // on each of the 4 rank threads:
//   dist::init_process_group({.backend = "threads", .store = store, .rank = r, .world_size = 4});
// Rank 0 of each group makes its ThreadWorld and the others find it through the store, so every
// rank must be a thread of one process (ValueError otherwise).
//
// Threads: each ProcessGroupThreads belongs to its rank's thread (collectives issued in the
// same order on every rank, as any group). The k-th group a rank creates on a world pairs with
// the k-th group of every other rank (like new_group). Send and recv match by (source,
// destination, tag) in call order; both complete when the data has been copied.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ember/distributed/op_type.h>
#include <ember/distributed/process_group.h>

namespace ember::dist::detail {
class ThreadWorldState;
}  // namespace ember::dist::detail

namespace ember::dist {

/// What the rank threads of a ProcessGroupThreads share: the rendezvous table and the worker
/// thread that runs the exchanges. Thread-safe.
class ThreadWorld {
 public:
  /// A world of `size` ranks (>= 1; ValueError otherwise). Starts the worker thread.
  static std::shared_ptr<ThreadWorld> create(int size);
  /// Stops the worker; collectives still pending fail with DistBackendError.
  ~ThreadWorld();
  ThreadWorld(const ThreadWorld&) = delete;
  ThreadWorld& operator=(const ThreadWorld&) = delete;

  int size() const { return size_; }
  /// Fails every pending collective and every later one with DistBackendError naming `reason`
  /// (a rank died: its peers should not wait for their timeouts). Idempotent.
  void abort(const std::string& reason);
  /// As abort(), but this world only: the adopted sub-group worlds go on (ProcessGroup::abort).
  void abort_alone(const std::string& reason);

  /// Makes `child` (a sub-group's world) fail with this one: abort() aborts it too, at once if
  /// this world is aborted already.
  void adopt(const std::shared_ptr<ThreadWorld>& child);

  /// For ProcessGroupThreads.
  dist::detail::ThreadWorldState& state() { return *state_; }

 private:
  explicit ThreadWorld(int size);
  int size_;
  std::shared_ptr<dist::detail::ThreadWorldState> state_;
  std::thread worker_;
  std::mutex children_mu_;
  std::vector<std::weak_ptr<ThreadWorld>> children_;  // adopted sub-group worlds
  std::string aborted_;                               // the reason, once aborted
};

/// The failure of one rank thread in run_rank_threads: "[threads] rank 2 of 4 failed: <what>";
/// cause() is the original exception (rethrow it to test its type).
class RankThreadError : public DistError {
 public:
  RankThreadError(int rank, int size, std::exception_ptr cause, const std::string& what);
  /// The message from `cause`'s what().
  RankThreadError(int rank, int size, std::exception_ptr cause);
  int rank() const { return rank_; }
  std::exception_ptr cause() const { return cause_; }

 private:
  int rank_;
  std::exception_ptr cause_;
};

/// Runs body(rank) on `size` threads, each with a default group of its own over the "threads"
/// backend (init_process_group over a store they share, with `timeout`), which body may use as
/// any default group: new_group, init_device_mesh, DDP; and each with a default random
/// generator of its own (set_thread_default_generator), so ranks draw as processes would. The group is destroyed when body ends.
/// When a rank throws, its world and every sub-group's world are aborted (the others'
/// collectives fail at once) and, once every thread has ended, the first failure is rethrown as
/// RankThreadError.
void run_rank_threads(int size, const std::function<void(int rank)>& body,
                      Duration timeout = kDefaultCollectiveTimeout);

/// Runs body(rank) on world->size() threads, one per rank, and joins them all. When a rank
/// throws, the world is aborted (the others' collectives fail instead of waiting for their
/// timeouts) and, once every thread has ended, the first failure (in time) is rethrown as
/// RankThreadError. Never hangs as long as body blocks only in the world's collectives.
void run_rank_threads(const std::shared_ptr<ThreadWorld>& world,
                      const std::function<void(int rank)>& body);

class ProcessGroupThreads : public ProcessGroup {
 public:
  /// Rank `rank` of `world`. Throws ValueError for a null world or a rank outside it.
  /// `in_place_coalesced`: what coalesced_without_copies() answers (true: DDP all-reduces
  /// gradients where they lie; false: through its flat buckets), so tests cover both paths.
  ProcessGroupThreads(std::shared_ptr<ThreadWorld> world, int rank, Options options,
                      bool in_place_coalesced = false);
  ProcessGroupThreads(std::shared_ptr<ThreadWorld> world, int rank)
      : ProcessGroupThreads(std::move(world), rank, Options{}) {}

  std::string backend_name() const override { return "threads"; }
  const std::shared_ptr<ThreadWorld>& world() const { return world_; }
  /// Fails this group's pending and later collectives with "rank R aborted the group: <reason>"
  /// (ThreadWorld::abort_alone): not the sub-groups made from it, as a gloo group's abort
  /// leaves the rank's other groups alone.
  bool abort(const std::string& reason) override;

  /// Tensors: defined, on the CPU or one CUDA device (the same for every rank), any dtype the
  /// tensor ops support (float16 and bfloat16 reduce in float32). Avg on integers truncates.
  WorkPtr allreduce(Tensor& tensor, const AllreduceOptions& opts = {}) override;
  /// Reduces each tensor where it lies (no packing).
  WorkPtr allreduce_coalesced(std::vector<Tensor>& tensors,
                              const AllreduceOptions& opts = {}) override;
  bool coalesced_without_copies(const Device&) const override { return in_place_coalesced_; }
  WorkPtr broadcast(Tensor& tensor, const BroadcastOptions& opts = {}) override;
  /// Only root's tensor is written.
  WorkPtr reduce(Tensor& tensor, const ReduceOptions& opts = {}) override;
  /// `output` must be contiguous.
  WorkPtr allgather_into_tensor(Tensor& output, const Tensor& input,
                                const CollectiveOptions& opts = {}) override;
  WorkPtr allgather(std::vector<Tensor>& outputs, const Tensor& input,
                    const CollectiveOptions& opts = {}) override;
  WorkPtr gather(std::vector<Tensor>& outputs, const Tensor& input,
                 const GatherOptions& opts = {}) override;
  WorkPtr scatter(Tensor& output, const std::vector<Tensor>& inputs,
                  const ScatterOptions& opts = {}) override;
  WorkPtr reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                         const ReduceScatterOptions& opts = {}) override;
  /// outputs[r] receives rank r's inputs[rank()]; sizes may differ per pair (not dtypes).
  WorkPtr alltoall(std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                   const CollectiveOptions& opts = {}) override;
  WorkPtr barrier(const CollectiveOptions& opts = {}) override;
  /// Completes when `dst` has received it (a rendezvous, bounded by the group's timeout).
  WorkPtr send(const Tensor& tensor, int dst, int tag = 0) override;
  WorkPtr recv(Tensor& tensor, int src, int tag = 0) override;

  struct Call;  // process_group_threads.cpp

 private:
  WorkPtr issue(Call call);
  /// Labels a collective with the next sequence number and issues it; the Future's value is
  /// `out`, or `in` when there are no outputs (in-place collectives).
  WorkPtr collective(OpType kind, const char* name,
                     const std::optional<Duration>& timeout, std::vector<Tensor> in,
                     std::vector<Tensor> out, int root = 0, ReduceOp op = ReduceOp::Sum);
  WorkPtr point_to_point(bool send, const Tensor& tensor, int peer, int tag);
  std::shared_ptr<ThreadWorld> world_;
  int index_;  // this group's position among the groups its rank made on the world
  bool in_place_coalesced_;
};

}  // namespace ember::dist
