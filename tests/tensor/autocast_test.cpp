// Autocast (tensor/autocast.h): the per-op policy of the tensor ops (output dtypes), the guard's
// scoping (nested, disabled, per device type, per thread), the dtypes it accepts, and values
// against the same op run on explicitly cast inputs. Gradients and the cast cache need the
// autograd library: tests/nn/autocast_test.cpp.
#include <ember/tensor/autocast.h>

#include <gtest/gtest.h>

#include <thread>

#include <ember/tensor/ops.h>
#include "test_util.h"

using ember::test::expect_error;
using ember::test::rand_t;

using namespace ember;

namespace {

Tensor f32(IntList shape, uint64_t seed) { return rand_t(shape, kFloat32, seed); }

TEST(Autocast, OffByDefaultWithTorchsDefaultDtypes) {
  EXPECT_FALSE(is_autocast_enabled(kCPU));
  EXPECT_FALSE(is_autocast_enabled(cuda_device()));
  EXPECT_EQ(get_autocast_dtype(kCPU), kBFloat16);
  EXPECT_EQ(get_autocast_dtype(cuda_device()), kFloat16);
  EXPECT_TRUE(is_autocast_cache_enabled());
  EXPECT_EQ(matmul(f32({2, 3}, 1), f32({3, 4}, 2)).dtype(), kFloat32);
}

TEST(Autocast, LowPrecisionOps) {
  AutocastGuard amp(kCPU, kBFloat16);
  const Tensor a = f32({2, 3}, 1), b = f32({3, 4}, 2), bias = f32({4}, 3);
  EXPECT_EQ(matmul(a, b).dtype(), kBFloat16);
  EXPECT_EQ(mm(a, b).dtype(), kBFloat16);
  EXPECT_EQ(bmm(f32({2, 2, 3}, 4), f32({2, 3, 4}, 5)).dtype(), kBFloat16);
  EXPECT_EQ(addmm(bias, a, b).dtype(), kBFloat16);
  EXPECT_EQ(matmul(f32({5, 2, 3}, 6), b).dtype(), kBFloat16);  // the folded batched path
  // Inputs of mixed dtypes are all cast, so ops that require equal dtypes accept them.
  EXPECT_EQ(mm(a.to(kFloat16), b).dtype(), kBFloat16);
  const Tensor x = f32({1, 2, 5, 5}, 7), w = f32({3, 2, 3, 3}, 8);
  EXPECT_EQ(conv2d(x, w, f32({3}, 9), {}).dtype(), kBFloat16);
  EXPECT_EQ(conv2d(x, w, Tensor(), {}).dtype(), kBFloat16);
}

TEST(Autocast, LowPrecisionValuesEqualExplicitCasts) {
  const Tensor a = f32({7, 5}, 1), b = f32({5, 3}, 2), bias = f32({3}, 3);
  const Tensor want = addmm(bias.to(kBFloat16), a.to(kBFloat16), b.to(kBFloat16));
  Tensor got;
  {
    AutocastGuard amp(kCPU);
    got = addmm(bias, a, b);
  }
  EXPECT_EQ(got.to_vector<float>(), want.to_vector<float>());
}

TEST(Autocast, Float32Ops) {
  AutocastGuard amp(kCPU, kBFloat16);
  const Tensor h = f32({3, 4}, 1).to(kBFloat16);
  EXPECT_EQ(softmax(h, 1).dtype(), kFloat32);
  EXPECT_EQ(log_softmax(h, 1).dtype(), kFloat32);
  EXPECT_EQ(sum(h).dtype(), kFloat32);
  EXPECT_EQ(sum(h, {1}).dtype(), kFloat32);
  EXPECT_EQ(mean(h).dtype(), kFloat32);
  EXPECT_EQ(prod(h, {1}).dtype(), kFloat32);
  EXPECT_EQ(norm(h).dtype(), kFloat32);
  EXPECT_EQ(exp(h).dtype(), kFloat32);
  EXPECT_EQ(log(h).dtype(), kFloat32);
  EXPECT_EQ(log1p(h).dtype(), kFloat32);
  EXPECT_EQ(rsqrt(h).dtype(), kFloat32);
  EXPECT_EQ(reciprocal(h).dtype(), kFloat32);
  EXPECT_EQ(pow(h, 3).dtype(), kFloat32);
  EXPECT_EQ(pow(h, h).dtype(), kFloat32);
  EXPECT_EQ(pow(2, h).dtype(), kFloat32);
  // An explicit dtype opts out, as in torch.
  EXPECT_EQ(sum(h, {}, false, kBFloat16).dtype(), kBFloat16);
  // The float32 result equals the op on the upcast input.
  EXPECT_EQ(softmax(h, 1).to_vector<float>(), softmax(h.to(kFloat32), 1).to_vector<float>());
}

TEST(Autocast, OtherOpsFollowTheirInputs) {
  AutocastGuard amp(kCPU);
  const Tensor h = f32({4}, 1).to(kBFloat16), s = f32({4}, 2);
  EXPECT_EQ(relu(h).dtype(), kBFloat16);
  EXPECT_EQ(gelu(h).dtype(), kBFloat16);
  EXPECT_EQ((h * h).dtype(), kBFloat16);
  EXPECT_EQ((h + s).dtype(), kFloat32);  // ordinary type promotion
  EXPECT_EQ(relu(s).dtype(), kFloat32);
}

TEST(Autocast, Float64AndIntegersAreNotCast) {
  AutocastGuard amp(kCPU);
  const Tensor d = f32({2, 2}, 1).to(kFloat64);
  EXPECT_EQ(mm(d, d).dtype(), kFloat64);
  EXPECT_EQ(softmax(d, 0).dtype(), kFloat64);
  EXPECT_EQ(sum(arange(0, 4)).dtype(), kInt64);
}

TEST(Autocast, NestedAndDisabledScopesRestore) {
  const Tensor a = f32({2, 2}, 1);
  {
    AutocastGuard outer(kCPU);
    EXPECT_TRUE(is_autocast_enabled(kCPU));
    {
      AutocastGuard off(kCPU, std::nullopt, /*enabled=*/false);
      EXPECT_FALSE(is_autocast_enabled(kCPU));
      EXPECT_EQ(mm(a, a).dtype(), kFloat32);
      {
        AutocastGuard inner(kCPU);
        EXPECT_EQ(mm(a, a).dtype(), kBFloat16);
      }
      EXPECT_EQ(mm(a, a).dtype(), kFloat32);
    }
    EXPECT_TRUE(is_autocast_enabled(kCPU));
    EXPECT_EQ(mm(a, a).dtype(), kBFloat16);
  }
  EXPECT_FALSE(is_autocast_enabled(kCPU));
  EXPECT_EQ(mm(a, a).dtype(), kFloat32);
}

TEST(Autocast, DeviceTypesAreIndependent) {
  const Tensor a = f32({2, 2}, 1);
  {
    AutocastGuard cuda_amp(cuda_device(), kBFloat16);
    EXPECT_TRUE(is_autocast_enabled(cuda_device()));
    EXPECT_EQ(get_autocast_dtype(cuda_device()), kBFloat16);
    EXPECT_FALSE(is_autocast_enabled(kCPU));
    EXPECT_EQ(mm(a, a).dtype(), kFloat32);  // CPU ops ignore CUDA autocast
  }
  EXPECT_EQ(get_autocast_dtype(cuda_device()), kFloat16);  // restored
  AutocastGuard cpu_amp(kCPU);
  EXPECT_FALSE(is_autocast_enabled(cuda_device()));
}

TEST(Autocast, UnsupportedDtypesAreRefusedAndLeaveTheStateAlone) {
  expect_error([] { AutocastGuard g(kCPU, kFloat16); }, {"[autocast]", "bfloat16", "float16"});
  expect_error([] { AutocastGuard g(kCPU, kFloat32); }, {"[autocast]", "float32"});
  expect_error([] { AutocastGuard g(cuda_device(), kFloat64); }, {"CUDA", "float64"});
  EXPECT_FALSE(is_autocast_enabled(kCPU));
  EXPECT_EQ(get_autocast_dtype(kCPU), kBFloat16);
  {
    AutocastGuard off(kCPU, kFloat16, /*enabled=*/false);  // casts nothing: accepted
    EXPECT_EQ(mm(f32({2, 2}, 1), f32({2, 2}, 2)).dtype(), kFloat32);
    expect_error([] { AutocastGuard on(kCPU); }, {"[autocast]", "float16"});  // inherits it
  }
  EXPECT_EQ(get_autocast_dtype(kCPU), kBFloat16);
}

TEST(Autocast, StateIsThreadLocal) {
  AutocastGuard amp(kCPU);
  const Tensor a = f32({2, 2}, 1);
  bool other_enabled = true;
  Dtype other_dtype = kBFloat16;
  std::thread t([&] {
    other_enabled = is_autocast_enabled(kCPU);
    other_dtype = mm(a, a).dtype();
  });
  t.join();
  EXPECT_FALSE(other_enabled);
  EXPECT_EQ(other_dtype, kFloat32);
  EXPECT_EQ(mm(a, a).dtype(), kBFloat16);
}

TEST(Autocast, ZeroSizedInputs) {
  AutocastGuard amp(kCPU);
  EXPECT_EQ(mm(f32({0, 3}, 1), f32({3, 2}, 2)).dtype(), kBFloat16);
  EXPECT_EQ(sum(f32({0}, 1).to(kBFloat16)).item<float>(), 0.0f);
}

TEST(Autocast, CudaOpsUseCudaAutocast) {
  if (!cuda::is_available()) GTEST_SKIP() << cuda::unavailable_reason();
  const Tensor a = f32({4, 4}, 1).cuda(), h = a.to(kFloat16);
  {
    AutocastGuard amp(cuda_device());
    EXPECT_EQ(mm(a, a).dtype(), kFloat16);
    EXPECT_EQ(softmax(h, 1).dtype(), kFloat32);
  }
  {
    AutocastGuard amp(cuda_device(), kBFloat16);
    EXPECT_EQ(mm(a, a).dtype(), kBFloat16);
  }
  AutocastGuard cpu_only(kCPU);
  EXPECT_EQ(mm(a, a).dtype(), kFloat32);
}

}  // namespace

namespace {

// bfloat16 products (oneDNN's matmul, tensor/cpu/matmul_dnnl.cpp) against float32 products of
// the same bfloat16 values: one rounding apart, for every operand layout the GEMM front end
// passes down (transposed, batched with broadcast batch dims, scaled addmm, odd and empty sizes).
void expect_bf16_close(const Tensor& got, const Tensor& want, const char* what) {
  ASSERT_EQ(got.dtype(), kBFloat16) << what;
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const std::vector<float> g = got.to_vector<float>(), w = want.to_vector<float>();
  for (size_t i = 0; i < w.size(); ++i) {
    ASSERT_NEAR(g[i], w[i], 1e-2 * (1 + std::abs(w[i]))) << what << " at index " << i;
  }
}

TEST(Bf16Gemm, MatchesFloat32OnEveryLayout) {
  const Tensor a = f32({7, 13}, 1).to(kBFloat16), b = f32({13, 5}, 2).to(kBFloat16);
  const Tensor a32 = a.to(kFloat32), b32 = b.to(kFloat32);
  expect_bf16_close(mm(a, b), mm(a32, b32), "mm");
  const Tensor at = f32({13, 7}, 3).to(kBFloat16), bt = f32({5, 13}, 4).to(kBFloat16);
  expect_bf16_close(mm(at.t(), bt.t()), mm(at.to(kFloat32).t(), bt.to(kFloat32).t()), "mm^T");
  const Tensor batch = f32({3, 7, 13}, 5).to(kBFloat16);
  expect_bf16_close(bmm(batch, b.expand({3, 13, 5})),
                    bmm(batch.to(kFloat32), b32.expand({3, 13, 5})), "bmm broadcast");
  expect_bf16_close(matmul(batch.transpose(1, 2).transpose(1, 2), b),
                    matmul(batch.to(kFloat32), b32), "matmul folded");
  const Tensor bias = f32({5}, 6).to(kBFloat16);
  expect_bf16_close(addmm(bias, a, b, 0.5, 2.0), addmm(bias.to(kFloat32), a32, b32, 0.5, 2.0),
                    "addmm");
  expect_bf16_close(mm(zeros({4, 0}, kBFloat16), zeros({0, 3}, kBFloat16)), zeros({4, 3}), "k = 0");
  const Tensor vec = f32({13}, 9).to(kBFloat16);
  expect_bf16_close(matmul(vec, b), matmul(vec.to(kFloat32), b32), "vector @ matrix");
  expect_bf16_close(matmul(a, vec), matmul(a32, vec.to(kFloat32)), "matrix @ vector");
  expect_bf16_close(matmul(vec, vec), matmul(vec.to(kFloat32), vec.to(kFloat32)), "dot");
  expect_bf16_close(mm(a.narrow(1, 1, 1), b.narrow(0, 2, 1)),
                    mm(a32.narrow(1, 1, 1), b32.narrow(0, 2, 1)), "outer product of columns");
  const Tensor big_a = f32({64, 300}, 7).to(kBFloat16), big_b = f32({300, 33}, 8).to(kBFloat16);
  expect_bf16_close(mm(big_a, big_b), mm(big_a.to(kFloat32), big_b.to(kFloat32)), "64x300x33");
}

}  // namespace
