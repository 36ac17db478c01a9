// Backward rules of the matrix products (tensor/ops/linalg.h); convolution and pooling are in
// functions_conv.cpp.
//
// The rules are written with mm / matmul, so they are recorded under create_graph and can be
// differentiated again.
#include <ember/autograd/detail/functions.h>
#include <ember/tensor/ops.h>

namespace ember::autograd {
namespace {

// ---- matrix products --------------------------------------------------------------------------

// Whether a 2-d tensor is a column-major matrix (the transpose of a contiguous one, as
// linear's weight.t()).
bool column_major(const Tensor& t) {
  return t.dim() == 2 && t.size(0) > 1 && t.size(1) > 1 && t.stride(0) == 1 &&
         t.stride(1) == t.size(0);
}

// The gradients of a @ b given g, laid out like the operand they belong to (PyTorch's
// mm_mat1_backward / mm_mat2_backward): for linear's weight.t() the gradient is computed
// transposed, so that after TBackward the weight's gradient is contiguous and AccumulateGrad
// can take it without a copy.
Tensor mat1_grad(const Tensor& g, const Tensor& b, bool a_column_major) {
  if (a_column_major) return mm(b, g.t()).t();
  return mm(g, b.t());
}
Tensor mat2_grad(const Tensor& g, const Tensor& a, bool b_column_major) {
  if (b_column_major) return mm(g.t(), a).t();
  return mm(a.t(), g);
}

/// a [n, k] @ b [k, m]: grad_a = g @ b^T, grad_b = a^T @ g.
struct MmBackward final : Node {
  SavedTensor a, b;
  bool a_column_major = false, b_column_major = false;
  const char* name() const override { return "MmBackward"; }
  TensorList apply(TensorList&& g) override {
    TensorList r(2);
    if (needs_input_grad(0)) r[0] = mat1_grad(g[0], b.unpack(*this), a_column_major);
    if (needs_input_grad(1)) r[1] = mat2_grad(g[0], a.unpack(*this), b_column_major);
    return r;
  }
  void release_variables() override {
    a.release();
    b.release();
  }
};

/// a [..., n, k] @ b [..., k, m] with equal batch dims: bmm's [B, n, k] @ [B, k, m], and
/// matmul's broadcast case, which records its operands as expanded views (their Expand nodes
/// sum the gradients back over the broadcast batch dims).
struct BmmBackward final : Node {
  SavedTensor a, b;
  const char* name() const override { return "BmmBackward"; }
  TensorList apply(TensorList&& g) override {
    TensorList r(2);
    if (needs_input_grad(0)) r[0] = matmul(g[0], b.unpack(*this).transpose(-1, -2));
    if (needs_input_grad(1)) r[1] = matmul(a.unpack(*this).transpose(-1, -2), g[0]);
    return r;
  }
  void release_variables() override {
    a.release();
    b.release();
  }
};

void record_mm(const RecordArgs& r) {
  auto n = new_node<MmBackward>(r);
  if (n->needs_input_grad(0)) n->b = SavedTensor(r.in(1), false);
  if (n->needs_input_grad(1)) n->a = SavedTensor(r.in(0), false);
  n->a_column_major = column_major(r.in(0));
  n->b_column_major = column_major(r.in(1));
  commit(n, r);
}

template <typename N>
void record_product(const RecordArgs& r) {
  auto n = new_node<N>(r);
  if (n->needs_input_grad(0)) n->b = SavedTensor(r.in(1), false);
  if (n->needs_input_grad(1)) n->a = SavedTensor(r.in(0), false);
  commit(n, r);
}

/// beta * bias + alpha * (a @ b): grad_bias = beta * g (summed back to bias's shape by the
/// engine), grad_a = alpha * g @ b^T, grad_b = alpha * a^T @ g.
struct AddmmBackward final : Node {
  SavedTensor a, b;
  bool a_column_major = false, b_column_major = false;
  Scalar alpha{1}, beta{1};
  const char* name() const override { return "AddmmBackward"; }
  TensorList apply(TensorList&& g) override {
    auto scaled = [](Tensor t, const Scalar& s) { return s.to_double() == 1.0 ? t : mul(t, s); };
    TensorList r(3);
    if (needs_input_grad(0)) r[0] = scaled(g[0], beta);
    if (needs_input_grad(1)) r[1] = scaled(mat1_grad(g[0], b.unpack(*this), a_column_major), alpha);
    if (needs_input_grad(2)) r[2] = scaled(mat2_grad(g[0], a.unpack(*this), b_column_major), alpha);
    return r;
  }
  void release_variables() override {
    a.release();
    b.release();
  }
};

void record_addmm(const RecordArgs& r) {
  auto n = new_node<AddmmBackward>(r);
  n->alpha = r.attrs<OpId::Addmm>().alpha;
  n->beta = r.attrs<OpId::Addmm>().beta;
  if (n->needs_input_grad(1)) n->b = SavedTensor(r.in(2), false);
  if (n->needs_input_grad(2)) n->a = SavedTensor(r.in(1), false);
  n->a_column_major = column_major(r.in(1));
  n->b_column_major = column_major(r.in(2));
  commit(n, r);
}

}  // namespace

void register_linalg(FactoryTable& t) {
  slot(t, OpId::Mm) = record_mm;
  slot(t, OpId::Bmm) = record_product<BmmBackward>;
  slot(t, OpId::Addmm) = record_addmm;
}

}  // namespace ember::autograd
