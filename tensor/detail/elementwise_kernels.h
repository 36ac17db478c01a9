// Backend kernels behind tensor/ops/elementwise.h (internal). The front end (elementwise.cpp) has
// already validated everything: operands are on the kernel's device, `out` has the broadcast
// shape of the inputs, the inputs have the compute dtype, and `out` has the compute dtype (or
// bool for comparisons, logical ops and logical_not). Inputs may be any strided or broadcast
// views of out's shape (fewer leading dims, size-1 dims). CUDA kernels are queued on the current
// stream of out's device.
#pragma once

#include <cstdint>
#include <optional>

#include <ember/tensor/detail/binary_ops.h>
#include <ember/tensor/detail/unary_ops.h>
#include <ember/tensor/tensor.h>

namespace ember::detail {

/// True for ops whose output is bool whatever the compute dtype.
constexpr bool is_bool_result(BinaryOp op) { return op >= BinaryOp::Eq; }

/// The comparison with its operands swapped (Lt <-> Gt, Le <-> Ge; the rest are symmetric).
constexpr BinaryOp mirrored(BinaryOp op) {
  switch (op) {
    case BinaryOp::Lt: return BinaryOp::Gt;
    case BinaryOp::Le: return BinaryOp::Ge;
    case BinaryOp::Gt: return BinaryOp::Lt;
    case BinaryOp::Ge: return BinaryOp::Le;
    default: return op;
  }
}

/// out = op(in).
void unary_cpu(UnaryOp op, const Tensor& out, const Tensor& in);
void unary_cuda(UnaryOp op, const Tensor& out, const Tensor& in);

/// out = op(a, b); alpha is used by Add and Sub only.
void binary_cpu(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b,
                const Scalar& alpha);
void binary_cuda(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b,
                 const Scalar& alpha);

/// out = op(a, s), or op(s, a) when reverse. s is converted to the compute type of a's dtype
/// (float for 16-bit floats). Supported ops: those with a scalar form in EMBER_BINARY_OPS, and
/// the comparisons.
void binary_scalar_cpu(BinaryOp op, const Tensor& out, const Tensor& a, const Scalar& s,
                       bool reverse);
void binary_scalar_cuda(BinaryOp op, const Tensor& out, const Tensor& a, const Scalar& s,
                        bool reverse);

/// out = cond ? a : b; cond is bool, a, b and out share one dtype.
void where_cpu(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b);
void where_cuda(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b);

/// out = clamp(in, lo, hi); at least one bound is present.
void clamp_cpu(const Tensor& out, const Tensor& in, const std::optional<Scalar>& lo,
               const std::optional<Scalar>& hi);
void clamp_cuda(const Tensor& out, const Tensor& in, const std::optional<Scalar>& lo,
                const std::optional<Scalar>& hi);

}  // namespace ember::detail
