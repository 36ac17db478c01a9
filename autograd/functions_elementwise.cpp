// Backward rules of the element-wise ops (tensor/elementwise.h).
//
// The formulas and subgradient choices follow PyTorch's tools/autograd/derivatives.yaml, and
// so does the choice of what to save (input or output): it decides which later in-place
// changes backward can survive, so it should match what PyTorch users expect.
#include <cmath>
#include <optional>

#include "autograd/functions.h"
#include "tensor/ops.h"

namespace ember::autograd {
namespace {

constexpr double kInvSqrt2Pi = 0.39894228040143267794;  // 1 / sqrt(2 pi)

Scalar negated(const Scalar& s) {
  return s.is_floating() ? Scalar(-s.to_double()) : Scalar(-s.to_int());
}

// ---- unary ------------------------------------------------------------------------------------

/// The gradient of a unary op from the incoming gradient and one saved tensor (the op's input
/// or output, see UnarySpec; undefined when the rule needs neither).
using UnaryRule = Tensor (*)(const Tensor& g, const Tensor& saved);

enum class Saves : uint8_t { Nothing, Input, Output };

struct UnarySpec {
  const char* name;
  Saves saves;
  UnaryRule rule;
};

// g: the output's shape (= the input's shape); `x` is the saved input, `y` the saved output.
const UnarySpec kNeg{"NegBackward", Saves::Nothing,
                     [](const Tensor& g, const Tensor&) { return neg(g); }};
const UnarySpec kAbs{"AbsBackward", Saves::Input,  // abs'(0) = sign(0) = 0
                     [](const Tensor& g, const Tensor& x) { return mul(g, sign(x)); }};
const UnarySpec kSign{"SignBackward", Saves::Nothing,
                      [](const Tensor& g, const Tensor&) { return zeros_like(g); }};
const UnarySpec kExp{"ExpBackward", Saves::Output,
                     [](const Tensor& g, const Tensor& y) { return mul(g, y); }};
const UnarySpec kLog{"LogBackward", Saves::Input,
                     [](const Tensor& g, const Tensor& x) { return div(g, x); }};
const UnarySpec kLog1p{"Log1pBackward", Saves::Input,
                       [](const Tensor& g, const Tensor& x) { return div(g, add(x, 1)); }};
const UnarySpec kSqrt{"SqrtBackward", Saves::Output,
                      [](const Tensor& g, const Tensor& y) { return div(g, mul(y, 2)); }};
const UnarySpec kRsqrt{"RsqrtBackward", Saves::Output,  // -1/2 x^-3/2 = -y^3 / 2
                       [](const Tensor& g, const Tensor& y) {
                         return mul(g, mul(pow(y, 3), -0.5));
                       }};
const UnarySpec kReciprocal{"ReciprocalBackward", Saves::Output,  // -1/x^2 = -y^2
                            [](const Tensor& g, const Tensor& y) {
                              return mul(neg(g), square(y));
                            }};
const UnarySpec kSquare{"SquareBackward", Saves::Input,
                        [](const Tensor& g, const Tensor& x) { return mul(g, mul(x, 2)); }};
const UnarySpec kSin{"SinBackward", Saves::Input,
                     [](const Tensor& g, const Tensor& x) { return mul(g, cos(x)); }};
const UnarySpec kCos{"CosBackward", Saves::Input,
                     [](const Tensor& g, const Tensor& x) { return neg(mul(g, sin(x))); }};
const UnarySpec kTanh{"TanhBackward", Saves::Output,  // 1 - y^2
                      [](const Tensor& g, const Tensor& y) {
                        return mul(g, rsub(mul(y, y), 1));
                      }};
const UnarySpec kSigmoid{"SigmoidBackward", Saves::Output,  // y (1 - y)
                         [](const Tensor& g, const Tensor& y) {
                           return mul(g, mul(y, rsub(y, 1)));
                         }};
const UnarySpec kRelu{"ReluBackward", Saves::Output,  // relu'(0) = 0 (threshold_backward)
                      [](const Tensor& g, const Tensor& y) {
                        // One fused pass, unless create_graph needs a differentiable result.
                        if (!GradMode::is_enabled() && is_floating(g.dtype()) && g.dtype() == y.dtype()) {
                          return relu_backward(g, y);
                        }
                        return masked_fill(g, le(y, 0), 0);
                      }};
const UnarySpec kSilu{"SiluBackward", Saves::Input,  // s (1 + x (1 - s)), s = sigmoid(x)
                      [](const Tensor& g, const Tensor& x) {
                        const Tensor s = sigmoid(x);
                        return mul(g, mul(s, add(mul(x, rsub(s, 1)), 1)));
                      }};

const UnarySpec* unary_spec(OpId op) {
  switch (op) {
    case OpId::Neg: return &kNeg;
    case OpId::Abs: return &kAbs;
    case OpId::Sign: return &kSign;
    case OpId::Exp: return &kExp;
    case OpId::Log: return &kLog;
    case OpId::Log1p: return &kLog1p;
    case OpId::Sqrt: return &kSqrt;
    case OpId::Rsqrt: return &kRsqrt;
    case OpId::Reciprocal: return &kReciprocal;
    case OpId::Square: return &kSquare;
    case OpId::Sin: return &kSin;
    case OpId::Cos: return &kCos;
    case OpId::Tanh: return &kTanh;
    case OpId::Sigmoid: return &kSigmoid;
    case OpId::Relu: return &kRelu;
    case OpId::Silu: return &kSilu;
    default: return nullptr;
  }
}

struct UnaryBackward final : Node {
  const UnarySpec* spec = nullptr;
  SavedTensor saved;
  const char* name() const override { return spec->name; }
  TensorList apply(TensorList&& g) override {
    return {spec->rule(g[0], saved.defined() ? saved.unpack(*this) : Tensor())};
  }
  void release_variables() override { saved.release(); }
};

void record_unary(const RecordArgs& r) {
  auto n = new_node<UnaryBackward>(r);
  n->spec = unary_spec(r.op);
  EMBER_INTERNAL_ASSERT(n->spec != nullptr, "no unary rule for op #", static_cast<int>(r.op));
  if (n->spec->saves == Saves::Input) n->saved = SavedTensor(r.in(0), false);
  if (n->spec->saves == Saves::Output) n->saved = SavedTensor(r.out(0), true);
  commit(n, r);
}

/// d/dx x Phi(x) = Phi(x) + x phi(x), with the normal CDF Phi and density phi.
///
/// There is no erf op, so Phi comes from the forward kernel: Phi(x) = gelu(x) / x. That is
/// accurate (a few ulp) wherever x is a normal number, but 0/0 at x = 0 and inexact for
/// subnormal x; for |x| < 1e-6 we use Phi(x) = 1/2 + x phi(0) instead, whose error (x^3 / 15)
/// is below double rounding there. The division uses x with those entries replaced by 1, so
/// under create_graph no 0/0 reaches the second derivative either.
Tensor gelu_erf_derivative(const Tensor& x) {
  const Tensor small = lt(abs(x), 1e-6);
  const Tensor cdf = where(small, add(mul(x, kInvSqrt2Pi), 0.5),
                           div(gelu(x, "none"), masked_fill(x, small, 1)));
  const Tensor pdf = mul(exp(mul(square(x), -0.5)), kInvSqrt2Pi);
  return add(cdf, mul(x, pdf));
}

/// The derivative of 0.5 x (1 + tanh(k (x + c x^3))), written as PyTorch's GeluBackward does.
Tensor gelu_tanh_derivative(const Tensor& x) {
  constexpr double kBeta = 0.79788456080286535588;  // sqrt(2 / pi)
  constexpr double kKappa = 0.044715;
  const Tensor x_sq = square(x);
  const Tensor t = tanh(mul(add(mul(mul(x_sq, x), kKappa), x), kBeta));
  const Tensor left_derivative = mul(add(t, 1), 0.5);
  const Tensor dinner = mul(add(mul(x_sq, 3 * kKappa), 1), kBeta);
  const Tensor right_derivative = mul(mul(mul(x, 0.5), rsub(square(t), 1)), dinner);
  return add(left_derivative, right_derivative);
}

struct GeluBackward final : Node {
  bool tanh_approx = false;
  SavedTensor self;
  const char* name() const override { return "GeluBackward"; }
  TensorList apply(TensorList&& g) override {
    const Tensor x = self.unpack(*this);
    return {mul(g[0], tanh_approx ? gelu_tanh_derivative(x) : gelu_erf_derivative(x))};
  }
  void release_variables() override { self.release(); }
};

void record_gelu(const RecordArgs& r) {
  auto n = new_node<GeluBackward>(r);
  n->tanh_approx = r.attrs.flag;
  n->self = SavedTensor(r.in(0), false);
  commit(n, r);
}

/// x ** e: e x^(e-1), and exactly zero for e == 0 (as PyTorch, even where x^-1 is inf).
struct PowScalarBackward final : Node {
  Scalar exponent;
  SavedTensor self;
  const char* name() const override { return "PowBackward"; }
  TensorList apply(TensorList&& g) override {
    if (exponent.to_double() == 0.0) return {zeros_like(g[0])};
    const Tensor x = self.unpack(*this);
    const Scalar em1 = exponent.is_floating() ? Scalar(exponent.to_double() - 1)
                                              : Scalar(exponent.to_int() - 1);
    return {mul(g[0], mul(pow(x, em1), exponent))};
  }
  void release_variables() override { self.release(); }
};

void record_pow_scalar(const RecordArgs& r) {
  auto n = new_node<PowScalarBackward>(r);
  n->exponent = r.attrs.scalar;
  if (n->exponent.to_double() != 0.0) n->self = SavedTensor(r.in(0), false);
  commit(n, r);
}

/// base ** x: y log(base). For base 0 PyTorch defines the gradient as 0 where x >= 0 (where
/// y log(base) would be 0 * -inf).
struct RPowScalarBackward final : Node {
  Scalar base;
  SavedTensor result, self;
  const char* name() const override { return "PowBackward"; }
  TensorList apply(TensorList&& g) override {
    const double b = base.to_double();
    Tensor d = mul(result.unpack(*this), std::log(b));
    if (b == 0.0) d = masked_fill(d, ge(self.unpack(*this), 0), 0);
    return {mul(g[0], d)};
  }
  void release_variables() override {
    result.release();
    self.release();
  }
};

void record_rpow_scalar(const RecordArgs& r) {
  auto n = new_node<RPowScalarBackward>(r);
  n->base = r.attrs.scalar;
  n->result = SavedTensor(r.out(0), true);
  if (n->base.to_double() == 0.0) n->self = SavedTensor(r.in(0), false);
  commit(n, r);
}

/// The gradient passes where min <= x <= max (inclusive, as PyTorch); NaN inputs get none.
struct ClampBackward final : Node {
  std::optional<Scalar> lo, hi;
  SavedTensor self;
  const char* name() const override { return "ClampBackward"; }
  TensorList apply(TensorList&& g) override {
    const Tensor x = self.unpack(*this);
    Tensor pass;
    if (lo) pass = ge(x, *lo);
    if (hi) pass = pass.defined() ? logical_and(pass, le(x, *hi)) : le(x, *hi);
    return {where(pass, g[0], 0.0)};
  }
  void release_variables() override { self.release(); }
};

void record_clamp(const RecordArgs& r) {
  auto n = new_node<ClampBackward>(r);
  if (r.attrs.has_lo) n->lo = r.attrs.opt_lo;
  if (r.attrs.has_hi) n->hi = r.attrs.opt_hi;
  n->self = SavedTensor(r.in(0), false);
  commit(n, r);
}

// ---- binary -----------------------------------------------------------------------------------
// g has the broadcast output's shape; the engine sums each result back to its input's shape.

/// a + alpha * b and a - alpha * b: the gradient passes through (scaled for b).
struct AddBackward final : Node {
  Scalar alpha;
  const char* name() const override { return "AddBackward"; }
  TensorList apply(TensorList&& g) override {
    TensorList r(2);
    if (needs_input_grad(0)) r[0] = g[0];
    if (needs_input_grad(1)) r[1] = alpha.to_double() == 1.0 ? g[0] : mul(g[0], alpha);
    return r;
  }
};

void record_add(const RecordArgs& r) {
  auto n = new_node<AddBackward>(r);
  n->alpha = r.op == OpId::Sub ? negated(r.attrs.scalar) : r.attrs.scalar;
  commit(n, r);
}

struct MulBackward final : Node {
  SavedTensor self, other;
  const char* name() const override { return "MulBackward"; }
  TensorList apply(TensorList&& g) override {
    TensorList r(2);
    if (needs_input_grad(0)) r[0] = mul(g[0], other.unpack(*this));
    if (needs_input_grad(1)) r[1] = mul(g[0], self.unpack(*this));
    return r;
  }
  void release_variables() override {
    self.release();
    other.release();
  }
};

void record_mul(const RecordArgs& r) {
  auto n = new_node<MulBackward>(r);
  if (n->needs_input_grad(0)) n->other = SavedTensor(r.in(1), false);
  if (n->needs_input_grad(1)) n->self = SavedTensor(r.in(0), false);
  commit(n, r);
}

/// a / b: g / b and -g a / b^2 (computed as (a / b) / b, as PyTorch, to delay overflow).
struct DivBackward final : Node {
  SavedTensor self, other;
  const char* name() const override { return "DivBackward"; }
  TensorList apply(TensorList&& g) override {
    TensorList r(2);
    const Tensor b = other.unpack(*this);
    if (needs_input_grad(0)) r[0] = div(g[0], b);
    if (needs_input_grad(1)) r[1] = mul(neg(g[0]), div(div(self.unpack(*this), b), b));
    return r;
  }
  void release_variables() override {
    self.release();
    other.release();
  }
};

void record_div(const RecordArgs& r) {
  auto n = new_node<DivBackward>(r);
  n->other = SavedTensor(r.in(1), false);
  if (n->needs_input_grad(1)) n->self = SavedTensor(r.in(0), false);
  commit(n, r);
}

/// a ** b. For a: b a^(b-1), zero where b == 0. For b: y log(a), zero where a == 0 and b >= 0
/// (PyTorch's pow_backward_self / pow_backward_exponent).
struct PowBackward final : Node {
  SavedTensor self, exponent, result;
  const char* name() const override { return "PowBackward"; }
  TensorList apply(TensorList&& g) override {
    TensorList r(2);
    const Tensor a = self.unpack(*this);
    const Tensor b = exponent.unpack(*this);
    if (needs_input_grad(0)) {
      r[0] = masked_fill(mul(g[0], mul(b, pow(a, sub(b, 1)))), eq(b, 0), 0);
    }
    if (needs_input_grad(1)) {
      const Tensor d = mul(result.unpack(*this), log(a));
      r[1] = mul(g[0], masked_fill(d, logical_and(eq(a, 0), ge(b, 0)), 0));
    }
    return r;
  }
  void release_variables() override {
    self.release();
    exponent.release();
    result.release();
  }
};

void record_pow(const RecordArgs& r) {
  auto n = new_node<PowBackward>(r);
  n->self = SavedTensor(r.in(0), false);
  n->exponent = SavedTensor(r.in(1), false);
  if (n->needs_input_grad(1)) n->result = SavedTensor(r.out(0), true);
  commit(n, r);
}

/// maximum / minimum: the gradient goes to the selected input; ties give half to each.
struct MaxMinBackward final : Node {
  bool is_max = true;
  SavedTensor self, other;
  const char* name() const override { return is_max ? "MaximumBackward" : "MinimumBackward"; }
  TensorList apply(TensorList&& g) override {
    TensorList r(2);
    const Tensor a = self.unpack(*this);
    const Tensor b = other.unpack(*this);
    const Tensor shared = where(eq(a, b), mul(g[0], 0.5), g[0]);
    // a loses where it is smaller (maximum) / larger (minimum), b the other way round.
    if (needs_input_grad(0)) r[0] = masked_fill(shared, is_max ? lt(a, b) : gt(a, b), 0);
    if (needs_input_grad(1)) r[1] = masked_fill(shared, is_max ? gt(a, b) : lt(a, b), 0);
    return r;
  }
  void release_variables() override {
    self.release();
    other.release();
  }
};

void record_max_min(const RecordArgs& r) {
  auto n = new_node<MaxMinBackward>(r);
  n->is_max = r.op == OpId::Maximum;
  n->self = SavedTensor(r.in(0), false);
  n->other = SavedTensor(r.in(1), false);
  commit(n, r);
}

// ---- tensor op scalar -------------------------------------------------------------------------

/// x + s and x - s.
struct IdentityBackward final : Node {
  const char* name() const override { return "AddBackward"; }
  TensorList apply(TensorList&& g) override { return {std::move(g[0])}; }
};

struct MulScalarBackward final : Node {
  Scalar s;
  const char* name() const override { return "MulBackward"; }
  TensorList apply(TensorList&& g) override { return {mul(g[0], s)}; }
};

void record_mul_scalar(const RecordArgs& r) {
  auto n = new_node<MulScalarBackward>(r);
  n->s = r.attrs.scalar;
  commit(n, r);
}

struct DivScalarBackward final : Node {
  Scalar s;
  const char* name() const override { return "DivBackward"; }
  TensorList apply(TensorList&& g) override { return {div(g[0], s)}; }
};

void record_div_scalar(const RecordArgs& r) {
  auto n = new_node<DivScalarBackward>(r);
  n->s = r.attrs.scalar;
  commit(n, r);
}

/// s - x.
struct RSubScalarBackward final : Node {
  const char* name() const override { return "RsubBackward"; }
  TensorList apply(TensorList&& g) override { return {neg(g[0])}; }
};

/// s / x: -s / x^2.
struct RDivScalarBackward final : Node {
  Scalar s;
  SavedTensor self;
  const char* name() const override { return "RdivBackward"; }
  TensorList apply(TensorList&& g) override {
    return {div(mul(g[0], negated(s)), square(self.unpack(*this)))};
  }
  void release_variables() override { self.release(); }
};

void record_rdiv_scalar(const RecordArgs& r) {
  auto n = new_node<RDivScalarBackward>(r);
  n->s = r.attrs.scalar;
  n->self = SavedTensor(r.in(0), false);
  commit(n, r);
}

// ---- selection --------------------------------------------------------------------------------

/// where(cond, a, b): g where cond holds to a, elsewhere to b; nothing to cond.
struct WhereBackward final : Node {
  SavedTensor cond;
  const char* name() const override { return "WhereBackward"; }
  TensorList apply(TensorList&& g) override {
    TensorList r(3);
    const Tensor c = cond.unpack(*this);
    if (needs_input_grad(1)) r[1] = where(c, g[0], 0.0);
    if (needs_input_grad(2)) r[2] = masked_fill(g[0], c, 0);
    return r;
  }
  void release_variables() override { cond.release(); }
};

void record_where(const RecordArgs& r) {
  auto n = new_node<WhereBackward>(r);
  n->cond = SavedTensor(r.in(0), false);
  commit(n, r);
}

/// masked_fill(x, mask, v): g except at filled positions; nothing to mask.
struct MaskedFillBackward final : Node {
  SavedTensor mask;
  const char* name() const override { return "MaskedFillBackward"; }
  TensorList apply(TensorList&& g) override {
    return {masked_fill(g[0], mask.unpack(*this), 0), Tensor()};
  }
  void release_variables() override { mask.release(); }
};

void record_masked_fill(const RecordArgs& r) {
  auto n = new_node<MaskedFillBackward>(r);
  n->mask = SavedTensor(r.in(1), false);
  commit(n, r);
}

template <typename N>
void record_plain(const RecordArgs& r) {
  commit(new_node<N>(r), r);
}

}  // namespace

void register_elementwise(FactoryTable& t) {
  for (OpId op : {OpId::Neg, OpId::Abs, OpId::Sign, OpId::Exp, OpId::Log, OpId::Log1p,
                  OpId::Sqrt, OpId::Rsqrt, OpId::Reciprocal, OpId::Square, OpId::Sin, OpId::Cos,
                  OpId::Tanh, OpId::Sigmoid, OpId::Relu, OpId::Silu}) {
    slot(t, op) = record_unary;
  }
  slot(t, OpId::Gelu) = record_gelu;
  slot(t, OpId::PowScalar) = record_pow_scalar;
  slot(t, OpId::RPowScalar) = record_rpow_scalar;
  slot(t, OpId::Clamp) = record_clamp;
  slot(t, OpId::Add) = record_add;
  slot(t, OpId::Sub) = record_add;
  slot(t, OpId::Mul) = record_mul;
  slot(t, OpId::Div) = record_div;
  slot(t, OpId::Pow) = record_pow;
  slot(t, OpId::Maximum) = record_max_min;
  slot(t, OpId::Minimum) = record_max_min;
  slot(t, OpId::AddScalar) = record_plain<IdentityBackward>;
  slot(t, OpId::MulScalar) = record_mul_scalar;
  slot(t, OpId::DivScalar) = record_div_scalar;
  slot(t, OpId::RSubScalar) = record_plain<RSubScalarBackward>;
  slot(t, OpId::RDivScalar) = record_rdiv_scalar;
  slot(t, OpId::Where) = record_where;
  slot(t, OpId::MaskedFill) = record_masked_fill;
}

}  // namespace ember::autograd
