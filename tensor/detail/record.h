// The seam between the tensor layer and autograd (see docs/architecture.md, "Autograd seam").
//
// A differentiable op's front end computes its result, then ends with
//
//   if (detail::should_record(a, b)) detail::record(OpId::Mul, {&a, &b}, {&out});
//
// `record` calls the function the autograd library installs when it is loaded; that function
// builds the backward Node for the OpId (autograd/functions_*.cpp), points the outputs at it,
// and saves what the backward rule needs. Without the autograd library no tensor can require
// grad, so should_record is always false and nothing is recorded.
//
// In-place ops under recording go through record_inplace (below), which computes the result
// out of place on a differentiable clone, writes it back into self, and moves self's history
// to the new node, so no saved tensor is ever overwritten.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <utility>

#include "tensor/detail/unary_ops.h"
#include "tensor/grad_mode.h"
#include "tensor/tensor.h"

namespace ember {

/// Every op autograd knows how to differentiate. The comment says which inputs the op
/// records (in order) and which OpAttrs fields it sets. Inputs that are not tensors of a
/// floating dtype never receive gradients; outputs of integral dtype are never recorded.
enum class OpId : uint16_t {
  // ---- element-wise unary: inputs {x}; the table in tensor/detail/unary_ops.h, first so
  // that OpId::X and detail::UnaryOp::X share their value ----
#define EMBER_OPID_ENUM_(Op, ...) Op,
  EMBER_UNARY_OPS(EMBER_OPID_ENUM_)
#undef EMBER_OPID_ENUM_
  Gelu,          ///< flag = approximate "tanh"
  PowScalar,     ///< x ** scalar (scalar = exponent)
  RPowScalar,    ///< scalar ** x (scalar = base)
  Clamp,         ///< min/max in opt_lo/opt_hi (has_lo/has_hi say which are set)
  // ---- element-wise binary: inputs {a, b}, broadcast; the engine sums grads back ----
  Add,           ///< a + alpha * b (scalar = alpha)
  Sub,           ///< a - alpha * b (scalar = alpha)
  Mul, Div, Pow, Maximum, Minimum,
  // ---- tensor op scalar: inputs {x} ----
  AddScalar,     ///< x + s (also x - s): gradient passes through
  MulScalar,     ///< x * scalar
  DivScalar,     ///< x / scalar
  RSubScalar,    ///< scalar - x
  RDivScalar,    ///< scalar / x
  // ---- selection: ----
  Where,         ///< inputs {cond, a, b}
  MaskedFill,    ///< inputs {x, mask}
  // ---- reductions: inputs {x} ----
  Sum,           ///< dims, keepdim (empty dims = all)
  Mean,          ///< dims, keepdim
  Prod,          ///< dims, keepdim
  MaxAll, MinAll,             ///< full reduction; ties share the gradient evenly
  MaxDim, MinDim,             ///< outputs {values, indices}; dim, keepdim
  Amax, Amin,                 ///< dims, keepdim; ties share the gradient evenly
  Var, Std,                   ///< dims, keepdim, i0 = correction
  Norm,                       ///< dims, keepdim, scalar = p
  Logsumexp,                  ///< dims, keepdim
  Softmax, LogSoftmax,        ///< dim
  // ---- linear algebra: ----
  Mm, Bmm,       ///< inputs {a, b}
  Addmm,         ///< inputs {bias, a, b}; scalar = alpha, scalar2 = beta
  Conv2d,        ///< inputs {input, weight, bias (may be undefined)}; params = Conv2dParams*
  MaxPool2d,     ///< inputs {x}, outputs {y, indices}; params = Pool2dParams*
  AvgPool2d,     ///< inputs {x}; params = Pool2dParams*
  AdaptiveAvgPool2d,  ///< inputs {x}
  // ---- indexing and joining: ----
  IndexSelect,   ///< inputs {x, index}; dim
  Gather,        ///< inputs {x, index}; dim
  ScatterAdd,    ///< inputs {self, index, src}; dim
  IndexAdd,      ///< inputs {self, index, src}; dim, scalar = alpha
  Embedding,     ///< inputs {weight, indices}
  Cat,           ///< inputs: every tensor; dim
  // ---- views and copies: inputs {x} ----
  ViewAs,        ///< view/reshape/squeeze/unsqueeze: output is x's data in another shape
  Permute,       ///< dims = the permutation
  Slice,         ///< dim, i0 = start, i1 = end (exclusive, already clamped), i2 = step
  Select,        ///< dim, i0 = index (non-negative)
  Expand,        ///< output is x broadcast to its shape
  AsStrided,     ///< output geometry is the output's own (sizes, strides, offset)
  Clone,         ///< clone() / contiguous(): identity gradient
  ToCopy,        ///< to(dtype/device): gradient converted back
  CopyInto,      ///< self.copy_(src): inputs {src}, outputs {self}
  kCount
};

namespace detail {
/// The op a unary kernel computes; kCount for the kernel-only entries that are no op of the
/// table (gelu's two forms share OpId::Gelu and are mapped by its front end).
constexpr OpId opid_of(UnaryOp op) {
  return static_cast<int>(op) < kNumUnaryOps ? static_cast<OpId>(op) : OpId::kCount;
}
#define EMBER_OPID_CHECK_(Op, ...)                                                   \
  static_assert(static_cast<int>(OpId::Op) == static_cast<int>(UnaryOp::Op) &&      \
                    opid_of(UnaryOp::Op) == OpId::Op,                                \
                "OpId and UnaryOp must list the unary table in the same order");
EMBER_UNARY_OPS(EMBER_OPID_CHECK_)
#undef EMBER_OPID_CHECK_
}  // namespace detail

/// Non-tensor arguments of a recorded op; which fields mean what is listed on each OpId.
/// Only read while `record` runs (params points at the caller's struct).
struct OpAttrs {
  Scalar scalar{1};
  Scalar scalar2{1};
  Shape dims;
  int64_t dim = 0;
  int64_t i0 = 0, i1 = 0, i2 = 0;
  bool keepdim = false;
  bool flag = false;
  bool has_lo = false, has_hi = false;
  Scalar opt_lo{0}, opt_hi{0};
  const void* params = nullptr;
};

namespace detail {

inline bool requires_grad(const Tensor& t) { return t.defined() && t.requires_grad(); }

/// True when grad mode is on and any argument requires grad.
template <typename... Ts>
inline bool should_record(const Ts&... ts) {
  return GradMode::is_enabled() && (requires_grad(ts) || ...);
}
inline bool should_record_list(const std::vector<Tensor>& ts) {
  if (!GradMode::is_enabled()) return false;
  for (const Tensor& t : ts) {
    if (requires_grad(t)) return true;
  }
  return false;
}

/// The functions the autograd library installs. `record` receives inputs and outputs as
/// arrays; an output may be an existing tensor (in-place ops), whose history it replaces.
struct AutogradHooks {
  void (*record)(OpId op, const Tensor* const* inputs, size_t n_inputs, Tensor* const* outputs,
                 size_t n_outputs, const OpAttrs& attrs);
  /// Throws if `self` may not be modified in place under recording (a leaf that requires
  /// grad, or a view of one).
  void (*check_inplace)(const Tensor& self, const char* op);
};
void install_autograd_hooks(const AutogradHooks* hooks);
const AutogradHooks* autograd_hooks();

void record(OpId op, std::initializer_list<const Tensor*> inputs,
            std::initializer_list<Tensor*> outputs, const OpAttrs& attrs = OpAttrs{});
void record_list(OpId op, const std::vector<Tensor>& inputs, std::initializer_list<Tensor*> outputs,
                 const OpAttrs& attrs = OpAttrs{});
void check_inplace(const Tensor& self, const char* op);

/// An in-place op under recording: `out_of_place(clone_of_self)` computes (and records) the
/// result, which is written into self; self's history then points at the result's node.
/// The clone keeps the original values for backward rules that need them.
template <typename F>
Tensor& record_inplace(const char* op, Tensor& self, F&& out_of_place) {
  check_inplace(self, op);
  Tensor result = out_of_place(self.clone());
  {
    NoGradGuard no_grad;
    self.copy_(result);
  }
  // self takes over result's history (an identity node from result to self).
  record(OpId::Clone, {&result}, {&self});
  return self;
}

}  // namespace detail
}  // namespace ember
