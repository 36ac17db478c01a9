// Front end of the index ops: validation and shape inference, then every op becomes a gather or
// a scatter loop over restrided views (see tensor/detail/indexing_kernels.h).
#include <ember/tensor/ops/indexing.h>

#include <algorithm>

#include <ember/tensor/ops/creation.h>
#include <ember/tensor/detail/indexing_kernels.h>
#include <ember/tensor/detail/overlap.h>
#include <ember/tensor/detail/record.h>

namespace ember {

using detail::check_defined;
using detail::GatherArgs;
using detail::IndexBound;
using detail::make_view;
using detail::ScatterArgs;

namespace {

void check_index(const char* op, const Tensor& self, const Tensor& index) {
  check_defined(op, index, "index");
  EMBER_CHECK_TYPE(TypeError, index.dtype() == kInt64 || index.dtype() == kInt32, "[", op,
                   "] expected an index tensor of dtype int64 (or int32), got ", index.dtype());
  EMBER_CHECK(index.device() == self.device(), "[", op,
              "] expected index on the same device as self (", self.device(), "), got index on ",
              index.device());
}

void check_src(const char* op, const Tensor& self, const Tensor& src) {
  check_defined(op, src, "src");
  EMBER_CHECK(src.device() == self.device(), "[", op,
              "] expected src on the same device as self (", self.device(), "), got src on ",
              src.device());
  EMBER_CHECK_TYPE(TypeError, src.dtype() == self.dtype(), "[", op,
                   "] expected src of self's dtype (", self.dtype(), "), got ", src.dtype());
}

// 0-d tensors index like 1-d tensors of one element.
Tensor as_1d(const Tensor& t) { return t.dim() == 0 ? t.view({1}) : t; }

// A view of t with the loop's sizes whose stride along dim is 0 (the index supplies it).
Tensor restride(const Tensor& t, const Shape& loop, int64_t dim) {
  Shape strides = t.strides();
  strides[dim] = 0;
  return make_view(t, loop, strides, t.storage_offset());
}

void run_gather(const GatherArgs& a) {
  if (a.out.numel() == 0) return;
  if (a.out.is_cuda()) {
    detail::gather_cuda(a);
  } else {
    detail::gather_cpu(a);
  }
}

void run_scatter(const ScatterArgs& a) {
  if (a.index.numel() == 0) return;
  if (a.self_r.is_cuda()) {
    detail::scatter_add_cuda(a);
  } else {
    detail::scatter_add_cpu(a);
  }
}

// t's entries at `index` (1-d or 0-d) along dim; op names the caller in messages.
Tensor index_select_impl(const char* op, const Tensor& t0, int64_t dim, const Tensor& index) {
  check_defined(op, t0, "self");
  check_index(op, t0, index);
  EMBER_CHECK(index.dim() <= 1, "[", op, "] expected a 1-d (or 0-d) index, got index of shape ",
              index.shape());
  const Tensor t = as_1d(t0);
  dim = wrap_dim(op, dim, t.dim());
  const Tensor idx = as_1d(index);
  Shape loop = t.shape();
  loop[dim] = idx.numel();
  Shape istrides = Shape::filled(loop.size(), 0);
  istrides[dim] = idx.stride(0);
  Tensor out = detail::make_empty(loop, t.dtype(), t.device());
  run_gather(GatherArgs{out, restride(t, loop, dim),
                        make_view(idx, loop, istrides, idx.storage_offset()), t.stride(dim),
                        IndexBound{op, dim, t.size(dim)}});
  return out;
}

// Validates self[index] += alpha * src along dim with a 1-d (or 0-d) index and describes it as
// a scatter (run it with run_scatter).
ScatterArgs index_add_args(const char* op, const Tensor& self0, int64_t dim, const Tensor& index,
                           const Tensor& src0, const Scalar& alpha) {
  check_defined(op, self0, "self");
  check_index(op, self0, index);
  check_src(op, self0, src0);
  EMBER_CHECK(index.dim() <= 1, "[", op, "] expected a 1-d (or 0-d) index, got index of shape ",
              index.shape());
  EMBER_CHECK_TYPE(TypeError, is_floating(self0.dtype()) || !alpha.is_floating(), "[", op,
                   "] alpha must be an integer for self of dtype ", self0.dtype(), ", got ",
                   alpha);
  const Tensor self = as_1d(self0);
  const Tensor src = as_1d(src0);
  const Tensor idx = as_1d(index);
  dim = wrap_dim(op, dim, self.dim());
  EMBER_CHECK(src.dim() == self.dim(), "[", op, "] expected src with as many dims as self (shape ",
              self.shape(), "), got src of shape ", src.shape());
  for (int64_t d = 0; d < self.dim(); ++d) {
    const int64_t want = d == dim ? idx.numel() : self.size(d);
    EMBER_CHECK(src.size(d) == want, "[", op, "] expected src of shape matching self (shape ",
                self.shape(), ") except along dim ", dim, " where it has the index's length (",
                idx.numel(), "), got src of shape ", src.shape());
  }
  const Shape loop = src.shape();
  Shape istrides = Shape::filled(loop.size(), 0);
  istrides[dim] = idx.stride(0);
  return ScatterArgs{restride(self, loop, dim), src,
                     make_view(idx, loop, istrides, idx.storage_offset()), dim, self.stride(dim),
                     alpha, IndexBound{op, dim, self.size(dim)}};
}

// Validates self[index[p]] += src[p] along dim (torch.scatter_add_) and describes it as a scatter.
ScatterArgs scatter_add_args(const char* op, const Tensor& self0, int64_t dim,
                             const Tensor& index0, const Tensor& src0) {
  check_defined(op, self0, "self");
  check_index(op, self0, index0);
  check_src(op, self0, src0);
  const Tensor self = as_1d(self0);
  const Tensor index = as_1d(index0);
  const Tensor src = as_1d(src0);
  dim = wrap_dim(op, dim, self.dim());
  EMBER_CHECK(index.dim() == self.dim() && src.dim() == self.dim(), "[", op,
              "] expected self, index and src with the same number of dims, got self of shape ",
              self.shape(), ", index of shape ", index.shape(), " and src of shape ", src.shape());
  for (int64_t d = 0; d < self.dim(); ++d) {
    EMBER_CHECK(index.size(d) <= src.size(d) && (d == dim || index.size(d) <= self.size(d)), "[",
                op, "] expected index (shape ", index.shape(),
                ") no larger than src (shape ", src.shape(), ") in every dim and than self (shape ",
                self.shape(), ") in every dim but ", dim, "; dim ", d, " differs");
  }
  const Shape loop = index.shape();
  return ScatterArgs{restride(self, loop, dim),
                     make_view(src, loop, src.strides(), src.storage_offset()), index, dim,
                     self.stride(dim), Scalar(1), IndexBound{op, dim, self.size(dim)}};
}

// The recorded form of an in-place scatter (scatter_add_, index_add_), for record_inplace: `s`
// is record_inplace's fresh copy of self, which nothing else sees, so the scatter runs in it
// directly (no second copy) and s becomes the op's output, recorded from {s, index, src}.
Tensor scatter_into_copy(OpId op, const Tensor& s, const ScatterArgs& args, const Tensor& index,
                         const Tensor& src, int64_t dim, const Scalar& alpha) {
  run_scatter(args);
  Tensor out = s;
  const OpAttrs attrs =
      op == OpId::IndexAdd ? OpAttrs(IndexAddAttrs{dim, alpha}) : OpAttrs(DimAttrs{dim});
  detail::record(op, {&s, &index, &src}, {&out}, attrs);
  return out;
}

}  // namespace

Tensor index_select(const Tensor& t, int64_t dim, const Tensor& index) {
  if (t.defined() && index.defined() && t.dim() == 0) {
    EMBER_CHECK(index.numel() == 1, "[index_select] index into a 0-d tensor must have one "
                "element, got index of shape ", index.shape());
  }
  Tensor out = index_select_impl("index_select", t, dim, index);
  if (t.dim() == 0) out = out.view(IntList{});  // as PyTorch: a 0-d self gives a 0-d result
  if (detail::should_record(t)) {
    detail::record<OpId::IndexSelect>({&t, &index}, {&out}, {.dim = dim});
  }
  return out;
}

Tensor gather(const Tensor& t0, int64_t dim, const Tensor& index0) {
  check_defined("gather", t0, "self");
  check_index("gather", t0, index0);
  const Tensor t = as_1d(t0);
  const Tensor index = as_1d(index0);
  dim = wrap_dim("gather", dim, t.dim());
  EMBER_CHECK(index.dim() == t.dim(), "[gather] expected index with as many dims as self (shape ",
              t0.shape(), "), got index of shape ", index0.shape());
  for (int64_t d = 0; d < t.dim(); ++d) {
    EMBER_CHECK(d == dim || index.size(d) <= t.size(d), "[gather] expected index (shape ",
                index.shape(), ") no larger than self (shape ", t.shape(), ") in every dim but ",
                dim, "; dim ", d, " is larger");
  }
  Tensor out = detail::make_empty(index.shape(), t.dtype(), t.device());
  run_gather(GatherArgs{out, restride(t, index.shape(), dim), index, t.stride(dim),
                        IndexBound{"gather", dim, t.size(dim)}});
  if (index0.dim() == 0) out = out.view(IntList{});
  if (detail::should_record(t0)) {
    detail::record<OpId::Gather>({&t0, &index0}, {&out}, {.dim = dim});
  }
  return out;
}

Tensor scatter_add(const Tensor& self, int64_t dim, const Tensor& index, const Tensor& src) {
  check_defined("scatter_add", self, "self");
  Tensor out;
  {
    NoGradGuard no_grad;  // the copy is part of this op, not a recorded clone
    out = self.clone();
  }
  run_scatter(scatter_add_args("scatter_add", out, dim, index, src));
  if (detail::should_record(self, src)) {
    detail::record<OpId::ScatterAdd>({&self, &index, &src}, {&out}, {.dim = dim});
  }
  return out;
}

Tensor& scatter_add_(Tensor& self, int64_t dim, const Tensor& index, const Tensor& src) {
  const ScatterArgs args = scatter_add_args("scatter_add_", self, dim, index, src);
  detail::check_writable("scatter_add_", self);
  if (detail::should_record(self, src)) {
    return detail::record_inplace("scatter_add_", self, [&](const Tensor& s) {
      return scatter_into_copy(OpId::ScatterAdd, s,
                               scatter_add_args("scatter_add_", s, dim, index, src), index, src,
                               dim, 1);
    });
  }
  run_scatter(args);
  self.bump_version();
  return self;
}

Tensor& index_add_(Tensor& self, int64_t dim, const Tensor& index, const Tensor& src,
                   const Scalar& alpha) {
  const ScatterArgs args = index_add_args("index_add_", self, dim, index, src, alpha);
  detail::check_writable("index_add_", self);
  if (detail::should_record(self, src)) {
    return detail::record_inplace("index_add_", self, [&](const Tensor& s) {
      return scatter_into_copy(OpId::IndexAdd, s,
                               index_add_args("index_add_", s, dim, index, src, alpha), index,
                               src, dim, alpha);
    });
  }
  run_scatter(args);
  self.bump_version();
  return self;
}

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  check_defined("embedding", weight, "weight");
  check_defined("embedding", indices, "indices");
  EMBER_CHECK(weight.dim() == 2, "[embedding] expected weight of shape [num_embeddings, "
              "embedding_dim], got shape ", weight.shape());
  Tensor out = index_select_impl("embedding", weight, 0, indices.reshape({-1}));
  Shape shape = indices.shape();
  shape.push_back(weight.size(1));
  out = out.view(shape);
  if (detail::should_record(weight)) detail::record(OpId::Embedding, {&weight, &indices}, {&out});
  return out;
}

Tensor embedding_backward(const Tensor& grad, const Tensor& indices, int64_t num_weights) {
  constexpr const char* op = "embedding_backward";
  check_defined(op, grad, "grad");
  check_defined(op, indices, "indices");
  EMBER_CHECK(num_weights >= 0, "[embedding_backward] expected num_weights >= 0, got ", num_weights);
  EMBER_CHECK(grad.dim() == indices.dim() + 1, "[embedding_backward] expected grad of shape "
              "[*indices.shape, embedding_dim] with indices of shape ", indices.shape(),
              ", got grad of shape ", grad.shape());
  for (int64_t d = 0; d < indices.dim(); ++d) {
    EMBER_CHECK(grad.size(d) == indices.size(d), "[embedding_backward] expected grad of shape "
                "[*indices.shape, embedding_dim] with indices of shape ", indices.shape(),
                ", got grad of shape ", grad.shape());
  }
  const int64_t dim = grad.size(-1);
  // A frequent token's row sums thousands of gradients (GPT-2's "the"): in bfloat16 or float16
  // each add would round to 8 or 11 bits, and 1024 ones would sum to 256. So they are summed in
  // float32 and rounded once, as PyTorch's embedding backward accumulates in its op math type.
  const bool half = grad.dtype() == kBFloat16 || grad.dtype() == kFloat16;
  Tensor src = grad.reshape({indices.numel(), dim});
  if (half) src = src.to(kFloat32);
  Tensor out = zeros({num_weights, dim}, src.options());
  const Tensor idx = indices.reshape({-1});
  const ScatterArgs args = index_add_args(op, out, 0, idx, src, 1);
  // Differentiable (it is embedding's backward rule, so double backward goes through it): out
  // is fresh, so the scatter is recorded as an index_add into it.
  if (detail::should_record(grad)) {
    out = scatter_into_copy(OpId::IndexAdd, out, args, idx, src, 0, 1);
  } else {
    run_scatter(args);
  }
  return half ? out.to(grad.dtype()) : out;
}

Tensor one_hot(const Tensor& t, int64_t num_classes) {
  check_defined("one_hot", t, "self");
  EMBER_CHECK_TYPE(TypeError, t.dtype() == kInt64 || t.dtype() == kInt32,
                   "[one_hot] expected a tensor of class indices of dtype int64 (or int32), got ",
                   t.dtype());
  EMBER_CHECK(num_classes >= -1, "[one_hot] expected num_classes >= 0 (or -1 to infer it), got ",
              num_classes);
  if (num_classes == -1) {
    EMBER_CHECK(t.numel() > 0, "[one_hot] cannot infer the number of classes from an empty "
                "tensor (shape ", t.shape(), "); pass num_classes");
    const std::vector<int64_t> v = t.to_vector<int64_t>();
    const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
    EMBER_CHECK_TYPE(IndexError, *lo >= 0, "[one_hot] class values must be non-negative, got ",
                     *lo);
    num_classes = *hi + 1;
  }
  Shape shape = t.shape();
  shape.push_back(num_classes);
  Tensor out = zeros(shape, TensorOptions(kInt64).device(t.device()));
  if (t.numel() == 0) return out;
  const Tensor index = t.unsqueeze(-1);
  const Tensor ones = full({1}, 1, TensorOptions(kInt64).device(t.device())).expand(index.shape());
  run_scatter(scatter_add_args("one_hot", out, -1, index, ones));
  return out;
}

}  // namespace ember
