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
#include <optional>
#include <type_traits>
#include <utility>
#include <variant>

#include <ember/tensor/ops/conv.h>
#include <ember/tensor/detail/attention_kernels.h>
#include <ember/tensor/detail/elementwise_kernels.h>
#include <ember/tensor/grad_mode.h>
#include <ember/tensor/ops/loss.h>
#include <ember/tensor/tensor.h>

namespace ember {

/// Every op autograd knows how to differentiate. The comment says which inputs the op
/// records (in order) and, where it has any, its attribute type (EMBER_OP_ATTRS below).
/// Inputs that are not tensors of a floating dtype never receive gradients; outputs of
/// integral dtype are never recorded.
enum class OpId : uint16_t {
  // ---- element-wise unary: inputs {x}; the table in tensor/detail/unary_ops.h, first so
  // that OpId::X and detail::UnaryOp::X share their value ----
#define EMBER_OPID_ENUM_(Op, ...) Op,
  EMBER_UNARY_OPS(EMBER_OPID_ENUM_)
#undef EMBER_OPID_ENUM_
  Gelu,          ///< GeluAttrs
  PowScalar,     ///< x ** scalar; ScalarAttrs (the exponent)
  RPowScalar,    ///< scalar ** x; ScalarAttrs (the base)
  Clamp,         ///< ClampAttrs
  // ---- element-wise binary: inputs {a, b}, broadcast; the engine sums grads back. The table
  // in tensor/detail/binary_ops.h; Add and Sub: ScalarAttrs (alpha) ----
#define EMBER_OPID_ENUM_(Op, ...) Op,
  EMBER_BINARY_OPS(EMBER_OPID_ENUM_)
#undef EMBER_OPID_ENUM_
  // ---- tensor op scalar: inputs {x}; ScalarAttrs ----
  AddScalar,     ///< x + s (also x - s): gradient passes through
  MulScalar,     ///< x * scalar
  DivScalar,     ///< x / scalar
  RSubScalar,    ///< scalar - x
  RDivScalar,    ///< scalar / x
  // ---- selection: ----
  Where,         ///< inputs {cond, a, b}
  MaskedFill,    ///< inputs {x, mask}
  // ---- reductions: inputs {x} ----
  Sum,           ///< ReduceAttrs (empty dims = all)
  Mean,          ///< ReduceAttrs
  Prod,          ///< ReduceAttrs
  MaxAll, MinAll,             ///< full reduction; ties share the gradient evenly
  MaxDim, MinDim,             ///< outputs {values, indices}; DimAttrs
  Amax, Amin,                 ///< ReduceAttrs; ties share the gradient evenly
  Var, Std,                   ///< VarAttrs
  Norm,                       ///< NormAttrs
  Logsumexp,                  ///< ReduceAttrs
  Softmax, LogSoftmax,        ///< DimAttrs
  // ---- linear algebra: ----
  Mm, Bmm,       ///< inputs {a, b}
  Addmm,         ///< inputs {bias, a, b}; AddmmAttrs
  // ---- convolution and pooling (autograd/functions_conv.cpp): ----
  Conv2d,        ///< inputs {input, weight, bias (may be undefined)}; Conv2dParams
  MaxPool2d,     ///< inputs {x}, outputs {y, indices}; Pool2dParams
  AvgPool2d,     ///< inputs {x}; Pool2dParams
  AdaptiveAvgPool2d,  ///< inputs {x}
  // ---- fused ops behind nn's layers and losses (autograd/functions_nn.cpp): ----
  LayerNorm,     ///< inputs {x, weight, bias (both may be undefined)}; LayerNormAttrs
  BatchNorm,     ///< inputs {x, weight, bias (both may be undefined)}; BatchNormAttrs
  CrossEntropy,  ///< inputs {x [N, C]}; CrossEntropyAttrs
  ScaledDotProductAttention,  ///< inputs {q, k, v}, the fused kernels' layout; AttentionAttrs
  // ---- indexing and joining: ----
  IndexSelect,   ///< inputs {x, index}; DimAttrs
  Gather,        ///< inputs {x, index}; DimAttrs
  ScatterAdd,    ///< inputs {self, index, src}; DimAttrs
  IndexAdd,      ///< inputs {self, index, src}; IndexAddAttrs
  Embedding,     ///< inputs {weight, indices}
  Cat,           ///< inputs: every tensor; DimAttrs
  // ---- views and copies: inputs {x} ----
  ViewAs,        ///< view/reshape/squeeze/unsqueeze: output is x's data in another shape
  Permute,       ///< PermuteAttrs
  Slice,         ///< SliceAttrs
  Select,        ///< SelectAttrs
  Split,         ///< split/split_with_sizes/chunk: outputs the parts along DimAttrs::dim
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

#define EMBER_BINARY_OPID_(Op, ...) OpId::Op,
/// The OpIds of the binary table, indexed by BinaryOp.
inline constexpr OpId kBinaryOpIds[] = {EMBER_BINARY_OPS(EMBER_BINARY_OPID_)};
#undef EMBER_BINARY_OPID_
/// The op a binary kernel computes (kCount for kernels that are no recorded op).
constexpr OpId opid_of(BinaryOp op) {
  return is_table_op(op) ? kBinaryOpIds[static_cast<int>(op)] : OpId::kCount;
}
/// The kernel of an op of the binary table (the table's ops are consecutive in OpId).
constexpr BinaryOp binary_op_of(OpId op) {
  return static_cast<BinaryOp>(static_cast<int>(op) - static_cast<int>(kBinaryOpIds[0]));
}
#define EMBER_OPID_CHECK_(Op, ...)                                               \
  static_assert(binary_op_of(OpId::Op) == BinaryOp::Op,                          \
                "OpId must list the binary table consecutively, in its order");
EMBER_BINARY_OPS(EMBER_OPID_CHECK_)
#undef EMBER_OPID_CHECK_

// The OpId a row's tensor-scalar form records, by its `scalar` column (binary_ops.h).
#define EMBER_SCALAR_OPID_NoScalar OpId::kCount
#define EMBER_SCALAR_OPID_Commutes(S) OpId::S
#define EMBER_SCALAR_OPID_Scalars(S, R) (reverse ? OpId::R : OpId::S)
/// The op the tensor-scalar form of `op` records: x op s, or s op x when reverse (kCount: the
/// op has no such form).
constexpr OpId scalar_opid_of(BinaryOp op, bool reverse) {
  switch (op) {
#define EMBER_BINARY_SCALAR_OPID_(Op, name, dom, sa, sb, so, scalar, ...) \
  case BinaryOp::Op:                                                    \
    return EMBER_SCALAR_OPID_##scalar;
    EMBER_BINARY_OPS(EMBER_BINARY_SCALAR_OPID_)
#undef EMBER_BINARY_SCALAR_OPID_
    default:
      return OpId::kCount;
  }
}
#undef EMBER_SCALAR_OPID_NoScalar
#undef EMBER_SCALAR_OPID_Commutes
#undef EMBER_SCALAR_OPID_Scalars
}  // namespace detail

// ---- typed attributes ---------------------------------------------------------------------------
// What a backward rule needs of an op besides tensors. Each op has one attribute type,
// OpAttrsOf<op> (NoAttrs unless EMBER_OP_ATTRS lists it): a front end records with
// record<OpId::X>(..., OpAttrsOf<X>{...}) and the factory reads r.attrs<OpId::X>(), so both
// sides name the same type at compile time; an op chosen at run time is checked when recorded.

struct NoAttrs {};
/// Add/Sub: alpha; the tensor-scalar ops: the scalar (PowScalar: the exponent, RPowScalar: the
/// base).
struct ScalarAttrs {
  Scalar scalar{1};
};
struct GeluAttrs {
  bool tanh_approx = false;  ///< approximate == "tanh"
};
struct ClampAttrs {
  std::optional<Scalar> lo, hi;  ///< at least one is set
};
/// A reduction over dims (empty = all).
struct ReduceAttrs {
  Shape dims;
  bool keepdim = false;
};
struct VarAttrs {
  ReduceAttrs reduce;
  int64_t correction = 1;
};
struct NormAttrs {
  ReduceAttrs reduce;
  double p = 2;
};
/// One dimension (MaxDim/MinDim also use keepdim).
struct DimAttrs {
  int64_t dim = 0;
  bool keepdim = false;
};
struct IndexAddAttrs {
  int64_t dim = 0;
  Scalar alpha{1};
};
struct AddmmAttrs {
  Scalar alpha{1}, beta{1};
};
struct PermuteAttrs {
  Shape dims;  ///< the permutation
};
struct SliceAttrs {
  int64_t dim = 0, start = 0, end = 0, step = 1;  ///< end exclusive, already clamped
};
struct SelectAttrs {
  int64_t dim = 0, index = 0;  ///< index non-negative
};

// The fused ops' attributes also carry the tensors their forward computed for backward besides
// inputs and outputs (statistics, probabilities); the node saves them.

/// layer_norm over the last normalized_dims dims. mean and rstd ([rows]): the fused kernels'
/// per-row statistics, undefined after the tensor-op path.
struct LayerNormAttrs {
  int64_t normalized_dims = 1;
  double eps = 1e-5;
  Tensor mean, rstd;
};
/// batch_norm's normalisation over dim 1 (Note [BatchNorm as one op] in tensor/ops/norm.cpp).
/// mean and invstd ([C], x's dtype): the batch's statistics when training, else the running
/// ones (constants for backward).
struct BatchNormAttrs {
  bool training = true;
  double eps = 1e-5;
  Tensor mean, invstd;
};
/// The fused 2-d cross_entropy (Note [Fused cross_entropy] in tensor/ops/loss.cpp).
struct CrossEntropyAttrs {
  Reduction reduction = Reduction::kMean;
  double label_smoothing = 0;
  double weight_sum = 0;  ///< C, with smoothing and without class weights (whose sum the backward
                          ///< takes on the device)
  // [N] and [C] tensors in the accumulation type (float32 for float16 and bfloat16 input).
  Tensor lse;           ///< [N] log sum exp of each row
  Tensor target_index;  ///< [N, 1] int64 class of each row, 0 where ignored
  Tensor row_weight;    ///< [N] the target class's weight, 0 where ignored
  Tensor valid;         ///< [N] 1, 0 where ignored
  Tensor class_weight;  ///< [C], or undefined
};
/// The fused attention kernels' parameters, the additive mask they read (undefined without one)
/// and the forward's per-row logsumexp lse [batch, L].
struct AttentionAttrs {
  detail::AttentionParams params;
  Tensor mask, lse;
};

/// X(Op, Attrs): every op whose attributes are not NoAttrs.
#define EMBER_OP_ATTRS(X)                                                                     \
  X(Gelu, GeluAttrs) X(PowScalar, ScalarAttrs) X(RPowScalar, ScalarAttrs) X(Clamp, ClampAttrs) \
  X(Add, ScalarAttrs) X(Sub, ScalarAttrs) X(AddScalar, ScalarAttrs) X(MulScalar, ScalarAttrs)  \
  X(DivScalar, ScalarAttrs) X(RSubScalar, ScalarAttrs) X(RDivScalar, ScalarAttrs)              \
  X(Sum, ReduceAttrs) X(Mean, ReduceAttrs) X(Prod, ReduceAttrs) X(Amax, ReduceAttrs)           \
  X(Amin, ReduceAttrs) X(Logsumexp, ReduceAttrs) X(Var, VarAttrs) X(Std, VarAttrs)             \
  X(Norm, NormAttrs) X(MaxDim, DimAttrs) X(MinDim, DimAttrs) X(Softmax, DimAttrs)              \
  X(LogSoftmax, DimAttrs) X(Addmm, AddmmAttrs) X(Conv2d, Conv2dParams)                         \
  X(MaxPool2d, Pool2dParams) X(AvgPool2d, Pool2dParams) X(IndexSelect, DimAttrs)               \
  X(Gather, DimAttrs) X(ScatterAdd, DimAttrs) X(IndexAdd, IndexAddAttrs) X(Cat, DimAttrs)      \
  X(Permute, PermuteAttrs) X(Slice, SliceAttrs) X(Select, SelectAttrs) X(Split, DimAttrs)      \
  X(LayerNorm, LayerNormAttrs) X(BatchNorm, BatchNormAttrs) X(CrossEntropy, CrossEntropyAttrs) \
  X(ScaledDotProductAttention, AttentionAttrs)

/// The attributes of one recorded op, whichever type it has.
using OpAttrs = std::variant<NoAttrs, ScalarAttrs, GeluAttrs, ClampAttrs, ReduceAttrs, VarAttrs,
                             NormAttrs, DimAttrs, IndexAddAttrs, AddmmAttrs, PermuteAttrs,
                             SliceAttrs, SelectAttrs, Conv2dParams, Pool2dParams,
                             LayerNormAttrs, BatchNormAttrs, CrossEntropyAttrs, AttentionAttrs>;

template <OpId op>
struct OpAttrsOfT {
  using type = NoAttrs;
};
#define EMBER_OP_ATTRS_OF_(Op, Attrs) \
  template <>                         \
  struct OpAttrsOfT<OpId::Op> {       \
    using type = Attrs;               \
  };
EMBER_OP_ATTRS(EMBER_OP_ATTRS_OF_)
#undef EMBER_OP_ATTRS_OF_
/// The attribute type of `op`.
template <OpId op>
using OpAttrsOf = typename OpAttrsOfT<op>::type;

namespace detail {
template <typename T, size_t I = 0>
constexpr size_t attrs_index() {
  static_assert(I < std::variant_size_v<OpAttrs>, "an attribute type is missing from OpAttrs");
  if constexpr (std::is_same_v<std::variant_alternative_t<I, OpAttrs>, T>) {
    return I;
  } else {
    return attrs_index<T, I + 1>();
  }
}
/// The OpAttrs alternative `op` records with.
constexpr size_t attrs_index(OpId op) {
  switch (op) {
#define EMBER_OP_ATTRS_CASE_(Op, Attrs) \
  case OpId::Op:                        \
    return attrs_index<Attrs>();
    EMBER_OP_ATTRS(EMBER_OP_ATTRS_CASE_)
#undef EMBER_OP_ATTRS_CASE_
    default:
      return attrs_index<NoAttrs>();
  }
}
}  // namespace detail

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

/// Records `op` (known only at run time); `attrs` must hold OpAttrsOf<op>, which is asserted.
void record(OpId op, std::initializer_list<const Tensor*> inputs,
            std::initializer_list<Tensor*> outputs, OpAttrs attrs = NoAttrs{});
void record_list(OpId op, const std::vector<Tensor>& inputs, std::initializer_list<Tensor*> outputs,
                 OpAttrs attrs = NoAttrs{});
/// Records `op` with one input and a run-time number of outputs (split's parts).
void record_outputs(OpId op, const Tensor& input, std::vector<Tensor>& outputs,
                    OpAttrs attrs = NoAttrs{});

/// Records `op` with its attributes, their type checked at compile time.
template <OpId op>
void record(std::initializer_list<const Tensor*> inputs, std::initializer_list<Tensor*> outputs,
            OpAttrsOf<op> attrs = {}) {
  record(op, inputs, outputs, OpAttrs(std::move(attrs)));
}
template <OpId op>
void record_list(const std::vector<Tensor>& inputs, std::initializer_list<Tensor*> outputs,
                 OpAttrsOf<op> attrs = {}) {
  record_list(op, inputs, outputs, OpAttrs(std::move(attrs)));
}
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
