// Backward rules of the view and copy ops (tensor/tensor.h methods).
#include "autograd/functions.h"
#include "tensor/ops.h"

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
}

}  // namespace ember::autograd
