// Grad mode: whether differentiable ops record a graph on this thread.
//
// The flag lives in the tensor layer so an op's "should I record?" test is inline and costs a
// thread-local read. It is on by default. NoGradGuard turns it off for a scope (optimizer
// steps, evaluation, in-place parameter updates); EnableGradGuard turns it back on inside one.
#pragma once

namespace ember {

namespace detail {
// A plain __thread bool (no dynamic initialisation) so reading it needs no TLS wrapper call.
extern __thread bool t_grad_disabled;
}  // namespace detail

struct GradMode {
  static bool is_enabled() { return !detail::t_grad_disabled; }
  static void set_enabled(bool on) { detail::t_grad_disabled = !on; }
};

/// Sets grad mode for the guard's scope and restores the previous mode on exit.
class GradModeGuard {
 public:
  explicit GradModeGuard(bool enabled) : prev_(GradMode::is_enabled()) {
    GradMode::set_enabled(enabled);
  }
  ~GradModeGuard() { GradMode::set_enabled(prev_); }
  GradModeGuard(const GradModeGuard&) = delete;
  GradModeGuard& operator=(const GradModeGuard&) = delete;

 private:
  bool prev_;
};

/// torch.no_grad(): ops in scope record nothing and their results do not require grad.
class NoGradGuard : public GradModeGuard {
 public:
  NoGradGuard() : GradModeGuard(false) {}
};

/// torch.enable_grad(): recording on again, e.g. inside a NoGradGuard.
class EnableGradGuard : public GradModeGuard {
 public:
  EnableGradGuard() : GradModeGuard(true) {}
};

}  // namespace ember

namespace ember {

/// torch.inference_mode(). In PyTorch it also skips version-counter bumps and marks tensors
/// as unusable by autograd later; Ember's version bump is one relaxed atomic add, so inference
/// mode is exactly no-grad mode here (tensors made inside may later be used with autograd).
class InferenceMode : public GradModeGuard {
 public:
  explicit InferenceMode(bool enabled = true) : GradModeGuard(!enabled) {}
};

}  // namespace ember
