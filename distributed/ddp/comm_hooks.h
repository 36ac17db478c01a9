// DDP communication hooks (torch.distributed.algorithms.ddp_comm_hooks): a hook replaces the
// all-reduce that DistributedDataParallel runs on each gradient bucket, e.g. to compress it.
//
//   ddp.register_comm_hook(dist::fp16_compress_hook);                 // stateless
//   auto state = std::make_shared<dist::PowerSGDState>(dist::PowerSGDOptions{...});
//   ddp.register_comm_hook(state, dist::powersgd_hook);               // torch's (state, hook)
//   ddp.register_comm_hook([](dist::GradBucket& b) { ... });          // any callable
//
// A hook receives a GradBucket (the bucket's flat buffer of local, not yet averaged gradients)
// and returns a Future whose value()[0] is the reduced (averaged) buffer; DDP copies it into the
// bucket if it is another tensor. Hooks run on the thread that runs backward, the moment the
// bucket is launched (buckets launch strictly in index order). See docs/ddp.md.
//
// Note [comm hook ordering]: collectives must be issued in the same order on every rank.
// Future::then callbacks run on a backend thread when the collective completes, so a hook must
// NOT issue a collective from them (whether it runs before or after the next bucket's hook
// would depend on timing: this is what makes torch 1.13's PowerSGD hang or crash over gloo with
// several buckets). A hook that needs another collective after the first completes uses
// GradBucket::defer(): DDP runs deferred steps on its own thread at the end of backward, in
// rounds (each bucket's first pending step, in bucket order, then each bucket's next one, ...),
// so the collective sequence depends only on the bucket layout and the hooks' code.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ember/distributed/process_group.h>

namespace ember::dist::detail {
class DeferredSteps;
}  // namespace ember::dist::detail

namespace ember::dist {

/// What a communication hook sees: one bucket of gradients. Cheap to copy (tensors are handles
/// sharing memory), so deferred steps may capture it by value.
class GradBucket {
 public:
  /// A step of a hook run later on DDP's collective-issuing thread (see defer()). It receives the
  /// future it waited for (completed, successfully) and returns the future of what it started.
  using DeferredStep = std::function<std::shared_ptr<Future>(Future& after)>;

  /// `buffer`: flat 1-d, the parameters' gradients packed in order; `parameter_indices[k]` is
  /// parameters[k]'s index in the module's parameters(). `deferred` null (a bucket made outside
  /// DDP, e.g. in a test): defer() runs its step at once. Throws ValueError if the parameters'
  /// sizes do not add up to the buffer's.
  /// `bytes_sent`: where record_bytes_sent adds (DDP's per-bucket counter, -1 until a hook
  /// records); null: record_bytes_sent does nothing.
  GradBucket(size_t index, size_t num_buckets, Tensor buffer, std::vector<Tensor> parameters,
             std::vector<size_t> parameter_indices, std::shared_ptr<ProcessGroup> group,
             std::shared_ptr<dist::detail::DeferredSteps> deferred = nullptr,
             std::shared_ptr<std::atomic<int64_t>> bytes_sent = nullptr);

  /// Position in the launch order (0 is launched first).
  size_t index() const { return index_; }
  /// Whether this is the last bucket launched in an iteration (torch: holds the first layers).
  bool is_last() const { return index_ + 1 == num_buckets_; }
  /// The flat gradient buffer (DDP's bucket, or what set_buffer() put in its place).
  const Tensor& buffer() const { return buffer_; }
  /// Replaces buffer() (same number of elements, any dtype: the fp16 wrapper passes a float16
  /// copy to the hook it wraps). DDP still reads the result from the hook's Future.
  void set_buffer(const Tensor& buffer);
  /// One view into buffer() per parameter, shaped like it.
  std::vector<Tensor> gradients() const;
  /// The model parameters whose gradients the bucket holds, in buffer order.
  const std::vector<Tensor>& parameters() const { return parameters_; }
  /// Their indices in the wrapped module's parameters(): an identity that survives the bucket
  /// rebuild and a restart, for keying hook state.
  const std::vector<size_t>& parameter_indices() const { return parameter_indices_; }
  /// The sorted parameter indices joined by '_' ("0_1_5"): a bucket identity independent of
  /// the bucket's index and position.
  std::string key() const;
  /// The group DDP reduces over.
  ProcessGroup& process_group() const { return *group_; }
  const std::shared_ptr<ProcessGroup>& process_group_ptr() const { return group_; }

  /// Like after->then(step), but `step` may issue collectives: it runs on the thread that issues
  /// DDP's collectives, at the end of backward, in bucket order (Note [comm hook ordering]).
  /// The returned future completes with the value (or error) of the future `step` returns; if
  /// `after` fails (or does not complete within the group's timeout) the step is skipped and the
  /// error passed on. Every rank must make the same defer() calls for a bucket. Outside DDP
  /// (no queue) the step runs before defer() returns, on the calling thread.
  std::shared_ptr<Future> defer(std::shared_ptr<Future> after, DeferredStep step) const;

  /// Adds `bytes` to what this rank sent for this bucket in this iteration, for
  /// DDPStats::bytes_sent: a hook counts what it puts on the wire (ring_allreduce_bytes for an
  /// all-reduce, the ranks a message reaches times its size otherwise). A hook that never calls
  /// it leaves the iteration's bytes unknown. Thread-safe (a Future::then callback may call it).
  void record_bytes_sent(int64_t bytes) const;

  /// This bucket over another group (same buffer, parameters and deferred-step queue): for a
  /// hook that runs another hook over a subgroup (compress_across_nodes). Throws ValueError if
  /// `group` is null.
  GradBucket with_group(std::shared_ptr<ProcessGroup> group) const;

 private:
  size_t index_;
  size_t num_buckets_;
  Tensor buffer_;
  std::vector<Tensor> parameters_;
  std::vector<size_t> parameter_indices_;
  std::shared_ptr<ProcessGroup> group_;
  std::shared_ptr<dist::detail::DeferredSteps> deferred_;
  std::shared_ptr<std::atomic<int64_t>> bytes_sent_;
};

/// What a ring all-reduce of `bytes` sends from each of `world` ranks: 2 (world - 1) / world of
/// it (0 for one rank). The reference DDPStats and the compression hooks compare against.
int64_t ring_allreduce_bytes(int64_t bytes, int world);

/// A communication hook: returns a Future whose value()[0] is the averaged bucket (same number
/// of elements as bucket.buffer()). Called on the backward thread.
using CommHook = std::function<std::shared_ptr<Future>(GradBucket& bucket)>;

/// torch's (state, hook) pair as one CommHook: `hook(*state, bucket)`; the CommHook keeps
/// `state` alive. `hook` is any callable taking (State&, GradBucket&).
template <typename State, typename Hook>
CommHook bind_hook(std::shared_ptr<State> state, Hook hook) {
  return [state = std::move(state), hook = std::move(hook)](GradBucket& bucket) {
    return hook(*state, bucket);
  };
}

/// A Future already completed with `value` (a hook that needs no communication).
std::shared_ptr<Future> completed_future(std::vector<Tensor> value);

// ---- built-in hooks (torch.distributed.algorithms.ddp_comm_hooks.default_hooks) --------------

/// Averages the bucket over the group (ReduceOp::Avg): the same result as no hook.
std::shared_ptr<Future> allreduce_hook(GradBucket& bucket);
/// Casts the bucket to float16, divides by the world size, all-reduces (sum) the float16 copy
/// (half the bytes) and casts the result back into the bucket.
std::shared_ptr<Future> fp16_compress_hook(GradBucket& bucket);
/// fp16_compress_hook with bfloat16 (float32's range, 8 bits of mantissa).
std::shared_ptr<Future> bf16_compress_hook(GradBucket& bucket);
/// Runs `hook` on a float16 copy of the bucket (set_buffer) and casts its result back to the
/// bucket's dtype: fp16_compress_wrapper(allreduce_hook) is fp16_compress_hook.
CommHook fp16_compress_wrapper(CommHook hook);
/// fp16_compress_wrapper with bfloat16.
CommHook bf16_compress_wrapper(CommHook hook);
/// No communication: the bucket's value is left as it is (each rank keeps its local gradient).
/// For measuring how much of an iteration communication costs, never for training.
std::shared_ptr<Future> noop_hook(GradBucket& bucket);

}  // namespace ember::dist

namespace ember::dist::detail {

/// DDP's queue of deferred hook steps (GradBucket::defer), one queue per bucket. Used by DDP
/// and by GradBucket only; all methods are called from DDP's thread.
///
/// A step that defers more steps for its own bucket puts them ahead of the steps already queued
/// for it (depth first): those were queued before it ran, typically by a wrapping hook waiting
/// for the result of the step now running, which may be what the new steps compute
/// (compress_across_nodes' broadcast waits for the leaders' two-phase hook, whose second phase
/// is deferred from its first). Queued behind them, it would wait for them forever. The order
/// still depends only on the hooks' code and the bucket layout, the same on every rank.
class DeferredSteps {
 public:
  /// `timeout`: how long to wait for a step's `after` future.
  DeferredSteps(size_t num_buckets, dist::Duration timeout);
  void push(size_t bucket, std::shared_ptr<dist::Future> after,
            dist::GradBucket::DeferredStep step, std::shared_ptr<dist::Future> result);
  /// Runs every queued step (and those they queue) in rounds: each bucket's first step, in
  /// bucket order, then the next round. Errors go to the steps' result futures.
  void run_all();
  /// Completes every queued step's result with `error`, running none (an aborted backward).
  void abandon(const std::exception_ptr& error);
  bool empty() const;

 private:
  struct Item {
    std::shared_ptr<dist::Future> after;
    dist::GradBucket::DeferredStep step;
    std::shared_ptr<dist::Future> result;
  };
  /// Waits for item.after and runs the step, passing the outcome to item.result.
  void run(Item& item);
  std::vector<std::deque<Item>> queues_;
  // While a step of bucket running_ runs: the steps it defers for that bucket, in order, put
  // at the front of its queue when it returns.
  static constexpr size_t kNone = static_cast<size_t>(-1);
  size_t running_ = kNone;
  std::vector<Item> nested_;
  dist::Duration timeout_;
};

}  // namespace ember::dist::detail
