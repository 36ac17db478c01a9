// DistributedDataParallel over gloo with 1-3 real processes on 127.0.0.1. Each rank trains on its
// slice of a fixed batch; every check compares against a single-process reference computed in
// the same rank on the full batch (mean loss), so expected values need no literals.
#include <ember/distributed/backends/shareable.h>
#include <ember/distributed/ddp/ddp.h>
#include <ember/distributed/forwarding_process_group.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>

#include <ember/distributed/backends/process_group_gloo.h>
#include <ember/distributed/store/prefix_store.h>
#include <ember/distributed/store/tcp_store.h>
#include <ember/nn/layers/activation.h>
#include <ember/nn/layers/container.h>
#include <ember/nn/functional.h>
#include <ember/nn/layers/linear.h>
#include <ember/nn/optim/sgd.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops/random.h>
#include "tests/distributed/ddp/ddp_test_util.h"
#include "tests/distributed/store/store_test_util.h"
#include "tests/distributed/require_gloo.h"

namespace ember::dist {
namespace {

using namespace std::chrono_literals;
using test::require;
using test::require_close;
using test::require_same_on_all_ranks;
using test::Batch;
using test::slice;
using test::loss_of;

constexpr int64_t kBatch = 12;  // divisible by 1, 2 and 3 ranks
constexpr int64_t kIn = 5;
constexpr int64_t kOut = 3;

void run_group(int n, const std::function<void(std::shared_ptr<ProcessGroup>, int)>& body,
               bool shm = true) {
  test::run_gloo_ranks(
      n, [&](std::shared_ptr<ProcessGroupGloo> pg, int rank) { body(pg, rank); }, shm);
}

/// World size, and whether gloo runs over shared memory (DDP then all-reduces gradients where
/// they lie, Note [DDP in place]) or TCP (DDP's flat buckets).
struct DDPCase {
  int n;
  bool shm;
};
void PrintTo(const DDPCase& c, std::ostream* os) {
  *os << c.n << (c.n == 1 ? " rank" : " ranks") << (c.shm ? ", shared memory" : ", tcp");
}
void run_group(const DDPCase& c,
               const std::function<void(std::shared_ptr<ProcessGroup>, int)>& body) {
  run_group(c.n, body, c.shm);
}

// A small MLP; its initial weights depend on the seed.
std::shared_ptr<nn::Sequential> make_model(uint64_t seed, int64_t hidden = 7) {
  manual_seed(seed);
  return std::make_shared<nn::Sequential>(
      std::make_shared<nn::Linear>(kIn, hidden), std::make_shared<nn::Tanh>(),
      std::make_shared<nn::Linear>(hidden, 4), std::make_shared<nn::Tanh>(),
      std::make_shared<nn::Linear>(4, kOut));
}

// A copy of `m`'s current weights in a fresh model.
std::shared_ptr<nn::Sequential> clone_model(const nn::Module& m, int64_t hidden = 7) {
  auto c = make_model(999, hidden);
  c->load_state_dict(m.state_dict());
  return c;
}

Batch fixed_batch(uint64_t seed, int64_t rows = kBatch) {
  manual_seed(seed);
  return {randn({rows, kIn}), randn({rows, kOut})};
}



void require_grads_match(const std::string& what, const nn::Module& got, const nn::Module& ref) {
  const auto a = got.named_parameters();
  const auto b = ref.named_parameters();
  require(a.size() == b.size(), what + ": parameter count");
  for (size_t i = 0; i < a.size(); ++i) {
    require_close(what + " grad of " + a[i].first, a[i].second.grad(), b[i].second.grad());
  }
}

// Every rank's flattened parameters, gathered; throws unless all ranks hold identical bits.

class DDPWorld : public ::testing::TestWithParam<DDPCase> {};

// (a) one step: every rank's grads equal the full-batch gradient of one process.
TEST_P(DDPWorld, GradientsEqualFullBatchGradient) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam().n;
  run_group(GetParam(), [n](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto model = make_model(100 + rank);  // different on every rank: DDP broadcasts rank 0's
    DistributedDataParallel ddp(model, pg);
    auto ref = clone_model(*model);
    const Batch b = fixed_batch(7);
    loss_of(*ref, b).backward();
    loss_of(ddp, slice(b, rank, n)).backward();
    require_grads_match("rank " + std::to_string(rank), *model, *ref);
    // The reference has rank 0's initial weights on every rank.
    auto rank0 = make_model(100);
    const auto p0 = rank0->named_parameters();
    const auto p = model->named_parameters();
    for (size_t i = 0; i < p.size(); ++i)
      require_close("initial " + p[i].first, p[i].second, p0[i].second, 0);
  });
}

// (b) several SGD steps from different seeds: identical parameters on all ranks, equal to
// single-process training on the full batch.
TEST_P(DDPWorld, SgdStepsKeepRanksIdentical) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam().n;
  run_group(GetParam(), [n](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto model = make_model(200 + rank);
    auto ddp = std::make_shared<DistributedDataParallel>(model, pg);
    auto ref = clone_model(*model);
    nn::optim::SGD opt(ddp->parameters(), {.lr = 0.1, .momentum = 0.9});
    nn::optim::SGD ref_opt(ref->parameters(), {.lr = 0.1, .momentum = 0.9});
    for (int step = 0; step < 5; ++step) {
      const Batch b = fixed_batch(50 + step);
      opt.zero_grad();
      ref_opt.zero_grad();
      loss_of(*ddp, slice(b, rank, n)).backward();
      loss_of(*ref, b).backward();
      opt.step();
      ref_opt.step();
    }
    require_same_on_all_ranks(*pg, *model);
    const auto a = model->named_parameters();
    const auto r = ref->named_parameters();
    for (size_t i = 0; i < a.size(); ++i)
      require_close("trained " + a[i].first, a[i].second, r[i].second, 1e-4);
  });
}

// (c) a tiny bucket cap gives one bucket per parameter (in reverse order) and the same grads.
TEST_P(DDPWorld, SmallBucketsGiveSameGradients) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam().n;
  run_group(GetParam(), [n](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto model = make_model(300 + rank, 40);
    // Reverse order with a 50-byte cap: [4.bias 12 B, 4.weight 48 B], [2.bias 16 B,
    // 2.weight 640 B], [0.bias 160 B], [0.weight 800 B].
    DDPOptions o;
    o.bucket_cap_mb = 50.0 / (1024 * 1024);
    DistributedDataParallel ddp(model, pg, o);
    const auto buckets = ddp.bucket_indices();
    require(buckets.size() == 4, "expected 4 buckets, got " + std::to_string(buckets.size()));
    std::vector<size_t> order;
    for (const auto& bk : buckets) order.insert(order.end(), bk.begin(), bk.end());
    require(order.size() == 6, "every parameter in one bucket");
    for (size_t i = 0; i < order.size(); ++i) require(order[i] == 5 - i, "reverse order");

    auto ref = clone_model(*model, 40);
    const Batch b = fixed_batch(8);
    for (int it = 0; it < 2; ++it) {  // a second iteration reuses the buckets
      model->zero_grad();
      ref->zero_grad();
      loss_of(*ref, b).backward();
      loss_of(ddp, slice(b, rank, n)).backward();
      require_grads_match("iteration " + std::to_string(it), *model, *ref);
    }
  });
}

// (d) no_sync accumulates locally; the next synced backward averages the accumulated grads.
TEST_P(DDPWorld, NoSyncThenSyncEqualsCombinedBatches) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam().n;
  run_group(GetParam(), [n](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto model = make_model(400 + rank);
    DistributedDataParallel ddp(model, pg);
    auto ref = clone_model(*model);
    const Batch b1 = fixed_batch(11), b2 = fixed_batch(12);
    {
      auto guard = ddp.no_sync();
      loss_of(ddp, slice(b1, rank, n)).backward();
    }
    if (n > 1) {
      // Under no_sync nothing was averaged: the local grad is this rank's slice gradient.
      auto local = clone_model(*model);
      loss_of(*local, slice(b1, rank, n)).backward();
      require_grads_match("local after no_sync", *model, *local);
    }
    loss_of(ddp, slice(b2, rank, n)).backward();
    loss_of(*ref, b1).backward();
    loss_of(*ref, b2).backward();
    require_grads_match("after synced step", *model, *ref);
  });
}

// Buckets are all-reduced while backward is still running: when 0.bias (the third bucket) is
// ready, the first three buckets have been launched, before the end-of-backward callback.
TEST_P(DDPWorld, BucketsLaunchDuringBackward) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam().n;
  if (n == 1) GTEST_SKIP() << "world size 1 launches no collectives";
  run_group(GetParam(), [n](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto model = make_model(500 + rank, 40);
    DDPOptions o;
    o.bucket_cap_mb = 50.0 / (1024 * 1024);  // buckets as in SmallBucketsGiveSameGradients
    DistributedDataParallel ddp(model, pg, o);
    const Tensor bias0 = model->named_parameters()[1].second;
    uint64_t seen = 0;
    bool fired = false;
    bias0.register_post_accumulate_grad_hook([&](const Tensor&) {
      seen = pg->sequence_number();
      fired = true;
    });
    const Batch b = fixed_batch(9);
    Tensor loss = loss_of(ddp, slice(b, rank, n));
    const uint64_t before = pg->sequence_number();
    loss.backward();
    require(fired, "hook on 0.bias did not run");
    require(seen >= before + 3, "when 0.bias was ready only " + std::to_string(seen - before) +
                                    " all-reduces had been launched, want >= 3");
    require(pg->sequence_number() == before + 4,
            "want 4 all-reduces in all, got " + std::to_string(pg->sequence_number() - before));
  });
}

// gradient_as_bucket_view: grads become views into the buckets (stable addresses) and stay
// correct across iterations with zero_grad(set_to_none = false) and an optimizer step.
TEST_P(DDPWorld, GradientAsBucketView) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam().n;
  run_group(GetParam(), [n](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto model = make_model(600 + rank);
    DDPOptions o;
    o.gradient_as_bucket_view = true;
    auto ddp = std::make_shared<DistributedDataParallel>(model, pg, o);
    auto ref = clone_model(*model);
    nn::optim::SGD opt(ddp->parameters(), {.lr = 0.05});
    nn::optim::SGD ref_opt(ref->parameters(), {.lr = 0.05});
    std::vector<void*> addresses;
    for (int it = 0; it < 3; ++it) {
      model->zero_grad(false);
      ref->zero_grad(false);
      const Batch b = fixed_batch(70 + it);
      loss_of(*ddp, slice(b, rank, n)).backward();
      loss_of(*ref, b).backward();
      require_grads_match("iteration " + std::to_string(it), *model, *ref);
      std::vector<void*> now;
      for (const Tensor& p : model->parameters()) now.push_back(p.grad().data_ptr());
      if (it > 0) require(now == addresses, "grad() moved after the first iteration");
      addresses = now;
      opt.step();
      ref_opt.step();
    }
    require_same_on_all_ranks(*pg, *model);
  });
}

// Over shared memory DDP's buckets come from the group (zeros_for_collectives(): shareable
// memory), so with gradient_as_bucket_view a large bucket's all-reduce reduces straight from the
// peers' buckets (Note [mapped reductions]); the gradients are still the reference's, and after
// the first iteration every grad() lies in shareable memory.
TEST(DDP, BucketViewsOverSharedMemoryAreMappedReductions) {
  EMBER_REQUIRE_GLOO();
  constexpr int n = 2;
  constexpr int64_t hidden = 20000;  // buckets of several hundred KiB
  test::run_gloo_ranks(
      n,
      [](std::shared_ptr<ProcessGroupGloo> pg, int rank) {
        require(pg->uses_shared_memory(), "no shared memory");
        auto model = make_model(610 + rank, hidden);
        DDPOptions o;
        o.gradient_as_bucket_view = true;
        auto ddp = std::make_shared<DistributedDataParallel>(model, pg, o);
        auto ref = clone_model(*model, hidden);
        const uint64_t before = pg->shared_memory_stats().mapped_reductions;
        for (int it = 0; it < 3; ++it) {
          model->zero_grad(false);
          ref->zero_grad(false);
          const Batch b = fixed_batch(80 + it);
          loss_of(*ddp, slice(b, rank, n)).backward();
          loss_of(*ref, b).backward();
          require_grads_match("iteration " + std::to_string(it), *model, *ref);
        }
        for (const Tensor& p : model->parameters()) {
          require(is_shareable(p.grad()), "a grad() outside shareable memory");
        }
        require(pg->shared_memory_stats().mapped_reductions > before,
                "no bucket was reduced from the peers' mapped buckets");
      },
      true);
}

// A module with a buffer that scales its output: rank 0's value must win at every forward.
struct Scaled : nn::Module {
  Scaled() {
    lin = register_module("lin", std::make_shared<nn::Linear>(kIn, kOut));
    register_buffer("scale", full({1}, 1.0));
  }
  Tensor forward(const Tensor& x) override { return lin->forward(x) * tensor("scale"); }
  std::shared_ptr<nn::Linear> lin;
};

TEST_P(DDPWorld, BroadcastBuffersFromRankZeroEachForward) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam().n;
  run_group(GetParam(), [n](std::shared_ptr<ProcessGroup> pg, int rank) {
    manual_seed(3);
    auto model = std::make_shared<Scaled>();
    DistributedDataParallel ddp(model, pg);
    model->tensor("scale").fill_(rank + 2.0);  // diverges after construction
    const Batch b = fixed_batch(5);
    ddp.forward(slice(b, rank, n).x);
    require(model->tensor("scale").item<float>() == 2.0f,
            "scale after forward: " + std::to_string(model->tensor("scale").item<float>()));
    // Evaluation mode and broadcast_buffers = false leave local buffers alone.
    model->tensor("scale").fill_(rank + 2.0);
    ddp.eval();
    ddp.forward(slice(b, rank, n).x);
    require(model->tensor("scale").item<float>() == rank + 2.0f, "eval forward broadcast");
  });
}

// A module whose second layer never takes part in the loss.
struct WithUnused : nn::Module {
  WithUnused() {
    used = register_module("used", std::make_shared<nn::Linear>(kIn, kOut));
    unused = register_module("unused", std::make_shared<nn::Linear>(kIn, kOut));
  }
  Tensor forward(const Tensor& x) override { return used->forward(x); }
  std::shared_ptr<nn::Linear> used, unused;
};

// (e) a parameter without a gradient is an error naming it, unless find_unused_parameters.
TEST_P(DDPWorld, UnusedParameterErrorNamesIt) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam().n;
  run_group(GetParam(), [n](std::shared_ptr<ProcessGroup> pg, int rank) {
    manual_seed(1);
    auto model = std::make_shared<WithUnused>();
    DistributedDataParallel ddp(model, pg);
    const Batch b = fixed_batch(3);
    std::string msg;
    try {
      loss_of(ddp, slice(b, rank, n)).backward();
    } catch (const ValueError& e) {
      msg = e.what();
    }
    require(msg.find("[DistributedDataParallel]") != std::string::npos &&
                msg.find("'unused.weight'") != std::string::npos &&
                msg.find("'unused.bias'") != std::string::npos &&
                msg.find("'used.weight'") == std::string::npos &&
                msg.find("find_unused_parameters") != std::string::npos,
            "unexpected message: '" + msg + "'");
    // The reducer recovered: the next iteration fails the same way instead of hanging.
    msg.clear();
    try {
      loss_of(ddp, slice(b, rank, n)).backward();
    } catch (const ValueError& e) {
      msg = e.what();
    }
    require(msg.find("'unused.weight'") != std::string::npos, "second iteration: '" + msg + "'");
  });
}

TEST_P(DDPWorld, FindUnusedParametersAveragesUsedOnesOnly) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam().n;
  run_group(GetParam(), [n](std::shared_ptr<ProcessGroup> pg, int rank) {
    manual_seed(2 + rank);
    auto model = std::make_shared<WithUnused>();
    DDPOptions o;
    o.find_unused_parameters = true;
    o.bucket_cap_mb = 1e-6;  // one bucket per parameter
    DistributedDataParallel ddp(model, pg, o);
    model->zero_grad();
    const Batch b = fixed_batch(4);
    loss_of(ddp, slice(b, rank, n)).backward();
    // Reference: the used layer alone on the full batch.
    auto ref = std::make_shared<nn::Linear>(kIn, kOut);
    ref->load_state_dict(model->used->state_dict());
    loss_of(*ref, b).backward();
    require_close("used.weight grad", model->used->tensor("weight").grad(),
                  ref->tensor("weight").grad());
    require_close("used.bias grad", model->used->tensor("bias").grad(), ref->tensor("bias").grad());
    require(!model->unused->tensor("weight").grad().defined(), "unused grad must stay undefined");
  });
}

// Two branches, one used per forward.
struct TwoBranch : nn::Module {
  TwoBranch() {
    a = register_module("a", std::make_shared<nn::Linear>(kIn, kOut));
    b = register_module("b", std::make_shared<nn::Linear>(kIn, kOut));
  }
  Tensor forward(const Tensor& x) override { return use_a ? a->forward(x) : b->forward(x); }
  std::shared_ptr<nn::Linear> a, b;
  bool use_a = true;
};

// A parameter used under no_sync and not in the synchronised step that follows: its
// accumulated gradient is averaged with the rest (it was zeroed as "unused", so each rank kept
// its own and the replicas diverged).
TEST_P(DDPWorld, NoSyncGradientsOfAParameterUnusedInTheSyncedStepAreAveraged) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam().n;
  run_group(GetParam(), [n](std::shared_ptr<ProcessGroup> pg, int rank) {
    manual_seed(5);
    auto model = std::make_shared<TwoBranch>();
    DDPOptions o;
    o.find_unused_parameters = true;
    DistributedDataParallel ddp(model, pg, o);
    auto ref_a = std::make_shared<nn::Linear>(kIn, kOut);
    auto ref_b = std::make_shared<nn::Linear>(kIn, kOut);
    ref_a->load_state_dict(model->a->state_dict());
    ref_b->load_state_dict(model->b->state_dict());
    const Batch b1 = fixed_batch(21), b2 = fixed_batch(22);
    {
      auto guard = ddp.no_sync();
      model->use_a = true;
      loss_of(ddp, slice(b1, rank, n)).backward();
    }
    model->use_a = false;
    loss_of(ddp, slice(b2, rank, n)).backward();
    loss_of(*ref_a, b1).backward();
    loss_of(*ref_b, b2).backward();
    require_close("a.weight grad", model->a->tensor("weight").grad(),
                  ref_a->tensor("weight").grad());
    require_close("a.bias grad", model->a->tensor("bias").grad(), ref_a->tensor("bias").grad());
    require_close("b.weight grad", model->b->tensor("weight").grad(),
                  ref_b->tensor("weight").grad());
  });
}

// A forward without autograd between a training forward and its backward (an evaluation, a
// pseudo-label) leaves that backward synchronised (it used to turn the sync off).
TEST_P(DDPWorld, ANoGradForwardBeforeTheBackwardKeepsItSynchronised) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam().n;
  run_group(GetParam(), [n](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto model = make_model(600 + rank);
    DistributedDataParallel ddp(model, pg);
    auto ref = clone_model(*model);
    const Batch b = fixed_batch(23), mine = slice(b, rank, n);
    Tensor out = ddp.forward(mine.x);
    {
      NoGradGuard no_grad;
      ddp.forward(mine.x);
    }
    nn::functional::mse_loss(out, mine.y).backward();
    loss_of(*ref, b).backward();
    require_grads_match("after a no-grad forward", *model, *ref);
  });
}

// Counts the collectives DDP issues and forwards them to gloo.
class Counting final : public ForwardingProcessGroup {
 public:
  using ForwardingProcessGroup::ForwardingProcessGroup;
  WorkPtr allreduce(Tensor& t, const AllreduceOptions& o) override {
    ++allreduces;
    return inner_->allreduce(t, o);
  }
  WorkPtr allreduce_coalesced(std::vector<Tensor>& ts, const AllreduceOptions& o) override {
    ++coalesced;
    return inner_->allreduce_coalesced(ts, o);
  }
  int allreduces = 0;
  int coalesced = 0;
};

// Note [DDP in place]: over shared memory every bucket all-reduces the gradients where they lie
// (allreduce_coalesced, no flat buffer); over TCP every bucket uses its flat buffer; an unused
// parameter (find_unused_parameters) sends its bucket back to the flat buffer. The gradients
// equal the full-batch ones either way, through several steps and a bucket rebuild.
TEST_P(DDPWorld, GradientsAllReducedWhereTheyLieOverSharedMemory) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam().n;
  const bool shm = GetParam().shm;
  if (n == 1) GTEST_SKIP() << "world size 1 launches no collectives";
  run_group(GetParam(), [n, shm](std::shared_ptr<ProcessGroup> gloo, int rank) {
    auto pg = std::make_shared<Counting>(gloo);
    require(pg->coalesced_without_copies(kCPU) == shm, "coalesced_without_copies()");
    auto model = make_model(800 + rank, 40);
    DDPOptions o;
    o.bucket_cap_mb = 50.0 / (1024 * 1024);  // several buckets
    auto ddp = std::make_shared<DistributedDataParallel>(model, pg, o);
    auto ref = clone_model(*model, 40);
    nn::optim::SGD opt(ddp->parameters(), {.lr = 0.1, .momentum = 0.9});
    nn::optim::SGD ref_opt(ref->parameters(), {.lr = 0.1, .momentum = 0.9});
    int buckets = 0;
    for (int step = 0; step < 3; ++step) {
      const Batch b = fixed_batch(60 + step);
      opt.zero_grad();
      ref_opt.zero_grad();
      pg->allreduces = pg->coalesced = 0;
      loss_of(*ddp, slice(b, rank, n)).backward();
      loss_of(*ref, b).backward();
      require_grads_match("step " + std::to_string(step), *model, *ref);
      if (step == 0) buckets = pg->allreduces + pg->coalesced;
      require(buckets > 1 && pg->allreduces + pg->coalesced == buckets, "several buckets");
      require(shm ? pg->coalesced == buckets : pg->allreduces == buckets,
              "step " + std::to_string(step) + ": " + std::to_string(pg->coalesced) +
                  " buckets all-reduced in place, " + std::to_string(pg->allreduces) + " flat");
      opt.step();
      ref_opt.step();
    }
    require_same_on_all_ranks(*pg, *model);

    // A parameter unused on this iteration: its bucket falls back to the flat buffer, whose
    // slot for it is zero.
    manual_seed(2 + rank);
    auto partly = std::make_shared<WithUnused>();
    DDPOptions u;
    u.find_unused_parameters = true;
    DistributedDataParallel ddp2(partly, pg, u);
    auto used_ref = std::make_shared<nn::Linear>(kIn, kOut);
    used_ref->load_state_dict(partly->used->state_dict());
    const Batch b = fixed_batch(4);
    pg->allreduces = pg->coalesced = 0;
    loss_of(ddp2, slice(b, rank, n)).backward();
    loss_of(*used_ref, b).backward();
    require_close("used.weight grad", partly->used->tensor("weight").grad(),
                  used_ref->tensor("weight").grad());
    require(!partly->unused->tensor("weight").grad().defined(), "unused grad must stay undefined");
    require(pg->coalesced == 0, "a bucket with an unused parameter was all-reduced in place");
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, DDPWorld,
                         ::testing::Values(DDPCase{1, true}, DDPCase{2, true}, DDPCase{3, true},
                                           DDPCase{2, false}, DDPCase{3, false}),
                         [](const auto& info) {
                           return "world" + std::to_string(info.param.n) +
                                  (info.param.n == 1 ? "" : info.param.shm ? "_shm" : "_tcp");
                         });

// A destroyed DDP removes its hooks: the module it wrapped then trains alone (each rank on its
// own batch, no collective, local gradients, also in a second step), and nothing holds on to
// DDP's group any more.
TEST(DDP, DestroyedDDPLeavesTheModuleToTrainAlone) {
  EMBER_REQUIRE_GLOO();
  constexpr int n = 2;
  run_group(n, [](std::shared_ptr<ProcessGroup> gloo, int rank) {
    auto pg = std::make_shared<Counting>(gloo);
    const std::weak_ptr<ProcessGroup> weak_pg = pg;
    auto model = make_model(900 + rank);
    {
      DistributedDataParallel ddp(model, pg);
      loss_of(ddp, slice(fixed_batch(3), rank, n)).backward();
      require(pg->allreduces + pg->coalesced > 0, "DDP all-reduced nothing");
    }
    const int collectives = pg->allreduces + pg->coalesced;
    auto ref = clone_model(*model);
    for (int step = 0; step < 2; ++step) {
      model->zero_grad();
      ref->zero_grad();
      const Batch mine = fixed_batch(40 + 10 * rank + step);  // differs across ranks
      loss_of(*model, mine).backward();
      loss_of(*ref, mine).backward();
      require(pg->allreduces + pg->coalesced == collectives,
              "the unwrapped module issued a collective in step " + std::to_string(step));
      require_grads_match("alone, step " + std::to_string(step), *model, *ref);
    }
    pg.reset();
    require(weak_pg.expired(), "the destroyed DDP's hooks still hold its group");
  });
}

TEST(DDP, MismatchedParameterShapesNameParameterAndRank) {
  EMBER_REQUIRE_GLOO();
  run_group(2, [](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto model = make_model(1, rank == 0 ? 7 : 6);
    std::string msg;
    try {
      DistributedDataParallel ddp(model, pg);
    } catch (const ValueError& e) {
      msg = e.what();
    }
    require(msg.find("parameter 0 ('0.weight'") != std::string::npos &&
                msg.find("rank 0 has shape [7, 5] float32") != std::string::npos &&
                msg.find("rank 1 has shape [6, 5] float32") != std::string::npos,
            "unexpected message: '" + msg + "'");
  });
}

// DDP on CUDA parameters over gloo (staged through host memory), two ranks sharing one GPU:
// SGD steps with one bucket per parameter and gradient_as_bucket_view end where one process on
// the CPU ends after the same steps on the whole batch (to TF32 tolerance: cuDNN may use it).
TEST(DDPCuda, TwoRanksOverGlooTrainLikeOneProcess) {
  EMBER_REQUIRE_GLOO();
  const std::string no_cuda = test::cuda_unusable_in_children();
  if (!no_cuda.empty()) GTEST_SKIP() << "no CUDA device in a child process: " << no_cuda;
  constexpr int n = 2;
  run_group(n, [](std::shared_ptr<ProcessGroup> pg, int rank) {
    const Device gpu = cuda_device(0);
    auto model = test::make_cnn(300 + rank);  // DDP broadcasts rank 0's
    model->to(gpu);
    DDPOptions o;
    o.bucket_cap_mb = o.first_bucket_cap_mb = 1e-6;
    o.gradient_as_bucket_view = true;
    auto ddp = std::make_shared<DistributedDataParallel>(model, pg, o);
    auto ref = test::make_cnn(300);  // rank 0's initial weights, on the CPU
    nn::optim::SGD opt(ddp->parameters(), {.lr = 0.05, .momentum = 0.9});
    nn::optim::SGD ref_opt(ref->parameters(), {.lr = 0.05, .momentum = 0.9});
    for (int step = 0; step < 4; ++step) {
      const Batch b = test::cnn_batch(60 + step, 8);
      opt.zero_grad();
      ref_opt.zero_grad();
      loss_of(*ddp, test::to_device(slice(b, rank, n), gpu)).backward();
      loss_of(*ref, b).backward();
      opt.step();
      ref_opt.step();
    }
    const auto a = model->named_parameters();
    const auto r = ref->named_parameters();
    for (size_t i = 0; i < a.size(); ++i) {
      require(a[i].second.is_cuda(), a[i].first + " left the GPU");
      require_close("trained " + a[i].first, a[i].second, r[i].second, 2e-3);
    }
    require_same_on_all_ranks(*pg, *model);
  });
}

}  // namespace
}  // namespace ember::dist
