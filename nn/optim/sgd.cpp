#include <ember/nn/optim/sgd.h>

#include <ember/tensor/ops/optim.h>

namespace ember::nn::optim {

namespace {
GroupOptions sgd_defaults(const SGDOptions& o) {
  GroupOptions d{{"momentum", o.momentum},       {"dampening", o.dampening},
                 {"weight_decay", o.weight_decay}, {"nesterov", o.nesterov ? 1.0 : 0.0},
                 {"maximize", o.maximize ? 1.0 : 0.0}};
  if (o.lr) d["lr"] = *o.lr;
  return d;
}
}  // namespace

SGD::SGD(std::vector<ParamGroup> groups, const SGDOptions& options)
    : Optimizer(sgd_defaults(options), {"nesterov", "maximize"}) {
  // Validate the defaults even when every group overrides them, as PyTorch's constructor does.
  if (options.lr) {
    EMBER_CHECK(*options.lr >= 0, "[SGD] invalid learning rate: ", *options.lr,
                " (expected lr >= 0)");
  }
  add_param_groups(std::move(groups));
}

void SGD::check_options(const GroupOptions& o, size_t gi) const {
  const double lr = o.at("lr"), momentum = o.at("momentum"), dampening = o.at("dampening");
  const double wd = o.at("weight_decay");
  EMBER_CHECK(lr >= 0, "[SGD] invalid learning rate in parameter group ", gi, ": ", lr,
              " (expected lr >= 0)");
  EMBER_CHECK(momentum >= 0, "[SGD] invalid momentum value in parameter group ", gi, ": ",
              momentum, " (expected momentum >= 0)");
  EMBER_CHECK(wd >= 0, "[SGD] invalid weight_decay value in parameter group ", gi, ": ", wd,
              " (expected weight_decay >= 0)");
  EMBER_CHECK(o.at("nesterov") == 0 || (momentum > 0 && dampening == 0),
              "[SGD] Nesterov momentum requires a momentum and zero dampening; parameter group ",
              gi, " has momentum=", momentum, ", dampening=", dampening);
}

void SGD::step() {
  NoGradGuard no_grad;
  for (ParamGroup& group : param_groups()) {
    const GroupOptions& o = group.options;
    const double lr = o.at("lr"), momentum = o.at("momentum"), dampening = o.at("dampening");
    const double wd = o.at("weight_decay");
    const bool nesterov = o.at("nesterov") != 0, maximize = o.at("maximize") != 0;
    for (Tensor& p : group.params) {
      const Tensor grad = p.grad();
      if (!grad.defined()) continue;
      ember::detail::SgdStepArgs args;
      args.lr = lr;
      args.momentum = momentum;
      args.dampening = dampening;
      args.weight_decay = wd;
      args.nesterov = nesterov;
      args.maximize = maximize;
      Tensor buf;
      if (momentum != 0) {
        NamedTensors& state = mutable_state(p);
        Tensor* found = find(state, "momentum_buffer");
        if (found == nullptr) {
          // PyTorch's first step clones d_p into the buffer; the kernel writes it.
          state.emplace_back("momentum_buffer", empty_like(p));
          found = &state.back().second;
          args.init_buffer = true;
        }
        buf = *found;
      }
      // One fused pass over p, g and the buffer (tensor/ops/optim.h).
      ember::detail::sgd_update_(p, grad, buf, args);
    }
  }
}

}  // namespace ember::nn::optim
