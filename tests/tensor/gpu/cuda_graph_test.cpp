// CUDA graphs (Note [CUDA graphs]): capture, replay on new inputs, the private pool, random ops
// drawing fresh numbers per replay, and the errors. The pool's bookkeeping is tested without a
// GPU in caching_allocator_test.cpp; everything here needs a GPU and skips without one.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/gpu/cuda_graph.h>
#include <ember/tensor/ops.h>

using namespace ember;

#define REQUIRE_CUDA() \
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason()

namespace {

const Device kGpu("cuda");

std::vector<float> host(const Tensor& t) { return t.cpu().to(kFloat32).to_vector<float>(); }

}  // namespace

TEST(CudaGraph, WithoutADeviceEveryCallSaysWhy) {
  if (cuda::is_available()) GTEST_SKIP() << "a CUDA device is present";
  cuda::CUDAGraph g;
  EXPECT_FALSE(cuda::is_current_stream_capturing());
  EXPECT_THROW(g.capture_begin(), NotImplementedError);
  EXPECT_THROW(cuda::graph(g, [] {}), NotImplementedError);
  EXPECT_FALSE(g.ready());
}

TEST(CudaGraph, ReplayRerunsTheCapturedWorkOnNewInputs) {
  REQUIRE_CUDA();
  Tensor x = full({1000}, 1.0, kGpu);
  Tensor y;
  // Warm-up, as a capture should have (first-use set-up stays out of the graph).
  y = (x * 2.0 + 1.0).exp().log();
  cuda::CUDAGraph g;
  bool capturing_inside = false;
  cuda::graph(g, [&] {
    capturing_inside = cuda::is_current_stream_capturing();
    y = (x * 2.0 + 1.0).exp().log();
  });
  EXPECT_TRUE(capturing_inside);
  EXPECT_FALSE(cuda::is_current_stream_capturing());
  EXPECT_TRUE(g.ready());
  EXPECT_NE(g.pool(), 0u);
  for (int i = 0; i < 3; ++i) {
    x.copy_(full({1000}, static_cast<double>(i), kFloat32));
    g.replay();
    const std::vector<float> got = host(y);
    EXPECT_NEAR(got[0], 2.0f * static_cast<float>(i) + 1.0f, 1e-5f) << "replay " << i;
    EXPECT_NEAR(got[999], 2.0f * static_cast<float>(i) + 1.0f, 1e-5f) << "replay " << i;
  }
  g.reset();
  EXPECT_FALSE(g.ready());
  EXPECT_THROW(g.replay(), ValueError);
  // y was made by the capture; it outlives the graph.
  EXPECT_NEAR(host(y)[5], 5.0f, 1e-5f);
}

// The capture's temporaries live in its private pool: memory allocated after the capture never
// overlaps them, so replays cannot overwrite it.
TEST(CudaGraph, ReplaysDoNotWriteOverMemoryAllocatedAfterTheCapture) {
  REQUIRE_CUDA();
  const int64_t n = 1 << 20;
  Tensor x = full({n}, 3.0, kGpu);
  Tensor out;
  out = ((x + 1.0) * (x - 1.0)).sum();
  cuda::CUDAGraph g;
  const int64_t reserved_before = cuda::memory_reserved();
  cuda::graph(g, [&] { out = ((x + 1.0) * (x - 1.0)).sum(); });
  EXPECT_GT(cuda::memory_reserved(), reserved_before);  // the pool's own segments
  std::vector<Tensor> bystanders;
  for (int i = 0; i < 4; ++i) bystanders.push_back(full({n}, 7.0, kGpu));
  for (int i = 0; i < 3; ++i) g.replay();
  EXPECT_NEAR(host(out)[0], 8.0f * static_cast<float>(n), 1.0f);
  for (const Tensor& b : bystanders) {
    EXPECT_TRUE(all(eq(b, 7.0)).item<bool>()) << "a replay wrote into a later tensor";
  }
  const int64_t with_graph = cuda::memory_reserved();
  out = Tensor();
  g.reset();
  cuda::empty_cache();
  EXPECT_LT(cuda::memory_reserved(), with_graph);  // the pool's memory went back
}

// Each replay draws what the same op run eagerly would have drawn from the generator at that
// point, and advances the generator as the eager op would.
TEST(CudaGraph, RandomOpsDrawFreshNumbersOnEachReplayAsEagerOpsWould) {
  REQUIRE_CUDA();
  Generator gen(1234);
  Tensor r = rand({4099}, kGpu, &gen);
  Tensor mask = empty({1000}, kGpu);
  bernoulli_(mask, 0.3);  // the default generator
  cuda::CUDAGraph g;
  cuda::graph(g, [&] {
    r = rand({4099}, kGpu, &gen);
    bernoulli_(mask, 0.3);
  });
  std::vector<float> previous;
  for (int i = 0; i < 3; ++i) {
    Generator eager(1234);
    eager.set_offset(gen.offset());
    Generator eager_default(default_generator().seed());
    eager_default.set_offset(default_generator().offset());
    g.replay();
    const std::vector<float> got = host(r);
    EXPECT_EQ(got, host(rand({4099}, kGpu, &eager))) << "replay " << i;
    EXPECT_EQ(gen.offset(), eager.offset());
    Tensor m = empty({1000}, kGpu);
    bernoulli_(m, 0.3, &eager_default);
    EXPECT_EQ(host(mask), host(m)) << "replay " << i;
    EXPECT_EQ(default_generator().offset(), eager_default.offset());
    EXPECT_NE(got, previous);
    previous = got;
  }
}

TEST(CudaGraph, AttentionDropoutInAGraphMatchesEagerAtTheSameOffset) {
  REQUIRE_CUDA();
  Generator gen(99);
  auto opts = TensorOptions(kFloat32).device(kGpu);
  Tensor q = randn({2, 3, 40, 32}, opts), k = randn({2, 3, 40, 32}, opts),
         v = randn({2, 3, 40, 32}, opts);
  Tensor out = scaled_dot_product_attention(q, k, v, {}, 0.25, true, std::nullopt, &gen);
  cuda::CUDAGraph g;
  cuda::graph(
      g, [&] { out = scaled_dot_product_attention(q, k, v, {}, 0.25, true, std::nullopt, &gen); });
  for (int i = 0; i < 2; ++i) {
    Generator eager(99);
    eager.set_offset(gen.offset());
    g.replay();
    Tensor want = scaled_dot_product_attention(q, k, v, {}, 0.25, true, std::nullopt, &eager);
    EXPECT_EQ(host(out), host(want)) << "replay " << i;
  }
}

TEST(CudaGraph, MisuseIsAClearError) {
  REQUIRE_CUDA();
  cuda::CUDAGraph g;
  // The legacy default stream cannot be captured.
  try {
    g.capture_begin();
    FAIL() << "expected an error";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("legacy default stream"), std::string::npos) << e.what();
  }
  EXPECT_THROW(g.capture_end(), ValueError);
  // Reading a result on the host inside the capture invalidates it: the error says so, the
  // graph is reset, and the stream works afterwards.
  Tensor x = full({16}, 2.0, kGpu);
  try {
    cuda::graph(g, [&] { (void)(x * 3.0).sum().item<float>(); });
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    SUCCEED() << e.what();
  }
  EXPECT_FALSE(g.ready());
  EXPECT_FALSE(cuda::is_current_stream_capturing());
  EXPECT_EQ(host(x * 3.0)[0], 6.0f);
  // A graph holding a capture must be reset before the next.
  cuda::graph(g, [&] { x.mul_(2.0); });
  EXPECT_THROW(cuda::graph(g, [&] { x.mul_(2.0); }), ValueError);
  g.replay();
  EXPECT_EQ(host(x)[0], 4.0f);
}

// Two graphs sharing a pool, replayed in capture order, as PyTorch's graph_pool_handle allows.
TEST(CudaGraph, GraphsSharingAPoolReplayInCaptureOrder) {
  REQUIRE_CUDA();
  Tensor x = full({4096}, 1.0, kGpu);
  Tensor y, z;
  y = x * 2.0;
  z = y + 1.0;
  const cuda::MempoolId pool = cuda::graph_pool_handle();
  cuda::CUDAGraph first, second;
  cuda::graph(first, [&] { y = x * 2.0; }, {.pool = pool});
  cuda::graph(second, [&] { z = y + 1.0; }, {.pool = pool});
  EXPECT_EQ(first.pool(), pool);
  EXPECT_EQ(second.pool(), pool);
  x.fill_(5.0);
  first.replay();
  second.replay();
  EXPECT_EQ(host(z)[100], 11.0f);
}

// A bad index in a replay is reported as an eager one is: by the next index op after it
// (Note [CUDA index checks]); the check's copy to the host follows each launch.
TEST(CudaGraph, BadIndexInAReplayIsReportedByTheNextIndexOp) {
  REQUIRE_CUDA();
  Tensor src = arange(0, 40, 1, kFloat32).view({10, 4}).to(kGpu);
  Tensor idx = zeros({3, 4}, TensorOptions(kInt64).device(kGpu));
  Tensor out = gather(src, 0, idx);
  cuda::CUDAGraph g;
  cuda::graph(g, [&] { out = gather(src, 0, idx); });
  idx.copy_(full({3, 4}, 2.0, kInt64));
  g.replay();
  EXPECT_EQ(host(out)[0], 8.0f);
  cuda::synchronize();
  EXPECT_NO_THROW(gather(src, 0, zeros({1, 4}, TensorOptions(kInt64).device(kGpu))));
  idx.copy_(full({3, 4}, 12.0, kInt64));  // row 12 of 10
  g.replay();
  cuda::synchronize();
  try {
    gather(src, 0, zeros({1, 4}, TensorOptions(kInt64).device(kGpu)));
    FAIL() << "expected IndexError";
  } catch (const IndexError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("index 12 is out of bounds"), std::string::npos) << m;
    EXPECT_NE(m.find("checked on the device"), std::string::npos) << m;
  }
  // Fixed inputs replay cleanly again.
  idx.copy_(full({3, 4}, 1.0, kInt64));
  g.replay();
  cuda::synchronize();
  EXPECT_NO_THROW(gather(src, 0, zeros({1, 4}, TensorOptions(kInt64).device(kGpu))));
  EXPECT_EQ(host(out)[0], 4.0f);
}
