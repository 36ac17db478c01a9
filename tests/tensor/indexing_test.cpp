// Indexing and joining: index_select, gather, scatter_add(_), index_add_, embedding(_backward),
// one_hot, cat, stack, split, split_with_sizes, chunk. Values are checked against naive loops
// written here and against examples from PyTorch's documentation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/ops.h>
#include "test_util.h"

using ember::test::expect_error;

using namespace ember;

namespace {

// Deterministic test data (a 64-bit LCG; independent of Ember's random module).
std::vector<double> lcg_values(int64_t n, uint64_t seed, int64_t lo, int64_t hi) {
  std::vector<double> v(n);
  uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (auto& x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x = static_cast<double>(lo + static_cast<int64_t>((s >> 33) % static_cast<uint64_t>(hi - lo)));
  }
  return v;
}
Tensor data(IntList shape, Dtype dt = kFloat32, uint64_t seed = 1) {
  // Unsigned and bool dtypes get non-negative values.
  const int64_t lo = dt == kUInt8 || dt == kBool ? 0 : -50;
  return from_vector(lcg_values(Shape(shape).numel(), seed, lo, 50), shape).to(dt);
}
Tensor indices(IntList shape, int64_t bound, uint64_t seed = 2, Dtype dt = kInt64) {
  std::vector<double> v = lcg_values(Shape(shape).numel(), seed, 0, bound);
  std::vector<int64_t> iv(v.begin(), v.end());
  return from_vector(iv, shape).to(dt);
}

void expect_same(const Tensor& got, const std::vector<double>& want, const std::string& what) {
  const std::vector<double> g = got.to_vector<double>();
  ASSERT_EQ(g.size(), want.size()) << what;
  for (size_t i = 0; i < g.size(); ++i) {
    EXPECT_EQ(g[i], want[i]) << what << ": element " << i << " got " << g[i] << " want " << want[i];
  }
}
void expect_same(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  EXPECT_EQ(got.dtype(), want.dtype()) << what;
  expect_same(got, want.to_vector<double>(), what);
}

// Row-major flat offset of a multi-index.
int64_t flat(const Shape& shape, const std::vector<int64_t>& idx) {
  int64_t off = 0;
  for (int64_t d = 0; d < shape.size(); ++d) off = off * shape[d] + idx[d];
  return off;
}
// Calls fn(multi_index) for every element of shape in row-major order.
template <typename F>
void for_each_index(const Shape& shape, F&& fn) {
  const int64_t n = shape.numel();
  std::vector<int64_t> idx(shape.size(), 0);
  for (int64_t i = 0; i < n; ++i) {
    fn(idx);
    for (int64_t d = shape.size() - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}

std::vector<double> naive_gather(const Tensor& t, int64_t dim, const Tensor& index) {
  const auto tv = t.to_vector<double>();
  const auto iv = index.to_vector<int64_t>();
  std::vector<double> out;
  int64_t k = 0;
  for_each_index(index.shape(), [&](std::vector<int64_t> idx) {
    idx[dim] = iv[k++];
    out.push_back(tv[flat(t.shape(), idx)]);
  });
  return out;
}

std::vector<double> naive_scatter_add(const Tensor& self, int64_t dim, const Tensor& index,
                                      const Tensor& src, double alpha = 1) {
  auto out = self.to_vector<double>();
  const auto iv = index.to_vector<int64_t>();
  const auto sv = src.to_vector<double>();
  int64_t k = 0;
  for_each_index(index.shape(), [&](std::vector<int64_t> idx) {
    const double v = sv[flat(src.shape(), idx)];
    idx[dim] = iv[k++];
    out[flat(self.shape(), idx)] += alpha * v;
  });
  return out;
}

const Dtype kAll[] = {kFloat32, kFloat64, kFloat16, kBFloat16, kInt64, kInt32, kUInt8, kBool};

}  // namespace

// ---- index_select -------------------------------------------------------------------------------

TEST(IndexSelect, RowsAndColumnsAllDtypes) {
  const Tensor idx = tensor({2, 0, 2});
  for (Dtype dt : kAll) {
    const Tensor t = arange(12).view({3, 4}).to(dt);
    const std::string what = std::string("dtype ") + std::string(dtype_name(dt));
    const Tensor rows = index_select(t, 0, idx);
    ASSERT_EQ(rows.shape(), Shape({3, 4})) << what;
    EXPECT_EQ(rows.dtype(), dt);
    std::vector<double> want = {8, 9, 10, 11, 0, 1, 2, 3, 8, 9, 10, 11};
    if (dt == kBool) for (auto& w : want) w = w != 0;
    expect_same(rows, want, what + " rows");
    const Tensor cols = index_select(t, -1, idx.to(kInt32));
    want = {2, 0, 2, 6, 4, 6, 10, 8, 10};
    if (dt == kBool) for (auto& w : want) w = w != 0;
    expect_same(cols, want, what + " cols");
  }
}

TEST(IndexSelect, NonContiguousInputsAndIndex) {
  const Tensor t = data({5, 6, 7}).permute({2, 0, 1});  // [7, 5, 6], non-contiguous
  const Tensor idx = indices({8}, 5).slice(0, 0, 8, 2);  // stride 2
  ASSERT_FALSE(t.is_contiguous());
  for (int64_t dim = 0; dim < 3; ++dim) {
    const Tensor i = idx.slice(0, 0, std::min<int64_t>(4, t.size(dim)));
    const Tensor out = index_select(t, dim, i);
    // index_select == gather with the index broadcast along the other dims.
    Shape s = t.shape();
    s[dim] = i.numel();
    Shape v = Shape::filled(3, 1);
    v[dim] = i.numel();
    const Tensor gi = i.view(v).expand(s).contiguous();
    expect_same(out, naive_gather(t, dim, gi), "dim " + std::to_string(dim));
  }
}

TEST(IndexSelect, EmptyAndZeroDimIndex) {
  const Tensor t = arange(12.0, 24.0, 1.0).view({3, 4});
  const Tensor e = index_select(t, 0, zeros({0}, kInt64));
  EXPECT_EQ(e.shape(), Shape({0, 4}));
  const Tensor one = index_select(t, 1, scalar_tensor(3, kInt64));
  EXPECT_EQ(one.shape(), Shape({3, 1}));
  expect_same(one, {15, 19, 23}, "0-d index");
  // torch.index_select(torch.tensor(5.), 0, torch.tensor([0])) is 0-d.
  const Tensor s = index_select(scalar_tensor(5.0, kFloat32), 0, tensor({0}));
  EXPECT_EQ(s.dim(), 0);
  EXPECT_EQ(s.item<float>(), 5.0f);
  const Tensor from_empty = index_select(zeros({0, 3}), 1, tensor({0, 2}));
  EXPECT_EQ(from_empty.shape(), Shape({0, 2}));
}

TEST(IndexSelect, Errors) {
  const Tensor t = zeros({3, 4});
  expect_error<IndexError>([&] { index_select(t, 0, tensor({0, 3})); },
                           {"[index_select]", "index 3", "dimension 0", "size 3"});
  expect_error<IndexError>([&] { index_select(t, 1, tensor({-1})); },
                           {"[index_select]", "index -1", "dimension 1", "size 4"});
  expect_error<TypeError>([&] { index_select(t, 0, tensor({0.f})); },
                          {"[index_select]", "int64", "float32"});
  expect_error<ValueError>([&] { index_select(t, 0, zeros({2, 2}, kInt64)); },
                           {"[index_select]", "[2, 2]"});
  expect_error<IndexError>([&] { index_select(t, 2, tensor({0})); }, {"index_select"});
  expect_error<ValueError>([&] { index_select(Tensor(), 0, tensor({0})); },
                           {"[index_select]", "self"});
}

// ---- gather -------------------------------------------------------------------------------------

TEST(Gather, PyTorchDocExample) {
  // torch.gather(torch.tensor([[1, 2], [3, 4]]), 1, torch.tensor([[0, 0], [1, 0]]))
  //   -> tensor([[1, 1], [4, 3]])
  const Tensor t = tensor({1, 2, 3, 4}).view({2, 2});
  const Tensor out = gather(t, 1, tensor({0, 0, 1, 0}).view({2, 2}));
  EXPECT_EQ(out.dtype(), kInt64);
  expect_same(out, {1, 1, 4, 3}, "doc example");
}

TEST(Gather, MatchesNaiveLoopEveryDimAndLayout) {
  const Tensor base = data({4, 5, 6}, kFloat64);
  for (int64_t dim = -3; dim < 3; ++dim) {
    const int64_t d = (dim + 3) % 3;
    Shape ishape = {3, 4, 5};  // smaller than t off dim
    ishape[d] = 7;             // may exceed t along dim
    const Tensor idx = indices(ishape, base.size(d), 10 + d);
    const std::string what = "dim " + std::to_string(dim);
    expect_same(gather(base, dim, idx), naive_gather(base, d, idx), what);
    // Same through a non-contiguous self and a non-contiguous index.
    const Tensor tt = base.permute({2, 1, 0}).contiguous().permute({2, 1, 0});
    ASSERT_FALSE(tt.is_contiguous());
    const Tensor it = idx.permute({1, 0, 2}).contiguous().permute({1, 0, 2});
    ASSERT_FALSE(it.is_contiguous());
    expect_same(gather(tt, dim, it), naive_gather(base, d, idx), what + " strided");
    // int32 index.
    expect_same(gather(base, dim, idx.to(kInt32)), naive_gather(base, d, idx), what + " int32");
  }
}

TEST(Gather, DtypesEmptyAndScalar) {
  for (Dtype dt : kAll) {
    const Tensor t = data({3, 4}, dt);
    const Tensor idx = indices({3, 6}, 4);
    expect_same(gather(t, 1, idx), naive_gather(t, 1, idx), std::string(dtype_name(dt)));
  }
  EXPECT_EQ(gather(zeros({3, 4}), 0, zeros({0, 4}, kInt64)).shape(), Shape({0, 4}));
  const Tensor s = gather(scalar_tensor(7.0, kFloat32), 0, scalar_tensor(0, kInt64));
  EXPECT_EQ(s.dim(), 0);
  EXPECT_EQ(s.item<float>(), 7.0f);
}

TEST(Gather, Errors) {
  const Tensor t = arange(3);
  // Message as PyTorch's: "index 5 is out of bounds for dimension 0 with size 3".
  expect_error<IndexError>([&] { gather(t, 0, tensor({1, 5})); },
                           {"[gather]", "index 5 is out of bounds for dimension 0 with size 3"});
  expect_error<IndexError>([&] { gather(t, 0, tensor({-1})); },
                           {"[gather]", "index -1 is out of bounds for dimension 0 with size 3"});
  expect_error<TypeError>([&] { gather(t, 0, tensor({true})); }, {"[gather]", "bool"});
  expect_error<ValueError>([&] { gather(zeros({2, 3}), 0, zeros({2}, kInt64)); },
                           {"[gather]", "[2, 3]", "[2]"});
  expect_error<ValueError>([&] { gather(zeros({2, 3}), 0, zeros({2, 4}, kInt64)); },
                           {"[gather]", "[2, 4]", "[2, 3]"});
}

// ---- scatter_add / index_add_ -------------------------------------------------------------------

TEST(ScatterAdd, PyTorchDocExample) {
  // torch.zeros(3, 5).scatter_add_(0, torch.tensor([[0, 1, 2, 0, 0], [2, 0, 0, 1, 2]]),
  //                                torch.ones(2, 5))
  Tensor self = zeros({3, 5});
  const Tensor index = tensor({0, 1, 2, 0, 0, 2, 0, 0, 1, 2}).view({2, 5});
  const uint32_t v0 = self.version();
  scatter_add_(self, 0, index, ones({2, 5}));
  EXPECT_GT(self.version(), v0);
  expect_same(self, {1, 1, 1, 1, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1}, "doc example");
}

TEST(ScatterAdd, MatchesNaiveLoopEveryDimDtypeAndLayout) {
  const Dtype dtypes[] = {kFloat32, kFloat64, kFloat16, kBFloat16, kInt64, kInt32, kUInt8};
  for (Dtype dt : dtypes) {
    for (int64_t dim = -3; dim < 3; ++dim) {
      const int64_t d = (dim + 3) % 3;
      const std::string what = std::string(dtype_name(dt)) + " dim " + std::to_string(dim);
      const Tensor self = data({4, 5, 6}, dt);
      Shape ishape = {3, 4, 5};
      ishape[d] = 9;  // many collisions along dim
      const Tensor idx = indices(ishape, self.size(d), 20 + d);
      const Tensor src = data({9, 9, 9}, dt);
      std::vector<double> want = naive_scatter_add(self, d, idx, src);
      if (dt == kUInt8) for (auto& w : want) w = static_cast<uint8_t>(static_cast<int64_t>(w));
      const Tensor before = self.clone();
      const Tensor out = scatter_add(self, dim, idx, src);
      if (dt == kFloat16 || dt == kBFloat16) {
        // Partial sums round to the 16-bit type, so allow a few units in the last place.
        const auto g = out.to_vector<double>();
        for (size_t i = 0; i < g.size(); ++i) {
          EXPECT_NEAR(g[i], want[i], std::abs(want[i]) * (dt == kBFloat16 ? 1.0 / 64 : 1.0 / 512))
              << what << " element " << i;
        }
      } else {
        expect_same(out, want, what);
      }
      expect_same(self, before, what + " (functional form leaves self alone)");
    }
  }
}

TEST(ScatterAdd, StridedSelfSrcAndIndex) {
  Tensor base = zeros({6, 4}, kFloat64);
  Tensor self = base.t();  // [4, 6] view, non-contiguous
  const Tensor src = data({6, 8}, kFloat64).t();  // [8, 6]
  const Tensor idx = indices({6, 5}, 4).t();  // [5, 6]
  const std::vector<double> want = naive_scatter_add(zeros({4, 6}, kFloat64), 0, idx, src);
  scatter_add_(self, 0, idx, src);
  expect_same(self, want, "through a transposed view");
  expect_same(base.t(), want, "base sees the writes");
}

TEST(ScatterAdd, SameResultWithOneOrTwoThreadsAsGather) {
  // 70000 positions off the scatter dim: enough for the parallel path.
  const Tensor src = data({8, 70000}, kFloat32);
  const Tensor idx = indices({8, 70000}, 16);
  const int saved = get_num_threads();
  set_num_threads(1);
  const Tensor a = scatter_add(zeros({16, 70000}), 0, idx, src);
  set_num_threads(2);
  const Tensor b = scatter_add(zeros({16, 70000}), 0, idx, src);
  const Tensor ga = gather(a, 0, idx);
  set_num_threads(1);
  const Tensor gb = gather(a, 0, idx);
  set_num_threads(saved);
  expect_same(a, b, "scatter_add threads");
  expect_same(a, naive_scatter_add(zeros({16, 70000}), 0, idx, src), "naive");
  expect_same(ga, gb, "gather threads");
}

TEST(ScatterAdd, Errors) {
  Tensor self = zeros({3, 4});
  expect_error<IndexError>([&] { scatter_add_(self, 0, tensor({3}).view({1, 1}), ones({1, 1})); },
                           {"[scatter_add_]", "index 3 is out of bounds for dimension 0 with size 3"});
  expect_error<IndexError>([&] { scatter_add(self, 1, tensor({-2}).view({1, 1}), ones({1, 1})); },
                           {"[scatter_add]", "index -2", "dimension 1", "size 4"});
  expect_error<TypeError>([&] { scatter_add_(self, 0, zeros({1, 1}, kInt64), ones({1, 1}, kFloat64)); },
                          {"[scatter_add_]", "float32", "float64"});
  expect_error<TypeError>([&] { scatter_add_(self, 0, zeros({1, 1}), ones({1, 1})); },
                          {"[scatter_add_]", "int64", "float32"});
  expect_error<ValueError>([&] { scatter_add_(self, 0, zeros({2, 2}, kInt64), ones({1, 2})); },
                           {"[scatter_add_]", "[2, 2]", "[1, 2]"});
  Tensor b = zeros({2}, kBool);
  expect_error<TypeError>([&] { scatter_add_(b, 0, zeros({1}, kInt64), ones({1}, kBool)); },
                          {"scatter_add_", "bool"});
}

TEST(IndexAdd, MatchesNaiveLoopWithAlpha) {
  for (int64_t dim : {0, 1, -1}) {
    const int64_t d = (dim + 2) % 2;
    Tensor self = data({5, 6}, kFloat64, 3);
    Shape sshape = {5, 6};
    sshape[d] = 8;
    const Tensor src = data(sshape, kFloat64, 4);
    const Tensor idx = indices({8}, self.size(d), 5);
    // index_add_ == scatter_add_ with the index broadcast along the other dims.
    Shape v = {1, 1};
    v[d] = 8;
    const Tensor full_idx = idx.view(v).expand(sshape).contiguous();
    const std::vector<double> want = naive_scatter_add(self, d, full_idx, src, 2.5);
    const uint32_t v0 = self.version();
    index_add_(self, dim, idx, src, 2.5);
    EXPECT_GT(self.version(), v0);
    expect_same(self, want, "dim " + std::to_string(dim));
  }
}

TEST(IndexAdd, IntegralAndStrided) {
  Tensor self = zeros({4, 3}, kInt32);
  Tensor view = self.t();  // [3, 4]
  const Tensor src = arange(1, 7).view({2, 3}).to(kInt32).t();  // [3, 2], strided
  const Tensor idx = tensor({3, 3, 1, 0}).slice(0, 0, 4, 2);   // [3, 1], strided
  index_add_(view, 1, idx, src);
  // view[:, 3] += src[:, 0] = [1, 2, 3]; view[:, 1] += src[:, 1] = [4, 5, 6]
  expect_same(self, {0, 0, 0, 4, 5, 6, 0, 0, 0, 1, 2, 3}, "int32 through views");
  expect_error<TypeError>([&] { index_add_(self, 0, tensor({0}), ones({1, 3}, kInt32), 0.5); },
                          {"[index_add_]", "alpha"});
  expect_error<ValueError>([&] { index_add_(self, 0, tensor({0, 1}), ones({3, 3}, kInt32)); },
                           {"[index_add_]", "[3, 3]"});
  expect_error<IndexError>([&] { index_add_(self, 0, tensor({4}), ones({1, 3}, kInt32)); },
                           {"[index_add_]", "index 4", "size 4"});
}

// ---- embedding ----------------------------------------------------------------------------------

TEST(Embedding, ForwardAndBackward) {
  const Tensor weight = arange(0.0, 15.0, 1.0).view({5, 3});
  const Tensor ids = tensor({4, 0, 4, 1, 2, 4}).view({2, 3});
  const Tensor out = embedding(weight, ids);
  ASSERT_EQ(out.shape(), Shape({2, 3, 3}));
  expect_same(out, {12, 13, 14, 0, 1, 2, 12, 13, 14, 3, 4, 5, 6, 7, 8, 12, 13, 14}, "forward");
  EXPECT_EQ(embedding(weight, scalar_tensor(2, kInt64)).shape(), Shape({3}));
  EXPECT_EQ(embedding(weight, zeros({0}, kInt32)).shape(), Shape({0, 3}));

  const Tensor grad = arange(1.0, 19.0, 1.0).view({2, 3, 3});
  const Tensor gw = embedding_backward(grad, ids, 5);
  ASSERT_EQ(gw.shape(), Shape({5, 3}));
  // Row 4 gets grad rows 0, 2 and 5: [1+7+16, 2+8+17, 3+9+18]; row 3 gets nothing.
  expect_same(gw, {4, 5, 6, 10, 11, 12, 13, 14, 15, 0, 0, 0, 24, 27, 30}, "backward");
  // Non-contiguous grad and ids.
  const Tensor gt = grad.permute({1, 0, 2}).contiguous().permute({1, 0, 2});
  expect_same(embedding_backward(gt, ids.t().contiguous().t(), 5), gw, "strided backward");
}

// A row hit many times sums its gradients in float32 and rounds once: 1024 bfloat16 ones (and
// 4096 float16 ones) into one row are 1024 (4096), not the 256 (2048) where adding 1 to a
// 16-bit running sum stops changing it.
void expect_reduced_precision_sums_in_float32(Device dev) {
  for (const auto& [dtype, n] : {std::pair{kBFloat16, 1024}, std::pair{kFloat16, 4096}}) {
    const Tensor grad = ones({n, 2}, TensorOptions(dtype).device(dev));
    const Tensor gw = embedding_backward(grad, zeros({n}, TensorOptions(kInt64).device(dev)), 3);
    EXPECT_EQ(gw.dtype(), dtype);
    EXPECT_EQ(gw.cpu().to(kFloat64).to_vector<double>(),
              (std::vector<double>{double(n), double(n), 0, 0, 0, 0}))
        << dtype << " on " << dev.str();
  }
}

TEST(Embedding, ReducedPrecisionGradientsSumInFloat32) {
  expect_reduced_precision_sums_in_float32(kCPU);
}

TEST(EmbeddingCuda, ReducedPrecisionGradientsSumInFloat32) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  expect_reduced_precision_sums_in_float32(cuda_device(0));
}

TEST(Embedding, Errors) {
  const Tensor weight = zeros({5, 3});
  expect_error<IndexError>([&] { embedding(weight, tensor({5})); },
                           {"[embedding]", "index 5", "size 5"});
  expect_error<ValueError>([&] { embedding(zeros({5}), tensor({0})); }, {"[embedding]", "[5]"});
  expect_error<TypeError>([&] { embedding(weight, tensor({0.f})); }, {"[embedding]", "float32"});
  expect_error<ValueError>([&] { embedding_backward(zeros({2, 3}), tensor({0, 1, 2}), 5); },
                           {"[embedding_backward]", "[2, 3]", "[3]"});
  expect_error<IndexError>([&] { embedding_backward(zeros({1, 3}), tensor({7}), 5); },
                           {"[embedding_backward]", "index 7", "size 5"});
}

// ---- one_hot ------------------------------------------------------------------------------------

TEST(OneHot, PyTorchDocExamples) {
  // F.one_hot(torch.arange(0, 5) % 3) -> [[1,0,0],[0,1,0],[0,0,1],[1,0,0],[0,1,0]]
  const Tensor t = tensor({0, 1, 2, 0, 1});
  const Tensor a = one_hot(t);
  EXPECT_EQ(a.dtype(), kInt64);
  ASSERT_EQ(a.shape(), Shape({5, 3}));
  expect_same(a, {1, 0, 0, 0, 1, 0, 0, 0, 1, 1, 0, 0, 0, 1, 0}, "inferred");
  const Tensor b = one_hot(t.view({5, 1}).to(kInt32), 5);
  ASSERT_EQ(b.shape(), Shape({5, 1, 5}));
  const auto bv = b.to_vector<int64_t>();
  EXPECT_EQ(std::count(bv.begin(), bv.end(), 1), 5);
  EXPECT_EQ(bv[0 * 5 + 0], 1);
  EXPECT_EQ(bv[2 * 5 + 2], 1);
  EXPECT_EQ(one_hot(zeros({0}, kInt64), 3).shape(), Shape({0, 3}));
}

TEST(OneHot, Errors) {
  expect_error<ValueError>([] { one_hot(zeros({0}, kInt64)); }, {"[one_hot]", "empty"});
  expect_error<IndexError>([] { one_hot(tensor({0, 3}), 3); }, {"[one_hot]", "3", "size 3"});
  expect_error<IndexError>([] { one_hot(tensor({-1, 0})); }, {"[one_hot]", "-1"});
  expect_error<TypeError>([] { one_hot(tensor({0.f})); }, {"[one_hot]", "float32"});
}

// ---- cat / stack --------------------------------------------------------------------------------

TEST(Cat, AlongEveryDim) {
  const Tensor a = arange(0, 6).view({2, 3});
  const Tensor b = arange(6, 12).view({2, 3});
  expect_same(cat({a, b}), {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, "dim 0");
  const Tensor c1 = cat({a, b.slice(1, 0, 2)}, -1);
  ASSERT_EQ(c1.shape(), Shape({2, 5}));
  expect_same(c1, {0, 1, 2, 6, 7, 3, 4, 5, 9, 10}, "dim -1");
  // Non-contiguous inputs.
  const Tensor c2 = cat({a.t(), b.t()}, 1);
  ASSERT_EQ(c2.shape(), Shape({3, 4}));
  expect_same(c2, {0, 3, 6, 9, 1, 4, 7, 10, 2, 5, 8, 11}, "transposed");
  // Zero-size along the cat dim and a single input.
  expect_same(cat({a, zeros({0, 3}, kInt64), b}), cat({a, b}), "0-size part");
  expect_same(cat({a}), a, "one input");
  EXPECT_FALSE(cat({a}).is_same(a));
}

TEST(Cat, PromotesDtypesAndSkipsLegacyEmpty) {
  const Tensor i = tensor({1, 2}).to(kInt32);
  const Tensor h = tensor({0.5f}).to(kFloat16);
  const Tensor c = cat({i, h});
  EXPECT_EQ(c.dtype(), kFloat16);
  expect_same(c, {1, 2, 0.5}, "int32 + float16");
  EXPECT_EQ(cat({tensor({true}), tensor({3}).to(kUInt8)}).dtype(), kUInt8);
  EXPECT_EQ(cat({h, tensor({1.f}).to(kBFloat16)}).dtype(), kFloat32);
  // Legacy: 1-d tensors of shape [0] are skipped whatever the other shapes, but still promote
  // (torch.cat([torch.zeros(0, dtype=torch.float64), torch.ones(2, 3, dtype=torch.int32)])
  // is float64 of shape [2, 3]).
  const Tensor m = ones({2, 3}, kInt32);
  const Tensor l = cat({zeros({0}, kFloat64), m, zeros({0}, kFloat64)}, 1);
  EXPECT_EQ(l.dtype(), kFloat64);
  expect_same(l, {1, 1, 1, 1, 1, 1}, "legacy skip");
  const Tensor all_empty = cat({zeros({0}), zeros({0}, kInt64)});
  EXPECT_EQ(all_empty.shape(), Shape({0}));
  EXPECT_EQ(all_empty.dtype(), kFloat32);
}

TEST(Cat, Errors) {
  expect_error<ValueError>([] { cat({}); }, {"[cat]", "empty"});
  expect_error<ValueError>([] { cat({zeros({2, 3}), zeros({2, 3}), zeros({2, 4})}); },
                           {"[cat]", "tensor 2", "[2, 4]", "[2, 3]", "dim 0"});
  expect_error<ValueError>([] { cat({zeros({2, 3}), zeros({3})}); },
                           {"[cat]", "tensor 1", "[3]", "[2, 3]"});
  expect_error<ValueError>([] { cat({scalar_tensor(1.0)}); }, {"[cat]", "zero-dim"});
  expect_error<IndexError>([] { cat({zeros({2, 3})}, 2); }, {"cat"});
  expect_error<ValueError>([] { cat({zeros({2}), Tensor()}); }, {"[cat]", "tensors[1]"});
}

TEST(Stack, NewDimAnywhere) {
  const Tensor a = arange(0, 6).view({2, 3});
  const Tensor b = arange(6, 12).view({2, 3});
  const Tensor s0 = stack({a, b});
  ASSERT_EQ(s0.shape(), Shape({2, 2, 3}));
  expect_same(s0, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, "dim 0");
  const Tensor s2 = stack({a, b}, -1);
  ASSERT_EQ(s2.shape(), Shape({2, 3, 2}));
  expect_same(s2, {0, 6, 1, 7, 2, 8, 3, 9, 4, 10, 5, 11}, "dim -1");
  const Tensor s1 = stack({a, b.t().contiguous().t()}, 1);
  ASSERT_EQ(s1.shape(), Shape({2, 2, 3}));
  expect_same(s1, {0, 1, 2, 6, 7, 8, 3, 4, 5, 9, 10, 11}, "dim 1");
  EXPECT_EQ(stack({zeros({0}), zeros({0})}).shape(), Shape({2, 0}));
  expect_error<ValueError>([&] { stack({a, b, zeros({2, 4})}); },
                           {"[stack]", "[2, 3]", "position 0", "[2, 4]", "position 2"});
  expect_error<ValueError>([] { stack({}); }, {"[stack]"});
}

// ---- split / chunk ------------------------------------------------------------------------------

std::vector<int64_t> sizes_of(const std::vector<Tensor>& parts, int64_t dim) {
  std::vector<int64_t> s;
  for (const Tensor& p : parts) s.push_back(p.size(dim));
  return s;
}

TEST(Split, ViewsOfTheRightSizes) {
  Tensor t = arange(0, 14).view({7, 2});
  const auto parts = split(t, 3);
  EXPECT_EQ(sizes_of(parts, 0), (std::vector<int64_t>{3, 3, 1}));
  expect_same(parts[2], {12, 13}, "last");
  // Views: writes show through.
  Tensor p1 = parts[1];
  p1.fill_(-1);
  EXPECT_EQ(t.to_vector<int64_t>()[6], -1);
  EXPECT_EQ(sizes_of(split(t, 1, -1), 1), (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(sizes_of(split(t, 10), 0), (std::vector<int64_t>{7}));
  EXPECT_EQ(sizes_of(split(zeros({0, 2}), 2), 0), (std::vector<int64_t>{0}));
  EXPECT_EQ(sizes_of(split(zeros({0, 2}), 0), 0), (std::vector<int64_t>{0}));
  const auto ws = split_with_sizes(t, {2, 0, 5});
  EXPECT_EQ(sizes_of(ws, 0), (std::vector<int64_t>{2, 0, 5}));
  EXPECT_EQ(ws[2].storage(), t.storage());
  expect_error<ValueError>([&] { split(t, 0); }, {"[split]", "size 7"});
  expect_error<ValueError>([&] { split(t, -1); }, {"[split]", "-1"});
  expect_error<ValueError>([&] { split_with_sizes(t, {2, 2}); },
                           {"[split_with_sizes]", "[2, 2]", "4", "7"});
}

TEST(Chunk, MatchesTorchChunk) {
  // torch.chunk(torch.arange(5), 3) -> sizes [2, 2, 1]; torch.chunk(torch.arange(6), 4) ->
  // [2, 2, 2]; torch.chunk(torch.arange(3), 5) -> [1, 1, 1]; torch.chunk(torch.empty(0), 3) ->
  // three empty tensors.
  EXPECT_EQ(sizes_of(chunk(arange(5), 3), 0), (std::vector<int64_t>{2, 2, 1}));
  EXPECT_EQ(sizes_of(chunk(arange(6), 4), 0), (std::vector<int64_t>{2, 2, 2}));
  EXPECT_EQ(sizes_of(chunk(arange(3), 5), 0), (std::vector<int64_t>{1, 1, 1}));
  EXPECT_EQ(sizes_of(chunk(zeros({0}), 3), 0), (std::vector<int64_t>{0, 0, 0}));
  const auto c = chunk(arange(0, 12).view({3, 4}).t(), 2, 1);  // [4, 3], non-contiguous
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[0].shape(), Shape({4, 2}));
  expect_same(c[0], {0, 4, 1, 5, 2, 6, 3, 7}, "chunk 0 of transposed");
  expect_same(c[1], {8, 9, 10, 11}, "chunk 1 of transposed");
  expect_error<ValueError>([] { chunk(arange(4), 0); }, {"[chunk]", "0"});
  expect_error<ValueError>([] { chunk(arange(4), -2); }, {"[chunk]", "-2"});
}

// ---- CUDA == CPU --------------------------------------------------------------------------------

TEST(IndexingCuda, MatchesCpu) {
  if (!ember::cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << ember::cuda::unavailable_reason();
  const Device dev("cuda");
  const Tensor t = data({7, 9, 5}, kFloat32);
  for (int64_t dim = 0; dim < 3; ++dim) {
    Shape ishape = {5, 6, 4};
    ishape[dim] = 11;
    const Tensor idx = indices(ishape, t.size(dim), 30 + dim);
    expect_same(gather(t.to(dev), dim, idx.to(dev)), gather(t, dim, idx), "gather");
    const Tensor sel = indices({6}, t.size(dim), 40 + dim, kInt32);
    // A non-contiguous input (dims 0 and 2 swapped in memory).
    const Tensor strided = t.transpose(0, 2).contiguous().transpose(0, 2);
    expect_same(index_select(strided.to(dev), dim, sel.to(dev)), index_select(strided, dim, sel),
                "index_select");
    for (Dtype dt : {kFloat32, kFloat64, kInt64, kInt32}) {
      const Tensor self = data({7, 9, 5}, dt);
      const Tensor src = data({11, 11, 11}, dt);
      expect_same(scatter_add(self.to(dev), dim, idx.to(dev), src.to(dev)),
                  scatter_add(self, dim, idx, src), "scatter_add " + std::string(dtype_name(dt)));
    }
  }
  // Half/BFloat16 atomics, on values whose sums are exact.
  for (Dtype dt : {kFloat16, kBFloat16}) {
    const Tensor idx = indices({8, 3}, 4);
    Tensor a = zeros({4, 3}, dt);
    Tensor b = a.to(dev);
    scatter_add_(a, 0, idx, ones({8, 3}, dt));
    scatter_add_(b, 0, idx.to(dev), ones({8, 3}, dt).to(dev));
    expect_same(b, a, "scatter_add " + std::string(dtype_name(dt)));
  }
  Tensor w = data({10, 16}, kFloat32);
  const Tensor ids = indices({3, 4}, 10);
  expect_same(embedding(w.to(dev), ids.to(dev)), embedding(w, ids), "embedding");
  Tensor g = data({3, 4, 16}, kFloat32);
  expect_same(embedding_backward(g.to(dev), ids.to(dev), 10), embedding_backward(g, ids, 10),
              "embedding_backward");
  expect_same(one_hot(ids.to(dev)), one_hot(ids), "one_hot");
  Tensor s = data({10, 16}, kFloat64);
  Tensor sd = s.to(dev);
  index_add_(s, 0, tensor({1, 1, 9}), ones({3, 16}, kFloat64), 2);
  index_add_(sd, 0, tensor({1, 1, 9}).to(dev), ones({3, 16}, kFloat64).to(dev), 2);
  expect_same(sd, s, "index_add_");
  expect_same(cat({w.to(dev), w.to(dev).to(kFloat64)}, 1), cat({w, w.to(kFloat64)}, 1), "cat");
  // Bounds checked on the device, reported like the CPU by the next index op once the device
  // got there (Note [CUDA index checks]).
  const Tensor good = arange(3).to(dev);
  auto then_next = [&](const std::function<void()>& bad) {
    return [&, bad] {
      bad();
      ember::cuda::synchronize();
      gather(good, 0, tensor({0}).to(dev));
    };
  };
  expect_error<IndexError>(then_next([&] { gather(good, 0, tensor({1, 5}).to(dev)); }),
                           {"[gather]", "index 5 is out of bounds for dimension 0 with size 3"});
  Tensor z = zeros({3}).to(dev);
  expect_error<IndexError>(
      then_next([&] { scatter_add_(z, 0, tensor({-1}).to(dev), ones({1}).to(dev)); }),
      {"[scatter_add_]", "index -1", "size 3"});
  expect_error<IndexError>(then_next([&] { embedding(w.to(dev), tensor({10}).to(dev)); }),
                           {"[embedding]", "index 10", "size 10"});
}

// gather and scatter_add (cross_entropy's forward and backward) queue their bounds checks
// instead of waiting for the device: they return while a spin queued before them still runs.
TEST(IndexingCuda, BoundsChecksDoNotWaitForTheDevice) {
  if (!ember::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device: " << ember::cuda::unavailable_reason();
  }
  const Device dev("cuda");
  const Tensor src = arange(6).to(kFloat32).to(dev);
  const Tensor idx = tensor({5, 0, 2}).to(dev);
  Tensor acc = zeros({6}).to(dev);
  // The checks' first pinned host slots come from cudaHostAlloc, which waits for the device
  // (once per process): take them before the spin, as any earlier training step would have.
  Tensor warm = zeros({6}).to(dev);
  scatter_add_(warm, 0, idx, gather(src, 0, idx));
  ember::cuda::synchronize();
  ember::cuda::spin(4'000'000'000);  // about 2 s on a 2 GHz GPU
  ember::cuda::Event spun;
  spun.record();
  const Tensor picked = gather(src, 0, idx);
  scatter_add_(acc, 0, idx, picked);
  EXPECT_FALSE(spun.query()) << "gather or scatter_add_ waited for the device";
  EXPECT_EQ(picked.cpu().to_vector<float>(), (std::vector<float>{5, 0, 2}));
  EXPECT_EQ(acc.cpu().to_vector<float>(), (std::vector<float>{0, 0, 2, 0, 0, 5}));
}
