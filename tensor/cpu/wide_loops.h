// Element-wise kernels with a run-time choice of vector ISA (internal to tensor/cpu/; see
// wide_loops.cpp for which ops and why).
#pragma once

#include <ember/tensor/detail/elementwise_kernels.h>
#include <ember/tensor/tensor.h>

namespace ember::detail::cpu_ew {

/// Runs op when it has a wide-vector loop and every operand is dense float32 or bfloat16 (one
/// dtype) of out's element count; returns false, having done nothing, otherwise.
bool unary_wide(UnaryOp op, const Tensor& out, const Tensor& in);
bool binary_wide(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b);

}  // namespace ember::detail::cpu_ew
