// fully_shard as a training loop uses it: a residual MLP whose blocks (and root) are sharded,
// trained with Adam on each rank's slice of every batch, ends where one process training on the
// whole batches ends. Ranks are threads of this process (ProcessGroupThreads) or forked gloo
// processes, or MPI ranks under mpirun (the FsdpMpiWorld cases start it on this binary). Models
// and batches are made before the ranks start (the default random generator is shared by the
// threads).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <thread>

#include <ember/distributed/backends/process_group_gloo.h>
#include <ember/distributed/backends/process_group_mpi.h>
#include <ember/distributed/sharding/fsdp.h>
#include <ember/distributed/checkpoint/model_checkpoint.h>
#include <ember/distributed/checkpoint/sharded_checkpoint.h>
#include <ember/distributed/forwarding_process_group.h>
#include <ember/distributed/init.h>
#include <ember/distributed/mesh/device_mesh.h>
#include <ember/nn/activation_checkpoint.h>
#include <ember/nn/io/checkpoint.h>
#include <ember/nn/clip_grad.h>
#include <ember/nn/functional.h>
#include <ember/nn/layers/linear.h>
#include <ember/nn/layers/norm.h>
#include <ember/nn/optim/adam.h>
#include <ember/nn/optim/sgd.h>
#include <ember/nn/io/serialize.h>
#include <ember/tensor/allocator.h>
#include <ember/tensor/threading.h>
#include "tests/distributed/ddp/ddp_test_util.h"
#include "tests/distributed/sharding/fsdp_test_model.h"
#include "tests/distributed/backends/mpi_job.h"
#include "tests/distributed/backends/threads_test_util.h"

namespace ember::dist {
namespace {

using test::Batch;
using test::FsdpNet;
using test::require;
using test::require_close;

constexpr int kSteps = 20;

struct Variant {
  std::string name;
  FullyShardOptions options;
  bool shard_root = true;
  bool checkpoint = false;  // activation checkpointing of every block
  int micro = 1;            // micro-batches per step, all but the last without gradient sync
  double clip = 0;          // clip_grad_norm_ to this (0: no clipping)
  bool freeze_input = false;
};

std::vector<Batch> batches() { return test::fsdp_batches(kSteps, 7); }

// One process on the whole batches: what every rank must end with.
std::shared_ptr<FsdpNet> train_reference(const Variant& v, const std::vector<Batch>& bs) {
  auto model = test::make_fsdp_net();
  if (v.freeze_input) model->inp->weight.requires_grad_(false);
  model->checkpoint = v.checkpoint;
  nn::optim::Adam opt(test::trainable(*model), test::fsdp_adam());
  for (const Batch& b : bs) {
    opt.zero_grad();
    test::fsdp_loss(*model, b).backward();
    if (v.clip > 0) nn::clip_grad_norm_(test::trainable(*model), v.clip);
    opt.step();
  }
  return model;
}

void shard(FsdpNet& model, const std::shared_ptr<FsdpNet>& self, const Variant& v,
           std::shared_ptr<ProcessGroup> pg) {
  FullyShardOptions o = v.options;
  if (!o.mesh && !o.group) o.group = std::move(pg);
  for (auto& b : model.blocks) fully_shard(b, o);
  if (v.shard_root) fully_shard(self, o);
}

// This rank's part of the variant's training; returns the full state dict at the end.
nn::NamedTensors train_sharded(const Variant& v, const std::shared_ptr<FsdpNet>& model,
                               const std::vector<Batch>& bs, std::shared_ptr<ProcessGroup> pg) {
  const int rank = pg->rank(), n = pg->size();
  if (v.freeze_input) model->inp->weight.requires_grad_(false);
  model->checkpoint = v.checkpoint;
  shard(*model, model, v, pg);
  nn::optim::Adam opt(fsdp_parameters(*model), test::fsdp_adam());
  for (const Batch& b : bs) {
    opt.zero_grad();
    const Batch mine = test::slice(b, rank, n);
    for (int m = 0; m < v.micro; ++m) {
      set_requires_gradient_sync(*model, m + 1 == v.micro);
      (test::fsdp_loss(*model, test::slice(mine, m, v.micro)) / static_cast<double>(v.micro))
          .backward();
    }
    if (v.clip > 0) clip_grad_norm_(*model, v.clip);
    opt.step();
  }
  return full_state_dict(*model);
}

void require_state(const std::string& what, const nn::NamedTensors& got, const nn::Module& want,
                   double tol) {
  const auto ref = want.state_dict();
  require(got.size() == ref.size(), what + ": entry count");
  for (size_t i = 0; i < got.size(); ++i) {
    require(got[i].first == ref[i].first, what + ": name " + got[i].first);
    require_close(what + " " + got[i].first, got[i].second, ref[i].second.detach(), tol);
  }
}

// n rank threads, each training its own model (all made before the threads start: the default
// generator is shared).
using RankBody =
    std::function<void(std::shared_ptr<FsdpNet>&, std::shared_ptr<ProcessGroup>, int)>;
void with_rank_models(int n, const RankBody& body, int blocks = 3) {
  std::vector<std::shared_ptr<FsdpNet>> models;
  for (int r = 0; r < n; ++r) models.push_back(test::make_fsdp_net(blocks));
  test::ThreadsSetup s;
  s.n = n;
  test::run_threads(s, [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    body(models[rank], std::move(pg), rank);
  });
}

void run_variant(const Variant& v, int n) {
  const auto bs = batches();
  auto ref = train_reference(v, bs);
  with_rank_models(n, [&](std::shared_ptr<FsdpNet>& model, std::shared_ptr<ProcessGroup> pg,
                          int rank) {
    const auto state = train_sharded(v, model, bs, pg);
    require_state(v.name + " rank " + std::to_string(rank) + " of " + std::to_string(n), state,
                  *ref, 2e-5);
  });
}

class Fsdp : public ::testing::TestWithParam<int> {};

TEST_P(Fsdp, TrainsLikeOneProcess) { run_variant({.name = "default"}, GetParam()); }

TEST_P(Fsdp, KeepingParametersFromForwardToBackwardWithoutPrefetch) {
  run_variant({.name = "no reshard, no prefetch",
               .options = {.reshard_after_forward = false, .prefetch = false}},
              GetParam());
}

TEST_P(Fsdp, RootNotShardedKeepsItsOwnParametersReplicated) {
  run_variant({.name = "root replicated", .shard_root = false}, GetParam());
}

TEST_P(Fsdp, ActivationCheckpointingOfEveryBlock) {
  run_variant({.name = "checkpointed", .checkpoint = true}, GetParam());
}

TEST_P(Fsdp, GradientAccumulationWithoutSyncEqualsTheWholeBatch) {
  run_variant({.name = "no_sync", .micro = 2}, GetParam());
}

TEST_P(Fsdp, ClipGradNormOverTheShards) {
  run_variant({.name = "clipped", .clip = 0.05}, GetParam());
}

TEST_P(Fsdp, FrozenParameters) {
  run_variant({.name = "frozen input layer", .freeze_input = true}, GetParam());
}

// bfloat16 compute with float32 reduction and float32 shards: the blocks compute on bfloat16
// parameters (checked from a forward hook), the optimizer steps float32 shards, and training
// stays within bfloat16's precision of the float32 run.
TEST_P(Fsdp, MixedPrecisionComputesInBfloat16AndKeepsFloat32Shards) {
  const int n = GetParam();
  const auto bs = batches();
  auto ref = train_reference({}, bs);
  with_rank_models(n, [&](std::shared_ptr<FsdpNet>& model, std::shared_ptr<ProcessGroup> pg,
                          int rank) {
    Dtype seen = kFloat32;
    model->blocks[0]->register_forward_hook(
        [&](nn::Module& m, const std::vector<Tensor>&, std::vector<Tensor>&) {
          seen = static_cast<test::FsdpBlock&>(m).fc1->weight.dtype();
        });
    Variant v{.name = "bf16"};
    v.options.mp_policy = {.param_dtype = kBFloat16, .reduce_dtype = kFloat32};
    // The loss is taken in float32 (the head's output is bfloat16).
    shard(*model, model, v, pg);
    nn::optim::Adam opt(fsdp_parameters(*model), test::fsdp_adam());
    for (const Tensor& t : fsdp_parameters(*model)) require(t.dtype() == kFloat32, "shard dtype");
    for (const Batch& b : bs) {
      opt.zero_grad();
      const Batch mine = test::slice(b, rank, n);
      nn::functional::mse_loss((*model)(mine.x).to(kFloat32), mine.y).backward();
      opt.step();
    }
    require(seen == kBFloat16, "the blocks did not compute in bfloat16");
    require_state("bf16 rank " + std::to_string(rank), full_state_dict(*model), *ref, 0.05);
  });
}

// 3 ranks: no flat group divides evenly, so every shard ends in padding.
INSTANTIATE_TEST_SUITE_P(Ranks, Fsdp, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return "n" + std::to_string(info.param); });

// The state held per rank: the shards are 1/n of the model; with reshard_after_forward at most
// the root and two blocks (the one computing and the one prefetched) are gathered at once.
TEST(FsdpMemory, ShardsAreOneNthAndFewModulesAreGatheredAtOnce) {
  const auto bs = batches();
  constexpr int n = 2;
  int64_t model_bytes = 0;
  for (const Tensor& p : test::make_fsdp_net(/*blocks=*/6)->parameters()) model_bytes += p.nbytes();
  std::mutex mu;
  std::map<int, int64_t> shard_bytes;
  reset_fsdp_peak_memory_stats();
  auto body = [&](std::shared_ptr<FsdpNet>& model, std::shared_ptr<ProcessGroup> pg, int rank) {
    shard(*model, model, {}, pg);
    nn::optim::Adam opt(fsdp_parameters(*model), test::fsdp_adam());
    int64_t bytes = 0;
    for (const Tensor& t : fsdp_parameters(*model)) bytes += t.nbytes();
    for (int i = 0; i < 3; ++i) {
      opt.zero_grad();
      test::fsdp_loss(*model, test::slice(bs[i], rank, n)).backward();
      opt.step();
    }
    std::lock_guard<std::mutex> lock(mu);
    shard_bytes[rank] = bytes;
  };
  with_rank_models(n, body, /*blocks=*/6);
  int64_t total = 0;
  for (const auto& [rank, bytes] : shard_bytes) {
    EXPECT_LE(bytes, model_bytes / n + 64 * 4) << "rank " << rank;  // a flat group's split point
    total += bytes;
  }
  EXPECT_EQ(total, model_bytes) << "every parameter element is held by exactly one rank";
  const FsdpMemoryStats m = fsdp_memory_stats();
  EXPECT_EQ(m.unsharded_bytes, 0) << "everything is released after the steps";
  // Both ranks' gather buffers count here (they are threads of this process).
  EXPECT_GT(m.peak_unsharded_bytes, 0);
  EXPECT_LT(m.peak_unsharded_bytes, n * model_bytes * 6 / 10)
      << "peak " << m.peak_unsharded_bytes << " of " << n * model_bytes;
}

// A block holding a Linear its forward never calls, in a net of two of them.
class SpareBlock : public test::FsdpBlock {
 public:
  SpareBlock() {
    spare = register_module("spare", std::make_shared<nn::Linear>(test::kWidth, test::kWidth));
  }
  std::shared_ptr<nn::Linear> spare;
};
class SpareNet : public nn::Module {
 public:
  SpareNet() {
    manual_seed(5);
    inp = register_module("inp", std::make_shared<nn::Linear>(test::kFsdpIn, test::kWidth));
    b0 = register_module("b0", std::make_shared<SpareBlock>());
    b1 = register_module("b1", std::make_shared<SpareBlock>());
    head = register_module("head", std::make_shared<nn::Linear>(test::kWidth, test::kFsdpOut));
  }
  Tensor forward(const Tensor& x) override { return (*head)((*b1)((*b0)((*inp)(x)))); }
  std::shared_ptr<nn::Linear> inp, head;
  std::shared_ptr<SpareBlock> b0, b1;
};

// A parameter no rank uses keeps no gradient, as in one process and in PyTorch's FSDP2 (which
// reduce-scatters only the parameters that have one), so Adam skips it: with weight decay a zero
// gradient would have moved it. The used ones train as one process does.
TEST(FsdpUnused, AParameterNoRankUsesGetsNoGradientAndStaysAsItWas) {
  const auto bs = batches();
  constexpr int n = 2, kUnusedSteps = 5;
  auto ref = std::make_shared<SpareNet>();
  const Tensor spare_at_start = ref->b0->spare->weight.detach().clone();
  {
    nn::optim::Adam opt(ref->parameters(), test::fsdp_adam());
    for (int i = 0; i < kUnusedSteps; ++i) {
      opt.zero_grad();
      test::fsdp_loss(*ref, bs[i]).backward();
      opt.step();
    }
  }
  ASSERT_TRUE(equal(ref->b0->spare->weight.detach(), spare_at_start));
  std::vector<std::shared_ptr<SpareNet>> models;
  for (int r = 0; r < n; ++r) models.push_back(std::make_shared<SpareNet>());
  test::ThreadsSetup setup;
  setup.n = n;
  test::run_threads(setup, [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto& model = models[rank];
    for (const auto& b : {model->b0, model->b1}) fully_shard(b, {.group = pg});
    fully_shard(model, {.group = pg});
    nn::optim::Adam opt(fsdp_parameters(*model), test::fsdp_adam());
    for (int i = 0; i < kUnusedSteps; ++i) {
      opt.zero_grad();
      test::fsdp_loss(*model, test::slice(bs[i], rank, n)).backward();
      for (const LocalShard& s : local_shards(*model)) {
        if (!s.data.defined()) continue;
        const bool spare = s.name.find(".spare.") != std::string::npos;
        require(s.data.grad().defined() != spare,
                "rank " + std::to_string(rank) + ": " + s.name + "'s piece " +
                    (spare ? "has a gradient" : "has no gradient"));
      }
      opt.step();
    }
    require_state("rank " + std::to_string(rank), full_state_dict(*model), *ref, 2e-5);
  });
}

// A Linear in the root that rank 0's forward uses and rank 1's does not (input-dependent use, as
// in a routed model): its every piece gets the average of the two ranks' gradients, as in one
// process on the sum of both ranks' losses, though rank 1 saw no gradient for it.
class SometimesNet : public nn::Module {
 public:
  SometimesNet() {
    manual_seed(6);
    inp = register_module("inp", std::make_shared<nn::Linear>(test::kFsdpIn, test::kWidth));
    b0 = register_module("b0", std::make_shared<test::FsdpBlock>());
    extra = register_module("extra", std::make_shared<nn::Linear>(test::kWidth, test::kWidth));
    head = register_module("head", std::make_shared<nn::Linear>(test::kWidth, test::kFsdpOut));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = (*b0)((*inp)(x));
    if (use_extra) h = h + (*extra)(h);
    return (*head)(h);
  }
  std::shared_ptr<nn::Linear> inp, extra, head;
  std::shared_ptr<test::FsdpBlock> b0;
  bool use_extra = true;
};

TEST(FsdpUnused, AParameterOnlySomeRanksUseGetsTheAverageOnEveryRank) {
  const auto bs = batches();
  constexpr int n = 2, kSteps = 4;
  auto ref = std::make_shared<SometimesNet>();
  {
    nn::optim::Adam opt(ref->parameters(), test::fsdp_adam());
    for (int i = 0; i < kSteps; ++i) {
      opt.zero_grad();
      ref->use_extra = true;
      const Tensor l0 = test::fsdp_loss(*ref, test::slice(bs[i], 0, n));
      ref->use_extra = false;
      const Tensor l1 = test::fsdp_loss(*ref, test::slice(bs[i], 1, n));
      ((l0 + l1) * 0.5).backward();
      opt.step();
    }
  }
  std::vector<std::shared_ptr<SometimesNet>> models;
  for (int r = 0; r < n; ++r) models.push_back(std::make_shared<SometimesNet>());
  test::ThreadsSetup setup;
  setup.n = n;
  test::run_threads(setup, [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto& model = models[rank];
    model->use_extra = rank == 0;
    fully_shard(model->b0, {.group = pg});
    fully_shard(model, {.group = pg});
    nn::optim::Adam opt(fsdp_parameters(*model), test::fsdp_adam());
    for (int i = 0; i < kSteps; ++i) {
      opt.zero_grad();
      test::fsdp_loss(*model, test::slice(bs[i], rank, n)).backward();
      opt.step();
    }
    require_state("rank " + std::to_string(rank), full_state_dict(*model), *ref, 2e-5);
  });
}

// A group whose every wait first sleeps kDelay: a slow link's wait, bounded below.
class SlowWaits : public ForwardingProcessGroup {
 public:
  static constexpr std::chrono::milliseconds kDelay{5};
  using ForwardingProcessGroup::ForwardingProcessGroup;
  WorkPtr allgather_into_tensor(Tensor& out, const Tensor& in,
                                const CollectiveOptions& o) override {
    return slow(inner()->allgather_into_tensor(out, in, o));
  }
  WorkPtr reduce_scatter_tensor(Tensor& out, const Tensor& in,
                                const ReduceScatterOptions& o) override {
    return slow(inner()->reduce_scatter_tensor(out, in, o));
  }
  WorkPtr allreduce(Tensor& t, const AllreduceOptions& o) override {
    return slow(inner()->allreduce(t, o));
  }
  WorkPtr allreduce_coalesced(std::vector<Tensor>& ts, const AllreduceOptions& o) override {
    return slow(inner()->allreduce_coalesced(ts, o));
  }
  std::atomic<int> waits{0};

 private:
  class SlowWork : public Work {
   public:
    SlowWork(WorkPtr inner, std::atomic<int>& waits)
        : Work(inner->describe(), inner->timeout()), inner_(std::move(inner)), waits_(waits) {
      future_ = inner_->future();
    }
    bool wait(std::optional<Duration> timeout) override {
      ++waits_;
      std::this_thread::sleep_for(kDelay);
      return inner_->wait(timeout);
    }

   private:
    WorkPtr inner_;
    std::atomic<int>& waits_;
  };
  WorkPtr slow(WorkPtr w) { return std::make_shared<SlowWork>(std::move(w), waits); }
};

// fsdp_comm_stats counts the host's time blocked in FSDP's waits (the straggler report's
// "waiting on communication"): over a group whose waits each take at least 5 ms, a step's
// reading grows by at least 5 ms per wait the step made, on every rank; a model with nothing
// sharded reads 0.
TEST(FsdpCommStats, CountsTheHostsWaitsOnItsCollectives) {
  const auto bs = batches();
  constexpr int n = 2;
  auto body = [&](std::shared_ptr<FsdpNet>& model, std::shared_ptr<ProcessGroup> pg, int rank) {
    auto slow = std::make_shared<SlowWaits>(pg);
    EXPECT_EQ(fsdp_comm_stats(*model).wait_ms, 0);
    shard(*model, model, {}, slow);
    nn::optim::Adam opt(fsdp_parameters(*model), test::fsdp_adam());
    double before = fsdp_comm_stats(*model).wait_ms;
    for (int i = 0; i < 2; ++i) {
      const int waits_before = slow->waits.load();
      opt.zero_grad();
      test::fsdp_loss(*model, test::slice(bs[i], rank, n)).backward();
      opt.step();
      const int waits = slow->waits.load() - waits_before;
      const double after = fsdp_comm_stats(*model).wait_ms;
      EXPECT_GT(waits, 0) << "rank " << rank;
      EXPECT_GE(after - before, waits * static_cast<double>(SlowWaits::kDelay.count()))
          << "rank " << rank << " step " << i << ": " << waits << " waits";
      before = after;
    }
  };
  with_rank_models(n, body);
}

// Note [FSDP and the host cache]: a shard takes a block of its own size, not a cached block that
// the unsharded parameters (or a temporary of the model's construction) left, and what the
// unsharded parameters held is not kept in the cache. Rank 0 of a 2-rank world shards on this
// thread alone (sharding runs no collective), so nothing else allocates meanwhile; kernels run on
// this thread too, so that no pool thread outlives the test (the gloo cases fork after it).
TEST(FsdpMemory, ShardsTakeBlocksOfTheirOwnSizeAndTheUnshardedParametersAreGivenBack) {
  constexpr int n = 2, kLayers = 4;
  constexpr int64_t kDim = 512;     // 1 MiB weights: host blocks from 128 KiB are cached
  constexpr int64_t kPage = 4096;   // the host allocator rounds cached blocks up to pages
  const int threads = get_num_threads();
  set_num_threads(1);
  auto pg = std::make_shared<ProcessGroupThreads>(ThreadWorld::create(n), 0);
  cpu_empty_cache();
  const int64_t before = cpu_allocator_stats().allocated;
  std::vector<std::shared_ptr<nn::Linear>> layers;
  for (int i = 0; i < kLayers; ++i) layers.push_back(std::make_shared<nn::Linear>(kDim, kDim));
  { const Tensor scratch = randn({kDim, kDim}); }  // a freed temporary, as building a model leaves
  FullyShardOptions o;
  o.group = pg;
  int64_t shards = 0;
  for (const auto& layer : layers) {
    fully_shard(layer, o);
    shards += (kDim * kDim + kDim + n - 1) / n * static_cast<int64_t>(sizeof(float));
  }
  const AllocatorStats after = cpu_allocator_stats();
  const int64_t held = after.allocated - before;
  EXPECT_GE(held, shards);
  EXPECT_LT(held, shards + kLayers * kPage)
      << "the " << kLayers << " shards of " << shards / kLayers << " bytes hold " << held
      << " bytes: they took larger cached blocks";
  EXPECT_LT(after.cached, kDim * kDim * static_cast<int64_t>(sizeof(float)))
      << "a weight's memory stayed in the cache after sharding";
  set_num_threads(threads);
}

// The same over gloo between processes, through shared memory and over TCP, at 2 and 4 ranks.
TEST(FsdpGloo, TrainsLikeOneProcessOverSharedMemoryAndTcp) {
  if (!gloo_available()) GTEST_SKIP() << "built without gloo (EMBER_WITH_GLOO=OFF)";
  for (auto [n, shm] : {std::pair{2, true}, std::pair{2, false}, std::pair{4, true}}) {
    test::run_gloo_ranks(
        n,
        [&](std::shared_ptr<ProcessGroupGloo> pg, int rank) {
          const Variant v{.name = std::string(shm ? "shm" : "tcp")};
          const auto bs = batches();
          auto ref = train_reference(v, bs);
          const auto state = train_sharded(v, test::make_fsdp_net(), bs, pg);
          require_state(v.name + " rank " + std::to_string(rank) + " of " + std::to_string(n),
                        state, *ref, 2e-5);
        },
        shm);
  }
}

// Over MPI: the FsdpMpiWorld cases (run by ctest) start mpirun on this binary, whose every rank
// runs the FsdpMpiRanks cases.
TEST(FsdpMpiWorld, Np2) {
  test::expect_mpi_job_passes(2, "FsdpMpiRanks.*", std::chrono::seconds(240),
                              ProcessGroupMpi::is_available());
}
TEST(FsdpMpiWorld, Np4) {
  test::expect_mpi_job_passes(4, "FsdpMpiRanks.*", std::chrono::seconds(240),
                              ProcessGroupMpi::is_available());
}

TEST(FsdpMpiRanks, TrainsLikeOneProcess) {
  SKIP_UNLESS_UNDER_MPIRUN();
  std::shared_ptr<ProcessGroup> pg = ProcessGroupMpi::create();
  for (const Variant& v : {Variant{.name = "mpi"}, Variant{.name = "mpi no_sync", .micro = 2}}) {
    const auto bs = batches();
    auto ref = train_reference(v, bs);
    const auto state = train_sharded(v, test::make_fsdp_net(), bs, pg);
    require_state(v.name + " rank " + std::to_string(pg->rank()), state, *ref, 2e-5);
  }
}

// A full state dict goes both ways: to a plain model (identical forward), and from a plain
// model's state into a sharded one at another world size, which then trains on as the plain one.
TEST(FsdpState, FullStateDictLoadsIntoPlainAndShardedModels) {
  const auto bs = batches();
  auto ref = train_reference({}, std::vector<Batch>(bs.begin(), bs.begin() + 10));
  with_rank_models(3, [&](std::shared_ptr<FsdpNet>& model, std::shared_ptr<ProcessGroup> pg,
                          int rank) {
    shard(*model, model, {}, pg);
    load_full_state_dict(*model, ref->state_dict());
    const auto back = full_state_dict(*model);
    require_state("round trip rank " + std::to_string(rank), back, *ref, 0);
    const Tensor got = (*model)(bs[0].x);
    require_close("forward rank " + std::to_string(rank), got, (*ref)(bs[0].x).detach(), 1e-6);
  });
  auto plain = test::make_fsdp_net();
  nn::NamedTensors state;
  for (const auto& [name, t] : ref->state_dict()) state.emplace_back(name, t.detach().clone());
  plain->load_state_dict(state);
  require_state("plain", plain->state_dict(), *ref, 0);
}

// A sharded checkpoint of 10 steps on 4 ranks (model and Adam's state), loaded by 2 ranks and by
// 1, continues the same run: both end where 20 uninterrupted steps of one process end.
TEST(FsdpCheckpoint, ReshardsFromFourRanksToTwoAndOne) {
  const auto bs = batches();
  auto ref = train_reference({}, bs);
  test::TempDir dir;
  const std::string path = dir.file("ckpt");
  auto run = [&](int n, int first, int last, bool load, bool save) {
    with_rank_models(n, [&](std::shared_ptr<FsdpNet>& model, std::shared_ptr<ProcessGroup> pg,
                            int rank) {
      shard(*model, model, {}, pg);
      nn::optim::Adam opt(fsdp_parameters(*model), test::fsdp_adam());
      if (load) {
        const auto meta = load_model_checkpoint(path, *model, &opt);
        require(meta.at("step") == std::to_string(first), "metadata step");
      }
      for (int i = first; i < last; ++i) {
        opt.zero_grad();
        test::fsdp_loss(*model, test::slice(bs[i], rank, n)).backward();
        opt.step();
      }
      if (save) save_model_checkpoint(path, *model, &opt, *pg, {{"step", std::to_string(last)}});
      if (last == kSteps) {
        require_state(std::to_string(n) + " ranks, rank " + std::to_string(rank),
                      full_state_dict(*model), *ref, 2e-5);
      }
    });
  };
  run(4, 0, kSteps / 2, false, true);
  run(2, kSteps / 2, kSteps, true, false);
  run(1, kSteps / 2, kSteps, true, false);
  // The consolidated file is an ordinary checkpoint: a plain model and a plain Adam load it
  // (the optimizer's state by parameter name) and continue the same run.
  const std::string whole = dir.file("whole.safetensors");
  ShardedCheckpoint(path).consolidate(whole);
  EXPECT_TRUE(nn::load_safetensors(whole).contains("optim.block0.fc1.weight.exp_avg"));
  auto plain = test::make_fsdp_net();
  nn::optim::Adam opt(plain->parameters(), test::fsdp_adam());
  EXPECT_EQ(nn::load_checkpoint(whole, *plain, &opt).at("step"), std::to_string(kSteps / 2));
  for (int i = kSteps / 2; i < kSteps; ++i) {
    opt.zero_grad();
    test::fsdp_loss(*plain, bs[i]).backward();
    opt.step();
  }
  require_state("plain model from the consolidated file", plain->state_dict(), *ref, 2e-5);
}

// Bad checkpoint use is refused by name: a model of another shape, an optimizer of another type,
// a reserved metadata key, a folder without a checkpoint.
TEST(FsdpCheckpoint, MismatchesAreRefusedByName) {
  test::TempDir dir;
  const std::string path = dir.file("ckpt");
  with_rank_models(2, [&](std::shared_ptr<FsdpNet>& model, std::shared_ptr<ProcessGroup> pg, int) {
    shard(*model, model, {}, pg);
    nn::optim::Adam opt(fsdp_parameters(*model), test::fsdp_adam());
    test::require_throws_with(
        "reserved key", [&] { save_model_checkpoint(path, *model, &opt, *pg, {{"optim.x", "1"}}); },
        "is reserved");
    save_model_checkpoint(path, *model, &opt, *pg, {});
    auto deeper = test::make_fsdp_net(4);  // one block more: blocks.3 is missing
    shard(*deeper, deeper, {}, pg);
    test::require_throws_with("missing tensor",
                              [&] { load_model_checkpoint(path, *deeper, nullptr); },
                              "has no tensor 'block3.");
    nn::optim::SGD sgd(fsdp_parameters(*model), {.lr = 0.1});
    test::require_throws_with("optimizer type", [&] { load_model_checkpoint(path, *model, &sgd); },
                              "holds Adam state; the optimizer is SGD");
    test::require_throws_with("no checkpoint",
                              [&] { load_model_checkpoint(dir.file("none"), *model, nullptr); },
                              "index.json");
  });
}

TEST(FsdpErrors, RefusedWithClearMessages) {
  test::ThreadsSetup s;
  s.n = 2;
  test::run_threads(s, [&](std::shared_ptr<ProcessGroup> pg, int) {
    FullyShardOptions o{.group = pg};
    auto twice = test::make_fsdp_net(2);
    fully_shard(twice->blocks[0], o);
    test::require_throws_with("twice", [&] { fully_shard(twice->blocks[0], o); },
                              "already sharded");
    auto parent_first = test::make_fsdp_net(2);
    fully_shard(parent_first, o);
    test::require_throws_with("parent first", [&] { fully_shard(parent_first->blocks[0], o); },
                              "shard submodules before their parents");
    auto nothing = std::make_shared<nn::Sequential>(test::make_fsdp_net(1)->blocks[0]);
    fully_shard(nothing->children()[0], o);
    test::require_throws_with("no parameters", [&] { fully_shard(nothing, o); },
                              "no parameters of its own");
    test::require_throws_with("nothing sharded", [&] { fsdp_parameters(*test::make_fsdp_net(1)); },
                              "is sharded");
    test::require_throws_with("null", [&] { fully_shard(nullptr, o); }, "got null");
  });
}

// A weight tied between a sharded submodule and a module that uses it directly (an LM head
// sharing the embedding's) is refused when the parent is sharded, naming it: the submodule frees
// it after its own forward, and the head then read released memory.
TEST(FsdpErrors, AWeightTiedOutsideItsShardedModuleIsRefused) {
  test::ThreadsSetup s;
  s.n = 2;
  test::run_threads(s, [&](std::shared_ptr<ProcessGroup> pg, int) {
    FullyShardOptions o{.group = pg};
    auto root = std::make_shared<nn::Sequential>(std::make_shared<nn::Linear>(4, 4),
                                                 std::make_shared<nn::Linear>(4, 4));
    auto first = std::dynamic_pointer_cast<nn::Linear>(root->children()[0]);
    auto second = std::dynamic_pointer_cast<nn::Linear>(root->children()[1]);
    second->set_parameter("weight", first->weight);
    fully_shard(root->children()[0], o);
    test::require_throws_with(
        "tied", [&] { fully_shard(root, o); },
        "parameter '1.weight' is the same tensor as a parameter of a sharded "
        "submodule");
  });
}

// ---- HSDP: sharded within a group of ranks, replicated across the groups ---------------------

// What run_hsdp gives every rank: the variant, the mesh's shape (replicate, shard), and whether
// fully_shard takes the mesh or its two groups.
struct HsdpRun {
  Variant v;
  std::vector<int64_t> shape{2, 2};
  bool groups = false;
};

// The pieces a rank holds: (parameter, begin, end).
using Pieces = std::vector<std::tuple<std::string, int64_t, int64_t>>;

Pieces pieces_of(const nn::Module& model) {
  Pieces out;
  for (const LocalShard& s : local_shards(model)) out.emplace_back(s.name, s.begin, s.end);
  return out;
}

// This rank's HSDP training of `run` (the world is the default group): each rank trains on its
// slice of every batch, as under FSDP; returns the full state dict at the end and the pieces it
// held.
std::pair<nn::NamedTensors, Pieces> train_hsdp(const HsdpRun& run,
                                               const std::shared_ptr<FsdpNet>& model,
                                               const std::vector<Batch>& bs) {
  auto mesh = init_device_mesh("cpu", run.shape, {"replicate", "shard"});
  Variant v = run.v;
  if (run.groups) {
    v.options.group = mesh->get_group("shard");
    v.options.replicate_group = mesh->get_group("replicate");
  } else {
    v.options.mesh = mesh;
  }
  auto state = train_sharded(v, model, bs, default_group());
  return {std::move(state), pieces_of(*model)};
}

// Rank threads of one world laid out as run.shape: every rank ends where one process on the whole
// batches ends, the ranks of a replicate group hold the same pieces, and those of a shard group
// hold disjoint ones that together make every parameter whole.
void run_hsdp(const HsdpRun& run) {
  const auto bs = batches();
  auto ref = train_reference(run.v, bs);
  const int64_t replicas = run.shape[0], shards = run.shape[1];
  const int n = static_cast<int>(replicas * shards);
  std::vector<std::shared_ptr<FsdpNet>> models;
  for (int r = 0; r < n; ++r) models.push_back(test::make_fsdp_net());
  std::vector<Pieces> held(static_cast<size_t>(n));
  const std::string what = run.v.name + " on a " + std::to_string(replicas) + " x " +
                           std::to_string(shards) + (run.groups ? " layout of groups" : " mesh");
  try {
    run_rank_threads(n, [&](int rank) {
      auto [state, pieces] = train_hsdp(run, models[static_cast<size_t>(rank)], bs);
      require_state(what + ", rank " + std::to_string(rank), state, *ref, 2e-5);
      held[static_cast<size_t>(rank)] = std::move(pieces);
    });
  } catch (const RankThreadError& e) {
    FAIL() << what << ": " << e.what();
  }
  for (int64_t r = 1; r < replicas; ++r) {  // rank (r, s) holds what rank (0, s) holds
    for (int64_t k = 0; k < shards; ++k) {
      EXPECT_EQ(held[static_cast<size_t>(r * shards + k)], held[static_cast<size_t>(k)])
          << what << ": replica " << r << " of shard " << k;
    }
  }
  std::map<std::string, int64_t> covered;  // elements of each parameter, over one replica
  for (int64_t k = 0; k < shards; ++k) {
    for (const auto& [name, b, e] : held[static_cast<size_t>(k)]) covered[name] += e - b;
  }
  const nn::NamedTensors params = ref->named_parameters();
  const std::map<std::string, Tensor> by_name(params.begin(), params.end());
  EXPECT_FALSE(covered.empty()) << what;
  for (const auto& [name, count] : covered) {  // a root left unsharded holds no pieces
    EXPECT_EQ(count, by_name.at(name).numel()) << what << ": " << name;
  }
}

TEST(Hsdp, TrainsLikeOneProcess) { run_hsdp({.v = {.name = "default"}}); }

TEST(Hsdp, TheGroupsInsteadOfTheMesh) { run_hsdp({.v = {.name = "groups"}, .groups = true}); }

TEST(Hsdp, OneShardPerReplicaAndOneReplica) {
  run_hsdp({.v = {.name = "no sharding"}, .shape = {2, 1}});
  run_hsdp({.v = {.name = "no replication"}, .shape = {1, 2}});
  run_hsdp({.v = {.name = "one rank"}, .shape = {1, 1}});  // both dimensions the world's group
}

TEST(Hsdp, RootNotShardedIsAveragedOverEveryRank) {
  run_hsdp({.v = {.name = "root replicated", .shard_root = false}});
}

TEST(Hsdp, GradientAccumulationWithoutSync) { run_hsdp({.v = {.name = "no_sync", .micro = 2}}); }

TEST(Hsdp, ClipGradNormCountsEachShardOnce) { run_hsdp({.v = {.name = "clipped", .clip = 0.05}}); }

// Six ranks as 2 x 3: no flat group divides evenly into three, so every shard ends in padding.
TEST(Hsdp, ThreeShardsPerReplica) { run_hsdp({.v = {.name = "padded"}, .shape = {2, 3}}); }

// A checkpoint of 10 HSDP steps on a 2 x 2 mesh (each piece written once, though two ranks hold
// it) loaded by 2 FSDP ranks continues the same run.
TEST(Hsdp, ACheckpointLoadsIntoPlainFsdp) {
  const auto bs = batches();
  auto ref = train_reference({}, bs);
  test::TempDir dir;
  const std::string path = dir.file("ckpt");
  std::vector<std::shared_ptr<FsdpNet>> models;
  for (int r = 0; r < 4; ++r) models.push_back(test::make_fsdp_net());
  try {
    run_rank_threads(4, [&](int rank) {
      auto mesh = init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
      auto& model = models[static_cast<size_t>(rank)];
      shard(*model, model, {.options = {.mesh = mesh}}, nullptr);
      nn::optim::Adam opt(fsdp_parameters(*model), test::fsdp_adam());
      for (int i = 0; i < kSteps / 2; ++i) {
        opt.zero_grad();
        test::fsdp_loss(*model, test::slice(bs[static_cast<size_t>(i)], rank, 4)).backward();
        opt.step();
      }
      save_model_checkpoint(path, *model, &opt, *default_group(), {{"step", "10"}});
    });
  } catch (const RankThreadError& e) {
    FAIL() << "saving: " << e.what();
  }
  with_rank_models(
      2, [&](std::shared_ptr<FsdpNet>& model, std::shared_ptr<ProcessGroup> pg, int rank) {
        shard(*model, model, {}, pg);
        nn::optim::Adam opt(fsdp_parameters(*model), test::fsdp_adam());
        require(load_model_checkpoint(path, *model, &opt).at("step") == "10", "metadata step");
        for (int i = kSteps / 2; i < kSteps; ++i) {
          opt.zero_grad();
          test::fsdp_loss(*model, test::slice(bs[static_cast<size_t>(i)], rank, 2)).backward();
          opt.step();
        }
        require_state("rank " + std::to_string(rank), full_state_dict(*model), *ref, 2e-5);
      });
}

// A replicate group whose ranks hold different shards (here the whole world, over shard groups of
// two) is refused on every rank, as are a mesh beside groups, a 3-D mesh, the shard group given
// as its own replicate group, and modules of one shard group replicating differently.
TEST(HsdpErrors, RefusedWithClearMessages) {
  try {
    run_rank_threads(4, [&](int) {
      auto mesh = init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
      auto cube = init_device_mesh("cpu", {1, 2, 2});
      const auto shard_group = mesh->get_group("shard");
      auto net = [] { return test::make_fsdp_net(2); };
      test::require_throws_with(
          "mesh and group", [&] { fully_shard(net(), {.group = shard_group, .mesh = mesh}); },
          "pass either a mesh or groups");
      test::require_throws_with(
          "3-D", [&] { fully_shard(net(), {.mesh = cube}); },
          "expected a 1-D mesh (FSDP) or a 2-D mesh");
      test::require_throws_with(
          "itself",
          [&] { fully_shard(net(), {.group = shard_group, .replicate_group = shard_group}); },
          "the replicate group is the shard group");
      test::require_throws_with(
          "world",
          [&] { fully_shard(net(), {.group = shard_group, .replicate_group = default_group()}); },
          "the ranks of a replicate group must hold the same shard");
      auto model = net();
      fully_shard(model->blocks[0], {.mesh = mesh});
      test::require_throws_with(
          "mixed", [&] { fully_shard(model->blocks[1], {.group = shard_group}); },
          "must all replicate over the same group (or none)");
    });
  } catch (const RankThreadError& e) {
    FAIL() << e.what();
  }
}

// The same 2 x 2 mesh as four processes over gloo's shared memory.
TEST(HsdpProcesses, TwoByTwoOverGlooSharedMemory) {
  if (!gloo_available()) GTEST_SKIP() << "built without gloo (EMBER_WITH_GLOO=OFF)";
  test::run_gloo_world(4, [](int rank) {
    const HsdpRun run{.v = {.name = "gloo"}};
    const auto bs = batches();
    auto ref = train_reference(run.v, bs);
    const auto state = train_hsdp(run, test::make_fsdp_net(), bs).first;
    require_state("gloo rank " + std::to_string(rank), state, *ref, 2e-5);
  });
}

// A sharded module called twice in one forward (b(b(a(x)))): every module keeps training,
// as in one process (the second call restarted the forward order, and the modules before it
// were left out of the end of backward: never reduced again from the third step).
class TwiceNet : public nn::Module {
 public:
  TwiceNet() {
    a = register_module("a", std::make_shared<nn::Linear>(test::kFsdpIn, test::kWidth));
    b = register_module("b", std::make_shared<nn::Linear>(test::kWidth, test::kWidth));
    head = register_module("head", std::make_shared<nn::Linear>(test::kWidth, test::kFsdpOut));
  }
  Tensor forward(const Tensor& x) override {
    return (*head)(tanh((*b)(tanh((*b)(tanh((*a)(x)))))));
  }
  std::shared_ptr<nn::Linear> a, b, head;
};

TEST(Fsdp2, AModuleCalledTwiceInOneForwardTrainsLikeOneProcess) {
  const auto bs = test::fsdp_batches(5, 9);
  manual_seed(3);
  auto ref = std::make_shared<TwiceNet>();
  nn::NamedTensors init;  // copies: state_dict() holds the live tensors
  for (const auto& [name, t] : ref->state_dict()) init.emplace_back(name, t.detach().clone());
  nn::optim::SGD opt_ref(ref->parameters(), {.lr = 0.1});
  for (const Batch& b : bs) {
    opt_ref.zero_grad();
    test::fsdp_loss(*ref, b).backward();
    opt_ref.step();
  }
  std::vector<std::shared_ptr<TwiceNet>> models;
  for (int r = 0; r < 2; ++r) {
    models.push_back(std::make_shared<TwiceNet>());
    models.back()->load_state_dict(init);
  }
  test::ThreadsSetup s;
  s.n = 2;
  test::run_threads(s, [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto& m = models[rank];
    FullyShardOptions o{.group = pg};
    fully_shard(m->a, o);
    fully_shard(m->b, o);
    // The optimizer from the pieces and the root's own parameters (weight-decay groups do
    // this), not fsdp_parameters(): the head's gradients are still averaged.
    std::vector<Tensor> params;
    for (const auto& shard : local_shards(*m)) {
      if (shard.data.defined()) params.push_back(shard.data);
    }
    for (const Tensor& p : m->head->parameters()) params.push_back(p);
    nn::optim::SGD opt(params, {.lr = 0.1});
    for (const Batch& b : bs) {
      opt.zero_grad();
      test::fsdp_loss(*m, test::slice(b, rank, 2)).backward();
      opt.step();
    }
    require_state("rank " + std::to_string(rank), full_state_dict(*m), *ref, 2e-5);
  });
}

// module->forward(x) skips the hooks, so a resharded module's parameters are released memory:
// the process dies saying so instead of computing with zeros.
TEST(FsdpErrorsDeathTest, ForwardWithoutHooksOnReleasedParametersSaysWhy) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        test::ThreadsSetup s;
        s.n = 1;
        test::run_threads_or_throw(s, [&](std::shared_ptr<ProcessGroup> pg, int) {
          auto model = test::make_fsdp_net(1);
          fully_shard(model->blocks[0], {.group = pg});
          model->blocks[0]->forward(randn({2, test::kWidth}));
        });
      },
      "read while the module is resharded");
}

}  // namespace
}  // namespace ember::dist
