// fully_shard on CUDA parameters, on the one-GPU multi-rank harness: every rank is a thread of
// this process on cuda:0 with its own stream (ProcessGroupThreads). Sharded training must end
// where DDP + Adam on the same harness ends; the gathered parameters live in CUDA arenas whose
// memory is really given back on reshard (Note [CUDA arenas] in distributed/sharding/fsdp_cuda_arena.cpp).
// The CUDA cases skip without a GPU. The same checks run on the CPU too (the _cpu cases and the
// FsdpArena suites), so the checks themselves are exercised where there is no GPU.
#include <gtest/gtest.h>

#include <mutex>

#include <ember/distributed/ddp/ddp.h>
#include <ember/distributed/sharding/detail/fsdp_unit.h>
#include <ember/distributed/sharding/fsdp.h>
#include <ember/distributed/checkpoint/model_checkpoint.h>
#include <ember/distributed/mesh/device_mesh.h>
#include <ember/nn/clip_grad.h>
#include <ember/nn/layers/container.h>
#include <ember/nn/functional.h>
#include <ember/nn/layers/linear.h>
#include <ember/nn/optim/adam.h>
#include <ember/tensor/gpu/cuda_graph.h>
#include "tests/distributed/ddp/ddp_test_util.h"
#include "tests/distributed/sharding/fsdp_test_model.h"
#include "tests/distributed/store/store_test_util.h"
#include "tests/distributed/backends/threads_test_util.h"

namespace ember::dist {
namespace {

using namespace std::chrono_literals;
using test::Batch;
using test::FsdpNet;
using test::require;
using test::require_close;

constexpr int kSteps = 20;
const Device kGpu = cuda_device(0);

// `delayed`: through a DelayingGroup, so an FSDP step that reads a gather's result (or frees
// what a collective still uses) before waiting for it fails instead of passing by luck; on the
// GPU it also keeps the GPU well behind the CPU, so a release that does not wait for the queued
// kernels unmaps memory they still read.
test::ThreadsSetup ranks_on(Device dev, int n, bool delayed = false) {
  test::ThreadsSetup s;
  s.n = n;
  s.device = dev;
  if (delayed) s.delay = DelayOptions{.cycles = 5'000'000, .cpu_delay = 1ms, .scale = 1.0};
  return s;
}

std::vector<std::shared_ptr<FsdpNet>> rank_models(int n, int blocks = 3) {
  std::vector<std::shared_ptr<FsdpNet>> models;  // made here: the generator is shared
  for (int r = 0; r < n; ++r) models.push_back(test::make_fsdp_net(blocks));
  return models;
}

nn::NamedTensors on_host(const nn::NamedTensors& state) {
  nn::NamedTensors out;
  for (const auto& [name, t] : state) out.emplace_back(name, t.detach().cpu());
  return out;
}

void require_same_state(const std::string& what, const nn::NamedTensors& got,
                        const nn::NamedTensors& want, double tol) {
  require(got.size() == want.size(), what + ": entry count");
  for (size_t i = 0; i < got.size(); ++i) {
    require(got[i].first == want[i].first, what + ": name " + got[i].first);
    require_close(what + " " + got[i].first, got[i].second, want[i].second, tol);
  }
}

Batch mine(const Batch& b, int rank, int n, Device dev) {
  return test::to_device(test::slice(b, rank, n), dev);
}

// The reference: DDP + Adam on the same harness, each rank on its slice of every batch; rank 0's
// final state dict (every rank's is the same under DDP).
// `clip`: nn::clip_grad_norm_ to this before each step (0: none).
nn::NamedTensors train_ddp(Device dev, int n, const std::vector<Batch>& bs, double clip = 0) {
  auto models = rank_models(n);
  nn::NamedTensors out;
  std::mutex mu;
  test::run_threads(ranks_on(dev, n), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto model = models[static_cast<size_t>(rank)];
    model->to(dev);
    auto ddp = std::make_shared<DistributedDataParallel>(model, pg);
    nn::optim::Adam opt(ddp->parameters(), test::fsdp_adam());
    for (const Batch& b : bs) {
      opt.zero_grad();
      test::fsdp_loss(*ddp, mine(b, rank, n, dev)).backward();
      if (clip > 0) nn::clip_grad_norm_(ddp->parameters(), clip);
      opt.step();
    }
    if (rank != 0) return;
    std::lock_guard<std::mutex> lock(mu);
    out = on_host(model->state_dict());
  });
  return out;
}

struct CudaCase {
  int n;
  bool reshard_after_forward;
  bool bf16;  // parameters gathered (and computed) in bfloat16, gradients reduced in float32
  bool gpu = true;
  double clip = 0;  // dist::clip_grad_norm_ over the shards to this before each step
};
void PrintTo(const CudaCase& c, std::ostream* os) {
  *os << c.n << " ranks on " << (c.gpu ? "cuda:0" : "cpu")
      << (c.reshard_after_forward ? ", reshard" : ", keep") << (c.bf16 ? ", bf16" : "")
      << (c.clip > 0 ? ", clipped" : "");
}
std::string case_name(const ::testing::TestParamInfo<CudaCase>& info) {
  const CudaCase& c = info.param;
  return std::string("n") + std::to_string(c.n) +
         (c.reshard_after_forward ? "_reshard" : "_keep") + (c.bf16 ? "_bf16" : "") +
         (c.clip > 0 ? "_clip" : "") + (c.gpu ? "" : "_cpu");
}

FullyShardOptions options_of(const CudaCase& c, std::shared_ptr<ProcessGroup> pg) {
  FullyShardOptions o{.group = std::move(pg), .reshard_after_forward = c.reshard_after_forward};
  if (c.bf16) o.mp_policy = {.param_dtype = kBFloat16, .reduce_dtype = kFloat32};
  return o;
}

// Moves the model to `dev`, then shards every block and the root.
void shard_on(Device dev, const std::shared_ptr<FsdpNet>& model, const FullyShardOptions& o) {
  model->to(dev);
  for (auto& b : model->blocks) fully_shard(b, o);
  fully_shard(model, o);
}

class FsdpCuda : public ::testing::TestWithParam<CudaCase> {
 protected:
  void SetUp() override {
    if (GetParam().gpu) EMBER_REQUIRE_CUDA();
  }
};

// 20 steps of sharded Adam end where DDP + Adam on the same device ends (bfloat16: within its
// precision; clipped: dist::clip_grad_norm_ over the shards as nn::clip_grad_norm_ over DDP's
// parameters); the shards and the gathered parameters are on the model's device.
TEST_P(FsdpCuda, TrainsLikeDdp) {
  const CudaCase c = GetParam();
  const Device dev = c.gpu ? kGpu : kCPU;
  const auto bs = test::fsdp_batches(kSteps, 7);
  const nn::NamedTensors want = train_ddp(dev, c.n, bs, c.clip);
  auto models = rank_models(c.n);
  auto body = [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto model = models[static_cast<size_t>(rank)];
    shard_on(dev, model, options_of(c, pg));
    const auto shards = fsdp_parameters(*model);
    for (const Tensor& t : shards) {
      require(t.device() == dev && t.dtype() == kFloat32, "a shard is not float32 on " + dev.str());
    }
    nn::optim::Adam opt(shards, test::fsdp_adam());
    for (const Batch& b : bs) {
      opt.zero_grad();
      const Batch m = mine(b, rank, c.n, dev);
      nn::functional::mse_loss((*model)(m.x).to(kFloat32), m.y).backward();
      if (c.clip > 0) clip_grad_norm_(*model, c.clip);
      opt.step();
    }
    require(model->blocks[0]->fc1->weight.device() == dev, "block 0's weight left " + dev.str());
    const std::string what = ::testing::PrintToString(c) + ", rank " + std::to_string(rank);
    require_same_state(what, on_host(full_state_dict(*model)), want, c.bf16 ? 0.05 : 1e-4);
  };
  test::run_threads(ranks_on(dev, c.n, /*delayed=*/true), body);
  detail::flush_released_cuda_arenas(0);  // released arenas give their memory back lazily
  EXPECT_EQ(detail::cuda_arena_held_bytes(0), 0) << "arena memory held after the last step";
  EXPECT_EQ(fsdp_memory_stats().unsharded_bytes, 0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, FsdpCuda,
                         ::testing::Values(CudaCase{2, true, false}, CudaCase{2, false, false},
                                           CudaCase{4, true, false}, CudaCase{4, false, false},
                                           CudaCase{2, true, true}, CudaCase{4, true, true},
                                           CudaCase{2, true, false, true, 0.05},
                                           CudaCase{2, true, false, false},
                                           CudaCase{2, false, false, false},
                                           CudaCase{2, true, true, false},
                                           CudaCase{2, true, false, false, 0.05}),
                         case_name);

// HSDP on the harness: 4 rank threads as a 2 x 2 mesh (replicate, shard), each with its own
// stream on `dev`, end where DDP + Adam at 4 ranks ends: a module's gradient is reduce-scattered
// over the shard group and its shard all-reduced across the replicas, stream-ordered after it.
void hsdp_trains_like_ddp(Device dev) {
  const auto bs = test::fsdp_batches(kSteps, 7);
  const nn::NamedTensors want = train_ddp(dev, 4, bs);
  auto models = rank_models(4);
  try {
    run_rank_threads(4, [&](int rank) {
      std::optional<cuda::StreamGuard> own_stream;
      if (dev.is_cuda()) {
        cuda::set_device(dev.index);
        own_stream.emplace(cuda::Stream::create(dev.index));
      }
      auto mesh = init_device_mesh(dev.is_cuda() ? "cuda" : "cpu", {2, 2}, {"replicate", "shard"});
      auto model = models[static_cast<size_t>(rank)];
      shard_on(dev, model, {.mesh = mesh});
      nn::optim::Adam opt(fsdp_parameters(*model), test::fsdp_adam());
      for (const Batch& b : bs) {
        opt.zero_grad();
        test::fsdp_loss(*model, mine(b, rank, 4, dev)).backward();
        opt.step();
      }
      require_same_state("hsdp 2 x 2 on " + dev.str() + ", rank " + std::to_string(rank),
                         on_host(full_state_dict(*model)), want, 1e-4);
      if (dev.is_cuda()) cuda::current_stream(dev.index).synchronize();
    });
  } catch (const RankThreadError& e) {
    FAIL() << e.what();
  }
}

TEST(FsdpCudaHsdp, TrainsLikeDdp) {
  EMBER_REQUIRE_CUDA();
  hsdp_trains_like_ddp(kGpu);
}
TEST(FsdpArenaHsdp, TrainsLikeDdpOnTheCpu) { hsdp_trains_like_ddp(kCPU); }

// A sharded checkpoint of the shards on `dev` (model and Adam's state) after 10 steps, loaded
// into freshly sharded models there, continues the same run: 10 more steps end where 20 DDP
// steps end.
void resume_mid_run(Device dev) {
  constexpr int n = 2;
  const auto bs = test::fsdp_batches(kSteps, 7);
  const nn::NamedTensors want = train_ddp(dev, n, bs);
  test::TempDir dir;
  const std::string path = dir.file("ckpt");
  for (bool second_half : {false, true}) {
    auto models = rank_models(n);
    test::run_threads(ranks_on(dev, n), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
      auto model = models[static_cast<size_t>(rank)];
      shard_on(dev, model, options_of({n, true, false}, pg));
      nn::optim::Adam opt(fsdp_parameters(*model), test::fsdp_adam());
      if (second_half) load_model_checkpoint(path, *model, &opt);
      for (int i = second_half ? kSteps / 2 : 0; i < (second_half ? kSteps : kSteps / 2); ++i) {
        opt.zero_grad();
        test::fsdp_loss(*model, mine(bs[static_cast<size_t>(i)], rank, n, dev)).backward();
        opt.step();
      }
      if (!second_half) {
        save_model_checkpoint(path, *model, &opt, *pg, {});
        return;
      }
      require_same_state("resumed rank " + std::to_string(rank), on_host(full_state_dict(*model)),
                         want, 1e-4);
    });
  }
}

TEST(FsdpCudaCheckpoint, GpuShardsSaveAndLoadMidRun) {
  EMBER_REQUIRE_CUDA();
  resume_mid_run(kGpu);
}
TEST(FsdpArenaCheckpoint, CpuShardsSaveAndLoadMidRun) { resume_mid_run(kCPU); }

bool committed(const nn::Module& m) {
  auto unit = detail::unit_of(m);
  require(unit != nullptr, m.name() + " is not sharded");
  for (const auto& g : unit->groups) {
    if (!g.arena->committed()) return false;
  }
  return true;
}

// Between forward and backward the blocks' arenas are released with reshard_after_forward and
// kept without (the root, outermost, keeps its own either way); after the backward every arena
// is released, and fsdp_memory_stats() (and on the GPU the arenas' device memory counter) say
// so.
void check_arenas_released(Device dev) {
  constexpr int n = 2, kBlocks = 6;
  const auto bs = test::fsdp_batches(3, 7);
  for (bool reshard : {true, false}) {
    auto models = rank_models(n, kBlocks);
    reset_fsdp_peak_memory_stats();
    test::run_threads(ranks_on(dev, n), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
      auto model = models[static_cast<size_t>(rank)];
      shard_on(dev, model, options_of({n, reshard, false}, pg));
      // Runs after fully_shard's own pre-hook (registered first): block 1 is gathered.
      model->blocks[1]->register_forward_pre_hook([dev](nn::Module& m, std::vector<Tensor>&) {
        require(committed(m), "block 1 is not gathered in its forward");
        if (dev.is_cuda()) {
          require(detail::cuda_arena_held_bytes(0) > 0, "no arena memory held in a forward");
        }
      });
      nn::optim::Adam opt(fsdp_parameters(*model), test::fsdp_adam());
      const std::string what = std::string(reshard ? "reshard" : "keep") + " rank " +
                               std::to_string(rank) + ": ";
      for (const Batch& b : bs) {
        opt.zero_grad();
        Tensor loss = test::fsdp_loss(*model, mine(b, rank, n, dev));
        require(committed(*model), what + "the root released its parameters before backward");
        for (const auto& blk : model->blocks) {
          require(committed(*blk) == !reshard,
                  what + "a block's arena after forward: " + (committed(*blk) ? "held" : "free"));
        }
        loss.backward();
        require(!committed(*model), what + "the root's arena is held after backward");
        for (const auto& blk : model->blocks) {
          require(!committed(*blk), what + "a block's arena is held after backward");
        }
        opt.step();
      }
    });
    detail::flush_released_cuda_arenas(0);
    EXPECT_EQ(detail::cuda_arena_held_bytes(0), 0) << (reshard ? "reshard" : "keep");
    const FsdpMemoryStats m = fsdp_memory_stats();
    EXPECT_EQ(m.unsharded_bytes, 0);
    EXPECT_GT(m.peak_unsharded_bytes, 0);
    if (reshard) {
      EXPECT_LT(m.peak_unsharded_bytes, m.full_bytes * 6 / 10);
    }
  }
}

TEST(FsdpCudaMemory, ReshardReleasesTheArenasOnTheDevice) {
  EMBER_REQUIRE_CUDA();
  check_arenas_released(kGpu);
}
TEST(FsdpArenaMemory, ReshardReleasesTheArenasOnTheCpu) { check_arenas_released(kCPU); }

// The arena itself: its address stays, committing takes device memory (the driver's free memory
// drops by its size) and releasing gives it back once flushed; values written after a recommit
// read back.
TEST(FsdpCudaArena, KeepsItsAddressAndGivesTheMemoryBack) {
  EMBER_REQUIRE_CUDA();
  cuda::set_device(0);
  constexpr size_t kBytes = size_t{256} << 20;
  constexpr auto kSlack = static_cast<int64_t>(kBytes / 10);  // other users of the device
  auto arena = detail::make_cuda_arena(0, kBytes, "fully_shard(test)");
  void* const at = arena->data();
  EXPECT_GE(arena->held_bytes(), kBytes);
  const auto held = static_cast<int64_t>(arena->held_bytes());
  for (int round = 0; round < 2; ++round) {
    const int64_t before = detail::cuda_free_bytes(0);
    arena->commit();
    EXPECT_GE(before - detail::cuda_free_bytes(0), held - kSlack) << "round " << round;
    EXPECT_EQ(detail::cuda_arena_held_bytes(0), held);
    EXPECT_EQ(arena->data(), at);
    Tensor t = from_blob(arena->data(), {1 << 20}, TensorOptions(kFloat32).device(kGpu));
    t.fill_(round + 2.0);
    EXPECT_EQ(t.sum().item<double>(), (round + 2.0) * (1 << 20));
    const int64_t before_release = detail::cuda_free_bytes(0);
    arena->release();
    EXPECT_FALSE(arena->committed());
    detail::flush_released_cuda_arenas(0);
    EXPECT_GE(detail::cuda_free_bytes(0) - before_release, held - kSlack) << "round " << round;
    EXPECT_EQ(detail::cuda_arena_held_bytes(0), 0);
  }
}

// Note [CUDA arenas]: release() does not wait for the GPU. A released arena stays mapped until
// its work is done and a commit or flush looks; committed again before that, it takes its own
// mapping back (its contents with it, no new memory); and no more than two released arenas
// stay mapped per device: a third release gives the oldest one's memory back.
TEST(FsdpCudaArena, ReleasesLazilyReusesItsMappingAndBoundsWhatIsPending) {
  EMBER_REQUIRE_CUDA();
  cuda::set_device(0);
  constexpr size_t kBytes = size_t{64} << 20;
  std::vector<std::shared_ptr<detail::FsdpArena>> arenas;
  for (int i = 0; i < 3; ++i)
    arenas.push_back(detail::make_cuda_arena(0, kBytes, "fully_shard(test)"));
  const auto held = static_cast<int64_t>(arenas[0]->held_bytes());
  // Work queued behind the release keeps the first arena busy: it cannot go back yet.
  arenas[0]->commit();
  Tensor t = from_blob(arenas[0]->data(), {1 << 20}, TensorOptions(kFloat32).device(kGpu));
  t.fill_(7.0);
  cuda::spin(int64_t{200} << 20);  // ~0.1 s of GPU time on the current stream
  arenas[0]->release();
  EXPECT_FALSE(arenas[0]->committed());
  EXPECT_EQ(detail::cuda_arena_held_bytes(0), held) << "released, still mapped";
  arenas[0]->commit();  // takes its mapping back: no new memory, same contents
  EXPECT_EQ(detail::cuda_arena_held_bytes(0), held);
  EXPECT_EQ(t.sum().item<double>(), 7.0 * (1 << 20));
  for (auto& a : arenas) a->commit();
  EXPECT_EQ(detail::cuda_arena_held_bytes(0), 3 * held);
  for (auto& a : arenas) a->release();
  EXPECT_EQ(detail::cuda_arena_held_bytes(0), 2 * held) << "the oldest of three went back";
  detail::flush_released_cuda_arenas(0);
  EXPECT_EQ(detail::cuda_arena_held_bytes(0), 0);
  for (auto& a : arenas) EXPECT_FALSE(a->committed());
}

TEST(FsdpCudaArena, WithoutACudaDeviceSaysWhy) {
  if (cuda::is_available()) GTEST_SKIP() << "checks the message on a machine without CUDA";
  try {
    detail::make_cuda_arena(0, 1024, "fully_shard(Block)");
    FAIL() << "expected NotImplementedError";
  } catch (const NotImplementedError& e) {
    EXPECT_NE(std::string(e.what()).find("fully_shard(Block)"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(cuda::unavailable_reason()), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(detail::cuda_arena_held_bytes(0), 0);
}

// A module whose parameters are on two devices is refused by name before anything is sharded.
TEST(FsdpCudaErrors, ParametersOnTwoDevicesAreRefused) {
  EMBER_REQUIRE_CUDA();
  test::run_threads(ranks_on(kGpu, 1), [&](std::shared_ptr<ProcessGroup> pg, int) {
    auto gpu = std::make_shared<nn::Linear>(4, 4);
    gpu->to(kGpu);
    auto model = std::make_shared<nn::Sequential>(gpu, std::make_shared<nn::Linear>(4, 4));
    test::require_throws_with("two devices", [&] { fully_shard(model, {.group = pg}); },
                              "must be on one device");
    require(!is_fully_sharded(*model), "a refused module is marked sharded");
  });
}

// FSDP frees its gathered parameters when the host sees an event pass, which a CUDA graph
// cannot hold: a forward in a capture is refused saying so, and the capture is reset.
TEST(FsdpCudaErrors, ForwardInACudaGraphIsRefused) {
  EMBER_REQUIRE_CUDA();
  test::run_threads(ranks_on(kGpu, 1), [&](std::shared_ptr<ProcessGroup> pg, int) {
    auto model = std::make_shared<nn::Linear>(4, 4);
    model->to(kGpu);
    fully_shard(model, {.group = pg});
    const Tensor x = ones({2, 4}, kGpu);
    cuda::CUDAGraph graph;
    test::require_throws_with(
        "capture", [&] { cuda::graph(graph, [&] { (void)(*model)(x); }); },
        "[fully_shard] forward cannot be captured in a CUDA graph");
    require(!graph.ready(), "the failed capture was reset");
    require((*model)(x).shape() == Shape{2, 4}, "FSDP runs eagerly after the failed capture");
  });
}

}  // namespace
}  // namespace ember::dist
