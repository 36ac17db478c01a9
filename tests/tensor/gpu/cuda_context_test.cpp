// A rank creates CUDA contexts only on the devices it uses (tensor/cuda/runtime/check.h's DeviceGuard).
// Its own binary: the checks need a process in which no other test touched a device.
#include <gtest/gtest.h>

#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/ops.h>

namespace ember {
namespace {

TEST(CudaContext, NoContextUntilADeviceIsUsed) {
  if (!cuda::is_available()) GTEST_SKIP() << cuda::unavailable_reason();
  EXPECT_FALSE(cuda::has_context(0)) << "a context on cuda:0 before any use";
  Tensor t = ones({4}, TensorOptions(kFloat32).device(cuda_device(0)));
  EXPECT_TRUE(cuda::has_context(0));
  EXPECT_FALSE(cuda::has_context(cuda::device_count()));
}

// The situation of rank 1 of a node: it works on its own GPU only; leaving a device guard must
// not set (and so initialise) device 0, its thread's default.
TEST(CudaContext, WorkOnOneDeviceLeavesTheOthersWithoutAContext) {
  if (cuda::device_count() < 2) {
    GTEST_SKIP() << "needs 2 CUDA devices, found " << cuda::device_count() << ": "
                 << cuda::unavailable_reason();
  }
  const int mine = cuda::device_count() - 1;
  {
    Tensor t = ones({1 << 10}, TensorOptions(kFloat32).device(cuda_device(mine)));
    Tensor u = (t * 2).sum();
    cuda::Stream s = cuda::Stream::create(mine);
    cuda::Event e;
    e.record(s);
    e.synchronize();
    EXPECT_FLOAT_EQ(u.to(kCPU).item<float>(), 2048.0f);
  }
  for (int d = 0; d < mine; ++d) EXPECT_FALSE(cuda::has_context(d)) << "cuda:" << d;
  EXPECT_TRUE(cuda::has_context(mine));
}

TEST(CudaContext, WithoutCudaNoDeviceHasAContext) {
  if (cuda::is_available()) GTEST_SKIP() << "checks the machine without a device";
  EXPECT_FALSE(cuda::has_context(0));
}

}  // namespace
}  // namespace ember
