// List operations (tensor/ops/foreach.h): total_norm against the norm of the concatenated values,
// foreach_mul_ against mul_ per tensor; on CUDA the multi-tensor kernels against the CPU, with
// lists long enough to take several launches and a tensor whose chunks straddle two.
#include <ember/tensor/ops/foreach.h>

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/ops.h>
#include "tests/tensor/test_util.h"

namespace ember {
namespace {

using test::expect_close;
using test::expect_error;
using test::rand_t;

constexpr double kInf = std::numeric_limits<double>::infinity();

// The p-norm of every element of `ts`, in double on the host.
double reference_norm(const std::vector<Tensor>& ts, double p) {
  double acc = 0;
  for (const Tensor& t : ts) {
    for (double v : t.to_vector<double>()) {
      acc = std::isinf(p) ? std::max(acc, std::fabs(v)) : acc + std::pow(std::fabs(v), p);
    }
  }
  return std::isinf(p) ? acc : std::pow(acc, 1.0 / p);
}

// Tensors of assorted shapes (an empty one and a scalar among them), in `dtype`.
std::vector<Tensor> assorted(Dtype dtype, uint64_t seed) {
  std::vector<Tensor> ts;
  const std::vector<Shape> shapes = {{3, 4}, {0}, {}, {17}, {2, 3, 5}, {100}};
  for (size_t i = 0; i < shapes.size(); ++i) ts.push_back(rand_t(shapes[i], dtype, seed + i));
  return ts;
}

double tol_for(Dtype d) {
  return d == kFloat64 ? 1e-12 : d == kFloat32 ? 1e-6 : 1e-2;
}

TEST(Foreach, TotalNormIsTheNormOfTheConcatenation) {
  for (Dtype dtype : {kFloat32, kFloat64, kBFloat16}) {
    for (double p : {1.0, 2.0, 3.0, 0.5, kInf}) {
      const std::vector<Tensor> ts = assorted(dtype, 3);
      const Tensor total = total_norm(ts, p);
      EXPECT_EQ(total.dim(), 0);
      EXPECT_EQ(total.dtype(), dtype);
      const std::string what = std::string(dtype_name(dtype)) + " p=" + std::to_string(p);
      expect_close(total, {reference_norm(ts, p)}, tol_for(dtype), what);
    }
  }
  // Mixed dtypes promote; an empty list is a float32 zero; empty tensors add nothing.
  const Tensor mixed = total_norm({rand_t({5}, kFloat32, 1), rand_t({4}, kFloat64, 2)});
  EXPECT_EQ(mixed.dtype(), kFloat64);
  EXPECT_EQ(total_norm({}).item<float>(), 0.0f);
  EXPECT_EQ(total_norm({zeros({0}), zeros({2, 0})}).item<float>(), 0.0f);
}

TEST(Foreach, MulScalesEveryTensorInPlace) {
  std::vector<Tensor> ts = assorted(kFloat32, 5);
  std::vector<Tensor> want;
  for (const Tensor& t : ts) want.push_back(mul(t, 0.25));
  std::vector<int64_t> versions;
  for (const Tensor& t : ts) versions.push_back(t.version());
  foreach_mul_(ts, full({1}, 0.25f));
  for (size_t i = 0; i < ts.size(); ++i) {
    expect_close(ts[i], want[i].to_vector<double>(), 0, "tensor " + std::to_string(i));
    EXPECT_GT(ts[i].version(), versions[i]) << i;
  }
  foreach_mul_({}, full({}, 2.0f));  // nothing to do
}

TEST(Foreach, Errors) {
  const Tensor x = rand_t({3}, kFloat32, 1);
  expect_error([&] { total_norm({x, Tensor()}); }, {"[total_norm]", "tensor 1", "undefined"});
  expect_error([&] { total_norm({x, zeros({2}, kInt64)}); }, {"[total_norm]", "floating", "int64"});
  expect_error([&] { total_norm({x}, 0.0); }, {"[total_norm]", "p > 0", "0"});
  expect_error([&] { total_norm({x}, -kInf); }, {"[total_norm]", "p > 0", "-inf"});
  expect_error([&] { total_norm({x}, std::nan("")); }, {"[total_norm]", "p > 0", "nan"});
  expect_error([&] { foreach_mul_({x}, zeros({2})); }, {"[foreach_mul_]", "one-element", "[2]"});
  expect_error([&] { foreach_mul_({x}, ones({}, kInt64)); }, {"[foreach_mul_]", "floating"});
  expect_error([&] { foreach_mul_({x}, Tensor()); }, {"[foreach_mul_]", "scale"});
  // A tensor that requires grad under grad mode: tests/nn/optim_test.cpp (autograd's layer).
}

// ---- CUDA ------------------------------------------------------------------------------------

// 150 tensors (more than one launch takes) of sizes from 0 to a few chunks, and one of 11 Mi
// elements whose 336 chunks cannot fit one launch's 320 blocks.
std::vector<Tensor> many(Dtype dtype) {
  std::vector<Tensor> ts;
  for (int i = 0; i < 150; ++i) {
    const int64_t n = i % 7 == 0 ? 0 : (i * 7919) % 90001;
    ts.push_back(rand_t({n}, dtype, 100 + i));
    if (i == 75) ts.push_back(rand_t({11 << 20}, dtype, 7));
  }
  return ts;
}

std::vector<Tensor> to_cuda(const std::vector<Tensor>& ts) {
  std::vector<Tensor> out;
  for (const Tensor& t : ts) out.push_back(t.cuda());
  return out;
}

TEST(ForeachCuda, TotalNormMatchesCpuAcrossLaunches) {
  if (!cuda::is_available()) GTEST_SKIP() << cuda::unavailable_reason();
  for (Dtype dtype : {kFloat32, kBFloat16, kFloat16, kFloat64}) {
    const std::vector<Tensor> cpu = many(dtype);
    const std::vector<Tensor> gpu = to_cuda(cpu);
    for (double p : {2.0, 1.0, 3.0, kInf}) {
      const Tensor got = total_norm(gpu, p);
      EXPECT_TRUE(got.is_cuda());
      EXPECT_EQ(got.dtype(), dtype);
      const double want = reference_norm(cpu, p);
      const std::string what = std::string(dtype_name(dtype)) + " p=" + std::to_string(p);
      if (dtype == kFloat16 && want > 65504) {
        // Beyond float16's range (the 1-norm of 11 Mi values): infinite, as the per-tensor
        // norms and PyTorch's are in the tensors' dtype.
        EXPECT_TRUE(std::isinf(got.item<double>())) << what << ": got " << got.item<double>();
        continue;
      }
      expect_close(got.cpu(), {want}, dtype == kFloat64 ? 1e-10 : tol_for(dtype), what);
      // The same value every time: partial results are combined in a fixed order.
      EXPECT_EQ(total_norm(gpu, p).item<double>(), got.item<double>()) << what;
    }
  }
  // A NaN anywhere makes the norm NaN; an infinity makes it infinite.
  std::vector<Tensor> gpu = to_cuda(many(kFloat32));
  gpu[40].narrow(0, 3, 1).fill_(std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isinf(total_norm(gpu).item<float>()));
  gpu[41].narrow(0, 5, 1).fill_(std::nanf(""));
  EXPECT_TRUE(std::isnan(total_norm(gpu).item<float>()));
  EXPECT_TRUE(std::isnan(total_norm(gpu, kInf).item<float>()));
}

TEST(ForeachCuda, MulMatchesCpuAndFallsBackForOtherLayouts) {
  if (!cuda::is_available()) GTEST_SKIP() << cuda::unavailable_reason();
  for (Dtype dtype : {kFloat32, kBFloat16, kFloat64}) {
    std::vector<Tensor> cpu = many(dtype);
    std::vector<Tensor> gpu = to_cuda(cpu);
    const Tensor scale = full({}, 0.3, kFloat32);
    foreach_mul_(gpu, scale.cuda());
    for (size_t i = 0; i < cpu.size(); ++i) {
      cpu[i].mul_(scale.to(dtype == kFloat64 ? kFloat64 : kFloat32));
      expect_close(gpu[i].cpu(), cpu[i].to_vector<double>(), dtype == kBFloat16 ? 1e-2 : 1e-7,
                   std::string(dtype_name(dtype)) + " tensor " + std::to_string(i));
    }
  }
  // A transposed tensor in the list, or a scale on the host: the per-tensor path, same values.
  Tensor m = rand_t({30, 20}, kFloat32, 9).cuda().t();
  Tensor v = rand_t({50}, kFloat32, 10).cuda();
  const Tensor want_m = mul(m, 2.0).cpu(), want_v = mul(v, 2.0).cpu();
  foreach_mul_({m, v}, full({}, 2.0f));
  expect_close(m.cpu(), want_m.to_vector<double>(), 0, "transposed");
  expect_close(v.cpu(), want_v.to_vector<double>(), 0, "dense");
}

}  // namespace
}  // namespace ember
