// Backward rules of the indexing and joining ops (tensor/ops/indexing.h).
//
// Gathers (index_select, gather, embedding) scatter their gradient back with index_add_ /
// scatter_add_ into fresh zeros; scatters (scatter_add, index_add_) gather it. The in-place
// scatters record themselves (tensor/ops/indexing.cpp), so under create_graph these rules are
// differentiable again.
#include <ember/autograd/detail/functions.h>
#include <ember/tensor/ops.h>

namespace ember::autograd {
namespace {

/// `t` zero-padded at the end of each dim up to `shape` (same number of dims, or 0-d vs one
/// element). Built with cat so it stays differentiable under create_graph.
Tensor pad_to(Tensor t, const Shape& shape) {
  if (t.shape() == shape) return t;
  if (t.dim() != static_cast<int64_t>(shape.size())) {
    // 0-d vs 1-d of one element (the index ops treat 0-d tensors as 1-d).
    t = shape.size() == 0 ? t.reshape(IntList{}) : t.reshape({t.numel()});
    if (t.shape() == shape) return t;
  }
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) == shape[d]) continue;
    Shape rest = t.shape();
    rest[d] = shape[d] - t.size(d);
    t = cat({t, zeros(rest, t.options())}, d);
  }
  return t;
}

// ---- gathers ----------------------------------------------------------------------------------

/// out = x.index_select(dim, index): grad_x = zeros.index_add_(dim, index, g).
struct IndexSelectBackward final : Node {
  SavedTensor index;
  Shape in_shape;
  int64_t dim = 0;
  const char* name() const override { return "IndexSelectBackward"; }
  TensorList apply(TensorList&& g) override {
    Tensor gx = zeros(in_shape, g[0].options());
    index_add_(gx, dim, index.unpack(*this), g[0]);
    return {gx, Tensor()};
  }
  void release_variables() override { index.release(); }
};

void record_index_select(const RecordArgs& r) {
  auto n = new_node<IndexSelectBackward>(r);
  n->index = SavedTensor(r.in(1), false);
  n->in_shape = r.in(0).shape();
  n->dim = r.attrs<OpId::IndexSelect>().dim;
  commit(n, r);
}

/// out = x.gather(dim, index): grad_x = zeros.scatter_add_(dim, index, g).
struct GatherBackward final : Node {
  SavedTensor index;
  Shape in_shape;
  int64_t dim = 0;
  const char* name() const override { return "GatherBackward"; }
  TensorList apply(TensorList&& g) override {
    Tensor gx = zeros(in_shape, g[0].options());
    scatter_add_(gx, dim, index.unpack(*this), g[0]);
    return {gx, Tensor()};
  }
  void release_variables() override { index.release(); }
};

void record_gather(const RecordArgs& r) {
  auto n = new_node<GatherBackward>(r);
  n->index = SavedTensor(r.in(1), false);
  n->in_shape = r.in(0).shape();
  n->dim = r.attrs<OpId::Gather>().dim;
  commit(n, r);
}

/// out = embedding(weight, indices): grad_weight sums the rows of g by id (embedding_backward,
/// which records itself, so this rule is differentiable).
struct EmbeddingBackward final : Node {
  SavedTensor indices;
  int64_t num_weights = 0;
  const char* name() const override { return "EmbeddingBackward"; }
  TensorList apply(TensorList&& g) override {
    return {embedding_backward(g[0], indices.unpack(*this), num_weights), Tensor()};
  }
  void release_variables() override { indices.release(); }
};

void record_embedding(const RecordArgs& r) {
  auto n = new_node<EmbeddingBackward>(r);
  n->indices = SavedTensor(r.in(1), false);
  n->num_weights = r.in(0).size(0);
  commit(n, r);
}

// ---- scatters ---------------------------------------------------------------------------------

/// out = self.scatter_add(dim, index, src): grad_self = g; grad_src = g.gather(dim, index),
/// zero where src is not covered by the index (index may be smaller than src).
struct ScatterAddBackward final : Node {
  SavedTensor index;
  Shape src_shape;
  int64_t dim = 0;
  const char* name() const override { return "ScatterAddBackward"; }
  TensorList apply(TensorList&& g) override {
    TensorList r(3);
    if (needs_input_grad(0)) r[0] = g[0];
    if (needs_input_grad(2)) r[2] = pad_to(gather(g[0], dim, index.unpack(*this)), src_shape);
    return r;
  }
  void release_variables() override { index.release(); }
};

void record_scatter_add(const RecordArgs& r) {
  auto n = new_node<ScatterAddBackward>(r);
  if (n->needs_input_grad(2)) n->index = SavedTensor(r.in(1), false);
  n->src_shape = r.in(2).shape();
  n->dim = r.attrs<OpId::ScatterAdd>().dim;
  commit(n, r);
}

/// self.index_add_(dim, index, src, alpha): grad_self = g;
/// grad_src = alpha * g.index_select(dim, index).
struct IndexAddBackward final : Node {
  SavedTensor index;
  Shape src_shape;
  int64_t dim = 0;
  Scalar alpha;
  const char* name() const override { return "IndexAddBackward"; }
  TensorList apply(TensorList&& g) override {
    TensorList r(3);
    if (needs_input_grad(0)) r[0] = g[0];
    if (needs_input_grad(2)) {
      Tensor gs = index_select(g[0], dim, index.unpack(*this));
      if (!(gs.shape() == src_shape)) gs = gs.reshape(src_shape);  // 0-d vs one element
      r[2] = alpha.to_double() == 1.0 ? gs : mul(gs, alpha);
    }
    return r;
  }
  void release_variables() override { index.release(); }
};

void record_index_add(const RecordArgs& r) {
  auto n = new_node<IndexAddBackward>(r);
  if (n->needs_input_grad(2)) n->index = SavedTensor(r.in(1), false);
  n->src_shape = r.in(2).shape();
  n->dim = r.attrs<OpId::IndexAdd>().dim;
  n->alpha = r.attrs<OpId::IndexAdd>().alpha;
  commit(n, r);
}

// ---- joining ----------------------------------------------------------------------------------

/// cat(tensors, dim): each input's gradient is its narrow of g. Inputs that cat skipped (1-d
/// and empty, PyTorch's legacy rule) get none.
struct CatBackward final : Node {
  int64_t dim = 0;
  std::vector<int64_t> sizes;  ///< each input's extent along dim; -1 for a skipped input
  const char* name() const override { return "CatBackward"; }
  TensorList apply(TensorList&& g) override {
    TensorList r(sizes.size());
    int64_t offset = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      if (sizes[i] < 0) continue;
      if (needs_input_grad(i)) r[i] = g[0].narrow(dim, offset, sizes[i]);
      offset += sizes[i];
    }
    return r;
  }
};

void record_cat(const RecordArgs& r) {
  auto n = new_node<CatBackward>(r);
  n->dim = r.attrs<OpId::Cat>().dim;
  n->sizes.reserve(r.n_inputs);
  for (size_t i = 0; i < r.n_inputs; ++i) {
    const Tensor& t = r.in(i);
    n->sizes.push_back(t.dim() == 1 && t.size(0) == 0 ? -1 : t.size(n->dim));
  }
  commit(n, r);
}

}  // namespace

void register_indexing(FactoryTable& t) {
  slot(t, OpId::IndexSelect) = record_index_select;
  slot(t, OpId::Gather) = record_gather;
  slot(t, OpId::Embedding) = record_embedding;
  slot(t, OpId::ScatterAdd) = record_scatter_add;
  slot(t, OpId::IndexAdd) = record_index_add;
  slot(t, OpId::Cat) = record_cat;
}

}  // namespace ember::autograd
