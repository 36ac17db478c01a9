// Random fills (internal): the per-block functors shared by the CPU loop and the CUDA kernel,
// and the backend entry points. See Note [Random streams] in tensor/detail/philox.h.
//
// A functor maps one Philox block (four 32-bit words, counter value base + j) to the
// kPerBlock consecutive elements j * kPerBlock ... of the (row-major) output; `n` < kPerBlock
// only for the last block.
#pragma once

#include <cstdint>
#include <type_traits>

#include <ember/tensor/detail/philox.h>
#include <ember/tensor/tensor.h>

namespace ember {
class Generator;
}

namespace ember::detail {

/// Uniform on [from, to) in T (floating). 16-bit floats draw only as many bits as they hold,
/// so rand() is exact in the type and never rounds up to 1.
template <typename T>
struct UniformOp {
  static constexpr int kPerBlock = std::is_same_v<T, double> ? 2 : 4;
  double from, to;
  EMBER_HD void operator()(const Philox4& w, T* out, int n) const {
    if constexpr (std::is_same_v<T, double>) {
      const double range = to - from;
      out[0] = from + range * uniform_f64(w.v[0], w.v[1]);
      if (n > 1) out[1] = from + range * uniform_f64(w.v[2], w.v[3]);
    } else {
      const float f = static_cast<float>(from), range = static_cast<float>(to - from);
      for (int k = 0; k < n; ++k) out[k] = T(f + range * uniform_f32(w.v[k], uniform_bits<T>()));
    }
  }
};

/// Normal(mean, std) in T (floating), by Box-Muller on pairs of uniforms.
template <typename T>
struct NormalOp {
  static constexpr int kPerBlock = std::is_same_v<T, double> ? 2 : 4;
  double mean, std;
  EMBER_HD void operator()(const Philox4& w, T* out, int n) const {
    if constexpr (std::is_same_v<T, double>) {
      double z0, z1;
      box_muller_f64(w, &z0, &z1);
      out[0] = mean + std * z0;
      if (n > 1) out[1] = mean + std * z1;
    } else {
      const float m = static_cast<float>(mean), s = static_cast<float>(std);
      float z[4];
      box_muller_f32(w.v[0], w.v[1], &z[0], &z[1]);
      box_muller_f32(w.v[2], w.v[3], &z[2], &z[3]);
      for (int k = 0; k < n; ++k) out[k] = T(m + s * z[k]);
    }
  }
};

/// 1 with probability p, else 0, in any dtype (a 32-bit word below p * 2^32 is a 1).
template <typename T>
struct BernoulliOp {
  static constexpr int kPerBlock = 4;
  uint64_t threshold;  ///< p * 2^32, 2^32 for p == 1
  EMBER_HD void operator()(const Philox4& w, T* out, int n) const {
    for (int k = 0; k < n; ++k) out[k] = convert<T>(static_cast<int>(w.v[k] < threshold));
  }
};

/// Integers on [low, low + range): one word each when the range fits in 32 bits, else two.
/// (The modulo leaves a bias below range / 2^32, as in PyTorch.)
template <typename T, bool kWide>
struct RandintOp {
  static constexpr int kPerBlock = kWide ? 2 : 4;
  int64_t low;
  uint64_t range;
  EMBER_HD void operator()(const Philox4& w, T* out, int n) const {
    if constexpr (kWide) {
      for (int k = 0; k < n; ++k) {
        const uint64_t x = static_cast<uint64_t>(w.v[2 * k]) << 32 | w.v[2 * k + 1];
        out[k] = convert<T>(low + static_cast<int64_t>(x % range));
      }
    } else {
      const uint32_t r = static_cast<uint32_t>(range);
      for (int k = 0; k < n; ++k) out[k] = convert<T>(low + static_cast<int64_t>(w.v[k] % r));
    }
  }
};

/// What to draw.
struct RandomSpec {
  enum Kind : uint8_t { kUniform, kNormal, kBernoulli, kRandint } kind;
  double a = 0, b = 0;  ///< uniform: from, to; normal: mean, std; bernoulli: p
  int64_t low = 0;      ///< randint
  uint64_t range = 0;   ///< randint: high - low (>= 1)
};

/// Elements one Philox block fills for this spec and dtype (so blocks = ceil(numel / this)).
int64_t random_per_block(const RandomSpec& spec, Dtype dtype);

/// Calls fill.template operator()<T>() with T the C++ type of out's dtype, restricted to the
/// dtypes spec's kind supports (shared by the CPU and CUDA fills).
template <typename Fill>
void dispatch_random(const Tensor& out, const RandomSpec& spec, Fill&& fill) {
  switch (spec.kind) {
    case RandomSpec::kUniform:
    case RandomSpec::kNormal:
      return EMBER_DISPATCH_FLOATING(out.dtype(), "random", fill);
    case RandomSpec::kBernoulli:
      return EMBER_DISPATCH_ALL(out.dtype(), "bernoulli_", fill);
    case RandomSpec::kRandint:
      return EMBER_DISPATCH_NUMERIC(out.dtype(), "randint", fill);
  }
}

/// Fills the contiguous tensor `out` from the stream (seed, base); CPU and CUDA write the same
/// values. Dtypes: uniform/normal floating; bernoulli all; randint numeric.
void random_fill_cpu(const Tensor& out, const RandomSpec& spec, uint64_t seed, uint64_t base);
void random_fill_cuda(const Tensor& out, const RandomSpec& spec, const PhiloxArgs& args);

/// The counter range of `n` values for an op on `device`: reserved from `gen` now, or, while the
/// calling thread captures a CUDA graph on that device, within the graph (its replays reserve
/// from `gen`). CPU ops always reserve now.
PhiloxArgs philox_draw(Generator& gen, uint64_t n, const Device& device);
/// philox_draw's capture half (tensor/cuda/runtime/graph.cpp): true, with `out` set, when the calling
/// thread captures a graph on CUDA device `device`.
bool cuda_capture_draw(Generator& gen, uint64_t n, int device, PhiloxArgs* out);
/// Writes {seed, first} to the two device words at `replay` on `stream` (a graph's replay).
void write_philox_replay(uint64_t* replay, uint64_t seed, uint64_t first, void* stream);

/// Calls fn.template operator()<Op>(op) with the functor for spec and element type T.
template <typename T, typename Fn>
void with_random_op(const RandomSpec& s, Fn&& fn) {
  switch (s.kind) {
    case RandomSpec::kUniform:
      if constexpr (is_floating(dtype_of<T>)) return fn(UniformOp<T>{s.a, s.b});
      break;
    case RandomSpec::kNormal:
      if constexpr (is_floating(dtype_of<T>)) return fn(NormalOp<T>{s.a, s.b});
      break;
    case RandomSpec::kBernoulli: {
      const uint64_t threshold = s.a >= 1.0 ? uint64_t{1} << 32
                                            : static_cast<uint64_t>(s.a * 4294967296.0);
      return fn(BernoulliOp<T>{threshold});
    }
    case RandomSpec::kRandint:
      if constexpr (!std::is_same_v<T, bool>) {
        if (s.range > 0xffffffffull) return fn(RandintOp<T, true>{s.low, s.range});
        return fn(RandintOp<T, false>{s.low, s.range});
      }
      break;
  }
  EMBER_INTERNAL_ASSERT(false, "random op not valid for dtype ", dtype_of<T>);
}

}  // namespace ember::detail
