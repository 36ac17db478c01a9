// Reductions (tensor/ops/reduce.h): sum, mean, prod, max/min (with indices), amax/amin,
// argmax/argmin, topk, var/std, norm, logsumexp, softmax/log_softmax, any/all. Expected values are
// closed forms, naive double-precision loops written here, or PyTorch 1.13 literals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <ember/tensor/ops.h>
#include "test_util.h"

using ember::test::expect_error;

using namespace ember;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// Deterministic values in [-2, 2) on a 1/64 grid (exact in every floating dtype).
std::vector<float> grid_values(int64_t n, uint32_t seed = 1) {
  std::vector<float> v(n);
  uint32_t s = seed * 2654435761u + 12345u;
  for (auto& x : v) {
    s = s * 1664525u + 1013904223u;
    x = static_cast<float>(static_cast<int>(s >> 24) - 128) / 64.0f;
  }
  return v;
}

Tensor grid_tensor(IntList shape, Dtype dtype = kFloat32, uint32_t seed = 1, float scale = 1,
                   float offset = 0) {
  std::vector<float> v = grid_values(Shape(shape).numel(), seed);
  for (auto& x : v) x = x * scale + offset;
  return from_vector(v, shape).to(dtype);
}

// Reference reduction of t over the dims in `mask`, in double: outputs in row-major order over
// the kept dims. fold(acc, x, count_so_far) folds one element; fin(acc, n) finishes.
std::vector<double> ref_reduce(const Tensor& t, uint32_t mask, double init,
                               const std::function<double(double, double)>& fold,
                               const std::function<double(double, int64_t)>& fin =
                                   [](double a, int64_t) { return a; }) {
  const std::vector<double> v = t.to_vector<double>();
  const int64_t nd = t.dim();
  int64_t nout = 1, nred = 1;
  for (int64_t d = 0; d < nd; ++d) (mask >> d & 1u ? nred : nout) *= t.size(d);
  std::vector<double> acc(nout, init);
  std::vector<int64_t> idx(nd, 0);
  for (size_t i = 0; i < v.size(); ++i) {
    int64_t o = 0;
    for (int64_t d = 0; d < nd; ++d) {
      if (!(mask >> d & 1u)) o = o * t.size(d) + idx[d];
    }
    acc[o] = fold(acc[o], v[i]);
    for (int64_t d = nd - 1; d >= 0; --d) {
      if (++idx[d] < t.size(d)) break;
      idx[d] = 0;
    }
  }
  for (auto& a : acc) a = fin(a, nred);
  return acc;
}

void expect_close(const Tensor& got, const std::vector<double>& want, double rtol, double atol,
                  const std::string& what) {
  const std::vector<double> g = got.to_vector<double>();
  ASSERT_EQ(g.size(), want.size()) << what;
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::isnan(want[i])) {
      EXPECT_TRUE(std::isnan(g[i])) << what << " at " << i << ": got " << g[i] << ", want nan";
    } else if (std::isinf(want[i])) {
      EXPECT_EQ(g[i], want[i]) << what << " at " << i;
    } else {
      EXPECT_NEAR(g[i], want[i], atol + rtol * std::fabs(want[i]))
          << what << " at " << i << ": got " << g[i] << ", want " << want[i];
    }
  }
}

double tol_for(Dtype d) {
  switch (d) {
    case kFloat16: return 2e-3;
    case kBFloat16: return 1.6e-2;
    case kFloat32: return 1e-5;
    default: return 1e-12;
  }
}

const Dtype kFloats[] = {kFloat32, kFloat64, kFloat16, kBFloat16};

// Layouts of a logical [4, 6, 5] tensor: contiguous, transposed, stepped slice, expanded.
// Values are grid_values * scale + offset.
std::vector<std::pair<std::string, Tensor>> layouts(Dtype dtype, float scale = 1,
                                                    float offset = 0) {
  std::vector<std::pair<std::string, Tensor>> out;
  out.emplace_back("contiguous", grid_tensor({4, 6, 5}, dtype, 1, scale, offset));
  out.emplace_back("transposed",
                   grid_tensor({5, 6, 4}, dtype, 2, scale, offset).permute({2, 1, 0}));
  out.emplace_back("sliced", grid_tensor({8, 6, 10}, dtype, 3, scale, offset)
                                 .slice(0, 0, 8, 2)
                                 .slice(2, 1, 10, 2));
  out.emplace_back("expanded",
                   grid_tensor({4, 1, 5}, dtype, 4, scale, offset).expand({4, 6, 5}));
  return out;
}

const std::vector<std::vector<int64_t>> kDimSets = {{}, {0}, {1}, {2}, {-1}, {0, 2}, {2, 0}, {1, 2}, {0, 1, 2}, {-3, -2}};

uint32_t mask_of(const std::vector<int64_t>& dims, int64_t nd) {
  if (dims.empty()) return (1u << nd) - 1;
  uint32_t m = 0;
  for (int64_t d : dims) m |= 1u << (d < 0 ? d + nd : d);
  return m;
}

Shape expected_shape(const Tensor& t, uint32_t mask, bool keepdim) {
  Shape s;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (mask >> d & 1u) {
      if (keepdim) s.push_back(1);
    } else {
      s.push_back(t.size(d));
    }
  }
  return s;
}

}  // namespace

// ---- sum -------------------------------------------------------------------------------------

TEST(Sum, ArangeClosedFormOverDtypes) {
  const int64_t n = 200;
  EXPECT_EQ(sum(arange(n)).item<int64_t>(), n * (n - 1) / 2);
  Tensor i32 = arange(0, n, 1, kInt32);
  Tensor s = sum(i32);
  EXPECT_EQ(s.dtype(), kInt64);  // integers accumulate and return int64 (PyTorch)
  EXPECT_EQ(s.item<int64_t>(), n * (n - 1) / 2);
  Tensor u8 = full({1000}, 200, kUInt8);
  EXPECT_EQ(sum(u8).dtype(), kInt64);
  EXPECT_EQ(sum(u8).item<int64_t>(), 200000);  // no uint8 overflow
  Tensor b = arange(10).to(kBool);
  EXPECT_EQ(sum(b).dtype(), kInt64);
  EXPECT_EQ(sum(b).item<int64_t>(), 9);
  for (Dtype d : kFloats) {
    Tensor f = arange(0, 64, 1, d);
    EXPECT_EQ(sum(f).dtype(), d);
    EXPECT_EQ(sum(f).item<double>(), 64 * 63 / 2) << d;
  }
  EXPECT_EQ(arange(0, 10, 1, kFloat32).sum().item<float>(), 45.0f);
}

TEST(Sum, DimsKeepdimAndLayoutsMatchNaiveLoop) {
  for (Dtype dtype : {kFloat32, kFloat64, kInt64, kInt32, kUInt8, kBool, kBFloat16}) {
    const float scale = is_floating(dtype) ? 1.0f : dtype == kUInt8 ? 32.0f : 64.0f;
    for (const auto& [name, t] : layouts(dtype, scale, dtype == kUInt8 ? 64.0f : 0.0f)) {
      for (const auto& dims : kDimSets) {
        for (bool keepdim : {false, true}) {
          const uint32_t mask = mask_of(dims, 3);
          Tensor r = sum(t, dims, keepdim);
          const std::string what = name + " " + std::string(dtype_name(dtype)) + " dims=" +
                                   ::testing::PrintToString(dims) + " keepdim=" +
                                   std::to_string(keepdim);
          EXPECT_EQ(r.shape(), expected_shape(t, mask, keepdim)) << what;
          const double tol = is_floating(dtype) ? tol_for(dtype) : 0.0;
          expect_close(r, ref_reduce(t, mask, 0.0, [](double a, double x) { return a + x; }),
                       tol, tol * 4, what);
        }
      }
    }
  }
}

TEST(Sum, PairwiseAccuracyOnTenMillionValues) {
  // Naive float32 accumulation of 1e7 x 0.1 drifts by ~1%; pairwise/blocked summation does not.
  Tensor t = full({10000000}, 0.1f);
  const double s = sum(t).item<float>();
  EXPECT_NEAR(s, 1e6, 1e-3 * 1e6) << s;
  EXPECT_NEAR(s, 1e6, 1e-5 * 1e6) << s;  // in fact much better (PyTorch: 999999.4375)
  // Same along a dim that is not innermost (outer reduction).
  Tensor c = full({1000000, 3}, 0.1f);
  for (float v : sum(c, {0}).to_vector<float>()) EXPECT_NEAR(v, 1e5, 1e-2) << v;
  // And with more outputs than threads but long rows.
  Tensor r = full({3, 2000000}, 0.1f);
  for (float v : sum(r, {1}).to_vector<float>()) EXPECT_NEAR(v, 2e5, 2.0) << v;
}

TEST(Sum, DtypeArgumentCastsFirst) {
  Tensor f = from_vector<float>({1.5f, 2.5f, -0.5f});
  Tensor d = sum(f, {}, false, kFloat64);
  EXPECT_EQ(d.dtype(), kFloat64);
  EXPECT_EQ(d.item<double>(), 3.5);
  Tensor i = sum(f, {}, false, kInt32);  // PyTorch: cast to int32 (truncating), then sum
  EXPECT_EQ(i.dtype(), kInt32);
  EXPECT_EQ(i.item<int64_t>(), 1 + 2 + 0);
  Tensor x = arange(6);
  EXPECT_EQ(sum(x, {}, false, kFloat32).dtype(), kFloat32);
  EXPECT_EQ(sum(x, {}, false, kFloat32).item<float>(), 15.0f);
}

TEST(Sum, EmptyAndZeroDim) {
  EXPECT_EQ(sum(empty({0})).item<float>(), 0.0f);
  Tensor e = sum(empty({2, 0}), {1});
  EXPECT_EQ(e.shape(), Shape({2}));
  EXPECT_EQ(e.to_vector<float>(), std::vector<float>({0.0f, 0.0f}));
  EXPECT_EQ(sum(empty({0, 3}), {1}).shape(), Shape({0}));
  Tensor s = scalar_tensor(3.5f);
  EXPECT_EQ(sum(s).item<float>(), 3.5f);
  EXPECT_EQ(sum(s, {0}).dim(), 0);
  EXPECT_EQ(sum(s, {-1}, true).dim(), 0);
  EXPECT_EQ(sum(s, {0}).item<float>(), 3.5f);
}

TEST(Sum, BadDimsAreClearErrors) {
  Tensor t = zeros({2, 3});
  expect_error<ValueError>([&] { sum(t, {1, 1}); }, {"[sum]", "dim 1 appears multiple times"});
  expect_error<ValueError>([&] { sum(t, {1, -1}); }, {"[sum]", "dim 1 appears multiple times"});
  expect_error<IndexError>([&] { sum(t, {2}); }, {"[sum]", "2"});
  expect_error<ValueError>([&] { amax(t, {0, 0}); }, {"[amax]", "dim 0"});
  expect_error<ValueError>([&] { sum(Tensor()); }, {"[sum]"});
}

// ---- mean / prod -----------------------------------------------------------------------------

TEST(Mean, DimsAndDtypes) {
  for (Dtype dtype : kFloats) {
    for (const auto& [name, t0] : layouts(dtype)) {
      for (const auto& dims : kDimSets) {
        const uint32_t mask = mask_of(dims, 3);
        Tensor r = mean(t0, dims, true);
        EXPECT_EQ(r.dtype(), dtype);
        expect_close(r,
                     ref_reduce(t0, mask, 0.0, [](double a, double x) { return a + x; },
                                [](double a, int64_t n) { return a / n; }),
                     tol_for(dtype), tol_for(dtype), name + " mean");
      }
    }
  }
  EXPECT_EQ(arange(0, 100, 1, kFloat32).mean().item<float>(), 49.5f);
  EXPECT_EQ(full({3, 4}, 2.0f).mean({1}).to_vector<float>(), std::vector<float>(3, 2.0f));
}

TEST(Mean, EmptyIsNanAndIntegersAreRejected) {
  EXPECT_TRUE(std::isnan(mean(empty({0})).item<float>()));
  auto v = mean(empty({2, 0}), {1}).to_vector<float>();
  EXPECT_TRUE(std::isnan(v[0]) && std::isnan(v[1]));
  expect_error<TypeError>([] { mean(arange(4)); }, {"[mean]", "floating", "int64"});
}

TEST(Prod, ClosedFormsAndInt64Accumulation) {
  Tensor t = arange(1, 11, 1, kInt32);
  EXPECT_EQ(prod(t).dtype(), kInt64);
  EXPECT_EQ(prod(t).item<int64_t>(), 3628800);
  Tensor big = full({20}, 3, kInt32);
  EXPECT_EQ(prod(big).item<int64_t>(), 3486784401LL);  // beyond int32
  EXPECT_EQ(prod(empty({0})).item<float>(), 1.0f);
  Tensor f = from_vector<double>({1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_EQ(prod(f, {1}).to_vector<double>(), std::vector<double>({6, 120}));
  EXPECT_EQ(prod(f, {0}).to_vector<double>(), std::vector<double>({4, 10, 18}));
  EXPECT_EQ(prod(f.t(), {0}).to_vector<double>(), std::vector<double>({6, 120}));
  for (const auto& [name, x] : layouts(kFloat64, 0.25f, 1.0f)) {
    expect_close(prod(x, {0, 2}),
                 ref_reduce(x, 0b101, 1.0, [](double a, double v) { return a * v; }), 1e-12, 0,
                 name + " prod");
  }
}

// ---- max / min / amax / amin / argmax / argmin -------------------------------------------------

TEST(MaxMin, AllElementsOverDtypes) {
  for (Dtype d : {kFloat32, kFloat64, kFloat16, kBFloat16, kInt32, kInt64, kUInt8}) {
    for (const auto& [name, t] : layouts(d, d == kUInt8 ? 32.0f : 8.0f, d == kUInt8 ? 64.0f : 0.0f)) {
      const auto v = t.to_vector<double>();
      EXPECT_EQ(max(t).item<double>(), *std::max_element(v.begin(), v.end())) << name << " " << d;
      EXPECT_EQ(min(t).item<double>(), *std::min_element(v.begin(), v.end())) << name << " " << d;
      EXPECT_EQ(max(t).dtype(), d);
      EXPECT_EQ(amax(t).item<double>(), *std::max_element(v.begin(), v.end()));
      EXPECT_EQ(argmax(t).item<int64_t>(), std::max_element(v.begin(), v.end()) - v.begin());
      EXPECT_EQ(argmin(t).item<int64_t>(), std::min_element(v.begin(), v.end()) - v.begin());
    }
  }
  EXPECT_EQ(max(arange(1000)).item<int64_t>(), 999);
  EXPECT_EQ(min(arange(-5, 1000, 1)).item<int64_t>(), -5);
}

TEST(MaxMin, ValuesAndFirstIndexAlongDims) {
  for (Dtype dtype : {kFloat32, kFloat64, kFloat16, kBFloat16, kInt32, kInt64}) {
    // Values on a coarse grid so ties are common: the first occurrence must win.
    for (const auto& [name, t] : layouts(dtype, 2.0f)) {
      for (int64_t dim : {0, 1, 2, -1}) {
        const int64_t d = dim < 0 ? dim + 3 : dim;
        for (bool is_max : {true, false}) {
          auto [v, i] = is_max ? max(t, dim) : min(t, dim);
          EXPECT_EQ(i.dtype(), kInt64);
          EXPECT_EQ(v.dtype(), dtype);
          const auto tv = t.to_vector<double>();
          const auto vv = v.to_vector<double>();
          const auto iv = i.to_vector<int64_t>();
          // Naive first-occurrence search.
          std::vector<double> want_v;
          std::vector<int64_t> want_i;
          const int64_t s0 = t.size(0), s1 = t.size(1), s2 = t.size(2);
          auto at = [&](int64_t a, int64_t b, int64_t c) { return tv[(a * s1 + b) * s2 + c]; };
          for (int64_t a = 0; a < (d == 0 ? 1 : s0); ++a) {
            for (int64_t b = 0; b < (d == 1 ? 1 : s1); ++b) {
              for (int64_t c = 0; c < (d == 2 ? 1 : s2); ++c) {
                double best = 0;
                int64_t bi = -1;
                for (int64_t r = 0; r < t.size(d); ++r) {
                  const double x = d == 0 ? at(r, b, c) : d == 1 ? at(a, r, c) : at(a, b, r);
                  if (bi < 0 || (is_max ? x > best : x < best)) {
                    best = x;
                    bi = r;
                  }
                }
                want_v.push_back(best);
                want_i.push_back(bi);
              }
            }
          }
          ASSERT_EQ(vv.size(), want_v.size());
          for (size_t k = 0; k < vv.size(); ++k) {
            EXPECT_EQ(vv[k], want_v[k]) << name << " dim " << dim << " at " << k;
            EXPECT_EQ(iv[k], want_i[k]) << name << " dim " << dim << " at " << k;
          }
          // argmax/argmin agree with the indices; amax/amin with the values.
          EXPECT_EQ((is_max ? argmax(t, dim) : argmin(t, dim)).to_vector<int64_t>(), iv);
          EXPECT_EQ((is_max ? amax(t, {dim}) : amin(t, {dim})).to_vector<double>(), vv);
        }
      }
    }
  }
}

TEST(MaxMin, KeepdimShapes) {
  Tensor t = grid_tensor({3, 4, 5});
  auto [v, i] = max(t, 1, true);
  EXPECT_EQ(v.shape(), Shape({3, 1, 5}));
  EXPECT_EQ(i.shape(), Shape({3, 1, 5}));
  EXPECT_EQ(argmax(t, 2, true).shape(), Shape({3, 4, 1}));
  EXPECT_EQ(argmax(t, std::nullopt, true).shape(), Shape({1, 1, 1}));
  EXPECT_EQ(amin(t, {0, 2}, true).shape(), Shape({1, 4, 1}));
  EXPECT_EQ(amin(t, {0, 2}).shape(), Shape({4}));
}

TEST(MaxMin, TiesNanAndFlattened) {
  Tensor t = from_vector<int64_t>({1, 3, 3});
  EXPECT_EQ(max(t, 0).second.item<int64_t>(), 1);
  EXPECT_EQ(min(from_vector<int64_t>({3, 1, 1}), 0).second.item<int64_t>(), 1);
  Tensor n = from_vector<float>({1.0f, std::nanf(""), 3.0f, std::nanf("")});
  EXPECT_TRUE(std::isnan(max(n).item<float>()));
  EXPECT_TRUE(std::isnan(min(n).item<float>()));
  EXPECT_EQ(argmax(n).item<int64_t>(), 1);  // NaN counts as the extreme (PyTorch)
  EXPECT_EQ(argmin(n).item<int64_t>(), 1);
  EXPECT_TRUE(std::isnan(amax(n, {0}).item<float>()));
  // Flattened over a non-contiguous tensor.
  Tensor m = from_vector<float>({5, 1, 9, 2, 9, 0}, {2, 3}).t();  // [[5,2],[1,9],[9,0]]
  EXPECT_EQ(argmax(m).item<int64_t>(), 3);
  EXPECT_EQ(argmin(m).item<int64_t>(), 5);
  EXPECT_EQ(m.argmax().item<int64_t>(), 3);
  EXPECT_EQ(m.max().item<float>(), 9.0f);
  EXPECT_EQ(m.min().item<float>(), 0.0f);
  // Bool max/amax work (PyTorch).
  Tensor b = from_vector<bool>({false, true, false});
  EXPECT_EQ(max(b).item<bool>(), true);
  EXPECT_EQ(min(b).item<bool>(), false);
  // A long flattened argmax goes through the chunked path; the first of equal maxima wins.
  std::vector<float> big(300000, 0.0f);
  big[123456] = 7.0f;
  big[234567] = 7.0f;
  EXPECT_EQ(argmax(from_vector(big)).item<int64_t>(), 123456);
  big[200000] = std::nanf("");
  EXPECT_EQ(argmax(from_vector(big)).item<int64_t>(), 200000);
  EXPECT_EQ(argmin(from_vector(big)).item<int64_t>(), 200000);
}

TEST(MaxMin, ZeroDimAndEmptyErrors) {
  Tensor s = scalar_tensor(3.0f);
  auto [v, i] = max(s, 0);
  EXPECT_EQ(v.dim(), 0);
  EXPECT_EQ(v.item<float>(), 3.0f);
  EXPECT_EQ(i.item<int64_t>(), 0);
  EXPECT_EQ(argmax(s).item<int64_t>(), 0);
  EXPECT_EQ(max(s).item<float>(), 3.0f);
  expect_error<IndexError>([] { max(empty({0})); }, {"[max]", "non-empty", "[0]"});
  expect_error<IndexError>([] { min(empty({2, 0})); }, {"[min]", "[2, 0]"});
  expect_error<IndexError>([] { argmax(empty({0})); }, {"[argmax]", "[0]"});
  expect_error<IndexError>([] { max(empty({0, 3}), 0); }, {"[max]", "dim 0", "[0, 3]"});
  expect_error<IndexError>([] { amax(empty({0, 3}), {0}); }, {"[amax]", "dim 0"});
  expect_error<IndexError>([] { amin(empty({0, 3})); }, {"[amin]"});
  expect_error<IndexError>([] { argmin(empty({0, 3}), 0); }, {"[argmin]"});
  expect_error<IndexError>([] { argmax(zeros({2, 3}), 5); }, {"[argmax]", "5"});
  // Reducing a non-empty dim of an empty tensor is fine.
  auto [ev, ei] = max(empty({0, 3}), 1);
  EXPECT_EQ(ev.shape(), Shape({0}));
  EXPECT_EQ(ei.shape(), Shape({0}));
  EXPECT_EQ(amax(empty({0, 3}), {1}).shape(), Shape({0}));
}

// ---- topk ------------------------------------------------------------------------------------

namespace {

// The positions of topk along `dim` by a stable sort of each row (larger first when `largest`;
// NaN larger than every number; ties in position order), in t's shape with dim's size k.
std::vector<int64_t> ref_topk(const Tensor& t, int64_t k, int64_t dim, bool largest) {
  const Tensor rows = t.movedim(dim, -1).contiguous();
  const int64_t n = t.size(dim), nrows = rows.numel() / std::max<int64_t>(n, 1);
  const std::vector<double> v = rows.to_vector<double>();
  std::vector<int64_t> out;
  for (int64_t r = 0; r < nrows; ++r) {
    std::vector<int64_t> order(n);
    for (int64_t i = 0; i < n; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](int64_t i, int64_t j) {
      const double a = v[r * n + i], b = v[r * n + j];
      if (std::isnan(a) != std::isnan(b)) return largest ? std::isnan(a) : std::isnan(b);
      return largest ? a > b : a < b;
    });
    out.insert(out.end(), order.begin(), order.begin() + k);
  }
  Shape s = rows.shape();
  s[s.size() - 1] = k;
  return from_vector(out, s).movedim(-1, dim).contiguous().to_vector<int64_t>();
}

}  // namespace

TEST(TopK, MatchesAStableSortAlongEveryDimOfEveryLayout) {
  for (Dtype dtype : {kFloat32, kFloat64, kBFloat16, kInt64, kUInt8}) {
    // Values on a 1/64 grid (integers: on 1/8 of it): many ties, which go in position order.
    for (const auto& [name, t] :
         layouts(dtype, is_floating(dtype) ? 1.0f : 8.0f, dtype == kUInt8 ? 32.0f : 0.0f)) {
      for (int64_t dim : {0, 1, 2, -1}) {
        const int64_t n = t.size(dim);
        for (int64_t k : {int64_t{0}, int64_t{1}, int64_t{3}, n}) {
          for (bool largest : {true, false}) {
            const std::string w = name + " " + std::string(dtype_name(dtype)) + " dim " +
                                  std::to_string(dim) + " k " + std::to_string(k) +
                                  (largest ? " largest" : " smallest");
            auto [values, indices] = topk(t, k, dim, largest);
            Shape s = t.shape();
            s[dim < 0 ? dim + 3 : dim] = k;
            ASSERT_EQ(indices.shape(), s) << w;
            ASSERT_EQ(values.shape(), s) << w;
            EXPECT_EQ(indices.dtype(), kInt64) << w;
            EXPECT_EQ(values.dtype(), dtype) << w;
            EXPECT_EQ(indices.to_vector<int64_t>(), ref_topk(t, k, dim, largest)) << w;
            EXPECT_EQ(values.to_vector<double>(), gather(t, dim, indices).to_vector<double>()) << w;
          }
        }
      }
    }
  }
}

TEST(TopK, NanCountsAsLargestAndRowsLongerThanAThreadsShare) {
  const Tensor t = from_vector<double>({1, kNaN, 3, kNaN, -kInf, 3}, {6});
  EXPECT_EQ(topk(t, 3).second.to_vector<int64_t>(), (std::vector<int64_t>{1, 3, 2}));
  EXPECT_EQ(topk(t, 4, 0, false).second.to_vector<int64_t>(), (std::vector<int64_t>{4, 0, 2, 5}));
  // Long rows, few of them (sampling's shape), and many short rows (a router's).
  for (const Shape& shape : {Shape{2, 50304}, Shape{4099, 8}}) {
    const Tensor x = grid_tensor(IntList(shape.data(), shape.size()), kFloat32, 7);
    for (int64_t k : {int64_t{1}, int64_t{2}, int64_t{8}}) {
      EXPECT_EQ(topk(x, k).second.to_vector<int64_t>(), ref_topk(x, k, 1, true))
          << shape << " k " << k;
    }
  }
}

TEST(TopK, ZeroDimAndEmptyRows) {
  auto [v0, i0] = topk(from_vector<float>({2.5f}, {1}).view(Shape{}), 1);
  EXPECT_EQ(v0.dim(), 0);
  EXPECT_EQ(v0.item<float>(), 2.5f);
  EXPECT_EQ(i0.item<int64_t>(), 0);
  auto [v00, i00] = topk(from_vector<float>({2.5f}, {1}).view(Shape{}), 0);  // torch's shapes
  EXPECT_EQ(v00.dim(), 0);
  EXPECT_EQ(i00.dim(), 0);
  EXPECT_EQ(topk(empty({0, 5}), 2).first.shape(), Shape({0, 2}));
}

TEST(TopK, BadArgumentsAreClearErrors) {
  const Tensor t = zeros({3, 4});
  expect_error<IndexError>([&] { topk(t, 5); }, {"[topk]", "0 <= k <= 4", "got k = 5"});
  expect_error<IndexError>([&] { topk(t, -1, 0); }, {"[topk]", "0 <= k <= 3"});
  expect_error<IndexError>([&] { topk(t, 1, 2); }, {"topk"});
  expect_error<TypeError>([&] { topk(t.to(kBool), 1); }, {"[topk]", "bool"});
  expect_error<ValueError>([&] { topk(Tensor(), 1); }, {"topk"});
}

// ---- var / std -------------------------------------------------------------------------------

TEST(VarStd, ClosedFormsOfArange) {
  // var(arange(n)) with correction c = n (n^2 - 1) / 12 / (n - c).
  for (int64_t n : {1, 2, 10, 1000, 100001}) {
    Tensor t = arange(0, n, 1, kFloat64);
    for (int64_t c : {0, 1, 2}) {
      const double ss = static_cast<double>(n) * (static_cast<double>(n) * n - 1) / 12.0;
      const double want = n - c > 0 ? ss / (n - c) : (ss == 0 ? kNaN : kInf);
      const double got = var(t, {}, c).item<double>();
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got)) << n << " " << c;
      } else if (std::isinf(want)) {
        EXPECT_EQ(got, want) << n << " " << c;
      } else {
        EXPECT_NEAR(got, want, 1e-9 * want) << n << " " << c;
        EXPECT_NEAR(ember::std(t, {}, c).item<double>(), std::sqrt(want), 1e-9 * std::sqrt(want));
      }
    }
  }
}

TEST(VarStd, PyTorchLiteralsDimsAndLayouts) {
  Tensor x = from_vector<double>({0.5, -1.25, 2.0, 3.5, -0.75, 0.0, 1.5, -2.0, 4.0, 1.0, -3.0, 0.25},
                                 {3, 4});
  // torch.var(x, 1) and torch.std(x, 0, correction=0) in float64.
  expect_close(var(x, {1}), {4.140625, 2.140625, 8.265625}, 1e-14, 0, "var1");
  expect_close(ember::std(x, {0}, 0),
               {2.0103896803024699, 0.92044675143227184, 2.2484562605386738, 2.2577028640240111},
               1e-14, 0, "std0");
  for (Dtype dtype : kFloats) {
    for (const auto& [name, t] : layouts(dtype)) {
      for (const auto& dims : kDimSets) {
        const uint32_t mask = mask_of(dims, 3);
        // Reference: two passes in double.
        const auto m = ref_reduce(t, mask, 0.0, [](double a, double v) { return a + v; },
                                  [](double a, int64_t n) { return a / n; });
        auto got = var(t, dims, 1, false);
        // Naive variance through E[(x - mean)^2] computed per output.
        std::vector<double> want(m.size(), 0.0);
        {
          const auto v = t.to_vector<double>();
          int64_t nred = 1;
          for (int64_t d = 0; d < 3; ++d) {
            if (mask >> d & 1u) nred *= t.size(d);
          }
          std::vector<int64_t> idx(3, 0);
          for (size_t i = 0; i < v.size(); ++i) {
            int64_t o = 0;
            for (int64_t d = 0; d < 3; ++d) {
              if (!(mask >> d & 1u)) o = o * t.size(d) + idx[d];
            }
            want[o] += (v[i] - m[o]) * (v[i] - m[o]);
            for (int64_t d = 2; d >= 0; --d) {
              if (++idx[d] < t.size(d)) break;
              idx[d] = 0;
            }
          }
          for (auto& w : want) w /= static_cast<double>(nred - 1);
        }
        expect_close(got, want, 4 * tol_for(dtype), 4 * tol_for(dtype), name + " var");
      }
    }
  }
}

TEST(VarStd, EdgeCasesAndTypes) {
  EXPECT_TRUE(std::isnan(var(empty({0})).item<float>()));
  EXPECT_TRUE(std::isnan(ember::std(empty({0})).item<float>()));
  EXPECT_TRUE(std::isnan(var(scalar_tensor(3.0f)).item<float>()));
  EXPECT_EQ(var(scalar_tensor(3.0f), {}, 0).item<float>(), 0.0f);
  // Large offset: two-pass variance stays exact where E[x^2] - E[x]^2 would not.
  Tensor off = from_vector<float>({1e4f + 1, 1e4f + 2, 1e4f + 3, 1e4f + 4});
  EXPECT_NEAR(var(off).item<float>(), 5.0f / 3.0f, 1e-5);
  expect_error<TypeError>([] { var(arange(4)); }, {"[var]", "int64"});
  expect_error<TypeError>([] { ember::std(arange(4)); }, {"[std]", "int64"});
  EXPECT_EQ(var(full({4}, 1.0f, kFloat16)).dtype(), kFloat16);
}

// ---- norm ------------------------------------------------------------------------------------

TEST(Norm, PyTorchLiterals) {
  Tensor x = from_vector<double>({0.5, -1.25, 2.0, 3.5, -0.75, 0.0, 1.5, -2.0, 4.0, 1.0, -3.0, 0.25},
                                 {3, 4});
  // torch.linalg / Tensor.norm on the same float64 values.
  expect_close(norm(x), {7.1370512118100988}, 1e-14, 0, "norm2");
  expect_close(norm(x, 1, {1}), {7.25, 4.25, 8.25}, 1e-14, 0, "norm1");
  expect_close(norm(x, 3, {0}),
               {4.0113609309295226, 1.4346983870792918, 3.3729983558527121, 3.7057768293331566},
               1e-13, 0, "norm3");
  expect_close(norm(x, kInf), {4}, 0, 0, "norminf");
  expect_close(norm(x, -kInf, {1}), {0.5, 0, 0.25}, 0, 0, "norm-inf");
  expect_close(norm(x, 0), {11}, 0, 0, "norm0");
  expect_close(norm(x, 0.5), {191.74543722291759}, 1e-13, 0, "norm0.5");
  // Non-contiguous (transposed) gives the same values.
  expect_close(norm(x.t(), 1, {0}), {7.25, 4.25, 8.25}, 1e-14, 0, "norm1 t");
}

TEST(Norm, DtypesLayoutsAndErrors) {
  for (Dtype dtype : kFloats) {
    for (const auto& [name, t] : layouts(dtype)) {
      expect_close(norm(t, 2.0, {0, 2}),
                   ref_reduce(t, 0b101, 0.0, [](double a, double v) { return a + v * v; },
                              [](double a, int64_t) { return std::sqrt(a); }),
                   4 * tol_for(dtype), 4 * tol_for(dtype), name + " norm2");
      expect_close(norm(t, kInf, {1}),
                   ref_reduce(t, 0b010, 0.0,
                              [](double a, double v) { return std::max(a, std::fabs(v)); }),
                   tol_for(dtype), 0, name + " norminf");
    }
  }
  EXPECT_EQ(norm(empty({0})).item<float>(), 0.0f);
  EXPECT_EQ(norm(empty({2, 0}), kInf, {1}).to_vector<float>(), std::vector<float>(2, 0.0f));
  // min |x| of nothing has no identity (torch.linalg.vector_norm raises): it was +inf.
  expect_error<ValueError>([] { norm(empty({0}), -kInf); }, {"[norm]", "-inf", "dim 0"});
  expect_error<ValueError>([] { norm(empty({2, 0}), -kInf, {1}); }, {"[norm]", "dim 1"});
  EXPECT_EQ(norm(empty({0, 2}), -kInf, {1}).numel(), 0);  // over a non-empty dim: nothing
  EXPECT_EQ(norm(tensor({-3.f, 2.f}), -kInf).item<float>(), 2.0f);
  expect_error<TypeError>([] { norm(arange(3)); }, {"[norm]", "int64"});
}

// ---- logsumexp / softmax / log_softmax -------------------------------------------------------

namespace {
Tensor lit34() {
  return from_vector<double>({0.5, -1.25, 2.0, 3.5, -0.75, 0.0, 1.5, -2.0, 4.0, 1.0, -3.0, 0.25},
                             {3, 4});
}
}  // namespace

TEST(LogSumExp, PyTorchLiteralsAndStability) {
  Tensor x = lit34();
  // torch.logsumexp(x, dim) in float64.
  expect_close(logsumexp(x, {1}), {3.7480850490038047, 1.806548061336632, 4.0715917412742479},
               1e-14, 0, "lse1");
  expect_close(logsumexp(x, {0}),
               {4.0381134451904606, 1.3874903020272, 2.478262311448824, 3.5419678778444985},
               1e-14, 0, "lse0");
  expect_close(logsumexp(x, {0, 1}), {4.6745037802852396}, 1e-14, 0, "lse01");
  expect_close(logsumexp(x.t(), {1}, true), {4.0381134451904606, 1.3874903020272,
                                             2.478262311448824, 3.5419678778444985},
               1e-14, 0, "lse t");
  EXPECT_EQ(logsumexp(x.t(), {1}, true).shape(), Shape({4, 1}));
  // Huge values do not overflow: torch.logsumexp([1000, 1000.5, -1000]) = 1000.97407698418.
  for (Dtype d : {kFloat32, kFloat64}) {
    Tensor big = from_vector<double>({1000.0, 1000.5, -1000.0}).to(d);
    EXPECT_NEAR(logsumexp(big, {0}).item<double>(), 1000.9740769841801, 1e-4) << d;
  }
  Tensor inf = from_vector<float>({INFINITY, INFINITY});
  EXPECT_EQ(logsumexp(inf, {0}).item<float>(), INFINITY);
  Tensor ninf = from_vector<float>({-INFINITY, -INFINITY});
  EXPECT_EQ(logsumexp(ninf, {0}).item<float>(), -INFINITY);
  EXPECT_EQ(logsumexp(empty({2, 0}), {1}).to_vector<float>(), std::vector<float>(2, -INFINITY));
  expect_error<TypeError>([] { logsumexp(arange(3), {0}); }, {"[logsumexp]", "int64"});
  for (Dtype dtype : kFloats) {
    for (const auto& [name, t] : layouts(dtype)) {
      expect_close(logsumexp(t, {0, 2}),
                   ref_reduce(t, 0b101, 0.0, [](double a, double v) { return a + std::exp(v); },
                              [](double a, int64_t) { return std::log(a); }),
                   4 * tol_for(dtype), 4 * tol_for(dtype), name + " lse");
    }
  }
}

TEST(Softmax, PyTorchLiterals) {
  Tensor x = lit34();
  // torch.softmax / torch.log_softmax in float64.
  const std::vector<double> sm1 = {
      0.038848529678271349, 0.006750862199444865, 0.17410703085781265, 0.78029357726447113,
      0.077572052773142469, 0.16422003700942187,  0.73598314499563855, 0.02222476522179713,
      0.93091087072776224,  0.046347323165310851, 0.00084888083455529801, 0.021892925272371661};
  const std::vector<double> sm0 = {
      0.029068113976935313,  0.071540589715526168, 0.61985957939036118, 0.95890058203138362,
      0.0083281540900707052, 0.24970119348625383,  0.37596383961683122, 0.0039188075109724283,
      0.96260373193299398,   0.6787582167982199,   0.0041765809928076634, 0.037180610457644064};
  const std::vector<double> ls1 = {
      -3.2480850490038047, -4.9980850490038042, -1.7480850490038045, -0.24808504900380454,
      -2.556548061336632,  -1.806548061336632,  -0.30654806133663198, -3.806548061336632,
      -0.071591741274248166, -3.0715917412742479, -7.0715917412742479, -3.8215917412742479};
  const std::vector<double> ls0 = {
      -3.5381134451904606, -2.6374903020272003, -0.47826231144882381, -0.041967877844498652,
      -4.7881134451904606, -1.3874903020272,    -0.97826231144882381, -5.541967877844499,
      -0.03811344519046056, -0.38749030202720008, -5.478262311448824, -3.2919678778444985};
  for (Dtype d : kFloats) {
    Tensor xd = x.to(d);
    const double tol = d == kFloat32 ? 2e-6 : tol_for(d) * 2;
    expect_close(softmax(xd, 1), sm1, tol, tol, "softmax1");
    expect_close(softmax(xd, -1), sm1, tol, tol, "softmax-1");
    expect_close(softmax(xd, 0), sm0, tol, tol, "softmax0");
    expect_close(log_softmax(xd, 1), ls1, tol, tol, "log_softmax1");
    expect_close(log_softmax(xd, 0), ls0, tol, tol, "log_softmax0");
    EXPECT_EQ(softmax(xd, 1).dtype(), d);
  }
  // Non-contiguous input: softmax over dim 0 of x^T equals the transpose of softmax over dim 1.
  expect_close(softmax(x.t(), 0).t().contiguous(), sm1, 1e-14, 0, "softmax t");
}

TEST(Softmax, AnyDimOfThreeDimsMatchesNaive) {
  for (Dtype dtype : {kFloat32, kFloat64}) {
    for (const auto& [name, t] : layouts(dtype)) {
      for (int64_t dim : {0, 1, 2}) {
        Tensor y = softmax(t, dim), ly = log_softmax(t, dim);
        const auto lse = ref_reduce(t, 1u << dim, 0.0,
                                    [](double a, double v) { return a + std::exp(v); },
                                    [](double a, int64_t) { return std::log(a); });
        // Broadcast lse back over dim.
        const auto v = t.to_vector<double>();
        std::vector<double> want_log(v.size()), want(v.size());
        std::vector<int64_t> idx(3, 0);
        for (size_t i = 0; i < v.size(); ++i) {
          int64_t o = 0;
          for (int64_t d = 0; d < 3; ++d) {
            if (d != dim) o = o * t.size(d) + idx[d];
          }
          want_log[i] = v[i] - lse[o];
          want[i] = std::exp(want_log[i]);
          for (int64_t d = 2; d >= 0; --d) {
            if (++idx[d] < t.size(d)) break;
            idx[d] = 0;
          }
        }
        expect_close(y, want, 2 * tol_for(dtype), 1e-7, name + " softmax");
        expect_close(ly, want_log, 2 * tol_for(dtype), 1e-6, name + " log_softmax");
      }
    }
  }
}

TEST(Softmax, StabilityEdgeCasesAndErrors) {
  Tensor big = from_vector<float>({1000.0f, 1001.0f, -1e30f});
  auto y = softmax(big, 0).to_vector<float>();
  EXPECT_NEAR(y[0], 0.26894142f, 1e-6);
  EXPECT_NEAR(y[1], 0.73105858f, 1e-6);
  EXPECT_EQ(y[2], 0.0f);
  auto ly = log_softmax(big, 0).to_vector<float>();
  EXPECT_NEAR(ly[1], -0.31326169f, 1e-5);
  Tensor with_inf = from_vector<float>({-INFINITY, 0.0f, -INFINITY});
  EXPECT_EQ(softmax(with_inf, 0).to_vector<float>(), std::vector<float>({0.0f, 1.0f, 0.0f}));
  auto nn = softmax(from_vector<float>({-INFINITY, -INFINITY}), 0).to_vector<float>();
  EXPECT_TRUE(std::isnan(nn[0]) && std::isnan(nn[1]));  // as PyTorch
  auto wn = softmax(from_vector<float>({1.0f, std::nanf("")}), 0).to_vector<float>();
  EXPECT_TRUE(std::isnan(wn[0]) && std::isnan(wn[1]));
  // A NaN anywhere in a long row (the vector lanes or the tail of the row's max) makes the whole
  // row NaN; a row of -inf and finite values does not.
  for (const int64_t at : {int64_t{0}, int64_t{37}, int64_t{95}, int64_t{99}}) {
    std::vector<float> row(100, 1.0f);
    row[static_cast<size_t>(at)] = std::nanf("");
    for (const float v : softmax(from_vector<float>(row), 0).to_vector<float>()) {
      ASSERT_TRUE(std::isnan(v)) << "NaN at " << at;
    }
    row[static_cast<size_t>(at)] = -INFINITY;
    for (const float v : softmax(from_vector<float>(row), 0).to_vector<float>()) {
      ASSERT_FALSE(std::isnan(v)) << "-inf at " << at;
    }
  }
  EXPECT_EQ(softmax(scalar_tensor(2.0f), 0).item<float>(), 1.0f);
  EXPECT_EQ(softmax(scalar_tensor(2.0f), 0).dim(), 0);
  EXPECT_EQ(log_softmax(scalar_tensor(2.0f), -1).item<float>(), 0.0f);
  EXPECT_EQ(softmax(empty({2, 0}), 1).shape(), Shape({2, 0}));
  // A long row (several exp blocks) still sums to 1.
  Tensor longrow = grid_tensor({1, 100000});
  EXPECT_NEAR(sum(softmax(longrow, 1)).item<float>(), 1.0f, 1e-5);
  expect_error<TypeError>([] { softmax(arange(3), 0); }, {"[softmax]", "int64"});
  expect_error<TypeError>([] { log_softmax(arange(3), 0); }, {"[log_softmax]", "int64"});
  expect_error<IndexError>([] { softmax(zeros({2, 3}), 2); }, {"[softmax]", "2"});
}

// Closed forms: y (g - sum(g y)) for softmax and g - exp(y) sum(g) for log_softmax, per row.
TEST(Softmax, BackwardMatchesClosedFormAndNamesItsErrors) {
  const Tensor x = grid_tensor({3, 5}, kFloat64, 7), g = grid_tensor({3, 5}, kFloat64, 8);
  for (bool log : {false, true}) {
    for (int64_t dim : {1, -2}) {
      const int64_t d = dim < 0 ? dim + 2 : dim;
      const Tensor y = log ? log_softmax(x, d) : softmax(x, d);
      const auto yv = y.to_vector<double>(), gv = g.to_vector<double>();
      std::vector<double> want(yv.size());
      for (int64_t o = 0; o < (d == 1 ? 3 : 5); ++o) {
        auto at = [&](int64_t i) { return d == 1 ? o * 5 + i : i * 5 + o; };
        double s = 0;
        for (int64_t i = 0; i < (d == 1 ? 5 : 3); ++i) s += log ? gv[at(i)] : gv[at(i)] * yv[at(i)];
        for (int64_t i = 0; i < (d == 1 ? 5 : 3); ++i) {
          want[at(i)] = log ? gv[at(i)] - std::exp(yv[at(i)]) * s : yv[at(i)] * (gv[at(i)] - s);
        }
      }
      expect_close(softmax_backward(g, y, dim, log), want, 1e-14, 1e-15,
                   std::string(log ? "log_softmax" : "softmax") + " backward dim " +
                       std::to_string(dim));
    }
  }
  expect_error([&] { softmax_backward(g, x.view({5, 3}), 1); },
               {"[softmax_backward]", "output's shape [5, 3]", "got [3, 5]"});
  expect_error<TypeError>([&] { softmax_backward(arange(3), arange(3), 0); },
                          {"[softmax_backward]", "floating-point", "int64"});
  expect_error<IndexError>([&] { softmax_backward(g, x, 2); }, {"[softmax_backward]", "2"});
}

// ---- any / all -------------------------------------------------------------------------------

TEST(AnyAll, OverDtypesAndLayouts) {
  EXPECT_TRUE(any(from_vector<float>({0.0f, 0.0f, 0.5f})).item<bool>());
  EXPECT_FALSE(any(zeros({5})).item<bool>());
  EXPECT_TRUE(all(ones({5}, kInt32)).item<bool>());
  EXPECT_FALSE(all(arange(5)).item<bool>());
  EXPECT_EQ(any(arange(5)).dtype(), kBool);
  EXPECT_FALSE(any(empty({0})).item<bool>());
  EXPECT_TRUE(all(empty({0})).item<bool>());
  EXPECT_TRUE(all(from_vector<bool>({true, true})).item<bool>());
  EXPECT_TRUE(any(from_vector<float>({0.0f, std::nanf("")})).item<bool>());  // NaN is nonzero
  Tensor m = zeros({64, 64}, kUInt8);
  m.select(0, 37).select(0, 5).fill_(1);
  EXPECT_TRUE(any(m.t()).item<bool>());
  EXPECT_FALSE(all(m.t()).item<bool>());
  EXPECT_TRUE(any(full({100000}, 1.0f, kFloat16)).item<bool>());
  EXPECT_TRUE(all(full({100000}, 1.0f, kBFloat16)).item<bool>());
}

// ---- multithreading gives the same results ---------------------------------------------------

TEST(Reduce, ThreadCountDoesNotChangeResults) {
  const int saved = get_num_threads();
  Tensor t = grid_tensor({300, 7000});
  set_num_threads(1);
  const auto s1 = sum(t).item<float>();
  const auto c1 = sum(t, {0}).to_vector<float>();
  const auto r1 = sum(t, {1}).to_vector<float>();
  const auto a1 = argmax(t).item<int64_t>();
  set_num_threads(2);
  EXPECT_EQ(sum(t).item<float>(), s1);
  EXPECT_EQ(sum(t, {0}).to_vector<float>(), c1);
  EXPECT_EQ(sum(t, {1}).to_vector<float>(), r1);
  EXPECT_EQ(argmax(t).item<int64_t>(), a1);
  set_num_threads(saved);
}

// Reduced dims on both sides of a kept one, the innermost reduced run dense and at least 64 long
// (batch norm's statistics of [N, C, H, W] over N, H and W): reduced where the runs lie, without
// a permuted copy. Every kind against the double-precision loop, a NaN in one run, and the same
// bits at 1 and 2 threads.
TEST(Reduce, DenseRunsAroundAKeptDimMatchTheNaiveLoop) {
  const std::vector<std::pair<std::string, Tensor>> cases = {
      {"[3, 5, 130] over {0, 2}", grid_tensor({3, 5, 130}, kFloat32, 5)},
      {"[4, 3, 8, 16] over {0, 2, 3}", grid_tensor({4, 3, 8, 16}, kFloat32, 6)},
      {"sliced [6, 3, 70] over {0, 2}", grid_tensor({6, 4, 70}, kFloat32, 7).slice(1, 0, 4, 2)}};
  for (const auto& [name, t] : cases) {
    const uint32_t mask = t.dim() == 3 ? 0b101u : 0b1101u;
    const std::vector<int64_t> dims =
        t.dim() == 3 ? std::vector<int64_t>{0, 2} : std::vector<int64_t>{0, 2, 3};
    auto add = [](double a, double x) { return a + x; };
    expect_close(sum(t, dims), ref_reduce(t, mask, 0.0, add), 1e-5, 1e-5, name + " sum");
    const std::vector<double> means =
        ref_reduce(t, mask, 0.0, add, [](double a, int64_t n) { return a / n; });
    expect_close(mean(t, dims), means, 1e-5, 1e-5, name + " mean");
    // var: the sum of squares about each output's mean, n - 1 degrees of freedom.
    std::vector<double> sq(means.size(), 0.0);
    {
      const Tensor c = t - mean(t, dims, /*keepdim=*/true);
      sq = ref_reduce(
          c, mask, 0.0, [](double a, double x) { return a + x * x; },
          [](double a, int64_t n) { return a / (n - 1); });
    }
    expect_close(var(t, dims), sq, 1e-5, 1e-5, name + " var");
    expect_close(amax(t, dims),
                 ref_reduce(t, mask, -kInf, [](double a, double x) { return std::max(a, x); }), 0,
                 0, name + " amax");
    expect_close(logsumexp(t, dims),
                 ref_reduce(
                     t, mask, 0.0, [](double a, double x) { return a + std::exp(x); },
                     [](double a, int64_t) { return std::log(a); }),
                 1e-5, 1e-5, name + " logsumexp");
    const int saved = get_num_threads();
    set_num_threads(1);
    const std::vector<float> one = sum(t, dims).to_vector<float>();
    set_num_threads(2);
    EXPECT_EQ(sum(t, dims).to_vector<float>(), one) << name;
    set_num_threads(saved);
  }
  std::vector<float> v = grid_values(600);
  v[(1 * 3 + 2) * 100 + 57] = NAN;  // [1, 2, 57]
  const Tensor t = from_vector(v, {2, 3, 100});
  const std::vector<double> got = amax(t, {0, 2}).to_vector<double>();
  EXPECT_FALSE(std::isnan(got[0]));
  EXPECT_TRUE(std::isnan(got[2])) << "a NaN in one run makes its output NaN";
  EXPECT_TRUE(std::isnan(sum(t, {0, 2}).to_vector<double>()[2]));
}

// ---- CUDA vs CPU -----------------------------------------------------------------------------

namespace {
void expect_same(const Tensor& cpu, const Tensor& gpu, double tol, const std::string& what) {
  ASSERT_TRUE(gpu.is_cuda()) << what;
  EXPECT_EQ(cpu.shape(), gpu.shape()) << what;
  EXPECT_EQ(cpu.dtype(), gpu.dtype()) << what;
  expect_close(gpu.cpu(), cpu.to_vector<double>(), tol, tol, what);
}
}  // namespace

TEST(ReduceCuda, MatchesCpu) {
  if (!ember::cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << ember::cuda::unavailable_reason();
  for (Dtype dtype : {kFloat32, kFloat64, kFloat16, kBFloat16, kInt64, kInt32, kUInt8, kBool}) {
    for (const auto& [name, t] : layouts(dtype, is_floating(dtype) ? 1.0f : 8.0f,
                                         dtype == kUInt8 ? 32.0f : 0.0f)) {
      // The same layout on the device: copy the storage, then take the same view.
      Tensor base = t.contiguous().cuda();
      Tensor g = name == "contiguous" ? base : base.as_strided(t.shape(), contiguous_strides(t.shape()));
      if (name == "transposed") g = t.permute({2, 1, 0}).contiguous().cuda().permute({2, 1, 0});
      if (name == "expanded") g = t.select(1, 0).unsqueeze(1).contiguous().cuda().expand({4, 6, 5});
      for (const auto& dims : kDimSets) {
        const std::string w = name + " " + std::string(dtype_name(dtype)) + " " +
                              ::testing::PrintToString(dims);
        const double tol = is_floating(dtype) ? 4 * tol_for(dtype) : 0;
        expect_same(sum(t, dims), sum(g, dims), tol, "sum " + w);
        if (dtype == kFloat64) expect_same(prod(t, dims), prod(g, dims), 1e-12, "prod " + w);
        expect_same(amax(t, dims, true), amax(g, dims, true), 0, "amax " + w);
        expect_same(amin(t, dims), amin(g, dims), 0, "amin " + w);
        if (is_floating(dtype)) {
          expect_same(mean(t, dims), mean(g, dims), tol, "mean " + w);
          expect_same(var(t, dims), var(g, dims), 4 * tol, "var " + w);
          expect_same(norm(t, 2.0, dims), norm(g, 2.0, dims), tol, "norm " + w);
          expect_same(norm(t, 3.0, dims), norm(g, 3.0, dims), tol, "norm3 " + w);
          expect_same(logsumexp(t, dims), logsumexp(g, dims), tol, "lse " + w);
        }
      }
      for (int64_t dim : {0, 1, 2}) {
        auto [cv, ci] = max(t, dim);
        auto [gv, gi] = max(g, dim);
        expect_same(cv, gv, 0, "max values " + name);
        expect_same(ci, gi, 0, "max indices " + name);
        expect_same(argmin(t, dim), argmin(g, dim), 0, "argmin " + name);
        if (is_floating(dtype)) {
          expect_same(softmax(t, dim), softmax(g, dim), 4 * tol_for(dtype), "softmax " + name);
          expect_same(log_softmax(t, dim), log_softmax(g, dim), 4 * tol_for(dtype),
                      "log_softmax " + name);
        }
      }
      expect_same(argmax(t), argmax(g), 0, "argmax flat " + name);
      expect_same(any(t), any(g), 0, "any " + name);
      expect_same(all(t), all(g), 0, "all " + name);
    }
  }
}

// Sums over the rows of [N, K] (a bias gradient): the packet-per-thread column kernel for
// every element size, with and without splitting the rows over blocks, for K a multiple of the
// packet width or not, and for column views (row stride above K; an offset that is not packet
// aligned takes the general kernel).
TEST(ReduceCuda, ColumnsOfEveryWidth) {
  if (!ember::cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << ember::cuda::unavailable_reason();
  for (Dtype dtype : {kFloat32, kBFloat16, kFloat16, kFloat64, kInt32, kInt64}) {
    for (int64_t N : {1, 7, 200, 6000}) {
      for (int64_t K : {8, 24, 36, 1536}) {
        const Tensor t = grid_tensor({N, K}, dtype, static_cast<uint32_t>(N + K), 1, 0);
        const Tensor wide = grid_tensor({N, K + 16}, dtype, 3);
        const std::vector<std::pair<std::string, Tensor>> views = {
            {"dense", t}, {"column view", wide.narrow(1, 8, K)}, {"unaligned", wide.narrow(1, 1, K)}};
        for (const auto& [name, v] : views) {
          const Tensor g = name == "dense" ? v.cuda() : wide.cuda().narrow(1, name == "unaligned" ? 1 : 8, K);
          const std::string w = name + " " + std::string(dtype_name(dtype)) + " [" +
                                std::to_string(N) + ", " + std::to_string(K) + "]";
          const double tol = is_floating(dtype) ? 4 * tol_for(dtype) : 0;
          expect_same(sum(v, {0}), sum(g, {0}), tol, "sum " + w);
          expect_same(amax(v, {0}), amax(g, {0}), 0, "amax " + w);
          if (is_floating(dtype)) {
            expect_same(mean(v, {0}), mean(g, {0}), tol, "mean " + w);
            if (N > 1) expect_same(var(v, {0}), var(g, {0}), 4 * tol, "var " + w);
            expect_same(norm(v, 2.0, {0}), norm(g, 2.0, {0}), tol, "norm " + w);
          }
        }
      }
    }
  }
}

TEST(ReduceCuda, TopKMatchesCpu) {
  if (!ember::cuda::is_available())
    GTEST_SKIP() << "no CUDA device: " << ember::cuda::unavailable_reason();
  for (Dtype dtype : {kFloat32, kFloat64, kFloat16, kBFloat16, kInt64, kInt32, kUInt8}) {
    for (const auto& [name, t] :
         layouts(dtype, is_floating(dtype) ? 1.0f : 8.0f, dtype == kUInt8 ? 32.0f : 0.0f)) {
      const Tensor g = t.cuda();
      for (int64_t dim : {0, 1, 2}) {
        for (int64_t k : {int64_t{1}, int64_t{3}, t.size(dim)}) {
          for (bool largest : {true, false}) {
            const std::string w = name + " " + std::string(dtype_name(dtype)) + " dim " +
                                  std::to_string(dim) + " k " + std::to_string(k);
            auto [cv, ci] = topk(t, k, dim, largest);
            auto [gv, gi] = topk(g, k, dim, largest);
            expect_same(cv, gv, 0, "topk values " + w);
            expect_same(ci, gi, 0, "topk indices " + w);
          }
        }
      }
    }
  }
  const Tensor nan = from_vector<double>({1, kNaN, 3, kNaN, -kInf, 3}, {6});
  expect_same(topk(nan, 4).second, topk(nan.cuda(), 4).second, 0, "topk NaN");
  expect_same(topk(nan, 4, 0, false).second, topk(nan.cuda(), 4, 0, false).second, 0, "topk NaN");
  const Tensor wide = grid_tensor({3, 50304}, kBFloat16, 7);
  expect_same(topk(wide, 50).second, topk(wide.cuda(), 50).second, 0, "topk wide");
}

TEST(ReduceCuda, LargeAndEdgeCases) {
  if (!ember::cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << ember::cuda::unavailable_reason();
  Tensor big = full({10000000}, 0.1f).cuda();
  EXPECT_NEAR(sum(big).item<float>(), 1e6, 1e3);
  Tensor m = grid_tensor({513, 4099});
  Tensor g = m.cuda();
  expect_same(sum(m, {0}), sum(g, {0}), 1e-4, "sum dim0");
  expect_same(sum(m, {1}), sum(g, {1}), 1e-4, "sum dim1");
  expect_same(argmax(m, 1), argmax(g, 1), 0, "argmax dim1");
  expect_same(argmax(m, 0), argmax(g, 0), 0, "argmax dim0");
  expect_same(softmax(m, 1), softmax(g, 1), 1e-5, "softmax");
  // Tall and narrow: few column tiles, so the reduced rows are split over blocks (two passes).
  Tensor tall = grid_tensor({6000, 37}, kFloat32, 3);
  Tensor tg = tall.cuda();
  expect_same(sum(tall, {0}), sum(tg, {0}), 1e-4, "sum dim0 of tall");
  expect_same(mean(tall, {0}), mean(tg, {0}), 1e-5, "mean dim0 of tall");
  expect_same(amax(tall, {0}), amax(tg, {0}), 0, "amax dim0 of tall");
  expect_same(var(tall, {0}), var(tg, {0}), 1e-4, "var dim0 of tall");
  expect_same(argmax(tall, 0), argmax(tg, 0), 0, "argmax dim0 of tall");
  // Softmax rows longer than a block: -inf entries (some threads see only -inf), a row of -inf
  // only and a row with a NaN (both all NaN, as in torch).
  const float inf = std::numeric_limits<float>::infinity();
  Tensor rows = grid_tensor({4, 3000}, kFloat32, 5);
  rows.select(0, 0).narrow(0, 0, 2000).fill_(-inf);
  rows.select(0, 1).fill_(-inf);
  rows.select(0, 2).narrow(0, 1234, 1).fill_(std::nanf(""));
  for (bool log : {false, true}) {
    const Tensor want = log ? log_softmax(rows, 1) : softmax(rows, 1);
    const Tensor got = (log ? log_softmax(rows.cuda(), 1) : softmax(rows.cuda(), 1)).cpu();
    const std::string what = log ? "log_softmax" : "softmax";
    expect_close(got.select(0, 0), want.select(0, 0).to_vector<double>(), 1e-5, 1e-5, what + " row 0");
    expect_close(got.select(0, 3), want.select(0, 3).to_vector<double>(), 1e-5, 1e-5, what + " row 3");
    for (int r : {1, 2}) {
      for (float v : got.select(0, r).to_vector<float>()) {
        ASSERT_TRUE(std::isnan(v)) << what << " row " << r << " got " << v;
      }
    }
  }
  // The same for rows that the warp kernel holds in registers (D <= 1024), and sizes around
  // its register buckets.
  for (int64_t D : {31, 300, 1024}) {
    Tensor w = grid_tensor({4, D}, kFloat32, 7);
    w.select(0, 0).narrow(0, 0, D / 2).fill_(-inf);
    w.select(0, 1).fill_(-inf);
    w.select(0, 2).narrow(0, D / 3, 1).fill_(std::nanf(""));
    for (bool log : {false, true}) {
      const Tensor want = log ? log_softmax(w, 1) : softmax(w, 1);
      const Tensor got = (log ? log_softmax(w.cuda(), 1) : softmax(w.cuda(), 1)).cpu();
      const std::string what = (log ? "log_softmax D " : "softmax D ") + std::to_string(D);
      expect_close(got.select(0, 0), want.select(0, 0).to_vector<double>(), 1e-5, 1e-5, what + " row 0");
      expect_close(got.select(0, 3), want.select(0, 3).to_vector<double>(), 1e-5, 1e-5, what + " row 3");
      for (int r : {1, 2}) {
        for (float v : got.select(0, r).to_vector<float>()) {
          ASSERT_TRUE(std::isnan(v)) << what << " row " << r << " got " << v;
        }
      }
    }
  }
  expect_same(sum(empty({2, 0}), {1}), sum(empty({2, 0}).cuda(), {1}), 0, "empty sum");
  expect_same(sum(scalar_tensor(2.5f)), sum(scalar_tensor(2.5f).cuda()), 0, "0-dim sum");
  expect_error<IndexError>([] { max(empty({0}).cuda()); }, {"[max]"});
}
