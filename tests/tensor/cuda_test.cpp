// CUDA core: devices, streams, events, the caching allocator, copies between host and device.
// Every test needs a GPU and skips with the reason where there is none.
#include <gtest/gtest.h>

#include "tensor/ops.h"

using namespace ember;

#define REQUIRE_CUDA()                                                                    \
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason()

TEST(CudaCore, BuildReportsCudaSupport) {
#ifdef EMBER_WITH_CUDA
  EXPECT_TRUE(cuda::is_built());
#else
  EXPECT_FALSE(cuda::is_built());
  EXPECT_EQ(cuda::device_count(), 0);
#endif
}

TEST(CudaCore, RoundTripPreservesValuesAndConvertsDtypes) {
  REQUIRE_CUDA();
  Tensor h = arange(0, 1000, 1, kFloat32).view({10, 100});
  Tensor d = h.to(Device("cuda"));
  EXPECT_TRUE(d.is_cuda());
  EXPECT_EQ(d.cpu().to_vector<float>(), h.to_vector<float>());
  // Conversion on the device, then back.
  EXPECT_EQ(d.to(kFloat16).cpu().to_vector<float>(), h.to(kFloat16).to_vector<float>());
  EXPECT_EQ(d.to(kBFloat16).to(kFloat64).cpu().to_vector<double>(),
            h.to(kBFloat16).to(kFloat64).to_vector<double>());
  // Non-contiguous sources and destinations on both sides.
  EXPECT_EQ(d.t().cpu().contiguous().to_vector<float>(), h.t().contiguous().to_vector<float>());
  Tensor dst = zeros({100, 10}, Device("cuda"));
  dst.copy_(h.t());
  EXPECT_EQ(dst.cpu().to_vector<float>(), h.t().contiguous().to_vector<float>());
  Tensor back = zeros({100, 10});
  back.t().copy_(d);
  EXPECT_EQ(back.t().contiguous().to_vector<float>(), h.to_vector<float>());
  // Broadcast copy on the device.
  Tensor row = arange(0, 5, 1, kFloat32).to(Device("cuda"));
  Tensor m = empty({3, 5}, Device("cuda"));
  m.copy_(row);
  EXPECT_EQ(m.cpu()[2].to_vector<float>(), std::vector<float>({0, 1, 2, 3, 4}));
}

TEST(CudaCore, FillAndCreationOnDevice) {
  REQUIRE_CUDA();
  EXPECT_EQ(full({4}, 2.5, TensorOptions(kFloat32).device(Device("cuda"))).cpu().to_vector<float>(),
            std::vector<float>(4, 2.5f));
  EXPECT_EQ(zeros({3}, TensorOptions(kInt64).device(Device("cuda"))).cpu().to_vector<int64_t>(),
            std::vector<int64_t>(3, 0));
  Tensor e = eye(3, {}, Device("cuda")).cpu();
  EXPECT_EQ(e.to_vector<float>(), eye(3).to_vector<float>());
  EXPECT_EQ(arange(0, 4, 1, TensorOptions(kInt32).device(Device("cuda"))).cpu().to_vector<int32_t>(),
            std::vector<int32_t>({0, 1, 2, 3}));
}

TEST(CudaCore, PinnedNonBlockingCopyCompletesAfterSync) {
  REQUIRE_CUDA();
  Tensor h = arange(0, 1 << 20, 1, kFloat32).pin_memory();
  EXPECT_TRUE(h.is_pinned());
  Tensor d = h.to(Device("cuda"), /*non_blocking=*/true);
  cuda::current_stream().synchronize();
  Tensor back = empty({1 << 20}, TensorOptions().pinned_memory());
  back.copy_(d);
  EXPECT_EQ(back[12345].item<float>(), 12345.0f);
}

TEST(CudaCore, StreamsOrderWorkAndEventsTime) {
  REQUIRE_CUDA();
  cuda::Stream s = cuda::Stream::create();
  Tensor a;
  {
    cuda::StreamGuard g(s);
    EXPECT_EQ(cuda::current_stream(), s);
    a = full({1 << 20}, 3.0, Device("cuda"));
  }
  EXPECT_EQ(cuda::current_stream(), cuda::default_stream());
  cuda::Event done(/*enable_timing=*/true), start(/*enable_timing=*/true);
  start.record(s);
  done.record(s);
  done.block(cuda::current_stream());
  EXPECT_EQ(a.cpu()[7].item<float>(), 3.0f);
  done.synchronize();
  EXPECT_TRUE(done.query());
  EXPECT_GE(start.elapsed_ms(done), 0.0f);
}

TEST(CudaCore, AllocatorReusesFreedBlocksOnSameStream) {
  REQUIRE_CUDA();
  void* first;
  {
    Tensor t = empty({1 << 18}, Device("cuda"));
    first = t.storage()->data();
  }
  Tensor u = empty({1 << 18}, Device("cuda"));
  EXPECT_EQ(u.storage()->data(), first);
  // A block recorded on another stream is not handed out again until that stream is done.
  cuda::Stream s = cuda::Stream::create();
  void* p;
  {
    Tensor t = empty({1 << 18}, Device("cuda"));
    p = t.storage()->data();
    cuda::record_stream(p, s);
  }
  s.synchronize();
  cuda::empty_cache();
}

TEST(CudaCore, BadDeviceIndexIsAnError) {
  REQUIRE_CUDA();
  const int n = cuda::device_count();
  EXPECT_THROW(zeros({1}).to(cuda_device(n)), ValueError);
}
