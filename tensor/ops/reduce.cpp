// Reductions: validation, output shape/dtype inference and device dispatch. The kernels are in
// cpu/reduce.cpp and cuda/reduce.cu (Note [Reduction geometry] in detail/reduce_kernels.h).
#include <ember/tensor/ops/reduce.h>

#include <algorithm>
#include <limits>
#include <optional>

#include <ember/tensor/autocast.h>
#include <ember/tensor/detail/record.h>
#include <ember/tensor/detail/reduce_kernels.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops/indexing.h>

namespace ember {

namespace detail {

namespace {
// Appends a dim (size, stride) to sizes/strides[0..n), merging it into the last one when that
// continues it (last stride == stride * size).
template <typename N>
void append_merged(int64_t* sizes, int64_t* strides, N& n, int64_t size, int64_t stride) {
  if (n > 0 && strides[n - 1] == stride * size) {
    sizes[n - 1] *= size;
    strides[n - 1] = stride;
  } else {
    sizes[n] = size;
    strides[n] = stride;
    ++n;
  }
}
}  // namespace

ReduceGeom make_reduce_geom(const Tensor& in, uint32_t mask) {
  ReduceGeom g;
  const int nd = static_cast<int>(in.dim());
  int keep[kMaxDims], red[kMaxDims];
  int nk = 0, nr = 0;
  bool any_zero = false;
  for (int d = 0; d < nd; ++d) {
    const int64_t s = in.size(d);
    if (s == 0) any_zero = true;
    if (mask >> d & 1u) {
      g.red_numel *= s;
      if (s != 1) red[nr++] = d;
    } else {
      g.num_out *= s;
      if (s != 1) keep[nk++] = d;
    }
  }
  if (any_zero) {
    // Nothing to read: either no outputs, or every output reduces nothing.
    g.nkeep = 1;
    g.keep_sizes[0] = g.num_out;
    g.keep_strides[0] = 0;
    g.nred = 1;
    g.red_sizes[0] = g.red_numel;
    g.red_strides[0] = 1;
    return g;
  }
  // Kept dims: output order; merge neighbours whose input strides line up.
  for (int i = 0; i < nk; ++i) {
    append_merged(g.keep_sizes, g.keep_strides, g.nkeep, in.size(keep[i]), in.stride(keep[i]));
  }
  // Reduced dims: any order works, so sort by decreasing stride, then merge.
  std::stable_sort(red, red + nr, [&](int a, int b) { return in.stride(a) > in.stride(b); });
  for (int i = 0; i < nr; ++i) {
    append_merged(g.red_sizes, g.red_strides, g.nred, in.size(red[i]), in.stride(red[i]));
  }
  if (g.nred == 0) {  // every output reads one element
    g.nred = 1;
    g.red_sizes[0] = 1;
    g.red_strides[0] = 1;
  }
  return g;
}

ReduceInput prepare_reduce(const Tensor& in, uint32_t mask) {
  ReduceInput p{in, make_reduce_geom(in, mask)};
  if (p.g.inner() || p.g.outer()) return p;
  std::vector<int64_t> perm;
  for (int64_t d = 0; d < in.dim(); ++d) {
    if (!(mask >> d & 1u)) perm.push_back(d);
  }
  uint32_t new_mask = 0;
  for (int64_t d = 0; d < in.dim(); ++d) {
    if (mask >> d & 1u) {
      new_mask |= 1u << perm.size();
      perm.push_back(d);
    }
  }
  p.src = in.permute(perm).contiguous();
  p.g = make_reduce_geom(p.src, new_mask);
  EMBER_INTERNAL_ASSERT(p.g.inner(), "a contiguous permuted copy must reduce dense runs");
  return p;
}

}  // namespace detail

namespace {

using detail::ReduceKind;
using detail::ReduceParams;

// Bit d set for every reduced dim; an empty list means all dims. Duplicates are an error.
uint32_t dims_mask(const char* op, const Tensor& t, IntList dims) {
  const int64_t nd = t.dim();
  if (dims.empty()) return nd == 0 ? 0u : static_cast<uint32_t>((uint64_t{1} << nd) - 1);
  uint32_t mask = 0;
  for (int64_t d : dims) {
    const int64_t w = wrap_dim(op, d, nd);
    EMBER_CHECK(!(mask >> w & 1u), "[", op, "] dim ", w,
                " appears multiple times in the list of dims ", dims);
    mask |= 1u << w;
  }
  if (nd == 0) return 0u;
  return mask;
}

Shape keepdim_shape(const Tensor& t, uint32_t mask) {
  Shape s = t.shape();
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (mask >> d & 1u) s[d] = 1;
  }
  return s;
}

Shape result_shape(const Tensor& t, uint32_t mask, bool keepdim) {
  if (keepdim) return keepdim_shape(t, mask);
  Shape s;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (!(mask >> d & 1u)) s.push_back(t.size(d));
  }
  return s;
}

void check_floating(const char* op, const Tensor& t) {
  EMBER_CHECK_TYPE(TypeError, t.is_floating_point(), "[", op,
                   "] expected a floating-point input (float16, bfloat16, float32 or float64), "
                   "got ",
                   t.dtype());
}

// Max-like ops have no identity: every reduced dim must be non-empty.
void check_nonempty_dims(const char* op, const Tensor& t, uint32_t mask) {
  for (int64_t d = 0; d < t.dim(); ++d) {
    EMBER_CHECK_TYPE(IndexError, !(mask >> d & 1u) || t.size(d) != 0, "[", op,
                     "] expected reduction dim ", d, " to have non-zero size, got shape ",
                     t.shape());
  }
}

void dispatch_reduce(ReduceKind kind, const Tensor& out, const Tensor& in, uint32_t mask,
                     const ReduceParams& params) {
  if (out.numel() == 0) return;
  if (in.is_cuda()) {
    detail::reduce_cuda(kind, out, in, mask, params);
  } else {
    detail::reduce_cpu(kind, out, in, mask, params);
  }
}

// Note [Reductions record once]: kernels may permute or copy their input (prepare_reduce,
// contiguous()); when the input would be recorded, that runs with grad mode off so those
// internal ops record nothing, and the front end records the reduction as one node.
Tensor reduce(const char* op, ReduceKind kind, const Tensor& t, IntList dims, bool keepdim,
              Dtype out_dtype, const ReduceParams& params = {}) {
  const uint32_t mask = dims_mask(op, t, dims);
  Tensor out = detail::make_empty(keepdim_shape(t, mask), out_dtype, t.device());
  {
    std::optional<NoGradGuard> no_grad;
    if (detail::should_record(t)) no_grad.emplace();
    dispatch_reduce(kind, out, t, mask, params);
  }
  return keepdim ? out : out.view(result_shape(t, mask, keepdim));
}

// Records a reduction over `dims` whose attributes are ReduceAttrs.
void record_reduce(OpId op, const Tensor& t, Tensor& out, IntList dims, bool keepdim) {
  detail::record(op, {&t}, {&out}, ReduceAttrs{Shape(dims), keepdim});
}

Dtype sum_dtype(Dtype t) { return is_floating(t) ? t : kInt64; }

std::pair<Tensor, Tensor> arg_reduce(const char* op, const Tensor& t, int64_t dim, bool keepdim,
                                     bool is_max, bool want_values) {
  const int64_t d = wrap_dim(op, dim, t.dim());
  const uint32_t mask = t.dim() == 0 ? 0u : 1u << d;
  check_nonempty_dims(op, t, mask);
  std::optional<NoGradGuard> no_grad;  // Note [Reductions record once]
  if (detail::should_record(t)) no_grad.emplace();
  const Shape ks = keepdim_shape(t, mask);
  Tensor values = want_values ? detail::make_empty(ks, t.dtype(), t.device()) : Tensor();
  Tensor indices = detail::make_empty(ks, kInt64, t.device());
  if (indices.numel() > 0) {
    const int64_t kdim = t.dim() == 0 ? 0 : d;
    const Tensor in = t.dim() == 0 ? t.view({1}) : t;
    if (t.is_cuda()) {
      detail::arg_reduce_cuda(values, indices, in, kdim, is_max);
    } else {
      detail::arg_reduce_cpu(values, indices, in, kdim, is_max);
    }
  }
  if (!keepdim) {
    const Shape rs = result_shape(t, mask, false);
    if (want_values) values = values.view(rs);
    indices = indices.view(rs);
  }
  return {values, indices};
}

Tensor all_extreme(const char* op, const Tensor& t, ReduceKind kind) {
  detail::check_defined(op, t, "input");
  EMBER_CHECK_TYPE(IndexError, t.numel() > 0, "[", op,
                   "] expected a non-empty tensor to reduce over all elements, got shape ",
                   t.shape(), "; specify a dim to reduce over");
  return reduce(op, kind, t, {}, false, t.dtype());
}

Tensor flat_arg(const char* op, const Tensor& t, std::optional<int64_t> dim, bool keepdim,
                bool is_max) {
  detail::check_defined(op, t, "input");
  std::optional<NoGradGuard> no_grad;  // the reshape below must not record (indices only)
  if (detail::should_record(t)) no_grad.emplace();
  if (dim) return arg_reduce(op, t, *dim, keepdim, is_max, false).second;
  EMBER_CHECK_TYPE(IndexError, t.numel() > 0, "[", op,
                   "] expected a non-empty tensor when no dim is given, got shape ", t.shape());
  Tensor idx = arg_reduce(op, t.reshape({-1}), 0, false, is_max, false).second;
  if (keepdim) return idx.view(Shape::filled(t.dim(), 1));
  return idx;
}

}  // namespace

Tensor sum(const Tensor& t, IntList dims, bool keepdim, std::optional<Dtype> dtype) {
  if (!dtype) {  // an explicit dtype opts out of autocast, as in torch
    if (auto ac = detail::autocast_inputs(AutocastPolicy::kFloat32, t)) return sum(ac[0], dims, keepdim);
  }
  detail::check_defined("sum", t, "input");
  if (dtype) {
    // PyTorch casts the input to `dtype` first and returns that dtype.
    Tensor r = sum(t.to(*dtype), dims, keepdim);
    return r.dtype() == *dtype ? r : r.to(*dtype);
  }
  Tensor out = reduce("sum", ReduceKind::Sum, t, dims, keepdim, sum_dtype(t.dtype()));
  if (detail::should_record(t)) record_reduce(OpId::Sum, t, out, dims, keepdim);
  return out;
}

Tensor mean(const Tensor& t, IntList dims, bool keepdim) {
  if (auto ac = detail::autocast_inputs(AutocastPolicy::kFloat32, t)) return mean(ac[0], dims, keepdim);
  detail::check_defined("mean", t, "input");
  check_floating("mean", t);
  Tensor out = reduce("mean", ReduceKind::Mean, t, dims, keepdim, t.dtype());
  if (detail::should_record(t)) record_reduce(OpId::Mean, t, out, dims, keepdim);
  return out;
}

Tensor prod(const Tensor& t, IntList dims, bool keepdim) {
  if (auto ac = detail::autocast_inputs(AutocastPolicy::kFloat32, t)) return prod(ac[0], dims, keepdim);
  detail::check_defined("prod", t, "input");
  Tensor out = reduce("prod", ReduceKind::Prod, t, dims, keepdim, sum_dtype(t.dtype()));
  if (detail::should_record(t)) record_reduce(OpId::Prod, t, out, dims, keepdim);
  return out;
}

Tensor max(const Tensor& t) {
  Tensor out = all_extreme("max", t, ReduceKind::Max);
  if (detail::should_record(t)) detail::record(OpId::MaxAll, {&t}, {&out});
  return out;
}
Tensor min(const Tensor& t) {
  Tensor out = all_extreme("min", t, ReduceKind::Min);
  if (detail::should_record(t)) detail::record(OpId::MinAll, {&t}, {&out});
  return out;
}

std::pair<Tensor, Tensor> max(const Tensor& t, int64_t dim, bool keepdim) {
  detail::check_defined("max", t, "input");
  auto r = arg_reduce("max", t, dim, keepdim, true, true);
  if (detail::should_record(t)) {
    detail::record<OpId::MaxDim>({&t}, {&r.first, &r.second},
                                 {.dim = wrap_dim("max", dim, t.dim()), .keepdim = keepdim});
  }
  return r;
}
std::pair<Tensor, Tensor> min(const Tensor& t, int64_t dim, bool keepdim) {
  detail::check_defined("min", t, "input");
  auto r = arg_reduce("min", t, dim, keepdim, false, true);
  if (detail::should_record(t)) {
    detail::record<OpId::MinDim>({&t}, {&r.first, &r.second},
                                 {.dim = wrap_dim("min", dim, t.dim()), .keepdim = keepdim});
  }
  return r;
}

Tensor amax(const Tensor& t, IntList dims, bool keepdim) {
  detail::check_defined("amax", t, "input");
  check_nonempty_dims("amax", t, dims_mask("amax", t, dims));
  Tensor out = reduce("amax", ReduceKind::Max, t, dims, keepdim, t.dtype());
  if (detail::should_record(t)) record_reduce(OpId::Amax, t, out, dims, keepdim);
  return out;
}
Tensor amin(const Tensor& t, IntList dims, bool keepdim) {
  detail::check_defined("amin", t, "input");
  check_nonempty_dims("amin", t, dims_mask("amin", t, dims));
  Tensor out = reduce("amin", ReduceKind::Min, t, dims, keepdim, t.dtype());
  if (detail::should_record(t)) record_reduce(OpId::Amin, t, out, dims, keepdim);
  return out;
}

Tensor argmax(const Tensor& t, std::optional<int64_t> dim, bool keepdim) {
  return flat_arg("argmax", t, dim, keepdim, true);
}
Tensor argmin(const Tensor& t, std::optional<int64_t> dim, bool keepdim) {
  return flat_arg("argmin", t, dim, keepdim, false);
}

std::pair<Tensor, Tensor> topk(const Tensor& t, int64_t k, int64_t dim, bool largest, bool) {
  detail::check_defined("topk", t, "input");
  EMBER_CHECK_TYPE(TypeError, t.dtype() != kBool, "[topk] expected a numeric tensor, got bool");
  const int64_t d = wrap_dim("topk", dim, t.dim());
  const int64_t n = t.dim() == 0 ? 1 : t.size(d);
  EMBER_CHECK_TYPE(IndexError, k >= 0 && k <= n, "[topk] expected 0 <= k <= ", n,
                   " (the size of dim ", d, " of shape ", t.shape(), "), got k = ", k);
  if (t.dim() == 0) {  // k 0 or 1: torch gives the element and position 0, both 0-dim
    const Tensor zero = from_vector(std::vector<int64_t>{0}, {1}).to(t.device());
    return {gather(t.view({1}), 0, zero).view(Shape{}), zero.view(Shape{})};
  }
  Tensor idx;
  {
    // Only the positions come from the kernel; the values are gathered below, which is what
    // autograd records (its backward scatters the gradient back to the positions).
    NoGradGuard no_grad;
    const Tensor rows = t.movedim(d, -1).contiguous();
    const int64_t nrows = n == 0 ? 0 : rows.numel() / n;
    Tensor flat = detail::make_empty(Shape{nrows, k}, kInt64, t.device());
    if (nrows > 0 && k > 0) {
      const Tensor in = rows.reshape({nrows, n});
      if (t.is_cuda()) {
        detail::topk_cuda(flat, in, k, largest);
      } else {
        detail::topk_cpu(flat, in, k, largest);
      }
    }
    Shape s = rows.shape();
    s[s.size() - 1] = k;
    idx = flat.view(s).movedim(-1, d).contiguous();
  }
  return {gather(t, d, idx), idx};
}

namespace {
/// var and std: one kernel (std takes the square root), recorded as `id`.
Tensor var_or_std(const char* op, OpId id, bool take_sqrt, const Tensor& t, IntList dims,
                  int64_t correction, bool keepdim) {
  detail::check_defined(op, t, "input");
  check_floating(op, t);
  ReduceParams p;
  p.correction = correction;
  p.take_sqrt = take_sqrt;
  Tensor out = reduce(op, ReduceKind::Var, t, dims, keepdim, t.dtype(), p);
  if (detail::should_record(t)) {
    detail::record(id, {&t}, {&out}, VarAttrs{{Shape(dims), keepdim}, correction});
  }
  return out;
}
}  // namespace

Tensor var(const Tensor& t, IntList dims, int64_t correction, bool keepdim) {
  return var_or_std("var", OpId::Var, false, t, dims, correction, keepdim);
}

Tensor std(const Tensor& t, IntList dims, int64_t correction, bool keepdim) {
  return var_or_std("std", OpId::Std, true, t, dims, correction, keepdim);
}

Tensor norm(const Tensor& t, double p, IntList dims, bool keepdim) {
  if (auto ac = detail::autocast_inputs(AutocastPolicy::kFloat32, t)) return norm(ac[0], p, dims, keepdim);
  detail::check_defined("norm", t, "input");
  check_floating("norm", t);
  if (p == -std::numeric_limits<double>::infinity()) {  // min |x| has no identity (as amin)
    const uint32_t mask = dims_mask("norm", t, dims);
    for (int64_t d = 0; d < t.dim(); ++d) {
      EMBER_CHECK(!(mask >> d & 1u) || t.size(d) != 0, "[norm] cannot compute the -inf norm over ",
                  "dim ", d, " of size 0 (shape ", t.shape(), "): it has no identity");
    }
  }
  ReduceParams params;
  params.p = p;
  Tensor out = reduce("norm", ReduceKind::Norm, t, dims, keepdim, t.dtype(), params);
  if (detail::should_record(t)) {
    detail::record<OpId::Norm>({&t}, {&out}, {{Shape(dims), keepdim}, p});
  }
  return out;
}

Tensor any(const Tensor& t) {
  detail::check_defined("any", t, "input");
  return reduce("any", ReduceKind::Any, t, {}, false, kBool);
}
Tensor all(const Tensor& t) {
  detail::check_defined("all", t, "input");
  return reduce("all", ReduceKind::All, t, {}, false, kBool);
}

// logsumexp lives here rather than in softmax.cpp: it is a reduction over a dims list.
Tensor logsumexp(const Tensor& t, IntList dims, bool keepdim) {
  detail::check_defined("logsumexp", t, "input");
  check_floating("logsumexp", t);
  Tensor out = reduce("logsumexp", ReduceKind::LogSumExp, t, dims, keepdim, t.dtype());
  if (detail::should_record(t)) record_reduce(OpId::Logsumexp, t, out, dims, keepdim);
  return out;
}

// ---- Tensor methods --------------------------------------------------------------------------

Tensor Tensor::sum() const { return ember::sum(*this); }
Tensor Tensor::sum(IntList dims, bool keepdim) const { return ember::sum(*this, dims, keepdim); }
Tensor Tensor::mean() const { return ember::mean(*this); }
Tensor Tensor::mean(IntList dims, bool keepdim) const { return ember::mean(*this, dims, keepdim); }
Tensor Tensor::max() const { return ember::max(*this); }
Tensor Tensor::min() const { return ember::min(*this); }
Tensor Tensor::argmax(std::optional<int64_t> dim, bool keepdim) const {
  return ember::argmax(*this, dim, keepdim);
}

}  // namespace ember
