#include <ember/nn/layers/norm.h>

#include <ember/nn/functional.h>
#include <ember/nn/init.h>
#include <ember/nn/layers/layer_utils.h>

namespace ember::nn {

// ---- BatchNorm --------------------------------------------------------------------------------

BatchNorm::BatchNorm(int64_t num_features, const BatchNormOptions& options)
    : num_features(num_features), options(options) {
  EMBER_CHECK(num_features > 0, "[BatchNorm] expected num_features > 0, got ", num_features);
  EMBER_CHECK(options.eps >= 0, "[BatchNorm] expected eps >= 0, got ", options.eps);
  if (options.affine) {
    weight = register_parameter("weight", ones({num_features}));
    bias = register_parameter("bias", zeros({num_features}));
  }
  if (options.track_running_stats) {
    running_mean = register_buffer("running_mean", zeros({num_features}));
    running_var = register_buffer("running_var", ones({num_features}));
    num_batches_tracked = register_buffer("num_batches_tracked", zeros({}, kInt64));
  }
}

void BatchNorm::reset_running_stats() {
  if (!options.track_running_stats) return;
  NoGradGuard no_grad;
  running_mean.zero_();
  running_var.fill_(1);
  num_batches_tracked.zero_();
}

void BatchNorm::reset_parameters() {
  reset_running_stats();
  if (options.affine) {
    init::ones_(weight);
    init::zeros_(bias);
  }
}

std::string BatchNorm::extra_repr() const {
  return detail::str_cat(
      num_features, ", eps=", detail::repr_double(options.eps), ", momentum=",
      options.momentum ? detail::repr_double(*options.momentum) : std::string("None"),
      ", affine=", detail::repr_bool(options.affine),
      ", track_running_stats=", detail::repr_bool(options.track_running_stats));
}

Tensor BatchNorm::forward(const Tensor& input) {
  detail::check_defined(name().c_str(), input, "input");
  check_input_dim(input);
  EMBER_CHECK(input.size(1) == num_features, "[", name(), "] expected input with ", num_features,
              " channels (dim 1), got shape ", input.shape());
  // PyTorch's _BatchNorm.forward: count the batch, pick the averaging factor, and use batch
  // statistics in training or when there are no running statistics.
  double factor = options.momentum.value_or(0.0);
  const bool training = is_training();
  if (training && options.track_running_stats) {
    {
      NoGradGuard no_grad;
      num_batches_tracked.add_(1);
    }
    if (!options.momentum) {
      factor = 1.0 / static_cast<double>(num_batches_tracked.item<int64_t>());
    }
  }
  const bool use_batch_stats = training || !options.track_running_stats;
  const bool pass_stats = !training || options.track_running_stats;
  return functional::batch_norm(input, pass_stats ? running_mean : Tensor(),
                                pass_stats ? running_var : Tensor(), weight, bias, use_batch_stats,
                                factor, options.eps);
}

void BatchNorm1d::check_input_dim(const Tensor& input) const {
  EMBER_CHECK(input.dim() == 2 || input.dim() == 3,
              "[BatchNorm1d] expected 2D or 3D input ([N, C] or [N, C, L]), got ", input.dim(),
              "D input of shape ", input.shape());
}

void BatchNorm2d::check_input_dim(const Tensor& input) const {
  EMBER_CHECK(input.dim() == 4, "[BatchNorm2d] expected 4D input [N, C, H, W], got ", input.dim(),
              "D input of shape ", input.shape());
}

// ---- LayerNorm --------------------------------------------------------------------------------

LayerNorm::LayerNorm(std::vector<int64_t> normalized_shape, const LayerNormOptions& options)
    : normalized_shape(std::move(normalized_shape)), options(options) {
  EMBER_CHECK(!this->normalized_shape.empty(), "[LayerNorm] expected a non-empty normalized_shape");
  for (int64_t s : this->normalized_shape) {
    EMBER_CHECK(s > 0, "[LayerNorm] expected positive sizes in normalized_shape, got ",
                IntList(this->normalized_shape));
  }
  EMBER_CHECK(options.eps >= 0, "[LayerNorm] expected eps >= 0, got ", options.eps);
  if (options.elementwise_affine) {
    weight = register_parameter("weight", ones(this->normalized_shape));
    bias = register_parameter("bias", zeros(this->normalized_shape));
  }
}

void LayerNorm::reset_parameters() {
  if (!options.elementwise_affine) return;
  init::ones_(weight);
  init::zeros_(bias);
}

std::string LayerNorm::extra_repr() const {
  // A Python tuple: "(10,)" for one dim, "(4, 5)" for more.
  std::string shape = "(";
  for (size_t i = 0; i < normalized_shape.size(); ++i) {
    shape += (i ? ", " : "") + std::to_string(normalized_shape[i]);
  }
  shape += normalized_shape.size() == 1 ? ",)" : ")";
  return detail::str_cat(shape, ", eps=", detail::repr_double(options.eps),
                         ", elementwise_affine=", detail::repr_bool(options.elementwise_affine));
}

Tensor LayerNorm::forward(const Tensor& input) {
  return functional::layer_norm(input, normalized_shape, weight, bias, options.eps);
}

}  // namespace ember::nn
