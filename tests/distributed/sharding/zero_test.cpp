// ZeroRedundancyOptimizer as a training loop uses it: DDP averages the gradients, ZeRO's Adam
// updates each rank's partition and all-gathers the parameters. Ranks are threads of this
// process (ProcessGroupThreads); models and batches are made on the main thread (the default
// random generator is shared by the threads).
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>

#include <ember/distributed/backends/process_group_gloo.h>
#include <ember/distributed/backends/process_group_mpi.h>
#include <ember/distributed/ddp/ddp.h>
#include <ember/distributed/sharding/zero.h>
#include <ember/distributed/sharding/zero_hook.h>
#include <ember/nn/layers/activation.h>
#include <ember/nn/layers/container.h>
#include <ember/nn/layers/linear.h>
#include <ember/nn/optim/adam.h>
#include <ember/nn/optim/sgd.h>
#include "tests/distributed/ddp/ddp_test_util.h"
#include "tests/distributed/backends/mpi_job.h"
#include "tests/distributed/store/store_test_util.h"
#include "tests/distributed/backends/threads_test_util.h"

namespace ember::dist {
namespace {

using nn::optim::Adam;
using nn::optim::AdamOptions;
using nn::optim::OptimizerState;
using nn::optim::ParamGroup;
using test::Batch;
using test::loss_of;
using test::require;
using test::require_close;

constexpr int64_t kBatch = 24, kIn = 6, kOut = 3;
constexpr int kSteps = 20;

// `h1`, `h2`: the hidden widths.
std::shared_ptr<nn::Sequential> make_sized_model(int64_t h1, int64_t h2) {
  manual_seed(11);
  return std::make_shared<nn::Sequential>(
      std::make_shared<nn::Linear>(kIn, h1), std::make_shared<nn::Tanh>(),
      std::make_shared<nn::Linear>(h1, h2), std::make_shared<nn::Tanh>(),
      std::make_shared<nn::Linear>(h2, kOut));
}

std::shared_ptr<nn::Sequential> make_model() { return make_sized_model(32, 16); }

std::vector<Batch> make_batches(int n, uint64_t seed) {
  std::vector<Batch> out;
  manual_seed(seed);
  for (int i = 0; i < n; ++i) out.push_back({randn({kBatch, kIn}), randn({kBatch, kOut})});
  return out;
}

AdamOptions adam_options() { return {.lr = 1e-2, .weight_decay = 1e-3}; }

ZeroRedundancyOptimizer::OptimizerFactory adam_factory() {
  return [](std::vector<ParamGroup> g) {
    return std::make_unique<Adam>(std::move(g), adam_options());
  };
}

// One process training on the whole batches with plain Adam: what every ZeRO rank must match.
struct Reference {
  std::shared_ptr<nn::Sequential> model = make_model();
  Adam opt{model->parameters(), adam_options()};
  void train(const std::vector<Batch>& batches) {
    for (const Batch& b : batches) {
      opt.zero_grad();
      loss_of(*model, b).backward();
      opt.step();
    }
  }
};

void require_params(const std::string& what, const nn::Module& m, const nn::Module& want) {
  const auto got = m.named_parameters(), ref = want.named_parameters();
  require(got.size() == ref.size(), what + ": parameter count");
  for (size_t i = 0; i < got.size(); ++i) {
    require_close(what + " " + got[i].first, got[i].second.detach().cpu(),
                  ref[i].second.detach().cpu(), 2e-5);
  }
}

test::ThreadsSetup ranks(int n) {
  test::ThreadsSetup s;
  s.n = n;
  return s;
}

class Zero : public ::testing::TestWithParam<int> {};

TEST_P(Zero, TrainsLikeOneProcessWithAdamAndShardsTheState) {
  const int n = GetParam();
  const std::vector<Batch> batches = make_batches(kSteps, 5);
  Reference ref;
  ref.train(batches);
  std::vector<std::shared_ptr<nn::Sequential>> models;
  for (int r = 0; r < n; ++r) models.push_back(make_model());
  std::mutex mu;
  std::map<int, int64_t> state_bytes;
  test::run_threads(ranks(n), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto ddp = std::make_shared<DistributedDataParallel>(models[rank], pg);
    ZeroRedundancyOptimizer opt(ddp->parameters(), adam_factory(), pg);
    // 100-byte windows: many all-gathers per step, windows cutting through parameters (every
    // rank sets the same size: it is part of the collectives' shape).
    opt.set_gather_chunk_bytes(100);
    for (const Batch& b : batches) {
      opt.zero_grad();
      loss_of(*ddp, test::slice(b, rank, n)).backward();
      opt.step();
    }
    require_params("rank " + std::to_string(rank), *models[rank], *ref.model);
    int64_t bytes = 0;
    for (const auto& [name, t] : opt.optimizer().state_dict().state) bytes += t.nbytes();
    std::lock_guard<std::mutex> lock(mu);
    state_bytes[rank] = bytes;
  });
  int64_t full = 0, total = 0, most = 0;
  for (const auto& [name, t] : ref.opt.state_dict().state) full += t.nbytes();
  for (const auto& [rank, b] : state_bytes) {
    total += b;
    most = std::max(most, b);
  }
  EXPECT_EQ(total, full) << "every parameter's state is held exactly once";
  // The partition balances bytes: no rank holds much more than its 1/n (the largest weight
  // matrix alone is over a third of the model).
  EXPECT_LE(most, full / n + full / 2) << n << " ranks";
  if (n == 2) {
    EXPECT_LT(most, full * 3 / 4);
  }
}

// One process of a multi-process group: DDP + ZeRO on its slices, then compared with one
// process on the whole batches.
void train_this_rank_and_check(const std::shared_ptr<ProcessGroup>& pg, const std::string& what) {
  const int rank = pg->rank(), n = pg->size();
  const std::vector<Batch> batches = make_batches(kSteps, 5);
  Reference ref;
  ref.train(batches);
  auto model = make_model();
  auto ddp = std::make_shared<DistributedDataParallel>(model, pg);
  ZeroRedundancyOptimizer opt(ddp->parameters(), adam_factory(), pg);
  for (const Batch& b : batches) {
    opt.zero_grad();
    loss_of(*ddp, test::slice(b, rank, n)).backward();
    opt.step();
  }
  require_params(what + " rank " + std::to_string(rank) + " of " + std::to_string(n), *model,
                 *ref.model);
}

// The same over gloo between processes, through shared memory and over TCP (2 ranks), and over
// shared memory with 4.
TEST(ZeroGloo, TrainsLikeOneProcessOverSharedMemoryAndTcp) {
  if (!gloo_available()) GTEST_SKIP() << "built without gloo (EMBER_WITH_GLOO=OFF)";
  for (auto [n, shm] : {std::pair{2, true}, std::pair{2, false}, std::pair{4, true}}) {
    test::run_gloo_ranks(
        n,
        [&](std::shared_ptr<ProcessGroupGloo> pg, int) {
          train_this_rank_and_check(pg, shm ? "shm" : "tcp");
        },
        shm);
  }
}

// Over MPI: the ZeroMpiWorld cases (run by ctest) start mpirun on this binary, whose every rank
// runs the ZeroMpiRanks cases.
TEST(ZeroMpiWorld, Np2) {
  test::expect_mpi_job_passes(2, "ZeroMpiRanks.*", std::chrono::seconds(240),
                              ProcessGroupMpi::is_available());
}
TEST(ZeroMpiWorld, Np4) {
  test::expect_mpi_job_passes(4, "ZeroMpiRanks.*", std::chrono::seconds(240),
                              ProcessGroupMpi::is_available());
}

TEST(ZeroMpiRanks, TrainsLikeOneProcess) {
  SKIP_UNLESS_UNDER_MPIRUN();
  train_this_rank_and_check(ProcessGroupMpi::create(), "mpi");
}

INSTANTIATE_TEST_SUITE_P(Ranks, Zero, ::testing::Values(2, 4),
                         [](const auto& info) { return "n" + std::to_string(info.param); });

// Trains 10 steps on 4 ranks, consolidates, and continues from that state on 2 ranks and on a
// plain Adam: both end where 20 uninterrupted steps of one process end.
TEST(ZeroCheckpoint, ConsolidatedStateReshardsToAnotherWorldSizeAndToAPlainOptimizer) {
  const std::vector<Batch> batches = make_batches(kSteps, 6);
  const std::vector<Batch> first(batches.begin(), batches.begin() + kSteps / 2);
  const std::vector<Batch> rest(batches.begin() + kSteps / 2, batches.end());
  Reference ref;
  ref.train(batches);

  std::vector<std::shared_ptr<nn::Sequential>> models4;
  for (int r = 0; r < 4; ++r) models4.push_back(make_model());
  OptimizerState saved;
  nn::NamedTensors saved_params;
  test::run_threads(ranks(4), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto ddp = std::make_shared<DistributedDataParallel>(models4[rank], pg);
    ZeroRedundancyOptimizer opt(ddp->parameters(), adam_factory(), pg);
    for (const Batch& b : first) {
      opt.zero_grad();
      loss_of(*ddp, test::slice(b, rank, 4)).backward();
      opt.step();
    }
    try {
      (void)opt.state_dict();
      require(false, "state_dict before consolidate_state_dict must throw");
    } catch (const ValueError& e) {
      require(std::string(e.what()).find("consolidate_state_dict") != std::string::npos,
              e.what());
    }
    opt.consolidate_state_dict(1);
    if (rank == 1) {
      saved = opt.state_dict();
      for (auto& [name, t] : saved.state) t = t.clone();
      saved_params = models4[rank]->named_parameters();
      for (auto& [name, t] : saved_params) t = t.detach().clone();
    } else {
      try {
        (void)opt.state_dict();
        require(false, "state_dict on a rank other than `to` must throw");
      } catch (const ValueError&) {
      }
    }
  });
  ASSERT_EQ(saved.type, "Adam");

  auto load_params = [&](nn::Module& m) {
    NoGradGuard no_grad;
    const auto params = m.named_parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      Tensor p = params[i].second;
      p.copy_(saved_params[i].second);
    }
  };
  // A plain Adam over the whole model takes the consolidated state as it is.
  {
    auto model = make_model();
    load_params(*model);
    Adam plain(model->parameters(), adam_options());
    plain.load_state_dict(saved);
    for (const Batch& b : rest) {
      plain.zero_grad();
      loss_of(*model, b).backward();
      plain.step();
    }
    require_params("plain Adam resumed", *model, *ref.model);
  }
  // Two ranks each take their part.
  std::vector<std::shared_ptr<nn::Sequential>> models2{make_model(), make_model()};
  for (auto& m : models2) load_params(*m);
  test::run_threads(ranks(2), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto ddp = std::make_shared<DistributedDataParallel>(models2[rank], pg);
    ZeroRedundancyOptimizer opt(ddp->parameters(), adam_factory(), pg);
    opt.load_state_dict(saved);
    for (const Batch& b : rest) {
      opt.zero_grad();
      loss_of(*ddp, test::slice(b, rank, 2)).backward();
      opt.step();
    }
    require_params("2 ranks resumed, rank " + std::to_string(rank), *models2[rank], *ref.model);
  });
}

// add_param_group mid-training (a layer unfrozen): the new group is partitioned after the others
// and trains as a plain Adam's added group does. Every rank computes the whole batch's gradient
// (no DDP: its buckets are fixed at construction).
TEST_P(Zero, AddParamGroupTrainsLikeAPlainOptimizersAddedGroup) {
  const int n = GetParam();
  const std::vector<Batch> batches = make_batches(kSteps, 9);
  auto split = [](nn::Module& m) {
    std::vector<Tensor> all = m.parameters();
    return std::make_pair(std::vector<Tensor>(all.begin(), all.begin() + 4),
                          std::vector<Tensor>(all.begin() + 4, all.end()));
  };
  const nn::optim::GroupOptions head_options = {{"lr", 5e-3}};
  auto ref_model = make_model();
  auto [ref_body, ref_head] = split(*ref_model);
  Adam ref_opt(ref_body, adam_options());
  for (int i = 0; i < kSteps; ++i) {
    if (i == kSteps / 2) ref_opt.add_param_group(ParamGroup(ref_head, head_options));
    ref_opt.zero_grad();
    loss_of(*ref_model, batches[i]).backward();
    ref_opt.step();
  }
  std::vector<std::shared_ptr<nn::Sequential>> models;
  for (int r = 0; r < n; ++r) models.push_back(make_model());
  test::run_threads(ranks(n), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto [body, head] = split(*models[rank]);
    ZeroRedundancyOptimizer opt(std::vector<ParamGroup>{ParamGroup(body)}, adam_factory(), pg);
    std::vector<int> owners;
    for (size_t i = 0; i < body.size(); ++i) owners.push_back(opt.rank_of(i));
    for (int i = 0; i < kSteps; ++i) {
      if (i == kSteps / 2) {
        opt.add_param_group(ParamGroup(head, head_options));
        for (size_t k = 0; k < body.size(); ++k) {
          require(opt.rank_of(k) == owners[k], "an earlier parameter moved to another rank");
        }
        require(opt.optimizer().param_groups().size() == 2 &&
                    opt.optimizer().param_groups()[1].lr() == 5e-3,
                "the wrapped optimizer's new group");
      }
      opt.zero_grad();
      loss_of(*models[rank], batches[i]).backward();
      opt.step();
    }
    require_params("rank " + std::to_string(rank), *models[rank], *ref_model);
    // Its state consolidates as the plain optimizer's, two groups and all.
    opt.consolidate_state_dict(0);
    if (rank == 0) {
      const OptimizerState got = opt.state_dict(), want = ref_opt.state_dict();
      require(nlohmann::json::parse(got.param_groups) == nlohmann::json::parse(want.param_groups),
              "param_groups: " + got.param_groups + " vs " + want.param_groups);
      require(got.state.size() == want.state.size(), "state entries");
    }
    // Refused, on every rank alike: a parameter held already, an empty group.
    for (auto& [what, group] : std::vector<std::pair<std::string, ParamGroup>>{
             {"appears twice", ParamGroup(head)},
             {"no parameters", ParamGroup(std::vector<Tensor>{})}}) {
      try {
        opt.add_param_group(group);
        require(false, "add_param_group must refuse: " + what);
      } catch (const ValueError& e) {
        require(std::string(e.what()).find(what) != std::string::npos, e.what());
      }
    }
    require(opt.optimizer().param_groups().size() == 2, "a refused group was added");
  });
}

TEST(ZeroErrors, TooFewParametersForTheRanksAndBadStates) {
  test::run_threads(ranks(4), [&](std::shared_ptr<ProcessGroup> pg, int) {
    manual_seed(1);
    Tensor a = randn({3}).requires_grad_(true), b = randn({2}).requires_grad_(true);
    try {
      ZeroRedundancyOptimizer opt(std::vector<Tensor>{a, b}, adam_factory(), pg);
      require(false, "2 parameters over 4 ranks must be refused");
    } catch (const ValueError& e) {
      require(std::string(e.what()).find("would get none") != std::string::npos, e.what());
    }
  });
  test::run_threads(ranks(2), [&](std::shared_ptr<ProcessGroup> pg, int) {
    auto model = make_model();
    ZeroRedundancyOptimizer opt(model->parameters(), adam_factory(), pg);
    OptimizerState sgd = nn::optim::SGD(model->parameters(), {.lr = 0.1}).state_dict();
    try {
      opt.load_state_dict(sgd);
      require(false, "an SGD state must not load into Adam");
    } catch (const ValueError& e) {
      require(std::string(e.what()).find("SGD") != std::string::npos, e.what());
    }
    try {
      opt.consolidate_state_dict(2);
      require(false, "rank 2 is not in a group of 2");
    } catch (const ValueError&) {
    }
  });
}

// ---- overlap_with_ddp: updates from DDP's communication hook (distributed/sharding/zero_hook.h) -------

// Buckets of about 256 bytes: the model spreads over several, and DDP's rebuild after the first
// iteration regroups them (the overlap must not care).
DDPOptions small_buckets(bool bucket_view = false) {
  DDPOptions o;
  o.gradient_as_bucket_view = bucket_view;
  o.bucket_cap_mb = 0.25 / 1024;
  o.first_bucket_cap_mb = 0.125 / 1024;
  return o;
}

ZeroOptions overlapped() { return ZeroOptions{.overlap_with_ddp = true}; }

// A hidden weight of 80 KiB: the hook broadcasts it where it lies, and packs the small
// parameters.
std::shared_ptr<nn::Sequential> make_wide_model() { return make_sized_model(160, 128); }

// What one rank trains twice: plain DDP (with the hook) + Adam, and DDP with
// hook_with_zero_step(hook) + an overlapped ZeRO(Adam). Made before the ranks start (threads
// share the default generator).
struct OverlapCase {
  explicit OverlapCase(std::shared_ptr<nn::Sequential> (*make)() = make_model)
      : plain(make()), overlap(make()) {}
  std::vector<Batch> batches;  // `accumulate` per step
  std::shared_ptr<nn::Sequential> plain, overlap;
};

// Each step: accumulate - 1 backward passes under no_sync(), then a synchronised one, then
// step(); both runs must end with the same parameters, and each rank's optimizer state is
// 1/n of the model's (the state is sharded, as without overlap).
// `dev`: where the models and batches are (each rank thread's current stream when CUDA).
void train_both_and_compare(const std::shared_ptr<ProcessGroup>& pg, OverlapCase& c,
                            const CommHook& hook, int accumulate, const std::string& what,
                            bool bucket_view = false, Device dev = kCPU) {
  const int rank = pg->rank(), n = pg->size();
  c.plain->to(dev);
  c.overlap->to(dev);
  auto run = [&](auto&& zero_grad, auto&& step, DistributedDataParallel& ddp) {
    for (size_t s = 0; s + static_cast<size_t>(accumulate) <= c.batches.size(); s += accumulate) {
      zero_grad();
      for (int m = 0; m < accumulate; ++m) {
        const Batch b = test::to_device(test::slice(c.batches[s + m], rank, n), dev);
        if (m + 1 < accumulate) {
          auto guard = ddp.no_sync();
          loss_of(ddp, b).backward();
        } else {
          loss_of(ddp, b).backward();
        }
      }
      step();
    }
  };
  {
    auto ddp = std::make_shared<DistributedDataParallel>(c.plain, pg, small_buckets(bucket_view));
    ddp->register_comm_hook(hook);
    Adam opt(ddp->parameters(), adam_options());
    run([&] { opt.zero_grad(); }, [&] { opt.step(); }, *ddp);
  }
  auto ddp = std::make_shared<DistributedDataParallel>(c.overlap, pg, small_buckets(bucket_view));
  ZeroRedundancyOptimizer zero(ddp->parameters(), adam_factory(), pg, overlapped());
  ddp->register_comm_hook(hook_with_zero_step(hook, *ddp, zero));
  run([&] { zero.zero_grad(); }, [&] { zero.step(); }, *ddp);
  require(ddp->buckets_rebuilt() && ddp->bucket_indices().size() > 2,
          what + ": expected several buckets, rebuilt once; got " +
              std::to_string(ddp->bucket_indices().size()) +
              (ddp->buckets_rebuilt() ? " rebuilt" : " not rebuilt"));
  require_params(what + " rank " + std::to_string(rank) + " of " + std::to_string(n), *c.overlap,
                 *c.plain);
  test::require_same_on_all_ranks(*pg, *c.overlap);
}

std::vector<std::pair<std::string, CommHook>> inner_hooks() {
  return {{"allreduce", allreduce_hook}, {"fp16", fp16_compress_hook}};
}

class ZeroOverlap : public ::testing::TestWithParam<int> {};

// 20 steps (no skipped iteration: the first two count too) equal plain DDP + Adam with the same
// inner hook, on rank threads, parameters sent packed and where they lie; once more with every
// collective's result held back 1 ms (the received parameters must be waited for).
TEST_P(ZeroOverlap, TrainsLikeDdpWithAdamForEachInnerHook) {
  const int n = GetParam();
  for (const auto& [name, hook] : inner_hooks()) {
    for (bool delayed : {false, true}) {
      std::vector<OverlapCase> cases;
      for (int r = 0; r < n; ++r) {
        cases.emplace_back(make_wide_model);
        cases.back().batches = make_batches(kSteps, 5);
      }
      test::ThreadsSetup s = ranks(n);
      if (delayed) s.delay = DelayOptions{.cycles = 0, .cpu_delay = std::chrono::milliseconds(1)};
      const std::string what = name + (delayed ? " delayed" : "");
      test::run_threads(s, [&](std::shared_ptr<ProcessGroup> pg, int rank) {
        train_both_and_compare(pg, cases[static_cast<size_t>(rank)], hook, 1, what);
      });
    }
  }
}

// Gradient accumulation: the backward passes under no_sync() run no hook and update nothing;
// the synchronised one that ends the accumulation reduces the summed gradients and updates, as
// plain DDP + Adam does with step() after it. Also with gradient_as_bucket_view (grad() is then
// the bucket the hook reduces and the step reads).
TEST_P(ZeroOverlap, AccumulatesUnderNoSyncAndUpdatesAtTheSynchronisedBackward) {
  const int n = GetParam();
  for (bool bucket_view : {false, true}) {
    std::vector<OverlapCase> cases(static_cast<size_t>(n));
    for (auto& c : cases) c.batches = make_batches(3 * 8, 7);
    test::run_threads(ranks(n), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
      train_both_and_compare(pg, cases[static_cast<size_t>(rank)], allreduce_hook, 3,
                             bucket_view ? "no_sync x3, bucket view" : "no_sync x3", bucket_view);
    });
  }
}

// Over MPI (a rank of the ZeroMpiWorld jobs above).
TEST(ZeroMpiRanks, OverlapTrainsLikeDdpWithAdam) {
  SKIP_UNLESS_UNDER_MPIRUN();
  auto pg = ProcessGroupMpi::create();
  OverlapCase c;
  c.batches = make_batches(kSteps, 5);
  train_both_and_compare(pg, c, allreduce_hook, 1, "mpi");
}

INSTANTIATE_TEST_SUITE_P(Ranks, ZeroOverlap, ::testing::Values(2, 4),
                         [](const auto& info) { return "n" + std::to_string(info.param); });

// On the parameters' device: 2 rank threads (on cuda:0 each with its own stream) through a
// DelayingGroup. ZeRO without overlap (4 KiB gather windows: several all-gathers into the
// parameters per step, cutting through them) and with overlap_with_ddp (packed and direct
// broadcasts of the parameters) end where DDP + Adam on the same device ends; the optimizer
// state is on that device and consolidates to rank 0.
void plain_and_overlapped_train_like_ddp_on(Device dev) {
  constexpr int n = 2;
  test::ThreadsSetup s = ranks(n);
  s.device = dev;
  // Every result held back (on the GPU behind a spin on the group's stream): a missing wait or
  // stream wait reads the old values.
  s.delay = DelayOptions{.cycles = 5'000'000, .cpu_delay = std::chrono::milliseconds(1)};
  std::vector<OverlapCase> overlap, plain;
  for (int r = 0; r < n; ++r) {
    overlap.emplace_back(make_wide_model);
    overlap.back().batches = make_batches(kSteps, 5);
    plain.emplace_back(make_wide_model);
    plain.back().batches = make_batches(kSteps, 5);
  }
  test::run_threads(s, [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    const std::string what = dev.str() + " rank " + std::to_string(rank);
    train_both_and_compare(pg, overlap[static_cast<size_t>(rank)], allreduce_hook, 1,
                           what + " overlap", false, dev);
    OverlapCase& c = plain[static_cast<size_t>(rank)];
    c.plain->to(dev);
    c.overlap->to(dev);
    auto train = [&](DistributedDataParallel& ddp, auto& opt) {
      for (const Batch& b : c.batches) {
        opt.zero_grad();
        loss_of(ddp, test::to_device(test::slice(b, rank, n), dev)).backward();
        opt.step();
      }
    };
    auto ddp = std::make_shared<DistributedDataParallel>(c.plain, pg);
    Adam adam(ddp->parameters(), adam_options());
    train(*ddp, adam);
    auto zddp = std::make_shared<DistributedDataParallel>(c.overlap, pg);
    ZeroRedundancyOptimizer zero(zddp->parameters(), adam_factory(), pg);
    zero.set_gather_chunk_bytes(4096);
    train(*zddp, zero);
    require_params(what + " plain", *c.overlap, *c.plain);
    test::require_same_on_all_ranks(*pg, *c.overlap);
    for (const auto& [name, t] : zero.optimizer().state_dict().state) {
      if (name.find("exp_avg") != std::string::npos) {
        require(t.device() == dev, what + ": " + name + " is on " + t.device().str());
      }
    }
    zero.consolidate_state_dict(0);
    if (rank != 0) return;
    require(zero.state_dict().state.size() == adam.state_dict().state.size(),
            what + ": the consolidated state has " +
                std::to_string(zero.state_dict().state.size()) + " entries, plain Adam's " +
                std::to_string(adam.state_dict().state.size()));
  });
}

TEST(ZeroCuda, PlainAndOverlappedTrainLikeDdpWithAdamOnTheGpu) {
  EMBER_REQUIRE_CUDA();
  plain_and_overlapped_train_like_ddp_on(cuda_device(0));
}
TEST(ZeroDevices, PlainAndOverlappedTrainLikeDdpWithAdamOnTheCpu) {
  plain_and_overlapped_train_like_ddp_on(kCPU);
}

// The same between gloo processes (shared memory with 2 and 4 ranks, TCP with 2), both hooks;
// and with EMBER_DISTRIBUTED_DEBUG=DETAIL, whose cross-rank checks see the hook's broadcasts
// among DDP's collectives.
TEST(ZeroOverlapGloo, TrainsLikeDdpWithAdamOverSharedMemoryAndTcp) {
  if (!gloo_available()) GTEST_SKIP() << "built without gloo (EMBER_WITH_GLOO=OFF)";
  for (auto [n, shm, detail] : {std::tuple{2, true, false}, std::tuple{2, false, false},
                                std::tuple{4, true, false}, std::tuple{2, true, true}}) {
    test::run_gloo_ranks(
        n,
        [&](std::shared_ptr<ProcessGroupGloo> pg, int) {
          if (detail) ::setenv("EMBER_DISTRIBUTED_DEBUG", "DETAIL", 1);  // this child only
          for (const auto& [name, hook] : inner_hooks()) {
            OverlapCase c(make_wide_model);
            c.batches = make_batches(kSteps, 5);
            train_both_and_compare(pg, c, hook, 1, name + (shm ? " shm" : " tcp"));
          }
        },
        shm);
  }
}

// Uneven inputs: under ddp.join() the rank that ran out of data shadows the others' buckets
// through the same hook, so it still steps and sends its share of each update (plain ZeRO's
// step() would wait for it in vain). Every rank ends where plain DDP + Adam ends.
TEST(ZeroOverlapJoin, UnevenInputsEndLikeDdpWithAdam) {
  const std::vector<Batch> batches = make_batches(6, 10);
  const std::vector<size_t> count{6, 3};  // batches per rank
  std::vector<std::shared_ptr<nn::Sequential>> plain, overlap;
  for (int r = 0; r < 2; ++r) {
    plain.push_back(make_model());
    overlap.push_back(make_model());
  }
  test::run_threads(ranks(2), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto train = [&](DistributedDataParallel& ddp, auto&& zero_grad, auto&& step) {
      ddp.join([&] {
        for (size_t t = 0; t < count[static_cast<size_t>(rank)]; ++t) {
          zero_grad();
          loss_of(ddp, test::slice(batches[t], rank, 2)).backward();
          step();
        }
      });
    };
    auto ddp_plain = std::make_shared<DistributedDataParallel>(plain[rank], pg, small_buckets());
    ddp_plain->register_comm_hook(allreduce_hook);
    Adam opt(ddp_plain->parameters(), adam_options());
    train(*ddp_plain, [&] { opt.zero_grad(); }, [&] { opt.step(); });
    auto ddp = std::make_shared<DistributedDataParallel>(overlap[rank], pg, small_buckets());
    ZeroRedundancyOptimizer zero(ddp->parameters(), adam_factory(), pg, overlapped());
    ddp->register_comm_hook(hook_with_zero_step(allreduce_hook, *ddp, zero));
    train(*ddp, [&] { zero.zero_grad(); }, [&] { zero.step(); });
    require_params("join, rank " + std::to_string(rank), *overlap[rank], *plain[rank]);
  });
}

// Checkpoints in overlap mode: the consolidated state is plain DDP + Adam's; it goes stale with
// the next update (made by the backward pass, counted at once).
TEST(ZeroOverlapCheckpoint, ConsolidatesThePlainOptimizersState) {
  const std::vector<Batch> batches = make_batches(kSteps / 2, 8);
  std::vector<std::shared_ptr<nn::Sequential>> plain, overlap;
  for (int r = 0; r < 2; ++r) {
    plain.push_back(make_model());
    overlap.push_back(make_model());
  }
  test::run_threads(ranks(2), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto ddp_plain = std::make_shared<DistributedDataParallel>(plain[rank], pg);
    Adam opt(ddp_plain->parameters(), adam_options());
    auto ddp = std::make_shared<DistributedDataParallel>(overlap[rank], pg, small_buckets());
    ZeroRedundancyOptimizer zero(ddp->parameters(), adam_factory(), pg, overlapped());
    ddp->register_comm_hook(hook_with_zero_step(allreduce_hook, *ddp, zero));
    for (const Batch& b : batches) {
      opt.zero_grad();
      loss_of(*ddp_plain, test::slice(b, rank, 2)).backward();
      opt.step();
      zero.zero_grad();
      loss_of(*ddp, test::slice(b, rank, 2)).backward();
      zero.step();
    }
    zero.consolidate_state_dict(0);
    if (rank == 0) {
      const OptimizerState got = zero.state_dict(), want = opt.state_dict();
      require(got.type == want.type && got.state.size() == want.state.size(),
              "consolidated state: type or entry count differs");
      for (size_t i = 0; i < got.state.size(); ++i) {
        require(got.state[i].first == want.state[i].first,
                "entry " + got.state[i].first + " vs " + want.state[i].first);
        require_close(got.state[i].first, got.state[i].second, want.state[i].second, 2e-5);
      }
    }
    loss_of(*ddp, test::slice(batches[0], rank, 2)).backward();  // updates: the state is stale
    if (rank == 0) {
      try {
        (void)zero.state_dict();
        require(false, "state_dict after an overlapped update must throw");
      } catch (const ValueError& e) {
        require(std::string(e.what()).find("consolidate again") != std::string::npos, e.what());
      }
    }
  });
}

template <typename F>
void require_value_error(const std::string& what, const std::string& needle, F&& f) {
  try {
    f();
  } catch (const ValueError& e) {
    require(std::string(e.what()).find(needle) != std::string::npos,
            what + ": the error should mention '" + needle + "': " + e.what());
    return;
  }
  require(false, what + ": expected ValueError");
}

TEST(ZeroOverlapErrors, NoHookPlainOptimizerOtherParametersNoSyncStepDestroyedOptimizer) {
  const std::vector<Batch> batches = make_batches(2, 9);
  std::vector<std::shared_ptr<nn::Sequential>> models{make_model(), make_model()};
  test::run_threads(ranks(2), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    const Batch b = test::slice(batches[0], rank, 2);
    {  // overlap_with_ddp, but DDP has no hook: step() says what to register
      auto ddp = std::make_shared<DistributedDataParallel>(models[rank], pg);
      ZeroRedundancyOptimizer zero(ddp->parameters(), adam_factory(), pg, overlapped());
      loss_of(*ddp, b).backward();
      require_value_error("no hook", "register_comm_hook(dist::hook_with_zero_step",
                          [&] { zero.step(); });
    }
    auto ddp = std::make_shared<DistributedDataParallel>(models[rank], pg);
    {  // a ZeRO without overlap_with_ddp would update twice
      ZeroRedundancyOptimizer plain(ddp->parameters(), adam_factory(), pg);
      require_value_error("not overlapped", "overlap_with_ddp",
                          [&] { (void)hook_with_zero_step(allreduce_hook, *ddp, plain); });
    }
    {  // DDP trains a parameter the optimizer does not hold, and the other way round
      std::vector<Tensor> some = ddp->parameters();
      some.pop_back();
      ZeroRedundancyOptimizer fewer(some, adam_factory(), pg, overlapped());
      require_value_error("fewer", "'module.4.bias'",
                          [&] { (void)hook_with_zero_step(allreduce_hook, *ddp, fewer); });
      std::vector<Tensor> more = ddp->parameters();
      more.push_back(zeros({5}).requires_grad_(true));
      ZeroRedundancyOptimizer extra(more, adam_factory(), pg, overlapped());
      require_value_error("more", "parameter 6 (shape [5])",
                          [&] { (void)hook_with_zero_step(allreduce_hook, *ddp, extra); });
    }
    require_value_error("null hook", "expects a hook", [&] {
      ZeroRedundancyOptimizer zero(ddp->parameters(), adam_factory(), pg, overlapped());
      (void)hook_with_zero_step(nullptr, *ddp, zero);
    });
    // step() after a backward under no_sync() only: nothing was updated.
    ZeroRedundancyOptimizer zero(ddp->parameters(), adam_factory(), pg, overlapped());
    ddp->register_comm_hook(hook_with_zero_step(allreduce_hook, *ddp, zero));
    loss_of(*ddp, b).backward();
    zero.step();
    {
      auto guard = ddp->no_sync();
      loss_of(*ddp, b).backward();
    }
    require_value_error("no_sync", "no_sync()", [&] { zero.step(); });
    loss_of(*ddp, b).backward();
    zero.step();  // the synchronised backward updated: fine again
  });
  // The optimizer destroyed while DDP keeps its hook: the next backward says so (on every rank,
  // before any collective).
  std::vector<std::shared_ptr<nn::Sequential>> more{make_model(), make_model()};
  test::run_threads(ranks(2), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto ddp = std::make_shared<DistributedDataParallel>(more[rank], pg);
    {
      ZeroRedundancyOptimizer zero(ddp->parameters(), adam_factory(), pg, overlapped());
      ddp->register_comm_hook(hook_with_zero_step(allreduce_hook, *ddp, zero));
    }
    require_value_error("destroyed", "was destroyed",
                        [&] { loss_of(*ddp, test::slice(batches[1], rank, 2)).backward(); });
  });
}

}  // namespace
}  // namespace ember::dist
