// Memory-overlap checks of op outputs (overlap.h).
#include <ember/tensor/detail/overlap.h>

#include <algorithm>
#include <numeric>
#include <utility>
#include <vector>

#include <ember/tensor/error.h>

namespace ember::detail {

void check_writable(const char* op, const Tensor& t) {
  if (t.is_contiguous()) return;
  for (int64_t d = 0; d < t.dim(); ++d) {
    EMBER_CHECK(t.strides()[d] != 0 || t.shape()[d] <= 1, "[", op,
                "] cannot write into a tensor where several elements share one memory location "
                "(shape ",
                t.shape(), ", strides ", t.strides(), "); call clone() on it first");
  }
}

namespace {

// Whether t's elements fill numel() consecutive locations exactly once: its strides, sorted,
// are those of a contiguous tensor of its sizes in that order.
bool dense(const Tensor& t) {
  if (t.is_contiguous()) return true;
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) != 1) dims.push_back(d);
  }
  std::sort(dims.begin(), dims.end(),
            [&](int64_t a, int64_t b) { return t.stride(a) < t.stride(b); });
  int64_t expected = 1;
  for (int64_t d : dims) {
    if (t.stride(d) != expected) return false;
    expected *= t.size(d);
  }
  return true;
}

// The (size, stride) pairs of t's dims longer than 1: two tensors at one address with the same
// pairs lay out the same elements in the same order, whatever their size-1 dims.
std::vector<std::pair<int64_t, int64_t>> squeezed(const Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) != 1) out.emplace_back(t.size(d), t.stride(d));
  }
  return out;
}

}  // namespace

void check_no_partial_overlap(const char* op, const Tensor& out, const Tensor& in) {
  if (!out.defined() || !in.defined() || out.is_same(in) || out.storage() != in.storage()) return;
  if (out.numel() == 0 || in.numel() == 0 || !dense(out) || !dense(in)) return;
  const auto* a = static_cast<const char*>(out.data_ptr());
  const auto* b = static_cast<const char*>(in.data_ptr());
  if (a == b && out.dtype() == in.dtype() && squeezed(out) == squeezed(in)) {
    return;  // the same elements in the same order (x.unsqueeze(0).add_(x) too)
  }
  const bool disjoint = a + out.nbytes() <= b || b + in.nbytes() <= a;
  EMBER_CHECK(disjoint, "[", op, "] some elements of the input (shape ", in.shape(), ", strides ",
              in.strides(), ") and of the output written to (shape ", out.shape(), ", strides ",
              out.strides(),
              ") share memory: the result would depend on the order the elements "
              "are written in; clone() the input first");
}

}  // namespace ember::detail
