// scaled_dot_product_attention's front end: validation, autocast, and the choice between the
// fused kernels (cpu/attention.cpp, cuda/attention.cu), recorded as one op whose node is in
// autograd/functions_nn.cpp, and the math path written with recorded tensor ops.
#include <ember/tensor/ops/attention.h>
#include <ember/tensor/ops/attention_parts.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <tuple>
#include <vector>

#include <ember/tensor/autocast.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/detail/attention_kernels.h>
#include <ember/tensor/detail/random_kernels.h>
#include <ember/tensor/detail/record.h>
#include <ember/tensor/ops/elementwise.h>
#include <ember/tensor/ops/linalg.h>
#include <ember/tensor/ops/reduce.h>

namespace ember {

namespace {

constexpr const char* kOp = "scaled_dot_product_attention";

void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask,
                  double dropout_p, bool is_causal, const char* op = kOp) {
  const char* const kOp = op;  // the calling op's name in the messages
  detail::check_defined(kOp, q, "query");
  detail::check_defined(kOp, k, "key");
  detail::check_defined(kOp, v, "value");
  EMBER_CHECK_TYPE(TypeError, q.is_floating_point(), "[", kOp,
                   "] expected a floating-point query, got ", q.dtype());
  EMBER_CHECK_TYPE(TypeError, k.dtype() == q.dtype() && v.dtype() == q.dtype(), "[", kOp,
                   "] expected query, key and value of one dtype, got ", q.dtype(), ", ", k.dtype(),
                   " and ", v.dtype());
  EMBER_CHECK(k.device() == q.device() && v.device() == q.device(), "[", kOp,
              "] expected query, key and value on one device, got ", q.device(), ", ", k.device(),
              " and ", v.device());
  EMBER_CHECK(q.dim() >= 2 && k.dim() == q.dim() && v.dim() == q.dim(), "[", kOp,
              "] expected query, key and value of one rank >= 2, got shapes ", q.shape(), ", ",
              k.shape(), " and ", v.shape());
  const int64_t n = q.dim();
  for (int64_t d = 0; d < n - 2; ++d) {
    EMBER_CHECK(q.size(d) == k.size(d) && q.size(d) == v.size(d), "[", kOp,
                "] expected equal leading dims, got query ", q.shape(), ", key ", k.shape(),
                ", value ", v.shape());
  }
  EMBER_CHECK(k.size(n - 1) == q.size(n - 1), "[", kOp,
              "] last dim of key must equal last dim of query, got query ", q.shape(), ", key ",
              k.shape());
  EMBER_CHECK(v.size(n - 2) == k.size(n - 2), "[", kOp,
              "] value must have as many rows as key, got key ", k.shape(), ", value ", v.shape());
  EMBER_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "[", kOp, "] expected dropout_p in [0, 1), got ",
              dropout_p);
  if (attn_mask.defined()) {
    EMBER_CHECK(!is_causal, "[", kOp, "] attn_mask and is_causal may not both be given");
    EMBER_CHECK_TYPE(TypeError, attn_mask.dtype() == kBool || attn_mask.dtype() == q.dtype(), "[",
                     kOp, "] expected a bool attn_mask or one of the query's dtype ", q.dtype(),
                     ", got ", attn_mask.dtype());
    EMBER_CHECK(attn_mask.device() == q.device(), "[", kOp, "] expected attn_mask on ", q.device(),
                ", got ", attn_mask.device());
  }
}

/// Inverted dropout on the attention weights, drawn as nn::functional::dropout draws in training
/// (so the math path's masks are the same as when it was written with that function).
Tensor drop_weights(const Tensor& weights, double p, Generator* gen) {
  if (weights.numel() == 0) return weights;
  Tensor mask = empty(weights.shape(), weights.options());
  bernoulli_(mask, 1.0 - p, gen);
  mask.div_(1.0 - p);
  return weights * mask;
}

}  // namespace

Tensor scaled_dot_product_attention_math(const Tensor& q, const Tensor& k, const Tensor& v,
                                         const Tensor& attn_mask, double dropout_p, bool is_causal,
                                         std::optional<double> scale, Generator* gen) {
  check_inputs(q, k, v, attn_mask, dropout_p, is_causal);
  const int64_t n = q.dim();
  const int64_t L = q.size(n - 2), S = k.size(n - 2);
  const double s = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(n - 1)));
  // scores: [..., L, S]
  Tensor scores = matmul(q, k.transpose(-2, -1)) * s;
  Tensor mask = attn_mask;
  if (is_causal) {
    TensorOptions idx = TensorOptions(kInt64).device(q.device());
    mask = ge(arange(0, L, 1, idx).unsqueeze(1), arange(0, S, 1, idx).unsqueeze(0));
  }
  if (mask.defined()) {
    scores =
        mask.dtype() == kBool ? masked_fill(scores, logical_not(mask), -INFINITY) : scores + mask;
  }
  Tensor weights = softmax(scores, -1);
  if (dropout_p > 0.0) weights = drop_weights(weights, dropout_p, gen);
  return matmul(weights, v);
}

namespace {

// The fused op on operands of one dtype laid out for the kernel (Note [Attention operand
// layouts]): runs the forward kernel and records one node, which saves out and lse
// (AttentionAttrs) and recomputes the scores tile by tile in backward.
Tensor fused_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                       const detail::AttentionParams& p) {
  Tensor out = detail::attention_empty_like(q, p.Ev, q.dtype());
  Tensor lse = detail::make_empty({p.batch, p.L}, q.is_cuda() ? kFloat32 : q.dtype(), q.device());
  if (q.is_cuda()) {
    detail::attention_forward_cuda(out, lse, q, k, v, mask, p);
  } else {
    detail::attention_forward_cpu(out, lse, q, k, v, mask, p);
  }
  if (detail::should_record(q, k, v)) {
    detail::record<OpId::ScaledDotProductAttention>({&q, &k, &v}, {&out},
                                                    {.params = p, .mask = mask, .lse = lse});
  }
  return out;
}

// Largest head dims the CUDA kernel is built for (its per-thread register tiles).
constexpr int64_t kCudaMaxHeadDim = 128;

// One call of the fused kernels: their parameters, the dtype they compute in (the CPU kernels
// compute float16/bfloat16 in float32) and the operands laid out for them.
struct FusedCall {
  detail::AttentionParams p;
  Dtype dt = kFloat32;
  // t in dt as the kernel reads it: on CUDA contiguous [batch, rows, cols]; on the CPU as it
  // comes where its rows can be read so (a block of keys narrowed out of a longer sequence needs
  // no copy), else the same contiguous layout.
  Tensor operand(const Tensor& t, int64_t rows) const {
    Tensor c = t.to(dt);
    if (detail::attention_reads_as_is(c)) return c;
    return c.contiguous().view({p.batch, rows, t.size(t.dim() - 1)});
  }
  // A result in the kernel's layout (flat [batch, ...] on CUDA, else its operand's dims) as
  // `shape`.
  static Tensor shaped(const Tensor& r, const Shape& shape) {
    return r.shape() == shape ? r : r.view(shape);
  }
};

// The parameters of q [..., L, E] over k [..., S, E], v [..., S, Ev] (validated by the caller).
FusedCall fused_call(const Tensor& q, const Tensor& k, const Tensor& v, bool is_causal,
                     std::optional<double> scale) {
  const int64_t n = q.dim();
  FusedCall c;
  c.p.L = q.size(n - 2);
  c.p.S = k.size(n - 2);
  c.p.E = q.size(n - 1);
  c.p.Ev = v.size(n - 1);
  c.p.batch = c.p.L * c.p.E > 0 ? q.numel() / (c.p.L * c.p.E) : 0;
  c.p.scale = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(c.p.E));
  c.p.causal = is_causal;
  c.dt = !q.is_cuda() && q.dtype() != kFloat64 ? kFloat32 : q.dtype();
  return c;
}

std::atomic<SdpBackend> g_backend{SdpBackend::kAuto};
std::atomic<bool> g_cudnn{true};

// The fused kernels take this call; otherwise the math path runs: the math backend chosen, empty
// operands, a float mask that needs a gradient, dtypes or head sizes a backend has no kernel
// for, and on CUDA under kAuto scores that fit kAttentionMathBudgetBytes unless cuDNN's fused
// kernel or the TF32 one (Note [TF32 attention]) takes the call (see SdpBackend).
bool fused_applies(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                   const detail::AttentionParams& p) {
  const SdpBackend backend = g_backend.load(std::memory_order_relaxed);
  if (backend == SdpBackend::kMath) return false;
  if (q.numel() == 0 || k.numel() == 0 || v.numel() == 0) return false;
  if (mask.defined() && mask.requires_grad()) return false;
  if (!q.is_cuda()) return true;  // float64 and float32 natively, float16/bfloat16 via float32
  if (q.dtype() == kFloat64 || p.E > kCudaMaxHeadDim || p.Ev > kCudaMaxHeadDim) return false;
  if (backend == SdpBackend::kFused) return true;
  if (detail::attention_cudnn_supported(q.dtype(), q.device(), p, mask.defined())) return true;
  if (detail::attention_tf32_supported(q.dtype(), q.device(), p, mask.defined())) return true;
  const int64_t scores = p.batch * p.L * p.S;
  return scores * static_cast<int64_t>(q.element_size()) > kAttentionMathBudgetBytes;
}

// The additive mask (dtype `dt`) broadcast to [..., L, S], and where its elements live.
Tensor mask_layout(const Tensor& attn_mask, const Tensor& q, Dtype dt, int64_t L, int64_t S,
                   detail::AttentionMaskLayout* layout) {
  const int64_t n = q.dim();
  std::vector<int64_t> full(q.shape().begin(), q.shape().end() - 2);
  full.push_back(L);
  full.push_back(S);
  bool ok = attn_mask.dim() <= n;
  for (int64_t d = 1; ok && d <= attn_mask.dim(); ++d) {
    const int64_t m = attn_mask.size(attn_mask.dim() - d);
    ok = m == 1 || m == full[n - d];
  }
  EMBER_CHECK(ok, "[", kOp, "] attn_mask of shape ", attn_mask.shape(),
              " does not broadcast to the scores' shape ", Shape(full));
  Tensor m = attn_mask.dtype() == kBool
                 ? where(attn_mask, zeros({}, TensorOptions(dt).device(q.device())), -INFINITY)
                 : attn_mask.to(dt);
  m = m.expand(full);
  if (n - 2 > detail::kAttentionMaxLead) {
    m = m.contiguous().view({-1, L, S});
  }
  const int64_t lead = m.dim() - 2;
  layout->nlead = static_cast<int>(lead);
  for (int64_t d = 0; d < lead; ++d) {
    layout->size[d] = m.size(d);
    layout->stride[d] = m.strides()[d];
  }
  layout->row_stride = m.strides()[lead];
  layout->col_stride = m.strides()[lead + 1];
  return m;
}

}  // namespace

void set_sdp_backend(SdpBackend b) { g_backend.store(b, std::memory_order_relaxed); }
SdpBackend sdp_backend() { return g_backend.load(std::memory_order_relaxed); }
void enable_cudnn_sdp(bool enabled) { g_cudnn.store(enabled, std::memory_order_relaxed); }
bool cudnn_sdp_enabled() { return g_cudnn.load(std::memory_order_relaxed); }

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& attn_mask, double dropout_p, bool is_causal,
                                    std::optional<double> scale, Generator* gen) {
  // Under autocast attention runs in the low precision, as matmul does (PyTorch's policy).
  if (auto ac = detail::autocast_inputs(AutocastPolicy::kLowPrecision, q, k, v, attn_mask)) {
    return scaled_dot_product_attention(ac[0], ac[1], ac[2], ac[3], dropout_p, is_causal, scale,
                                        gen);
  }
  check_inputs(q, k, v, attn_mask, dropout_p, is_causal);
  FusedCall c = fused_call(q, k, v, is_causal, scale);
  detail::AttentionParams& p = c.p;
  p.dropout_p = dropout_p;
  if (!fused_applies(q, k, v, attn_mask, p)) {
    return scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal, scale, gen);
  }
  // The casts to c.dt are recorded ops, so the gradients come back in the inputs' dtype.
  Tensor mask;
  if (attn_mask.defined()) {
    mask = mask_layout(attn_mask, q, c.dt, p.L, p.S, &p.mask);
    p.bool_mask = attn_mask.dtype() == kBool;
  }
  if (dropout_p > 0.0) {
    const detail::PhiloxArgs d =
        detail::philox_draw(gen != nullptr ? *gen : default_generator(),
                            detail::attention_dropout_counters(p), q.device());
    p.seed = d.seed;
    p.offset = d.offset;
    p.philox_replay = d.replay;
  }
  const Tensor out =
      fused_attention(c.operand(q, p.L), c.operand(k, p.S), c.operand(v, p.S), mask, p);
  std::vector<int64_t> shape(q.shape().begin(), q.shape().end() - 1);
  shape.push_back(p.Ev);
  return FusedCall::shaped(out, Shape(shape)).to(q.dtype());
}

namespace {

// The parts' shared set-up: validation, the kernels' call and their lse dtype.
struct Parts : FusedCall {
  Dtype lse_dt = kFloat32;
  std::vector<int64_t> lead;  // q's leading dims
  std::vector<int64_t> shape(int64_t rows, int64_t cols) const {
    std::vector<int64_t> s = lead;
    s.push_back(rows);
    if (cols >= 0) s.push_back(cols);
    return s;
  }
};

Parts parts_of(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, bool is_causal,
               std::optional<double> scale) {
  check_inputs(q, k, v, Tensor(), 0.0, is_causal, op);
  Parts s;
  static_cast<FusedCall&>(s) = fused_call(q, k, v, is_causal, scale);
  s.lead.assign(q.shape().begin(), q.shape().end() - 2);
  EMBER_CHECK_TYPE(NotImplementedError, q.numel() > 0 && k.numel() > 0 && v.numel() > 0, "[", op,
                   "] expected non-empty operands, got query ", q.shape(), ", key ", k.shape(),
                   ", value ", v.shape());
  if (q.is_cuda()) {
    EMBER_CHECK_TYPE(NotImplementedError,
                     q.dtype() != kFloat64 && s.p.E <= kCudaMaxHeadDim && s.p.Ev <= kCudaMaxHeadDim,
                     "[", op, "] has no CUDA kernel for ", q.dtype(), " or head dims past ",
                     kCudaMaxHeadDim, ", got query ", q.shape(), ", value ", v.shape());
  }
  s.lse_dt = q.is_cuda() ? kFloat32 : s.dt;
  return s;
}

}  // namespace

AttentionForward scaled_dot_product_attention_forward(const Tensor& q, const Tensor& k,
                                                      const Tensor& v, bool is_causal,
                                                      std::optional<double> scale) {
  const Parts s = parts_of("scaled_dot_product_attention_forward", q, k, v, is_causal, scale);
  const detail::AttentionParams& p = s.p;
  const Tensor q3 = s.operand(q, p.L);
  Tensor out = detail::attention_empty_like(q3, p.Ev, s.dt);
  Tensor lse = detail::make_empty({p.batch, p.L}, s.lse_dt, q.device());
  (q.is_cuda() ? detail::attention_forward_cuda : detail::attention_forward_cpu)(
      out, lse, q3, s.operand(k, p.S), s.operand(v, p.S), Tensor(), p);
  return {FusedCall::shaped(out, Shape(s.shape(p.L, p.Ev))), lse.view(s.shape(p.L, -1))};
}

AttentionGrads scaled_dot_product_attention_backward(const Tensor& dout, const Tensor& q,
                                                     const Tensor& k, const Tensor& v,
                                                     const Tensor& out, const Tensor& lse,
                                                     bool is_causal, std::optional<double> scale) {
  constexpr const char* op = "scaled_dot_product_attention_backward";
  const Parts s = parts_of(op, q, k, v, is_causal, scale);
  const detail::AttentionParams& p = s.p;
  const Shape out_shape(s.shape(p.L, p.Ev)), lse_shape(s.shape(p.L, -1));
  for (const auto& [t, name, want] :
       {std::tuple{&dout, "dout", &out_shape}, std::tuple{&out, "out", &out_shape},
        std::tuple{&lse, "lse", &lse_shape}}) {
    detail::check_defined(op, *t, name);
    EMBER_CHECK(t->shape() == *want && t->device() == q.device(), "[", op, "] expected ", name,
                " of shape ", *want, " on ", q.device(), ", got ", t->shape(), " on ", t->device());
  }
  const Tensor q3 = s.operand(q, p.L), k3 = s.operand(k, p.S), v3 = s.operand(v, p.S);
  auto grad_like = [&](const Tensor& t) {
    return detail::attention_empty_like(t, t.size(t.dim() - 1), s.dt);
  };
  Tensor dq = grad_like(q3), dk = grad_like(k3), dv = grad_like(v3);
  (q.is_cuda() ? detail::attention_backward_cuda : detail::attention_backward_cpu)(
      dq, dk, dv, s.operand(dout, p.L), q3, k3, v3, s.operand(out, p.L),
      lse.to(s.lse_dt).contiguous().view({p.batch, p.L}), Tensor(), p);
  return {FusedCall::shaped(dq, q.shape()).to(q.dtype()),
          FusedCall::shaped(dk, k.shape()).to(k.dtype()),
          FusedCall::shaped(dv, v.shape()).to(v.dtype())};
}

namespace detail {

bool attention_rows_ok(const Tensor& t) {
  const int64_t n = t.dim();
  return n >= 2 && n - 2 <= kAttentionMaxLead && t.stride(n - 1) == 1 &&
         t.stride(n - 2) >= t.size(n - 1);
}

bool attention_reads_as_is(const Tensor& t) { return !t.is_cuda() && attention_rows_ok(t); }

AttentionRows attention_rows(const Tensor& t) {
  EMBER_INTERNAL_ASSERT(attention_rows_ok(t), "attention_rows: no row layout for shape ",
                        t.shape(), ", strides ", t.strides());
  const int64_t n = t.dim();
  AttentionRows r;
  r.lead.nlead = static_cast<int>(n - 2);
  for (int64_t d = 0; d < n - 2; ++d) {
    r.lead.size[d] = t.size(d);
    r.lead.stride[d] = t.stride(d);
  }
  r.row_stride = t.stride(n - 2);
  return r;
}

Tensor attention_empty_like(const Tensor& like, int64_t last, Dtype dtype) {
  const int64_t n = like.dim();
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t d = 0; d < n; ++d) order[static_cast<size_t>(d)] = d;
  // Outermost first; the last dim stays innermost, and ties (size-1 dims) keep their order.
  std::stable_sort(order.begin(), order.end() - 1,
                   [&](int64_t a, int64_t b) { return like.stride(a) > like.stride(b); });
  std::vector<int64_t> sizes, inverse(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t d = order[static_cast<size_t>(i)];
    sizes.push_back(d == n - 1 ? last : like.size(d));
    inverse[static_cast<size_t>(d)] = i;
  }
  return make_empty(Shape(sizes), dtype, like.device()).permute(Shape(inverse));
}

}  // namespace detail

}  // namespace ember
