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
  return (low ? loss.to(kFloat32) : loss) * static_cast<double>(scale_);
}

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
  // torch: self._scale.double().reciprocal().float()
  const double inv_scale = static_cast<float>(1.0 / static_cast<double>(scale_));
  NoGradGuard no_grad;
  std::vector<Tensor> found_infs;  // one per device holding gradients, in first-seen order
  for (const optim::ParamGroup& group : optimizer.param_groups()) {
    for (const Tensor& p : group.params) {
      const Tensor g = p.grad();
      if (!g.defined()) continue;
      EMBER_CHECK(g.dtype() != kFloat16,
                  "[GradScaler.unscale_] Attempting to unscale FP16 gradients: keep the "
                  "parameters in float32 and let autocast make the float16 copies");
      Tensor* found = nullptr;
      for (Tensor& f : found_infs) {
        if (f.device() == g.device()) found = &f;
      }
      if (found == nullptr) found = &found_infs.emplace_back(zeros({1}, g.device()));
      detail::amp_unscale_(g, *found, inv_scale);
    }
  }
  bool any = false;
  for (Tensor& f : found_infs) {
    if (options_.found_inf_sync) options_.found_inf_sync(f);
    any = any || f.item<float>() != 0.0f;
  }
  st.found_inf = any;
  st.stage = Stage::kUnscaled;
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
  if (st.stage == Stage::kReady) unscale_(optimizer);
  const bool run = !st.found_inf;
  if (run) optimizer.step();
  st.stage = Stage::kStepped;
  return run;
}

void GradScaler::update() {
  if (!options_.enabled) return;
  bool recorded = false, found = false;
  for (const auto& [opt, st] : per_optimizer_) {
    if (st.stage == Stage::kReady) continue;
    recorded = true;
    found = found || st.found_inf;
  }
  if (!recorded) throw Error("[GradScaler.update] No inf checks were recorded prior to update()");
  // torch's _amp_update_scale_: the products are taken in double and stored in float32.
  if (found) {
    scale_ = static_cast<float>(scale_ * options_.backoff_factor);
    growth_tracker_ = 0;
  } else if (growth_tracker_ + 1 == options_.growth_interval) {
    const float grown = static_cast<float>(scale_ * options_.growth_factor);
    if (std::isfinite(grown)) scale_ = grown;
    growth_tracker_ = 0;
  } else {
    ++growth_tracker_;
  }
  reset_per_optimizer();
}

void GradScaler::update(double new_scale) {
  if (!options_.enabled) return;
  scale_ = static_cast<float>(new_scale);
  reset_per_optimizer();
}

void GradScaler::reset_per_optimizer() { per_optimizer_.clear(); }

double GradScaler::get_scale() const { return options_.enabled ? scale_ : 1.0; }

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
  return {{"scale", scale_},
          {"growth_factor", options_.growth_factor},
          {"backoff_factor", options_.backoff_factor},
          {"growth_interval", static_cast<double>(options_.growth_interval)},
          {"_growth_tracker", static_cast<double>(growth_tracker_)}};
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
}

}  // namespace ember::nn::amp
