// Matrix products on oneDNN (internal to tensor/cpu/blas.cpp and tensor/cpu/attention.cpp):
// bfloat16 on its matmul primitive, float32 on its sgemm.
#pragma once

#include <ember/tensor/half.h>

namespace ember::detail {

/// c = alpha * op(a) @ op(b) + beta * c for one row-major matrix product with BLAS-style
/// arguments (op transposes when ta/tb; leading dims in elements): bfloat16 operands and
/// result, float32 accumulation, the result rounded to bfloat16 once. Primitives are cached per
/// shape (Note [oneDNN primitive cache] in conv_dnnl.cpp); where oneDNN has no bfloat16 matmul
/// for the CPU, through float32 copies and its sgemm. Throws Error if oneDNN fails.
void dnnl_gemm_bf16(bool ta, bool tb, int64_t n, int64_t m, int64_t k, double alpha,
                    const BFloat16* a, int64_t lda, const BFloat16* b, int64_t ldb, double beta,
                    BFloat16* c, int64_t ldc);

/// Test hook: with `on`, every bfloat16 product takes the float32 path that a CPU without
/// oneDNN's bfloat16 matmul (no AVX-512) takes, so that a machine with AVX-512 tests it too.
void force_bf16_gemm_through_f32(bool on);

/// The same for float32 on oneDNN's sgemm, whose kernels are generated at run time for the
/// CPU's widest vector ISA. OpenBLAS as Debian ships it (0.3.21) picks its kernels by CPU
/// model and falls back to its Haswell (AVX2) kernels on CPUs it does not know, such as newer
/// AMD EPYCs with AVX-512; oneDNN dispatches on the ISA bits instead. Threads: Ember's count,
/// one inside a parallel region. Throws Error if oneDNN fails.
void dnnl_gemm_f32(bool ta, bool tb, int64_t n, int64_t m, int64_t k, double alpha, const float* a,
                   int64_t lda, const float* b, int64_t ldb, double beta, float* c, int64_t ldc);

}  // namespace ember::detail
