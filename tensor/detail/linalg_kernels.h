// Backend kernels behind tensor/ops/linalg.h (internal). The front end (tensor/ops/linalg.cpp)
// validates, broadcasts and allocates; these only multiply.
#pragma once

#include <ember/tensor/tensor.h>

namespace ember::detail {

/// out[i] = alpha * a[i] @ b[i] + beta * out[i] for every batch index i.
///
/// a: [..., n, k], b: [..., k, m], out: [..., n, m], all with the same number of dims (>= 2)
/// and the same batch sizes; a and b may be any strided views (zero batch strides from expand
/// included): an operand whose last two dims form a row- or column-major matrix goes to BLAS
/// as is (with a transpose flag), anything else is copied. out is contiguous and does not
/// overlap a or b. One floating dtype on all three, one device. beta == 0 ignores out's
/// previous contents (NaNs included), as BLAS does.
void gemm_cpu(const Tensor& out, const Tensor& a, const Tensor& b, double alpha, double beta);
/// Same on CUDA with cuBLAS, queued on the current stream of out's device.
void gemm_cuda(const Tensor& out, const Tensor& a, const Tensor& b, double alpha, double beta);

/// out = a @ b + bias on CUDA with the bias added by cuBLASLt's epilogue (a, b 2-d, out [n, m]
/// contiguous, bias [m] contiguous; float32, float16 or bfloat16). Returns false, having written
/// nothing, when it cannot (another dtype or layout, no cuBLASLt algorithm): the caller then
/// takes the general path.
bool gemm_bias_cuda(const Tensor& out, const Tensor& a, const Tensor& b, const Tensor& bias);

/// How a strided [rows, cols] matrix can be handed to a row-major BLAS call: as is
/// (trans = false, element (i, j) at i * ld + j) or transposed (trans = true, element (i, j)
/// at j * ld + i). ok is false when neither describes it (the caller copies it).
struct BlasLayout {
  bool ok = false;
  bool trans = false;
  int64_t ld = 1;
};

inline BlasLayout blas_layout(int64_t rows, int64_t cols, int64_t row_stride,
                              int64_t col_stride) {
  const int64_t min_row_ld = cols > 1 ? cols : 1;
  const int64_t min_col_ld = rows > 1 ? rows : 1;
  if ((col_stride == 1 || cols <= 1) && (rows <= 1 || row_stride >= min_row_ld)) {
    return {true, false, rows <= 1 ? min_row_ld : row_stride};
  }
  if ((row_stride == 1 || rows <= 1) && (cols <= 1 || col_stride >= min_col_ld)) {
    return {true, true, cols <= 1 ? min_col_ld : col_stride};
  }
  return {};
}

}  // namespace ember::detail
