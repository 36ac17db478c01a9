#include <ember/nn/init.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <string>

namespace ember::nn::init {

namespace {

void check_tensor(const char* op, const Tensor& t) {
  detail::check_defined(op, t, "tensor");
  EMBER_CHECK_TYPE(TypeError, t.is_floating_point(), "[nn::init::", op,
                   "] expected a floating-point tensor, got ", t.dtype());
}

// PyTorch lower-cases the mode before checking it.
int64_t correct_fan(const char* op, const Tensor& t, std::string_view mode) {
  std::string m(mode);
  std::transform(m.begin(), m.end(), m.begin(), [](unsigned char c) { return std::tolower(c); });
  EMBER_CHECK(m == "fan_in" || m == "fan_out", "[nn::init::", op,
              "] expected mode 'fan_in' or 'fan_out', got '", mode, "'");
  const auto [fan_in, fan_out] = calculate_fan_in_and_fan_out(t);
  return m == "fan_in" ? fan_in : fan_out;
}

// Sampling into the parameter itself must not be recorded (and is refused on a leaf that
// requires grad while grad mode is on).
Tensor& draw_uniform(Tensor& t, double a, double b, Generator* gen) {
  NoGradGuard no_grad;
  return ember::uniform_(t, a, b, gen);
}
Tensor& draw_normal(Tensor& t, double mean, double std, Generator* gen) {
  NoGradGuard no_grad;
  return ember::normal_(t, mean, std, gen);
}

}  // namespace

std::pair<int64_t, int64_t> calculate_fan_in_and_fan_out(const Tensor& t) {
  detail::check_defined("calculate_fan_in_and_fan_out", t, "tensor");
  EMBER_CHECK(t.dim() >= 2,
              "[nn::init::calculate_fan_in_and_fan_out] fan in and fan out can not be computed for "
              "a tensor with fewer than 2 dimensions, got shape ",
              t.shape());
  int64_t receptive = 1;
  for (int64_t d = 2; d < t.dim(); ++d) receptive *= t.size(d);
  return {t.size(1) * receptive, t.size(0) * receptive};
}

double calculate_gain(std::string_view nonlinearity, std::optional<double> param) {
  static constexpr std::string_view kLinear[] = {
      "linear",           "conv1d",           "conv2d",           "conv3d",
      "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "sigmoid"};
  for (std::string_view l : kLinear) {
    if (nonlinearity == l) return 1.0;
  }
  if (nonlinearity == "tanh") return 5.0 / 3;
  if (nonlinearity == "relu") return std::sqrt(2.0);
  if (nonlinearity == "leaky_relu") {
    const double slope = param.value_or(0.01);
    EMBER_CHECK(std::isfinite(slope), "[nn::init::calculate_gain] negative_slope ", slope,
                " is not a valid number");
    return std::sqrt(2.0 / (1 + slope * slope));
  }
  if (nonlinearity == "selu") return 3.0 / 4;
  throw ValueError(detail::str_cat("[nn::init::calculate_gain] unsupported nonlinearity '",
                                   nonlinearity,
                                   "' (expected linear, conv1d/2d/3d, conv_transpose1d/2d/3d, "
                                   "sigmoid, tanh, relu, leaky_relu or selu)"));
}

Tensor& uniform_(Tensor& t, double a, double b, Generator* gen) {
  check_tensor("uniform_", t);
  return draw_uniform(t, a, b, gen);
}

Tensor& normal_(Tensor& t, double mean, double std, Generator* gen) {
  check_tensor("normal_", t);
  return draw_normal(t, mean, std, gen);
}

Tensor& constant_(Tensor& t, double value) {
  check_tensor("constant_", t);
  NoGradGuard no_grad;
  return t.fill_(value);
}

Tensor& zeros_(Tensor& t) { return constant_(t, 0.0); }
Tensor& ones_(Tensor& t) { return constant_(t, 1.0); }

namespace {
double xavier_std(const char* op, const Tensor& t, double gain) {
  check_tensor(op, t);
  const auto [fan_in, fan_out] = calculate_fan_in_and_fan_out(t);
  EMBER_CHECK(fan_in + fan_out > 0, "[nn::init::", op,
              "] fan_in + fan_out must be positive, got shape ", t.shape());
  return gain * std::sqrt(2.0 / static_cast<double>(fan_in + fan_out));
}

// nullopt for a tensor with no elements, which PyTorch leaves untouched.
std::optional<double> kaiming_std(const char* op, const Tensor& t, double a, std::string_view mode,
                                  std::string_view nonlinearity) {
  check_tensor(op, t);
  if (t.numel() == 0) return std::nullopt;
  const int64_t fan = correct_fan(op, t, mode);
  return calculate_gain(nonlinearity, a) / std::sqrt(static_cast<double>(fan));
}
}  // namespace

Tensor& xavier_uniform_(Tensor& t, double gain, Generator* gen) {
  const double a = std::sqrt(3.0) * xavier_std("xavier_uniform_", t, gain);
  return draw_uniform(t, -a, a, gen);
}

Tensor& xavier_normal_(Tensor& t, double gain, Generator* gen) {
  return draw_normal(t, 0.0, xavier_std("xavier_normal_", t, gain), gen);
}

Tensor& kaiming_uniform_(Tensor& t, double a, std::string_view mode, std::string_view nonlinearity,
                         Generator* gen) {
  const auto std = kaiming_std("kaiming_uniform_", t, a, mode, nonlinearity);
  if (!std) return t;
  const double bound = std::sqrt(3.0) * *std;
  return draw_uniform(t, -bound, bound, gen);
}

Tensor& kaiming_normal_(Tensor& t, double a, std::string_view mode, std::string_view nonlinearity,
                        Generator* gen) {
  const auto std = kaiming_std("kaiming_normal_", t, a, mode, nonlinearity);
  if (!std) return t;
  return draw_normal(t, 0.0, *std, gen);
}

}  // namespace ember::nn::init
