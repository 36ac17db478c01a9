// DistributedDataParallel: data-parallel training over a process group
// (torch.nn.parallel.DistributedDataParallel).
//
//   auto model = std::make_shared<nn::Sequential>(...);
//   auto ddp = std::make_shared<dist::DistributedDataParallel>(model);   // default group
//   nn::optim::SGD opt(ddp->parameters(), {.lr = 0.1});
//   loss_fn(ddp->forward(x_slice_of_this_rank), y).backward();  // grads averaged over ranks
//   opt.step();
//
// Construction checks that every rank has the same parameters (count, shapes, dtypes) and
// copies rank 0's parameters and buffers to every rank. Parameters that require grad are packed,
// in reverse registration order, into buckets (one flat buffer per bucket, per dtype and device;
// the first up to first_bucket_cap_mb, the others up to bucket_cap_mb), rebuilt once after the
// first iteration in the order rank 0's gradients became ready. During backward each
// parameter's post-accumulate-grad hook copies its gradient into its bucket; a full bucket is
// all-reduced (average) asynchronously, or handed to the communication hook, while backward
// goes on, buckets always in the same order on every rank. When the backward pass ends, a
// queued autograd callback runs the hooks' deferred steps, waits for every bucket and writes the
// averages back into the parameters' grad() (the reducer, distributed/ddp/detail/reducer.h). Destroying
// the DDP object removes its hooks. See docs/ddp.md.
//
// Uneven inputs: ddp.join([&] { training loop }) lets a rank that runs out of data shadow the
// others' collectives until every rank has finished. Debugging: EMBER_DISTRIBUTED_DEBUG=INFO logs
// the bucket layout and timings, DETAIL checks every collective across ranks (distributed/debug/debug.h).
//
// Threads: like any Module, one thread at a time; backward must run on the thread that owns the
// process group's collectives (collectives are issued from the backward pass).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ember/distributed/ddp/comm_hooks.h>
#include <ember/distributed/ddp/ddp_options.h>
#include <ember/distributed/process_group.h>
#include <ember/nn/module.h>

namespace ember::dist::detail {
class Reducer;
class JoinContext;
}  // namespace ember::dist::detail

namespace ember::dist {

class DistributedDataParallel : public nn::Module {
 public:
  /// Wraps `module` (registered as submodule "module", so parameter names get the "module."
  /// prefix as in torch). `group` null: the default group. Collective: every rank of the group
  /// must construct it with the same model structure. Throws ValueError naming the first
  /// parameter whose shape or dtype differs and the rank that has it, and the group's errors.
  explicit DistributedDataParallel(std::shared_ptr<nn::Module> module,
                                   std::shared_ptr<ProcessGroup> group = nullptr,
                                   DDPOptions options = {});
  /// Removes the post-accumulate-grad hooks it registered on the module's parameters (the
  /// module can then be trained alone or wrapped again) and waits, bounded by the group's
  /// timeout, for reductions a failed backward pass left running.
  ~DistributedDataParallel() override;

  std::string name() const override { return "DistributedDataParallel"; }

  /// Broadcasts buffers from rank 0 (training mode, broadcast_buffers), runs the module's
  /// forward, and (when grad mode is on and not under no_sync) arms gradient synchronisation
  /// for the next backward pass (a forward whose backward never ran is simply superseded).
  /// Throws ValueError if the previous synchronised backward pass started but never finished
  /// (it threw), naming the parameters that got no gradient; the state is reset, so the next
  /// call runs normally.
  Tensor forward(const Tensor& input) override;
  /// The same for a module of several inputs or outputs (its forward_many): PyTorch's
  /// `ddp(x, mask)` returning a tuple. Call it as `ddp(x, mask)` or `ddp({x, mask})`.
  std::vector<Tensor> forward_many(const std::vector<Tensor>& inputs) override;

  /// RAII guard: while alive, forward passes do not arm synchronisation, so backward passes
  /// only accumulate into grad() locally; the first synced backward afterwards averages the
  /// accumulated gradients.
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(DistributedDataParallel& ddp);
    ~NoSyncGuard();
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    DistributedDataParallel& ddp_;
    bool previous_;
  };
  /// torch's `with ddp.no_sync():` as `{ auto guard = ddp.no_sync(); ... }`.
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  /// Arms gradient synchronisation for the next backward pass as a synchronised forward does,
  /// without running one: a pipeline schedule runs a stage's forwards under no_sync() and
  /// calls this before the stage's last backward of the step, so gradients accumulated over
  /// the micro-batches are reduced once (torch's pipelining calls the reducer's
  /// prepare_for_backward the same way). Throws ValueError under no_sync() or join().
  void prepare_for_backward();

  /// Training with uneven inputs (torch's `with ddp.join():`). Collective: every rank calls
  ///   ddp.join([&] { for (auto& batch : my_batches) { ...forward, backward, step... } });
  /// with its own number of batches. Each DDP forward inside `body` first takes part in one
  /// small all-reduce that counts the ranks that still have data; once `body` returns, this rank
  /// shadows the others' iterations (their buffer broadcasts and bucket all-reduces, with zero
  /// gradients) until every rank has returned from `body`, then every rank takes the parameters
  /// and buffers of the highest rank among the last to finish, so all replicas end identical.
  /// Inside `body`, each synchronised forward must be followed by its backward pass, and the
  /// loop must not run other collectives (unless throw_on_early_termination). If `body` throws,
  /// join() rethrows at once (the other ranks then fail with the group's timeout). Throws
  /// ValueError for a nested join() or if the ranks disagree (some under no_sync(), some not),
  /// and DistError with throw_on_early_termination.
  void join(const std::function<void()>& body, JoinOptions options = {});

  /// The wrapped module.
  const std::shared_ptr<nn::Module>& module() const { return module_; }
  const std::shared_ptr<ProcessGroup>& process_group() const { return group_; }
  /// The group DDP issues its collectives on: process_group(), or under
  /// EMBER_DISTRIBUTED_DEBUG=DETAIL a CheckedProcessGroup wrapping it.
  const std::shared_ptr<ProcessGroup>& comm_group() const { return comm_; }
  const DDPOptions& options() const { return options_; }
  /// The buckets as indices into the module's parameters() (those requiring grad counted too),
  /// in reduction order: for tests and debugging. Changes once, at the first forward after the
  /// first synchronised backward pass (see buckets_rebuilt()).
  std::vector<std::vector<size_t>> bucket_indices() const;
  /// Whether the one-time bucket rebuild has happened (the buckets now follow the order in which
  /// rank 0's gradients became ready in the first synchronised backward pass; every rank uses
  /// rank 0's order). Not done with find_unused_parameters (as in torch).
  bool buckets_rebuilt() const;

  /// Replaces the averaging all-reduce of each bucket by `hook` (see distributed/ddp/comm_hooks.h):
  /// it runs on the backward thread when the bucket is launched (strictly in bucket order) and
  /// its Future's value()[0] becomes the bucket's reduced gradients. Every rank must register
  /// the same hook. Throws ValueError if `hook` is null, a hook is already registered, or a
  /// backward pass has already run.
  /// `name` is what stats() reports; empty: the built-in hook's name, or "custom".
  void register_comm_hook(CommHook hook, std::string name = {});
  /// torch's register_comm_hook(state, hook): `hook(*state, bucket)` with `hook` any callable
  /// taking (State&, GradBucket&), e.g. register_comm_hook(powersgd_state, powersgd_hook,
  /// "powersgd"). DDP keeps `state` alive.
  template <typename State, typename Hook>
  void register_comm_hook(std::shared_ptr<State> state, Hook hook, std::string name = "custom") {
    EMBER_CHECK(state != nullptr,
                "[DistributedDataParallel] register_comm_hook expects a state, "
                "got null (pass a CommHook alone for a stateless hook)");
    register_comm_hook(bind_hook(std::move(state), std::move(hook)), std::move(name));
  }

  /// This rank's statistics: configuration, buckets and timings (see DDPStats). Cheap: the
  /// timings are kept whatever EMBER_DISTRIBUTED_DEBUG says.
  DDPStats stats() const;

 private:
  // forward and forward_many: the iteration's plan (buffers, rebuild, join) around `run`.
  template <typename Run>
  auto run_forward(Run&& run);

  std::shared_ptr<nn::Module> module_;
  std::shared_ptr<ProcessGroup> group_;
  std::shared_ptr<ProcessGroup> comm_;
  DDPOptions options_;
  std::shared_ptr<detail::Reducer> reducer_;   // ddp/detail/reducer.h
  std::unique_ptr<detail::JoinContext> join_;  // set while inside join(); ddp/detail/ddp_join.h
};

}  // namespace ember::dist
