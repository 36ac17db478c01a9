// bfloat16 GEMM on oneDNN's matmul primitive. OpenBLAS as Debian builds it has no bfloat16
// GEMM, and going through float32 copies costs more than the product itself for the shapes of a
// small transformer; oneDNN reads the bfloat16 operands directly, accumulates in float32 with
// the CPU's bf16 dot-product instructions where it has them (avx512_bf16, AMX) and an
// emulation otherwise, and rounds once into the bfloat16 result. Debian's oneDNN (2.6) has no
// bfloat16 matmul below AVX-512 (an AVX2-only CPU: AMD's Zen 2, Intel's before Skylake-SP):
// there the product goes through float32 copies and oneDNN's sgemm, accumulating and rounding
// as the primitive does, so results agree to bfloat16's rounding.
#include <ember/tensor/cpu/matmul_dnnl.h>

#include <omp.h>

#include <array>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.h>
#include <oneapi/dnnl/dnnl.hpp>

#include <ember/tensor/error.h>
#include <ember/tensor/tensor.h>
#include <ember/tensor/threading.h>

namespace ember::detail {

namespace {

using dnnl::memory;

dnnl::engine& engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

// OpenMP's thread count is per calling thread: an autograd worker or a rank-thread would
// otherwise run with the runtime's default instead of Ember's setting.
void use_embers_thread_count() {
  if (!omp_in_parallel()) omp_set_num_threads(get_num_threads());
}

using Key = std::array<int64_t, 11>;

struct Gemm {
  dnnl::matmul prim;
  memory::desc a, b, c, scratch;
  bool supported = true;  // false: this oneDNN has no bfloat16 matmul on this CPU
};

// A row-major [rows, cols] matrix, or the transpose of one stored with leading dim ld.
memory::desc matrix(int64_t rows, int64_t cols, int64_t ld, bool trans) {
  const memory::dims strides = trans ? memory::dims{1, ld} : memory::dims{ld, 1};
  return memory::desc({rows, cols}, memory::data_type::bf16, strides);
}

std::shared_ptr<Gemm> make_gemm(bool ta, bool tb, int64_t n, int64_t m, int64_t k, int64_t lda,
                                int64_t ldb, int64_t ldc, float alpha, float beta) {
  try {
    auto g = std::make_shared<Gemm>();
    g->a = matrix(n, k, lda, ta);
    g->b = matrix(k, m, ldb, tb);
    g->c = matrix(n, m, ldc, false);
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
    if (beta != 0.0f) {
      dnnl::post_ops ops;
      ops.append_sum(beta);
      attr.set_post_ops(ops);
    }
    dnnl::matmul::desc desc(g->a, g->b, g->c);
    dnnl::matmul::primitive_desc pd(desc, attr, engine());
    g->prim = dnnl::matmul(pd);
    g->scratch = pd.scratchpad_desc();
    return g;
  } catch (const dnnl::error& e) {
    // dnnl_unimplemented: no implementation for this CPU's ISA; anything else is a real error.
    if (e.status == dnnl_unimplemented) {
      auto g = std::make_shared<Gemm>();
      g->supported = false;
      return g;
    }
    throw Error(str_cat("[matmul] oneDNN could not create a bfloat16 matmul primitive for [", n,
                        ", ", k, "] @ [", k, ", ", m, "]: ", e.what()));
  }
}

// c = alpha * op(a) @ op(b) + beta * c through float32 copies (row-major [n, k], [k, m], [n, m])
// and oneDNN's sgemm, rounded once into c: for a CPU whose oneDNN has no bfloat16 matmul.
void gemm_bf16_through_f32(bool ta, bool tb, int64_t n, int64_t m, int64_t k, float alpha,
                           const BFloat16* a, int64_t lda, const BFloat16* b, int64_t ldb,
                           float beta, BFloat16* c, int64_t ldc) {
  const Tensor buf = make_empty({n * k + k * m + n * m}, kFloat32, kCPU);
  float* af = static_cast<float*>(buf.data_ptr());
  float* bf = af + n * k;
  float* cf = bf + k * m;
#pragma omp parallel for schedule(static) if (n * k > 65536)
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t p = 0; p < k; ++p)
      af[i * k + p] = static_cast<float>(ta ? a[p * lda + i] : a[i * lda + p]);
  }
#pragma omp parallel for schedule(static) if (k * m > 65536)
  for (int64_t p = 0; p < k; ++p) {
    for (int64_t j = 0; j < m; ++j)
      bf[p * m + j] = static_cast<float>(tb ? b[j * ldb + p] : b[p * ldb + j]);
  }
  if (beta != 0.0f) {
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < m; ++j) cf[i * m + j] = static_cast<float>(c[i * ldc + j]);
    }
  }
  const dnnl_status_t st = dnnl_sgemm('N', 'N', n, m, k, alpha, af, k, bf, m, beta, cf, m);
  EMBER_CHECK(st == dnnl_success, "[matmul] oneDNN's sgemm failed with status ",
              static_cast<int>(st), " for a bfloat16 product of [", n, ", ", k, "] @ [", k, ", ", m,
              "] through float32");
#pragma omp parallel for schedule(static) if (n * m > 65536)
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < m; ++j) c[i * ldc + j] = BFloat16(cf[i * m + j]);
  }
}

// A primitive splits its work for the OpenMP thread count of the thread that creates it and
// keeps that split, so the count is part of the key: a rank-thread or autograd worker with
// another count gets its own primitive instead of one sized for more or fewer threads.
const Gemm& cached_gemm(bool ta, bool tb, int64_t n, int64_t m, int64_t k, int64_t lda, int64_t ldb,
                        int64_t ldc, float alpha, float beta) {
  static std::mutex mu;
  static std::map<Key, std::shared_ptr<Gemm>> cache;
  int32_t alpha_bits, beta_bits;
  static_assert(sizeof(float) == sizeof(int32_t));
  std::memcpy(&alpha_bits, &alpha, sizeof alpha);
  std::memcpy(&beta_bits, &beta, sizeof beta);
  const Key key{ta, tb, n, m, k, lda, ldb, ldc, alpha_bits, beta_bits, omp_get_max_threads()};
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = cache[key];
  if (!slot) slot = make_gemm(ta, tb, n, m, k, lda, ldb, ldc, alpha, beta);
  return *slot;
}

std::atomic<bool> g_force_through_f32{false};

}  // namespace

void force_bf16_gemm_through_f32(bool on) { g_force_through_f32 = on; }

void dnnl_gemm_bf16(bool ta, bool tb, int64_t n, int64_t m, int64_t k, double alpha,
                    const BFloat16* a, int64_t lda, const BFloat16* b, int64_t ldb, double beta,
                    BFloat16* c, int64_t ldc) {
  use_embers_thread_count();  // before the primitive is made: it is made for the count it sees
  const Gemm& g = cached_gemm(ta, tb, n, m, k, lda, ldb, ldc, static_cast<float>(alpha),
                              static_cast<float>(beta));
  if (!g.supported || g_force_through_f32) {
    gemm_bf16_through_f32(ta, tb, n, m, k, static_cast<float>(alpha), a, lda, b, ldb,
                          static_cast<float>(beta), c, ldc);
    return;
  }
  thread_local dnnl::stream stream(engine());
  dnnl::engine& eng = engine();
  // Scratch bytes from Ember's caching allocator, so one cached primitive may run on several
  // threads at once.
  const Tensor scratch = make_empty({static_cast<int64_t>(g.scratch.get_size())}, kUInt8, kCPU);
  g.prim.execute(stream, {{DNNL_ARG_SRC, memory(g.a, eng, const_cast<BFloat16*>(a))},
                          {DNNL_ARG_WEIGHTS, memory(g.b, eng, const_cast<BFloat16*>(b))},
                          {DNNL_ARG_DST, memory(g.c, eng, c)},
                          {DNNL_ARG_SCRATCHPAD, memory(g.scratch, eng, scratch.data_ptr())}});
  stream.wait();
}

void dnnl_gemm_f32(bool ta, bool tb, int64_t n, int64_t m, int64_t k, double alpha, const float* a,
                   int64_t lda, const float* b, int64_t ldb, double beta, float* c, int64_t ldc) {
  use_embers_thread_count();
  const dnnl_status_t st =
      dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', n, m, k, static_cast<float>(alpha), a, lda, b, ldb,
                 static_cast<float>(beta), c, ldc);
  EMBER_CHECK(st == dnnl_success, "[matmul] oneDNN's sgemm failed with status ", static_cast<int>(st),
              " for [", n, ", ", k, "] @ [", k, ", ", m, "] (transposed a: ", ta, ", b: ", tb, ")");
}

}  // namespace ember::detail
