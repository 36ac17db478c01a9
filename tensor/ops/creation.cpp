#include <ember/tensor/ops/creation.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include <ember/tensor/detail/copy.h>

namespace ember {

using detail::make_empty;

Tensor empty(IntList shape, TensorOptions o) { return make_empty(shape, o.dtype_, o.device_, o.pinned_); }

Tensor zeros(IntList shape, TensorOptions o) {
  Tensor t = empty(shape, o);
  t.zero_();
  return t;
}

Tensor ones(IntList shape, TensorOptions o) { return full(shape, 1, o); }

Tensor full(IntList shape, const Scalar& value) { return full(shape, value, value.default_dtype()); }

Tensor full(IntList shape, const Scalar& value, TensorOptions o) {
  Tensor t = empty(shape, o);
  t.fill_(value);
  return t;
}

Tensor empty_like(const Tensor& t) {
  detail::check_defined("empty_like", t, "t");
  return empty(t.shape(), t.options());
}
Tensor zeros_like(const Tensor& t) {
  detail::check_defined("zeros_like", t, "t");
  return zeros(t.shape(), t.options());
}
Tensor ones_like(const Tensor& t) {
  detail::check_defined("ones_like", t, "t");
  return ones(t.shape(), t.options());
}
Tensor full_like(const Tensor& t, const Scalar& v) {
  detail::check_defined("full_like", t, "t");
  return full(t.shape(), v, t.options());
}

Tensor scalar_tensor(const Scalar& v, TensorOptions o) { return full({}, v, o); }
Tensor scalar_tensor(const Scalar& v) { return full({}, v); }

namespace {

// PyTorch refuses a value its dtype cannot hold (300 into uint8, 1e20 into int32, 1e6 into
// float16) instead of wrapping it; a floating value into an integer dtype is truncated, as a
// cast would, when the result fits. Infinities and NaN are held by the floating dtypes.
void check_fits(const char* op, const Scalar& v, Dtype dt) {
  double lo = 0, hi = 0;
  bool floating = false;
  switch (dt) {
    case kBool:
    case kFloat64:
      return;
    case kUInt8:
      lo = std::numeric_limits<uint8_t>::min(), hi = std::numeric_limits<uint8_t>::max();
      break;
    case kInt32:
      lo = std::numeric_limits<int32_t>::min(), hi = std::numeric_limits<int32_t>::max();
      break;
    case kInt64:
      // Every integral Scalar fits; a floating one must be below 2^63 (the double below it is
      // the largest that fits).
      if (!v.is_floating()) return;
      lo = static_cast<double>(std::numeric_limits<int64_t>::min());
      hi = std::nextafter(-lo, 0.0);
      break;
    case kFloat16:
      floating = true, hi = 65504.0;  // the largest finite half
      break;
    case kBFloat16:
      floating = true, hi = 3.3895313892515355e38;  // the largest finite bfloat16
      break;
    case kFloat32:
      floating = true, hi = std::numeric_limits<float>::max();
      break;
  }
  if (floating) lo = -hi;
  const double d = v.to_double();
  if (floating && !std::isfinite(d)) return;
  const double t = floating ? d : std::trunc(d);
  EMBER_CHECK(t >= lo && t <= hi, "[", op, "] value ", v, " cannot be converted to ", dt,
              " without overflow (it holds [", lo, ", ", hi, "])");
}

}  // namespace

Tensor& Tensor::fill_(const Scalar& v) {
  detail::check_defined("fill_", *this, "self");
  check_fits("fill_", v, dtype());
  if (numel() == 0) return *this;
  if (is_cpu()) {
    detail::fill_cpu(*this, v);
  } else {
    detail::fill_cuda(*this, v);
  }
  bump_version();
  return *this;
}

Tensor& Tensor::zero_() {
  detail::check_defined("zero_", *this, "self");
  if (numel() == 0) return *this;  // also keeps a null data pointer away from memset
  if (is_cpu() && is_contiguous()) {
    std::memset(data_ptr(), 0, nbytes());
    bump_version();
    return *this;
  }
  return fill_(0);
}

// ---- ranges -----------------------------------------------------------------------------------

Tensor arange(const Scalar& end) { return arange(0, end, 1); }

Tensor arange(const Scalar& start, const Scalar& end, const Scalar& step) {
  const bool integral = !start.is_floating() && !end.is_floating() && !step.is_floating();
  return arange(start, end, step, integral ? kInt64 : kDefaultFloat);
}

Tensor arange(const Scalar& start, const Scalar& end, const Scalar& step, TensorOptions o) {
  const double s = start.to_double(), e = end.to_double(), st = step.to_double();
  EMBER_CHECK(st != 0, "[arange] step must be nonzero");
  EMBER_CHECK(std::isfinite(s) && std::isfinite(e), "[arange] start and end must be finite, got ",
              start, " and ", end);
  EMBER_CHECK((st > 0 && e >= s) || (st < 0 && e <= s), "[arange] upper bound and larger bound "
              "inconsistent with step sign: start=", start, " end=", end, " step=", step);
  int64_t n;
  if (!start.is_floating() && !end.is_floating() && !step.is_floating()) {
    const int64_t is = start.to_int(), ie = end.to_int(), ist = step.to_int();
    n = ist > 0 ? (ie - is + ist - 1) / ist : (is - ie - ist - 1) / (-ist);
  } else {
    n = static_cast<int64_t>(std::ceil((e - s) / st));
  }
  Tensor t = make_empty({n}, o.dtype_, kCPU);
  EMBER_DISPATCH_NUMERIC(o.dtype_, "arange", [&]<typename T>() {
    T* p = t.data<T>();
    if constexpr (std::is_integral_v<T>) {
      const int64_t is = start.to_int(), ist = step.to_int();
      if (!step.is_floating() && !start.is_floating()) {
        for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(is + i * ist);
        return;
      }
    }
    for (int64_t i = 0; i < n; ++i) p[i] = T(s + static_cast<double>(i) * st);
  });
  return o.device_.is_cpu() ? t : t.to(o.device_);
}

Tensor linspace(double start, double end, int64_t steps, TensorOptions o) {
  EMBER_CHECK(steps >= 0, "[linspace] number of steps must be non-negative, got ", steps);
  Tensor t = make_empty({steps}, o.dtype_, kCPU);
  const double step = steps > 1 ? (end - start) / static_cast<double>(steps - 1) : 0.0;
  EMBER_DISPATCH_NUMERIC(o.dtype_, "linspace", [&]<typename T>() {
    T* p = t.data<T>();
    // Fill from both ends (as PyTorch) so the last value is exactly `end`.
    const int64_t half = steps == 1 ? 1 : steps / 2;
    for (int64_t i = 0; i < steps; ++i) {
      const double v = i < half ? start + step * static_cast<double>(i)
                                : end - step * static_cast<double>(steps - 1 - i);
      p[i] = T(v);
    }
  });
  return o.device_.is_cpu() ? t : t.to(o.device_);
}

Tensor eye(int64_t n, std::optional<int64_t> m_opt, TensorOptions o) {
  const int64_t m = m_opt.value_or(n);
  EMBER_CHECK(n >= 0 && m >= 0, "[eye] sizes must be non-negative, got n=", n, " m=", m);
  Tensor t = zeros({n, m}, o);
  if (n > 0 && m > 0) t.as_strided({std::min(n, m)}, {m + 1}, 0).fill_(1);
  return t;
}

// ---- from values ------------------------------------------------------------------------------

template <typename T>
Tensor from_vector(const std::vector<T>& values, IntList shape, Device device) {
  Shape s = shape.empty() ? Shape({static_cast<int64_t>(values.size())}) : Shape(shape);
  EMBER_CHECK(s.numel() == static_cast<int64_t>(values.size()), "[from_vector] shape ", s,
              " needs ", s.numel(), " values, got ", values.size());
  Tensor t = make_empty(s, dtype_of<T>, kCPU);
  if constexpr (std::is_same_v<T, bool>) {
    bool* p = t.data<bool>();
    for (size_t i = 0; i < values.size(); ++i) p[i] = values[i];
  } else if (!values.empty()) {
    std::memcpy(t.data_ptr(), values.data(), values.size() * sizeof(T));
  }
  return device.is_cpu() ? t : t.to(device);
}

template Tensor from_vector(const std::vector<bool>&, IntList, Device);
template Tensor from_vector(const std::vector<uint8_t>&, IntList, Device);
template Tensor from_vector(const std::vector<int32_t>&, IntList, Device);
template Tensor from_vector(const std::vector<int64_t>&, IntList, Device);
template Tensor from_vector(const std::vector<Half>&, IntList, Device);
template Tensor from_vector(const std::vector<BFloat16>&, IntList, Device);
template Tensor from_vector(const std::vector<float>&, IntList, Device);
template Tensor from_vector(const std::vector<double>&, IntList, Device);

namespace {
template <typename T>
Tensor from_list(std::initializer_list<T> values, TensorOptions o) {
  Tensor t = from_vector(std::vector<T>(values));
  return t.to(o.device_, o.dtype_);
}
}  // namespace

Tensor tensor(std::initializer_list<float> v, TensorOptions o) { return from_list(v, o); }
Tensor tensor(std::initializer_list<double> v, TensorOptions o) { return from_list(v, o); }
Tensor tensor(std::initializer_list<int64_t> v, TensorOptions o) { return from_list(v, o); }
Tensor tensor(std::initializer_list<int> v, TensorOptions o) {
  std::vector<int64_t> w(v.begin(), v.end());
  return from_vector(w).to(o.device_, o.dtype_);
}
Tensor tensor(std::initializer_list<bool> v, TensorOptions o) { return from_list(v, o); }

Tensor from_blob(void* data, IntList shape, TensorOptions o, std::function<void(void*)> deleter) {
  return from_blob(data, shape, contiguous_strides(shape), o, std::move(deleter));
}

Tensor from_blob(void* data, IntList shape, IntList strides, TensorOptions o,
                 std::function<void(void*)> deleter) {
  EMBER_CHECK(shape.size() == strides.size(), "[from_blob] shape ", shape, " and strides ",
              strides, " must have the same length");
  int64_t extent = 1;
  bool empty = false;
  for (int64_t i = 0; i < shape.size(); ++i) {
    EMBER_CHECK(shape[i] >= 0 && strides[i] >= 0, "[from_blob] sizes and strides must be "
                "non-negative, got shape ", shape, " strides ", strides);
    if (shape[i] == 0) empty = true;
    extent += (shape[i] - 1) * strides[i];
  }
  EMBER_CHECK(data != nullptr || empty, "[from_blob] data is null for a non-empty shape ", shape);
  // The kernels may use aligned vector loads once they have stepped to a vector boundary, which
  // only ever comes if every element sits at a multiple of its size.
  EMBER_CHECK(reinterpret_cast<uintptr_t>(data) % static_cast<uintptr_t>(itemsize(o.dtype_)) == 0,
              "[from_blob] data at ", data, " is not aligned for ", o.dtype_, ": expected an ",
              "address that is a multiple of ", itemsize(o.dtype_), " bytes");
  const size_t nbytes = empty ? 0 : static_cast<size_t>(extent * itemsize(o.dtype_));
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>(data, nbytes, o.device_, std::move(deleter));
  impl->sizes = Shape(shape);
  impl->strides = Shape(strides);
  impl->dtype = o.dtype_;
  impl->refresh();
  return Tensor(std::move(impl));
}

}  // namespace ember
