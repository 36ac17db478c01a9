#include <ember/tensor/tensor.h>

#include <algorithm>

#include <ember/tensor/ops/creation.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/detail/copy.h>
#include <ember/tensor/detail/overlap.h>
#include <ember/tensor/detail/record.h>

namespace ember {

// ---- Storage ----------------------------------------------------------------------------------

Storage::Storage(size_t nbytes, Device device) : Storage(nbytes, allocator_for(device)) {}

Storage::Storage(size_t nbytes, Allocator* allocator)
    : nbytes_(nbytes), device_(allocator->device()), allocator_(allocator) {
  data_ = allocator_->allocate(nbytes);
  pinned_ = allocator->is_pinned();
}

Storage::Storage(void* data, size_t nbytes, Device device, std::function<void(void*)> deleter)
    : data_(data), nbytes_(nbytes), device_(device), deleter_(std::move(deleter)) {}

Storage::~Storage() {
  if (allocator_) {
    allocator_->deallocate(data_, nbytes_);
  } else if (deleter_) {
    deleter_(data_);
  }
}

// ---- TensorImpl -------------------------------------------------------------------------------

void TensorImpl::refresh() {
  numel = sizes.numel();
  contiguous = true;
  int64_t expected = 1;
  for (int64_t d = sizes.size() - 1; d >= 0; --d) {
    if (sizes[d] == 1) continue;
    if (strides[d] != expected) {
      contiguous = numel == 0;
      break;
    }
    expected *= sizes[d];
  }
}

// ---- helpers ----------------------------------------------------------------------------------

namespace detail {

Tensor make_empty(IntList shape, Dtype dtype, Device device, bool pinned) {
  auto impl = std::make_shared<TensorImpl>();
  impl->sizes = Shape(shape);
  int64_t numel = 1, nbytes_signed = 0;
  for (int64_t s : shape) {
    EMBER_CHECK(s >= 0, "[empty] sizes must be non-negative, got shape ", shape);
    EMBER_CHECK(!__builtin_mul_overflow(numel, s, &numel), "[empty] the element count of shape ",
                shape, " overflows int64");
  }
  EMBER_CHECK(!__builtin_mul_overflow(numel, itemsize(dtype), &nbytes_signed),
              "[empty] the size "
              "in bytes of shape ",
              shape, " (", dtype, ") overflows int64");
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  impl->numel = numel;
  impl->contiguous = true;
  const size_t nbytes = static_cast<size_t>(nbytes_signed);
  if (pinned) {
    EMBER_CHECK(device.is_cpu(), "[empty] pinned memory is host memory; got device ", device);
    impl->storage = std::make_shared<Storage>(nbytes, pinned_allocator());
  } else {
    impl->storage = std::make_shared<Storage>(nbytes, device);
  }
  return Tensor(std::move(impl));
}

Tensor make_view(const Tensor& base, const Shape& sizes, const Shape& strides, int64_t offset) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = base.storage();
  impl->sizes = sizes;
  impl->strides = strides;
  impl->offset = offset;
  impl->dtype = base.dtype();
  impl->is_view = true;
  impl->refresh();
  return Tensor(std::move(impl));
}

void check_defined(const char* op, const Tensor& t, const char* name) {
  EMBER_CHECK(t.defined(), "[", op, "] expected a defined tensor for argument '", name,
              "', got an undefined (default-constructed) Tensor");
}

}  // namespace detail

using detail::check_defined;
using detail::make_view;

namespace {

/// Records `op` from self to out when self requires grad.
template <OpId op>
Tensor recorded(const Tensor& self, Tensor out, OpAttrsOf<op> attrs = {}) {
  if (detail::should_record(self)) detail::record<op>({&self}, {&out}, std::move(attrs));
  return out;
}

/// The same, with attributes built only when recording (`make_attrs()` returns them).
template <OpId op, typename F>
Tensor recorded_with(const Tensor& self, Tensor out, F&& make_attrs) {
  if (detail::should_record(self)) detail::record<op>({&self}, {&out}, make_attrs());
  return out;
}

}  // namespace

void Tensor::check_dtype_for_data(Dtype t) const {
  check_defined("data", *this, "self");
  EMBER_CHECK_TYPE(TypeError, t == dtype(), "[data] requested element type ", t,
                   " but the tensor's dtype is ", dtype());
}

int64_t Tensor::size(int64_t d) const { return impl_->sizes[wrap_dim("size", d, dim())]; }
int64_t Tensor::stride(int64_t d) const { return impl_->strides[wrap_dim("stride", d, dim())]; }

// ---- views ------------------------------------------------------------------------------------

namespace {

// Resolves one -1 in shape against numel; checks the element count.
Shape infer_shape(const char* op, IntList shape, int64_t numel, IntList from) {
  Shape out(shape);
  int64_t known = 1, infer = -1;
  for (int64_t i = 0; i < out.size(); ++i) {
    if (out[i] == -1) {
      EMBER_CHECK(infer < 0, "[", op, "] only one dimension can be inferred (-1), got shape ",
                  shape);
      infer = i;
    } else {
      EMBER_CHECK(out[i] >= 0, "[", op, "] invalid size ", out[i], " in shape ", shape);
      EMBER_CHECK(!__builtin_mul_overflow(known, out[i], &known), "[", op,
                  "] the element count of shape ", shape, " overflows int64");
    }
  }
  if (infer >= 0) {
    EMBER_CHECK(known != 0 && numel % known == 0, "[", op, "] shape ", shape,
                " is invalid for input of size ", numel, " (shape ", from, ")");
    out[infer] = numel / known;
  } else {
    EMBER_CHECK(known == numel, "[", op, "] shape ", shape, " is invalid for input of size ",
                numel, " (shape ", from, ")");
  }
  return out;
}

// Strides that let `old` (sizes/strides) be seen as new_sizes without copying, if any: each
// run of new dims must cover whole runs of old dims that are contiguous with each other.
bool view_strides(const Shape& old_sizes, const Shape& old_strides, const Shape& new_sizes,
                  Shape* new_strides) {
  *new_strides = Shape::filled(new_sizes.size(), 1);
  if (old_sizes.numel() == 0 || old_sizes.empty()) {
    *new_strides = contiguous_strides(new_sizes);
    return true;
  }
  int64_t view_d = new_sizes.size() - 1;
  int64_t chunk_base_stride = old_strides.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t td = old_sizes.size() - 1; td >= 0; --td) {
    tensor_numel *= old_sizes[td];
    const bool chunk_ends = td == 0 || (old_sizes[td - 1] != 1 &&
                                        old_strides[td - 1] != tensor_numel * chunk_base_stride);
    if (!chunk_ends) continue;
    while (view_d >= 0 && (view_numel < tensor_numel || new_sizes[view_d] == 1)) {
      (*new_strides)[view_d] = view_numel * chunk_base_stride;
      view_numel *= new_sizes[view_d];
      --view_d;
    }
    if (view_numel != tensor_numel) return false;
    if (td > 0) {
      chunk_base_stride = old_strides[td - 1];
      tensor_numel = 1;
      view_numel = 1;
    }
  }
  return view_d == -1;
}

}  // namespace

Tensor Tensor::view(IntList shape) const {
  check_defined("view", *this, "self");
  Shape sizes = infer_shape("view", shape, numel(), this->shape());
  Shape strides;
  EMBER_CHECK(view_strides(impl_->sizes, impl_->strides, sizes, &strides),
              "[view] size ", sizes, " is not compatible with input of shape ", this->shape(),
              " and strides ", this->strides(),
              " (at least one dimension spans across two contiguous subspaces); use reshape()");
  return recorded<OpId::ViewAs>(*this, make_view(*this, sizes, strides, impl_->offset));
}

Tensor Tensor::reshape(IntList shape) const {
  check_defined("reshape", *this, "self");
  Shape sizes = infer_shape("reshape", shape, numel(), this->shape());
  Shape strides;
  if (view_strides(impl_->sizes, impl_->strides, sizes, &strides)) {
    return recorded<OpId::ViewAs>(*this, make_view(*this, sizes, strides, impl_->offset));
  }
  return clone().view(sizes);
}

Tensor Tensor::flatten(int64_t start_dim, int64_t end_dim) const {
  check_defined("flatten", *this, "self");
  const int64_t s = wrap_dim("flatten", start_dim, dim());
  const int64_t e = wrap_dim("flatten", end_dim, dim());
  if (dim() == 0) return reshape({1});
  EMBER_CHECK(s <= e, "[flatten] start_dim (", start_dim, ") must not come after end_dim (",
              end_dim, ")");
  Shape sizes;
  for (int64_t d = 0; d < s; ++d) sizes.push_back(size(d));
  int64_t n = 1;
  for (int64_t d = s; d <= e; ++d) n *= size(d);
  sizes.push_back(n);
  for (int64_t d = e + 1; d < dim(); ++d) sizes.push_back(size(d));
  return reshape(sizes);
}

Tensor Tensor::permute(IntList dims) const {
  check_defined("permute", *this, "self");
  EMBER_CHECK(dims.size() == dim(), "[permute] number of dims in the permutation (", dims.size(),
              ") must equal the tensor's number of dims (", dim(), "); got ", dims);
  Shape sizes, strides;
  bool seen[kMaxDims] = {};
  for (int64_t i = 0; i < dims.size(); ++i) {
    const int64_t d = wrap_dim("permute", dims[i], dim());
    EMBER_CHECK(!seen[d], "[permute] dim ", d, " appears more than once in ", dims);
    seen[d] = true;
    sizes.push_back(size(d));
    strides.push_back(stride(d));
  }
  return recorded_with<OpId::Permute>(*this, make_view(*this, sizes, strides, impl_->offset), [&] {
    PermuteAttrs a;
    for (int64_t i = 0; i < dims.size(); ++i) a.dims.push_back(wrap_dim("permute", dims[i], dim()));
    return a;
  });
}

Tensor Tensor::movedim(int64_t source, int64_t destination) const {
  check_defined("movedim", *this, "self");
  const int64_t s = wrap_dim("movedim", source, dim());
  const int64_t d = wrap_dim("movedim", destination, dim());
  if (dim() == 0) return *this;
  std::vector<int64_t> order;
  for (int64_t i = 0; i < dim(); ++i) {
    if (i != s) order.push_back(i);
  }
  order.insert(order.begin() + d, s);
  return permute(order);
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  check_defined("transpose", *this, "self");
  d0 = wrap_dim("transpose", d0, dim());  // a 0-dim tensor's are -1 and 0
  d1 = wrap_dim("transpose", d1, dim());
  if (dim() == 0) return *this;
  Shape sizes = impl_->sizes, strides = impl_->strides;
  std::swap(sizes[d0], sizes[d1]);
  std::swap(strides[d0], strides[d1]);
  return recorded_with<OpId::Permute>(*this, make_view(*this, sizes, strides, impl_->offset), [&] {
    PermuteAttrs a;
    for (int64_t i = 0; i < dim(); ++i) a.dims.push_back(i);
    std::swap(a.dims[d0], a.dims[d1]);
    return a;
  });
}

Tensor Tensor::t() const {
  check_defined("t", *this, "self");
  EMBER_CHECK(dim() <= 2, "[t] expects a tensor with <= 2 dimensions, but got ", dim(),
              "-d tensor of shape ", shape());
  return dim() < 2 ? *this : transpose(0, 1);
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  check_defined("narrow", *this, "self");
  EMBER_CHECK(dim() > 0, "[narrow] cannot be applied to a 0-dim tensor");
  d = wrap_dim("narrow", d, dim());
  const int64_t n = size(d);
  if (start < 0) start += n;
  // length <= n - start, not start + length <= n: that sum can overflow.
  EMBER_CHECK_TYPE(IndexError, start >= 0 && length >= 0 && start <= n && length <= n - start,
                   "[narrow] start (", start, ") + length (", length, ") exceeds dimension size (",
                   n, ") of dim ", d);
  Shape sizes = impl_->sizes;
  sizes[d] = length;
  return recorded<OpId::Slice>(
      *this, make_view(*this, sizes, impl_->strides, impl_->offset + start * stride(d)),
      {.dim = d, .start = start, .end = start + length, .step = 1});
}

Tensor Tensor::slice(int64_t d, std::optional<int64_t> start, std::optional<int64_t> end,
                     int64_t step) const {
  check_defined("slice", *this, "self");
  EMBER_CHECK(dim() > 0, "[slice] cannot be applied to a 0-dim tensor");
  EMBER_CHECK(step > 0, "[slice] step must be positive, got ", step);
  d = wrap_dim("slice", d, dim());
  const int64_t n = size(d);
  auto clampi = [n](int64_t v) {
    if (v < 0) v += n;
    return std::clamp<int64_t>(v, 0, n);
  };
  const int64_t s = start ? clampi(*start) : 0;
  const int64_t e = std::max(s, end ? clampi(*end) : n);
  Shape sizes = impl_->sizes, strides = impl_->strides;
  sizes[d] = (e - s + step - 1) / step;
  strides[d] *= step;
  return recorded<OpId::Slice>(
      *this, make_view(*this, sizes, strides, impl_->offset + s * stride(d)),
      {.dim = d, .start = s, .end = e, .step = step});
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  check_defined("select", *this, "self");
  EMBER_CHECK_TYPE(IndexError, dim() > 0, "[select] cannot select from a 0-dim tensor");
  d = wrap_dim("select", d, dim());
  const int64_t n = size(d);
  EMBER_CHECK_TYPE(IndexError, index >= -n && index < n, "[select] index ", index,
                   " is out of bounds for dimension ", d, " with size ", n);
  if (index < 0) index += n;
  Shape sizes = impl_->sizes, strides = impl_->strides;
  sizes.erase(d);
  strides.erase(d);
  return recorded<OpId::Select>(
      *this, make_view(*this, sizes, strides, impl_->offset + index * stride(d)),
      {.dim = d, .index = index});
}

Tensor Tensor::expand(IntList shape) const {
  check_defined("expand", *this, "self");
  EMBER_CHECK(shape.size() >= dim(), "[expand] the number of sizes provided (", shape.size(),
              ") must be greater or equal to the number of dimensions in the tensor (", dim(),
              ")");
  const int64_t lead = shape.size() - dim();
  Shape sizes, strides;
  for (int64_t i = 0; i < shape.size(); ++i) {
    const int64_t td = i - lead;
    int64_t want = shape[i];
    if (td < 0) {
      EMBER_CHECK(want >= 0, "[expand] the expanded size ", want,
                  " is not allowed in a leading, non-existing dimension ", i);
      sizes.push_back(want);
      strides.push_back(0);
      continue;
    }
    const int64_t have = size(td);
    if (want == -1) want = have;
    EMBER_CHECK(want >= 0, "[expand] the expanded size ", want, " at dimension ", i,
                " must be non-negative (or -1 to keep the size). Target sizes: ", shape);
    EMBER_CHECK(have == want || have == 1, "[expand] the expanded size of the tensor (", want,
                ") must match the existing size (", have, ") at non-singleton dimension ", i,
                ".  Target sizes: ", shape, ".  Tensor sizes: ", this->shape());
    sizes.push_back(want);
    strides.push_back(have == want ? stride(td) : 0);
  }
  return recorded<OpId::Expand>(*this, make_view(*this, sizes, strides, impl_->offset));
}

Tensor Tensor::squeeze() const {
  check_defined("squeeze", *this, "self");
  Shape sizes, strides;
  for (int64_t d = 0; d < dim(); ++d) {
    if (size(d) != 1) {
      sizes.push_back(size(d));
      strides.push_back(stride(d));
    }
  }
  return recorded<OpId::ViewAs>(*this, make_view(*this, sizes, strides, impl_->offset));
}

Tensor Tensor::squeeze(int64_t d) const {
  check_defined("squeeze", *this, "self");
  d = wrap_dim("squeeze", d, dim());  // a 0-dim tensor's are -1 and 0
  if (dim() == 0) return *this;
  if (size(d) != 1) return *this;
  Shape sizes = impl_->sizes, strides = impl_->strides;
  sizes.erase(d);
  strides.erase(d);
  return recorded<OpId::ViewAs>(*this, make_view(*this, sizes, strides, impl_->offset));
}

Tensor Tensor::unsqueeze(int64_t d) const {
  check_defined("unsqueeze", *this, "self");
  d = wrap_dim("unsqueeze", d, dim() + 1);
  Shape sizes = impl_->sizes, strides = impl_->strides;
  const int64_t st = d < dim() ? size(d) * stride(d) : 1;
  sizes.insert(d, 1);
  strides.insert(d, st);
  return recorded<OpId::ViewAs>(*this, make_view(*this, sizes, strides, impl_->offset));
}

Tensor Tensor::as_strided(IntList size, IntList stride, std::optional<int64_t> offset) const {
  check_defined("as_strided", *this, "self");
  EMBER_CHECK(size.size() == stride.size(), "[as_strided] mismatch in length of size (",
              size.size(), ") and stride (", stride.size(), ")");
  const int64_t off = offset.value_or(impl_->offset);
  EMBER_CHECK(off >= 0, "[as_strided] storage offset must be non-negative, got ", off);
  int64_t max_index = off;
  bool empty = false;
  for (int64_t i = 0; i < size.size(); ++i) {
    EMBER_CHECK(size[i] >= 0 && stride[i] >= 0, "[as_strided] sizes and strides must be "
                "non-negative, got size ", size, " stride ", stride);
    if (size[i] == 0) empty = true;
    max_index += (size[i] - 1) * stride[i];
  }
  const int64_t capacity = static_cast<int64_t>(storage()->nbytes()) / element_size();
  EMBER_CHECK(empty || max_index < capacity, "[as_strided] size ", size, " stride ", stride,
              " offset ", off, " needs ", max_index + 1, " elements but the storage has ",
              capacity);
  return recorded<OpId::AsStrided>(*this, make_view(*this, Shape(size), Shape(stride), off));
}

Tensor Tensor::contiguous() const {
  check_defined("contiguous", *this, "self");
  return is_contiguous() ? *this : clone();
}

// ---- copies -----------------------------------------------------------------------------------

Tensor& Tensor::copy_(const Tensor& src) {
  check_defined("copy_", *this, "self");
  check_defined("copy_", src, "src");
  if (!(src.shape() == shape())) {
    broadcast_shapes("copy_", shape(), src.shape());  // throws with both shapes if impossible
    EMBER_CHECK(src.dim() <= dim(), "[copy_] src of shape ", src.shape(),
                " cannot be broadcast to self of shape ", shape());
  }
  detail::check_writable("copy_", *this);
  detail::check_no_partial_overlap("copy_", *this, src);
  if (detail::should_record(*this, src)) {
    detail::check_inplace(*this, "copy_");
    {
      NoGradGuard no_grad;
      copy_(src);
    }
    // self's old values are overwritten: its gradient flows only to src.
    detail::record(OpId::CopyInto, {&src}, {this});
    return *this;
  }
  const Tensor s = src.shape() == shape() ? src : src.expand(shape());
  if (numel() == 0) return *this;
  // A tensor copied onto the very elements it views (a hook handing back its bucket as the
  // result): nothing to move. torch skips this case too.
  const bool same_elements = impl_->storage == s.impl_->storage &&
                             storage_offset() == s.storage_offset() &&
                             strides() == s.strides() && dtype() == s.dtype();
  if (same_elements) {
    bump_version();
    return *this;
  }
  if (is_cpu() && s.is_cpu()) {
    detail::copy_cpu(*this, s);
  } else {
    detail::copy_cuda(*this, s, false);
  }
  bump_version();
  return *this;
}

Tensor Tensor::clone() const {
  check_defined("clone", *this, "self");
  Tensor out = detail::make_empty(shape(), dtype(), device(), is_pinned());
  if (numel() > 0) {
    if (is_cpu()) {
      detail::copy_cpu(out, *this);
    } else {
      detail::copy_cuda(out, *this, false);
    }
  }
  return recorded<OpId::Clone>(*this, std::move(out));
}

Tensor Tensor::to(Device d, Dtype t, bool non_blocking, bool copy) const {
  check_defined("to", *this, "self");
  if (d == device() && t == dtype() && !copy) return *this;
  if (d.is_cuda()) {
    EMBER_CHECK_TYPE(NotImplementedError, cuda::is_available(), "[to] cannot move a tensor to ",
                     d, ": ", cuda::unavailable_reason());
    EMBER_CHECK(d.index < cuda::device_count(), "[to] device ", d, " does not exist; this machine has ",
                cuda::device_count(), " CUDA device(s)");
  }
  Tensor out = detail::make_empty(shape(), t, d);
  if (numel() > 0) {
    if (d.is_cpu() && is_cpu()) {
      detail::copy_cpu(out, *this);
    } else {
      detail::copy_cuda(out, *this, non_blocking);
    }
  }
  return recorded<OpId::ToCopy>(*this, std::move(out));
}

Tensor Tensor::to(Device d, bool non_blocking, bool copy) const {
  check_defined("to", *this, "self");
  return to(d, dtype(), non_blocking, copy);
}
Tensor Tensor::to(Dtype t, bool copy) const {
  check_defined("to", *this, "self");
  return to(device(), t, false, copy);
}

Tensor Tensor::pin_memory() const {
  check_defined("pin_memory", *this, "self");
  EMBER_CHECK(is_cpu(), "[pin_memory] only CPU tensors can be pinned, got a tensor on ", device());
  if (is_pinned()) return *this;
  Tensor out = detail::make_empty(shape(), dtype(), kCPU, /*pinned=*/true);
  if (numel() > 0) detail::copy_cpu(out, *this);
  return out;
}

// ---- element access ---------------------------------------------------------------------------

template <typename T>
T Tensor::item() const {
  check_defined("item", *this, "self");
  EMBER_CHECK(numel() == 1, "[item] a Tensor with ", numel(),
              " elements cannot be converted to a scalar (shape ", shape(), ")");
  Tensor c = to(kCPU, dtype_of<T>);
  return *static_cast<const T*>(c.data_ptr());
}

Scalar Tensor::item() const {
  switch (dtype()) {
    case kBool: return Scalar(item<bool>());
    case kUInt8:
    case kInt32:
    case kInt64: return Scalar(item<int64_t>());
    default: return Scalar(item<double>());
  }
}

template <typename T>
std::vector<T> Tensor::to_vector() const {
  check_defined("to_vector", *this, "self");
  Tensor c = to(kCPU, dtype_of<T>).contiguous();
  const T* p = static_cast<const T*>(c.data_ptr());
  return std::vector<T>(p, p + c.numel());
}

#define EMBER_INSTANTIATE_ACCESS(T)        \
  template T Tensor::item<T>() const;      \
  template std::vector<T> Tensor::to_vector<T>() const;
EMBER_INSTANTIATE_ACCESS(bool)
EMBER_INSTANTIATE_ACCESS(uint8_t)
EMBER_INSTANTIATE_ACCESS(int32_t)
EMBER_INSTANTIATE_ACCESS(int64_t)
EMBER_INSTANTIATE_ACCESS(Half)
EMBER_INSTANTIATE_ACCESS(BFloat16)
EMBER_INSTANTIATE_ACCESS(float)
EMBER_INSTANTIATE_ACCESS(double)
#undef EMBER_INSTANTIATE_ACCESS

std::ostream& operator<<(std::ostream& os, const Scalar& s) {
  switch (s.kind()) {
    case ScalarKind::Bool: return os << (s.to<bool>() ? "True" : "False");
    case ScalarKind::Integral: return os << s.to_int();
    case ScalarKind::Floating: return os << s.to_double();
  }
  return os;
}

}  // namespace ember
