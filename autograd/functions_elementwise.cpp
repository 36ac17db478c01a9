// Backward rules of the element-wise ops (tensor/elementwise.h).
#include "autograd/functions.h"
#include "tensor/ops.h"

namespace ember::autograd {
namespace {

// ---- binary -----------------------------------------------------------------------------------

/// a + alpha * b and a - alpha * b: the gradient passes through (scaled for b).
struct AddBackward final : Node {
  Scalar alpha;
  const char* name() const override { return "AddBackward"; }
  TensorList apply(TensorList&& g) override {
    TensorList r(2);
    if (needs_input_grad(0)) r[0] = g[0];
    if (needs_input_grad(1)) {
      const double a = alpha.to_double();
      r[1] = a == 1.0 ? g[0] : mul(g[0], alpha);
    }
    return r;
  }
};

void record_add(const RecordArgs& r) {
  auto n = new_node<AddBackward>(r);
  n->alpha = r.op == OpId::Sub ? Scalar(-r.attrs.scalar.to_double()) : r.attrs.scalar;
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

// ---- tensor op scalar -------------------------------------------------------------------------

struct IdentityBackward final : Node {
  const char* name() const override { return "AddBackward"; }
  TensorList apply(TensorList&& g) override { return {std::move(g[0])}; }
};

void record_identity(const RecordArgs& r) { commit(new_node<IdentityBackward>(r), r); }

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

struct RSubScalarBackward final : Node {
  const char* name() const override { return "RsubBackward"; }
  TensorList apply(TensorList&& g) override { return {neg(g[0])}; }
};

// ---- unary ------------------------------------------------------------------------------------

struct NegBackward final : Node {
  const char* name() const override { return "NegBackward"; }
  TensorList apply(TensorList&& g) override { return {neg(g[0])}; }
};

/// tanh: d/dx = 1 - y^2, from the saved output.
struct TanhBackward final : Node {
  SavedTensor result;
  const char* name() const override { return "TanhBackward"; }
  TensorList apply(TensorList&& g) override {
    const Tensor y = result.unpack(*this);
    return {mul(g[0], rsub(mul(y, y), 1))};
  }
  void release_variables() override { result.release(); }
};

void record_tanh(const RecordArgs& r) {
  auto n = new_node<TanhBackward>(r);
  n->result = SavedTensor(r.out(0), true);
  commit(n, r);
}

}  // namespace

void register_elementwise(FactoryTable& t) {
  slot(t, OpId::Add) = record_add;
  slot(t, OpId::Sub) = record_add;
  slot(t, OpId::Mul) = record_mul;
  slot(t, OpId::AddScalar) = record_identity;
  slot(t, OpId::MulScalar) = record_mul_scalar;
  slot(t, OpId::Neg) = [](const RecordArgs& r) { commit(new_node<NegBackward>(r), r); };
  slot(t, OpId::Tanh) = record_tanh;
  slot(t, OpId::RSubScalar) = [](const RecordArgs& r) { commit(new_node<RSubScalarBackward>(r), r); };
}

}  // namespace ember::autograd
