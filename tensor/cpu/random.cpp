// CPU random fills: a parallel loop over Philox blocks (Note [Random streams]). Each block's
// values depend only on its counter, so the result is the same for any thread count.
#include <algorithm>

#if defined(__x86_64__)
#include <immintrin.h>
#define EMBER_RANDOM_AVX2 1
#endif

#include <ember/tensor/detail/random_kernels.h>
#include <ember/tensor/threading.h>

namespace ember::detail {

namespace {

// Blocks are generated in batches of kBatch. With AVX2 the batch runs as 8-lane vectors, one
// lane per block (philox4x32_10 on one block is a serial chain of multiplies, so lanes are where
// the speed is); otherwise block by block with philox_block. Both give philox4x32_10's words
// bit for bit (the random tests compare them with philox.h), so the choice never changes values.
constexpr int kBatch = 8;

#define EMBER_ALWAYS_INLINE inline __attribute__((always_inline))

template <typename T, typename Op>
EMBER_ALWAYS_INLINE void write_block(T* out, int64_t numel, const Op& op, const Philox4& w,
                                     int64_t j) {
  constexpr int P = Op::kPerBlock;
  const int64_t first = j * P;
  if (first + P <= numel) {
    op(w, out + first, P);
  } else {
    op(w, out + first, static_cast<int>(numel - first));
  }
}

#if defined(EMBER_RANDOM_AVX2)

// hi and lo 32 bits of a * m for the eight 32-bit lanes of a.
__attribute__((target("avx2"))) EMBER_ALWAYS_INLINE void mulhilo8(__m256i a, __m256i m,
                                                                  __m256i* hi, __m256i* lo) {
  const __m256i even = _mm256_mul_epu32(a, m);                         // lanes 0, 2, 4, 6
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);  // lanes 1, 3, 5, 7
  *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xaa);
  *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xaa);
}

// Words of blocks first .. first + 7: c[k][q] is word k of block first + q.
__attribute__((target("avx2"))) EMBER_ALWAYS_INLINE void philox8(uint64_t seed, uint64_t first,
                                                                 uint32_t (&c)[4][kBatch]) {
  alignas(32) uint32_t lo[kBatch], hi[kBatch];
  for (int q = 0; q < kBatch; ++q) {
    lo[q] = static_cast<uint32_t>(first + q);
    hi[q] = static_cast<uint32_t>((first + q) >> 32);
  }
  __m256i c0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(lo));
  __m256i c1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(hi));
  __m256i c2 = _mm256_setzero_si256(), c3 = _mm256_setzero_si256();
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m256i m1 = _mm256_set1_epi32(static_cast<int>(0xCD9E8D57u));
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int r = 0; r < 10; ++r) {
    __m256i hi0, lo0, hi1, lo1;
    mulhilo8(c0, m0, &hi0, &lo0);
    mulhilo8(c2, m1, &hi1, &lo1);
    c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32(static_cast<int>(k0)));
    c1 = lo1;
    c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), _mm256_set1_epi32(static_cast<int>(k1)));
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c[0]), c0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c[1]), c1);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c[2]), c2);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c[3]), c3);
}

template <typename T, typename Op>
__attribute__((target("avx2"))) void fill_blocks_avx2(T* out, int64_t numel, uint64_t seed,
                                                      uint64_t base, const Op& op, int64_t b,
                                                      int64_t e) {
  uint32_t c[4][kBatch];
  for (int64_t j0 = b; j0 < e; j0 += kBatch) {
    const int m = static_cast<int>(std::min<int64_t>(kBatch, e - j0));
    philox8(seed, base + static_cast<uint64_t>(j0), c);
    if constexpr (std::is_same_v<Op, NormalOp<float>>) {
      // Full batches of float normals: Box-Muller across the 16 pairs as 8-lane vectors (the
      // same box_muller_f32 the scalar path and the GPU run, so the values do not change).
      if (m == kBatch && (j0 + kBatch) * 4 <= numel) {
        // box_muller_f32 in three vectorisable steps (sqrt is correctly rounded either way).
        alignas(32) float r[2][kBatch];
        float sn[2][kBatch], cs[2][kBatch], z[4][kBatch];
        for (int q = 0; q < kBatch; ++q) {
          r[0][q] = bm_radius_sq(c[0][q]);
          r[1][q] = bm_radius_sq(c[2][q]);
          bm_angle(c[1][q], &sn[0][q], &cs[0][q]);
          bm_angle(c[3][q], &sn[1][q], &cs[1][q]);
        }
        for (int h = 0; h < 2; ++h) {
          _mm256_store_ps(r[h], _mm256_sqrt_ps(_mm256_load_ps(r[h])));
        }
        for (int q = 0; q < kBatch; ++q) {
          z[0][q] = r[0][q] * cs[0][q];
          z[1][q] = r[0][q] * sn[0][q];
          z[2][q] = r[1][q] * cs[1][q];
          z[3][q] = r[1][q] * sn[1][q];
        }
        const float mean = static_cast<float>(op.mean), stdv = static_cast<float>(op.std);
        float* o = out + j0 * 4;
        for (int q = 0; q < kBatch; ++q) {
          for (int k = 0; k < 4; ++k) o[4 * q + k] = mean + stdv * z[k][q];
        }
        continue;
      }
    }
    for (int q = 0; q < m; ++q) {
      write_block(out, numel, op, Philox4{{c[0][q], c[1][q], c[2][q], c[3][q]}}, j0 + q);
    }
  }
}

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}
#endif  // EMBER_RANDOM_AVX2

template <typename T, typename Op>
void fill_blocks_default(T* out, int64_t numel, uint64_t seed, uint64_t base, const Op& op,
                         int64_t b, int64_t e) {
  for (int64_t j = b; j < e; ++j) {
    write_block(out, numel, op, philox_block(seed, base + static_cast<uint64_t>(j)), j);
  }
}

template <typename T, typename Op>
void fill_blocks(T* out, int64_t numel, uint64_t seed, uint64_t base, const Op& op, int64_t b,
                 int64_t e) {
#if defined(EMBER_RANDOM_AVX2)
  if (has_avx2()) return fill_blocks_avx2(out, numel, seed, base, op, b, e);
#endif
  fill_blocks_default(out, numel, seed, base, op, b, e);
}

template <typename T>
void fill_typed(const Tensor& t, const RandomSpec& spec, uint64_t seed, uint64_t base) {
  T* out = static_cast<T*>(t.data_ptr());
  const int64_t numel = t.numel();
  with_random_op<T>(spec, [&](const auto& op) {
    constexpr int P = std::remove_cvref_t<decltype(op)>::kPerBlock;
    const int64_t blocks = (numel + P - 1) / P;
    parallel_for(0, blocks, std::max<int64_t>(kBatch, kGrainSize / P / 4), [&](int64_t b, int64_t e) {
      fill_blocks(out, numel, seed, base, op, b, e);
    });
  });
}

}  // namespace

void random_fill_cpu(const Tensor& out, const RandomSpec& spec, uint64_t seed, uint64_t base) {
  if (out.numel() == 0) return;
  EMBER_INTERNAL_ASSERT(out.is_contiguous());
  dispatch_random(out, spec, [&]<typename T>() { fill_typed<T>(out, spec, seed, base); });
}

}  // namespace ember::detail
