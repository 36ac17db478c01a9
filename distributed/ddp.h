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
// in reverse registration order, into buckets of about bucket_cap_mb each (one flat buffer per
// bucket, per dtype and device). During backward each parameter's post-accumulate-grad hook
// copies its gradient into its bucket; a full bucket is all-reduced (average) asynchronously
// while backward goes on, buckets always in the same order on every rank. When the backward
// pass ends, a queued autograd callback waits for every bucket and writes the averages back
// into the parameters' grad(). See docs/ddp.md.
//
// Threads: like any Module, one thread at a time; backward must run on the thread that owns the
// process group's collectives (collectives are issued from the backward pass).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "distributed/process_group.h"
#include "nn/module.h"

namespace ember::dist {

/// Options of DistributedDataParallel (torch's constructor arguments of the same names).
struct DDPOptions {
  /// Bucket size in MiB (a bucket closes once it holds at least this much).
  double bucket_cap_mb = 25;
  /// Copy rank 0's buffers to every rank at the start of each training-mode forward.
  bool broadcast_buffers = true;
  /// After the first reduction, grad() of each parameter is a view into its bucket's flat
  /// buffer (saves one copy and the memory of the gradients).
  bool gradient_as_bucket_view = false;
  /// Parameters that get no gradient in an iteration contribute zeros instead of raising an
  /// error; a parameter that no rank used keeps its grad() untouched.
  bool find_unused_parameters = false;
};

namespace detail {
struct Reducer;
}

class DistributedDataParallel : public nn::Module {
 public:
  /// Wraps `module` (registered as submodule "module", so parameter names get the "module."
  /// prefix as in torch). `group` null: the default group. Collective: every rank of the group
  /// must construct it with the same model structure. Throws ValueError naming the first
  /// parameter whose shape or dtype differs and the rank that has it, and the group's errors.
  explicit DistributedDataParallel(std::shared_ptr<nn::Module> module,
                                   std::shared_ptr<ProcessGroup> group = nullptr,
                                   DDPOptions options = {});
  ~DistributedDataParallel() override;

  std::string name() const override { return "DistributedDataParallel"; }

  /// Broadcasts buffers from rank 0 (training mode, broadcast_buffers), runs the module's
  /// forward, and (when grad mode is on and not under no_sync) arms gradient synchronisation
  /// for the next backward pass (a forward whose backward never ran is simply superseded).
  Tensor forward(const Tensor& input) override;

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

  /// The wrapped module.
  const std::shared_ptr<nn::Module>& module() const { return module_; }
  const std::shared_ptr<ProcessGroup>& process_group() const { return group_; }
  const DDPOptions& options() const { return options_; }
  /// The buckets as indices into the module's parameters() (those requiring grad counted too),
  /// in reduction order: for tests and debugging.
  std::vector<std::vector<size_t>> bucket_indices() const;

 private:
  std::shared_ptr<nn::Module> module_;
  std::shared_ptr<ProcessGroup> group_;
  DDPOptions options_;
  bool require_sync_ = true;
  std::shared_ptr<detail::Reducer> reducer_;
};

}  // namespace ember::dist
