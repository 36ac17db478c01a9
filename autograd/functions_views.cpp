// Backward rules of the view and copy ops (tensor/tensor.h methods).
#include "autograd/functions.h"
#include "tensor/ops.h"

namespace ember::autograd {
namespace {

/// clone(), contiguous() and the identity node of in-place ops: the gradient passes through.
struct CloneBackward final : Node {
  const char* name() const override { return "CloneBackward"; }
  TensorList apply(TensorList&& g) override { return {std::move(g[0])}; }
};

/// self.copy_(src): the gradient goes to src (broadcast dims summed, dtype and device
/// converted back by the engine / here).
struct CopyBackward final : Node {
  Device src_device;
  const char* name() const override { return "CopyBackward"; }
  TensorList apply(TensorList&& g) override {
    return {g[0].device() == src_device ? g[0] : g[0].to(src_device)};
  }
};

/// to(dtype / device): the gradient goes back to the input's dtype and device.
struct ToCopyBackward final : Node {
  Device device;
  Dtype dtype = kFloat32;
  const char* name() const override { return "ToCopyBackward"; }
  TensorList apply(TensorList&& g) override { return {g[0].to(device, dtype)}; }
};

/// view / reshape / squeeze / unsqueeze: the same elements in the input's shape.
struct ViewBackward final : Node {
  Shape in_shape;
  const char* name() const override { return "ViewBackward"; }
  TensorList apply(TensorList&& g) override { return {g[0].reshape(in_shape)}; }
};

/// expand: the engine sums broadcast dims back to the input's shape.
struct ExpandBackward final : Node {
  Shape in_shape;
  const char* name() const override { return "ExpandBackward"; }
  TensorList apply(TensorList&& g) override { return {sum_to(g[0], in_shape)}; }
};

/// permute / transpose: the inverse permutation.
struct PermuteBackward final : Node {
  Shape inverse;
  const char* name() const override { return "PermuteBackward"; }
  TensorList apply(TensorList&& g) override { return {g[0].permute(inverse)}; }
};

/// The gradient of x.slice(dim, start, end, step) for x of shape in_shape: g placed at the
/// sliced positions of a zero tensor. Under create_graph it is built from differentiable ops
/// (cat and views) instead of a copy into a zero tensor, so it can be differentiated again.
Tensor slice_backward(const Tensor& g, const Shape& in_shape, int64_t dim, int64_t start,
                      int64_t end, int64_t step) {
  if (!GradMode::is_enabled()) {
    Tensor z = zeros(in_shape, g.options());
    z.slice(dim, start, end, step).copy_(g);
    return z;
  }
  auto zeros_with = [&](int64_t d, int64_t n, const Shape& like) {
    Shape s = like;
    s[d] = n;
    return zeros(s, g.options());
  };
  Tensor spread = g;
  if (step > 1) {
    // Interleave step-1 zero rows after every row, then trim to end - start rows.
    Tensor u = g.unsqueeze(dim + 1);
    spread = cat({u, zeros_with(dim + 1, step - 1, u.shape())}, dim + 1);
    Shape flat = g.shape();
    flat[dim] = g.size(dim) * step;
    spread = spread.reshape(flat).narrow(dim, 0, end - start);
  }
  std::vector<Tensor> parts;
  if (start > 0) parts.push_back(zeros_with(dim, start, spread.shape()));
  parts.push_back(spread);
  if (end < in_shape[dim]) parts.push_back(zeros_with(dim, in_shape[dim] - end, spread.shape()));
  return parts.size() == 1 ? spread : cat(parts, dim);
}

struct SliceBackward final : Node {
  Shape in_shape;
  int64_t dim = 0, start = 0, end = 0, step = 1;
  const char* name() const override { return "SliceBackward"; }
  TensorList apply(TensorList&& g) override {
    return {slice_backward(g[0], in_shape, dim, start, end, step)};
  }
};

struct SelectBackward final : Node {
  Shape in_shape;
  int64_t dim = 0, index = 0;
  const char* name() const override { return "SelectBackward"; }
  TensorList apply(TensorList&& g) override {
    return {slice_backward(g[0].unsqueeze(dim), in_shape, dim, index, index + 1, 1)};
  }
};

void record_permute(const RecordArgs& r) {
  auto n = new_node<PermuteBackward>(r);
  const Shape& p = r.attrs.dims;
  n->inverse = p;
  for (int64_t i = 0; i < static_cast<int64_t>(p.size()); ++i) n->inverse[p[i]] = i;
  commit(n, r);
}

void record_slice(const RecordArgs& r) {
  auto n = new_node<SliceBackward>(r);
  n->in_shape = r.in(0).shape();
  n->dim = r.attrs.dim;
  n->start = r.attrs.i0;
  n->end = r.attrs.i1;
  n->step = r.attrs.i2;
  commit(n, r);
}

void record_select(const RecordArgs& r) {
  auto n = new_node<SelectBackward>(r);
  n->in_shape = r.in(0).shape();
  n->dim = r.attrs.dim;
  n->index = r.attrs.i0;
  commit(n, r);
}

void record_view(const RecordArgs& r) {
  auto n = new_node<ViewBackward>(r);
  n->in_shape = r.in(0).shape();
  commit(n, r);
}

void record_expand(const RecordArgs& r) {
  auto n = new_node<ExpandBackward>(r);
  n->in_shape = r.in(0).shape();
  commit(n, r);
}

void record_to(const RecordArgs& r) {
  auto n = new_node<ToCopyBackward>(r);
  n->device = r.in(0).device();
  n->dtype = r.in(0).dtype();
  commit(n, r);
}

void record_copy(const RecordArgs& r) {
  auto n = new_node<CopyBackward>(r);
  n->src_device = r.in(0).device();
  commit(n, r);
}

}  // namespace

void register_views(FactoryTable& t) {
  slot(t, OpId::Clone) = [](const RecordArgs& r) { commit(new_node<CloneBackward>(r), r); };
  slot(t, OpId::CopyInto) = record_copy;
  slot(t, OpId::ToCopy) = record_to;
  slot(t, OpId::ViewAs) = record_view;
  slot(t, OpId::Expand) = record_expand;
  slot(t, OpId::Permute) = record_permute;
  slot(t, OpId::Slice) = record_slice;
  slot(t, OpId::Select) = record_select;
}

}  // namespace ember::autograd
