#include <ember/nn/functional.h>

#include <algorithm>
#include <any>
#include <string>
#include <vector>

#include <ember/autograd/function.h>
#include <ember/tensor/autocast.h>
#include <ember/tensor/detail/norm_kernels.h>

namespace ember::nn::functional {

namespace {

enum class Reduction { kNone, kMean, kSum };

Reduction parse_reduction(const char* op, std::string_view r) {
  if (r == "mean") return Reduction::kMean;
  if (r == "sum") return Reduction::kSum;
  if (r == "none") return Reduction::kNone;
  throw ValueError(
      detail::str_cat("[", op, "] expected reduction 'mean', 'sum' or 'none', got '", r, "'"));
}

Tensor reduce(const Tensor& loss, Reduction r) {
  switch (r) {
    case Reduction::kMean:
      return loss.mean();
    case Reduction::kSum:
      return loss.sum();
    case Reduction::kNone:
      return loss;
  }
  return loss;
}

void check_floating(const char* op, const Tensor& t, const char* name) {
  detail::check_defined(op, t, name);
  EMBER_CHECK_TYPE(TypeError, t.is_floating_point(), "[", op, "] expected a floating-point ", name,
                   ", got ", t.dtype());
}

// Shape [1, C, 1, ...] of rank `ndim`, to broadcast a per-channel [C] tensor over [N, C, *].
Shape channel_shape(int64_t ndim, int64_t channels, int64_t channel_dim = 1) {
  Shape s = Shape::filled(ndim, 1);
  s[channel_dim] = channels;
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

  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < input.dim(); ++d) dims.push_back(d);
  const Shape bshape = channel_shape(input.dim(), channels);

  Tensor mean, invstd;
  if (training) {
    const int64_t count = input.numel() / std::max<int64_t>(channels, 1);
    EMBER_CHECK(
        count > 1,
        "[batch_norm] expected more than 1 value per channel when training, got input of shape ",
        input.shape());
    mean = input.mean(dims);
    const Tensor var = ember::var(input, dims, /*correction=*/0);
    invstd = rsqrt(var + eps);
    if (running_mean.defined()) {
      NoGradGuard no_grad;
      const double unbias = static_cast<double>(count) / static_cast<double>(count - 1);
      Tensor rm = running_mean, rv = running_var;
      rm.copy_(rm * (1.0 - momentum) + mean.detach() * momentum);
      rv.copy_(rv * (1.0 - momentum) + var.detach() * (momentum * unbias));
    }
  } else {
    EMBER_CHECK(running_mean.defined(),
                "[batch_norm] running_mean and running_var must be defined when not training");
    mean = running_mean.to(input.dtype());
    invstd = rsqrt(running_var.to(input.dtype()) + eps);
  }
  // y = x * scale + shift with scale = weight * invstd, shift = bias - mean * scale: two passes
  // over the input instead of four, and the form PyTorch's CPU kernel computes.
  Tensor scale = weight.defined() ? invstd * weight : invstd;
  Tensor shift = bias.defined() ? bias - mean * scale : -(mean * scale);
  return input * scale.view(bshape) + shift.view(bshape);
}

namespace {

// Note [LayerNorm as a custom function]: the composite form (mean, var, sub, mul, ...) saves
// three input-sized tensors for backward and makes one pass over memory per op. This function
// saves only x, weight and the per-row mean and rstd. On the CPU and on CUDA, for contiguous
// float32/float64 tensors, forward and backward run fused row kernels
// (tensor/detail/norm_kernels.h). Elsewhere (other dtypes) both are built from tensor ops, with
// the textbook
//   dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),  dxhat = dy * weight.
// Under create_graph, backward always takes the tensor-op path, recomputing mean and rstd from
// the saved x with recorded ops, so double backward stays exact (the forward's no-grad
// statistics would silently cut that dependence).
struct LayerNormFunction : autograd::Function<LayerNormFunction> {
  struct Stats {
    Tensor xhat, rstd;
  };
  static std::vector<int64_t> last_dims(int64_t ndim, int64_t k) {
    std::vector<int64_t> dims;
    for (int64_t d = ndim - k; d < ndim; ++d) dims.push_back(d);
    return dims;
  }
  static Stats normalize(const Tensor& x, const std::vector<int64_t>& dims, double eps) {
    const Tensor mean = x.mean(dims, /*keepdim=*/true);
    const Tensor rstd = rsqrt(ember::var(x, dims, /*correction=*/0, /*keepdim=*/true) + eps);
    return {(x - mean) * rstd, rstd};
  }

  /// The fused kernels apply: contiguous float32/float64 tensors of one dtype on one device
  /// (the CPU or a CUDA device).
  static bool fusable(const Tensor& x, const Tensor& weight, const Tensor& bias) {
    auto ok = [&](const Tensor& t) {
      return !t.defined() ||
             (t.device() == x.device() && t.is_contiguous() && t.dtype() == x.dtype());
    };
    return (x.is_cpu() || x.is_cuda()) && x.is_contiguous() &&
           (x.dtype() == kFloat32 || x.dtype() == kFloat64) && x.numel() > 0 && ok(weight) &&
           ok(bias);
  }

  static Tensor forward(autograd::Context* ctx, const Tensor& x, const Tensor& weight,
                        const Tensor& bias, int64_t k, double eps) {
    ctx->saved_data["k"] = k;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["has_weight"] = weight.defined();
    if (fusable(x, weight, bias)) {
      int64_t row = 1;
      for (int64_t d = x.dim() - k; d < x.dim(); ++d) row *= x.size(d);
      const int64_t rows = x.numel() / row;
      Tensor y = empty(x.shape(), x.options());
      Tensor mean = empty({rows}, x.options()), rstd = empty({rows}, x.options());
      (x.is_cuda() ? detail::layer_norm_forward_cuda : detail::layer_norm_forward_cpu)(
          x.view({rows, row}), weight.defined() ? weight.view({row}) : Tensor(),
          bias.defined() ? bias.view({row}) : Tensor(), eps, y.view({rows, row}), mean, rstd);
      ctx->save_for_backward(weight.defined() ? std::vector<Tensor>{x, mean, rstd, weight}
                                              : std::vector<Tensor>{x, mean, rstd});
      ctx->saved_data["fused"] = true;
      return y;
    }
    Tensor y = normalize(x, last_dims(x.dim(), k), eps).xhat;
    if (weight.defined()) y.mul_(weight);
    if (bias.defined()) y.add_(bias);
    ctx->save_for_backward(weight.defined() ? std::vector<Tensor>{x, weight}
                                            : std::vector<Tensor>{x});
    ctx->saved_data["fused"] = false;
    return y;
  }

  static autograd::TensorList backward(autograd::Context* ctx, autograd::TensorList grads) {
    const autograd::TensorList saved = ctx->saved();
    const bool fused = std::any_cast<bool>(ctx->saved_data["fused"]);
    const bool has_weight = std::any_cast<bool>(ctx->saved_data["has_weight"]);
    const Tensor& x = saved[0];
    const Tensor weight = has_weight ? saved.back() : Tensor();
    const int64_t k = std::any_cast<int64_t>(ctx->saved_data["k"]);
    const double eps = std::any_cast<double>(ctx->saved_data["eps"]);
    if (fused && !GradMode::is_enabled()) {
      const Tensor &mean = saved[1], &rstd = saved[2];
      const int64_t rows = mean.numel(), row = x.numel() / rows;
      const Tensor dy = grads[0].to(x.dtype()).contiguous();
      Shape normalized;  // the last k dims, the shape of weight and bias
      for (int64_t d = x.dim() - k; d < x.dim(); ++d) normalized.push_back(x.size(d));
      Tensor dx = ctx->needs_input_grad(0) ? empty(x.shape(), x.options()) : Tensor();
      Tensor dweight =
          has_weight && ctx->needs_input_grad(1) ? empty(normalized, x.options()) : Tensor();
      Tensor dbias = ctx->needs_input_grad(2) ? empty(normalized, x.options()) : Tensor();
      (x.is_cuda() ? detail::layer_norm_backward_cuda : detail::layer_norm_backward_cpu)(
          dy.view({rows, row}), x.view({rows, row}), mean, rstd,
          has_weight ? weight.view({row}) : Tensor(), dx.defined() ? dx.view({rows, row}) : dx,
          dweight.defined() ? dweight.view({row}) : dweight,
          dbias.defined() ? dbias.view({row}) : dbias);
      return {dx, dweight, dbias};
    }
    const std::vector<int64_t> dims = last_dims(x.dim(), k);
    std::vector<int64_t> lead;  // the dims weight and bias are broadcast over
    for (int64_t d = 0; d < x.dim() - k; ++d) lead.push_back(d);
    auto sum_lead = [&](const Tensor& t) { return lead.empty() ? t : t.sum(lead); };

    const Tensor& dy = grads[0];  // [*, normalized_shape]
    const Stats s = normalize(x, dims, eps);
    Tensor dx, dweight, dbias;
    if (ctx->needs_input_grad(0)) {
      const Tensor dxhat = weight.defined() ? dy * weight : dy;
      const Tensor a = dxhat.mean(dims, /*keepdim=*/true);             // [*, 1...]
      const Tensor b = (dxhat * s.xhat).mean(dims, /*keepdim=*/true);  // [*, 1...]
      dx = (dxhat - a - s.xhat * b) * s.rstd;
    }
    if (weight.defined() && ctx->needs_input_grad(1)) dweight = sum_lead(dy * s.xhat);
    if (ctx->needs_input_grad(2)) dbias = sum_lead(dy);
    return {dx, dweight, dbias};
  }
};

}  // namespace

Tensor layer_norm(const Tensor& input, IntList normalized_shape, const Tensor& weight,
                  const Tensor& bias, double eps) {
  check_floating("layer_norm", input, "input");
  if (auto ac = detail::autocast_inputs(AutocastPolicy::kFloat32, input, weight, bias)) {
    return layer_norm(ac[0], normalized_shape, ac[1], ac[2], eps);
  }
  const int64_t k = normalized_shape.size();
  EMBER_CHECK(k >= 1, "[layer_norm] expected a non-empty normalized_shape");
  bool match = input.dim() >= k;
  for (int64_t i = 0; match && i < k; ++i) {
    match = input.size(input.dim() - k + i) == normalized_shape[i];
  }
  if (!match) {
    std::string want = "[*";
    for (int64_t s : normalized_shape) want += ", " + std::to_string(s);
    throw ValueError(detail::str_cat("[layer_norm] expected input of shape ", want,
                                     "] (normalized_shape ", normalized_shape, "), got ",
                                     input.shape()));
  }
  auto check_param = [&](const Tensor& t, const char* name) {
    if (!t.defined()) return;
    EMBER_CHECK(t.shape() == normalized_shape, "[layer_norm] expected ", name, " of shape ",
                normalized_shape, ", got ", t.shape());
  };
  check_param(weight, "weight");
  check_param(bias, "bias");
  return LayerNormFunction::apply(input, weight, bias, k, eps);
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

namespace {

// What nll_loss and cross_entropy share for class-index targets: the per-element losses (zero
// where ignored), the per-element weights (zero where ignored) and the ignore mask.
struct NllParts {
  Tensor loss;     // [N, d1, ...]: -weight[t] * input[t], 0 where ignored
  Tensor weights;  // [N, d1, ...]: weight[t] (or 1), 0 where ignored
  Tensor ignored;  // bool [N, d1, ...]
};

int64_t class_dim_of(const Tensor& input) { return input.dim() == 1 ? 0 : 1; }

void check_class_weight(const char* op, const Tensor& weight, const Tensor& input,
                        int64_t classes) {
  if (!weight.defined()) return;
  EMBER_CHECK(weight.dim() == 1 && weight.size(0) == classes, "[", op,
              "] weight must have one entry per class: expected shape [", classes, "], got ",
              weight.shape());
  EMBER_CHECK_TYPE(TypeError, weight.is_floating_point(), "[", op,
                   "] expected a floating-point weight, got ", weight.dtype());
  EMBER_CHECK_TYPE(TypeError, weight.device() == input.device(), "[", op, "] weight is on ",
                   weight.device(), " but input is on ", input.device());
}

// Validates a class-index target against input (whose class dim holds `classes`) and returns
// the ignore mask; throws IndexError for a class index outside [0, C) that is not ignored.
Tensor check_class_target(const char* op, const Tensor& input, const Tensor& target,
                          const Tensor& weight, int64_t ignore_index) {
  check_floating(op, input, "input");
  detail::check_defined(op, target, "target");
  EMBER_CHECK(input.dim() >= 1, "[", op,
              "] expected input of shape [N, C], [N, C, d1, ...] or [C], got a 0-d tensor");
  EMBER_CHECK_TYPE(TypeError, target.dtype() == kInt64, "[", op,
                   "] expected an int64 target of class indices, got ", target.dtype());
  EMBER_CHECK_TYPE(TypeError, target.device() == input.device(), "[", op, "] target is on ",
                   target.device(), " but input is on ", input.device());
  const int64_t cdim = class_dim_of(input);
  const int64_t classes = input.size(cdim);
  Shape want = input.shape();
  want.erase(cdim);
  EMBER_CHECK(target.shape() == want, "[", op, "] expected target of shape ", want,
              " for input of shape ", input.shape(), ", got ", target.shape());
  check_class_weight(op, weight, input, classes);

  const Tensor ignored = eq(target, ignore_index);
  // Class indices must lie in [0, C) unless ignored. On CUDA the gather that reads each target's
  // logit checks its indices on the device and the next index op reports a bad one (Note [CUDA
  // index checks]): a read-back here would make the host wait for the device in every step.
  if (target.is_cuda()) return ignored;
  const Tensor bad =
      logical_and(logical_not(ignored), logical_or(lt(target, 0), ge(target, classes)));
  if (target.numel() > 0 && any(bad).item<bool>()) {
    const int64_t i = argmax(bad.flatten()).item<int64_t>();
    const int64_t value = target.flatten()[i].item<int64_t>();
    throw IndexError(detail::str_cat("[", op, "] target ", value, " at flat index ", i,
                                     " is out of bounds: expected a class index in [0, ", classes,
                                     ") or ignore_index (", ignore_index, ")"));
  }
  return ignored;
}

NllParts nll_parts(const char* op, const Tensor& input, const Tensor& target, const Tensor& weight,
                   int64_t ignore_index) {
  NllParts p;
  p.ignored = check_class_target(op, input, target, weight, ignore_index);
  const int64_t cdim = class_dim_of(input);
  Shape want = input.shape();
  want.erase(cdim);
  const Tensor safe = masked_fill(target, p.ignored, 0);
  const Tensor picked = gather(input, cdim, safe.unsqueeze(cdim)).squeeze(cdim);
  if (weight.defined()) {
    const Tensor w = index_select(weight.to(input.dtype()), 0, safe.flatten()).view(want);
    p.weights = masked_fill(w, p.ignored, 0);
    p.loss = masked_fill(-(picked * w), p.ignored, 0);
  } else {
    p.weights = logical_not(p.ignored).to(input.dtype());
    p.loss = masked_fill(-picked, p.ignored, 0);
  }
  return p;
}

// Note [Fused cross_entropy]: for a 2-d input [N, C] and class-index targets, one function
// instead of log_softmax + gather + masking: forward computes p = softmax(x) (the only
// exponentials) and takes log p only where needed, through lse = max - log(p[argmax]) (p at the
// row's max is 1 / sum, never underflows), so logp[t] = x[t] - lse and, for label smoothing,
// sum_c w_c logp_c = sum_c w_c x_c - lse * sum_c w_c. With s_i the per-row scale of the
// reduction (0 where ignored) and K_i = (1 - ls) w[t_i] + ls / C * sum_c w_c, backward is
//   dx[i, c] = s_i * (K_i * p[i, c] - ls / C * w_c - (1 - ls) w[t_i] [c == t_i])
// in one pass over [N, C] plus a scatter into the target column. Under create_graph, backward
// recomputes p = softmax(x) from the saved input with recorded ops, so double backward is exact.
struct CrossEntropyFunction : autograd::Function<CrossEntropyFunction> {
  // x: [N, C]; target: [N] int64, already validated; weight: [C] or undefined (no grad);
  // ignored: [N] bool.
  static Tensor forward(autograd::Context* ctx, const Tensor& x, const Tensor& target,
                        const Tensor& weight, const Tensor& ignored, int64_t reduction,
                        double ls) {
    const int64_t classes = x.size(1);
    const Tensor w = weight.defined() ? weight.to(x.dtype()) : Tensor();
    const Tensor safe = masked_fill(target, ignored, 0).unsqueeze(1);  // [N, 1]
    const Tensor valid = logical_not(ignored).to(x.dtype());            // [N]
    const Tensor wt = w.defined() ? index_select(w, 0, safe.view({-1})) * valid : valid;  // [N]
    const Tensor p = softmax(x, 1);
    const Tensor amax = argmax(x, 1, /*keepdim=*/true);
    const Tensor lse = (gather(x, 1, amax) - log(gather(p, 1, amax))).view({-1});  // [N]
    const Tensor logpt = gather(x, 1, safe).view({-1}) - lse;
    Tensor loss = masked_fill(-(logpt * wt), ignored, 0);  // [N]
    if (ls > 0) {
      const double wsum = w.defined() ? w.sum().item<double>() : static_cast<double>(classes);
      const Tensor wx = w.defined() ? matmul(x, w) : x.sum({1});  // [N]
      const Tensor smooth = masked_fill(lse * wsum - wx, ignored, 0);  // -sum_c w_c logp_c
      loss = loss * (1.0 - ls) + smooth * (ls / static_cast<double>(classes));
      ctx->saved_data["wsum"] = wsum;
    }
    std::vector<Tensor> save{x, p, safe, wt, valid};
    if (w.defined()) save.push_back(w);
    ctx->save_for_backward(std::move(save));
    ctx->saved_data["reduction"] = reduction;
    ctx->saved_data["ls"] = ls;
    switch (static_cast<Reduction>(reduction)) {
      case Reduction::kNone:
        return loss;
      case Reduction::kSum:
        return loss.sum();
      case Reduction::kMean:
        return loss.sum() / wt.sum();
    }
    return loss;
  }

  static autograd::TensorList backward(autograd::Context* ctx, autograd::TensorList grads) {
    const autograd::TensorList saved = ctx->saved();
    const Tensor& x = saved[0];
    const Tensor& safe = saved[2];
    const Tensor& wt = saved[3];
    const Tensor& valid = saved[4];
    const Tensor w = saved.size() > 5 ? saved[5] : Tensor();
    const auto r = static_cast<Reduction>(std::any_cast<int64_t>(ctx->saved_data["reduction"]));
    const double ls = std::any_cast<double>(ctx->saved_data["ls"]);
    const int64_t classes = x.size(1);
    if (!ctx->needs_input_grad(0)) return {Tensor(), Tensor(), Tensor(), Tensor()};
    const bool create_graph = GradMode::is_enabled();
    const Tensor& g = grads[0];  // [] for mean/sum, [N] for none
    Tensor sv;                   // [N]: the reduction's scale per row, 0 where ignored
    switch (r) {
      case Reduction::kNone:
        sv = g * valid;
        break;
      case Reduction::kSum:
        sv = valid * g;
        break;
      case Reduction::kMean:
        sv = valid * (g / wt.sum());
        break;
    }
    Tensor k = wt * (1.0 - ls);
    if (ls > 0) k = k + std::any_cast<double>(ctx->saved_data["wsum"]) * ls / classes;
    const Tensor p = create_graph ? softmax(x, 1) : saved[1];
    Tensor dx = p * (sv * k).unsqueeze(1);  // [N, C]
    if (ls > 0) {
      const Tensor row = (sv * (ls / static_cast<double>(classes))).unsqueeze(1);  // [N, 1]
      const Tensor smooth = w.defined() ? row * w.view({1, classes}) : row;
      dx = create_graph ? dx - smooth : dx.sub_(smooth);
    }
    const Tensor at_target = (sv * wt * (ls - 1.0)).unsqueeze(1);  // [N, 1]
    dx = create_graph ? scatter_add(dx, 1, safe, at_target) : scatter_add_(dx, 1, safe, at_target);
    return {dx, Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

Tensor nll_loss(const Tensor& input, const Tensor& target, const NLLLossOptions& opts) {
  if (auto ac = detail::autocast_inputs(AutocastPolicy::kFloat32, input, target, opts.weight)) {
    NLLLossOptions o = opts;
    o.weight = ac[2];
    return nll_loss(ac[0], ac[1], o);
  }
  const Reduction r = parse_reduction("nll_loss", opts.reduction);
  NllParts p = nll_parts("nll_loss", input, target, opts.weight, opts.ignore_index);
  switch (r) {
    case Reduction::kNone:
      return p.loss;
    case Reduction::kSum:
      return p.loss.sum();
    case Reduction::kMean:
      return p.loss.sum() / p.weights.sum();
  }
  return p.loss;
}

Tensor cross_entropy(const Tensor& input, const Tensor& target, const CrossEntropyOptions& opts) {
  if (auto ac = detail::autocast_inputs(AutocastPolicy::kFloat32, input, target, opts.weight)) {
    CrossEntropyOptions o = opts;
    o.weight = ac[2];
    return cross_entropy(ac[0], ac[1], o);
  }
  const char* op = "cross_entropy";
  const Reduction r = parse_reduction(op, opts.reduction);
  check_floating(op, input, "input");
  detail::check_defined(op, target, "target");
  const double ls = opts.label_smoothing;
  EMBER_CHECK(ls >= 0.0 && ls <= 1.0,
              "[cross_entropy] label_smoothing must be between 0.0 and 1.0, got ", ls);
  EMBER_CHECK(
      input.dim() >= 1,
      "[cross_entropy] expected input of shape [N, C], [N, C, d1, ...] or [C], got a 0-d tensor");
  const int64_t cdim = class_dim_of(input);
  const int64_t classes = input.size(cdim);
  if (input.dim() == 2 && !target.is_floating_point() &&
      !(opts.weight.defined() && opts.weight.requires_grad() && GradMode::is_enabled())) {
    const Tensor ignored = check_class_target(op, input, target, opts.weight, opts.ignore_index);
    return CrossEntropyFunction::apply(input, target, opts.weight, ignored,
                                       static_cast<int64_t>(r), ls);
  }
  const Tensor logp = log_softmax(input, cdim);
  const Shape wshape = channel_shape(input.dim(), classes, cdim);

  if (target.is_floating_point()) {
    // Class probabilities.
    EMBER_CHECK(target.shape() == input.shape(),
                "[cross_entropy] a floating-point target holds class probabilities and must have "
                "input's shape ",
                input.shape(), ", got ", target.shape(), " (class indices must be int64)");
    EMBER_CHECK(opts.ignore_index < 0,
                "[cross_entropy] ignore_index is not supported for floating-point (probability) "
                "targets, got ignore_index=",
                opts.ignore_index);
    check_class_weight(op, opts.weight, input, classes);
    Tensor t = ls > 0 ? target * (1.0 - ls) + ls / static_cast<double>(classes) : target;
    Tensor prod = logp * t;
    if (opts.weight.defined()) prod = prod * opts.weight.to(input.dtype()).view(wshape);
    const Tensor loss = -prod.sum({cdim});
    if (r == Reduction::kMean) {
      return loss.sum() / static_cast<double>(input.numel() / std::max<int64_t>(classes, 1));
    }
    return reduce(loss, r);
  }

  NllParts p = nll_parts(op, logp, target, opts.weight, opts.ignore_index);
  Tensor nll;
  switch (r) {
    case Reduction::kNone:
      nll = p.loss;
      break;
    case Reduction::kSum:
      nll = p.loss.sum();
      break;
    case Reduction::kMean:
      nll = p.loss.sum() / p.weights.sum();
      break;
  }
  if (ls == 0.0) return nll;
  // PyTorch's label smoothing for class indices: (1 - s) * nll + s / C * smooth, where smooth
  // = -sum_c weight[c] * logp[c], zero where ignored, and "mean" divides smooth by the same
  // summed target weights as nll.
  Tensor smooth = opts.weight.defined()
                      ? -(logp * opts.weight.to(input.dtype()).view(wshape)).sum({cdim})
                      : -logp.sum({cdim});
  smooth = masked_fill(smooth, p.ignored, 0);
  Tensor sm;
  switch (r) {
    case Reduction::kNone:
      sm = smooth;
      break;
    case Reduction::kSum:
      sm = smooth.sum();
      break;
    case Reduction::kMean:
      sm = smooth.sum() / p.weights.sum();
      break;
  }
  return nll * (1.0 - ls) + sm * (ls / static_cast<double>(classes));
}

Tensor mse_loss(const Tensor& input, const Tensor& target, std::string_view reduction) {
  if (auto ac = detail::autocast_inputs(AutocastPolicy::kFloat32, input, target)) return mse_loss(ac[0], ac[1], reduction);
  const Reduction r = parse_reduction("mse_loss", reduction);
  check_floating("mse_loss", input, "input");
  detail::check_defined("mse_loss", target, "target");
  EMBER_CHECK(input.shape() == target.shape(), "[mse_loss] expected target of input's shape ",
              input.shape(), ", got ", target.shape());
  return reduce(square(input - target), r);
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
  return reduce(loss, r);
}

}  // namespace ember::nn::functional
