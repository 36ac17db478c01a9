// Tensor: a strided N-d view over shared storage.
//
// Ownership: `Tensor` is a cheap value handle (one shared_ptr) to a `TensorImpl`. Copying a
// Tensor copies the handle: both copies name the same tensor (like at::Tensor and torch.Tensor),
// so `Tensor b = a; b.add_(1);` changes a. `clone()` makes an independent copy. Views (view,
// permute, narrow, expand, ...) make a new TensorImpl over the same Storage, so writes through a
// view are seen by its base. The version counter lives in the Storage, so every view of one
// buffer sees the same version (autograd uses it to detect in-place changes to saved tensors).
//
// Threads: distinct Tensors may be used from distinct threads; one Tensor's data must not be
// written by one thread while another reads it. CUDA ops are asynchronous on the current stream.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include <ember/tensor/allocator.h>
#include <ember/tensor/device.h>
#include <ember/tensor/dtype.h>
#include <ember/tensor/scalar.h>
#include <ember/tensor/shape.h>

namespace ember {

/// A block of device memory shared by a tensor and its views.
class Storage {
 public:
  /// Allocates nbytes on `device` with its default (caching) allocator.
  Storage(size_t nbytes, Device device);
  /// Allocates nbytes with the given allocator (e.g. pinned_allocator()).
  Storage(size_t nbytes, Allocator* allocator);
  /// Wraps memory owned elsewhere; `deleter(data)` runs when the storage dies (may be empty:
  /// the caller then keeps the memory alive for as long as any tensor uses it).
  Storage(void* data, size_t nbytes, Device device, std::function<void(void*)> deleter);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  /// True for page-locked host memory from pinned_allocator().
  bool is_pinned() const { return pinned_; }
  /// Incremented by every in-place op on any view of this storage.
  uint32_t version() const { return version_.load(std::memory_order_relaxed); }
  void bump_version() { version_.fetch_add(1, std::memory_order_relaxed); }

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  Device device_;
  bool pinned_ = false;
  Allocator* allocator_ = nullptr;
  std::function<void(void*)> deleter_;
  std::atomic<uint32_t> version_{0};
};

namespace autograd {
class Node;
}  // namespace autograd

/// Autograd's per-tensor state. The autograd layer derives from it (AutogradMeta in
/// autograd/node.h) and keeps `requires_grad` true for a leaf that requires grad and for any
/// tensor with a grad_fn, so the tensor layer's "should this op record?" test is one inline
/// load.
struct AutogradMetaBase {
  virtual ~AutogradMetaBase() = default;
  bool requires_grad = false;
};

/// The shared state behind a Tensor handle. Invariant: numel/contiguous match sizes/strides
/// (call refresh() after changing them).
struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Shape sizes;
  Shape strides;           ///< in elements
  int64_t offset = 0;      ///< in elements, from storage->data()
  int64_t numel = 0;
  Dtype dtype = kFloat32;
  bool contiguous = true;  ///< row-major contiguous (size-1 dims may have any stride)
  bool is_view = false;    ///< made by a view op (shares another tensor's storage)
  std::shared_ptr<AutogradMetaBase> autograd;

  void refresh();
};

/// Options for creating a tensor: dtype, device, pinned host memory. Implicitly made from a
/// Dtype or a Device, so `zeros({2}, kInt64)` and `zeros({2}, Device("cuda"))` both work.
struct TensorOptions {
  Dtype dtype_ = kDefaultFloat;
  Device device_ = kCPU;
  bool pinned_ = false;

  TensorOptions() = default;
  TensorOptions(Dtype d) : dtype_(d) {}                   // NOLINT
  TensorOptions(Device d) : device_(d) {}                 // NOLINT
  TensorOptions(const char* d) : device_(Device(d)) {}    // NOLINT
  TensorOptions dtype(Dtype d) const { auto o = *this; o.dtype_ = d; return o; }
  TensorOptions device(Device d) const { auto o = *this; o.device_ = d; return o; }
  TensorOptions pinned_memory(bool p = true) const { auto o = *this; o.pinned_ = p; return o; }
};

class Tensor {
 public:
  /// An undefined tensor (defined() is false); most ops reject it.
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  bool defined() const { return impl_ != nullptr; }
  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  /// True if both handles name the same TensorImpl.
  bool is_same(const Tensor& o) const { return impl_ == o.impl_; }

  // ---- metadata ----
  const Shape& shape() const { return impl_->sizes; }
  const Shape& sizes() const { return impl_->sizes; }
  /// Size of dim (negative dims count from the end).
  int64_t size(int64_t dim) const;
  const Shape& strides() const { return impl_->strides; }
  int64_t stride(int64_t dim) const;
  int64_t dim() const { return impl_->sizes.size(); }
  int64_t numel() const { return impl_->numel; }
  int64_t storage_offset() const { return impl_->offset; }
  Dtype dtype() const { return impl_->dtype; }
  Device device() const { return impl_->storage->device(); }
  bool is_cpu() const { return device().is_cpu(); }
  bool is_cuda() const { return device().is_cuda(); }
  bool is_floating_point() const { return is_floating(dtype()); }
  bool is_contiguous() const { return impl_->contiguous; }
  bool is_pinned() const { return impl_->storage->is_pinned(); }
  int64_t element_size() const { return itemsize(dtype()); }
  int64_t nbytes() const { return numel() * element_size(); }
  const std::shared_ptr<Storage>& storage() const { return impl_->storage; }
  TensorOptions options() const { return TensorOptions(dtype()).device(device()); }

  /// Address of the first element (storage data + offset).
  void* data_ptr() const {
    return static_cast<char*>(impl_->storage->data()) + impl_->offset * element_size();
  }
  /// Typed pointer to the first element; throws TypeError if T is not this tensor's dtype.
  template <typename T> T* data() const {
    check_dtype_for_data(dtype_of<T>);
    return static_cast<T*>(data_ptr());
  }
  /// The single element of a one-element tensor, as T (copied from the GPU if needed).
  template <typename T> T item() const;
  Scalar item() const;
  /// All elements in row-major order as std::vector<T> (converting the dtype if needed).
  template <typename T> std::vector<T> to_vector() const;

  // ---- autograd state ----
  // requires_grad() is answered here; everything else in this block is defined by the autograd
  // library (autograd/tensor_methods.cpp): link ember_autograd to use it.
  bool requires_grad() const { return impl_->autograd && impl_->autograd->requires_grad; }
  /// Makes this leaf tensor (not) require grad; only floating-point leaves may.
  Tensor& requires_grad_(bool requires_grad = true);
  /// True for tensors not produced by a recorded op (including all that do not require grad).
  bool is_leaf() const;
  /// The accumulated gradient (undefined until a backward pass reaches this tensor).
  Tensor grad() const;
  /// Replaces the gradient (an undefined tensor clears it); checks shape, dtype and device.
  void set_grad(const Tensor& grad) const;
  /// The node that computes this tensor's gradient's contribution to its inputs; null for leaves.
  std::shared_ptr<autograd::Node> grad_fn() const;
  /// Which output of grad_fn() this tensor is.
  uint32_t output_nr() const;
  /// Computes gradients of this tensor with respect to graph leaves (see autograd::backward).
  /// `gradient` may be omitted only for a one-element tensor. retain_graph defaults to
  /// create_graph.
  void backward(const Tensor& gradient = {}, std::optional<bool> retain_graph = {},
                bool create_graph = false, const std::vector<Tensor>& inputs = {}) const;
  /// Makes backward fill grad() of this non-leaf tensor too.
  void retain_grad() const;
  bool retains_grad() const;
  /// A hook that sees this tensor's gradient when it is computed and may replace it (return an
  /// undefined tensor to keep it). Returns a handle for remove_hook.
  unsigned register_hook(std::function<Tensor(const Tensor&)> hook) const;
  void remove_hook(unsigned handle) const;
  /// A leaf's hook, run after grad() accumulated its gradient; returns a handle for remove_hook.
  unsigned register_post_accumulate_grad_hook(std::function<void(const Tensor&)> hook) const;
  /// The same data without autograd history (shares storage and version counter).
  Tensor detach() const;
  /// Drops this tensor's autograd history in place, making it a leaf that does not require grad.
  Tensor& detach_();

  uint32_t version() const { return impl_->storage->version(); }
  void bump_version() const { impl_->storage->bump_version(); }

  // ---- views: share storage with this tensor ----
  /// Same data, new shape; one size may be -1. Requires compatible strides (see reshape).
  Tensor view(IntList shape) const;
  /// view() when strides allow, otherwise a contiguous copy.
  Tensor reshape(IntList shape) const;
  Tensor flatten(int64_t start_dim = 0, int64_t end_dim = -1) const;
  Tensor permute(IntList dims) const;
  /// Dim `source` moved to position `destination`, the others in their order (torch.movedim).
  Tensor movedim(int64_t source, int64_t destination) const;
  Tensor transpose(int64_t dim0, int64_t dim1) const;
  /// Transpose of a tensor with at most 2 dims.
  Tensor t() const;
  /// Elements [start, start + length) of dim.
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  /// Python's t[..., start:end:step, ...] on one dim; start/end clamp like Python slices.
  Tensor slice(int64_t dim, std::optional<int64_t> start = std::nullopt,
               std::optional<int64_t> end = std::nullopt, int64_t step = 1) const;
  /// Removes dim, taking index `index` of it.
  Tensor select(int64_t dim, int64_t index) const;
  Tensor operator[](int64_t index) const { return select(0, index); }
  /// Broadcast view to `shape`; -1 keeps a size. New leading dims are allowed.
  Tensor expand(IntList shape) const;
  Tensor expand_as(const Tensor& other) const { return expand(other.shape()); }
  Tensor squeeze() const;
  Tensor squeeze(int64_t dim) const;
  Tensor unsqueeze(int64_t dim) const;
  Tensor as_strided(IntList size, IntList stride, std::optional<int64_t> storage_offset = {}) const;
  /// This tensor if already contiguous, otherwise a contiguous copy.
  Tensor contiguous() const;

  // ---- copies and conversions ----
  /// Copies src into this tensor (broadcasting src; converting dtype and device). In place.
  Tensor& copy_(const Tensor& src);
  /// A new tensor with its own storage and the same values.
  Tensor clone() const;
  /// This tensor on another device or with another dtype; returns *this (no copy) when nothing
  /// changes unless copy is true. Host-to-device copies of pinned memory run asynchronously
  /// when non_blocking is true.
  Tensor to(Device device, bool non_blocking = false, bool copy = false) const;
  Tensor to(Dtype dtype, bool copy = false) const;
  Tensor to(Device device, Dtype dtype, bool non_blocking = false, bool copy = false) const;
  Tensor to(const char* device) const { return to(Device(device)); }
  Tensor cpu() const { return to(kCPU); }
  Tensor cuda(int index = 0) const { return to(cuda_device(index)); }
  /// A copy in page-locked host memory (this tensor must be on the CPU).
  Tensor pin_memory() const;

  // ---- method sugar over the free functions in tensor/ops.h ----
  Tensor add(const Tensor& o, const Scalar& alpha = 1) const;
  Tensor sub(const Tensor& o, const Scalar& alpha = 1) const;
  Tensor mul(const Tensor& o) const;
  Tensor div(const Tensor& o) const;
  Tensor& add_(const Tensor& o, const Scalar& alpha = 1);
  Tensor& add_(const Scalar& o);
  Tensor& sub_(const Tensor& o, const Scalar& alpha = 1);
  Tensor& mul_(const Tensor& o);
  Tensor& mul_(const Scalar& o);
  Tensor& div_(const Tensor& o);
  Tensor& div_(const Scalar& o);
  Tensor& zero_();
  Tensor& fill_(const Scalar& value);
  Tensor neg() const;
  Tensor abs() const;
  Tensor exp() const;
  Tensor log() const;
  Tensor sqrt() const;
  Tensor pow(const Scalar& exponent) const;
  Tensor relu() const;
  Tensor sigmoid() const;
  Tensor tanh() const;
  Tensor sum() const;
  Tensor sum(IntList dims, bool keepdim = false) const;
  Tensor mean() const;
  Tensor mean(IntList dims, bool keepdim = false) const;
  Tensor max() const;
  Tensor min() const;
  Tensor argmax(std::optional<int64_t> dim = {}, bool keepdim = false) const;
  Tensor matmul(const Tensor& o) const;

  /// PyTorch-style text: "tensor([[1., 2.],\n        [3., 4.]])" plus dtype/device suffixes.
  std::string str() const;

 private:
  void check_dtype_for_data(Dtype t) const;
  std::shared_ptr<TensorImpl> impl_;
};

std::ostream& operator<<(std::ostream& os, const Tensor& t);

Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator+(const Tensor& a, const Scalar& b);
Tensor operator-(const Tensor& a, const Scalar& b);
Tensor operator*(const Tensor& a, const Scalar& b);
Tensor operator/(const Tensor& a, const Scalar& b);
Tensor operator+(const Scalar& a, const Tensor& b);
Tensor operator-(const Scalar& a, const Tensor& b);
Tensor operator*(const Scalar& a, const Tensor& b);
Tensor operator/(const Scalar& a, const Tensor& b);
Tensor operator-(const Tensor& a);
Tensor& operator+=(Tensor& a, const Tensor& b);
Tensor& operator-=(Tensor& a, const Tensor& b);
Tensor& operator*=(Tensor& a, const Tensor& b);
Tensor& operator/=(Tensor& a, const Tensor& b);
Tensor& operator+=(Tensor& a, const Scalar& b);
Tensor& operator-=(Tensor& a, const Scalar& b);
Tensor& operator*=(Tensor& a, const Scalar& b);
Tensor& operator/=(Tensor& a, const Scalar& b);

namespace detail {
/// A new tensor with fresh, uninitialised storage and contiguous strides.
Tensor make_empty(IntList shape, Dtype dtype, Device device, bool pinned = false);
/// A view of base's storage with the given geometry (shares the autograd-free impl fields).
Tensor make_view(const Tensor& base, const Shape& sizes, const Shape& strides, int64_t offset);
/// Throws ValueError "[op] expected a defined tensor for argument 'name'".
void check_defined(const char* op, const Tensor& t, const char* name);
}  // namespace detail

}  // namespace ember
