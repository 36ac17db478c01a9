// Backward nodes of the element-wise ops (tensor/elementwise.h). The unary ops' rules sit beside
// their forward functors in tensor/detail/unary_ops.h; the rest are here.
//
// The formulas and subgradient choices follow PyTorch's tools/autograd/derivatives.yaml, and
// so does the choice of what to save (input or output): it decides which later in-place
// changes backward can survive, so it should match what PyTorch users expect.
#include <cmath>
#include <optional>

#include <ember/autograd/functions.h>
#include <ember/tensor/ops.h>

namespace ember::autograd {
namespace {

Scalar negated(const Scalar& s) {
  return s.is_floating() ? Scalar(-s.to_double()) : Scalar(-s.to_int());
}

// ---- unary ------------------------------------------------------------------------------------
// The ops of the unary table (tensor/detail/unary_ops.h): one node type, told by a spec which
// tensor to save and which functor's vjp to run.

using detail::Saves;

struct UnarySpec {
  const char* name;
  Saves saves;
  /// The gradient from the incoming one and the saved tensor (undefined for Saves::Nothing).
  Tensor (*vjp)(const Tensor& g, const Tensor& saved);
};

#define EMBER_UNARY_SPEC_(Op, name, dom, saves, ...) \
  UnarySpec{#Op "Backward", Saves::saves, &detail::fn::Op::vjp},
/// Indexed by OpId: the table's ops come first in OpId (checked in tensor/detail/record.h).
constexpr UnarySpec kUnarySpecs[] = {EMBER_UNARY_OPS(EMBER_UNARY_SPEC_)};
#undef EMBER_UNARY_SPEC_

struct UnaryBackward final : Node {
  const UnarySpec* spec = nullptr;
  SavedTensor saved;
  const char* name() const override { return spec->name; }
  TensorList apply(TensorList&& g) override {
    return {spec->vjp(g[0], saved.defined() ? saved.unpack(*this) : Tensor())};
  }
  void release_variables() override { saved.release(); }
};

void record_unary(const RecordArgs& r) {
  auto n = new_node<UnaryBackward>(r);
  n->spec = &kUnarySpecs[static_cast<size_t>(r.op)];
  if (n->spec->saves == Saves::Input) n->saved = SavedTensor(r.in(0), false);
  if (n->spec->saves == Saves::Output) n->saved = SavedTensor(r.out(0), true);
  commit(n, r);
}

/// gelu: one op whose attribute picks the form; each form's rule sits beside its kernel.
struct GeluBackward final : Node {
  bool tanh_approx = false;
  SavedTensor self;
  const char* name() const override { return "GeluBackward"; }
  TensorList apply(TensorList&& g) override {
    const Tensor x = self.unpack(*this);
    return {tanh_approx ? detail::fn::GeluTanh::vjp(g[0], x) : detail::fn::GeluErf::vjp(g[0], x)};
  }
  void release_variables() override { self.release(); }
};

void record_gelu(const RecordArgs& r) {
  auto n = new_node<GeluBackward>(r);
  n->tanh_approx = r.attrs<OpId::Gelu>().tanh_approx;
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
  n->exponent = r.attrs<OpId::PowScalar>().scalar;
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
  n->base = r.attrs<OpId::RPowScalar>().scalar;
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
  n->lo = r.attrs<OpId::Clamp>().lo;
  n->hi = r.attrs<OpId::Clamp>().hi;
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
  const Scalar& alpha = r.attrs<OpId::Add>().scalar;  // Add and Sub
  n->alpha = r.op == OpId::Sub ? negated(alpha) : alpha;
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
  n->s = r.attrs<OpId::MulScalar>().scalar;
  commit(n, r);
}

struct DivScalarBackward final : Node {
  Scalar s;
  const char* name() const override { return "DivBackward"; }
  TensorList apply(TensorList&& g) override { return {div(g[0], s)}; }
};

void record_div_scalar(const RecordArgs& r) {
  auto n = new_node<DivScalarBackward>(r);
  n->s = r.attrs<OpId::DivScalar>().scalar;
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
  n->s = r.attrs<OpId::RDivScalar>().scalar;
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
#define EMBER_UNARY_SLOT_(Op, ...) slot(t, OpId::Op) = record_unary;
  EMBER_UNARY_OPS(EMBER_UNARY_SLOT_)
#undef EMBER_UNARY_SLOT_
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
