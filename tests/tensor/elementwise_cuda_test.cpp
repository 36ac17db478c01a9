// Element-wise ops on CUDA: binary, strided, unary, clamp and in-place ops agree with the CPU,
// and FastDiv (the strided CUDA loop's index split) matches integer division. Skipped with the
// reason when no CUDA device is available (except FastDiv, which runs on the host).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include <ember/tensor/cuda/fast_div.h>
#include <ember/tensor/ops.h>
#include "elementwise_test_util.h"
#include "test_util.h"

using namespace ember;
using namespace ember::test;

// ---- CUDA ------------------------------------------------------------------------------------

namespace {
void expect_cuda_matches_cpu(const std::function<Tensor(const Tensor&, const Tensor&)>& op,
                             const Tensor& a, const Tensor& b, double tol) {
  Tensor want = op(a, b);
  Tensor got = op(a.cuda(), b.cuda());
  ASSERT_TRUE(got.is_cuda());
  ASSERT_EQ(got.dtype(), want.dtype());
  ASSERT_EQ(got.shape(), want.shape());
  expect_values(got.cpu(), want.to_vector<double>(), tol);
}
}  // namespace

TEST(Cuda, BinaryOpsMatchCpu) {
  if (!ember::cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << ember::cuda::unavailable_reason();
  Tensor a = make({3, 1, 5}, [](int64_t i) { return 0.25 * i - 1; });
  Tensor b = make({4, 1}, [](int64_t i) { return 0.5 * i + 0.75; });
  for (Dtype dt : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
    SCOPED_TRACE(::testing::Message() << "dtype " << dt);
    Tensor x = a.to(dt), y = b.to(dt);
    const double tol = tol_for(dt);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return p + q; }, x, y, tol);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return sub(p, q, 2); }, x, y, tol);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return p * q; }, x, y, tol);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return p / q; }, x, y, tol);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return pow(abs(p), q); }, x, y, 4 * tol);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return maximum(p, q); }, x, y, 0);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return minimum(p, q); }, x, y, 0);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return lt(p, q); }, x, y, 0);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return logical_xor(p, q); }, x, y, 0);
    expect_cuda_matches_cpu([](auto& p, auto&) { return p * 1.0004 - 2; }, x, y, tol);
    expect_cuda_matches_cpu([](auto& p, auto&) { return 2 / (abs(p) + 1); }, x, y, tol);
    expect_cuda_matches_cpu([](auto& p, auto&) { return ge(p, 0.5); }, x, y, 0);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return where(gt(p, 0), p, q); }, x, y, 0);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return relu_backward(q, p); }, x, y, 0);
  }
  for (Dtype dt : {kInt32, kInt64, kUInt8, kBool}) {
    SCOPED_TRACE(::testing::Message() << "dtype " << dt);
    Tensor x = make({2, 5}, [](int64_t i) { return double(i % 3); }, dt);
    Tensor y = make({5}, [](int64_t i) { return double(i % 2); }, dt);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return p + q; }, x, y, 0);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return p * q; }, x, y, 0);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return eq(p, q); }, x, y, 0);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return maximum(p, q); }, x, y, 0);
    if (dt != kBool) {
      expect_cuda_matches_cpu([](auto& p, auto& q) { return add(p, q, 3); }, x, y, 0);
      expect_cuda_matches_cpu([](auto& p, auto& q) { return pow(p, q); }, x, y, 0);
      expect_cuda_matches_cpu([](auto& p, auto& q) { return p / q; }, x, y, 0);
    }
  }
}

// The strided CUDA loop (Note [CUDA element-wise loops]) splits linear indices with FastDiv;
// its host form is the same arithmetic as the device's multiply-high.
TEST(FastDiv, MatchesIntegerDivision) {
  std::vector<uint32_t> divisors = {1, 2, 3, 5, 7, 31, 33, 256, 384, 1000, 1536, 65535, 65536,
                                    65537, 1000003, (1u << 30) - 1, 1u << 30, (1u << 30) + 1,
                                    (1u << 31) - 1};
  uint64_t s = 12345;
  auto next = [&] {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<uint32_t>(s >> 33);  // [0, 2^31)
  };
  for (int i = 0; i < 200; ++i) divisors.push_back(std::max<uint32_t>(1, next() >> (i % 31)));
  for (uint32_t d : divisors) {
    const ember::detail::FastDiv f = ember::detail::FastDiv::make(d);
    std::vector<uint32_t> ns = {0, 1, d - 1, d, d + 1, 2 * d - 1, 2 * d, (1u << 31) - 1,
                                (1u << 31) - 2, (1u << 31) - d, ((1u << 31) - 1) / d * d,
                                ((1u << 31) - 1) / d * d - 1};
    for (int i = 0; i < 2000; ++i) ns.push_back(next() >> (i % 31));
    for (uint32_t n : ns) {
      if (n > (1u << 31) - 1) continue;
      ASSERT_EQ(f.div(n), n / d) << n << " / " << d;
    }
  }
}

// Broadcast, transposed and in-place operands take the strided kernel: the GPT's shapes (bias
// add over rows, a per-row scalar, a mask broadcast over heads), sizes that are no multiple of
// a block's elements, 4-d broadcasts, four operands (where), and an in-place op on a view.
TEST(Cuda, StridedLoopsMatchCpu) {
  if (!ember::cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << ember::cuda::unavailable_reason();
  using Op = std::function<Tensor(const Tensor&, const Tensor&)>;
  struct Case {
    std::vector<int64_t> a, b;
    Op op;
  };
  const Op plus = [](const Tensor& p, const Tensor& q) { return p + q; };
  const std::vector<Case> cases = {
      {{1000, 1536}, {1536}, plus},
      {{3, 1027}, {1027}, plus},
      {{777, 33}, {777, 1}, [](const Tensor& p, const Tensor& q) { return p - q; }},
      {{6, 64, 64}, {64, 64}, plus},
      {{5, 1, 7, 3}, {1, 6, 1, 3}, [](const Tensor& p, const Tensor& q) { return p * q; }},
      {{50, 37}, {50}, [](const Tensor& p, const Tensor& q) { return p.t() + q; }},
      {{40, 30}, {30, 40}, [](const Tensor& p, const Tensor& q) { return p.t() * q; }},
      {{4, 33, 33}, {33, 33},
       [](const Tensor& p, const Tensor& q) { return masked_fill(p, gt(q, 0), -1e4); }},
      {{4, 33, 33}, {33, 1},
       [](const Tensor& p, const Tensor& q) { return where(gt(q, 0), p, q); }},
      {{64, 48}, {32},
       [](const Tensor& p, const Tensor& q) {
         Tensor r = p.clone();
         r.narrow(1, 8, 32).add_(q);  // in place on a strided view
         return r;
       }},
  };
  for (Dtype dt : {kFloat32, kBFloat16, kFloat64}) {
    for (size_t i = 0; i < cases.size(); ++i) {
      SCOPED_TRACE(::testing::Message() << "dtype " << dt << " case " << i);
      const Case& c = cases[i];
      const Tensor a = make(c.a, [](int64_t k) { return 0.37 * (k % 101) - 7; }, dt);
      const Tensor b = make(c.b, [](int64_t k) { return 0.5 * (k % 13) - 3; }, dt);
      expect_cuda_matches_cpu(c.op, a, b, tol_for(dt));
    }
  }
}

TEST(Cuda, UnaryClampAndInPlaceMatchCpu) {
  if (!ember::cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << ember::cuda::unavailable_reason();
  Tensor base = make({4, 6}, [](int64_t i) { return 0.37 * i - 4; });
  for (Dtype dt : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
    SCOPED_TRACE(::testing::Message() << "dtype " << dt);
    Tensor x = base.to(dt).t();  // strided
    const double tol = 2 * tol_for(dt);
    for (auto op : {+[](const Tensor& t) { return exp(t); }, +[](const Tensor& t) { return log(abs(t)); },
                    +[](const Tensor& t) { return log1p(abs(t)); }, +[](const Tensor& t) { return sqrt(abs(t)); },
                    +[](const Tensor& t) { return rsqrt(abs(t)); }, +[](const Tensor& t) { return reciprocal(t); },
                    +[](const Tensor& t) { return square(t); }, +[](const Tensor& t) { return sin(t); },
                    +[](const Tensor& t) { return cos(t); }, +[](const Tensor& t) { return tanh(t); },
                    +[](const Tensor& t) { return sigmoid(t); }, +[](const Tensor& t) { return relu(t); },
                    +[](const Tensor& t) { return gelu(t); }, +[](const Tensor& t) { return gelu(t, "tanh"); },
                    +[](const Tensor& t) { return silu(t); }, +[](const Tensor& t) { return erf(t); },
                    +[](const Tensor& t) { return neg(t); },
                    +[](const Tensor& t) { return sign(t); }, +[](const Tensor& t) { return logical_not(t); },
                    +[](const Tensor& t) { return clamp(t, -1, 2); },
                    +[](const Tensor& t) { return masked_fill(t, gt(t, 0), 9); }}) {
      expect_cuda_matches_cpu([op](auto& p, auto&) { return op(p); }, x, x, tol);
    }
  }
  Tensor c = base.cuda();
  c += 1;
  c.mul_(base.cuda());
  clamp_(c, -3, 3);
  Tensor h = base.clone();
  h += 1;
  h.mul_(base);
  clamp_(h, -3, 3);
  expect_values(c.cpu(), h.to_vector<double>(), 1e-12);
  // A 0-dim CPU tensor may join a CUDA op; other device mixes are errors naming both.
  expect_values((c + scalar_tensor(1.0, kFloat64)).cpu(), (h + 1).to_vector<double>(), 1e-12);
  expect_error<ValueError>([&] { c + base; }, {"[add]", "cuda:0", "cpu"});
}
