// Front end of the element-wise ops: validation, broadcasting, type promotion, output
// allocation, and dispatch to the CPU or CUDA kernels (tensor/detail/elementwise_kernels.h).
//
// The common case (same dtypes, same device, same shapes) must stay cheap: tiny-tensor ops are
// dominated by this code, not by the kernels. So operands are passed by reference and only
// copied (converted) when their dtype or device differs from the compute one, no strings are
// built unless an error is thrown, and the only heap allocations are the output's.
#include <ember/tensor/ops/elementwise.h>

#include <cmath>
#include <cstring>

#include <ember/tensor/autocast.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/detail/elementwise_kernels.h>
#include <ember/tensor/detail/overlap.h>
#include <ember/tensor/detail/record.h>

namespace ember {

using detail::BinaryOp;
using detail::check_defined;
using detail::check_no_partial_overlap;
using detail::check_writable;
using detail::Domain;
using detail::make_empty;
using detail::UnaryOp;

namespace {

// ---- dtype rules ------------------------------------------------------------------------------

/// PyTorch's canCast: no floating -> integral and no non-bool -> bool.
constexpr bool can_cast(Dtype from, Dtype to) {
  if (is_floating(from) && !is_floating(to)) return false;
  if (from != kBool && to == kBool) return false;
  return true;
}

void check_cast(const char* name, Dtype result, Dtype out) {
  EMBER_CHECK_TYPE(TypeError, can_cast(result, out), "[", name, "] result type ", result,
                   " can't be cast to the desired output type ", out);
}

// Note [Dimension-aware promotion]
// torch.result_type ranks operands in three classes: tensors with dims, 0-dim tensors and
// Python scalars. The dtype comes from the highest class present; a lower class only matters
// when it is of a higher *category* (bool < integral < floating), and then it joins the
// promotion. So float16[N] + float32[] is float16 (same category), int32[N] + float64[] is
// float64, and bool[N] + uint8[] is uint8. Scalars are handled by promote_with_scalar.
Dtype result_type(const Tensor& a, const Tensor& b) {
  const Dtype x = a.dtype(), y = b.dtype();
  if (x == y) return x;
  const bool x0 = a.dim() == 0, y0 = b.dim() == 0;
  if (x0 == y0) return promote_types(x, y);
  const Dtype hi = x0 ? y : x, lo = x0 ? x : y;
  if (is_floating(hi)) return hi;
  if (hi == kBool || is_floating(lo)) return promote_types(hi, lo);
  return hi;
}

/// The dtype a binary op computes in, given the promoted dtype of its inputs: the ops of the
/// binary table by their row's domain, the rest in the promoted dtype.
Dtype compute_dtype(const char* name, BinaryOp op, Dtype promoted) {
  if (!detail::is_table_op(op)) return promoted;
  switch (detail::domain_of(op)) {
    case Domain::Real:
      return is_floating(promoted) ? promoted : kDefaultFloat;
    case Domain::Numeric:
      EMBER_CHECK_TYPE(TypeError, op != BinaryOp::Sub || promoted != kBool, "[", name,
                       "] subtraction of bool operands is not supported (both are bool); use "
                       "logical_xor() instead");
      EMBER_CHECK_TYPE(TypeError, promoted != kBool, "[", name,
                       "] is not supported for bool operands (promoted dtype bool)");
      return promoted;
    case Domain::Any:
      return promoted;
  }
  return promoted;
}

constexpr Dtype output_dtype(BinaryOp op, Dtype compute) {
  return detail::is_bool_result(op) ? kBool : compute;
}

void check_alpha(const char* name, Dtype compute, const Scalar& alpha) {
  if (alpha.kind() == ScalarKind::Integral) return;
  if (alpha.is_floating()) {
    EMBER_CHECK_TYPE(TypeError, is_floating(compute), "[", name,
                     "] for integral input tensors, argument alpha must not be a floating point "
                     "number; got alpha=", alpha, " with result dtype ", compute);
  } else {
    EMBER_CHECK_TYPE(TypeError, compute == kBool, "[", name,
                     "] boolean alpha is only supported for bool results; got alpha=", alpha,
                     " with result dtype ", compute);
  }
}

// ---- devices, shapes, operands ----------------------------------------------------------------

[[noreturn]] void throw_devices(const char* name, const char* an, Device da, const char* bn,
                                Device db) {
  throw ValueError(detail::str_cat("[", name, "] expected all tensors on the same device, got ",
                                   an, " on ", da, " and ", bn, " on ", db));
}

/// The device an op on a and b runs on. As in PyTorch, a 0-dim CPU tensor may join an op on a
/// CUDA device (it is copied there).
Device common_device(const char* name, const Tensor& a, const Tensor& b, const char* an = "self",
                     const char* bn = "other") {
  const Device da = a.device(), db = b.device();
  if (da == db) return da;
  if (da.is_cpu() && a.dim() == 0) return db;
  if (db.is_cpu() && b.dim() == 0) return da;
  throw_devices(name, an, da, bn, db);
}

/// `t` itself when it already has dtype dt on device d, else a converted copy kept in holder.
inline const Tensor& prep(const Tensor& t, Dtype dt, Device d, Tensor& holder) {
  if (t.dtype() == dt && t.device() == d) return t;
  holder = t.to(d, dt);
  return holder;
}

inline Shape out_shape(const char* name, const Tensor& a, const Tensor& b) {
  if (a.shape() == b.shape()) return a.shape();
  return broadcast_shapes(name, a.shape(), b.shape());
}

/// In-place ops may not grow self by broadcasting.
void check_inplace_shape(const char* name, const Tensor& self, const Tensor& other) {
  if (self.shape() == other.shape()) return;
  const Shape s = broadcast_shapes(name, self.shape(), other.shape());
  EMBER_CHECK(s == self.shape(), "[", name, "] output with shape ", self.shape(),
              " doesn't match the broadcast shape ", s);
}

/// Makes `out` ready to take a result of `shape` and dtype `dt` on `dev`: allocates it when
/// undefined, resizes it (in place, so every handle sees it) when it is empty, and otherwise
/// checks its device, shape and dtype.
void prepare_out(const char* name, Tensor& out, const Shape& shape, Dtype dt, Device dev) {
  if (!out.defined()) {
    out = make_empty(shape, dt, dev);
    return;
  }
  EMBER_CHECK(out.device() == dev, "[", name, "] expected out on ", dev,
              " (the inputs' device), got out on ", out.device());
  check_cast(name, dt, out.dtype());
  if (out.shape() == shape) {
    check_writable(name, out);
    return;
  }
  EMBER_CHECK(out.numel() == 0, "[", name, "] out has shape ", out.shape(),
              " but the result has shape ", shape, "; only an empty out is resized");
  TensorImpl* impl = out.impl();
  impl->storage = std::make_shared<Storage>(
      static_cast<size_t>(shape.numel() * itemsize(out.dtype())), dev);
  impl->sizes = shape;
  impl->strides = contiguous_strides(shape);
  impl->offset = 0;
  impl->refresh();
}

// ---- kernel dispatch --------------------------------------------------------------------------

inline void run_unary(UnaryOp op, const Tensor& out, const Tensor& in) {
  if (out.is_cpu()) {
    detail::unary_cpu(op, out, in);
  } else {
    detail::unary_cuda(op, out, in);
  }
}

inline void run_binary(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b,
                       const Scalar& alpha) {
  if (out.is_cpu()) {
    detail::binary_cpu(op, out, a, b, alpha);
  } else {
    detail::binary_cuda(op, out, a, b, alpha);
  }
}

inline void run_scalar(BinaryOp op, const Tensor& out, const Tensor& a, const Scalar& s,
                       bool reverse) {
  if (out.is_cpu()) {
    detail::binary_scalar_cpu(op, out, a, s, reverse);
  } else {
    detail::binary_scalar_cuda(op, out, a, s, reverse);
  }
}

inline void run_where(const Tensor& out, const Tensor& c, const Tensor& a, const Tensor& b) {
  if (out.is_cpu()) {
    detail::where_cpu(out, c, a, b);
  } else {
    detail::where_cuda(out, c, a, b);
  }
}

// ---- autograd ---------------------------------------------------------------------------------

/// PyTorch refuses out= variants on inputs that require grad; so does Ember.
void check_out_not_recorded(const char* name, const Tensor& a, const Tensor& b) {
  EMBER_CHECK(!detail::should_record(a, b), "[", name, "] out= variants don't support automatic "
              "differentiation, but one of the arguments requires grad; use the out-of-place op");
}

// ---- binary: tensor-tensor --------------------------------------------------------------------

constexpr bool takes_alpha(BinaryOp op) { return op == BinaryOp::Add || op == BinaryOp::Sub; }

Tensor binary(const char* name, BinaryOp op, const Tensor& a, const Tensor& b,
              const Scalar& alpha = 1) {
  check_defined(name, a, "self");
  check_defined(name, b, "other");
  const Dtype compute = compute_dtype(name, op, result_type(a, b));
  if (takes_alpha(op)) check_alpha(name, compute, alpha);
  const Device dev = common_device(name, a, b);
  Tensor ha, hb;
  const Tensor& ca = prep(a, compute, dev, ha);
  const Tensor& cb = prep(b, compute, dev, hb);
  Tensor out = make_empty(out_shape(name, a, b), output_dtype(op, compute), dev);
  run_binary(op, out, ca, cb, alpha);
  if (detail::should_record(a, b) && detail::opid_of(op) != OpId::kCount) {
    detail::record(detail::opid_of(op), {&a, &b}, {&out},
                   takes_alpha(op) ? OpAttrs(ScalarAttrs{alpha}) : OpAttrs(NoAttrs{}));
  }
  return out;
}

Tensor& binary_(const char* name, BinaryOp op, Tensor& self, const Tensor& b,
                const Scalar& alpha = 1) {
  check_defined(name, self, "self");
  check_defined(name, b, "other");
  const Dtype compute = compute_dtype(name, op, result_type(self, b));
  if (takes_alpha(op)) check_alpha(name, compute, alpha);
  const Device dev = self.device();
  if (b.device() != dev && !(b.is_cpu() && b.dim() == 0)) {
    throw_devices(name, "self", dev, "other", b.device());
  }
  check_cast(name, output_dtype(op, compute), self.dtype());
  check_inplace_shape(name, self, b);
  check_writable(name, self);
  check_no_partial_overlap(name, self, b);
  if (detail::should_record(self, b)) {
    return detail::record_inplace(name, self, [&](const Tensor& s) {
      return binary(name, op, s, b, alpha);
    });
  }
  Tensor hb;
  const Tensor& cb = prep(b, compute, dev, hb);
  if (self.dtype() == compute) {
    run_binary(op, self, self, cb, alpha);
  } else {
    // e.g. float16 self += float32 other: compute in float32, then cast back into self.
    Tensor tmp = self.to(compute);
    run_binary(op, tmp, tmp, cb, alpha);
    self.copy_(tmp);
  }
  self.bump_version();
  return self;
}

Tensor& binary_out(const char* name, BinaryOp op, Tensor& out, const Tensor& a,
                   const Tensor& b, const Scalar& alpha = 1) {
  check_defined(name, a, "self");
  check_defined(name, b, "other");
  const Dtype compute = compute_dtype(name, op, result_type(a, b));
  if (takes_alpha(op)) check_alpha(name, compute, alpha);
  const Device dev = common_device(name, a, b);
  const Shape shape = out_shape(name, a, b);
  const Dtype rdt = output_dtype(op, compute);
  check_out_not_recorded(name, a, b);
  prepare_out(name, out, shape, rdt, dev);
  check_no_partial_overlap(name, out, a);
  check_no_partial_overlap(name, out, b);
  Tensor ha, hb;
  const Tensor& ca = prep(a, compute, dev, ha);
  const Tensor& cb = prep(b, compute, dev, hb);
  if (out.dtype() == rdt) {
    run_binary(op, out, ca, cb, alpha);
  } else {
    Tensor tmp = make_empty(shape, rdt, dev);
    run_binary(op, tmp, ca, cb, alpha);
    out.copy_(tmp);
  }
  out.bump_version();
  return out;
}

// ---- binary: tensor-scalar --------------------------------------------------------------------

Tensor binary_scalar(const char* name, BinaryOp op, const Tensor& a, const Scalar& s,
                     bool reverse = false) {
  check_defined(name, a, "self");
  const Dtype compute = compute_dtype(name, op, promote_with_scalar(a.dtype(), s.kind()));
  Tensor ha;
  const Tensor& ca = prep(a, compute, a.device(), ha);
  Tensor out = make_empty(a.shape(), output_dtype(op, compute), a.device());
  run_scalar(op, out, ca, s, reverse);
  if (detail::should_record(a) && detail::scalar_opid_of(op, reverse) != OpId::kCount) {
    detail::record(detail::scalar_opid_of(op, reverse), {&a}, {&out}, ScalarAttrs{s});
  }
  return out;
}

Tensor& binary_scalar_(const char* name, BinaryOp op, Tensor& self, const Scalar& s) {
  check_defined(name, self, "self");
  const Dtype compute = compute_dtype(name, op, promote_with_scalar(self.dtype(), s.kind()));
  check_cast(name, output_dtype(op, compute), self.dtype());
  check_writable(name, self);
  if (detail::should_record(self)) {
    return detail::record_inplace(name, self, [&](const Tensor& x) {
      return binary_scalar(name, op, x, s);
    });
  }
  if (self.dtype() == compute) {
    run_scalar(op, self, self, s, false);
  } else {
    Tensor tmp = self.to(compute);
    run_scalar(op, tmp, tmp, s, false);
    self.copy_(tmp);
  }
  self.bump_version();
  return self;
}

void check_int_pow_exponent(const char* name, Dtype compute, const Scalar& e) {
  EMBER_CHECK(is_floating(compute) || e.is_floating() || e.to_int() >= 0, "[", name,
              "] integers to negative integer powers are not allowed; got exponent ", e,
              " for a tensor of dtype ", compute);
}

// ---- unary ------------------------------------------------------------------------------------

Dtype unary_dtype(const char* name, Domain dom, Dtype in) {
  switch (dom) {
    case Domain::Real:
      return is_floating(in) ? in : kDefaultFloat;
    case Domain::Numeric:
      EMBER_CHECK_TYPE(TypeError, in != kBool, "[", name,
                       "] is not supported for bool tensors; got dtype bool");
      return in;
    case Domain::Any:
      return in;
  }
  return in;
}

/// Runs a unary kernel; the caller records the op.
Tensor unary_kernel(const char* name, UnaryOp op, const Tensor& t) {
  check_defined(name, t, "self");
  const Dtype compute = unary_dtype(name, detail::domain_of(op), t.dtype());
  Tensor h;
  const Tensor& ct = prep(t, compute, t.device(), h);
  Tensor out = make_empty(t.shape(), op == UnaryOp::LogicalNot ? kBool : compute, t.device());
  run_unary(op, out, ct);
  return out;
}

// The unary ops torch's autocast runs in float32: their range or precision suffers most in
// half precision.
bool autocast_to_float32(UnaryOp op) {
  return op == UnaryOp::Exp || op == UnaryOp::Log || op == UnaryOp::Log1p ||
         op == UnaryOp::Rsqrt || op == UnaryOp::Reciprocal;
}

/// An op of the unary table (tensor/detail/unary_ops.h).
Tensor unary(const char* name, UnaryOp op, const Tensor& t) {
  if (autocast_to_float32(op)) {
    if (auto ac = detail::autocast_inputs(AutocastPolicy::kFloat32, t)) return unary(name, op, ac[0]);
  }
  Tensor out = unary_kernel(name, op, t);
  if (detail::should_record(t)) detail::record(detail::opid_of(op), {&t}, {&out});
  return out;
}

Tensor& unary_(const char* name, UnaryOp op, Tensor& t) {
  check_defined(name, t, "self");
  check_cast(name, unary_dtype(name, detail::domain_of(op), t.dtype()), t.dtype());
  check_writable(name, t);
  if (detail::should_record(t)) {
    return detail::record_inplace(name, t, [&](const Tensor& x) { return unary(name, op, x); });
  }
  run_unary(op, t, t);
  t.bump_version();
  return t;
}

// ---- clamp ------------------------------------------------------------------------------------

Dtype clamp_dtype(const char* name, const Tensor& t, const std::optional<Scalar>& lo,
                  const std::optional<Scalar>& hi) {
  EMBER_CHECK(lo.has_value() || hi.has_value(), "[", name,
              "] at least one of 'min' or 'max' must be given, got neither");
  Dtype dt = t.dtype();
  if (lo) dt = promote_with_scalar(dt, lo->kind());
  if (hi) dt = promote_with_scalar(dt, hi->kind());
  return dt;
}

inline void run_clamp(const Tensor& out, const Tensor& in, const std::optional<Scalar>& lo,
                      const std::optional<Scalar>& hi) {
  if (out.is_cpu()) {
    detail::clamp_cpu(out, in, lo, hi);
  } else {
    detail::clamp_cuda(out, in, lo, hi);
  }
}

}  // namespace

// ---- unary ------------------------------------------------------------------------------------

Tensor neg(const Tensor& t) {
  if (t.defined()) {
    EMBER_CHECK_TYPE(TypeError, t.dtype() != kBool,
                     "[neg] negation of a bool tensor is not supported; got dtype bool (use "
                     "logical_not() to invert a mask)");
  }
  return unary("neg", UnaryOp::Neg, t);
}
Tensor square(const Tensor& t) {
  // square(x) is pow(x, 2): a bool tensor with an int scalar promotes to int64.
  if (t.defined() && t.dtype() == kBool) return unary("square", UnaryOp::Square, t.to(kInt64));
  return unary("square", UnaryOp::Square, t);
}
Tensor gelu(const Tensor& t, const char* approximate) {
  const std::string_view a = approximate ? approximate : "none";
  EMBER_CHECK(a == "none" || a == "tanh", "[gelu] approximate must be 'none' or 'tanh', got '", a,
              "'");
  Tensor out = unary_kernel("gelu", a == "none" ? UnaryOp::GeluErf : UnaryOp::GeluTanh, t);
  if (detail::should_record(t)) {
    detail::record<OpId::Gelu>({&t}, {&out}, {.tanh_approx = a == "tanh"});
  }
  return out;
}
Tensor logical_not(const Tensor& t) { return unary_kernel("logical_not", UnaryOp::LogicalNot, t); }

// The rest of the unary table.
#define EMBER_UNARY_FRONT_Custom(Op, name)
#define EMBER_UNARY_FRONT_Plain(Op, name) \
  Tensor name(const Tensor& t) { return unary(#name, UnaryOp::Op, t); }
#define EMBER_UNARY_FRONT_(Op, name, dom, saves, front) EMBER_UNARY_FRONT_##front(Op, name)
EMBER_UNARY_OPS(EMBER_UNARY_FRONT_)
#undef EMBER_UNARY_FRONT_
#undef EMBER_UNARY_FRONT_Plain
#undef EMBER_UNARY_FRONT_Custom

Tensor& neg_(Tensor& t) {
  if (t.defined()) {
    EMBER_CHECK_TYPE(TypeError, t.dtype() != kBool,
                     "[neg_] negation of a bool tensor is not supported; got dtype bool (use "
                     "logical_not() to invert a mask)");
  }
  return unary_("neg_", UnaryOp::Neg, t);
}
Tensor& abs_(Tensor& t) { return unary_("abs_", UnaryOp::Abs, t); }
Tensor& exp_(Tensor& t) { return unary_("exp_", UnaryOp::Exp, t); }
Tensor& log_(Tensor& t) { return unary_("log_", UnaryOp::Log, t); }
Tensor& sqrt_(Tensor& t) { return unary_("sqrt_", UnaryOp::Sqrt, t); }
Tensor& rsqrt_(Tensor& t) { return unary_("rsqrt_", UnaryOp::Rsqrt, t); }
Tensor& tanh_(Tensor& t) { return unary_("tanh_", UnaryOp::Tanh, t); }
Tensor& sigmoid_(Tensor& t) { return unary_("sigmoid_", UnaryOp::Sigmoid, t); }
Tensor& relu_(Tensor& t) { return unary_("relu_", UnaryOp::Relu, t); }

// ---- binary arithmetic ------------------------------------------------------------------------

Tensor add(const Tensor& a, const Tensor& b, const Scalar& alpha) {
  return binary("add", BinaryOp::Add, a, b, alpha);
}
Tensor add(const Tensor& a, const Scalar& b) {
  return binary_scalar("add", BinaryOp::Add, a, b);
}
Tensor sub(const Tensor& a, const Tensor& b, const Scalar& alpha) {
  return binary("sub", BinaryOp::Sub, a, b, alpha);
}
Tensor sub(const Tensor& a, const Scalar& b) {
  return binary_scalar("sub", BinaryOp::Sub, a, b);
}
Tensor rsub(const Tensor& a, const Scalar& b) {
  return binary_scalar("rsub", BinaryOp::Sub, a, b, /*reverse=*/true);
}
Tensor mul(const Tensor& a, const Tensor& b) { return binary("mul", BinaryOp::Mul, a, b); }
Tensor mul(const Tensor& a, const Scalar& b) {
  return binary_scalar("mul", BinaryOp::Mul, a, b);
}
Tensor div(const Tensor& a, const Tensor& b) { return binary("div", BinaryOp::Div, a, b); }
Tensor div(const Tensor& a, const Scalar& b) {
  return binary_scalar("div", BinaryOp::Div, a, b);
}
Tensor rdiv(const Tensor& a, const Scalar& b) {
  return binary_scalar("rdiv", BinaryOp::Div, a, b, /*reverse=*/true);
}
Tensor pow(const Tensor& a, const Tensor& b) {
  if (auto ac = detail::autocast_inputs(AutocastPolicy::kFloat32, a, b)) return pow(ac[0], ac[1]);
  return binary("pow", BinaryOp::Pow, a, b);
}
Tensor pow(const Tensor& a, const Scalar& b) {
  if (auto ac = detail::autocast_inputs(AutocastPolicy::kFloat32, a)) return pow(ac[0], b);
  check_defined("pow", a, "self");
  const Dtype compute = compute_dtype("pow", BinaryOp::Pow, promote_with_scalar(a.dtype(), b.kind()));
  check_int_pow_exponent("pow", compute, b);
  // Common exponents take the cheaper unary kernels (as PyTorch does).
  const double e = b.to_double();
  if (e == 2.0) return square(a.to(compute));
  if (is_floating(compute)) {
    if (e == 0.5) return sqrt(a.to(compute));
    if (e == -1.0) return reciprocal(a.to(compute));
  }
  return binary_scalar("pow", BinaryOp::Pow, a, b);
}
Tensor pow(const Scalar& a, const Tensor& b) {
  if (auto ac = detail::autocast_inputs(AutocastPolicy::kFloat32, b)) return pow(a, ac[0]);
  return binary_scalar("pow", BinaryOp::Pow, b, a, /*reverse=*/true);
}

// The rest of the binary table.
#define EMBER_BINARY_FRONT_Custom(Op, name)
#define EMBER_BINARY_FRONT_Plain(Op, name) \
  Tensor name(const Tensor& a, const Tensor& b) { return binary(#name, BinaryOp::Op, a, b); }
#define EMBER_BINARY_FRONT_(Op, name, dom, sa, sb, so, scalar, front) \
  EMBER_BINARY_FRONT_##front(Op, name)
EMBER_BINARY_OPS(EMBER_BINARY_FRONT_)
#undef EMBER_BINARY_FRONT_
#undef EMBER_BINARY_FRONT_Plain
#undef EMBER_BINARY_FRONT_Custom

Tensor relu_backward(const Tensor& grad, const Tensor& output) {
  return binary("relu_backward", BinaryOp::ReluGrad, grad, output);
}
Tensor gelu_tanh_backward(const Tensor& grad, const Tensor& input) {
  return binary("gelu_tanh_backward", BinaryOp::GeluTanhGrad, grad, input);
}

Tensor& add_(Tensor& a, const Tensor& b, const Scalar& alpha) {
  return binary_("add_", BinaryOp::Add, a, b, alpha);
}
Tensor& add_(Tensor& a, const Scalar& b) { return binary_scalar_("add_", BinaryOp::Add, a, b); }
Tensor& sub_(Tensor& a, const Tensor& b, const Scalar& alpha) {
  return binary_("sub_", BinaryOp::Sub, a, b, alpha);
}
Tensor& sub_(Tensor& a, const Scalar& b) { return binary_scalar_("sub_", BinaryOp::Sub, a, b); }
Tensor& mul_(Tensor& a, const Tensor& b) { return binary_("mul_", BinaryOp::Mul, a, b); }
Tensor& mul_(Tensor& a, const Scalar& b) { return binary_scalar_("mul_", BinaryOp::Mul, a, b); }
Tensor& div_(Tensor& a, const Tensor& b) { return binary_("div_", BinaryOp::Div, a, b); }
Tensor& div_(Tensor& a, const Scalar& b) { return binary_scalar_("div_", BinaryOp::Div, a, b); }
Tensor& pow_(Tensor& a, const Scalar& b) {
  check_defined("pow_", a, "self");
  check_int_pow_exponent("pow_", a.dtype(), b);
  return binary_scalar_("pow_", BinaryOp::Pow, a, b);
}

Tensor& add_out(Tensor& out, const Tensor& a, const Tensor& b, const Scalar& alpha) {
  return binary_out("add_out", BinaryOp::Add, out, a, b, alpha);
}
Tensor& sub_out(Tensor& out, const Tensor& a, const Tensor& b, const Scalar& alpha) {
  return binary_out("sub_out", BinaryOp::Sub, out, a, b, alpha);
}
Tensor& mul_out(Tensor& out, const Tensor& a, const Tensor& b) {
  return binary_out("mul_out", BinaryOp::Mul, out, a, b);
}
Tensor& div_out(Tensor& out, const Tensor& a, const Tensor& b) {
  return binary_out("div_out", BinaryOp::Div, out, a, b);
}

// ---- comparisons and logic --------------------------------------------------------------------

#define EMBER_COMPARE_(NAME, OP)                                                              \
  Tensor NAME(const Tensor& a, const Tensor& b) { return binary(#NAME, BinaryOp::OP, a, b); } \
  Tensor NAME(const Tensor& a, const Scalar& b) {                                             \
    return binary_scalar(#NAME, BinaryOp::OP, a, b);                                          \
  }
EMBER_COMPARE_(eq, Eq)
EMBER_COMPARE_(ne, Ne)
EMBER_COMPARE_(lt, Lt)
EMBER_COMPARE_(le, Le)
EMBER_COMPARE_(gt, Gt)
EMBER_COMPARE_(ge, Ge)
#undef EMBER_COMPARE_

Tensor logical_and(const Tensor& a, const Tensor& b) {
  return binary("logical_and", BinaryOp::LogicalAnd, a, b);
}
Tensor logical_or(const Tensor& a, const Tensor& b) {
  return binary("logical_or", BinaryOp::LogicalOr, a, b);
}
Tensor logical_xor(const Tensor& a, const Tensor& b) {
  return binary("logical_xor", BinaryOp::LogicalXor, a, b);
}

// ---- ternary and friends ----------------------------------------------------------------------

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  check_defined("where", cond, "condition");
  check_defined("where", a, "self");
  check_defined("where", b, "other");
  EMBER_CHECK_TYPE(TypeError, cond.dtype() == kBool,
                   "[where] expected condition to be a bool tensor, got dtype ", cond.dtype());
  const Dtype dt = result_type(a, b);
  Device dev = common_device("where", a, b);
  if (cond.device() != dev) {
    if (!(cond.is_cpu() && cond.dim() == 0)) throw_devices("where", "condition", cond.device(), "self", dev);
  }
  const Shape shape = broadcast_shapes("where", cond.shape(), out_shape("where", a, b));
  Tensor hc, ha, hb;
  const Tensor& cc = prep(cond, kBool, dev, hc);
  const Tensor& ca = prep(a, dt, dev, ha);
  const Tensor& cb = prep(b, dt, dev, hb);
  Tensor out = make_empty(shape, dt, dev);
  run_where(out, cc, ca, cb);
  if (detail::should_record(a, b)) detail::record(OpId::Where, {&cond, &a, &b}, {&out});
  return out;
}

Tensor where(const Tensor& cond, const Tensor& a, const Scalar& b) {
  check_defined("where", a, "self");
  const Dtype dt = promote_with_scalar(a.dtype(), b.kind());
  return where(cond, a, scalar_tensor(b, TensorOptions(dt).device(a.device())));
}

Tensor clamp(const Tensor& t, std::optional<Scalar> min, std::optional<Scalar> max) {
  check_defined("clamp", t, "self");
  const Dtype dt = clamp_dtype("clamp", t, min, max);
  Tensor h;
  const Tensor& ct = prep(t, dt, t.device(), h);
  Tensor out = make_empty(t.shape(), dt, t.device());
  run_clamp(out, ct, min, max);
  if (detail::should_record(t)) {
    detail::record<OpId::Clamp>({&t}, {&out}, {min, max});
  }
  return out;
}

Tensor& clamp_(Tensor& t, std::optional<Scalar> min, std::optional<Scalar> max) {
  check_defined("clamp_", t, "self");
  check_cast("clamp_", clamp_dtype("clamp_", t, min, max), t.dtype());
  check_writable("clamp_", t);
  if (detail::should_record(t)) {
    return detail::record_inplace("clamp_", t, [&](const Tensor& x) { return clamp(x, min, max); });
  }
  run_clamp(t, t, min, max);
  t.bump_version();
  return t;
}

Tensor clamp_min(const Tensor& t, const Scalar& min) { return clamp(t, min, std::nullopt); }
Tensor clamp_max(const Tensor& t, const Scalar& max) { return clamp(t, std::nullopt, max); }

Tensor masked_fill(const Tensor& t, const Tensor& mask, const Scalar& value) {
  check_defined("masked_fill", t, "self");
  check_defined("masked_fill", mask, "mask");
  EMBER_CHECK_TYPE(TypeError, mask.dtype() == kBool,
                   "[masked_fill] expected mask to be a bool tensor, got dtype ", mask.dtype());
  const Device dev = t.device();
  if (mask.device() != dev) {
    if (!(mask.is_cpu() && mask.dim() == 0)) throw_devices("masked_fill", "self", dev, "mask", mask.device());
  }
  check_inplace_shape("masked_fill", t, mask);
  Tensor hm;
  const Tensor& cm = prep(mask, kBool, dev, hm);
  Tensor v = scalar_tensor(value, TensorOptions(t.dtype()).device(dev));
  Tensor out = make_empty(t.shape(), t.dtype(), dev);
  run_where(out, cm, v, t);
  if (detail::should_record(t)) detail::record(OpId::MaskedFill, {&t, &mask}, {&out});
  return out;
}

bool equal(const Tensor& a, const Tensor& b) {
  check_defined("equal", a, "self");
  check_defined("equal", b, "other");
  if (a.device() != b.device()) throw_devices("equal", "self", a.device(), "other", b.device());
  if (!(a.shape() == b.shape())) return false;
  if (a.numel() == 0) return true;
  Tensor e = eq(a, b);
  if (!e.is_cpu()) e = e.cpu();
  return std::memchr(e.data_ptr(), 0, static_cast<size_t>(e.numel())) == nullptr;
}

bool allclose(const Tensor& a, const Tensor& b, double rtol, double atol) {
  check_defined("allclose", a, "self");
  check_defined("allclose", b, "other");
  EMBER_CHECK(rtol >= 0 && atol >= 0, "[allclose] rtol and atol must be non-negative, got rtol=",
              rtol, " atol=", atol);
  if (a.device() != b.device()) {
    throw_devices("allclose", "self", a.device(), "other", b.device());
  }
  const Shape shape = out_shape("allclose", a, b);
  // Not a hot path: compare in float64 on the host.
  const Tensor x = a.expand(shape).to(kCPU, kFloat64).contiguous();
  const Tensor y = b.expand(shape).to(kCPU, kFloat64).contiguous();
  const double* px = x.data<double>();
  const double* py = y.data<double>();
  for (int64_t i = 0, n = x.numel(); i < n; ++i) {
    if (px[i] == py[i]) continue;  // also equal infinities
    if (!std::isfinite(px[i]) || !std::isfinite(py[i])) return false;  // NaN, unequal infinities
    if (!(std::fabs(px[i] - py[i]) <= atol + rtol * std::fabs(py[i]))) return false;
  }
  return true;
}

// ---- Tensor methods and operators -------------------------------------------------------------

Tensor Tensor::add(const Tensor& o, const Scalar& alpha) const {
  return binary("add", BinaryOp::Add, *this, o, alpha);
}
Tensor Tensor::sub(const Tensor& o, const Scalar& alpha) const {
  return binary("sub", BinaryOp::Sub, *this, o, alpha);
}
Tensor Tensor::mul(const Tensor& o) const { return binary("mul", BinaryOp::Mul, *this, o); }
Tensor Tensor::div(const Tensor& o) const { return binary("div", BinaryOp::Div, *this, o); }
Tensor& Tensor::add_(const Tensor& o, const Scalar& alpha) {
  return binary_("add_", BinaryOp::Add, *this, o, alpha);
}
Tensor& Tensor::add_(const Scalar& o) { return binary_scalar_("add_", BinaryOp::Add, *this, o); }
Tensor& Tensor::sub_(const Tensor& o, const Scalar& alpha) {
  return binary_("sub_", BinaryOp::Sub, *this, o, alpha);
}
Tensor& Tensor::mul_(const Tensor& o) { return binary_("mul_", BinaryOp::Mul, *this, o); }
Tensor& Tensor::mul_(const Scalar& o) { return binary_scalar_("mul_", BinaryOp::Mul, *this, o); }
Tensor& Tensor::div_(const Tensor& o) { return binary_("div_", BinaryOp::Div, *this, o); }
Tensor& Tensor::div_(const Scalar& o) { return binary_scalar_("div_", BinaryOp::Div, *this, o); }
Tensor Tensor::neg() const { return ember::neg(*this); }
Tensor Tensor::abs() const { return ember::abs(*this); }
Tensor Tensor::exp() const { return ember::exp(*this); }
Tensor Tensor::log() const { return ember::log(*this); }
Tensor Tensor::sqrt() const { return ember::sqrt(*this); }
Tensor Tensor::pow(const Scalar& exponent) const { return ember::pow(*this, exponent); }
Tensor Tensor::relu() const { return ember::relu(*this); }
Tensor Tensor::sigmoid() const { return ember::sigmoid(*this); }
Tensor Tensor::tanh() const { return ember::tanh(*this); }

Tensor operator+(const Tensor& a, const Tensor& b) { return binary("add", BinaryOp::Add, a, b); }
Tensor operator-(const Tensor& a, const Tensor& b) { return binary("sub", BinaryOp::Sub, a, b); }
Tensor operator*(const Tensor& a, const Tensor& b) { return binary("mul", BinaryOp::Mul, a, b); }
Tensor operator/(const Tensor& a, const Tensor& b) { return binary("div", BinaryOp::Div, a, b); }
Tensor operator+(const Tensor& a, const Scalar& b) { return add(a, b); }
Tensor operator-(const Tensor& a, const Scalar& b) { return sub(a, b); }
Tensor operator*(const Tensor& a, const Scalar& b) { return mul(a, b); }
Tensor operator/(const Tensor& a, const Scalar& b) { return div(a, b); }
Tensor operator+(const Scalar& a, const Tensor& b) { return add(b, a); }
Tensor operator-(const Scalar& a, const Tensor& b) { return rsub(b, a); }
Tensor operator*(const Scalar& a, const Tensor& b) { return mul(b, a); }
Tensor operator/(const Scalar& a, const Tensor& b) { return rdiv(b, a); }
Tensor operator-(const Tensor& a) { return neg(a); }
Tensor& operator+=(Tensor& a, const Tensor& b) { return binary_("add_", BinaryOp::Add, a, b); }
Tensor& operator-=(Tensor& a, const Tensor& b) { return binary_("sub_", BinaryOp::Sub, a, b); }
Tensor& operator*=(Tensor& a, const Tensor& b) { return binary_("mul_", BinaryOp::Mul, a, b); }
Tensor& operator/=(Tensor& a, const Tensor& b) { return binary_("div_", BinaryOp::Div, a, b); }
Tensor& operator+=(Tensor& a, const Scalar& b) { return add_(a, b); }
Tensor& operator-=(Tensor& a, const Scalar& b) { return sub_(a, b); }
Tensor& operator*=(Tensor& a, const Scalar& b) { return mul_(a, b); }
Tensor& operator/=(Tensor& a, const Scalar& b) { return div_(a, b); }

}  // namespace ember
