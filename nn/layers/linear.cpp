#include <ember/nn/layers/linear.h>

#include <cmath>

#include <ember/nn/functional.h>
#include <ember/nn/init.h>
#include <ember/nn/layers/layer_utils.h>

namespace ember::nn {

Linear::Linear(int64_t in_features, int64_t out_features, bool bias)
    : in_features(in_features), out_features(out_features) {
  EMBER_CHECK(in_features >= 0 && out_features >= 0,
              "[Linear] expected non-negative sizes, got in_features=", in_features,
              ", out_features=", out_features);
  weight = register_parameter("weight", empty({out_features, in_features}));
  this->bias = register_parameter("bias", bias ? empty({out_features}) : Tensor());
  reset_parameters();
}

void Linear::reset_parameters() {
  // torch.nn.Linear.reset_parameters: the bias bound is 1/sqrt(fan_in) (0 when fan_in is 0).
  init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias.defined()) {
    const int64_t fan_in = init::calculate_fan_in_and_fan_out(weight).first;
    const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
    init::uniform_(bias, -bound, bound);
  }
}

std::string Linear::extra_repr() const {
  return detail::str_cat("in_features=", in_features, ", out_features=", out_features,
                         ", bias=", detail::repr_bool(bias.defined()));
}

void Linear::on_parameter_set(const std::string& name, const Tensor& t) {
  (name == "weight" ? weight : bias) = t;
}

Tensor Linear::forward(const Tensor& input) { return functional::linear(input, weight, bias); }

}  // namespace ember::nn
