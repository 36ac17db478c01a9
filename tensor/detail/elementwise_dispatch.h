// Note [One op table for both devices]
// The CPU and CUDA element-wise kernels differ only in how a functor is run over the operands.
// Which functor serves which op, and for which dtypes, is written once here: each dispatcher
// takes a `Run` object with template members
//   unary<Out, In>(f)                      out = f(in)
//   binary<Out, In>(f)                     out = f(a, b)
//   scalar<Out, In, Reverse>(s, f)         out = f(a, s), or f(s, a) when Reverse
// that cpu/elementwise_loops.h and cuda/elementwise_launch.cuh provide (CpuRun, CudaRun).
#pragma once

#include <limits>
#include <optional>
#include <type_traits>

#include <ember/tensor/detail/elementwise_kernels.h>
#include <ember/tensor/detail/functors.h>

namespace ember::detail {

inline bool is_one(const Scalar& s) {
  return s.is_floating() ? s.to_double() == 1.0 : s.to_int() == 1;
}

// The dispatch macro of each Domain.
#define EMBER_DISPATCH_DOMAIN_Real EMBER_DISPATCH_FLOATING
#define EMBER_DISPATCH_DOMAIN_Numeric EMBER_DISPATCH_NUMERIC
#define EMBER_DISPATCH_DOMAIN_Any EMBER_DISPATCH_ALL

template <typename Run>
void dispatch_unary(UnaryOp op, Dtype dt, Run& run) {
#define EMBER_UNARY_CASE_(Op, name, dom, ...)                                              \
  case UnaryOp::Op:                                                                        \
    EMBER_DISPATCH_DOMAIN_##dom(dt, #name,                                                 \
                                [&]<typename T>() { run.template unary<T, T>(fn::Op{}); }); \
    return;
  switch (op) {
    EMBER_UNARY_OPS(EMBER_UNARY_CASE_)
    EMBER_UNARY_CASE_(GeluErf, gelu, Real)
    EMBER_UNARY_CASE_(GeluTanh, gelu, Real)
    case UnaryOp::LogicalNot:
      EMBER_DISPATCH_ALL(dt, "logical_not", [&]<typename T>() {
        run.template unary<bool, T>(fn::LogicalNot{});
      });
      return;
  }
#undef EMBER_UNARY_CASE_
}

template <typename Run>
void dispatch_clamp(Dtype dt, const std::optional<Scalar>& lo, const std::optional<Scalar>& hi,
                    Run& run) {
  EMBER_DISPATCH_ALL(dt, "clamp", [&]<typename T>() {
    using A = acc_t<T>;
    using L = std::numeric_limits<A>;
    const A lo_v = lo ? lo->to<A>() : (L::has_infinity ? -L::infinity() : L::lowest());
    const A hi_v = hi ? hi->to<A>() : (L::has_infinity ? L::infinity() : L::max());
    run.template unary<T, T>(fn::Clamp<A>{lo_v, hi_v});
  });
}

/// Arithmetic ops only (the binary table and its kernel-only entries); returns false for
/// comparisons and logical ops.
template <typename Run>
bool dispatch_binary(BinaryOp op, Dtype dt, const Scalar& alpha, Run& run) {
  if ((op == BinaryOp::Add || op == BinaryOp::Sub) && !is_one(alpha)) {
    EMBER_DISPATCH_ALL(dt, "add", [&]<typename T>() {
      using A = acc_t<T>;
      A al = alpha.to<A>();
      if constexpr (!std::is_same_v<A, bool>) {
        if (op == BinaryOp::Sub) al = static_cast<A>(-al);
      }
      run.template binary<T, T>(fn::AddAlpha<A>{al});
    });
    return true;
  }
#define EMBER_BINARY_CASE_(Op, name, dom, ...)                                                \
  case BinaryOp::Op:                                                                          \
    EMBER_DISPATCH_DOMAIN_##dom(dt, #name,                                                    \
                                [&]<typename T>() { run.template binary<T, T>(fn::Op{}); }); \
    return true;
  switch (op) {
    EMBER_BINARY_OPS(EMBER_BINARY_CASE_)
    EMBER_BINARY_KERNEL_ONLY(EMBER_BINARY_CASE_)
    default:
      return false;
  }
#undef EMBER_BINARY_CASE_
}

// The tensor-scalar kernels of a row, by its `scalar` column: none, one kernel for both orders
// (the op commutes), or one per order.
#define EMBER_SCALAR_KERNELS_NoScalar(Op, name, dom)
#define EMBER_SCALAR_KERNELS_Commutes(S) EMBER_SCALAR_KERNELS_ONE_
#define EMBER_SCALAR_KERNELS_Scalars(S, R) EMBER_SCALAR_KERNELS_BOTH_
#define EMBER_SCALAR_KERNELS_ONE_(Op, name, dom)                               \
  case BinaryOp::Op:                                                           \
    EMBER_DISPATCH_DOMAIN_##dom(dt, #name, [&]<typename T>() {                 \
      run.template scalar<T, T, false>(s.to<acc_t<T>>(), fn::Op{});            \
    });                                                                        \
    return true;
#define EMBER_SCALAR_KERNELS_BOTH_(Op, name, dom)                              \
  case BinaryOp::Op:                                                           \
    EMBER_DISPATCH_DOMAIN_##dom(dt, #name, [&]<typename T>() {                 \
      reverse ? run.template scalar<T, T, true>(s.to<acc_t<T>>(), fn::Op{})    \
              : run.template scalar<T, T, false>(s.to<acc_t<T>>(), fn::Op{});  \
    });                                                                        \
    return true;

/// Tensor-scalar arithmetic (s on the right, or on the left when reverse); returns false for
/// comparisons and logical ops.
template <typename Run>
bool dispatch_binary_scalar(BinaryOp op, Dtype dt, const Scalar& s, bool reverse, Run& run) {
#define EMBER_BINARY_SCALAR_CASE_(Op, name, dom, sa, sb, so, scalar, ...) \
  EMBER_SCALAR_KERNELS_##scalar(Op, name, dom)
  switch (op) {
    EMBER_BINARY_OPS(EMBER_BINARY_SCALAR_CASE_)
    default:
      return false;
  }
#undef EMBER_BINARY_SCALAR_CASE_
}

#undef EMBER_SCALAR_KERNELS_NoScalar
#undef EMBER_SCALAR_KERNELS_Commutes
#undef EMBER_SCALAR_KERNELS_Scalars
#undef EMBER_SCALAR_KERNELS_ONE_
#undef EMBER_SCALAR_KERNELS_BOTH_

}  // namespace ember::detail
