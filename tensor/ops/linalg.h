// Matrix products: OpenBLAS on the CPU, cuBLAS on CUDA (float32 and float64; float16 and
// bfloat16 on CUDA).
#pragma once

#include <ember/tensor/tensor.h>

namespace ember {

/// torch.matmul semantics: 1-d x 1-d dot, 2-d x 2-d mm, batched with broadcasting over the
/// leading dims, 1-d operands promoted and the added dim removed.
Tensor matmul(const Tensor& a, const Tensor& b);
/// [n, k] x [k, m] -> [n, m]
Tensor mm(const Tensor& a, const Tensor& b);
/// [B, n, k] x [B, k, m] -> [B, n, m]
Tensor bmm(const Tensor& a, const Tensor& b);
/// beta * bias + alpha * (a @ b); bias broadcasts to [n, m].
Tensor addmm(const Tensor& bias, const Tensor& a, const Tensor& b, const Scalar& beta = 1,
             const Scalar& alpha = 1);
/// out = a @ b written into an existing [n, m] tensor.
Tensor& mm_out(Tensor& out, const Tensor& a, const Tensor& b);

}  // namespace ember
