// nll_loss and cross_entropy: validation, autocast, the fused 2-d cross entropy (recorded as one
// op, OpId::CrossEntropy, whose node is in autograd/functions_nn.cpp) and the composite paths,
// written with recorded tensor ops.
#include <ember/tensor/ops/loss.h>

#include <algorithm>

#include <ember/tensor/autocast.h>
#include <ember/tensor/detail/record.h>
#include <ember/tensor/detail/reduce_kernels.h>
#include <ember/tensor/ops/elementwise.h>
#include <ember/tensor/ops/indexing.h>
#include <ember/tensor/ops/linalg.h>
#include <ember/tensor/ops/reduce.h>

namespace ember {

namespace {

void check_floating(const char* op, const Tensor& t, const char* name) {
  detail::check_defined(op, t, name);
  EMBER_CHECK_TYPE(TypeError, t.is_floating_point(), "[", op, "] expected a floating-point ", name,
                   ", got ", t.dtype());
}

// What nll_loss and cross_entropy share for class-index targets: the per-element losses (zero
// where ignored), the per-element weights (zero where ignored) and the ignore mask.
struct NllParts {
  Tensor loss;     // [N, d1, ...]: -weight[t] * input[t], 0 where ignored
  Tensor weights;  // [N, d1, ...]: weight[t] (or 1), 0 where ignored
  Tensor ignored;  // bool [N, d1, ...]
};

int64_t class_dim_of(const Tensor& input) { return input.dim() == 1 ? 0 : 1; }

/// Shape [1, C, 1, ...] of input's rank, to broadcast a per-class [C] tensor over the class dim.
Shape class_shape(const Tensor& input, int64_t classes) {
  Shape s = Shape::filled(input.dim(), 1);
  s[class_dim_of(input)] = classes;
  return s;
}

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

/// The weighted class-index loss reduced: kMean divides by the counted targets' weights.
Tensor reduce_weighted(const Tensor& loss, const Tensor& weights, Reduction r) {
  return r == Reduction::kMean ? loss.sum() / weights.sum() : reduce_loss(loss, r);
}

// Note [Fused cross_entropy]: for a 2-d input [N, C] and class-index targets, one op instead of
// log_softmax + gather + masking, as two row kernels (cross_entropy_rows_cpu in
// tensor/cpu/softmax.cpp, cross_entropy_rows_cuda in tensor/cuda/softmax.cu). Forward reads x
// once for each row's lse = log sum_c exp(x_c) and its target's logit, so logp[t] = x[t] - lse
// and, for label smoothing, sum_c w_c logp_c = sum_c w_c x_c - lse * sum_c w_c; it saves lse [N],
// not the softmax [N, C]. With s_i the per-row scale of the reduction (0 where ignored) and K_i
// = (1 - ls) w[t_i] + ls / C * sum_c w_c, backward (CrossEntropyBackward,
// autograd/functions_nn.cpp) is
//   dx[i, c] = s_i * (K_i * p[i, c] - ls / C * w_c - (1 - ls) w[t_i] [c == t_i])
// written in one pass that recomputes p = exp(x - lse), so the op keeps no logits-sized buffer
// of its own. Everything of size [N] or [C] is in the accumulation type (float32 for float16
// and bfloat16 x), and each gradient element is rounded to x's dtype once. Under create_graph,
// backward recomputes p = softmax(x) with recorded ops, so double backward is exact.
//
// Under autocast a float16 or bfloat16 input is not cast to float32 first (Note [cross_entropy
// under autocast], below): the row kernels read it as it is and compute in float32, which is
// what the cast would give (widening is exact), without the float32 copy of the logits; the
// loss is float32, as torch's under autocast, and the gradient arrives in the input's dtype.

// x: [N, C]; target: [N] int64 and weight [C] or undefined, already validated (the weight gets
// no gradient); ignored: [N] bool. The loss is computed in the accumulation type and returned in
// loss_dtype.
Tensor fused_cross_entropy(const Tensor& x, const Tensor& target, const Tensor& weight,
                           const Tensor& ignored, Reduction reduction, double ls,
                           Dtype loss_dtype) {
  CrossEntropyAttrs a;
  a.reduction = reduction;
  a.label_smoothing = ls;
  Tensor out;
  {
    // One recorded op: nothing computed here records.
    NoGradGuard no_grad;
    const int64_t rows = x.size(0), classes = x.size(1);
    const Dtype acc = x.dtype() == kFloat64 ? kFloat64 : kFloat32;
    a.class_weight = weight.defined() ? weight.to(acc).contiguous() : Tensor();
    const Tensor& w = a.class_weight;
    a.target_index = masked_fill(target, ignored, 0).unsqueeze(1);  // [N, 1]
    a.valid = logical_not(ignored).to(acc);                         // [N]
    a.lse = detail::make_empty({rows}, acc, x.device());
    const Tensor picked = detail::make_empty({rows}, acc, x.device());
    const Tensor xc = x.contiguous(), t = a.target_index.view({-1}).contiguous();
    if (x.is_cuda()) {
      detail::cross_entropy_rows_cuda(a.lse, picked, xc, t);
    } else {
      detail::cross_entropy_rows_cpu(a.lse, picked, xc, t);
    }
    // After the row kernel: on CUDA a bad target is then reported by cross_entropy's own device
    // check, queued first, rather than by this index_select's.
    a.row_weight =
        w.defined() ? index_select(w, 0, a.target_index.view({-1})) * a.valid : a.valid;  // [N]
    Tensor loss = masked_fill(-((picked - a.lse) * a.row_weight), ignored, 0);  // [N]
    if (ls > 0) {
      const Tensor xa = x.to(acc);  // a copy only for float16 and bfloat16 x
      // -sum_c w_c logp_c. With class weights their sum stays a device scalar (the backward
      // takes it again): a host read here would make every step wait for the GPU, and could not
      // be captured in a CUDA graph.
      Tensor smooth;
      if (w.defined()) {
        smooth = a.lse * w.sum() - matmul(xa, w);
      } else {
        a.weight_sum = static_cast<double>(classes);
        smooth = a.lse * a.weight_sum - xa.sum({1});
      }
      smooth = masked_fill(smooth, ignored, 0);
      loss = loss * (1.0 - ls) + smooth * (ls / static_cast<double>(classes));
    }
    out = reduce_weighted(loss, a.row_weight, reduction).to(loss_dtype);
  }
  if (detail::should_record(x)) detail::record<OpId::CrossEntropy>({&x}, {&out}, std::move(a));
  return out;
}

// Whether cross_entropy takes the fused path: a 2-d input, class indices, and no gradient
// wanted for the class weights.
bool fuses(const Tensor& input, const Tensor& target, const Tensor& weight) {
  return input.defined() && input.dim() == 2 && target.defined() && !target.is_floating_point() &&
         !(weight.defined() && weight.requires_grad() && GradMode::is_enabled());
}

void check_label_smoothing(double ls) {
  EMBER_CHECK(ls >= 0.0 && ls <= 1.0,
              "[cross_entropy] label_smoothing must be between 0.0 and 1.0, got ", ls);
}

Tensor checked_fused_cross_entropy(const Tensor& input, const Tensor& target, const Tensor& weight,
                                   int64_t ignore_index, Reduction reduction, double ls,
                                   Dtype loss_dtype) {
  check_label_smoothing(ls);
  const Tensor ignored = check_class_target("cross_entropy", input, target, weight, ignore_index);
  return fused_cross_entropy(input, target, weight, ignored, reduction, ls, loss_dtype);
}

}  // namespace

Tensor reduce_loss(const Tensor& loss, Reduction reduction) {
  switch (reduction) {
    case Reduction::kMean:
      return loss.mean();
    case Reduction::kSum:
      return loss.sum();
    case Reduction::kNone:
      return loss;
  }
  return loss;
}

Tensor nll_loss(const Tensor& input, const Tensor& target, const Tensor& weight,
                int64_t ignore_index, Reduction reduction) {
  if (auto ac = detail::autocast_inputs(AutocastPolicy::kFloat32, input, target, weight)) {
    return nll_loss(ac[0], ac[1], ac[2], ignore_index, reduction);
  }
  const NllParts p = nll_parts("nll_loss", input, target, weight, ignore_index);
  return reduce_weighted(p.loss, p.weights, reduction);
}

Tensor cross_entropy(const Tensor& input, const Tensor& target, const Tensor& weight,
                     int64_t ignore_index, Reduction reduction, double label_smoothing) {
  // Note [cross_entropy under autocast]: autocast runs cross_entropy in float32, but the fused
  // path reads float16 and bfloat16 logits itself (Note [Fused cross_entropy]); only the class
  // weights are cast, and the loss is float32.
  if (fuses(input, target, weight) && (input.dtype() == kBFloat16 || input.dtype() == kFloat16)) {
    if (auto ac = detail::autocast_inputs(AutocastPolicy::kFloat32, target, weight)) {
      return checked_fused_cross_entropy(input, ac[0], ac[1], ignore_index, reduction,
                                         label_smoothing, kFloat32);
    }
  }
  if (auto ac = detail::autocast_inputs(AutocastPolicy::kFloat32, input, target, weight)) {
    return cross_entropy(ac[0], ac[1], ac[2], ignore_index, reduction, label_smoothing);
  }
  if (fuses(input, target, weight)) {
    return checked_fused_cross_entropy(input, target, weight, ignore_index, reduction,
                                       label_smoothing, input.dtype());
  }
  const char* op = "cross_entropy";
  check_floating(op, input, "input");
  detail::check_defined(op, target, "target");
  const double ls = label_smoothing;
  check_label_smoothing(ls);
  EMBER_CHECK(
      input.dim() >= 1,
      "[cross_entropy] expected input of shape [N, C], [N, C, d1, ...] or [C], got a 0-d tensor");
  const int64_t cdim = class_dim_of(input);
  const int64_t classes = input.size(cdim);
  const Tensor logp = log_softmax(input, cdim);
  const Shape wshape = class_shape(input, classes);

  if (target.is_floating_point()) {
    // Class probabilities.
    EMBER_CHECK(target.shape() == input.shape(),
                "[cross_entropy] a floating-point target holds class probabilities and must have "
                "input's shape ",
                input.shape(), ", got ", target.shape(), " (class indices must be int64)");
    EMBER_CHECK(ignore_index < 0,
                "[cross_entropy] ignore_index is not supported for floating-point (probability) "
                "targets, got ignore_index=",
                ignore_index);
    check_class_weight(op, weight, input, classes);
    Tensor t = ls > 0 ? target * (1.0 - ls) + ls / static_cast<double>(classes) : target;
    Tensor prod = logp * t;
    if (weight.defined()) prod = prod * weight.to(input.dtype()).view(wshape);
    const Tensor loss = -prod.sum({cdim});
    if (reduction == Reduction::kMean) {
      return loss.sum() / static_cast<double>(input.numel() / std::max<int64_t>(classes, 1));
    }
    return reduce_loss(loss, reduction);
  }

  const NllParts p = nll_parts(op, logp, target, weight, ignore_index);
  const Tensor nll = reduce_weighted(p.loss, p.weights, reduction);
  if (ls == 0.0) return nll;
  // PyTorch's label smoothing for class indices: (1 - s) * nll + s / C * smooth, where smooth
  // = -sum_c weight[c] * logp[c], zero where ignored, and "mean" divides smooth by the same
  // summed target weights as nll.
  Tensor smooth = weight.defined() ? -(logp * weight.to(input.dtype()).view(wshape)).sum({cdim})
                                   : -logp.sum({cdim});
  smooth = masked_fill(smooth, p.ignored, 0);
  return nll * (1.0 - ls) + reduce_weighted(smooth, p.weights, reduction) *
                                (ls / static_cast<double>(classes));
}

}  // namespace ember
