// Dense float32 loops of the hottest element-wise ops, compiled for AVX-512 and AVX2 as well as
// the baseline and picked at load time (GCC function multi-versioning), so the library still
// runs on any x86-64. Only ops whose per-element work is long enough to gain from wider vectors
// are here (GELU's tanh form and its gradient, a transformer MLP's element-wise hot spot);
// memory-bound ones (add, copy) gain nothing from wider registers. The file compiles with
// -ffp-contract=off (tensor/CMakeLists.txt): AVX-512 has FMA, and a contracted multiply-add would
// round differently from the baseline; so every version gives the same bits.
#include <ember/tensor/cpu/elementwise_loops.h>
#include <ember/tensor/cpu/wide_loops.h>
#include <ember/tensor/detail/unary_ops.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define EMBER_WIDE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define EMBER_WIDE_CLONES
#endif

namespace ember::detail::cpu_ew {

namespace {

EMBER_WIDE_CLONES void gelu_tanh_run(float* o, const float* x, int64_t n) {
  const fn::GeluTanh f;
  for (int64_t i = 0; i < n; ++i) o[i] = f(x[i]);
}

EMBER_WIDE_CLONES void gelu_tanh_grad_run(float* o, const float* g, const float* x, int64_t n) {
  const fn::GeluTanhGrad f;
  for (int64_t i = 0; i < n; ++i) o[i] = f(g[i], x[i]);
}

bool dense_f32(const Tensor& t, int64_t n) {
  return t.dtype() == kFloat32 && t.numel() == n && t.is_contiguous();
}

}  // namespace

bool unary_wide(UnaryOp op, const Tensor& out, const Tensor& in) {
  const int64_t n = out.numel();
  if (op != UnaryOp::GeluTanh || n == 0 || !dense_f32(out, n) || !dense_f32(in, n)) return false;
  float* o = ptr<float>(out);
  const float* x = ptr<const float>(in);
  chunked(n, [=](int64_t b, int64_t e) { gelu_tanh_run(o + b, x + b, e - b); });
  return true;
}

bool binary_wide(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  const int64_t n = out.numel();
  if (op != BinaryOp::GeluTanhGrad || n == 0 || !dense_f32(out, n) || !dense_f32(a, n) ||
      !dense_f32(b, n)) {
    return false;
  }
  float* o = ptr<float>(out);
  const float* g = ptr<const float>(a);
  const float* x = ptr<const float>(b);
  chunked(n, [=](int64_t lo, int64_t hi) { gelu_tanh_grad_run(o + lo, g + lo, x + lo, hi - lo); });
  return true;
}

}  // namespace ember::detail::cpu_ew
