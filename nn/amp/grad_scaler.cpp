// GradScaler: PyTorch 1.13's algorithm (torch/cuda/amp/grad_scaler.py and the
// _amp_update_scale_ kernel), with the unscale fused per gradient (tensor/ops/amp.h).
#include <ember/nn/amp/grad_scaler.h>

#include <cmath>

#include <ember/nn/optim/optimizer.h>
#include <ember/tensor/ops/amp.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/error.h>
#include <ember/tensor/grad_mode.h>

namespace ember::nn::amp {

namespace {

void check_growth_factor(double v) {
  EMBER_CHECK(v > 1.0, "[GradScaler] growth_factor must be > 1.0, got ", v);
}
void check_backoff_factor(double v) {
  EMBER_CHECK(v > 0.0 && v < 1.0, "[GradScaler] backoff_factor must be in (0, 1), got ", v);
}
void check_growth_interval(int64_t v) {
  EMBER_CHECK(v > 0, "[GradScaler] growth_interval must be > 0, got ", v);
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options)
    : options_(std::move(options)), scale_(static_cast<float>(options_.init_scale)) {
  if (!options_.enabled) return;
  EMBER_CHECK(options_.init_scale > 0 && std::isfinite(scale_),
              "[GradScaler] init_scale must be a positive finite float32, got ",
              options_.init_scale);
  check_growth_factor(options_.growth_factor);
  check_backoff_factor(options_.backoff_factor);
  check_growth_interval(options_.growth_interval);
}

Tensor GradScaler::scale(const Tensor& loss) {
  if (!options_.enabled) return loss;
  detail::check_defined("GradScaler.scale", loss, "loss");
  EMBER_CHECK(loss.is_floating_point(), "[GradScaler.scale] expected a floating-point loss, got ",
              loss.dtype());
  const bool low = loss.dtype() == kFloat16 || loss.dtype() == kBFloat16;
  const Tensor l = low ? loss.to(kFloat32) : loss;
  if (!options_.capturable) return l * static_cast<double>(scale_);
  if (!scale_dev_.defined()) {
    scale_dev_ =
        full({}, static_cast<double>(scale_), TensorOptions(kFloat32).device(loss.device()));
    growth_tracker_dev_ =
        full({}, static_cast<double>(growth_tracker_), TensorOptions(kInt32).device(loss.device()));
  }
  EMBER_CHECK(loss.device() == scale_dev_.device(),
              "[GradScaler.scale] a capturable scaler keeps its scale on ", scale_dev_.device(),
              ", got a loss on ", loss.device());
  return l * scale_dev_;
}

namespace {

// Where the optimizer's parameters are (the first one's device), for a flag of a rank whose
// parameters have no gradient; the CPU if it has no parameters.
Device parameters_device(const optim::Optimizer& optimizer) {
  for (const optim::ParamGroup& group : optimizer.param_groups()) {
    if (!group.params.empty()) return group.params.front().device();
  }
  return kCPU;
}

}  // namespace

GradScaler::PerOptimizer& GradScaler::state_of(const optim::Optimizer& optimizer) {
  return per_optimizer_[&optimizer];
}

void GradScaler::unscale_(optim::Optimizer& optimizer) {
  if (!options_.enabled) return;
  PerOptimizer& st = state_of(optimizer);
  if (st.stage == Stage::kUnscaled) {
    throw Error(
        "[GradScaler.unscale_] unscale_() has already been called on this optimizer since the "
        "last update()");
  }
  if (st.stage == Stage::kStepped) {
    throw Error("[GradScaler.unscale_] unscale_() is being called after step()");
  }
  NoGradGuard no_grad;
  // torch: self._scale.double().reciprocal().float()
  const double inv_scale = static_cast<float>(1.0 / static_cast<double>(scale_));
  Tensor inv_scale_dev;
  if (on_device()) inv_scale_dev = reciprocal(scale_dev_.to(kFloat64)).to(kFloat32);
  // Every gradient is checked before any is divided, so a refusal leaves them all as they were
  // (a retry would otherwise divide the first ones twice).
  std::vector<Tensor> grads;
  for (const optim::ParamGroup& group : optimizer.param_groups()) {
    for (const Tensor& p : group.params) {
      const Tensor g = p.grad();
      if (!g.defined()) continue;
      EMBER_CHECK(g.dtype() != kFloat16,
                  "[GradScaler.unscale_] Attempting to unscale FP16 gradients: keep the "
                  "parameters in float32 and let autocast make the float16 copies");
      EMBER_CHECK(!inv_scale_dev.defined() || g.device() == scale_dev_.device(),
                  "[GradScaler.unscale_] a capturable scaler keeps its scale on ",
                  scale_dev_.device(), ", got a gradient on ", g.device());
      grads.push_back(g);
    }
  }
  std::vector<Tensor> found_infs;  // one per device holding gradients, in first-seen order
  for (const Tensor& g : grads) {
    Tensor* found = nullptr;
    for (Tensor& f : found_infs) {
      if (f.device() == g.device()) found = &f;
    }
    if (found == nullptr) found = &found_infs.emplace_back(zeros({1}, g.device()));
    if (inv_scale_dev.defined()) {
      detail::amp_unscale_(g, *found, inv_scale_dev);
    } else {
      detail::amp_unscale_(g, *found, inv_scale);
    }
  }
  st.stage = Stage::kUnscaled;
  st.recorded = !found_infs.empty();
  // found_inf_sync is collective: a rank without gradients still takes part, with a clear flag
  // on its parameters' device (its peers would otherwise wait for it).
  if (found_infs.empty() && (inv_scale_dev.defined() || options_.found_inf_sync)) {
    found_infs.push_back(
        zeros({1}, inv_scale_dev.defined() ? scale_dev_.device() : parameters_device(optimizer)));
  }
  if (inv_scale_dev.defined()) {
    if (options_.found_inf_sync) options_.found_inf_sync(found_infs[0]);
    st.found_inf_dev = found_infs[0];
    return;
  }
  bool any = false;
  for (Tensor& f : found_infs) {
    if (options_.found_inf_sync) options_.found_inf_sync(f);
    any = any || f.item<float>() != 0.0f;
  }
  st.found_inf = any;
}

bool GradScaler::step(optim::Optimizer& optimizer) {
  if (!options_.enabled) {
    optimizer.step();
    return true;
  }
  PerOptimizer& st = state_of(optimizer);
  if (st.stage == Stage::kStepped) {
    throw Error("[GradScaler.step] step() has already been called since the last update()");
  }
  if (options_.capturable) {
    EMBER_CHECK(optimizer.supports_found_inf(),
                "[GradScaler.step] a capturable scaler skips steps on the device, which ",
                optimizer.name(),
                " does not support: use Adam or AdamW (capturable=true for "
                "CUDA parameters) or GradScalerOptions::capturable=false");
  }
  if (st.stage == Stage::kReady) unscale_(optimizer);
  // As torch ("No inf checks were recorded for this optimizer"): most likely no backward ran.
  // Under found_inf_sync a rank without gradients has taken part in the sync, and steps nothing.
  if (!st.recorded && !options_.found_inf_sync) {
    throw Error(
        "[GradScaler.step] No inf checks were recorded for this optimizer: none of its "
        "parameters has a gradient (did backward run on the scaled loss?)");
  }
  if (st.found_inf_dev.defined()) {
    optimizer.step_unless(st.found_inf_dev);
    st.stage = Stage::kStepped;
    return true;
  }
  const bool run = !st.found_inf;
  if (run) optimizer.step();
  st.stage = Stage::kStepped;
  return run;
}

void GradScaler::update() {
  if (!options_.enabled) return;
  bool recorded = false;
  for (const auto& [opt, st] : per_optimizer_) recorded = recorded || st.stage != Stage::kReady;
  if (!recorded) throw Error("[GradScaler.update] No inf checks were recorded prior to update()");
  if (on_device()) {
    NoGradGuard no_grad;
    Tensor combined;
    for (const auto& [opt, st] : per_optimizer_) {
      if (!st.found_inf_dev.defined()) continue;
      combined = combined.defined() ? combined + st.found_inf_dev : st.found_inf_dev;
    }
    detail::amp_update_scale_(scale_dev_, growth_tracker_dev_, combined, options_.growth_factor,
                              options_.backoff_factor, options_.growth_interval);
  } else {
    bool found = false;
    for (const auto& [opt, st] : per_optimizer_) found = found || st.found_inf;
    detail::amp_update_scale(scale_, growth_tracker_, found, options_.growth_factor,
                             options_.backoff_factor, options_.growth_interval);
  }
  reset_per_optimizer();
}

void GradScaler::update(double new_scale) {
  if (!options_.enabled) return;
  scale_ = static_cast<float>(new_scale);
  if (on_device()) {
    NoGradGuard no_grad;
    scale_dev_.fill_(static_cast<double>(scale_));
  }
  reset_per_optimizer();
}

void GradScaler::reset_per_optimizer() { per_optimizer_.clear(); }

double GradScaler::get_scale() const {
  if (!options_.enabled) return 1.0;
  return on_device() ? scale_dev_.item<float>() : scale_;
}

int64_t GradScaler::growth_tracker() const {
  return on_device() ? growth_tracker_dev_.item<int32_t>() : growth_tracker_;
}

void GradScaler::set_growth_factor(double v) {
  check_growth_factor(v);
  options_.growth_factor = v;
}
void GradScaler::set_backoff_factor(double v) {
  check_backoff_factor(v);
  options_.backoff_factor = v;
}
void GradScaler::set_growth_interval(int64_t v) {
  check_growth_interval(v);
  options_.growth_interval = v;
}

std::map<std::string, double> GradScaler::state_dict() const {
  if (!options_.enabled) return {};
  return {{"scale", get_scale()},
          {"growth_factor", options_.growth_factor},
          {"backoff_factor", options_.backoff_factor},
          {"growth_interval", static_cast<double>(options_.growth_interval)},
          {"_growth_tracker", static_cast<double>(growth_tracker())}};
}

void GradScaler::load_state_dict(const std::map<std::string, double>& state) {
  if (!options_.enabled) return;
  if (state.empty()) {
    throw Error(
        "[GradScaler.load_state_dict] The source state dict is empty, possibly because it was "
        "saved from a disabled instance of GradScaler");
  }
  auto get = [&](const char* key) {
    auto it = state.find(key);
    EMBER_CHECK(it != state.end(), "[GradScaler.load_state_dict] missing key '", key, "'");
    return it->second;
  };
  const double scale = get("scale"), growth = get("growth_factor"), backoff = get("backoff_factor"),
               interval = get("growth_interval"), tracker = get("_growth_tracker");
  check_growth_factor(growth);
  check_backoff_factor(backoff);
  check_growth_interval(static_cast<int64_t>(interval));
  scale_ = static_cast<float>(scale);
  options_.growth_factor = growth;
  options_.backoff_factor = backoff;
  options_.growth_interval = static_cast<int64_t>(interval);
  growth_tracker_ = static_cast<int64_t>(tracker);
  if (on_device()) {
    NoGradGuard no_grad;
    scale_dev_.fill_(static_cast<double>(scale_));
    growth_tracker_dev_.fill_(static_cast<double>(growth_tracker_));
  }
}

}  // namespace ember::nn::amp
