// Element-wise ops. Binary ops broadcast (NumPy rules) and promote types as PyTorch does:
// tensor-tensor by promote_types, tensor-scalar by promote_with_scalar; comparisons and logical
// ops return bool; ops that are only defined on reals (exp, sigmoid, true division, ...) promote
// integer inputs to float32. In-place variants (name_) write into their first argument and
// throw if the result dtype cannot be cast to it (e.g. float result into an int tensor) or its
// shape would have to grow by broadcasting. `_out` variants write into an existing tensor of
// the result's shape (resized only if empty), the way to avoid fresh allocations.
#pragma once

#include <optional>

#include <ember/tensor/tensor.h>

namespace ember {

// ---- unary ----
Tensor neg(const Tensor& t);
Tensor abs(const Tensor& t);
Tensor sign(const Tensor& t);
Tensor exp(const Tensor& t);
Tensor log(const Tensor& t);
Tensor log1p(const Tensor& t);
Tensor sqrt(const Tensor& t);
Tensor rsqrt(const Tensor& t);
Tensor reciprocal(const Tensor& t);
Tensor square(const Tensor& t);
Tensor sin(const Tensor& t);
Tensor cos(const Tensor& t);
Tensor tanh(const Tensor& t);
Tensor sigmoid(const Tensor& t);
Tensor relu(const Tensor& t);
/// approximate: "none" (erf form) or "tanh", as torch.nn.functional.gelu.
Tensor gelu(const Tensor& t, const char* approximate = "none");
Tensor silu(const Tensor& t);
/// The error function erf(x) = 2/sqrt(pi) * integral of e^(-t^2) dt from 0 to x (torch.erf);
/// integer and bool inputs compute in float32.
Tensor erf(const Tensor& t);
Tensor logical_not(const Tensor& t);

Tensor& neg_(Tensor& t);
Tensor& abs_(Tensor& t);
Tensor& exp_(Tensor& t);
Tensor& log_(Tensor& t);
Tensor& sqrt_(Tensor& t);
Tensor& rsqrt_(Tensor& t);
Tensor& tanh_(Tensor& t);
Tensor& sigmoid_(Tensor& t);
Tensor& relu_(Tensor& t);

// ---- binary arithmetic ----
/// a + alpha * b
Tensor add(const Tensor& a, const Tensor& b, const Scalar& alpha = 1);
Tensor add(const Tensor& a, const Scalar& b);
/// a - alpha * b
Tensor sub(const Tensor& a, const Tensor& b, const Scalar& alpha = 1);
Tensor sub(const Tensor& a, const Scalar& b);
Tensor rsub(const Tensor& a, const Scalar& b);  ///< b - a
Tensor mul(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Scalar& b);
/// True division: integer inputs give float32.
Tensor div(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Scalar& b);
Tensor rdiv(const Tensor& a, const Scalar& b);  ///< b / a
Tensor pow(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, const Scalar& b);
Tensor pow(const Scalar& a, const Tensor& b);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);
/// The angle of the point (b, a) in radians, in [-pi, pi]: atan(a / b) in b's and a's quadrant,
/// with C's atan2 for signed zeros and infinities (torch.atan2(input=a, other=b)). Broadcasts;
/// integer and bool operands compute in float32.
Tensor atan2(const Tensor& a, const Tensor& b);
/// relu's gradient given its output: grad where output > 0, else 0, in one pass (what autograd's
/// ReluBackward runs; torch's threshold_backward(grad, output, 0)). Floating dtypes; not recorded
/// by autograd.
Tensor relu_backward(const Tensor& grad, const Tensor& output);
/// gelu(approximate="tanh")'s gradient given its input, in one pass (what autograd's
/// GeluBackward runs when no graph of the gradient is needed). Floating dtypes; not recorded.
Tensor gelu_tanh_backward(const Tensor& grad, const Tensor& input);

Tensor& add_(Tensor& a, const Tensor& b, const Scalar& alpha = 1);
Tensor& add_(Tensor& a, const Scalar& b);
Tensor& sub_(Tensor& a, const Tensor& b, const Scalar& alpha = 1);
Tensor& sub_(Tensor& a, const Scalar& b);
Tensor& mul_(Tensor& a, const Tensor& b);
Tensor& mul_(Tensor& a, const Scalar& b);
Tensor& div_(Tensor& a, const Tensor& b);
Tensor& div_(Tensor& a, const Scalar& b);
Tensor& pow_(Tensor& a, const Scalar& b);

Tensor& add_out(Tensor& out, const Tensor& a, const Tensor& b, const Scalar& alpha = 1);
Tensor& sub_out(Tensor& out, const Tensor& a, const Tensor& b, const Scalar& alpha = 1);
Tensor& mul_out(Tensor& out, const Tensor& a, const Tensor& b);
Tensor& div_out(Tensor& out, const Tensor& a, const Tensor& b);

// ---- comparisons and logic (bool results) ----
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
Tensor eq(const Tensor& a, const Scalar& b);
Tensor ne(const Tensor& a, const Scalar& b);
Tensor lt(const Tensor& a, const Scalar& b);
Tensor le(const Tensor& a, const Scalar& b);
Tensor gt(const Tensor& a, const Scalar& b);
Tensor ge(const Tensor& a, const Scalar& b);
Tensor logical_and(const Tensor& a, const Tensor& b);
Tensor logical_or(const Tensor& a, const Tensor& b);
Tensor logical_xor(const Tensor& a, const Tensor& b);

// ---- ternary and friends ----
/// cond ? a : b, broadcasting all three; cond must be bool.
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
Tensor where(const Tensor& cond, const Tensor& a, const Scalar& b);
/// Clamps into [min, max]; either bound may be absent (not both).
Tensor clamp(const Tensor& t, std::optional<Scalar> min, std::optional<Scalar> max);
Tensor& clamp_(Tensor& t, std::optional<Scalar> min, std::optional<Scalar> max);
Tensor clamp_min(const Tensor& t, const Scalar& min);
Tensor clamp_max(const Tensor& t, const Scalar& max);
/// out = t where mask is false, value where it is true (mask broadcasts to t).
Tensor masked_fill(const Tensor& t, const Tensor& mask, const Scalar& value);

/// True if a and b have the same shape and all elements are equal.
bool equal(const Tensor& a, const Tensor& b);
/// True if |a - b| <= atol + rtol * |b| everywhere (shapes broadcast; NaNs never close).
bool allclose(const Tensor& a, const Tensor& b, double rtol = 1e-5, double atol = 1e-8);

}  // namespace ember
