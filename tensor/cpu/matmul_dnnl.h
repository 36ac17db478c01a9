// bfloat16 matrix products on oneDNN's matmul primitive (internal to tensor/cpu/blas.cpp).
#pragma once

#include <ember/tensor/half.h>

namespace ember::detail {

/// c = alpha * op(a) @ op(b) + beta * c for one row-major matrix product with BLAS-style
/// arguments (op transposes when ta/tb; leading dims in elements): bfloat16 operands and
/// result, float32 accumulation, the result rounded to bfloat16 once. Primitives are cached per
/// shape (Note [oneDNN primitive cache] in conv_dnnl.cpp). Throws Error if oneDNN fails.
void dnnl_gemm_bf16(bool ta, bool tb, int64_t n, int64_t m, int64_t k, double alpha,
                    const BFloat16* a, int64_t lda, const BFloat16* b, int64_t ldb, double beta,
                    BFloat16* c, int64_t ldc);

}  // namespace ember::detail
