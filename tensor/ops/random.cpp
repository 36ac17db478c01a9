// Front end of the random ops: the Generator, validation, and device dispatch of the fills
// (Note [Random streams] in tensor/detail/philox.h).
#include <ember/tensor/ops/random.h>

#include <cmath>
#include <numeric>

#include <ember/tensor/detail/random_kernels.h>

namespace ember {

using detail::RandomSpec;

void Generator::manual_seed(uint64_t seed) {
  std::lock_guard<std::mutex> lock(mu_);
  seed_ = seed;
  offset_ = 0;
}

uint64_t Generator::seed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return seed_;
}

Generator::Draw Generator::reserve(uint64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  const Draw d{seed_, offset_};
  offset_ += n;
  return d;
}

uint64_t Generator::advance(uint64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t first = offset_;
  offset_ += n;
  return first;
}

uint64_t Generator::offset() const {
  std::lock_guard<std::mutex> lock(mu_);
  return offset_;
}

void Generator::set_offset(uint64_t offset) {
  std::lock_guard<std::mutex> lock(mu_);
  offset_ = offset;
}

namespace {
thread_local Generator* t_default = nullptr;
}  // namespace

Generator& default_generator() {
  if (t_default != nullptr) return *t_default;
  static Generator gen;
  return gen;
}

void set_thread_default_generator(Generator* gen) { t_default = gen; }

void manual_seed(uint64_t seed) { default_generator().manual_seed(seed); }

namespace detail {
PhiloxArgs philox_draw(Generator& gen, uint64_t n, const Device& device) {
  PhiloxArgs args;
  if (device.is_cuda() && cuda_capture_draw(gen, n, device.index, &args)) return args;
  const Generator::Draw d = gen.reserve(n);
  args.seed = d.seed;
  args.offset = d.offset;
  return args;
}

int64_t random_per_block(const RandomSpec& spec, Dtype dtype) {
  switch (spec.kind) {
    case RandomSpec::kUniform:
    case RandomSpec::kNormal:
      return dtype == kFloat64 ? 2 : 4;
    case RandomSpec::kBernoulli:
      return 4;
    case RandomSpec::kRandint:
      return spec.range > 0xffffffffull ? 2 : 4;
  }
  return 4;
}
}  // namespace detail

namespace {

void check_floating(const char* op, Dtype t) {
  EMBER_CHECK_TYPE(TypeError, is_floating(t), "[", op, "] expected a floating dtype, got ", t);
}

// Fills t (any layout) from the generator: a contiguous t is written in place, any other
// through a contiguous temporary, so element i always gets the stream's i-th value.
void fill(const Tensor& t, const RandomSpec& spec, Generator* gen) {
  if (t.numel() == 0) return;
  Generator& g = gen ? *gen : default_generator();
  const int64_t per = detail::random_per_block(spec, t.dtype());
  const uint64_t blocks = static_cast<uint64_t>((t.numel() + per - 1) / per);
  const detail::PhiloxArgs args = detail::philox_draw(g, blocks, t.device());
  Tensor dst = t.is_contiguous() ? t : detail::make_empty(t.shape(), t.dtype(), t.device());
  if (dst.is_cuda()) {
    detail::random_fill_cuda(dst, spec, args);
  } else {
    detail::random_fill_cpu(dst, spec, args.seed, args.offset);
  }
  if (!dst.is_same(t)) Tensor(t).copy_(dst);
}

Tensor make(IntList shape, const TensorOptions& o) {
  return detail::make_empty(shape, o.dtype_, o.device_, o.pinned_);
}

// Largest n such that 0..n-1 are all exact in t.
int64_t max_exact_count(Dtype t) {
  switch (t) {
    case kUInt8: return 256;
    case kInt32: return int64_t{1} << 31;
    case kFloat16: return (1 << 11) + 1;
    case kBFloat16: return (1 << 8) + 1;
    case kFloat32: return (int64_t{1} << 24) + 1;
    default: return INT64_MAX;
  }
}

}  // namespace

Tensor rand(IntList shape, TensorOptions opts, Generator* gen) {
  check_floating("rand", opts.dtype_);
  Tensor t = make(shape, opts);
  fill(t, RandomSpec{RandomSpec::kUniform, 0.0, 1.0}, gen);
  return t;
}

Tensor randn(IntList shape, TensorOptions opts, Generator* gen) {
  check_floating("randn", opts.dtype_);
  Tensor t = make(shape, opts);
  fill(t, RandomSpec{RandomSpec::kNormal, 0.0, 1.0}, gen);
  return t;
}

Tensor randint(int64_t low, int64_t high, IntList shape, TensorOptions opts, Generator* gen) {
  const Dtype dt = opts.dtype_;
  EMBER_CHECK_TYPE(TypeError, dt != kBool, "[randint] expected a numeric dtype, got bool");
  EMBER_CHECK(low < high, "[randint] expected low < high, got low=", low, " high=", high);
  if (dt == kUInt8 || dt == kInt32) {
    const int64_t lo = dt == kUInt8 ? 0 : INT32_MIN;
    const int64_t hi = dt == kUInt8 ? 256 : int64_t{1} << 31;
    EMBER_CHECK(low >= lo && high <= hi, "[randint] range [", low, ", ", high,
                ") does not fit dtype ", dt, " (values in [", lo, ", ", hi, "))");
  }
  if (dt == kFloat16) {
    EMBER_CHECK(low >= -65504 && high - 1 <= 65504, "[randint] range [", low, ", ", high,
                ") does not fit dtype float16 (|values| <= 65504)");
  }
  Tensor t = make(shape, opts);
  RandomSpec spec{RandomSpec::kRandint};
  spec.low = low;
  spec.range = static_cast<uint64_t>(high) - static_cast<uint64_t>(low);
  fill(t, spec, gen);
  return t;
}

Tensor randperm(int64_t n, TensorOptions opts, Generator* gen) {
  EMBER_CHECK(n >= 0, "[randperm] expected n >= 0, got ", n);
  EMBER_CHECK_TYPE(TypeError, opts.dtype_ != kBool, "[randperm] expected a numeric dtype, got bool");
  EMBER_CHECK(n <= max_exact_count(opts.dtype_), "[randperm] n=", n,
              " is too large for dtype ", opts.dtype_, " (at most ", max_exact_count(opts.dtype_),
              ")");
  // Fisher-Yates on the CPU; swap step k (for position i = n-1-k) draws 64 bits from words
  // 2k and 2k+1 of the stream. On CUDA the permutation is made here and copied over.
  Tensor p = detail::make_empty({n}, kInt64, kCPU);
  int64_t* v = p.data<int64_t>();
  std::iota(v, v + n, int64_t{0});
  if (n > 1) {
    Generator& g = gen ? *gen : default_generator();
    const auto [seed, base] = g.reserve(static_cast<uint64_t>(n) / 2);  // ceil((n - 1) / 2)
    detail::Philox4 w{};
    for (int64_t i = n - 1, k = 0; i >= 1; --i, ++k) {
      if (k % 2 == 0) w = detail::philox_block(seed, base + k / 2);
      const int h = 2 * static_cast<int>(k % 2);
      const uint64_t x = static_cast<uint64_t>(w.v[h]) << 32 | w.v[h + 1];
      std::swap(v[i], v[static_cast<int64_t>(x % static_cast<uint64_t>(i + 1))]);
    }
  }
  if (opts.dtype_ == kInt64 && opts.device_.is_cpu() && !opts.pinned_) return p;
  Tensor out = make({n}, opts);
  out.copy_(p);
  return out;
}

Tensor& uniform_(Tensor& t, double from, double to, Generator* gen) {
  detail::check_defined("uniform_", t, "self");
  check_floating("uniform_", t.dtype());
  EMBER_CHECK(std::isfinite(from) && std::isfinite(to) && from <= to,
              "[uniform_] expected finite from <= to, got from=", from, " to=", to);
  fill(t, RandomSpec{RandomSpec::kUniform, from, to}, gen);
  t.bump_version();
  return t;
}

Tensor& normal_(Tensor& t, double mean, double std, Generator* gen) {
  detail::check_defined("normal_", t, "self");
  check_floating("normal_", t.dtype());
  EMBER_CHECK(std::isfinite(mean) && std::isfinite(std) && std >= 0,
              "[normal_] expected finite mean and std >= 0, got mean=", mean, " std=", std);
  fill(t, RandomSpec{RandomSpec::kNormal, mean, std}, gen);
  t.bump_version();
  return t;
}

Tensor& bernoulli_(Tensor& t, double p, Generator* gen) {
  detail::check_defined("bernoulli_", t, "self");
  EMBER_CHECK(p >= 0.0 && p <= 1.0, "[bernoulli_] expected 0 <= p <= 1, got p=", p);
  fill(t, RandomSpec{RandomSpec::kBernoulli, p}, gen);
  t.bump_version();
  return t;
}

}  // namespace ember
