#include <ember/nn/optim/adam.h>

#include <cmath>
#include <optional>

#include <ember/tensor/gpu/cuda_graph.h>
#include <ember/tensor/ops/optim.h>

namespace ember::nn::optim {

namespace {
GroupOptions adam_defaults(const AdamOptions& o) {
  return {{"lr", o.lr},
          {"beta1", o.betas.first},
          {"beta2", o.betas.second},
          {"eps", o.eps},
          {"weight_decay", o.weight_decay},
          {"amsgrad", o.amsgrad ? 1.0 : 0.0},
          {"maximize", o.maximize ? 1.0 : 0.0},
          {"capturable", o.capturable ? 1.0 : 0.0}};
}

AdamOptions from_adamw(const AdamWOptions& o) {
  return {o.lr, o.betas, o.eps, o.weight_decay, o.amsgrad, o.maximize, o.capturable};
}
}  // namespace

Adam::Adam(std::vector<ParamGroup> groups, const AdamOptions& options)
    : Adam(std::move(groups), options, /*decoupled=*/false) {}

Adam::Adam(std::vector<ParamGroup> groups, const AdamOptions& options, bool decoupled)
    : Optimizer(adam_defaults(options), {"amsgrad", "maximize", "capturable"}),
      decoupled_(decoupled) {
  check_options(defaults(), 0);
  add_param_groups(std::move(groups));
}

AdamW::AdamW(std::vector<ParamGroup> groups, const AdamWOptions& options)
    : Adam(std::move(groups), from_adamw(options), /*decoupled=*/true) {}

void Adam::check_options(const GroupOptions& o, size_t gi) const {
  const std::string op = detail::str_cat("[", name(), "] ");
  const double lr = o.at("lr"), eps = o.at("eps"), wd = o.at("weight_decay");
  const double beta1 = o.at("beta1"), beta2 = o.at("beta2");
  EMBER_CHECK(lr >= 0, op, "invalid learning rate in parameter group ", gi, ": ", lr,
              " (expected lr >= 0)");
  EMBER_CHECK(eps >= 0, op, "invalid epsilon value in parameter group ", gi, ": ", eps,
              " (expected eps >= 0)");
  EMBER_CHECK(beta1 >= 0 && beta1 < 1, op, "invalid beta parameter at index 0 in parameter group ",
              gi, ": ", beta1, " (expected 0 <= beta1 < 1)");
  EMBER_CHECK(beta2 >= 0 && beta2 < 1, op, "invalid beta parameter at index 1 in parameter group ",
              gi, ": ", beta2, " (expected 0 <= beta2 < 1)");
  EMBER_CHECK(wd >= 0, op, "invalid weight_decay value in parameter group ", gi, ": ", wd,
              " (expected weight_decay >= 0)");
}

const double* Adam::device_lr(size_t group, const Device& device) {
  DeviceLr* slot = nullptr;
  for (auto& d : device_lr_) {
    if (d->group == group && d->device == device) slot = d.get();
  }
  if (slot == nullptr) {
    device_lr_.push_back(std::make_unique<DeviceLr>(
        DeviceLr{group, device, zeros({}, TensorOptions(kFloat64).device(device))}));
    slot = device_lr_.back().get();
  }
  auto write = [this, slot] {
    const double lr = param_groups()[slot->group].options.at("lr");
    if (slot->valid && slot->written == lr) return;
    slot->value.fill_(lr);
    slot->written = lr;
    slot->valid = true;
  };
  // In a capture the fill would be replayed with today's value: the graph writes the value of
  // the time before each replay instead.
  if (!cuda::on_each_replay(write)) write();
  return static_cast<const double*>(slot->value.data_ptr());
}

void Adam::step() { step_impl(nullptr); }

void Adam::step_unless(const Tensor& found_inf) {
  check_found_inf(found_inf);
  step_impl(&found_inf);
}

void Adam::step_impl(const Tensor* found_inf) {
  NoGradGuard no_grad;
  // With a flag: read once on the host for the parameters updated there, and made a 0/1 step
  // increment once for the capturable CUDA ones.
  std::optional<bool> skip_on_host;
  std::optional<bool> capturing;  // asked at the first CUDA parameter of a non-capturable group
  Tensor keep;
  for (size_t gi = 0; gi < param_groups().size(); ++gi) {
    ParamGroup& group = param_groups()[gi];
    const GroupOptions& o = group.options;
    const double lr = o.at("lr"), beta1 = o.at("beta1"), beta2 = o.at("beta2");
    const double eps = o.at("eps"), wd = o.at("weight_decay");
    const bool amsgrad = o.at("amsgrad") != 0, maximize = o.at("maximize") != 0;
    const bool capturable = o.at("capturable") != 0;
    for (Tensor& p : group.params) {
      const Tensor grad_in = p.grad();
      if (!grad_in.defined()) continue;
      if (!capturable && p.is_cuda()) {
        if (!capturing) capturing = cuda::is_current_stream_capturing();
        EMBER_CHECK(!*capturing, "[", name(), ".step] a CUDA graph is capturing this step, but ",
                    "parameter group ", gi, " is not capturable: its step count lives on the ",
                    "host, so every replay would repeat the captured step's bias corrections; ",
                    "construct the optimizer with capturable=true");
      }
      if (found_inf != nullptr && !(capturable && p.is_cuda())) {
        if (!skip_on_host) skip_on_host = found_inf->item<float>() != 0.0f;
        if (*skip_on_host) continue;
      }
      NamedTensors& state = mutable_state(p);
      if (state.empty()) {
        state.emplace_back("step", zeros({}, kFloat32));
        state.emplace_back("exp_avg", zeros_like(p));
        state.emplace_back("exp_avg_sq", zeros_like(p));
      }
      Tensor* step_t = find(state, "step");
      Tensor* exp_avg = find(state, "exp_avg");
      Tensor* exp_avg_sq = find(state, "exp_avg_sq");
      EMBER_CHECK(step_t && exp_avg && exp_avg_sq, "[", name(), "] the state of a parameter ",
                  "(shape ", p.shape(), ") lacks step, exp_avg or exp_avg_sq");
      Tensor* max_sq = nullptr;
      if (amsgrad) {
        max_sq = find(state, "max_exp_avg_sq");
        if (max_sq == nullptr) {  // amsgrad switched on after the first steps
          state.emplace_back("max_exp_avg_sq", zeros_like(p));
          max_sq = &state.back().second;
          // emplace_back may have moved the others.
          step_t = find(state, "step");
          exp_avg = find(state, "exp_avg");
          exp_avg_sq = find(state, "exp_avg_sq");
        }
      }

      ember::detail::AdamStepArgs args;
      if (capturable && p.is_cuda()) {
        // The count stays on the device and the kernel reads it (and the learning rate) there.
        if (step_t->device() != p.device()) *step_t = step_t->to(p.device());
        if (found_inf != nullptr) {
          EMBER_CHECK(found_inf->device() == p.device(), "[", name(),
                      ".step_unless] found_inf is "
                      "on ",
                      found_inf->device(), " but a parameter is on ", p.device());
          if (!keep.defined()) keep = eq(*found_inf, 0.0).to(kFloat32).reshape({});
          step_t->add_(keep);
          args.found_inf_dev = static_cast<const float*>(found_inf->data_ptr());
        } else {
          step_t->add_(1.0);
        }
        args.step_dev = static_cast<const float*>(step_t->data_ptr());
        args.lr_dev = device_lr(gi, p.device());
      } else {
        // The count is a float32 scalar, incremented in float32 and read back as a double
        // (PyTorch: step_t += 1; step = step_t.item()).
        if (!step_t->device().is_cpu()) *step_t = step_t->cpu();
        float* count = step_t->data<float>();
        *count += 1.0f;
        args.step = *count;
      }

      args.lr = lr;
      args.beta1 = beta1;
      args.beta2 = beta2;
      args.eps = eps;
      args.weight_decay = wd;
      args.amsgrad = amsgrad;
      args.maximize = maximize;
      args.decoupled = decoupled_;
      // One fused pass over p, g and the moments (tensor/ops/optim.h); the same values as the
      // op chain of PyTorch's single-tensor Adam.
      ember::detail::adam_update_(p, grad_in, *exp_avg, *exp_avg_sq,
                                  max_sq ? *max_sq : Tensor(), args);
    }
  }
}

}  // namespace ember::nn::optim
