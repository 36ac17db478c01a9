// Autocast: PyTorch's torch.autocast for Ember. Inside an enabled scope, ops that gain from low
// precision (matrix products, convolution, attention) cast their floating inputs to the
// autocast dtype; ops that need range or accumulation (softmax, log_softmax, layer_norm, the
// losses, sum, mean, exp, log, pow) cast low-precision inputs up to float32; every other op
// follows its inputs with the usual type promotion. The table is in docs/mixed_precision.md.
//
// The state is per thread and per device type (CPU autocast does not change CUDA ops and vice
// versa), like grad mode (tensor/grad_mode.h); it lives in the tensor layer because the ops that
// consult it record their autograd nodes here. The casts are ordinary differentiable `to()`
// copies, so gradients reach float32 leaves in float32.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>

#include <ember/tensor/device.h>
#include <ember/tensor/dtype.h>
#include <ember/tensor/tensor.h>

namespace ember {

/// Whether autocast is on for ops whose inputs live on devices of `device`'s type (the index
/// is ignored), on this thread.
bool is_autocast_enabled(Device device);
/// The low-precision dtype autocast uses for `device`'s type on this thread (default bfloat16
/// on CPU, float16 on CUDA), whether or not autocast is enabled.
Dtype get_autocast_dtype(Device device);
/// Low-level setters (the guard below is the usual way). set_autocast_dtype throws ValueError
/// for a dtype autocast does not support on that device type (CPU: bfloat16 only, as in torch;
/// CUDA: float16 or bfloat16).
void set_autocast_enabled(Device device, bool enabled);
void set_autocast_dtype(Device device, Dtype dtype);
/// Whether casts of float32 tensors that require grad are cached within the outermost autocast
/// scope (torch's cache_enabled; on by default).
bool is_autocast_cache_enabled();
void set_autocast_cache_enabled(bool enabled);
/// Drops this thread's cached casts (done when the outermost AutocastGuard exits).
void clear_autocast_cache();

/// torch.autocast(device_type, dtype, enabled, cache_enabled) as a scope guard:
///
///   { ember::AutocastGuard amp(kCPU, kBFloat16); auto y = model.forward(x); }
///
/// Sets the state of `device`'s type for the scope and restores the previous state on exit, so
/// nested and disabled (`enabled = false`) scopes behave as in torch. `dtype` defaults to the
/// current get_autocast_dtype(device). When the outermost guard on this thread exits, the cast
/// cache is cleared. An enabled guard throws ValueError for an unsupported dtype (float16 on
/// CPU: torch 1.13 warns and disables autocast; Ember refuses); a disabled one never throws. Not
/// movable; one thread only.
class AutocastGuard {
 public:
  explicit AutocastGuard(Device device, std::optional<Dtype> dtype = std::nullopt,
                         bool enabled = true, std::optional<bool> cache_enabled = std::nullopt);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  Device device_;
  bool prev_enabled_;
  Dtype prev_dtype_;
  bool prev_cache_;
};

/// How an op treats its inputs under autocast (torch's CastPolicy).
enum class AutocastPolicy : uint8_t {
  kLowPrecision,  ///< cast floating inputs (not float64) to the autocast dtype
  kFloat32,       ///< cast floating inputs (not float64) to float32
  kPromote,       ///< cast all floating inputs to the widest floating dtype among them
};

namespace detail {

/// One bit per DeviceType that is enabled and not suspended by an AutocastInputs in flight:
/// a plain __thread byte so an op's "is autocast on?" test is one load.
extern __thread uint8_t t_autocast_active;

/// What an op front end holds while it re-enters itself with cast inputs:
///
///   Tensor mm(const Tensor& a, const Tensor& b) {
///     if (auto ac = detail::autocast_inputs(AutocastPolicy::kLowPrecision, a, b))
///       return mm(ac[0], ac[1]);
///     ...
///
/// Converts to true only when autocast is on for the device of the first defined input; then
/// ac[i] is input i cast by the policy (undefined, integral and float64 inputs unchanged), and
/// autocast stays suspended for that device type until `ac` is destroyed, so the re-entered op
/// and the ops it is built from run as written (torch excludes its Autocast key the same way).
class AutocastInputs {
 public:
  static constexpr size_t kMaxInputs = 6;
  AutocastInputs(AutocastPolicy policy, std::initializer_list<const Tensor*> inputs);
  ~AutocastInputs();
  AutocastInputs(const AutocastInputs&) = delete;
  AutocastInputs& operator=(const AutocastInputs&) = delete;
  explicit operator bool() const { return active_; }
  const Tensor& operator[](size_t i) const { return cast_[i]; }

 private:
  bool active_ = false;
  uint8_t suspended_ = 0;  // the DeviceType this object suspended
  std::array<Tensor, kMaxInputs> cast_;
};

/// How many casts this thread's cache holds (for tests).
size_t autocast_cache_size();

/// The hook an op front end calls; see AutocastInputs. Costs one thread-local load when
/// autocast is off.
template <typename... Ts>
AutocastInputs autocast_inputs(AutocastPolicy policy, const Ts&... inputs) {
  static_assert(sizeof...(Ts) <= AutocastInputs::kMaxInputs, "too many autocast inputs");
  if (t_autocast_active == 0) return AutocastInputs(policy, {});
  return AutocastInputs(policy, {&inputs...});
}

}  // namespace detail
}  // namespace ember
