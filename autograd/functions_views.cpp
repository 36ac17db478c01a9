// Backward rules of the view and copy ops (tensor/tensor.h methods).
#include <algorithm>
#include <utility>
#include <vector>

#include <ember/autograd/detail/functions.h>
#include <ember/tensor/ops.h>

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

/// split / split_with_sizes / chunk: one node for every part, whose gradients (zeros filled in
/// by the engine for parts without one) are concatenated back along dim in one pass.
struct SplitBackward final : Node {
  int64_t dim = 0;
  const char* name() const override { return "SplitBackward"; }
  TensorList apply(TensorList&& g) override {
    return {cat(g, dim)};
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

/// Whether a strided geometry may address one storage element from two positions: with size-1
/// dims dropped and the rest sorted by stride, each stride must exceed the span of the smaller
/// ones (PyTorch's _maybe_overlapping_memory test; a "maybe" only errs on the safe side).
bool maybe_overlapping(const Shape& sizes, const Shape& strides) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (int64_t d = 0; d < static_cast<int64_t>(sizes.size()); ++d) {
    if (sizes[d] == 0) return false;
    if (sizes[d] > 1) dims.emplace_back(strides[d], sizes[d]);
  }
  std::sort(dims.begin(), dims.end());
  int64_t span = 0;  // the largest offset the dims so far reach
  for (const auto& [stride, size] : dims) {
    if (stride <= span) return true;
    span += (size - 1) * stride;
  }
  return false;
}

/// Storage elements a non-empty geometry needs from offset 0: offset + 1 + its span.
int64_t extent(const Shape& sizes, const Shape& strides, int64_t offset) {
  int64_t n = offset + 1;
  for (int64_t d = 0; d < static_cast<int64_t>(sizes.size()); ++d) n += (sizes[d] - 1) * strides[d];
  return n;
}

/// x.as_strided(sizes, strides, offset). Both geometries address the same storage, so the rule
/// works on a flat buffer covering both (PyTorch's as_strided_backward): the output's gradient
/// is added at each output element's storage position (index_add_, so positions the output
/// reaches more than once, e.g. through stride 0, sum their gradients), and the input's gradient
/// is the buffer read back through the input's geometry. Positions the input reaches more than
/// once (x itself overlapping, e.g. an expanded tensor) share their gradient evenly, so that
/// summing back through x's own history counts it once.
struct AsStridedBackward final : Node {
  Shape in_sizes, in_strides, out_sizes, out_strides;
  int64_t in_offset = 0, out_offset = 0;
  const char* name() const override { return "AsStridedBackward"; }
  TensorList apply(TensorList&& g) override {
    const Tensor& grad = g[0];
    if (in_sizes.numel() == 0 || grad.numel() == 0) return {zeros(in_sizes, grad.options())};
    const int64_t base = std::min(in_offset, out_offset);
    const int64_t in_off = in_offset - base, out_off = out_offset - base;
    const int64_t n = std::max(extent(in_sizes, in_strides, in_off),
                               extent(out_sizes, out_strides, out_off));
    Tensor buffer = zeros({n}, grad.options());
    const bool out_overlap = maybe_overlapping(out_sizes, out_strides);
    const bool in_overlap = maybe_overlapping(in_sizes, in_strides);
    Tensor positions;  // storage position of every buffer element
    if (out_overlap || in_overlap || GradMode::is_enabled()) {
      positions = arange(0, n, 1, TensorOptions(kInt64).device(grad.device()));
    }
    if (!out_overlap && !GradMode::is_enabled()) {
      buffer.as_strided(out_sizes, out_strides, out_off).copy_(grad);
    } else {
      // Recorded under create_graph (the in-place scatter into a fresh buffer records itself).
      const Tensor at = positions.as_strided(out_sizes, out_strides, out_off).reshape({-1});
      index_add_(buffer, 0, at, grad.reshape({-1}));
    }
    if (in_overlap) {
      const Tensor at = positions.as_strided(in_sizes, in_strides, in_off).reshape({-1});
      Tensor count = zeros({n}, grad.options());
      index_add_(count, 0, at, ones({at.numel()}, grad.options()));
      // Positions the input does not reach count 0; 1 keeps them finite (they are never read,
      // but a nan there would leak into a double backward).
      buffer = div(buffer, clamp_min(count, 1));
    }
    return {buffer.as_strided(in_sizes, in_strides, in_off)};
  }
};

void record_as_strided(const RecordArgs& r) {
  auto n = new_node<AsStridedBackward>(r);
  const Tensor& in = r.in(0);
  const Tensor& out = r.out(0);
  n->in_sizes = in.shape();
  n->in_strides = in.strides();
  n->in_offset = in.storage_offset();
  n->out_sizes = out.shape();
  n->out_strides = out.strides();
  n->out_offset = out.storage_offset();
  commit(n, r);
}

void record_permute(const RecordArgs& r) {
  auto n = new_node<PermuteBackward>(r);
  const Shape& p = r.attrs<OpId::Permute>().dims;
  n->inverse = p;
  for (int64_t i = 0; i < static_cast<int64_t>(p.size()); ++i) n->inverse[p[i]] = i;
  commit(n, r);
}

void record_slice(const RecordArgs& r) {
  auto n = new_node<SliceBackward>(r);
  n->in_shape = r.in(0).shape();
  const SliceAttrs& a = r.attrs<OpId::Slice>();
  n->dim = a.dim;
  n->start = a.start;
  n->end = a.end;
  n->step = a.step;
  commit(n, r);
}

void record_split(const RecordArgs& r) {
  auto n = new_node<SplitBackward>(r);
  n->dim = r.attrs<OpId::Split>().dim;
  commit(n, r);
}

void record_select(const RecordArgs& r) {
  auto n = new_node<SelectBackward>(r);
  n->in_shape = r.in(0).shape();
  n->dim = r.attrs<OpId::Select>().dim;
  n->index = r.attrs<OpId::Select>().index;
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
  slot(t, OpId::Split) = record_split;
  slot(t, OpId::AsStrided) = record_as_strided;
}

}  // namespace ember::autograd
