// ProcessGroup: collectives among the ranks of a group (torch.distributed's c10d ProcessGroup).
//
// Every collective is asynchronous: it returns a Work handle at once, and the operation runs
// on the backend's own threads (gloo, MPI) or stream (NCCL). Work::wait() waits until it is
// done or its timeout passes (on the CPU for gloo and MPI; NCCL orders the caller's current
// stream after it instead, see process_group_nccl.h); Work::future() gives a Future whose
// then() callbacks run when it completes (DistributedDataParallel's communication hooks chain
// on it).
//
// Tensors passed to a collective must stay alive and unmodified until its Work completes;
// results are written into the given output tensors (in place for allreduce and broadcast).
// Each collective gets a sequence number per group, so errors name it: "[gloo] allreduce #12
// on rank 3 of 4 timed out after 30000 ms".
//
// Threads: collectives must be issued in the same order on every rank; issuing from several
// threads at once is not supported (as in c10d). Issuing one from inside a Future callback
// (then(), add_done_callback()) is refused with ValueError: a callback runs on whichever thread
// completes the future, at a time that differs between ranks, so the ranks' collective orders
// could differ (a hang or wrong results). A communication hook that needs a second collective
// uses GradBucket::defer, which runs it on the thread that issues DDP's collectives.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <ember/distributed/errors.h>
#include <ember/distributed/op_type.h>
#include <ember/distributed/store/store.h>
#include <ember/tensor/tensor.h>

namespace ember::cuda {
class Event;
}

namespace ember::dist {

namespace detail {
class FlightRing;
}

enum class ReduceOp { Sum, Avg, Product, Min, Max };
const char* to_string(ReduceOp op);

/// A value (a list of tensors) that becomes available later, or an error.
///
/// CUDA values are stream-ordered (as c10d's CUDA futures): a backend may complete a future as
/// soon as the work producing the value is queued on a stream, with CUDA events that mark when
/// the value is ready on the device. Then wait() and value() make the calling thread's current
/// stream wait for those events instead of blocking the CPU, and a then() callback runs with
/// its current streams already waiting for them; the future it returns is ready after what the
/// callback queued on those streams. CPU values carry no events.
class Future : public std::enable_shared_from_this<Future> {
 public:
  Future() = default;
  Future(const Future&) = delete;
  Future& operator=(const Future&) = delete;

  bool completed() const;
  /// Blocks until completed (or timeout: DistTimeoutError naming `what`); rethrows the error.
  /// Then makes the current stream of each ready event's device wait for it.
  void wait(std::optional<Duration> timeout = {});
  /// Blocks until completed, like wait(), but leaves the streams alone.
  void wait_host(std::optional<Duration> timeout = {});
  /// The value, after wait(); rethrows the error.
  const std::vector<Tensor>& value();
  /// The CUDA events the value is ready after (empty: ready when completed).
  std::vector<std::shared_ptr<cuda::Event>> ready_events() const;
  /// The error, or null (only meaningful once completed).
  std::exception_ptr exception() const;

  /// Runs `callback(*this)` once this future completes (at once if it has), on the thread that
  /// completes it; returns a future completed with the callback's result, or with the
  /// exception it throws (or this future's, which the callback sees when it calls value()).
  /// Callbacks must not issue collectives (see the file comment; ProcessGroup refuses them).
  std::shared_ptr<Future> then(std::function<std::vector<Tensor>(Future&)> callback);
  /// Runs callback(*this) when completed; exceptions it throws are swallowed after logging.
  void add_done_callback(std::function<void(Future&)> callback);

  // For backends: complete the future (exactly once). `ready`: CUDA events recorded after the
  // work that produces `value` was queued (see above).
  void set_value(std::vector<Tensor> value,
                 std::vector<std::shared_ptr<cuda::Event>> ready = {});
  void set_exception(std::exception_ptr error);
  /// A short description used in timeout errors (e.g. "allreduce #3 on rank 1 (gloo)").
  void set_description(std::string what);

 private:
  void complete(std::unique_lock<std::mutex>& lock);
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool completed_ = false;
  std::vector<Tensor> value_;
  std::vector<std::shared_ptr<cuda::Event>> ready_;
  std::exception_ptr error_;
  std::string what_;
  std::vector<std::function<void(Future&)>> callbacks_;
};

/// The handle of one collective.
class Work {
 public:
  /// `what` describes the collective for errors; `timeout` is its default wait timeout.
  Work(std::string what, Duration timeout);
  virtual ~Work() = default;
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;

  /// Whether the collective is done (NCCL: on the device, as c10d's isCompleted), or failed.
  virtual bool is_completed() const { return future_->completed(); }
  bool is_success() const { return is_completed() && !exception(); }
  /// The collective's error, or null (NCCL: also the group's failure, see
  /// process_group_nccl.h).
  virtual std::exception_ptr exception() const { return future_->exception(); }
  /// Waits until done; throws the collective's error, or DistTimeoutError (naming backend,
  /// collective, sequence number, rank and timeout) if it does not finish within `timeout`
  /// (default: the group's or the call's timeout). Returns true on success. gloo and MPI block
  /// the CPU; NCCL makes the caller's current stream wait instead (process_group_nccl.h).
  virtual bool wait(std::optional<Duration> timeout = {});
  /// Completes with the collective's output tensors.
  std::shared_ptr<Future> future() const { return future_; }
  /// The output tensors (after wait()).
  const std::vector<Tensor>& result() { return future_->value(); }
  const std::string& describe() const { return what_; }
  Duration timeout() const { return timeout_; }

  // For backends.
  void finish(std::vector<Tensor> outputs) { future_->set_value(std::move(outputs)); }
  void finish_with_error(std::exception_ptr e) { future_->set_exception(e); }

 protected:
  std::string what_;
  Duration timeout_;
  std::shared_ptr<Future> future_ = std::make_shared<Future>();
};

using WorkPtr = std::shared_ptr<Work>;

/// For backends: a Work that completes when `inner` does, with finish()'s outputs. finish runs
/// as a then() callback of inner's future: on the thread that completes it, with the current
/// streams ordered after inner's CUDA work, so its copies are too (the returned Work's wait()
/// orders the caller after them). Its exception, or inner's error, fails the returned Work;
/// is_completed() and exception() also reflect inner's. `name` describes the outer operation.
WorkPtr chain_work(const WorkPtr& inner, const char* name,
                   std::function<std::vector<Tensor>()> finish);

/// For backends: checks allreduce_coalesced's list (not empty, one dtype and device); errors
/// name `backend`.
void check_coalesced(const char* backend, const std::vector<Tensor>& tensors);

/// torch.distributed's default collective timeout.
constexpr Duration kDefaultCollectiveTimeout = std::chrono::minutes(30);
/// NCCL's (PyTorch's default for NCCL since 2.x): a failed NCCL operation leaves the device's
/// work in doubt, so the job should end sooner than over gloo.
constexpr Duration kDefaultNcclTimeout = std::chrono::minutes(10);

struct AllreduceOptions {
  ReduceOp op = ReduceOp::Sum;
  std::optional<Duration> timeout;
};
struct BroadcastOptions {
  int root = 0;
  std::optional<Duration> timeout;
};
struct ReduceOptions {
  int root = 0;
  ReduceOp op = ReduceOp::Sum;
  std::optional<Duration> timeout;
};
struct GatherOptions {
  int root = 0;
  std::optional<Duration> timeout;
};
struct ScatterOptions {
  int root = 0;
  std::optional<Duration> timeout;
};
struct ReduceScatterOptions {
  ReduceOp op = ReduceOp::Sum;
  std::optional<Duration> timeout;
};
struct CollectiveOptions {
  std::optional<Duration> timeout;
};

class ProcessGroup;

/// One send or receive of batch_isend_irecv (torch.distributed.P2POp; p2p.h). `peer` is a rank
/// of `group` (null: the default group); `tag` pairs a send with its receive.
struct P2POp {
  enum class Kind { Send, Recv };
  Kind op = Kind::Send;
  Tensor tensor;
  int peer = 0;
  int tag = 0;
  std::shared_ptr<ProcessGroup> group;

  static P2POp isend(Tensor t, int peer, int tag = 0, std::shared_ptr<ProcessGroup> g = {}) {
    return {Kind::Send, std::move(t), peer, tag, std::move(g)};
  }
  static P2POp irecv(Tensor t, int peer, int tag = 0, std::shared_ptr<ProcessGroup> g = {}) {
    return {Kind::Recv, std::move(t), peer, tag, std::move(g)};
  }
};

/// Group ranks are 0..size-1. `global_ranks()[r]` is group rank r's rank in the default
/// (world) group.
class ProcessGroup {
 public:
  struct Options {
    Duration timeout = kDefaultCollectiveTimeout;
  };
  ProcessGroup(int rank, int size, Options options);
  virtual ~ProcessGroup() = default;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  Duration timeout() const { return options_.timeout; }
  /// "gloo", "mpi" or "nccl".
  virtual std::string backend_name() const = 0;
  /// Where the group's own small exchanges (DDP's parameter check, bucket rebuild and unused-
  /// parameter map, the debug mode's checks) put their tensors: the CPU, or the group's GPU for
  /// a backend that takes CUDA tensors only (torch's _get_pg_default_device).
  virtual Device default_device() const { return kCPU; }
  /// Whether a collective may be issued while this thread captures a CUDA graph (Note [NCCL in a
  /// CUDA graph]): NCCL's only. The others meet on the host or stage through it, which a capture
  /// cannot hold, so their collectives are refused there (next_op_label).
  virtual bool supports_graph_capture() const { return false; }
  /// Breaks the group for `reason` (torch's ProcessGroup.abort, with a reason), for a rank that
  /// fails outside a collective while its peers wait on it in one (a pipeline stage whose
  /// forward throws): this rank's running and later operations fail, and so do the other
  /// ranks', within moments rather than at their timeout, with "rank R aborted the group:
  /// <reason>". The first failure or abort stands; the group cannot be used again. Returns
  /// whether the backend can (gloo, hierarchical gloo, threads, and the wrappers of those); MPI
  /// and NCCL cannot reach their peers so, which then fail at their timeout. This group only: the
  /// rank's other groups go on. Thread-safe.
  virtual bool abort(const std::string& reason) {
    (void)reason;
    return false;
  }
  /// The next collective's sequence number (counts collectives issued by this rank).
  uint64_t sequence_number() const { return seq_; }
  /// The next send's or receive's number (counts those issued by this rank, apart from the
  /// collectives: next_p2p_label).
  uint64_t p2p_sequence_number() const { return p2p_seq_; }
  const std::vector<int>& global_ranks() const { return global_ranks_; }
  void set_global_ranks(std::vector<int> ranks) { global_ranks_ = std::move(ranks); }

  // ---- collectives: see torch.distributed for semantics ----
  /// In place: every rank ends with the reduction of all ranks' `tensor`.
  virtual WorkPtr allreduce(Tensor& tensor, const AllreduceOptions& opts = {}) = 0;
  /// In place: allreduces every tensor of `tensors` (one dtype and device, any shapes) as one
  /// collective, as if they were concatenated (c10d's allreduce_coalesced). The default packs
  /// them into one buffer, allreduces it and copies the result back; a backend may reduce them
  /// where they lie (coalesced_without_copies()). Throws ValueError for an empty list or mixed
  /// dtypes or devices.
  virtual WorkPtr allreduce_coalesced(std::vector<Tensor>& tensors,
                                      const AllreduceOptions& opts = {});
  /// True if allreduce_coalesced reads and writes tensors on `device` in place, without packing
  /// copies (DistributedDataParallel then all-reduces gradients where they lie instead of
  /// copying them into its buckets and back).
  virtual bool coalesced_without_copies(const Device& device) const { return false; }
  /// A zero-filled tensor for this group's collectives to work on, in the memory they are
  /// fastest over: for gloo over shared memory, CPU tensors from dist::empty_shareable(), which
  /// the reductions read and write where they lie in every rank (DistributedDataParallel's
  /// buckets come from here); otherwise zeros(shape, opts).
  virtual Tensor zeros_for_collectives(IntList shape, TensorOptions opts) const;
  /// In place: every rank ends with root's `tensor`.
  virtual WorkPtr broadcast(Tensor& tensor, const BroadcastOptions& opts = {}) = 0;
  /// Root's `tensor` ends with the reduction; other ranks' are left unspecified (as in c10d).
  virtual WorkPtr reduce(Tensor& tensor, const ReduceOptions& opts = {});
  /// outputs[r] (size() tensors shaped like input) receives rank r's input.
  virtual WorkPtr allgather(std::vector<Tensor>& outputs, const Tensor& input,
                            const CollectiveOptions& opts = {});
  /// The single-tensor form: output (size() * input.numel() elements, ranks concatenated along
  /// dim 0) receives every rank's input.
  virtual WorkPtr allgather_into_tensor(Tensor& output, const Tensor& input,
                                        const CollectiveOptions& opts = {}) = 0;
  /// On root, outputs[r] receives rank r's input; other ranks pass an empty outputs list.
  virtual WorkPtr gather(std::vector<Tensor>& outputs, const Tensor& input,
                         const GatherOptions& opts = {});
  /// output receives root's inputs[rank()]; only root passes inputs.
  virtual WorkPtr scatter(Tensor& output, const std::vector<Tensor>& inputs,
                          const ScatterOptions& opts = {});
  /// output receives the reduction over ranks of inputs[rank()].
  virtual WorkPtr reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                 const ReduceScatterOptions& opts = {});
  /// The single-tensor form (torch's reduce_scatter_tensor): input holds size() blocks of
  /// output.numel() elements, ranks' blocks concatenated along dim 0; output receives the
  /// reduction over ranks of block rank(). Throws ValueError naming both sizes unless input
  /// has size() * output.numel() elements of output's dtype. The default views input as the
  /// list of blocks and calls reduce_scatter.
  virtual WorkPtr reduce_scatter_tensor(Tensor& output, const Tensor& input,
                                        const ReduceScatterOptions& opts = {});
  /// outputs[r] receives rank r's inputs[rank()].
  virtual WorkPtr alltoall(std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                           const CollectiveOptions& opts = {});
  virtual WorkPtr barrier(const CollectiveOptions& opts = {}) = 0;
  virtual WorkPtr send(const Tensor& tensor, int dst, int tag = 0) = 0;
  virtual WorkPtr recv(Tensor& tensor, int src, int tag = 0) = 0;
  /// Issues every send and receive of `ops` (their groups are ignored: this group's) and
  /// returns their Works in order (p2p.h's batch_isend_irecv). The default issues them one
  /// after another, which never blocks where send and recv return at once (gloo, MPI,
  /// threads); NCCL overrides it with one group launch.
  virtual std::vector<WorkPtr> batch_isend_irecv(const std::vector<P2POp>& ops);

  /// For backends: gives the flight recorder (flight_recorder.h) the tensors and the Work of
  /// the collective that next_op_label labelled last, whose entry then has their sizes and
  /// dtypes and follows the Work to its completion; returns `work`. Call it on the thread that
  /// issued the collective, before issuing the next.
  WorkPtr record_flight(WorkPtr work, const std::vector<Tensor>& tensors);

 protected:
  /// The label of the collective being issued, "[gloo] allreduce #12 on rank 3 of 4", for its
  /// Work and errors; takes the next sequence number and records the collective in the flight
  /// recorder (record_flight adds its tensors and Work). Throws ValueError (naming the backend,
  /// the collective and the rank; no sequence number taken) when called from inside a Future
  /// callback: every collective passes here, so this refuses them for every backend.
  std::string next_op_label(const char* collective);
  /// The label of a send or receive being issued, "[gloo] send #3 on rank 0 of 2", with the
  /// same checks and flight recording as next_op_label. Sends and receives are numbered apart
  /// from the collectives (#3: this rank's fourth send or receive in the group): ranks issue
  /// different numbers of them (a pipeline's middle stage twice its ends'), and a collective's
  /// number must be the same on every rank, since backends match collectives by it.
  std::string next_p2p_label(const char* op);
  /// Throws ValueError ("[gloo] reduce: root 5 is not a rank of this group of size 4") unless
  /// 0 <= root < size().
  void check_root(const char* op, int root) const;
  /// On a rank other than root, throws ValueError unless `count` (the number of `what` tensors
  /// passed: "output", "input") is 0: gather and scatter take lists on the root only.
  void check_only_root_passes(const char* op, int root, size_t count, const char* what) const;
  /// Throws ValueError (naming the backend) unless `input` holds size() * output.numel()
  /// elements of output's dtype on output's device (reduce_scatter_tensor's shapes).
  void check_reduce_scatter_tensor(const Tensor& output, const Tensor& input) const;
  /// The tensors of `list` flattened and concatenated into one new contiguous buffer.
  static Tensor pack(const std::vector<Tensor>& list);
  Duration timeout_of(const std::optional<Duration>& t) const { return t.value_or(options_.timeout); }

  int rank_;
  int size_;
  Options options_;
  uint64_t seq_ = 0;      // collectives issued (next_op_label)
  uint64_t p2p_seq_ = 0;  // sends and receives issued (next_p2p_label)
  std::vector<int> global_ranks_;

 private:
  void check_issue(const char* op, uint64_t seq, bool p2p);
  std::shared_ptr<detail::FlightRing> flight_;  // null: the flight recorder is off
  uint64_t flight_entry_ = 0;                   // the entry next_op_label made last
};

}  // namespace ember::dist
