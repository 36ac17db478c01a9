// Learning-rate schedulers (torch.optim.lr_scheduler, PyTorch 1.13's formulas).
//
// A scheduler changes the "lr" option of each of an optimizer's parameter groups. Call step()
// once per epoch (or per iteration for OneCycleLR / warmup), after optimizer.step(). Like
// PyTorch's, each scheduler steps once at construction (last_epoch becomes 0), and the
// "chainable" schedulers (StepLR, CosineAnnealingLR, LinearLR, ...) compute the next lr from the
// group's current lr, so their values match PyTorch's to the last bit of a double.
//
// Ownership: a scheduler keeps a reference to its optimizer, which must outlive it. Threads: one
// thread at a time, like the optimizer.
//
// Resuming: construct the optimizer and the scheduler as for a fresh run, then load the
// optimizer's state (which restores each group's "lr" and "initial_lr") and then the
// scheduler's. The scheduler's state holds its counters and lrs; its settings (step_size,
// T_max, ...) come from the constructor.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ember/nn/optim/optimizer.h>

namespace ember::nn::optim {

class SequentialLR;

class LRScheduler {
 public:
  virtual ~LRScheduler() = default;
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;

  /// "StepLR", "CosineAnnealingLR", ...
  virtual std::string name() const = 0;
  /// Advances one epoch and sets every group's lr.
  virtual void step();
  /// The lr of each group set by the last step.
  const std::vector<double>& get_last_lr() const { return last_lr_; }
  /// The index of the last epoch (0 right after construction).
  int64_t last_epoch() const { return last_epoch_; }
  /// Each group's "initial_lr" when the scheduler was made.
  const std::vector<double>& base_lrs() const { return base_lrs_; }
  Optimizer& optimizer() { return optimizer_; }

  /// The scheduler's state as JSON: {"scheduler": name, "last_epoch", "step_count",
  /// "base_lrs", "last_lr"} (SequentialLR adds its schedulers' states). Store it as a string
  /// in a checkpoint's metadata.
  virtual std::string state_dict() const;
  /// Restores state_dict(); throws ValueError naming the field if the JSON is malformed, is
  /// from another scheduler type, or has another number of groups.
  virtual void load_state_dict(const std::string& state);

 protected:
  explicit LRScheduler(Optimizer& optimizer);
  /// PyTorch's _LRScheduler.__init__ tail; call at the end of the subclass constructor (the
  /// first step needs the subclass's get_lr). last_epoch == -1 starts afresh, setting each
  /// group's "initial_lr" to its lr if absent; otherwise every group must have "initial_lr".
  void start(int64_t last_epoch);
  /// Sets step_count to 0 and steps once.
  void initial_step();
  /// The lrs for last_epoch_ (called by step after incrementing it).
  virtual std::vector<double> get_lr() = 0;
  /// The closed-form lrs for last_epoch_, where the scheduler has one (used by step(epoch)).
  virtual std::vector<double> closed_form_lr() { return get_lr(); }
  /// PyTorch's deprecated step(epoch): jumps to `epoch` using the closed form.
  void step_to(int64_t epoch);
  /// Sets the groups' lrs and last_lr_.
  void apply(const std::vector<double>& lrs);
  /// One value per group: `values` of size 1 is repeated; otherwise the size must match.
  std::vector<double> per_group(const std::vector<double>& values, const char* what) const;
  /// Each group's current lr.
  std::vector<double> group_lrs() const;

  Optimizer& optimizer_;
  std::vector<double> base_lrs_;
  std::vector<double> last_lr_;
  int64_t last_epoch_ = -1;
  int64_t step_count_ = 0;

  friend class SequentialLR;
};

/// lr = initial_lr * lr_lambda(epoch), one function for all groups or one per group.
class LambdaLR : public LRScheduler {
 public:
  using Lambda = std::function<double(int64_t epoch)>;
  LambdaLR(Optimizer& optimizer, Lambda lr_lambda, int64_t last_epoch = -1);
  /// Throws ValueError if the number of functions is not the number of groups.
  LambdaLR(Optimizer& optimizer, std::vector<Lambda> lr_lambdas, int64_t last_epoch = -1);
  std::string name() const override { return "LambdaLR"; }

 protected:
  std::vector<double> get_lr() override;

 private:
  std::vector<Lambda> lambdas_;
};

/// Multiplies the lr by gamma every step_size epochs. Throws ValueError for step_size <= 0.
class StepLR : public LRScheduler {
 public:
  StepLR(Optimizer& optimizer, int64_t step_size, double gamma = 0.1, int64_t last_epoch = -1);
  std::string name() const override { return "StepLR"; }

 protected:
  std::vector<double> get_lr() override;
  std::vector<double> closed_form_lr() override;

 private:
  int64_t step_size_;
  double gamma_;
};

/// Multiplies the lr by gamma at each milestone epoch (given in any order; a milestone listed
/// twice applies twice).
class MultiStepLR : public LRScheduler {
 public:
  MultiStepLR(Optimizer& optimizer, std::vector<int64_t> milestones, double gamma = 0.1,
              int64_t last_epoch = -1);
  std::string name() const override { return "MultiStepLR"; }

 protected:
  std::vector<double> get_lr() override;
  std::vector<double> closed_form_lr() override;

 private:
  std::vector<int64_t> milestones_;
  double gamma_;
};

/// Multiplies the lr by gamma every epoch.
class ExponentialLR : public LRScheduler {
 public:
  ExponentialLR(Optimizer& optimizer, double gamma, int64_t last_epoch = -1);
  std::string name() const override { return "ExponentialLR"; }

 protected:
  std::vector<double> get_lr() override;
  std::vector<double> closed_form_lr() override;

 private:
  double gamma_;
};

/// Cosine annealing from initial_lr to eta_min over T_max epochs (and back up over the next
/// T_max, periodically), by PyTorch's recursive formula
///   lr_t = eta_min + (lr_{t-1} - eta_min) * (1 + cos(pi t / T_max)) / (1 + cos(pi (t-1) / T_max))
/// which follows the closed form eta_min + (initial_lr - eta_min) * (1 + cos(pi t / T_max)) / 2
/// when nothing else changes the lr. Throws ValueError for T_max <= 0.
class CosineAnnealingLR : public LRScheduler {
 public:
  CosineAnnealingLR(Optimizer& optimizer, int64_t T_max, double eta_min = 0,
                    int64_t last_epoch = -1);
  std::string name() const override { return "CosineAnnealingLR"; }

 protected:
  std::vector<double> get_lr() override;
  std::vector<double> closed_form_lr() override;

 private:
  int64_t t_max_;
  double eta_min_;
};

/// Linear warmup (or decay): the lr factor goes from start_factor at epoch 0 to end_factor at
/// epoch total_iters and stays there. Throws ValueError for factors outside [0, 1] (start_factor
/// must be > 0, as the recursive formula divides by it) or total_iters <= 0.
class LinearLR : public LRScheduler {
 public:
  LinearLR(Optimizer& optimizer, double start_factor = 1.0 / 3, double end_factor = 1.0,
           int64_t total_iters = 5, int64_t last_epoch = -1);
  std::string name() const override { return "LinearLR"; }

 protected:
  std::vector<double> get_lr() override;
  std::vector<double> closed_form_lr() override;

 private:
  double start_factor_, end_factor_;
  int64_t total_iters_;
};

/// Runs schedulers one after another: schedulers[i] from epoch milestones[i-1] on, e.g. linear
/// warmup then cosine decay:
///   auto warmup = std::make_shared<LinearLR>(opt, 0.01, 1.0, 100);
///   auto cosine = std::make_shared<CosineAnnealingLR>(opt, 900);
///   SequentialLR sched(opt, {warmup, cosine}, {100});
/// At a milestone the next scheduler restarts from epoch 0 (PyTorch's step(0)). Throws
/// ValueError if a scheduler belongs to another optimizer or milestones.size() is not
/// schedulers.size() - 1.
class SequentialLR : public LRScheduler {
 public:
  SequentialLR(Optimizer& optimizer, std::vector<std::shared_ptr<LRScheduler>> schedulers,
               std::vector<int64_t> milestones, int64_t last_epoch = -1);
  std::string name() const override { return "SequentialLR"; }
  void step() override;
  std::string state_dict() const override;
  void load_state_dict(const std::string& state) override;

 protected:
  std::vector<double> get_lr() override;

 private:
  std::vector<std::shared_ptr<LRScheduler>> schedulers_;
  std::vector<int64_t> milestones_;
};

/// OneCycleLR's settings (torch.optim.lr_scheduler.OneCycleLR's arguments).
struct OneCycleLROptions {
  /// Peak lr: one value for all groups or one per group.
  std::vector<double> max_lr = {};
  /// Number of steps in the cycle (> 0); or give epochs and steps_per_epoch instead.
  int64_t total_steps = 0;
  int64_t epochs = 0;
  int64_t steps_per_epoch = 0;
  /// Fraction of the cycle spent increasing the lr.
  double pct_start = 0.3;
  /// "cos" or "linear".
  std::string anneal_strategy = "cos";
  /// Cycle the momentum ("momentum" for SGD, "beta1" for Adam/AdamW) inversely to the lr.
  bool cycle_momentum = true;
  std::vector<double> base_momentum = {0.85};
  std::vector<double> max_momentum = {0.95};
  /// initial_lr = max_lr / div_factor; min_lr = initial_lr / final_div_factor.
  double div_factor = 25;
  double final_div_factor = 1e4;
  /// Three phases (up, down to initial_lr, down to min_lr) instead of two (up, down to min_lr).
  bool three_phase = false;
};

/// The 1cycle policy (Smith & Topin), stepped once per batch. Sets each group's "initial_lr",
/// "max_lr", "min_lr" (and with cycle_momentum "max_momentum", "base_momentum"). Throws
/// ValueError for a bad setting (naming it), when cycle_momentum is set but the optimizer has
/// no momentum, and from step() beyond total_steps.
class OneCycleLR : public LRScheduler {
 public:
  OneCycleLR(Optimizer& optimizer, const OneCycleLROptions& options, int64_t last_epoch = -1);
  std::string name() const override { return "OneCycleLR"; }
  int64_t total_steps() const { return total_steps_; }

 protected:
  std::vector<double> get_lr() override;

 private:
  struct Phase {
    double end_step;
    const char *start_lr, *end_lr, *start_momentum, *end_momentum;
  };
  double anneal(double start, double end, double pct) const;

  int64_t total_steps_;
  std::vector<Phase> phases_;
  bool cos_;
  bool cycle_momentum_;
  const char* momentum_key_ = "momentum";
};

}  // namespace ember::nn::optim
