// What the backward-rule files (autograd/functions_*.cpp) share: the record arguments, the
// factory table, and helpers to build a node for a recorded op. Internal to the autograd
// library (it reads the tensor layer's recording seam, tensor/detail/record.h); users write
// differentiable functions of their own with autograd/function.h.
//
// A family file defines one Node subclass per op (or per group of ops with one rule) and a
// `register_<family>(FactoryTable&)` that maps each OpId to a factory. A factory:
//
//   void record_clamp(const RecordArgs& r) {
//     auto n = new_node<ClampBackward>(r);        // next edges from r's inputs
//     n->lo = r.attrs<OpId::Clamp>().lo;          // the op's typed attributes
//     n->hi = r.attrs<OpId::Clamp>().hi;
//     n->self = SavedTensor(r.in(0), false);
//     commit(n, r);                               // outputs now point at n
//   }
//
// Attributes are typed per op (OpAttrsOf, tensor/detail/record.h): read them as
// r.attrs<OpId::X>(). The element-wise tables' nodes are generated from the tables instead
// (functions_elementwise.cpp).
//
// Save inputs before commit() (an in-place op's output is also its input). Backward rules are
// written with tensor ops only, so they run on every device; they run with grad mode off
// unless create_graph, and then they are recorded like any forward op.
#pragma once

#include <array>
#include <memory>

#include <ember/autograd/node.h>
#include <ember/tensor/detail/record.h>

namespace ember::autograd {

struct RecordArgs {
  OpId op;
  const Tensor* const* inputs;
  size_t n_inputs;
  Tensor* const* outputs;
  size_t n_outputs;
  const OpAttrs& attrs_variant;

  const Tensor& in(size_t i) const { return *inputs[i]; }
  Tensor& out(size_t i) const { return *outputs[i]; }
  /// The recorded op's attributes, typed as OpAttrsOf<Op>. A factory shared by several ops
  /// may name any op whose attributes have the same type as the recorded one's.
  template <OpId Op>
  const OpAttrsOf<Op>& attrs() const {
    EMBER_INTERNAL_ASSERT(detail::attrs_index(op) == detail::attrs_index(Op), "op #",
                          static_cast<int>(op), " read as op #", static_cast<int>(Op));
    return std::get<OpAttrsOf<Op>>(attrs_variant);
  }
};

using NodeFactory = void (*)(const RecordArgs&);
using FactoryTable = std::array<NodeFactory, static_cast<size_t>(OpId::kCount)>;

inline NodeFactory& slot(FactoryTable& t, OpId op) { return t[static_cast<size_t>(op)]; }

// One per family file.
void register_elementwise(FactoryTable& t);
void register_reduce(FactoryTable& t);
void register_linalg(FactoryTable& t);
void register_conv(FactoryTable& t);
void register_indexing(FactoryTable& t);
void register_views(FactoryTable& t);
void register_nn(FactoryTable& t);

template <typename N, typename... Args>
std::shared_ptr<N> new_node(const RecordArgs& r, Args&&... args) {
  auto n = std::make_shared<N>(std::forward<Args>(args)...);
  collect_next_edges(*n, r.inputs, r.n_inputs);
  return n;
}

inline void commit(const std::shared_ptr<Node>& n, const RecordArgs& r) {
  set_history(n, r.outputs, r.n_outputs);
}

/// The inverse of broadcasting: sums `g` down to `shape`.
Tensor sum_to(const Tensor& g, const Shape& shape);

}  // namespace ember::autograd
