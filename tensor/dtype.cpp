#include <ember/tensor/dtype.h>

#include <string>

namespace ember {

namespace {
constexpr std::string_view kNames[] = {"bool",    "uint8",    "int32",   "int64",
                                       "float16", "bfloat16", "float32", "float64"};
}

std::string_view dtype_name(Dtype t) { return kNames[static_cast<int>(t)]; }

std::ostream& operator<<(std::ostream& os, Dtype t) { return os << dtype_name(t); }

Dtype dtype_from_name(std::string_view n) {
  for (int i = 0; i < kNumDtypes; ++i) {
    if (n == kNames[i]) return static_cast<Dtype>(i);
  }
  if (n == "float" || n == "f32") return Dtype::Float32;
  if (n == "double" || n == "f64") return Dtype::Float64;
  if (n == "half" || n == "f16" || n == "fp16") return Dtype::Float16;
  if (n == "bf16") return Dtype::BFloat16;
  if (n == "int" || n == "i32") return Dtype::Int32;
  if (n == "long" || n == "i64") return Dtype::Int64;
  if (n == "byte" || n == "u8") return Dtype::UInt8;
  throw ValueError(detail::str_cat("[dtype] unknown dtype name '", n,
                                   "'; expected one of bool, uint8, int32, int64, float16, "
                                   "bfloat16, float32, float64"));
}

Dtype promote_types(Dtype a, Dtype b) {
  if (a == b) return a;
  // float16 with bfloat16 has no exact common 16-bit type: PyTorch picks float32.
  if ((a == Dtype::Float16 && b == Dtype::BFloat16) ||
      (a == Dtype::BFloat16 && b == Dtype::Float16)) {
    return Dtype::Float32;
  }
  // Otherwise the lattice is a total order: bool < uint8 < int32 < int64 < f16/bf16 < f32 < f64.
  return a > b ? a : b;
}

Dtype promote_with_scalar(Dtype t, ScalarKind k) {
  switch (k) {
    case ScalarKind::Bool:
      return t;
    case ScalarKind::Integral:
      return t == Dtype::Bool ? Dtype::Int64 : t;
    case ScalarKind::Floating:
      return is_floating(t) ? t : kDefaultFloat;
  }
  return t;
}

namespace detail {
void throw_unsupported_dtype(const char* op, Dtype t, const char* supported) {
  throw TypeError(str_cat("[", op, "] dtype ", t, " is not supported; expected ", supported));
}
}  // namespace detail

}  // namespace ember
