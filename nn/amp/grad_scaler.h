// GradScaler: torch.cuda.amp.GradScaler (PyTorch 1.13) for Ember, on CPU and CUDA.
//
//   nn::amp::GradScaler scaler;
//   for (...) {
//     opt.zero_grad();
//     Tensor loss;
//     { nn::amp::autocast amp(device, kFloat16); loss = loss_fn(model.forward(x), y); }
//     scaler.scale(loss).backward();
//     scaler.unscale_(opt);            // optional: only to clip or inspect unscaled grads
//     clip_grad_norm_(params, 1.0);
//     scaler.step(opt);                // skipped when a gradient holds an inf or NaN
//     scaler.update();                 // backs off after a skip, grows after growth_interval
//   }
//
// The loss is multiplied by the scale before backward so small float16 gradients do not flush
// to zero; unscale_ divides the gradients by it again in one fused pass that also detects inf
// and NaN (tensor/ops/amp.h). Data parallel: see GradScalerOptions::found_inf_sync and
// docs/mixed_precision.md.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include <ember/tensor/tensor.h>

namespace ember::nn::optim {
class Optimizer;
}  // namespace ember::nn::optim

namespace ember::nn::amp {

/// Makes `found_inf` (a float32 tensor of one element: 1 if this rank saw an inf/NaN gradient,
/// else 0) agree across the ranks of a data-parallel job, in place, e.g. an allreduce with
/// ReduceOp::Max (dist::found_inf_allreduce builds one). Called once per device per unscale.
using FoundInfSync = std::function<void(Tensor& found_inf)>;

/// torch's constructor arguments, with its defaults.
struct GradScalerOptions {
  double init_scale = 65536.0;  ///< 2^16
  double growth_factor = 2.0;   ///< scale *= growth_factor after growth_interval clean steps
  double backoff_factor = 0.5;  ///< scale *= backoff_factor after a step with inf/NaN grads
  int64_t growth_interval = 2000;
  /// false: every method is a pass-through (scale returns the loss, step just steps).
  bool enabled = true;
  /// Unset: each rank decides from its own gradients. Set it under data parallelism when the
  /// ranks' gradients may differ (a comm hook that is not an exact average, or no DDP at all),
  /// so every rank skips the same steps.
  FoundInfSync found_inf_sync = nullptr;
  /// Keep the scale, the growth tracker and the inf flags on the loss's device and never read
  /// them on the host during a step, so a CUDA graph can hold scale, unscale_, step and update
  /// (Note [CUDA graphs]; PyTorch 2's GradScaler does the same with optimizers that accept
  /// found_inf). step() then hands the flag to Optimizer::step_unless, which must
  /// supports_found_inf() (Adam/AdamW, capturable for CUDA parameters) and returns true: whether
  /// the update applied is decided on the device. Every gradient must be on that device.
  bool capturable = false;
};

/// The dynamic loss scaler. Not thread-safe; one per training loop. Throws ValueError for
/// options torch rejects (growth_factor <= 1, backoff_factor outside (0, 1), growth_interval
/// <= 0, init_scale <= 0), and Error where torch raises RuntimeError (see each method).
class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  /// loss * scale. A float16/bfloat16 loss is first cast to float32 (torch multiplies by a
  /// float32 tensor, which promotes), so the scaled loss cannot overflow the low dtype.
  /// Disabled: returns `loss`.
  Tensor scale(const Tensor& loss);

  /// Divides every gradient of `optimizer`'s parameters by the scale, in place, and records
  /// whether any was inf or NaN (then synchronised by found_inf_sync if set: on every rank,
  /// one with no gradients included). Checks every gradient before dividing any. At most once per
  /// optimizer between update()s: a second call throws Error (torch: RuntimeError) ("unscale_() has
  /// already been called on this optimizer since the last update()"), as does a call after step().
  /// Throws ValueError for a float16 gradient (torch: "Attempting to unscale FP16 gradients";
  /// keep the parameters in float32 and let autocast make the low-precision copies).
  void unscale_(optim::Optimizer& optimizer);

  /// Unscales (unless unscale_ already ran) and runs optimizer.step() unless a gradient held an
  /// inf or NaN. Returns whether the step ran (capturable: true, the optimizer skips it on the
  /// device). Throws Error (torch: RuntimeError) when called twice before update(), when none
  /// of the optimizer's parameters has a gradient (torch: "No inf checks were recorded"; under
  /// found_inf_sync such a rank takes part in the sync with a clear flag and steps nothing,
  /// since its peers wait for it), and, when capturable, for an optimizer that does not
  /// support_found_inf().
  bool step(optim::Optimizer& optimizer);

  /// Updates the scale from this iteration's inf checks (backoff after any inf, growth after
  /// growth_interval clean iterations in a row) and resets the per-optimizer state. Throws
  /// RuntimeError if no optimizer was unscaled or stepped since the last update().
  void update();
  /// Sets the scale directly (torch's update(new_scale)); resets per-optimizer state.
  void update(double new_scale);

  /// The current scale (init_scale before the first scale()); 1 when disabled. Capturable: read
  /// from the device (a synchronisation; not during a capture).
  double get_scale() const;
  double get_growth_factor() const { return options_.growth_factor; }
  double get_backoff_factor() const { return options_.backoff_factor; }
  int64_t get_growth_interval() const { return options_.growth_interval; }
  void set_growth_factor(double v);
  void set_backoff_factor(double v);
  void set_growth_interval(int64_t v);
  bool is_enabled() const { return options_.enabled; }
  /// Clean iterations since the last growth or backoff.
  int64_t growth_tracker() const;
  /// Capturable, after the first scale(): the device scalars (float32 scale, int32 tracker).
  /// Undefined otherwise.
  const Tensor& scale_tensor() const { return scale_dev_; }
  const Tensor& growth_tracker_tensor() const { return growth_tracker_dev_; }

  /// torch's state_dict: {"scale", "growth_factor", "backoff_factor", "growth_interval",
  /// "_growth_tracker"}; empty when disabled.
  std::map<std::string, double> state_dict() const;
  /// Restores a state_dict. Throws Error (torch: RuntimeError) for an empty one (saved from a
  /// disabled scaler) and ValueError naming a missing key; a no-op when this scaler is disabled.
  void load_state_dict(const std::map<std::string, double>& state);

 private:
  enum class Stage { kReady, kUnscaled, kStepped };
  struct PerOptimizer {
    Stage stage = Stage::kReady;
    bool recorded = false;   // some parameter had a gradient to check
    bool found_inf = false;  // over every device, after found_inf_sync
    Tensor found_inf_dev;    // capturable: the flag on the scale's device instead
  };
  bool on_device() const { return options_.capturable && scale_dev_.defined(); }
  PerOptimizer& state_of(const optim::Optimizer& optimizer);
  void reset_per_optimizer();

  GradScalerOptions options_;
  float scale_;  // float32, as torch's _scale tensor, so growth and backoff round the same
  int64_t growth_tracker_ = 0;
  // Capturable: created by the first scale() on the loss's device from scale_ and
  // growth_tracker_, and the state from then on.
  Tensor scale_dev_;
  Tensor growth_tracker_dev_;
  std::unordered_map<const optim::Optimizer*, PerOptimizer> per_optimizer_;
};

}  // namespace ember::nn::amp
