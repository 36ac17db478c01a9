// The wire encodings of the compressing hooks (compression_hooks.h, namespace codec).
//
// These loops are most of a compressed step's own work: a 10M-parameter model encodes and
// decodes every gradient element several times a step, on the cores that also compute. Each
// loop is therefore written so that GCC vectorizes it (lane-wise accumulators, branch-free
// selects, one pass where the arithmetic allows) and is compiled also for AVX-512 and AVX2,
// picked at load time (target_clones, as tensor/cpu/wide_loops.cpp). The file is compiled
// without floating-point contraction (distributed/CMakeLists.txt), so every version computes the
// bits of the baseline loop: the encodings must not depend on the CPU, since ranks on different
// machines decode each other's messages and error feedback relies on exact residuals.
#include <ember/distributed/ddp/compression_hooks.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

// Not under ThreadSanitizer: the version picker (an ifunc resolver) runs while the library is
// relocated, before TSan's runtime is set up, and TSan's instrumentation of it crashes there.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define EMBER_CODEC_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define EMBER_CODEC_CLONES
#endif

namespace ember::dist::codec {

namespace {

constexpr int64_t kParamBytes = 2 * sizeof(float);  // scale, zero point
int64_t channels(int64_t m, int64_t channel) { return m == 0 ? 0 : (m + channel - 1) / channel; }

// Rounds half to even, as std::nearbyint in the default rounding mode, for |v| < 2^22: adding
// std::nearbyint is a library call on baseline x86-64. The quantizer's values lie within
// [-2^22, 2^22]: |x / scale| <= 255 * (1 + 2^-23) inside the range, and its clamp follows.
inline float round_half_even(float v) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  return (v + kMagic) - kMagic;
}

// The smallest and largest of x[0, n) and 0 (the range always contains 0), NaNs ignored: what
// lo = std::min(lo, x[i]) and hi = std::max(hi, x[i]) from 0 give. In 16 lanes of a GCC vector
// (one AVX-512 register, two AVX2 ones, four SSE ones): the loop vectorizer leaves this select
// scalar without -ffinite-math-only. min and max are exact, so the lanes' order cannot change
// the result.
EMBER_CODEC_CLONES void min_max(const float* x, int64_t n, float* lo_out, float* hi_out) {
  constexpr int kLanes = 16;
  typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
  Lanes lo = {}, hi = {};
  const int64_t full = n / kLanes * kLanes;
  for (int64_t i = 0; i < full; i += kLanes) {
    Lanes v;
    std::memcpy(&v, x + i, sizeof v);
    lo = v < lo ? v : lo;
    hi = hi < v ? v : hi;
  }
  float l = 0, h = 0;
  for (int j = 0; j < kLanes; ++j) {
    l = lo[j] < l ? lo[j] : l;
    h = h < hi[j] ? hi[j] : h;
  }
  for (int64_t i = full; i < n; ++i) {
    l = x[i] < l ? x[i] : l;
    h = h < x[i] ? x[i] : h;
  }
  *lo_out = l;
  *hi_out = h;
}

// round(x / scale) + zero clamped to [0, 255], as std::clamp would (a NaN stays NaN and its
// byte is unspecified, as before).
inline float quantized(float x, float scale, float zero) {
  float v = round_half_even(x / scale) + zero;
  v = v < 0.0f ? 0.0f : v;
  return 255.0f < v ? 255.0f : v;
}

EMBER_CODEC_CLONES void quantize(const float* x, int64_t n, float scale, float zero, uint8_t* q) {
  for (int64_t i = 0; i < n; ++i) q[i] = static_cast<uint8_t>(quantized(x[i], scale, zero));
}

// quantize, and in the same pass the residual x minus the decoder's value of each byte.
EMBER_CODEC_CLONES void quantize_residual(const float* x, int64_t n, float scale, float zero,
                                          uint8_t* q, float* residual) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = quantized(x[i], scale, zero);
    q[i] = static_cast<uint8_t>(v);
    residual[i] = x[i] - scale * (v - zero);
  }
}

EMBER_CODEC_CLONES void dequantize_add(const uint8_t* q, int64_t n, float scale, float zero,
                                       float* acc) {
  for (int64_t i = 0; i < n; ++i) acc[i] += scale * (static_cast<float>(q[i]) - zero);
}

// What dequantize_add adds to a zero, stored: 0 + v, so that -0 becomes +0 as there.
EMBER_CODEC_CLONES void dequantize_set(const uint8_t* q, int64_t n, float scale, float zero,
                                       float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = 0.0f + scale * (static_cast<float>(q[i]) - zero);
}

// The sum of |x[i]| in eight double lanes (the same order every run and on every CPU).
EMBER_CODEC_CLONES double sum_abs(const float* x, int64_t m) {
  double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const int64_t full = m / 8;
  for (int64_t b = 0; b < full; ++b) {
    for (int j = 0; j < 8; ++j) lanes[j] += std::fabs(static_cast<double>(x[8 * b + j]));
  }
  double sum = 0;
  for (double l : lanes) sum += l;
  for (int64_t i = 8 * full; i < m; ++i) sum += std::fabs(static_cast<double>(x[i]));
  return sum;
}

EMBER_CODEC_CLONES void sign_bits(const float* x, int64_t m, uint8_t* bits) {
  const int64_t full = m / 8;
  for (int64_t b = 0; b < full; ++b) {
    unsigned byte = 0;
    for (int j = 0; j < 8; ++j) byte |= static_cast<unsigned>(x[8 * b + j] >= 0) << j;
    bits[b] = static_cast<uint8_t>(byte);
  }
  if (full * 8 < m) {
    unsigned byte = 0;
    for (int64_t j = 0; j < m - 8 * full; ++j) {
      byte |= static_cast<unsigned>(x[8 * full + j] >= 0) << j;
    }
    bits[full] = static_cast<uint8_t>(byte);
  }
}

EMBER_CODEC_CLONES void sign_residual(const float* x, int64_t m, float scale, float* residual) {
  for (int64_t i = 0; i < m; ++i) residual[i] = x[i] - (x[i] >= 0 ? scale : -scale);
}

// Bit j of `byte` as +1 or -1, in arithmetic (not a select) so that the loops vectorize.
inline float sign_of_bit(unsigned byte, int64_t j) {
  return static_cast<float>(static_cast<int>((byte >> j) & 1u) * 2 - 1);
}

EMBER_CODEC_CLONES void sign_add(const uint8_t* bits, int64_t m, float scale, float* acc) {
  const int64_t full = m / 8;
  for (int64_t b = 0; b < full; ++b) {
    const unsigned byte = bits[b];
    float* a = acc + 8 * b;
    for (int j = 0; j < 8; ++j) {
      a[j] += scale * sign_of_bit(byte, j);
    }
  }
  for (int64_t i = 8 * full; i < m; ++i) acc[i] += (bits[i / 8] >> (i % 8)) & 1u ? scale : -scale;
}

// What sign_add adds to a zero, stored, for elements [first, first + m) of a bit string.
EMBER_CODEC_CLONES void sign_set(const uint8_t* bits, int64_t first, int64_t m, float scale,
                                 float* out) {
  auto one = [&](int64_t i) {
    const int64_t at = first + i;
    out[i] = 0.0f + scale * sign_of_bit(bits[at / 8], at % 8);
  };
  int64_t i = 0;
  for (; i < m && (first + i) % 8 != 0; ++i) one(i);  // up to a byte boundary
  const uint8_t* bytes = bits + (first + i) / 8;
  float* o = out + i;
  const int64_t full = (m - i) / 8;
  for (int64_t b = 0; b < full; ++b) {
    const unsigned byte = bytes[b];
    for (int j = 0; j < 8; ++j) o[8 * b + j] = 0.0f + scale * sign_of_bit(byte, j);
  }
  for (i += 8 * full; i < m; ++i) one(i);
}

// Calls part(block_begin, from, len) for each piece [from, from + len) of [first, first + count)
// that lies in one block of `block` elements (block_begin: its block's first element).
template <typename F>
void for_blocks(int64_t first, int64_t count, int64_t block, F part) {
  for (int64_t at = first; at < first + count;) {
    const int64_t begin = at / block * block;
    const int64_t len = std::min(first + count, begin + block) - at;
    part(begin, at, len);
    at += len;
  }
}

void check_range(const char* codec, int64_t m, int64_t first, int64_t count) {
  EMBER_CHECK(first >= 0 && count >= 0 && first + count <= m, "[", codec,
              "] expects a range inside the message's ", m, " elements, got [", first, ", ",
              first + count, ")");
}

}  // namespace

int64_t int8_bytes(int64_t m, int64_t channel) { return channels(m, channel) * kParamBytes + m; }

// torch's MinMaxObserver.calculate_qparams for quint8, per_tensor_affine, reduce_range off:
// the range is widened to contain 0, scale = range / 255 (at least float32's epsilon),
// zero point = -round(min / scale) clamped to [0, 255]; quantize: round(x / scale) + zero
// point, clamped. float32 throughout, rounding half to even (torch.round).
void int8_encode(const float* x, int64_t m, int64_t channel, uint8_t* out, float* residual) {
  const int64_t nc = channels(m, channel);
  uint8_t* q = out + nc * kParamBytes;
  for (int64_t c = 0; c < nc; ++c) {
    const int64_t begin = c * channel, len = std::min(m, begin + channel) - begin;
    float lo = 0, hi = 0;
    min_max(x + begin, len, &lo, &hi);
    float scale = (hi - lo) / 255.0f;
    scale = std::max(scale, std::numeric_limits<float>::epsilon());
    const float zero = std::clamp(0.0f - std::nearbyint(lo / scale), 0.0f, 255.0f);
    const float params[2] = {scale, zero};
    std::memcpy(out + c * kParamBytes, params, sizeof params);
    if (residual != nullptr) {  // the decoder's arithmetic, so x - residual is what it decodes
      quantize_residual(x + begin, len, scale, zero, q + begin, residual + begin);
    } else {
      quantize(x + begin, len, scale, zero, q + begin);
    }
  }
}

void int8_decode_add(const uint8_t* in, int64_t m, int64_t channel, float* acc) {
  const int64_t nc = channels(m, channel);
  const uint8_t* q = in + nc * kParamBytes;
  for (int64_t c = 0; c < nc; ++c) {
    float params[2];
    std::memcpy(params, in + c * kParamBytes, sizeof params);
    const int64_t begin = c * channel, len = std::min(m, begin + channel) - begin;
    dequantize_add(q + begin, len, params[0], params[1], acc + begin);
  }
}

void int8_decode_range(const uint8_t* in, int64_t m, int64_t channel, int64_t first, int64_t count,
                       float* out) {
  check_range("int8_decode_range", m, first, count);
  const uint8_t* q = in + channels(m, channel) * kParamBytes;
  for_blocks(first, count, channel, [&](int64_t begin, int64_t at, int64_t len) {
    float params[2];
    std::memcpy(params, in + begin / channel * kParamBytes, sizeof params);
    dequantize_set(q + at, len, params[0], params[1], out + (at - first));
  });
}

int64_t sign_bytes(int64_t m, int64_t block) {
  return channels(m, block) * static_cast<int64_t>(sizeof(float)) + (m + 7) / 8;
}

void sign_encode(const float* x, int64_t m, int64_t block, uint8_t* out, float* residual) {
  const int64_t nb = channels(m, block);
  uint8_t* bits = out + nb * static_cast<int64_t>(sizeof(float));
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t begin = b * block, len = std::min(m, begin + block) - begin;
    // The scale that brings scale * sign(x) closest to x (least squares): the mean magnitude.
    // With it, x minus the message is always shorter than x, which error feedback needs; the
    // root mean square (1-bit Adam's choice, on Adam's momentum) can make it longer.
    const float scale = static_cast<float>(sum_abs(x + begin, len) / static_cast<double>(len));
    std::memcpy(out + b * static_cast<int64_t>(sizeof scale), &scale, sizeof scale);
    sign_bits(x + begin, len, bits + begin / 8);
    if (residual != nullptr) sign_residual(x + begin, len, scale, residual + begin);
  }
}

void sign_decode_add(const uint8_t* in, int64_t m, int64_t block, float* acc) {
  const int64_t nb = channels(m, block);
  const uint8_t* bits = in + nb * static_cast<int64_t>(sizeof(float));
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t begin = b * block, len = std::min(m, begin + block) - begin;
    float scale;
    std::memcpy(&scale, in + b * static_cast<int64_t>(sizeof scale), sizeof scale);
    sign_add(bits + begin / 8, len, scale, acc + begin);
  }
}

void sign_decode_range(const uint8_t* in, int64_t m, int64_t block, int64_t first, int64_t count,
                       float* out) {
  check_range("sign_decode_range", m, first, count);
  const uint8_t* bits = in + channels(m, block) * static_cast<int64_t>(sizeof(float));
  for_blocks(first, count, block, [&](int64_t begin, int64_t at, int64_t len) {
    float scale;
    std::memcpy(&scale, in + begin / block * static_cast<int64_t>(sizeof scale), sizeof scale);
    sign_set(bits, at, len, scale, out + (at - first));
  });
}

namespace {

// A NaN counts as the largest magnitude (it is sent, and poisons the average as an all-reduce
// would), which keeps the order strict and weak.
inline float magnitude(float v) {
  return std::isnan(v) ? std::numeric_limits<float>::infinity() : std::fabs(v);
}

// Bit j of bits[b] set where magnitude(x[8 b + j]) >= threshold, for m a multiple of 8: as
// sign_bits, a loop GCC vectorizes. !(|v| < t) is that comparison with a NaN counted as largest.
EMBER_CODEC_CLONES void at_least_bits(const float* x, int64_t m, float threshold, uint8_t* bits) {
  for (int64_t b = 0; b < m / 8; ++b) {
    unsigned byte = 0;
    for (int j = 0; j < 8; ++j) {
      byte |= static_cast<unsigned>(!(std::fabs(x[8 * b + j]) < threshold)) << j;
    }
    bits[b] = static_cast<uint8_t>(byte);
  }
}

// Appends to `out` every i in [0, n) with magnitude(x[i]) >= threshold, increasing, and to
// `mags` its magnitude: the comparisons vectorized into bit masks, then the set bits (a few
// percent) walked word by word while the block is still in cache.
void indices_at_least(const float* x, int64_t n, float threshold, std::vector<int32_t>& out,
                      std::vector<float>& mags) {
  constexpr int64_t kBlock = 4096;
  uint64_t words[kBlock / 64];
  for (int64_t begin = 0; begin < n; begin += kBlock) {
    const int64_t len = std::min(n - begin, kBlock), full = len / 8 * 8;
    auto* bytes = reinterpret_cast<uint8_t*>(words);
    std::memset(words, 0, sizeof words);
    at_least_bits(x + begin, full, threshold, bytes);
    for (int64_t i = full; i < len; ++i) {
      bytes[i / 8] |=
          static_cast<uint8_t>((magnitude(x[begin + i]) >= threshold ? 1u : 0u) << (i % 8));
    }
    for (int64_t w = 0; w < (len + 63) / 64; ++w) {
      uint64_t word;
      std::memcpy(&word, bytes + 8 * w, sizeof word);  // bytes in order: little-endian bits
      while (word != 0) {
        const int64_t i = begin + 64 * w + __builtin_ctzll(word);
        out.push_back(static_cast<int32_t>(i));
        mags.push_back(magnitude(x[i]));
        word &= word - 1;
      }
    }
  }
}

}  // namespace

std::vector<int32_t> topk_indices(const float* x, int64_t n, int64_t k) {
  EMBER_CHECK(k >= 1 && k <= n, "[topk_indices] expected k in [1, n] = [1, ", n, "], got ", k);
  EMBER_CHECK(n <= std::numeric_limits<int32_t>::max(), "[topk_indices] expected at most 2^31 - 1",
              " elements (int32 indices), got ", n);
  // A threshold from a sample leaves about 2k candidates: every entry at or above it, so the k
  // largest among them are the k largest of all. One that leaves fewer than k is lowered until
  // enough pass.
  float threshold = 0;
  if (2 * k < n) {
    const int64_t stride = std::max<int64_t>(1, n / 16384);
    std::vector<float> sample;
    for (int64_t i = 0; i < n; i += stride) sample.push_back(magnitude(x[i]));
    // The sample's magnitude at twice the wanted share.
    const auto at = static_cast<int64_t>(static_cast<double>(sample.size()) * 2 * k / n);
    if (at < static_cast<int64_t>(sample.size())) {
      std::nth_element(sample.begin(), sample.begin() + at, sample.end(), std::greater<float>());
      threshold = sample[static_cast<size_t>(at)];
    }
    // Infinities (or NaNs) filled the sample down to that rank: lowering an infinite threshold
    // would not end, so every entry is a candidate instead.
    if (std::isinf(threshold)) threshold = 0;
  }
  std::vector<int32_t> candidates;
  std::vector<float> mags;
  for (;;) {
    candidates.clear();
    mags.clear();
    indices_at_least(x, n, threshold, candidates, mags);
    if (static_cast<int64_t>(candidates.size()) >= k || threshold == 0) break;
    threshold = threshold > std::numeric_limits<float>::min() ? threshold / 4 : 0;
  }
  // The k-th largest magnitude among the candidates, t: every one above t is taken, and of
  // those equal to t the lowest indices, in one pass in index order (the candidates are
  // increasing), so the result needs no sort.
  std::vector<float> order = mags;
  std::nth_element(order.begin(), order.begin() + (k - 1), order.end(), std::greater<float>());
  const float t = order[static_cast<size_t>(k - 1)];
  int64_t equal_wanted = k;
  for (const float v : mags) equal_wanted -= v > t ? 1 : 0;
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(k));
  for (size_t j = 0; j < candidates.size(); ++j) {
    if (mags[j] > t || (mags[j] == t && equal_wanted-- > 0)) out.push_back(candidates[j]);
  }
  return out;
}

}  // namespace ember::dist::codec
