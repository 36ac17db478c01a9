// Backward rules of the reductions and softmax (tensor/ops/reduce.h). Formulas follow PyTorch's
// tools/autograd/derivatives.yaml (and FunctionsManual.cpp), including its subgradient choices:
// max/min/amax/amin over ties share the gradient evenly, max(dim)/min(dim) send it to the
// selected index, norms give 0 where the norm is 0.
#include <cmath>

#include <ember/autograd/detail/functions.h>
#include <ember/tensor/ops.h>

namespace ember::autograd {
namespace {

/// The reduced dims, wrapped; empty `dims` means every dim. A 0-d input has none (its dim 0
/// or -1 names the tensor itself).
Shape reduced_dims(const Shape& dims, int64_t in_dim) {
  Shape r;
  if (in_dim == 0) return r;
  if (dims.size() == 0) {
    for (int64_t d = 0; d < in_dim; ++d) r.push_back(d);
  } else {
    for (int64_t d : dims) r.push_back(d < 0 ? d + in_dim : d);
  }
  return r;
}

/// How many input elements each output element reduces.
int64_t reduced_numel(const Shape& in_shape, const Shape& dims) {
  int64_t n = 1;
  for (int64_t d : reduced_dims(dims, in_shape.size())) n *= in_shape[d];
  return n;
}

/// Re-inserts reduced dims (as size 1) so that g (an output-shaped gradient or a saved output)
/// broadcasts against the input. A full reduction without keepdim gives a 0-d tensor, which
/// broadcasts as it is.
Tensor unsqueeze_reduced(const Tensor& g, const Shape& dims, int64_t in_dim, bool keepdim) {
  if (keepdim || in_dim == 0 || dims.size() == 0) return g;
  bool reduced[kMaxDims] = {};
  for (int64_t d : dims) reduced[d < 0 ? d + in_dim : d] = true;
  Tensor r = g;
  for (int64_t d = 0; d < in_dim; ++d) {
    if (reduced[d]) r = r.unsqueeze(d);
  }
  return r;
}

/// What every reduction over `dims` keeps to put its gradient back into the input's shape.
struct ReduceNode : Node {
  Shape dims, in_shape;
  bool keepdim = false;
  /// t (output-shaped) with the reduced dims restored as size 1.
  Tensor restore(const Tensor& t) const {
    return unsqueeze_reduced(t, dims, in_shape.size(), keepdim);
  }
};

template <typename N>
std::shared_ptr<N> new_reduce_node(const RecordArgs& r, const ReduceAttrs& a) {
  auto n = new_node<N>(r);
  n->dims = a.dims;
  n->keepdim = a.keepdim;
  n->in_shape = r.in(0).shape();
  return n;
}

// ---- sum, mean --------------------------------------------------------------------------------

struct SumBackward final : ReduceNode {
  const char* name() const override { return "SumBackward"; }
  TensorList apply(TensorList&& g) override { return {restore(g[0]).expand(in_shape)}; }
};

/// Divides before expanding: the same values as PyTorch's expand-then-divide, on fewer elements.
struct MeanBackward final : ReduceNode {
  const char* name() const override { return "MeanBackward"; }
  TensorList apply(TensorList&& g) override {
    const int64_t n = reduced_numel(in_shape, dims);
    return {div(restore(g[0]), Scalar(static_cast<double>(n))).expand(in_shape)};
  }
};

// ---- prod -------------------------------------------------------------------------------------

/// For each element, the product of the other elements of its reduction slice, exactly and
/// with differentiable ops (so create_graph gives correct higher derivatives at zeros): the
/// reduced dims are moved last and flattened to n, and row j of an [..., n, n] matrix holds the
/// slice with element j replaced by 1. Costs n times the input's memory; used only for
/// double backward through a prod whose input has zeros.
Tensor prod_of_others_exact(const Tensor& x, const Shape& rdims) {
  const int64_t nd = x.dim();
  bool reduced[kMaxDims] = {};
  for (int64_t d : rdims) reduced[d] = true;
  Shape perm, kept_shape;
  int64_t n = 1;
  for (int64_t d = 0; d < nd; ++d) {
    if (!reduced[d]) {
      perm.push_back(d);
      kept_shape.push_back(x.size(d));
    }
  }
  for (int64_t d = 0; d < nd; ++d) {
    if (reduced[d]) {
      perm.push_back(d);
      n *= x.size(d);
    }
  }
  const Tensor xp = x.permute(perm);  // [kept..., reduced...]
  Shape flat = kept_shape;
  flat.push_back(n);
  Shape square = kept_shape;
  square.push_back(n);
  square.push_back(n);
  const Tensor rows = xp.reshape(flat).unsqueeze(-2).expand(square);  // rows[..., j, k] = x_k
  const Tensor eye_n = eye(n, {}, x.options());
  // Off the diagonal x_k, on it 1: the product over k of row j skips x_j.
  const Tensor others = prod(add(mul(rows, rsub(eye_n, 1)), eye_n), {-1});  // [kept..., n]
  Shape inverse = perm;
  for (int64_t i = 0; i < nd; ++i) inverse[perm[i]] = i;
  return others.reshape(xp.shape()).permute(inverse);
}

/// d prod / d x_j = product of the other elements of x_j's slice. Without zeros that is
/// result / x_j (PyTorch). With zeros (PyTorch's prod_safe_zeros_backward, here for any set of
/// dims): a slice with one zero sends the product of its non-zeros to the zero and nothing to
/// the rest; a slice with two or more zeros sends nothing.
struct ProdBackward final : ReduceNode {
  SavedTensor self, result;
  const char* name() const override { return "ProdBackward"; }
  TensorList apply(TensorList&& g) override {
    const Tensor x = self.unpack(*this);
    if (x.dim() == 0) return {g[0]};
    const Tensor gk = restore(g[0]);
    const Tensor is_zero = eq(x, 0);
    if (!any(is_zero).item<bool>()) return {mul(gk, div(restore(result.unpack(*this)), x))};
    const Shape rdims = reduced_dims(dims, x.dim());
    if (GradMode::is_enabled()) return {mul(gk, prod_of_others_exact(x, rdims))};
    const Tensor zf = is_zero.to(x.dtype());
    const Tensor safe = add(x, zf);                       // zeros replaced by 1
    const Tensor nonzero_prod = prod(safe, rdims, true);  // [slices]
    const Tensor zeros_in_slice = sum(zf, rdims, true);
    // Slices without zeros: nonzero_prod / x_j; the zero of a one-zero slice: nonzero_prod.
    const Tensor keep =
        logical_or(eq(zeros_in_slice, 0), logical_and(eq(zeros_in_slice, 1), is_zero));
    return {mul(gk, where(keep, div(nonzero_prod, safe), 0.0))};
  }
  void release_variables() override {
    self.release();
    result.release();
  }
};

void record_prod(const RecordArgs& r) {
  auto n = new_reduce_node<ProdBackward>(r, r.attrs<OpId::Prod>());
  n->self = SavedTensor(r.in(0), false);
  n->result = SavedTensor(r.out(0), true);
  commit(n, r);
}

// ---- max / min --------------------------------------------------------------------------------

/// max() / min() / amax / amin: the gradient is shared evenly by the elements equal to the
/// result (PyTorch's evenly_distribute_backward / scale_grad_by_count). The forward propagates
/// NaN, so a slice whose result is NaN gives its gradient to its NaN elements.
struct ExtremumBackward final : ReduceNode {
  const char* name_;
  SavedTensor self, result;
  explicit ExtremumBackward(const char* name) : name_(name) {}
  const char* name() const override { return name_; }
  TensorList apply(TensorList&& g) override {
    const Tensor x = self.unpack(*this);
    const Tensor yk = restore(result.unpack(*this));
    const Tensor mask = logical_or(eq(x, yk), ne(x, x)).to(g[0].dtype());
    const Tensor count = sum(mask, dims, /*keepdim=*/true);
    return {mul(div(restore(g[0]), count), mask)};
  }
  void release_variables() override {
    self.release();
    result.release();
  }
};

const char* extremum_name(OpId op) {
  switch (op) {
    case OpId::MaxAll: return "MaxBackward";
    case OpId::MinAll: return "MinBackward";
    case OpId::Amax: return "AmaxBackward";
    default: return "AminBackward";
  }
}

void record_extremum(const RecordArgs& r) {
  auto n = new_node<ExtremumBackward>(r, extremum_name(r.op));
  n->in_shape = r.in(0).shape();
  if (r.op == OpId::Amax || r.op == OpId::Amin) {
    const ReduceAttrs& a = r.attrs<OpId::Amax>();  // Amax and Amin
    n->dims = a.dims;
    n->keepdim = a.keepdim;
  }
  n->self = SavedTensor(r.in(0), false);
  n->result = SavedTensor(r.out(0), true);
  commit(n, r);
}

/// max(dim) / min(dim): the gradient goes to the selected index (PyTorch's
/// value_selecting_reduction_backward).
struct SelectedIndexBackward final : Node {
  const char* name_;
  SavedTensor indices;  // an integral output: saved as a plain tensor, it never has history
  Shape in_shape;
  int64_t dim = 0;
  bool keepdim = false;
  explicit SelectedIndexBackward(const char* name) : name_(name) {}
  const char* name() const override { return name_; }
  TensorList apply(TensorList&& g) override {
    if (in_shape.size() == 0) return {g[0]};
    const Tensor idx = indices.unpack(*this);
    const Tensor gk = keepdim ? g[0] : g[0].unsqueeze(dim);
    const Tensor ik = keepdim ? idx : idx.unsqueeze(dim);
    return {scatter_add(zeros(in_shape, gk.options()), dim, ik, gk)};
  }
  void release_variables() override { indices.release(); }
};

void record_extremum_dim(const RecordArgs& r) {
  auto n = new_node<SelectedIndexBackward>(r, r.op == OpId::MaxDim ? "MaxBackward" : "MinBackward");
  n->in_shape = r.in(0).shape();
  const DimAttrs& a = r.attrs<OpId::MaxDim>();  // MaxDim and MinDim
  n->dim = a.dim;
  n->keepdim = a.keepdim;
  n->indices = SavedTensor(r.out(1), false);
  commit(n, r);
}

// ---- var, std ---------------------------------------------------------------------------------

/// var: 2 / (N - correction) * g * (x - mean(x)); std: that times g / (2 std), 0 where std is
/// 0 (PyTorch's var_backward / std_backward). N - correction is clamped at 0 as in the forward,
/// so a slice with too few elements gets inf / nan like its result.
struct VarBackward final : ReduceNode {
  SavedTensor self, result;  // result: std only
  int64_t correction = 1;
  bool is_std = false;
  const char* name() const override { return is_std ? "StdBackward" : "VarBackward"; }
  TensorList apply(TensorList&& g) override {
    const Tensor x = self.unpack(*this);
    const int64_t dof = std::max<int64_t>(0, reduced_numel(in_shape, dims) - correction);
    const Tensor centered = sub(x, mean(x, dims, /*keepdim=*/true));
    Tensor scale;  // [slices]
    if (is_std) {
      const Tensor rk = restore(result.unpack(*this));
      scale = masked_fill(mul(div(restore(g[0]), rk), 1.0 / static_cast<double>(dof)), eq(rk, 0),
                          0.0);
    } else {
      scale = mul(restore(g[0]), 2.0 / static_cast<double>(dof));
    }
    return {mul(scale, centered)};
  }
  void release_variables() override {
    self.release();
    result.release();
  }
};

void record_var(const RecordArgs& r) {
  const VarAttrs& a = r.attrs<OpId::Var>();  // Var and Std
  auto n = new_reduce_node<VarBackward>(r, a.reduce);
  n->correction = a.correction;
  n->is_std = r.op == OpId::Std;
  n->self = SavedTensor(r.in(0), false);
  if (n->is_std) n->result = SavedTensor(r.out(0), true);
  commit(n, r);
}

// ---- norm -------------------------------------------------------------------------------------

/// PyTorch's norm_backward, case by case on p; the gradient is 0 where the norm is 0.
struct NormBackward final : ReduceNode {
  SavedTensor self, result;
  double p = 2.0;
  const char* name() const override { return "NormBackward"; }
  TensorList apply(TensorList&& g) override {
    const Tensor x = self.unpack(*this);
    if (p == 0.0) return {zeros_like(x)};
    const Tensor gk = restore(g[0]);
    if (p == 1.0) return {mul(sign(x), gk)};
    const Tensor nk = restore(result.unpack(*this));
    if (p == 2.0) return {mul(x, masked_fill(div(gk, nk), eq(nk, 0), 0.0))};
    if (std::isinf(p)) {
      // d max|x| (or min|x| for -inf): shared by the elements at the norm, as amax.
      const Tensor ax = abs(x);
      const Tensor mask = logical_or(eq(ax, nk), ne(ax, ax)).to(gk.dtype());
      const Tensor count = sum(mask, dims, /*keepdim=*/true);
      return {mul(sign(x), mul(div(gk, count), mask))};
    }
    if (p < 1.0) {
      // |x|^(p-1) is infinite at 0, where the subgradient is taken as 0.
      const Tensor scaled = masked_fill(mul(sign(x), pow(abs(x), p - 1.0)), eq(x, 0), 0.0);
      return {mul(scaled, mul(gk, pow(nk, 1.0 - p)))};
    }
    const Tensor scaled = p < 2.0 ? mul(sign(x), pow(abs(x), p - 1.0))
                                  : mul(x, pow(abs(x), p - 2.0));
    return {mul(scaled, masked_fill(div(gk, pow(nk, p - 1.0)), eq(nk, 0), 0.0))};
  }
  void release_variables() override {
    self.release();
    result.release();
  }
};

void record_norm(const RecordArgs& r) {
  const NormAttrs& a = r.attrs<OpId::Norm>();
  auto n = new_reduce_node<NormBackward>(r, a.reduce);
  n->p = a.p;
  n->self = SavedTensor(r.in(0), false);
  if (n->p != 0.0 && n->p != 1.0) n->result = SavedTensor(r.out(0), true);
  commit(n, r);
}

// ---- logsumexp, softmax, log_softmax ----------------------------------------------------------

/// g * exp(x - logsumexp(x)): the softmax over the reduced dims.
struct LogsumexpBackward final : ReduceNode {
  SavedTensor self, result;
  const char* name() const override { return "LogsumexpBackward"; }
  TensorList apply(TensorList&& g) override {
    const Tensor x = self.unpack(*this);
    return {mul(restore(g[0]), exp(sub(x, restore(result.unpack(*this)))))};
  }
  void release_variables() override {
    self.release();
    result.release();
  }
};

void record_logsumexp(const RecordArgs& r) {
  auto n = new_reduce_node<LogsumexpBackward>(r, r.attrs<OpId::Logsumexp>());
  n->self = SavedTensor(r.in(0), false);
  n->result = SavedTensor(r.out(0), true);
  commit(n, r);
}

/// softmax: y * (g - sum(g * y)); log_softmax: g - exp(y) * sum(g); sums over dim.
struct SoftmaxBackward final : Node {
  SavedTensor result;
  int64_t dim = 0;
  bool log = false;
  const char* name() const override { return log ? "LogSoftmaxBackward" : "SoftmaxBackward"; }
  TensorList apply(TensorList&& g) override {
    return {softmax_backward(g[0], result.unpack(*this), dim, log)};
  }
  void release_variables() override { result.release(); }
};

void record_softmax(const RecordArgs& r) {
  auto n = new_node<SoftmaxBackward>(r);
  n->dim = r.attrs<OpId::Softmax>().dim;  // Softmax and LogSoftmax
  n->log = r.op == OpId::LogSoftmax;
  n->result = SavedTensor(r.out(0), true);
  commit(n, r);
}

template <typename N>
void record_plain_reduce(const RecordArgs& r) {
  commit(new_reduce_node<N>(r, r.attrs<OpId::Sum>()), r);  // Sum and Mean
}

}  // namespace

void register_reduce(FactoryTable& t) {
  slot(t, OpId::Sum) = record_plain_reduce<SumBackward>;
  slot(t, OpId::Mean) = record_plain_reduce<MeanBackward>;
  slot(t, OpId::Prod) = record_prod;
  slot(t, OpId::MaxAll) = record_extremum;
  slot(t, OpId::MinAll) = record_extremum;
  slot(t, OpId::Amax) = record_extremum;
  slot(t, OpId::Amin) = record_extremum;
  slot(t, OpId::MaxDim) = record_extremum_dim;
  slot(t, OpId::MinDim) = record_extremum_dim;
  slot(t, OpId::Var) = record_var;
  slot(t, OpId::Std) = record_var;
  slot(t, OpId::Norm) = record_norm;
  slot(t, OpId::Logsumexp) = record_logsumexp;
  slot(t, OpId::Softmax) = record_softmax;
  slot(t, OpId::LogSoftmax) = record_softmax;
}

}  // namespace ember::autograd
