// Dense float32 and bfloat16 loops of the hottest element-wise ops, compiled for AVX-512 and AVX2 as well as
// the baseline and picked at load time (GCC function multi-versioning), so the library still
// runs on any x86-64. Only ops whose per-element work is long enough to gain from wider vectors
// are here (GELU's tanh form and its gradient, a transformer MLP's element-wise hot spot, and exp);
// memory-bound ones (add, copy) gain nothing from wider registers. The file compiles with
// -ffp-contract=off (tensor/CMakeLists.txt): AVX-512 has FMA, and a contracted multiply-add would
// round differently from the baseline; so every version gives the same bits.
#include <cstring>

#include <ember/tensor/cpu/elementwise_loops.h>
#include <ember/tensor/cpu/wide_loops.h>
#include <ember/tensor/detail/binary_ops.h>
#include <ember/tensor/detail/lane_sum.h>
#include <ember/tensor/detail/unary_ops.h>

namespace ember::detail::cpu_ew {

namespace {

// BFloat16(f)'s rounding (round to nearest even, NaN kept quiet) written with a select instead
// of BFloat16's early return for NaN, so that loops over it vectorise; the same bits.
[[gnu::always_inline]] inline BFloat16 round_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t nan = (x >> 16) | 0x40u;
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  return BFloat16::from_bits(static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded));
}

// float32, or bfloat16 computed in float32 and rounded once (what the generic loops do).
[[gnu::always_inline]] inline float store(float, float v) { return v; }
[[gnu::always_inline]] inline BFloat16 store(BFloat16, float v) { return round_bf16(v); }

template <typename T>
EMBER_WIDE_CLONES void gelu_tanh_run(T* o, const T* x, int64_t n) {
  const fn::GeluTanh f;
  for (int64_t i = 0; i < n; ++i) o[i] = store(T(), f(float(x[i])));
}

template <typename T>
EMBER_WIDE_CLONES void exp_run(T* o, const T* x, int64_t n) {
  const fn::Exp f;
  for (int64_t i = 0; i < n; ++i) o[i] = store(T(), f(float(x[i])));
}

// Uniform: g holds one value for every element (uniform(), below).
template <typename T, bool Uniform>
EMBER_WIDE_CLONES void gelu_tanh_grad_run(T* o, const T* g, const T* x, int64_t n) {
  const fn::GeluTanhGrad f;
  if constexpr (Uniform) {
    const float g0 = float(*g);
    for (int64_t i = 0; i < n; ++i) o[i] = store(T(), f(g0, float(x[i])));
  } else {
    for (int64_t i = 0; i < n; ++i) o[i] = store(T(), f(float(g[i]), float(x[i])));
  }
}

bool dense(const Tensor& t, Dtype dtype, int64_t n) {
  return t.dtype() == dtype && t.numel() == n && t.is_contiguous();
}

// One element seen n times: how the gradient of a sum or a mean reaches the op before it
// (a value expanded to the input's shape, every stride zero).
bool uniform(const Tensor& t, Dtype dtype, int64_t n) {
  if (t.dtype() != dtype || t.numel() != n) return false;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.stride(d) != 0 && t.size(d) != 1) return false;
  }
  return true;
}

template <typename T>
void gelu_dense(const Tensor& out, const Tensor& in) {
  T* o = ptr<T>(out);
  const T* x = ptr<const T>(in);
  chunked(out.numel(), [=](int64_t b, int64_t e) { gelu_tanh_run<T>(o + b, x + b, e - b); });
}

template <typename T>
void exp_dense(const Tensor& out, const Tensor& in) {
  T* o = ptr<T>(out);
  const T* x = ptr<const T>(in);
  chunked(out.numel(), [=](int64_t b, int64_t e) { exp_run<T>(o + b, x + b, e - b); });
}

template <typename T, bool Uniform>
void gelu_grad(const Tensor& out, const Tensor& grad, const Tensor& in) {
  T* o = ptr<T>(out);
  const T* g = ptr<const T>(grad);
  const T* x = ptr<const T>(in);
  chunked(out.numel(), [=](int64_t b, int64_t e) {
    gelu_tanh_grad_run<T, Uniform>(o + b, Uniform ? g : g + b, x + b, e - b);
  });
}

template <bool Uniform>
void gelu_grad(Dtype dt, const Tensor& out, const Tensor& grad, const Tensor& in) {
  dt == kFloat32 ? gelu_grad<float, Uniform>(out, grad, in)
                 : gelu_grad<BFloat16, Uniform>(out, grad, in);
}

}  // namespace

bool unary_wide(UnaryOp op, const Tensor& out, const Tensor& in) {
  const int64_t n = out.numel();
  const Dtype dt = in.dtype();
  if ((op != UnaryOp::GeluTanh && op != UnaryOp::Exp) || n == 0 ||
      (dt != kFloat32 && dt != kBFloat16) || !dense(out, dt, n) || !dense(in, dt, n)) {
    return false;
  }
  if (op == UnaryOp::Exp) {
    dt == kFloat32 ? exp_dense<float>(out, in) : exp_dense<BFloat16>(out, in);
  } else {
    dt == kFloat32 ? gelu_dense<float>(out, in) : gelu_dense<BFloat16>(out, in);
  }
  return true;
}

bool binary_wide(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  const int64_t n = out.numel();
  const Dtype dt = a.dtype();
  if (op != BinaryOp::GeluTanhGrad || n == 0 || (dt != kFloat32 && dt != kBFloat16) ||
      !dense(out, dt, n) || !dense(b, dt, n)) {
    return false;
  }
  if (dense(a, dt, n)) {
    gelu_grad<false>(dt, out, a, b);
  } else if (uniform(a, dt, n)) {
    gelu_grad<true>(dt, out, a, b);
  } else {
    return false;
  }
  return true;
}

}  // namespace ember::detail::cpu_ew
