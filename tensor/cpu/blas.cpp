// Batched GEMM on the CPU. Operands that are row- or column-major matrices go to BLAS as they
// are (a transposed view becomes a transpose flag, never a copy); only truly non-contiguous
// matrices are copied. float32 runs on oneDNN's sgemm, float64 on OpenBLAS, bfloat16 on oneDNN's
// matmul (cpu/matmul_dnnl.cpp: bfloat16 operands, float32 accumulation); float16 goes through
// float32 copies.
#include <cblas.h>

#include <algorithm>
#include <climits>

#include <ember/tensor/cpu/matmul_dnnl.h>
#include <ember/tensor/detail/linalg_kernels.h>

namespace ember::detail {

namespace {

CBLAS_TRANSPOSE flag(bool trans) { return trans ? CblasTrans : CblasNoTrans; }

// alpha and beta arrive in double so each overload rounds them to its own compute type.
void blas_gemm(bool ta, bool tb, int n, int m, int k, double alpha, const float* a, int lda,
               const float* b, int ldb, double beta, float* c, int ldc) {
  dnnl_gemm_f32(ta, tb, n, m, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
void blas_gemm(bool ta, bool tb, int n, int m, int k, double alpha, const double* a, int lda,
               const double* b, int ldb, double beta, double* c, int ldc) {
  cblas_dgemm(CblasRowMajor, flag(ta), flag(tb), n, m, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
void blas_gemm(bool ta, bool tb, int n, int m, int k, double alpha, const BFloat16* a, int lda,
               const BFloat16* b, int ldb, double beta, BFloat16* c, int ldc) {
  dnnl_gemm_bf16(ta, tb, n, m, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// The BLAS layout of t's last two dims, copying t when it has none.
BlasLayout layout_or_copy(Tensor& t) {
  const int64_t nd = t.dim();
  BlasLayout l = blas_layout(t.size(nd - 2), t.size(nd - 1), t.stride(nd - 2), t.stride(nd - 1));
  if (l.ok) return l;
  t = t.contiguous();
  l = blas_layout(t.size(nd - 2), t.size(nd - 1), t.stride(nd - 2), t.stride(nd - 1));
  EMBER_INTERNAL_ASSERT(l.ok, "a contiguous matrix must have a BLAS layout");
  return l;
}

template <typename T>
void gemm_typed(const Tensor& out, Tensor a, Tensor b, double alpha, double beta) {
  const int64_t nd = out.dim();
  const int64_t n = out.size(nd - 2), m = out.size(nd - 1), k = a.size(nd - 1);
  T* c = out.data<T>();
  const int64_t total = out.numel();
  if (k == 0) {  // an empty sum: out = beta * out
    if (beta == 0.0) {
      std::fill_n(c, total, T{});
    } else if (beta != 1.0) {
      for (int64_t i = 0; i < total; ++i) c[i] = static_cast<T>(c[i] * beta);
    }
    return;
  }
  const BlasLayout la = layout_or_copy(a);
  const BlasLayout lb = layout_or_copy(b);
  EMBER_CHECK(n < INT_MAX && m < INT_MAX && k < INT_MAX && la.ld < INT_MAX && lb.ld < INT_MAX,
              "[matmul] matrix dims must be below 2^31 for BLAS, got a of shape ", a.shape(),
              " and b of shape ", b.shape());
  const T* pa = a.data<T>();
  const T* pb = b.data<T>();
  const int64_t batches = total / (n * m);
  const int nb = static_cast<int>(nd - 2);
  int64_t idx[kMaxDims] = {};
  int64_t off_a = 0, off_b = 0;
  for (int64_t i = 0; i < batches; ++i) {
    blas_gemm(la.trans, lb.trans, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k),
              alpha, pa + off_a, static_cast<int>(la.ld), pb + off_b, static_cast<int>(lb.ld), beta,
              c + i * n * m, static_cast<int>(m));
    // Advance the batch multi-index like an odometer, tracking a's and b's offsets.
    for (int d = nb - 1; d >= 0; --d) {
      off_a += a.stride(d);
      off_b += b.stride(d);
      if (++idx[d] < out.size(d)) break;
      off_a -= a.stride(d) * idx[d];
      off_b -= b.stride(d) * idx[d];
      idx[d] = 0;
    }
  }
}

}  // namespace

void gemm_cpu(const Tensor& out, const Tensor& a, const Tensor& b, double alpha, double beta) {
  if (out.numel() == 0) return;
  if (out.dtype() == kBFloat16) {
    gemm_typed<BFloat16>(out, a, b, alpha, beta);
    return;
  }
  if (out.dtype() == kFloat16) {
    Tensor a32 = a.to(kFloat32), b32 = b.to(kFloat32);
    Tensor o32 =
        beta != 0.0 ? out.to(kFloat32, /*copy=*/true) : make_empty(out.shape(), kFloat32, kCPU);
    gemm_cpu(o32, a32, b32, alpha, beta);
    Tensor(out).copy_(o32);
    return;
  }
  EMBER_DISPATCH_F32_F64(out.dtype(), "matmul",
                         [&]<typename T>() { gemm_typed<T>(out, a, b, alpha, beta); });
}

}  // namespace ember::detail
