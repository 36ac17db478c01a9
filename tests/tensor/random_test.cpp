// Random numbers: Philox known-answer vectors, determinism (per seed, per thread count, across
// generator checkpoints), and statistics of uniform, normal, randint, randperm and bernoulli
// with bounds derived from the standard error (z = 6: a false failure is ~1e-9 likely, and the
// seeds are fixed so the tests are deterministic anyway).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <ember/tensor/detail/philox.h>
#include <ember/tensor/ops.h>
#include "test_util.h"

using ember::test::expect_error;

using namespace ember;

namespace {

void expect_identical(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_EQ(a.shape(), b.shape()) << what;
  ASSERT_EQ(a.dtype(), b.dtype()) << what;
  const auto x = a.to_vector<double>(), y = b.to_vector<double>();
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(x[i], y[i]) << what << ": element " << i << " differs: " << x[i] << " vs " << y[i];
  }
}

struct Moments {
  double mean = 0, var = 0, min = INFINITY, max = -INFINITY;
};
Moments moments(const Tensor& t) {
  const auto v = t.to_vector<double>();
  Moments m;
  for (double x : v) {
    m.mean += x;
    m.min = std::min(m.min, x);
    m.max = std::max(m.max, x);
  }
  m.mean /= v.size();
  for (double x : v) m.var += (x - m.mean) * (x - m.mean);
  m.var /= (v.size() - 1);
  return m;
}

constexpr double kZ = 6.0;

}  // namespace

TEST(Philox, KnownAnswerVectors) {
  // Random123's kat_vectors for philox4x32_10.
  using detail::Philox4;
  Philox4 r = detail::philox4x32_10(Philox4{{0, 0, 0, 0}}, 0, 0);
  EXPECT_EQ(r.v[0], 0x6627e8d5u);
  EXPECT_EQ(r.v[1], 0xe169c58du);
  EXPECT_EQ(r.v[2], 0xbc57ac4cu);
  EXPECT_EQ(r.v[3], 0x9b00dbd8u);
  r = detail::philox4x32_10(Philox4{{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}},
                            0xffffffffu, 0xffffffffu);
  EXPECT_EQ(r.v[0], 0x408f276du);
  EXPECT_EQ(r.v[1], 0x41c83b0eu);
  EXPECT_EQ(r.v[2], 0xa20bc7c6u);
  EXPECT_EQ(r.v[3], 0x6d5451fdu);
  r = detail::philox4x32_10(Philox4{{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}},
                            0xa4093822u, 0x299f31d0u);
  EXPECT_EQ(r.v[0], 0xd16cfe09u);
  EXPECT_EQ(r.v[1], 0x94fdccebu);
  EXPECT_EQ(r.v[2], 0x5001e420u);
  EXPECT_EQ(r.v[3], 0x24126ea1u);
}

TEST(Random, ValuesFollowTheDocumentedStream) {
  // Note [Random streams]: element i of a float32 rand reads word i of the stream that starts at
  // the generator's offset; randn pairs words (2m, 2m+1) through Box-Muller; float64 rand uses
  // words (2i, 2i+1). The CUDA kernels call the same philox.h functions.
  const uint64_t seed = 0x123456789abcdefull;
  Generator g(seed);
  g.set_offset(1000);
  const auto u = rand({203}, kFloat32, &g).to_vector<float>();
  for (int64_t i = 0; i < 203; ++i) {
    ASSERT_EQ(u[i], detail::uniform_f32(detail::philox_word(seed, 1000, i))) << "element " << i;
  }
  const uint64_t base = g.offset();
  EXPECT_EQ(base, 1000u + 51);
  const auto z = randn({203}, kFloat32, &g).to_vector<float>();
  for (int64_t m = 0; m < 101; ++m) {
    float z0, z1;
    detail::box_muller_f32(detail::philox_word(seed, base, 2 * m),
                           detail::philox_word(seed, base, 2 * m + 1), &z0, &z1);
    ASSERT_EQ(z[2 * m], z0) << "element " << 2 * m;
    ASSERT_EQ(z[2 * m + 1], z1) << "element " << 2 * m + 1;
  }
  const uint64_t base2 = g.offset();
  const auto d = rand({7}, kFloat64, &g).to_vector<double>();
  for (int64_t i = 0; i < 7; ++i) {
    ASSERT_EQ(d[i], detail::uniform_f64(detail::philox_word(seed, base2, 2 * i),
                                        detail::philox_word(seed, base2, 2 * i + 1)))
        << "element " << i;
  }
}

TEST(Philox, BoxMullerMathIsAccurate) {
  // bm_log and bm_sincos_2pi replace logf/sinf/cosf (so the CPU loop vectorises and CPU and GPU
  // share one expression): check them on u's 24-bit grid against double precision.
  double worst_log = 0, worst_trig = 0;
  for (uint32_t k = 1; k <= (1u << 24); k += 97) {
    const float x = static_cast<float>(k) * (1.0f / 16777216.0f);  // (0, 1]
    const double want = std::log(static_cast<double>(x));
    const double ulp = std::max(std::abs(want) * std::ldexp(1.0, -23), std::ldexp(1.0, -149));
    worst_log = std::max(worst_log, std::abs(detail::bm_log(x) - want) / ulp);
    const float u = static_cast<float>(k - 1) * (1.0f / 16777216.0f);  // [0, 1)
    float s, c;
    detail::bm_sincos_2pi(u, &s, &c);
    const double th = 2 * M_PI * static_cast<double>(u);
    worst_trig = std::max({worst_trig, std::abs(s - std::sin(th)), std::abs(c - std::cos(th))});
  }
  EXPECT_LE(worst_log, 4.0) << "ulp";
  EXPECT_LE(worst_trig, 3e-7) << "absolute";
}

TEST(Generator, SeedOffsetAndAdvance) {
  Generator g(42);
  EXPECT_EQ(g.seed(), 42u);
  EXPECT_EQ(g.offset(), 0u);
  EXPECT_EQ(g.advance(10), 0u);
  EXPECT_EQ(g.advance(5), 10u);
  EXPECT_EQ(g.offset(), 15u);
  g.manual_seed(7);
  EXPECT_EQ(g.seed(), 7u);
  EXPECT_EQ(g.offset(), 0u);
  // 10 float32 uniforms take ceil(10 / 4) counter values.
  rand({10}, {}, &g);
  EXPECT_EQ(g.offset(), 3u);
  rand({3}, kFloat64, &g);  // 2 per counter value
  EXPECT_EQ(g.offset(), 5u);
}

TEST(Random, SameSeedSameValuesDifferentSeedsDiffer) {
  for (Dtype dt : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
    const std::string what(dtype_name(dt));
    Generator a(123), b(123), c(124);
    const Tensor x = rand({1001}, dt, &a), y = rand({1001}, dt, &b), z = rand({1001}, dt, &c);
    expect_identical(x, y, what + " rand");
    const auto xv = x.to_vector<double>(), zv = z.to_vector<double>();
    int same = 0;
    for (size_t i = 0; i < xv.size(); ++i) same += xv[i] == zv[i];
    EXPECT_LT(same, dt == kBFloat16 ? 50 : 10) << what;
    // Consecutive draws differ.
    const Tensor x2 = rand({1001}, dt, &a);
    EXPECT_NE(x.to_vector<double>(), x2.to_vector<double>()) << what;
    expect_identical(rand({1001}, dt, &b), x2, what + " second draw");
    expect_identical(randn({999}, dt, &a), randn({999}, dt, &b), what + " randn");
  }
  manual_seed(5);
  const Tensor p = randn({64});
  manual_seed(5);
  expect_identical(p, randn({64}), "default generator");
}

TEST(Random, PrefixOfALongerDrawIsTheShorterDraw) {
  // Element i depends only on (seed, offset, i): a shorter tensor is a prefix of a longer one.
  Generator a(9), b(9);
  const auto s = randn({37}, kFloat32, &a).to_vector<float>();
  const auto l = randn({1000}, kFloat32, &b).to_vector<float>();
  for (size_t i = 0; i < s.size(); ++i) ASSERT_EQ(s[i], l[i]) << "element " << i;
}

TEST(Random, IndependentOfThreadCount) {
  const int saved = get_num_threads();
  auto draw = [](int threads) {
    set_num_threads(threads);
    Generator g(2024);
    std::vector<Tensor> out;
    out.push_back(rand({300001}, kFloat32, &g));
    out.push_back(randn({300001}, kFloat32, &g));
    out.push_back(randn({200001}, kFloat64, &g));
    out.push_back(randint(-5, 1000, {300001}, kInt64, &g));
    Tensor b = empty({300001}, kUInt8);
    bernoulli_(b, 0.3, &g);
    out.push_back(b);
    return out;
  };
  const auto one = draw(1), two = draw(2);
  set_num_threads(saved);
  for (size_t i = 0; i < one.size(); ++i) expect_identical(one[i], two[i], "tensor " + std::to_string(i));
}

TEST(Random, OffsetSaveRestoreReproducesTheNextDraw) {
  Generator g(77);
  rand({100}, {}, &g);
  const uint64_t saved = g.offset();
  const Tensor a = randn({50, 3}, kFloat64, &g);
  const Tensor b = randint(0, 10, {20}, kInt64, &g);
  g.set_offset(saved);
  expect_identical(randn({50, 3}, kFloat64, &g), a, "randn after restore");
  expect_identical(randint(0, 10, {20}, kInt64, &g), b, "randint after restore");
}

TEST(Random, UniformStatistics) {
  Generator g(1);
  const int64_t n = 1000000;
  for (Dtype dt : {kFloat32, kFloat64}) {
    const Moments m = moments(rand({n}, dt, &g));
    // U(0,1): mean 1/2, variance 1/12; the sample variance's standard error is
    // sqrt((mu4 - sigma^4) / n) with mu4 = 1/80.
    EXPECT_NEAR(m.mean, 0.5, kZ * std::sqrt(1.0 / 12 / n)) << dtype_name(dt);
    EXPECT_NEAR(m.var, 1.0 / 12, kZ * std::sqrt((1.0 / 80 - 1.0 / 144) / n)) << dtype_name(dt);
    EXPECT_GE(m.min, 0.0);
    EXPECT_LT(m.max, 1.0);
  }
  // 16-bit types never round up to 1.
  for (Dtype dt : {kFloat16, kBFloat16}) {
    const Moments m = moments(rand({100000}, dt, &g));
    EXPECT_GE(m.min, 0.0);
    EXPECT_LT(m.max, 1.0) << dtype_name(dt);
    EXPECT_NEAR(m.mean, 0.5, 0.01) << dtype_name(dt);
  }
  Tensor t = empty({n}, kFloat64);
  uniform_(t, -3.0, 5.0, &g);
  const Moments m = moments(t);
  EXPECT_NEAR(m.mean, 1.0, kZ * 8 * std::sqrt(1.0 / 12 / n));
  EXPECT_NEAR(m.var, 64.0 / 12, kZ * 64 * std::sqrt((1.0 / 80 - 1.0 / 144) / n));
  EXPECT_GE(m.min, -3.0);
  EXPECT_LT(m.max, 5.0);
}

TEST(Random, NormalStatistics) {
  Generator g(2);
  const int64_t n = 1000000;
  for (Dtype dt : {kFloat32, kFloat64}) {
    const Moments m = moments(randn({n}, dt, &g));
    // N(0,1): the mean's standard error is 1/sqrt(n), the variance's sqrt(2/n).
    EXPECT_NEAR(m.mean, 0.0, kZ / std::sqrt(n)) << dtype_name(dt);
    EXPECT_NEAR(m.var, 1.0, kZ * std::sqrt(2.0 / n)) << dtype_name(dt);
    EXPECT_TRUE(std::isfinite(m.min) && std::isfinite(m.max));
    EXPECT_LT(m.min, -4.0);  // P(min > -4) over 1e6 draws is ~e^-32
    EXPECT_GT(m.max, 4.0);
  }
  Tensor t = empty({n}, kFloat32);
  normal_(t, 3.0, 0.5, &g);
  const Moments m = moments(t);
  EXPECT_NEAR(m.mean, 3.0, kZ * 0.5 / std::sqrt(n));
  EXPECT_NEAR(m.var, 0.25, kZ * 0.25 * std::sqrt(2.0 / n));
  // Fraction within one sigma: 0.682689...
  const auto v = t.to_vector<double>();
  const double inside = std::count_if(v.begin(), v.end(), [](double x) { return std::abs(x - 3.0) < 0.5; });
  const double p = 0.6826894921370859;
  EXPECT_NEAR(inside / n, p, kZ * std::sqrt(p * (1 - p) / n));
  const Moments h = moments(randn({100000}, kBFloat16, &g));
  EXPECT_NEAR(h.mean, 0.0, 0.03);
  EXPECT_NEAR(h.var, 1.0, 0.03);
}

TEST(Random, RandintBucketsAreUniform) {
  Generator g(3);
  const int64_t n = 1000000, k = 10;
  const Tensor t = randint(-3, -3 + k, {n}, kInt64, &g);
  EXPECT_EQ(t.dtype(), kInt64);
  std::vector<int64_t> counts(k, 0);
  for (int64_t x : t.to_vector<int64_t>()) {
    ASSERT_GE(x, -3);
    ASSERT_LT(x, -3 + k);
    ++counts[x + 3];
  }
  // Chi-square with k - 1 = 9 degrees of freedom: mean 9, sd sqrt(18); 9 + 6 * 4.24 ~ 34.5 is far
  // beyond the 1e-5 quantile (~37 would be 1e-5.5); 35 keeps the false-failure odds negligible.
  double chi2 = 0;
  const double e = static_cast<double>(n) / k;
  for (int64_t c : counts) chi2 += (c - e) * (c - e) / e;
  EXPECT_LT(chi2, 35.0);
  // Other dtypes and a range wider than 32 bits.
  const Tensor u = randint(0, 256, {1000}, kUInt8, &g);
  EXPECT_EQ(u.dtype(), kUInt8);
  const Tensor w = randint(0, int64_t{1} << 40, {100000}, kInt64, &g);
  const Moments m = moments(w);
  EXPECT_GE(m.min, 0);
  EXPECT_LT(m.max, std::ldexp(1.0, 40));
  EXPECT_NEAR(m.mean / std::ldexp(1.0, 40), 0.5, kZ * std::sqrt(1.0 / 12 / 100000));
  const Tensor f = randint(2, 5, {100}, kFloat32, &g);
  for (float x : f.to_vector<float>()) EXPECT_TRUE(x == 2 || x == 3 || x == 4) << x;
}

TEST(Random, RandpermIsAPermutation) {
  Generator g(4);
  for (int64_t n : {0, 1, 2, 3, 10, 1000, 100001}) {
    const Tensor p = randperm(n, kInt64, &g);
    ASSERT_EQ(p.shape(), Shape({n}));
    auto v = p.to_vector<int64_t>();
    std::sort(v.begin(), v.end());
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(v[i], i) << "n=" << n;
  }
  Generator a(8), b(8);
  expect_identical(randperm(500, kInt64, &a), randperm(500, kInt64, &b), "same seed");
  EXPECT_NE(randperm(500, kInt64, &a).to_vector<int64_t>(),
            randperm(500, kInt64, &a).to_vector<int64_t>());
  // Position 0 takes each of 0..4 equally often.
  std::vector<int> first(5, 0);
  for (int i = 0; i < 5000; ++i) ++first[randperm(5, kInt64, &g).to_vector<int64_t>()[0]];
  for (int c : first) EXPECT_NEAR(c, 1000, kZ * std::sqrt(5000 * 0.2 * 0.8));
  EXPECT_EQ(randperm(10, kFloat32, &g).dtype(), kFloat32);
  expect_error<ValueError>([&] { randperm(-1, kInt64, &g); }, {"[randperm]", "-1"});
  expect_error<ValueError>([&] { randperm(300, kUInt8, &g); }, {"[randperm]", "300", "uint8"});
}

TEST(Random, BernoulliFrequency) {
  Generator g(5);
  const int64_t n = 1000000;
  for (double p : {0.0, 0.1, 0.5, 1.0}) {
    Tensor t = empty({n}, kFloat32);
    const uint32_t v0 = t.version();
    bernoulli_(t, p, &g);
    EXPECT_GT(t.version(), v0);
    const auto v = t.to_vector<double>();
    const double ones = std::count(v.begin(), v.end(), 1.0);
    EXPECT_EQ(ones + std::count(v.begin(), v.end(), 0.0), n);
    EXPECT_NEAR(ones / n, p, kZ * std::sqrt(p * (1 - p) / n) + 1e-12) << "p=" << p;
  }
  Tensor b = empty({1000}, kBool);
  bernoulli_(b, 1.0, &g);
  for (bool x : b.to_vector<bool>()) EXPECT_TRUE(x);
}

TEST(Random, NonContiguousTargetsGetTheStreamInLogicalOrder) {
  Generator a(6), b(6);
  Tensor base = zeros({40, 30});
  Tensor view = base.t();  // [30, 40], non-contiguous
  uniform_(view, 0.0, 1.0, &a);
  expect_identical(view, rand({30, 40}, {}, &b), "transposed view");
  Tensor sl = zeros({10, 10}, kFloat64).slice(1, 0, 10, 3);
  normal_(sl, 0, 1, &a);
  expect_identical(sl, randn({10, 4}, kFloat64, &b), "sliced view");
  EXPECT_EQ(rand({0}, {}, &a).numel(), 0);
  EXPECT_EQ(a.offset(), b.offset());
}

TEST(Random, Errors) {
  expect_error<TypeError>([] { rand({2}, kInt64); }, {"[rand]", "int64"});
  expect_error<TypeError>([] { randn({2}, kInt32); }, {"[randn]", "int32"});
  expect_error<ValueError>([] { randint(5, 5, {2}); }, {"[randint]", "low=5", "high=5"});
  expect_error<ValueError>([] { randint(0, 300, {2}, kUInt8); }, {"[randint]", "300", "uint8"});
  expect_error<TypeError>([] { randint(0, 2, {2}, kBool); }, {"[randint]", "bool"});
  expect_error<ValueError>([] { randint(0, 100000, {2}, kFloat16); }, {"[randint]", "float16"});
  Tensor t = zeros({3});
  expect_error<ValueError>([&] { uniform_(t, 2.0, 1.0); }, {"[uniform_]", "from=2", "to=1"});
  expect_error<ValueError>([&] { normal_(t, 0.0, -1.0); }, {"[normal_]", "std=-1"});
  expect_error<ValueError>([&] { bernoulli_(t, 1.5); }, {"[bernoulli_]", "1.5"});
  Tensor i = zeros({3}, kInt64);
  expect_error<TypeError>([&] { uniform_(i); }, {"[uniform_]", "int64"});
  expect_error<TypeError>([&] { normal_(i); }, {"[normal_]", "int64"});
}

TEST(RandomCuda, SameValuesAsCpu) {
  if (!ember::cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << ember::cuda::unavailable_reason();
  const Device dev("cuda");
  for (Dtype dt : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
    const std::string what(dtype_name(dt));
    Generator a(11), b(11);
    expect_identical(rand({1003}, TensorOptions(dt).device(dev), &a).cpu(), rand({1003}, dt, &b),
                     what + " rand");
    // Box-Muller goes through log/sin/cos, which may round differently on the device.
    const auto x = randn({1003}, TensorOptions(dt).device(dev), &a).to_vector<double>();
    const auto y = randn({1003}, dt, &b).to_vector<double>();
    const double tol = dt == kFloat64 ? 1e-12 : dt == kFloat32 ? 1e-5 : 1e-2;
    for (size_t i = 0; i < x.size(); ++i) {
      ASSERT_NEAR(x[i], y[i], tol * (1 + std::abs(y[i]))) << what << " randn element " << i;
    }
    EXPECT_EQ(a.offset(), b.offset());
  }
  Generator a(12), b(12);
  expect_identical(randint(-7, 100, {999}, TensorOptions(kInt32).device(dev), &a).cpu(),
                   randint(-7, 100, {999}, kInt32, &b), "randint");
  Tensor c = empty({999}, kFloat32).to(dev), d = empty({999}, kFloat32);
  bernoulli_(c, 0.25, &a);
  bernoulli_(d, 0.25, &b);
  expect_identical(c.cpu(), d, "bernoulli_");
  expect_identical(randperm(1000, TensorOptions(kInt64).device(dev), &a).cpu(),
                   randperm(1000, kInt64, &b), "randperm");
  Tensor e = zeros({20, 30}).to(dev).t(), f = zeros({20, 30}).t();
  uniform_(e, -1, 1, &a);
  uniform_(f, -1, 1, &b);
  expect_identical(e.cpu(), f, "uniform_ on a transposed view");
}
