#include <ember/nn/functional.h>

#include <algorithm>
#include <string>
#include <vector>

#include <ember/tensor/autocast.h>

namespace ember::nn::functional {

namespace {

Reduction parse_reduction(const char* op, std::string_view r) {
  if (r == "mean") return Reduction::kMean;
  if (r == "sum") return Reduction::kSum;
  if (r == "none") return Reduction::kNone;
  throw ValueError(
      detail::str_cat("[", op, "] expected reduction 'mean', 'sum' or 'none', got '", r, "'"));
}

void check_floating(const char* op, const Tensor& t, const char* name) {
  detail::check_defined(op, t, name);
  EMBER_CHECK_TYPE(TypeError, t.is_floating_point(), "[", op, "] expected a floating-point ", name,
                   ", got ", t.dtype());
}

// Shape [1, C, 1, ...] of rank `ndim`, to broadcast a per-channel [C] tensor over [N, C, *].
Shape channel_shape(int64_t ndim, int64_t channels) {
  Shape s = Shape::filled(ndim, 1);
  s[1] = channels;
  return s;
}

}  // namespace

Tensor linear(const Tensor& input, const Tensor& weight, const Tensor& bias) {
  if (auto ac = detail::autocast_inputs(AutocastPolicy::kLowPrecision, input, weight, bias)) return linear(ac[0], ac[1], ac[2]);
  detail::check_defined("linear", input, "input");
  detail::check_defined("linear", weight, "weight");
  EMBER_CHECK(weight.dim() == 2,
              "[linear] expected a 2-d weight [out_features, in_features], got shape ",
              weight.shape());
  EMBER_CHECK(input.dim() >= 1 && input.size(-1) == weight.size(1),
              "[linear] last dim of input (shape ", input.shape(),
              ") must equal in_features of weight (shape ", weight.shape(), ")");
  if (bias.defined()) {
    EMBER_CHECK(bias.dim() == 1 && bias.size(0) == weight.size(0),
                "[linear] expected bias of shape [", weight.size(0), "] for weight of shape ",
                weight.shape(), ", got ", bias.shape());
  }
  const Tensor wt = weight.t();
  if (input.dim() == 1) {
    Tensor y = matmul(input, wt);
    return bias.defined() ? y + bias : y;
  }
  // Fold the leading dims into one so a single GEMM (with the bias fused) does the work.
  const Tensor x2 = input.dim() == 2 ? input : input.reshape({-1, input.size(-1)});
  Tensor y = bias.defined() ? addmm(bias, x2, wt) : mm(x2, wt);
  if (input.dim() == 2) return y;
  Shape out = input.shape();
  out.back() = weight.size(0);
  return y.view(out);
}

Tensor dropout(const Tensor& input, double p, bool training, bool inplace, Generator* gen) {
  detail::check_defined("dropout", input, "input");
  EMBER_CHECK(p >= 0.0 && p <= 1.0,
              "[dropout] dropout probability has to be between 0 and 1, but got ", p);
  if (!training || p == 0.0 || input.numel() == 0) return input;
  EMBER_CHECK_TYPE(TypeError, input.is_floating_point(),
                   "[dropout] expected a floating-point input, got ", input.dtype());
  Tensor mask;
  if (p == 1.0) {
    mask = zeros({}, input.options());
  } else {
    mask = empty(input.shape(), input.options());
    bernoulli_(mask, 1.0 - p, gen);
    mask.div_(1.0 - p);
  }
  if (inplace) {
    Tensor out = input;
    out.mul_(mask);
    return out;
  }
  return input * mask;
}

Tensor batch_norm(const Tensor& input, const Tensor& running_mean, const Tensor& running_var,
                  const Tensor& weight, const Tensor& bias, bool training, double momentum,
                  double eps) {
  check_floating("batch_norm", input, "input");
  EMBER_CHECK(input.dim() >= 2, "[batch_norm] expected input of shape [N, C, *], got ",
              input.shape());
  const int64_t channels = input.size(1);
  auto check_param = [&](const Tensor& t, const char* name) {
    if (!t.defined()) return;
    EMBER_CHECK(t.dim() == 1 && t.size(0) == channels, "[batch_norm] expected ", name,
                " of shape [", channels, "] for input of shape ", input.shape(), ", got ",
                t.shape());
  };
  check_param(running_mean, "running_mean");
  check_param(running_var, "running_var");
  check_param(weight, "weight");
  check_param(bias, "bias");
  EMBER_CHECK(running_mean.defined() == running_var.defined(),
              "[batch_norm] running_mean and running_var must both be defined or both undefined");

  const int64_t count = input.numel() / std::max<int64_t>(channels, 1);
  if (training) {
    EMBER_CHECK(
        count > 1,
        "[batch_norm] expected more than 1 value per channel when training, got input of shape ",
        input.shape());
  } else {
    EMBER_CHECK(running_mean.defined(),
                "[batch_norm] running_mean and running_var must be defined when not training");
  }
  // running = (1 - momentum) * running + momentum * batch, the variance unbiased.
  auto update_running = [&](const Tensor& mean, const Tensor& var) {
    if (!training || !running_mean.defined()) return;
    NoGradGuard no_grad;
    const double unbias = static_cast<double>(count) / static_cast<double>(count - 1);
    Tensor rm = running_mean, rv = running_var;
    rm.copy_(rm * (1.0 - momentum) + mean.detach() * momentum);
    rv.copy_(rv * (1.0 - momentum) + var.detach() * (momentum * unbias));
  };
  if (detail::batch_norm_fusable(input, weight, bias, running_mean, running_var, training)) {
    const detail::BatchNormFused f =
        detail::batch_norm_fused(input, weight, bias, running_mean, running_var, training, eps);
    update_running(f.mean, f.var);
    return f.y;
  }

  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < input.dim(); ++d) dims.push_back(d);
  const Shape bshape = channel_shape(input.dim(), channels);
  Tensor mean, invstd;
  if (training) {
    mean = input.mean(dims);
    const Tensor var = ember::var(input, dims, /*correction=*/0);
    invstd = rsqrt(var + eps);
    update_running(mean, var);
  } else {
    mean = running_mean.to(input.dtype());
    invstd = rsqrt(running_var.to(input.dtype()) + eps);
  }
  // y = x * scale + shift with scale = weight * invstd, shift = bias - mean * scale: two passes
  // over the input instead of four, and the form PyTorch's CPU kernel computes.
  Tensor scale = weight.defined() ? invstd * weight : invstd;
  Tensor shift = bias.defined() ? bias - mean * scale : -(mean * scale);
  return input * scale.view(bshape) + shift.view(bshape);
}

Tensor embedding(const Tensor& input, const Tensor& weight, std::optional<int64_t> padding_idx) {
  detail::check_defined("embedding", input, "input");
  detail::check_defined("embedding", weight, "weight");
  EMBER_CHECK_TYPE(TypeError, input.dtype() == kInt64 || input.dtype() == kInt32,
                   "[embedding] expected int64 or int32 indices, got ", input.dtype());
  EMBER_CHECK(weight.dim() == 2,
              "[embedding] expected a 2-d weight [num_embeddings, embedding_dim], got shape ",
              weight.shape());
  Tensor out = ember::embedding(weight, input);
  if (!padding_idx) return out;
  int64_t pad = *padding_idx;
  const int64_t n = weight.size(0);
  EMBER_CHECK(pad >= -n && pad < n, "[embedding] padding_idx must be within [", -n, ", ", n,
              "), got ", pad);
  if (pad < 0) pad += n;
  if (!out.requires_grad()) return out;
  // Same values; the padding positions take theirs from a detached copy, so no gradient
  // reaches weight[padding_idx].
  return where(eq(input, pad).unsqueeze(-1), out.detach(), out);
}

// ---- losses ----------------------------------------------------------------------------------

Tensor nll_loss(const Tensor& input, const Tensor& target, const NLLLossOptions& opts) {
  const Reduction r = parse_reduction("nll_loss", opts.reduction);
  return ember::nll_loss(input, target, opts.weight, opts.ignore_index, r);
}

Tensor cross_entropy(const Tensor& input, const Tensor& target, const CrossEntropyOptions& opts) {
  const Reduction r = parse_reduction("cross_entropy", opts.reduction);
  return ember::cross_entropy(input, target, opts.weight, opts.ignore_index, r,
                              opts.label_smoothing);
}

Tensor mse_loss(const Tensor& input, const Tensor& target, std::string_view reduction) {
  if (auto ac = detail::autocast_inputs(AutocastPolicy::kFloat32, input, target)) return mse_loss(ac[0], ac[1], reduction);
  const Reduction r = parse_reduction("mse_loss", reduction);
  check_floating("mse_loss", input, "input");
  detail::check_defined("mse_loss", target, "target");
  EMBER_CHECK(input.shape() == target.shape(), "[mse_loss] expected target of input's shape ",
              input.shape(), ", got ", target.shape());
  return reduce_loss(square(input - target), r);
}

Tensor binary_cross_entropy_with_logits(const Tensor& input, const Tensor& target,
                                        const BCEWithLogitsOptions& opts) {
  if (auto ac = detail::autocast_inputs(AutocastPolicy::kFloat32, input, target, opts.weight, opts.pos_weight)) {
    BCEWithLogitsOptions o = opts;
    o.weight = ac[2];
    o.pos_weight = ac[3];
    return binary_cross_entropy_with_logits(ac[0], ac[1], o);
  }
  const char* op = "binary_cross_entropy_with_logits";
  const Reduction r = parse_reduction(op, opts.reduction);
  check_floating(op, input, "input");
  check_floating(op, target, "target");
  EMBER_CHECK(input.shape() == target.shape(), "[", op, "] target size (", target.shape(),
              ") must be the same as input size (", input.shape(), ")");
  // softplus(-x) = log(1 + e^-x) as log(e^-m + e^(-x-m)) + m with m = max(-x, 0): no overflow,
  // and exact for any m, so the gradient is right even where clamp's subgradient is arbitrary.
  const Tensor m = clamp_min(-input, 0);
  const Tensor softplus_neg = log(exp(-m) + exp(-input - m)) + m;
  Tensor loss;
  if (opts.pos_weight.defined()) {
    check_floating(op, opts.pos_weight, "pos_weight");
    const Tensor log_weight = (opts.pos_weight - 1) * target + 1;
    loss = (1 - target) * input + log_weight * softplus_neg;
  } else {
    loss = (1 - target) * input + softplus_neg;
  }
  if (opts.weight.defined()) {
    check_floating(op, opts.weight, "weight");
    loss = loss * opts.weight;
  }
  return reduce_loss(loss, r);
}

}  // namespace ember::nn::functional
