// Backward nodes of the ops behind nn's fused layers and losses: layer_norm and batch_norm
// (tensor/ops/norm.h), cross_entropy (tensor/ops/loss.h) and the fused
// scaled_dot_product_attention (tensor/ops/attention.h). Their forwards pass what backward needs
// besides inputs and outputs (statistics, probabilities, the kernels' parameters) in their typed
// attributes.
#include <utility>
#include <vector>

#include <ember/autograd/detail/functions.h>
#include <ember/tensor/detail/attention_kernels.h>
#include <ember/tensor/detail/norm_kernels.h>
#include <ember/tensor/detail/reduce_kernels.h>
#include <ember/tensor/ops.h>

namespace ember::autograd {
namespace {

// ---- layer_norm (Note [LayerNorm as one op] in tensor/ops/norm.cpp) -----------------------------

/// inputs {x, weight, bias}; weight and bias may be undefined.
struct LayerNormBackward final : Node {
  int64_t normalized_dims = 1;
  double eps = 0;
  SavedTensor x, weight, mean, rstd;  ///< mean and rstd: only after the fused kernels
  const char* name() const override { return "LayerNormBackward"; }
  TensorList apply(TensorList&& grads) override {
    const Tensor xs = x.unpack(*this);
    const Tensor w = weight.defined() ? weight.unpack(*this) : Tensor();
    const int64_t k = normalized_dims;
    if (mean.defined() && !GradMode::is_enabled()) {
      // The fused kernels: x, weight and the statistics are contiguous, of one dtype.
      const Tensor m = mean.unpack(*this), r = rstd.unpack(*this);
      const int64_t rows = m.numel(), row = xs.numel() / rows;
      const Tensor dy = grads[0].to(xs.dtype()).contiguous();
      Shape normalized;  // the last k dims, the shape of weight and bias
      for (int64_t d = xs.dim() - k; d < xs.dim(); ++d) normalized.push_back(xs.size(d));
      Tensor dx = needs_input_grad(0) ? empty(xs.shape(), xs.options()) : Tensor();
      Tensor dweight =
          w.defined() && needs_input_grad(1) ? empty(normalized, xs.options()) : Tensor();
      Tensor dbias = needs_input_grad(2) ? empty(normalized, xs.options()) : Tensor();
      auto rows_of = [&](const Tensor& t) { return t.defined() ? t.view({rows, row}) : t; };
      auto row_of = [&](const Tensor& t) { return t.defined() ? t.view({row}) : t; };
      (xs.is_cuda() ? detail::layer_norm_backward_cuda : detail::layer_norm_backward_cpu)(
          rows_of(dy), rows_of(xs), m, r, row_of(w), rows_of(dx), row_of(dweight), row_of(dbias));
      return {dx, dweight, dbias};
    }
    // dims: the normalized dims; lead: the dims weight and bias are broadcast over.
    std::vector<int64_t> dims, lead;
    for (int64_t d = 0; d < xs.dim(); ++d) (d < xs.dim() - k ? lead : dims).push_back(d);
    auto sum_lead = [&](const Tensor& t) { return lead.empty() ? t : t.sum(lead); };

    const Tensor& dy = grads[0];  // [*, normalized_shape]
    const detail::LayerNormStats s = detail::layer_norm_stats(xs, k, eps);
    Tensor dx, dweight, dbias;
    if (needs_input_grad(0)) {
      const Tensor dxhat = w.defined() ? dy * w : dy;
      const Tensor a = dxhat.mean(dims, /*keepdim=*/true);             // [*, 1...]
      const Tensor b = (dxhat * s.xhat).mean(dims, /*keepdim=*/true);  // [*, 1...]
      dx = (dxhat - a - s.xhat * b) * s.rstd;
    }
    if (w.defined() && needs_input_grad(1)) dweight = sum_lead(dy * s.xhat);
    if (needs_input_grad(2)) dbias = sum_lead(dy);
    return {dx, dweight, dbias};
  }
  void release_variables() override {
    x.release();
    weight.release();
    mean.release();
    rstd.release();
  }
};

void record_layer_norm(const RecordArgs& r) {
  const LayerNormAttrs& a = r.attrs<OpId::LayerNorm>();
  auto n = new_node<LayerNormBackward>(r);
  n->normalized_dims = a.normalized_dims;
  n->eps = a.eps;
  n->x = SavedTensor(r.in(0), false);
  if (r.in(1).defined()) n->weight = SavedTensor(r.in(1), false);
  if (a.mean.defined()) {
    n->mean = SavedTensor(a.mean, false);
    n->rstd = SavedTensor(a.rstd, false);
  }
  commit(n, r);
}

// ---- batch_norm (Note [BatchNorm as one op] in tensor/ops/norm.cpp) ----------------------------

/// inputs {x [N, C, *], weight, bias}; weight and bias may be undefined.
struct BatchNormBackward final : Node {
  bool training = true;
  double eps = 0;
  SavedTensor x, weight, mean, invstd;
  const char* name() const override { return "BatchNormBackward"; }
  TensorList apply(TensorList&& grads) override {
    const Tensor xs = x.unpack(*this);
    const Tensor w = weight.defined() ? weight.unpack(*this) : Tensor();
    const Tensor m = mean.unpack(*this), is = invstd.unpack(*this);
    const int64_t channels = xs.size(1);
    if (!GradMode::is_enabled()) {
      const Tensor dy = grads[0].to(xs.dtype()).contiguous();
      Tensor dx = needs_input_grad(0) ? empty(xs.shape(), xs.options()) : Tensor();
      Tensor dweight =
          w.defined() && needs_input_grad(1) ? empty({channels}, xs.options()) : Tensor();
      Tensor dbias = needs_input_grad(2) ? empty({channels}, xs.options()) : Tensor();
      auto runs = [&](const Tensor& t) {
        return t.defined() ? t.view({xs.size(0), channels, -1}) : t;
      };
      detail::batch_norm_backward_cpu(runs(dy), runs(xs), w, m, is, training, runs(dx), dweight,
                                      dbias);
      return {dx, dweight, dbias};
    }
    // create_graph: the same in recorded tensor ops, with the batch statistics recomputed from x
    // when training so that the second derivative sees their dependence on it.
    std::vector<int64_t> dims{0};
    for (int64_t d = 2; d < xs.dim(); ++d) dims.push_back(d);
    Shape bshape = Shape::filled(xs.dim(), 1);
    bshape[1] = channels;
    Tensor mean_b = m.view(bshape), invstd_b = is.view(bshape);
    if (training) {
      mean_b = xs.mean(dims, /*keepdim=*/true);
      invstd_b = rsqrt(var(xs, dims, /*correction=*/0, /*keepdim=*/true) + eps);
    }
    const Tensor& dy = grads[0];
    const Tensor xhat = (xs - mean_b) * invstd_b;
    Tensor dx, dweight, dbias;
    if (needs_input_grad(0)) {
      const Tensor dxhat = w.defined() ? dy * w.view(bshape) : dy;
      dx = training ? (dxhat - dxhat.mean(dims, true) - xhat * (dxhat * xhat).mean(dims, true)) *
                          invstd_b
                    : dxhat * invstd_b;
    }
    if (w.defined() && needs_input_grad(1)) dweight = (dy * xhat).sum(dims);
    if (needs_input_grad(2)) dbias = dy.sum(dims);
    return {dx, dweight, dbias};
  }
  void release_variables() override {
    x.release();
    weight.release();
    mean.release();
    invstd.release();
  }
};

void record_batch_norm(const RecordArgs& r) {
  const BatchNormAttrs& a = r.attrs<OpId::BatchNorm>();
  auto n = new_node<BatchNormBackward>(r);
  n->training = a.training;
  n->eps = a.eps;
  n->x = SavedTensor(r.in(0), false);
  if (r.in(1).defined()) n->weight = SavedTensor(r.in(1), false);
  n->mean = SavedTensor(a.mean, false);
  n->invstd = SavedTensor(a.invstd, false);
  commit(n, r);
}

// ---- cross_entropy (Note [Fused cross_entropy] in tensor/ops/loss.cpp) --------------------------

/// inputs {x [N, C]}.
struct CrossEntropyBackward final : Node {
  Reduction reduction = Reduction::kMean;
  double label_smoothing = 0, weight_sum = 0;
  // [N] and [C] tensors in the accumulation type (float32 for float16 and bfloat16 x).
  SavedTensor x, lse, target_index, row_weight, valid, class_weight;
  const char* name() const override { return "CrossEntropyBackward"; }
  TensorList apply(TensorList&& grads) override {
    const Tensor xs = x.unpack(*this);
    const Tensor l = lse.unpack(*this);              // [N]
    const Tensor safe = target_index.unpack(*this);  // [N, 1]
    const Tensor wt = row_weight.unpack(*this);      // [N]
    const Tensor v = valid.unpack(*this);            // [N]
    const Tensor w = class_weight.defined() ? class_weight.unpack(*this) : Tensor();  // [C]
    const Dtype acc = l.dtype();
    const double ls = label_smoothing;
    const int64_t classes = xs.size(1);
    const bool create_graph = GradMode::is_enabled();
    const Tensor g = grads[0].to(acc);  // [] for mean/sum, [N] for none
    Tensor sv;                          // [N]: the reduction's scale per row, 0 where ignored
    switch (reduction) {
      case Reduction::kNone:
        sv = g * v;
        break;
      case Reduction::kSum:
        sv = v * g;
        break;
      case Reduction::kMean:
        sv = v * (g / wt.sum());
        break;
    }
    Tensor k = wt * (1.0 - ls);
    if (ls > 0) {  // sum_c w_c: C without weights, else on the device (no host read)
      k = w.defined() ? k + w.sum() * (ls / static_cast<double>(classes))
                      : k + weight_sum * ls / static_cast<double>(classes);
    }
    const Tensor row_smooth = sv * (ls / static_cast<double>(classes));  // [N]
    const Tensor at_target = sv * wt * (ls - 1.0);                       // [N]
    if (!create_graph) {
      const Tensor dx = detail::make_empty(xs.shape(), xs.dtype(), xs.device());
      const Tensor xc = xs.contiguous(), t = safe.view({-1}).contiguous();
      const Tensor scale = (sv * k).contiguous(), at = at_target.contiguous();
      const Tensor smooth = ls > 0 ? row_smooth.contiguous() : Tensor();
      if (xs.is_cuda()) {
        detail::cross_entropy_rows_backward_cuda(dx, xc, l, t, scale, smooth, w, at);
      } else {
        detail::cross_entropy_rows_backward_cpu(dx, xc, l, t, scale, smooth, w, at);
      }
      return {dx};
    }
    const Tensor p = softmax(xs.to(acc), 1);
    Tensor dx = p * (sv * k).unsqueeze(1);  // [N, C]
    if (ls > 0) {
      const Tensor row = row_smooth.unsqueeze(1);  // [N, 1]
      dx = dx - (w.defined() ? row * w.view({1, classes}) : row);
    }
    return {scatter_add(dx, 1, safe, at_target.unsqueeze(1)).to(xs.dtype())};
  }
  void release_variables() override {
    for (SavedTensor* s : {&x, &lse, &target_index, &row_weight, &valid, &class_weight}) {
      s->release();
    }
  }
};

void record_cross_entropy(const RecordArgs& r) {
  const CrossEntropyAttrs& a = r.attrs<OpId::CrossEntropy>();
  auto n = new_node<CrossEntropyBackward>(r);
  n->reduction = a.reduction;
  n->label_smoothing = a.label_smoothing;
  n->weight_sum = a.weight_sum;
  n->x = SavedTensor(r.in(0), false);
  n->lse = SavedTensor(a.lse, false);
  n->target_index = SavedTensor(a.target_index, false);
  n->row_weight = SavedTensor(a.row_weight, false);
  n->valid = SavedTensor(a.valid, false);
  if (a.class_weight.defined()) n->class_weight = SavedTensor(a.class_weight, false);
  commit(n, r);
}

// ---- fused attention (Note [Fused attention] in tensor/detail/attention_kernels.h) ------------

/// inputs {q, k, v}: [..., L, E], [..., S, E], [..., S, Ev], one dtype, laid out for the kernel
/// (Note [Attention operand layouts]); the gradients are dense in their input's dim order.
struct ScaledDotProductAttentionBackward final : Node {
  detail::AttentionParams params;
  SavedTensor mask;  ///< the additive mask the kernels read (no gradient), or undefined
  SavedTensor q, k, v, out, lse;
  const char* name() const override { return "ScaledDotProductAttentionBackward"; }
  TensorList apply(TensorList&& g) override {
    EMBER_CHECK_TYPE(NotImplementedError, !GradMode::is_enabled(),
                     "[scaled_dot_product_attention] the fused kernel has no double backward "
                     "(backward with create_graph=true); use scaled_dot_product_attention_math "
                     "for that");
    const Tensor qs = q.unpack(*this), ks = k.unpack(*this), vs = v.unpack(*this);
    const Tensor dout = detail::attention_reads_as_is(g[0]) ? g[0] : g[0].contiguous();
    auto grad_like = [](const Tensor& t) {
      return detail::attention_empty_like(t, t.size(t.dim() - 1), t.dtype());
    };
    Tensor dq = grad_like(qs), dk = grad_like(ks), dv = grad_like(vs);
    (qs.is_cuda() ? detail::attention_backward_cuda : detail::attention_backward_cpu)(
        dq, dk, dv, dout, qs, ks, vs, out.unpack(*this), lse.unpack(*this),
        mask.defined() ? mask.unpack(*this) : Tensor(), params);
    return {dq, dk, dv};
  }
  void release_variables() override {
    for (SavedTensor* s : {&q, &k, &v, &out, &lse, &mask}) s->release();
  }
};

void record_attention(const RecordArgs& r) {
  const AttentionAttrs& a = r.attrs<OpId::ScaledDotProductAttention>();
  auto n = new_node<ScaledDotProductAttentionBackward>(r);
  n->params = a.params;
  // Saved with its version, as PyTorch saves attn_mask: a mask changed in place before the
  // backward is an error, not a silently different gradient.
  n->mask = SavedTensor(a.mask, false);
  n->q = SavedTensor(r.in(0), false);
  n->k = SavedTensor(r.in(1), false);
  n->v = SavedTensor(r.in(2), false);
  n->out = SavedTensor(r.out(0), true);
  n->lse = SavedTensor(a.lse, false);
  commit(n, r);
}

}  // namespace

void register_nn(FactoryTable& t) {
  slot(t, OpId::LayerNorm) = record_layer_norm;
  slot(t, OpId::BatchNorm) = record_batch_norm;
  slot(t, OpId::CrossEntropy) = record_cross_entropy;
  slot(t, OpId::ScaledDotProductAttention) = record_attention;
}

}  // namespace ember::autograd
