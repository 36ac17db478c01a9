// Element types, PyTorch's type promotion, and dispatch from a runtime Dtype to a C++ type.
#pragma once

#include <cstdint>
#include <ostream>
#include <string_view>

#include <ember/tensor/error.h>
#include <ember/tensor/half.h>

namespace ember {

/// Element type of a tensor. The order is PyTorch's promotion lattice order within each kind.
enum class Dtype : uint8_t { Bool, UInt8, Int32, Int64, Float16, BFloat16, Float32, Float64 };

inline constexpr Dtype kBool = Dtype::Bool;
inline constexpr Dtype kUInt8 = Dtype::UInt8;
inline constexpr Dtype kInt32 = Dtype::Int32;
inline constexpr Dtype kInt64 = Dtype::Int64;
inline constexpr Dtype kFloat16 = Dtype::Float16;
inline constexpr Dtype kBFloat16 = Dtype::BFloat16;
inline constexpr Dtype kFloat32 = Dtype::Float32;
inline constexpr Dtype kFloat64 = Dtype::Float64;
inline constexpr int kNumDtypes = 8;

/// Bytes per element.
constexpr int64_t itemsize(Dtype t) {
  constexpr int8_t sizes[] = {1, 1, 4, 8, 2, 2, 4, 8};
  return sizes[static_cast<int>(t)];
}
/// PyTorch's name without the "torch." prefix: "float32", "int64", "bool", ...
std::string_view dtype_name(Dtype t);
/// Parses "float32"/"float"/"f32", "float16"/"half", "bfloat16", "int64"/"long", ...;
/// throws ValueError naming the string for anything else.
Dtype dtype_from_name(std::string_view name);
constexpr bool is_floating(Dtype t) { return t >= Dtype::Float16; }
constexpr bool is_integral(Dtype t, bool include_bool = false) {
  return (t >= Dtype::UInt8 && t <= Dtype::Int64) || (include_bool && t == Dtype::Bool);
}
std::ostream& operator<<(std::ostream& os, Dtype t);

/// Result dtype of a binary op between tensors of types a and b (torch.promote_types).
Dtype promote_types(Dtype a, Dtype b);

/// The category of a Python-like scalar, used for tensor-scalar promotion: a scalar only
/// raises the category (bool < integer < floating), never the width within one.
enum class ScalarKind : uint8_t { Bool, Integral, Floating };
/// Result dtype of a tensor (of type t) combined with a scalar of the given kind:
/// float tensor + int scalar stays float; int tensor + float scalar becomes the default
/// float dtype (float32); bool + int becomes int64.
Dtype promote_with_scalar(Dtype t, ScalarKind k);

/// Default dtype for floating results and creation functions (float32, as in PyTorch).
constexpr Dtype kDefaultFloat = Dtype::Float32;

template <typename T> struct DtypeOf;
template <> struct DtypeOf<bool> { static constexpr Dtype value = Dtype::Bool; };
template <> struct DtypeOf<uint8_t> { static constexpr Dtype value = Dtype::UInt8; };
template <> struct DtypeOf<int32_t> { static constexpr Dtype value = Dtype::Int32; };
template <> struct DtypeOf<int64_t> { static constexpr Dtype value = Dtype::Int64; };
template <> struct DtypeOf<Half> { static constexpr Dtype value = Dtype::Float16; };
template <> struct DtypeOf<BFloat16> { static constexpr Dtype value = Dtype::BFloat16; };
template <> struct DtypeOf<float> { static constexpr Dtype value = Dtype::Float32; };
template <> struct DtypeOf<double> { static constexpr Dtype value = Dtype::Float64; };
template <typename T> inline constexpr Dtype dtype_of = DtypeOf<T>::value;

namespace detail {
[[noreturn]] void throw_unsupported_dtype(const char* op, Dtype t, const char* supported);
}

}  // namespace ember

// Dispatch: call a generic lambda `[&]<typename T>() { ... }` with T bound to the C++ type of
// `dtype`. The variants list the dtypes an op supports; any other dtype throws TypeError
// naming the op. Instantiate only what an op supports (nvcc compile time grows per type).
#define EMBER_DTYPE_CASE_(D, T, ...) \
  case ::ember::Dtype::D:            \
    return __VA_ARGS__.template operator()<T>();

#define EMBER_DISPATCH_(dtype, op, supported, CASES, ...)                          \
  [&] {                                                                            \
    const ::ember::Dtype ember_dt_ = (dtype);                                      \
    auto&& ember_fn_ = __VA_ARGS__;                                                \
    switch (ember_dt_) {                                                           \
      CASES(ember_fn_)                                                             \
      default:                                                                     \
        ::ember::detail::throw_unsupported_dtype(op, ember_dt_, supported);        \
    }                                                                              \
  }()

#define EMBER_CASES_FLOAT_(F)           \
  EMBER_DTYPE_CASE_(Float32, float, F)  \
  EMBER_DTYPE_CASE_(Float64, double, F) \
  EMBER_DTYPE_CASE_(Float16, ::ember::Half, F) \
  EMBER_DTYPE_CASE_(BFloat16, ::ember::BFloat16, F)
#define EMBER_CASES_INT_(F)               \
  EMBER_DTYPE_CASE_(UInt8, uint8_t, F)    \
  EMBER_DTYPE_CASE_(Int32, int32_t, F)    \
  EMBER_DTYPE_CASE_(Int64, int64_t, F)
#define EMBER_CASES_ALL_(F) EMBER_CASES_FLOAT_(F) EMBER_CASES_INT_(F) \
  EMBER_DTYPE_CASE_(Bool, bool, F)
#define EMBER_CASES_NUMERIC_(F) EMBER_CASES_FLOAT_(F) EMBER_CASES_INT_(F)
#define EMBER_CASES_F32_F64_(F)         \
  EMBER_DTYPE_CASE_(Float32, float, F)  \
  EMBER_DTYPE_CASE_(Float64, double, F)

/// All eight dtypes.
#define EMBER_DISPATCH_ALL(dtype, op, ...) \
  EMBER_DISPATCH_(dtype, op, "all dtypes", EMBER_CASES_ALL_, __VA_ARGS__)
/// Everything but bool.
#define EMBER_DISPATCH_NUMERIC(dtype, op, ...) \
  EMBER_DISPATCH_(dtype, op, "numeric dtypes (not bool)", EMBER_CASES_NUMERIC_, __VA_ARGS__)
/// float16, bfloat16, float32, float64.
#define EMBER_DISPATCH_FLOATING(dtype, op, ...) \
  EMBER_DISPATCH_(dtype, op, "floating dtypes", EMBER_CASES_FLOAT_, __VA_ARGS__)
/// float32 and float64 only (BLAS-backed ops).
#define EMBER_DISPATCH_F32_F64(dtype, op, ...) \
  EMBER_DISPATCH_(dtype, op, "float32 and float64", EMBER_CASES_F32_F64_, __VA_ARGS__)
/// uint8, int32, int64.
#define EMBER_DISPATCH_INTEGRAL(dtype, op, ...) \
  EMBER_DISPATCH_(dtype, op, "integral dtypes", EMBER_CASES_INT_, __VA_ARGS__)
