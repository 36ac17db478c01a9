// Backward rules of the reductions and softmax (tensor/reduce.h).
#include "autograd/functions.h"
#include "tensor/ops.h"

namespace ember::autograd {
namespace {

/// Re-inserts reduced dims (as size 1) so that g broadcasts against the input.
Tensor unsqueeze_reduced(const Tensor& g, const Shape& dims, int64_t in_dim, bool keepdim) {
  if (keepdim || dims.size() == 0) return g;
  bool reduced[kMaxDims] = {};
  for (int64_t d : dims) reduced[d < 0 ? d + in_dim : d] = true;
  Tensor r = g;
  for (int64_t d = 0; d < in_dim; ++d) {
    if (reduced[d]) r = r.unsqueeze(d);
  }
  return r;
}

struct SumBackward final : Node {
  Shape dims, in_shape;
  bool keepdim = false;
  const char* name() const override { return "SumBackward"; }
  TensorList apply(TensorList&& g) override {
    const int64_t nd = in_shape.size();
    const Tensor e = dims.size() == 0 && !keepdim ? g[0] : unsqueeze_reduced(g[0], dims, nd, keepdim);
    return {e.expand(in_shape)};
  }
};

void record_sum(const RecordArgs& r) {
  auto n = new_node<SumBackward>(r);
  n->dims = r.attrs.dims;
  n->keepdim = r.attrs.keepdim;
  n->in_shape = r.in(0).shape();
  commit(n, r);
}

}  // namespace

void register_reduce(FactoryTable& t) { slot(t, OpId::Sum) = record_sum; }

}  // namespace ember::autograd
