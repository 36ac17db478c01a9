// Parameter initialisation (torch.nn.init). Every function fills its tensor in place without
// recording autograd history (it runs under NoGradGuard, so parameters that require grad may
// be passed), draws from `gen` or, by default, Ember's global generator (manual_seed makes
// the values reproducible), works on any floating dtype and device, and returns the tensor.
// Fans and gains are computed exactly as PyTorch 1.13 does; only the random stream differs.
#pragma once

#include <optional>
#include <string_view>
#include <utility>

#include <ember/tensor/ops.h>

namespace ember::nn::init {

/// (fan_in, fan_out) of a weight: fan_in = size(1) * receptive field, fan_out = size(0) *
/// receptive field, the receptive field being the product of dims 2.. (1 for 2-d weights).
/// Throws ValueError for tensors with fewer than 2 dims.
std::pair<int64_t, int64_t> calculate_fan_in_and_fan_out(const Tensor& t);

/// The recommended gain for a nonlinearity: 1 for "linear", "conv1d", "conv2d", "conv3d",
/// "conv_transpose1d/2d/3d", "sigmoid"; 5/3 for "tanh"; sqrt(2) for "relu";
/// sqrt(2 / (1 + slope^2)) for "leaky_relu" (slope = param, default 0.01); 3/4 for "selu".
/// Throws ValueError naming the nonlinearity otherwise.
double calculate_gain(std::string_view nonlinearity, std::optional<double> param = {});

/// Uniform on [a, b).
Tensor& uniform_(Tensor& t, double a = 0.0, double b = 1.0, Generator* gen = nullptr);
/// Normal(mean, std).
Tensor& normal_(Tensor& t, double mean = 0.0, double std = 1.0, Generator* gen = nullptr);
/// Every element set to value.
Tensor& constant_(Tensor& t, double value);
Tensor& zeros_(Tensor& t);
Tensor& ones_(Tensor& t);

/// Glorot uniform: U(-a, a) with a = gain * sqrt(6 / (fan_in + fan_out)).
Tensor& xavier_uniform_(Tensor& t, double gain = 1.0, Generator* gen = nullptr);
/// Glorot normal: N(0, std^2) with std = gain * sqrt(2 / (fan_in + fan_out)).
Tensor& xavier_normal_(Tensor& t, double gain = 1.0, Generator* gen = nullptr);

/// He uniform: U(-bound, bound) with bound = gain * sqrt(3 / fan), fan = fan_in or fan_out
/// (mode "fan_in" / "fan_out"), gain = calculate_gain(nonlinearity, a) (a: the negative slope
/// for "leaky_relu", so the default a = 0 gives sqrt(2), as PyTorch). A tensor with no elements
/// is left as it is (PyTorch warns).
Tensor& kaiming_uniform_(Tensor& t, double a = 0.0, std::string_view mode = "fan_in",
                         std::string_view nonlinearity = "leaky_relu", Generator* gen = nullptr);
/// He normal: N(0, std^2) with std = gain / sqrt(fan).
Tensor& kaiming_normal_(Tensor& t, double a = 0.0, std::string_view mode = "fan_in",
                        std::string_view nonlinearity = "leaky_relu", Generator* gen = nullptr);

}  // namespace ember::nn::init
