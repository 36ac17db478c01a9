#include <cstring>

#include <ember/tensor/cpu/loops.h>
#include <ember/tensor/detail/copy.h>

namespace ember::detail {

namespace {
// Dense copies below this many bytes stay on one thread (splitting costs more than it saves).
constexpr int64_t kParallelCopyBytes = int64_t{1} << 19;
}  // namespace

void copy_cpu(const Tensor& dst, const Tensor& src) {
  if (dst.numel() == 0) return;
  if (dst.dtype() == src.dtype() && dst.is_contiguous() && src.is_contiguous()) {
    const int64_t n = dst.nbytes();
    char* d = static_cast<char*>(dst.data_ptr());
    const char* s = static_cast<const char*>(src.data_ptr());
    if (n < kParallelCopyBytes) {
      std::memmove(d, s, n);
    } else {
      parallel_for(0, n, 1 << 20, [&](int64_t b, int64_t e) { std::memmove(d + b, s + b, e - b); });
    }
    return;
  }
  Geometry g = make_geometry(dst.shape(), {&dst, &src});
  EMBER_DISPATCH_ALL(dst.dtype(), "copy_", [&]<typename To>() {
    EMBER_DISPATCH_ALL(src.dtype(), "copy_", [&]<typename From>() {
      cpu::cpu_elementwise<To, From>(g, [](From v) { return convert<To>(v); });
    });
  });
}

void fill_cpu(const Tensor& t, const Scalar& v) {
  if (t.numel() == 0) return;
  Geometry g = make_geometry(t.shape(), {&t});
  EMBER_DISPATCH_ALL(t.dtype(), "fill_", [&]<typename T>() {
    const T value = v.to<T>();
    cpu::cpu_elementwise<T>(g, [value]() { return value; });
  });
}

}  // namespace ember::detail
