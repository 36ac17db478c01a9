// Backward rules of convolution and pooling (tensor/ops/conv.h).
//
// They use the dedicated backward kernels of tensor/ops/conv.h, which record nothing: under
// create_graph, a rule whose result would need history (an input of the backward computation
// requires grad) throws instead of returning a gradient that silently lacks it.
#include <ember/autograd/detail/functions.h>
#include <ember/tensor/ops.h>

namespace ember::autograd {
namespace {

/// Throws when the backward kernel about to run would have to record its result (create_graph
/// and one of the kernel's tensor arguments requires grad): the kernels are not differentiable.
void check_not_double_backward(const Node& n, std::initializer_list<const Tensor*> args) {
  if (!GradMode::is_enabled()) return;
  for (const Tensor* t : args) {
    EMBER_CHECK_TYPE(NotImplementedError, !detail::requires_grad(*t),
                     "[backward] double backward through ", n.name(),
                     " is not supported: its backward kernel is not differentiable "
                     "(create_graph=true, and ",
                     describe(*t), " requires grad)");
  }
}

/// A tensor of `shape` standing in for the pooling input in the backward calls: the pooling
/// backward kernels read only the input's shape, dtype and device (see detail/conv_kernels.h),
/// so the node keeps a one-element broadcast view instead of the whole input alive.
Tensor shape_stand_in(const Shape& shape, const Tensor& like) {
  return zeros({}, like.options()).expand(shape);
}

/// conv2d(input [N, C, H, W], weight [O, C/groups, kH, kW], bias [O]).
struct ConvolutionBackward final : Node {
  SavedTensor input, weight;
  Shape input_shape, weight_shape;
  Conv2dParams params;
  const char* name() const override { return "ConvolutionBackward"; }
  TensorList apply(TensorList&& g) override {
    // g: [N, O, H', W']
    TensorList r(3);
    if (needs_input_grad(0)) {
      const Tensor w = weight.unpack(*this);
      check_not_double_backward(*this, {&g[0], &w});
      r[0] = conv2d_backward_input(g[0], input_shape, w, params);
    }
    if (needs_input_grad(1)) {
      const Tensor x = input.unpack(*this);
      check_not_double_backward(*this, {&g[0], &x});
      r[1] = conv2d_backward_weight(g[0], x, weight_shape, params);
    }
    if (needs_input_grad(2)) {  // per-channel sums: [N, C, H*W] -> [N, C] -> [C], no copy
      const Tensor& go = g[0];
      r[2] = go.is_contiguous()
                 ? sum(sum(go.view({go.size(0), go.size(1), go.size(2) * go.size(3)}), {2}), {0})
                 : sum(go, {0, 2, 3});
    }
    return r;
  }
  void release_variables() override {
    input.release();
    weight.release();
  }
};

void record_conv2d(const RecordArgs& r) {
  auto n = new_node<ConvolutionBackward>(r);
  n->params = r.attrs<OpId::Conv2d>();
  n->input_shape = r.in(0).shape();
  n->weight_shape = r.in(1).shape();
  if (n->needs_input_grad(0)) n->weight = SavedTensor(r.in(1), false);
  if (n->needs_input_grad(1)) n->input = SavedTensor(r.in(0), false);
  commit(n, r);
}

/// max_pool2d: the gradient goes to each window's maximum (the saved indices, as in PyTorch).
struct MaxPool2DWithIndicesBackward final : Node {
  SavedTensor indices;  // int64, without history: no reference cycle with this node
  Shape input_shape;
  Pool2dParams params;
  const char* name() const override { return "MaxPool2DWithIndicesBackward"; }
  TensorList apply(TensorList&& g) override {
    check_not_double_backward(*this, {&g[0]});
    return {max_pool2d_backward(g[0], shape_stand_in(input_shape, g[0]), indices.unpack(*this),
                                params)};
  }
  void release_variables() override { indices.release(); }
};

void record_max_pool2d(const RecordArgs& r) {
  auto n = new_node<MaxPool2DWithIndicesBackward>(r);
  n->params = r.attrs<OpId::MaxPool2d>();
  n->input_shape = r.in(0).shape();
  n->indices = SavedTensor(r.out(1), false);
  commit(n, r);
}

struct AvgPool2DBackward final : Node {
  Shape input_shape;
  Pool2dParams params;
  const char* name() const override { return "AvgPool2DBackward"; }
  TensorList apply(TensorList&& g) override {
    check_not_double_backward(*this, {&g[0]});
    return {avg_pool2d_backward(g[0], shape_stand_in(input_shape, g[0]), params)};
  }
};

void record_avg_pool2d(const RecordArgs& r) {
  auto n = new_node<AvgPool2DBackward>(r);
  n->params = r.attrs<OpId::AvgPool2d>();
  n->input_shape = r.in(0).shape();
  commit(n, r);
}

/// The output size is g's spatial size.
struct AdaptiveAvgPool2DBackward final : Node {
  Shape input_shape;
  const char* name() const override { return "AdaptiveAvgPool2DBackward"; }
  TensorList apply(TensorList&& g) override {
    check_not_double_backward(*this, {&g[0]});
    return {adaptive_avg_pool2d_backward(g[0], shape_stand_in(input_shape, g[0]))};
  }
};

void record_adaptive_avg_pool2d(const RecordArgs& r) {
  auto n = new_node<AdaptiveAvgPool2DBackward>(r);
  n->input_shape = r.in(0).shape();
  commit(n, r);
}

}  // namespace

void register_conv(FactoryTable& t) {
  slot(t, OpId::Conv2d) = record_conv2d;
  slot(t, OpId::MaxPool2d) = record_max_pool2d;
  slot(t, OpId::AvgPool2d) = record_avg_pool2d;
  slot(t, OpId::AdaptiveAvgPool2d) = record_adaptive_avg_pool2d;
}

}  // namespace ember::autograd
