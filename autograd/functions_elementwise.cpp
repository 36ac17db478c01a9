// Backward nodes of the element-wise ops (tensor/ops/elementwise.h). The rules of the unary and
// binary tables sit beside their forward functors in tensor/detail/unary_ops.h and binary_ops.h,
// and their nodes are generated here from the tables; the rest (tensor-scalar forms, gelu, clamp,
// where, masked_fill) are written here.
//
// The formulas and subgradient choices follow PyTorch's tools/autograd/derivatives.yaml, and
// so does the choice of what to save (input or output): it decides which later in-place
// changes backward can survive, so it should match what PyTorch users expect.
#include <cmath>
#include <optional>
#include <variant>

#include <ember/autograd/detail/functions.h>
#include <ember/tensor/ops.h>

namespace ember::autograd {
namespace {

using detail::negated;

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
// The ops of the binary table (tensor/detail/binary_ops.h): one node type, told by a spec which
// tensors to save for which gradient and which functor's vjp to run. g has the broadcast
// output's shape; the engine sums each result back to its input's shape.

using detail::BinaryGrads;
using detail::BinaryVjpArgs;
using detail::SavedFor;

struct BinarySpec {
  const char* name;
  SavedFor a, b, out;
  BinaryGrads (*vjp)(const BinaryVjpArgs&);
};

#define EMBER_BINARY_SPEC_(Op, name, dom, save_a, save_b, save_out, ...)                    \
  BinarySpec{#Op "Backward", SavedFor::save_a, SavedFor::save_b, SavedFor::save_out,      \
             &detail::fn::Op::vjp},
/// Indexed by BinaryOp (= the op's place in the table).
constexpr BinarySpec kBinarySpecs[] = {EMBER_BINARY_OPS(EMBER_BINARY_SPEC_)};
#undef EMBER_BINARY_SPEC_

struct BinaryBackward final : Node {
  const BinarySpec* spec = nullptr;
  Scalar alpha{1};  ///< Add and Sub only
  SavedTensor a, b, out;
  const char* name() const override { return spec->name; }
  TensorList apply(TensorList&& g) override {
    auto unpack = [&](const SavedTensor& s) { return s.defined() ? s.unpack(*this) : Tensor(); };
    const Tensor ta = unpack(a), tb = unpack(b), tout = unpack(out);
    BinaryGrads r = spec->vjp(
        {g[0], ta, tb, tout, needs_input_grad(0), needs_input_grad(1), alpha});
    return {std::move(r.a), std::move(r.b)};
  }
  void release_variables() override {
    a.release();
    b.release();
    out.release();
  }
};

void record_binary(const RecordArgs& r) {
  auto n = new_node<BinaryBackward>(r);
  n->spec = &kBinarySpecs[static_cast<size_t>(detail::binary_op_of(r.op))];
  const unsigned wanted = (n->needs_input_grad(0) ? static_cast<unsigned>(SavedFor::GradA) : 0) |
                          (n->needs_input_grad(1) ? static_cast<unsigned>(SavedFor::GradB) : 0);
  auto saved_for = [&](SavedFor s) { return (static_cast<unsigned>(s) & wanted) != 0; };
  if (saved_for(n->spec->a)) n->a = SavedTensor(r.in(0), false);
  if (saved_for(n->spec->b)) n->b = SavedTensor(r.in(1), false);
  if (saved_for(n->spec->out)) n->out = SavedTensor(r.out(0), true);
  // The binary ops' only attribute is Add's and Sub's alpha.
  if (const auto* s = std::get_if<ScalarAttrs>(&r.attrs_variant)) n->alpha = s->scalar;
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
#define EMBER_BINARY_SLOT_(Op, ...) slot(t, OpId::Op) = record_binary;
  EMBER_BINARY_OPS(EMBER_BINARY_SLOT_)
#undef EMBER_BINARY_SLOT_
  slot(t, OpId::Gelu) = record_gelu;
  slot(t, OpId::PowScalar) = record_pow_scalar;
  slot(t, OpId::RPowScalar) = record_rpow_scalar;
  slot(t, OpId::Clamp) = record_clamp;
  slot(t, OpId::AddScalar) = record_plain<IdentityBackward>;
  slot(t, OpId::MulScalar) = record_mul_scalar;
  slot(t, OpId::DivScalar) = record_div_scalar;
  slot(t, OpId::RSubScalar) = record_plain<RSubScalarBackward>;
  slot(t, OpId::RDivScalar) = record_rdiv_scalar;
  slot(t, OpId::Where) = record_where;
  slot(t, OpId::MaskedFill) = record_masked_fill;
}

}  // namespace ember::autograd
