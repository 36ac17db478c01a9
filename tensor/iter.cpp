#include <ember/tensor/detail/iter.h>

namespace ember::detail {

Geometry make_geometry(IntList shape, std::initializer_list<const Tensor*> operands) {
  Geometry g;
  g.nops = static_cast<int>(operands.size());
  EMBER_INTERNAL_ASSERT(g.nops <= kMaxOperands);
  g.numel = 1;
  for (int64_t s : shape) g.numel *= s;
  const int64_t nd = shape.size();
  int k = 0;
  int64_t full_strides[kMaxOperands][kMaxDims];
  for (const Tensor* t : operands) {
    g.data[k] = static_cast<char*>(t->data_ptr());
    g.itemsize[k] = t->element_size();
    const int64_t lead = nd - t->dim();
    EMBER_INTERNAL_ASSERT(lead >= 0, "operand has more dims than the loop");
    for (int64_t d = 0; d < nd; ++d) {
      const int64_t td = d - lead;
      const bool bcast = td < 0 || t->size(td) == 1;
      full_strides[k][d] = bcast ? 0 : t->stride(td) * g.itemsize[k];
    }
    ++k;
  }
  if (g.numel == 0) return g;
  // Drop size-1 dims, then merge dim d into the running outer dim when it continues it for
  // every operand.
  int out = -1;
  for (int64_t d = 0; d < nd; ++d) {
    if (shape[d] == 1) continue;
    bool merge = out >= 0;
    for (int j = 0; merge && j < g.nops; ++j) {
      merge = g.strides[j][out] == full_strides[j][d] * shape[d];
    }
    if (merge) {
      g.sizes[out] *= shape[d];
      for (int j = 0; j < g.nops; ++j) g.strides[j][out] = full_strides[j][d];
    } else {
      ++out;
      g.sizes[out] = shape[d];
      for (int j = 0; j < g.nops; ++j) g.strides[j][out] = full_strides[j][d];
    }
  }
  g.ndim = out + 1;
  if (g.ndim == 0) {  // a single element: one flat run of length 1
    g.ndim = 1;
    g.sizes[0] = 1;
    for (int j = 0; j < g.nops; ++j) g.strides[j][0] = g.itemsize[j];
  }
  return g;
}

}  // namespace ember::detail
