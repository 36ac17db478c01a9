// Front end of the matrix products: validation, torch.matmul's shape rules, broadcasting of
// batch dims and 1-d promotion, then one batched GEMM kernel per device (detail::gemm_*).
#include <ember/tensor/ops/linalg.h>

#include <atomic>

#include <ember/tensor/autocast.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/detail/linalg_kernels.h>
#include <ember/tensor/detail/record.h>

namespace ember {

namespace {
std::atomic<bool> g_allow_tf32{false};
}  // namespace

void cuda::set_matmul_allow_tf32(bool allow) {
  g_allow_tf32.store(allow, std::memory_order_relaxed);
}
bool cuda::matmul_allow_tf32() { return g_allow_tf32.load(std::memory_order_relaxed); }

namespace {

void check_pair(const char* op, const Tensor& a, const Tensor& b) {
  detail::check_defined(op, a, "a");
  detail::check_defined(op, b, "b");
  EMBER_CHECK(a.device() == b.device(), "[", op,
              "] expected a and b on the same device, got a on ", a.device(), " and b on ",
              b.device());
  EMBER_CHECK_TYPE(TypeError, a.dtype() == b.dtype(), "[", op,
                   "] expected a and b to have the same dtype, got ", a.dtype(), " and ",
                   b.dtype());
  EMBER_CHECK_TYPE(TypeError, is_floating(a.dtype()), "[", op,
                   "] expected a floating dtype (float32, float64, float16 or bfloat16), got ",
                   a.dtype());
}

void run_gemm(const Tensor& out, const Tensor& a, const Tensor& b, double alpha, double beta) {
  if (out.is_cuda()) {
    detail::gemm_cuda(out, a, b, alpha, beta);
  } else {
    detail::gemm_cpu(out, a, b, alpha, beta);
  }
}

// out = a @ b by one GEMM, recorded when a or b requires grad: Mm for 2-d operands, Bmm for
// batched ones (equal batch dims; matmul passes broadcast operands as expanded views). matmul
// records its reshapes, unsqueezes and expands as views around this, so its gradient composes.
Tensor gemm_recorded(Tensor out, const Tensor& a, const Tensor& b) {
  run_gemm(out, a, b, 1.0, 0.0);
  if (detail::should_record(a, b)) {
    detail::record(a.dim() == 2 ? OpId::Mm : OpId::Bmm, {&a, &b}, {&out});
  }
  return out;
}

void check_mm_shapes(const char* op, const Tensor& a, const Tensor& b) {
  EMBER_CHECK(a.dim() == 2 && b.dim() == 2, "[", op, "] expected 2-d tensors, got a of shape ",
              a.shape(), " and b of shape ", b.shape());
  EMBER_CHECK(a.size(1) == b.size(0), "[", op, "] last dim of a (shape ", a.shape(),
              ") must equal first dim of b (shape ", b.shape(), ")");
}

// True when dims [0, ndim - 1) of t can be merged into one (so t.reshape(-1, t.size(-1)) is a
// view): matmul then folds a batched @ 2-d product into one big GEMM.
bool leading_dims_merge(const Tensor& t) {
  int64_t prev = -1;  // the last dim of size > 1 seen so far
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    if (t.size(d) == 0) return true;
    if (t.size(d) == 1) continue;
    if (prev >= 0 && t.stride(prev) != t.stride(d) * t.size(d)) return false;
    prev = d;
  }
  return true;
}

}  // namespace

Tensor mm(const Tensor& a, const Tensor& b) {
  if (auto ac = detail::autocast_inputs(AutocastPolicy::kLowPrecision, a, b)) return mm(ac[0], ac[1]);
  check_pair("mm", a, b);
  check_mm_shapes("mm", a, b);
  return gemm_recorded(detail::make_empty({a.size(0), b.size(1)}, a.dtype(), a.device()), a, b);
}

Tensor bmm(const Tensor& a, const Tensor& b) {
  if (auto ac = detail::autocast_inputs(AutocastPolicy::kLowPrecision, a, b)) return bmm(ac[0], ac[1]);
  check_pair("bmm", a, b);
  EMBER_CHECK(a.dim() == 3 && b.dim() == 3, "[bmm] expected 3-d tensors, got a of shape ",
              a.shape(), " and b of shape ", b.shape());
  EMBER_CHECK(a.size(0) == b.size(0), "[bmm] expected a and b to have the same batch size, got ",
              "a of shape ", a.shape(), " and b of shape ", b.shape());
  EMBER_CHECK(a.size(2) == b.size(1), "[bmm] last dim of a (shape ", a.shape(),
              ") must equal dim 1 of b (shape ", b.shape(), ")");
  Tensor out = detail::make_empty({a.size(0), a.size(1), b.size(2)}, a.dtype(), a.device());
  return gemm_recorded(std::move(out), a, b);
}

Tensor matmul(const Tensor& a, const Tensor& b) {
  if (auto ac = detail::autocast_inputs(AutocastPolicy::kLowPrecision, a, b)) return matmul(ac[0], ac[1]);
  check_pair("matmul", a, b);
  const int64_t da = a.dim(), db = b.dim();
  EMBER_CHECK(da >= 1 && db >= 1,
              "[matmul] both arguments need to be at least 1-d, got a of shape ", a.shape(),
              " (", da, "-d) and b of shape ", b.shape(), " (", db, "-d)");
  // The contracted dim: a's last; b's only (1-d) or second-to-last.
  const int64_t k_a = a.size(-1);
  const int64_t k_b = db == 1 ? b.size(0) : b.size(-2);
  EMBER_CHECK(k_a == k_b, "[matmul] last dim of a (shape ", a.shape(), ") must equal ",
              db == 1 ? "the size" : "the second-to-last dim", " of b (shape ", b.shape(), ")");

  if (da <= 2 && db <= 2) {
    Tensor a2 = da == 1 ? a.unsqueeze(0) : a;
    Tensor b2 = db == 1 ? b.unsqueeze(1) : b;
    Tensor out =
        gemm_recorded(detail::make_empty({a2.size(0), b2.size(1)}, a.dtype(), a.device()), a2, b2);
    if (da == 1 && db == 1) return out.view({});
    if (da == 1) return out.view({b2.size(1)});
    if (db == 1) return out.view({a2.size(0)});
    return out;
  }

  // Batched @ matrix or vector where a's leading dims fold into rows: one big GEMM.
  if (db <= 2 && leading_dims_merge(a)) {
    Tensor b2 = db == 1 ? b.unsqueeze(1) : b;
    int64_t rows = 1;
    for (int64_t d = 0; d + 1 < da; ++d) rows *= a.size(d);
    Tensor a2 = a.reshape({rows, k_a});
    Tensor out =
        gemm_recorded(detail::make_empty({a2.size(0), b2.size(1)}, a.dtype(), a.device()), a2, b2);
    Shape shape(a.shape());
    if (db == 1) {
      shape.pop_back();
    } else {
      shape.back() = b2.size(1);
    }
    return out.view(shape);
  }

  // General case: promote 1-d operands, broadcast the batch dims, batched GEMM over views
  // (expanded operands keep zero strides; the kernel reads them without copying).
  Tensor a2 = da == 1 ? a.unsqueeze(0) : a;
  Tensor b2 = db == 1 ? b.unsqueeze(1) : b;
  const int64_t n = a2.size(-2), m = b2.size(-1);
  Shape batch_a(a2.shape()), batch_b(b2.shape());
  batch_a.resize(a2.dim() - 2);
  batch_b.resize(b2.dim() - 2);
  Shape batch;
  try {
    batch = broadcast_shapes("matmul", batch_a, batch_b);
  } catch (const ValueError&) {
    throw ValueError(detail::str_cat("[matmul] the batch dims of a (shape ", a.shape(),
                                     ") and b (shape ", b.shape(), ") cannot be broadcast: ",
                                     batch_a, " vs ", batch_b));
  }
  Shape sa(batch), sb(batch), so(batch);
  sa.push_back(n);
  sa.push_back(k_a);
  sb.push_back(k_a);
  sb.push_back(m);
  so.push_back(n);
  so.push_back(m);
  Tensor out =
      gemm_recorded(detail::make_empty(so, a.dtype(), a.device()), a2.expand(sa), b2.expand(sb));
  if (da == 1 || db == 1) {
    Shape shape(batch);
    if (da != 1) shape.push_back(n);
    if (db != 1) shape.push_back(m);
    return out.view(shape);
  }
  return out;
}

Tensor addmm(const Tensor& bias, const Tensor& a, const Tensor& b, const Scalar& beta,
             const Scalar& alpha) {
  if (auto ac = detail::autocast_inputs(AutocastPolicy::kLowPrecision, bias, a, b)) {
    return addmm(ac[0], ac[1], ac[2], beta, alpha);
  }
  check_pair("addmm", a, b);
  check_mm_shapes("addmm", a, b);
  detail::check_defined("addmm", bias, "bias");
  EMBER_CHECK(bias.device() == a.device(), "[addmm] expected bias on the same device as a, got ",
              "bias on ", bias.device(), " and a on ", a.device());
  EMBER_CHECK_TYPE(TypeError, bias.dtype() == a.dtype(),
                   "[addmm] expected bias to have the dtype of a and b (", a.dtype(), "), got ",
                   bias.dtype());
  const int64_t n = a.size(0), m = b.size(1);
  bool fits = bias.dim() <= 2;
  for (int64_t i = 0; fits && i < bias.dim(); ++i) {
    const int64_t want = i == bias.dim() - 1 ? m : n;
    fits = bias.size(i) == 1 || bias.size(i) == want;
  }
  EMBER_CHECK(fits, "[addmm] bias of shape ", bias.shape(), " does not broadcast to the output ",
              "shape [", n, ", ", m, "]");
  Tensor out = detail::make_empty({n, m}, a.dtype(), a.device());
  const double be = beta.to_double(), al = alpha.to_double();
  // A Linear layer's bias on a GPU: added by the GEMM's epilogue (tensor/cuda/blas_lt.cpp).
  const bool fused = out.is_cuda() && be == 1.0 && al == 1.0 && bias.dim() == 1 &&
                     bias.size(0) == m && detail::gemm_bias_cuda(out, a, b, bias);
  if (!fused) {
    if (be != 0.0) {
      NoGradGuard no_grad;  // the copy is part of addmm's own node
      out.copy_(bias.expand({n, m}));
    }
    run_gemm(out, a, b, al, be);
  }
  if (detail::should_record(bias, a, b)) {
    detail::record<OpId::Addmm>({&bias, &a, &b}, {&out}, {.alpha = alpha, .beta = beta});
  }
  return out;
}

Tensor& mm_out(Tensor& out, const Tensor& a, const Tensor& b) {
  check_pair("mm_out", a, b);
  check_mm_shapes("mm_out", a, b);
  detail::check_defined("mm_out", out, "out");
  EMBER_CHECK(out.device() == a.device(), "[mm_out] expected out on the same device as a, got ",
              "out on ", out.device(), " and a on ", a.device());
  EMBER_CHECK_TYPE(TypeError, out.dtype() == a.dtype(), "[mm_out] expected out of dtype ",
                   a.dtype(), ", got ", out.dtype());
  const int64_t n = a.size(0), m = b.size(1);
  EMBER_CHECK(out.dim() == 2 && out.size(0) == n && out.size(1) == m,
              "[mm_out] expected out of shape [", n, ", ", m, "], got ", out.shape());
  EMBER_CHECK(!detail::should_record(a, b, out),
              "[mm_out] out= variants don't support automatic differentiation, but one of the "
              "arguments requires grad; use mm");
  const bool aliases = out.storage() == a.storage() || out.storage() == b.storage();
  if (out.is_contiguous() && !aliases) {
    run_gemm(out, a, b, 1.0, 0.0);
    out.bump_version();
  } else {
    Tensor tmp = detail::make_empty({n, m}, a.dtype(), a.device());
    run_gemm(tmp, a, b, 1.0, 0.0);
    out.copy_(tmp);
  }
  return out;
}

Tensor Tensor::matmul(const Tensor& o) const { return ember::matmul(*this, o); }

}  // namespace ember
