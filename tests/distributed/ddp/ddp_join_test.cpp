// DistributedDataParallel: join() for uneven inputs, static_graph, the error messages for a
// reduction left unfinished, a parameter ready twice and a second backward pass, and the debug
// modes (EMBER_DISTRIBUTED_DEBUG=INFO logs, DETAIL checks every collective across ranks). Real
// processes over gloo on 127.0.0.1, world sizes 2 and 4; expected values come from a
// single-process reference computed in each rank (no literals).
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <ember/autograd/engine.h>
#include <ember/autograd/function.h>
#include <ember/distributed/backends/process_group_gloo.h>
#include <ember/distributed/ddp/ddp.h>
#include <ember/distributed/debug/debug.h>
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

constexpr int64_t kIn = 5;
constexpr int64_t kOut = 3;
constexpr int64_t kRows = 4;  // rows per batch

// Forks n ranks, each with a gloo group (60 s timeout) over a TCPStore on an OS-picked port.
void run_group(int n, const std::function<void(std::shared_ptr<ProcessGroup>, int)>& body) {
  test::run_gloo_ranks(n, [&](std::shared_ptr<ProcessGroupGloo> pg, int rank) { body(pg, rank); });
}

// A small MLP with a buffer counting training-mode forwards (like BatchNorm's
// num_batches_tracked), so buffer broadcasts under join() are exercised too.
struct Counted : nn::Module {
  explicit Counted(uint64_t seed) {
    manual_seed(seed);
    net = register_module("net",
                          std::make_shared<nn::Sequential>(std::make_shared<nn::Linear>(kIn, 6),
                                                           std::make_shared<nn::Tanh>(),
                                                           std::make_shared<nn::Linear>(6, kOut)));
    register_buffer("steps", zeros({1}));
  }
  Tensor forward(const Tensor& x) override {
    if (is_training()) {
      NoGradGuard g;
      tensor("steps").add_(1.0);
    }
    return net->forward(x);
  }
  std::shared_ptr<nn::Sequential> net;
};

// Rank r's batch t: the same on every process.
Batch batch_of(int rank, int t) {
  manual_seed(1000 + 37 * rank + t);
  return {randn({kRows, kIn}), randn({kRows, kOut})};
}

Tensor mse(nn::Module& m, const Batch& b) { return nn::functional::mse_loss(m.forward(b.x), b.y); }


// Throws unless every rank holds bitwise the same parameters and buffers.

using test::message_of;

bool has(const std::string& msg, const std::string& part) {
  return msg.find(part) != std::string::npos;
}

// ---- join() ----------------------------------------------------------------------------------

struct JoinCase {
  std::string name;
  std::vector<int> batches;  // per rank
  bool divide_by_initial_world_size = true;
  bool static_graph = false;
  bool gradient_as_bucket_view = false;
  bool find_unused_parameters = false;
  bool allreduce_hook = false;  // register dist::allreduce_hook (divides by the world size)
  // EMBER_DISTRIBUTED_DEBUG=DETAIL: a rank with data all-reduces its gradients in place
  // (allreduce_coalesced) while a joined rank all-reduces zeros; the check must match them.
  bool detail = false;
};

void PrintTo(const JoinCase& c, std::ostream* os) { *os << c.name; }

class DDPJoin : public ::testing::TestWithParam<JoinCase> {};

// Each rank trains on its own number of batches inside join(): nobody hangs, every rank ends
// with the same parameters, and they equal one process applying, at step t, the gradient of
// sum over the ranks that still have a batch t of their mean loss, divided by the world size
// (divide_by_initial_world_size, torch's default) or by the number of those ranks. A second
// epoch without join() then runs with even inputs: the ranks still agree on the bucket rebuild
// and every other collective.
TEST_P(DDPJoin, UnevenInputsFinishWithTheReferenceParameters) {
  EMBER_REQUIRE_GLOO();
  const JoinCase c = GetParam();
  const int n = static_cast<int>(c.batches.size());
  run_group(n, [&c, n](std::shared_ptr<ProcessGroup> pg, int rank) {
    if (c.detail) ::setenv("EMBER_DISTRIBUTED_DEBUG", "DETAIL", 1);  // this child only
    auto model = std::make_shared<Counted>(50 + rank);  // DDP broadcasts rank 0's weights
    DDPOptions o;
    o.bucket_cap_mb = 100.0 / (1024 * 1024);  // several buckets
    o.static_graph = c.static_graph;
    o.gradient_as_bucket_view = c.gradient_as_bucket_view;
    o.find_unused_parameters = c.find_unused_parameters;
    auto ddp = std::make_shared<DistributedDataParallel>(model, pg, o);
    if (c.allreduce_hook) ddp->register_comm_hook(allreduce_hook);
    auto ref = std::make_shared<Counted>(999);
    ref->load_state_dict(model->state_dict());
    nn::optim::SGD opt(ddp->parameters(), {.lr = 0.1});
    nn::optim::SGD ref_opt(ref->parameters(), {.lr = 0.1});

    JoinOptions jo;
    jo.divide_by_initial_world_size = c.divide_by_initial_world_size;
    ddp->join(
        [&] {
          for (int t = 0; t < c.batches[rank]; ++t) {
            opt.zero_grad();
            mse(*ddp, batch_of(rank, t)).backward();
            opt.step();
          }
        },
        jo);

    const int most = *std::max_element(c.batches.begin(), c.batches.end());
    for (int t = 0; t < most; ++t) {
      ref_opt.zero_grad();
      Tensor loss;
      int active = 0;
      for (int r = 0; r < n; ++r) {
        if (c.batches[r] <= t) continue;
        ++active;
        Tensor l = mse(*ref->net, batch_of(r, t));
        loss = loss.defined() ? loss + l : l;
      }
      (loss / (c.divide_by_initial_world_size ? n : active)).backward();
      ref_opt.step();
    }
    require_same_on_all_ranks(*pg, *model, /*buffers=*/true);
    const auto a = model->named_parameters();
    const auto b = ref->named_parameters();
    for (size_t i = 0; i < a.size(); ++i) {
      require_close("after join: " + a[i].first, a[i].second, b[i].second, 1e-4);
    }
    // Every iteration broadcast the buffer from a rank with data and each counted it once.
    require(model->tensor("steps").item<float>() == static_cast<float>(most),
            "steps buffer " + std::to_string(model->tensor("steps").item<float>()) + ", want " +
                std::to_string(most));

    // Epoch 2, even inputs, no join: still in lockstep (rebuild, buffers, buckets).
    for (int t = 0; t < 2; ++t) {
      opt.zero_grad();
      ref_opt.zero_grad();
      mse(*ddp, batch_of(rank, 10 + t)).backward();
      Tensor loss;
      for (int r = 0; r < n; ++r) {
        Tensor l = mse(*ref->net, batch_of(r, 10 + t));
        loss = loss.defined() ? loss + l : l;
      }
      (loss / n).backward();
      opt.step();
      ref_opt.step();
    }
    require(ddp->buckets_rebuilt(), "buckets not rebuilt");
    require_same_on_all_ranks(*pg, *model, /*buffers=*/true);
    const auto a2 = model->named_parameters();
    const auto b2 = ref->named_parameters();
    for (size_t i = 0; i < a2.size(); ++i) {
      require_close("epoch 2: " + a2[i].first, a2[i].second, b2[i].second, 1e-4);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Cases, DDPJoin,
    ::testing::Values(JoinCase{"ranks2_3and5", {3, 5}},
                      JoinCase{"ranks2_5and3_by_active", {5, 3}, false},
                      JoinCase{"ranks4_1to4", {1, 2, 3, 4}},
                      JoinCase{"ranks4_4to1_by_active", {4, 3, 2, 1}, false},
                      JoinCase{"ranks2_rank0_has_none", {0, 3}},
                      JoinCase{"ranks4_static_graph_rank0_has_none", {0, 4, 1, 3}, true, true},
                      JoinCase{"ranks2_bucket_view", {3, 1}, true, false, true},
                      JoinCase{"ranks2_find_unused", {1, 3}, true, false, false, true},
                      JoinCase{
                          "ranks4_allreduce_hook", {3, 1, 0, 2}, true, false, false, false, true},
                      JoinCase{"ranks2_even", {2, 2}},
                      JoinCase{"ranks2_detail", {3, 1}, true, false, false, false, false, true}),
    [](const auto& info) { return info.param.name; });

// throw_on_early_termination: every rank throws DistError at the first iteration in which a
// rank has run out, naming it, instead of carrying on.
TEST(DDPJoinErrors, ThrowOnEarlyTerminationStopsEveryRank) {
  EMBER_REQUIRE_GLOO();
  for (int n : {2, 4}) {
    run_group(n, [n](std::shared_ptr<ProcessGroup> pg, int rank) {
      auto model = std::make_shared<Counted>(5);
      DistributedDataParallel ddp(model, pg);
      JoinOptions jo;
      jo.throw_on_early_termination = true;
      int done = 0;
      const int mine = rank == 0 ? 2 : 4;  // rank 0 runs out first
      std::string msg;
      try {
        ddp.join(
            [&] {
              for (int t = 0; t < mine; ++t, ++done) mse(ddp, batch_of(rank, t)).backward();
            },
            jo);
      } catch (const DistError& e) {
        msg = e.what();
      }
      require(has(msg, "join: rank(s) 0 of " + std::to_string(n) + " ran out of inputs") &&
                  has(msg, "throw_on_early_termination"),
              "rank " + std::to_string(rank) + " of " + std::to_string(n) + ": '" + msg + "'");
      require(done == 2, "rank " + std::to_string(rank) + " ran " + std::to_string(done) +
                             " iterations, want 2");
      // The group is still usable and in step.
      Tensor t = full({1}, 1.0);
      pg->allreduce(t)->wait();
      require(t.item<float>() == n, "allreduce after the error");
    });
  }
}

// ---- static_graph ----------------------------------------------------------------------------

// A model whose layer `b` takes part only when use_b is set.
struct Switchable : nn::Module {
  Switchable() {
    manual_seed(9);
    a = register_module("a", std::make_shared<nn::Linear>(kIn, kOut));
    b = register_module("b", std::make_shared<nn::Linear>(kIn, kOut));
  }
  Tensor forward(const Tensor& x) override {
    Tensor y = a->forward(x);
    return use_b ? y + b->forward(x) : y;
  }
  std::shared_ptr<nn::Linear> a, b;
  bool use_b = false;
};

// static_graph with a parameter set that never changes: unused layer's grad stays undefined,
// the used one matches one process on the full batch, buckets are rebuilt.
TEST(DDPStaticGraph, SameUnusedSetTrainsLikeOneProcess) {
  EMBER_REQUIRE_GLOO();
  for (int n : {2, 4}) {
    run_group(n, [n](std::shared_ptr<ProcessGroup> pg, int rank) {
      auto model = std::make_shared<Switchable>();
      DDPOptions o;
      o.static_graph = true;
      o.bucket_cap_mb = 1e-6;  // one bucket per parameter
      DistributedDataParallel ddp(model, pg, o);
      auto ref = std::make_shared<nn::Linear>(kIn, kOut);
      ref->load_state_dict(model->a->state_dict());
      for (int it = 0; it < 3; ++it) {
        model->zero_grad();
        ref->zero_grad();
        mse(ddp, batch_of(rank, it)).backward();
        Tensor loss;
        for (int r = 0; r < n; ++r) {
          Tensor l = mse(*ref, batch_of(r, it));
          loss = loss.defined() ? loss + l : l;
        }
        (loss / n).backward();
        const std::string at = "iteration " + std::to_string(it) + " ";
        require_close(at + "a.weight", model->a->tensor("weight").grad(),
                      ref->tensor("weight").grad());
        require_close(at + "a.bias", model->a->tensor("bias").grad(), ref->tensor("bias").grad());
        require(!model->b->tensor("weight").grad().defined(), at + "b.weight got a grad");
      }
      require(ddp.buckets_rebuilt(), "static_graph rebuilds the buckets");
    });
  }
}

// After the first iteration, static_graph marks the unused layer ready at once: the single
// bucket (used and unused parameters together) is all-reduced by the time the last used
// gradient arrives, inside backward, and the used-parameter all-reduce is gone (2 collectives
// in the first iteration, 1 afterwards). find_unused_parameters does neither.
TEST(DDPStaticGraph, UnusedBucketLaunchesDuringBackwardAfterFirstIteration) {
  EMBER_REQUIRE_GLOO();
  run_group(2, [](std::shared_ptr<ProcessGroup> pg, int rank) {
    for (bool static_graph : {true, false}) {
      auto model = std::make_shared<Switchable>();
      DDPOptions o;
      o.static_graph = static_graph;
      o.find_unused_parameters = !static_graph;
      DistributedDataParallel ddp(model, pg, o);
      require(ddp.bucket_indices().size() == 1, "want one bucket");
      uint64_t at_last_used = 0;
      for (const char* name : {"weight", "bias"}) {
        model->a->tensor(name).register_post_accumulate_grad_hook(
            [&](const Tensor&) { at_last_used = std::max(at_last_used, pg->sequence_number()); });
      }
      for (int it = 0; it < 3; ++it) {
        Tensor loss = mse(ddp, batch_of(rank, it));
        const uint64_t before = pg->sequence_number();
        at_last_used = 0;
        loss.backward();
        const std::string at = std::string(static_graph ? "static" : "find_unused") +
                               " iteration " + std::to_string(it) + ": ";
        const bool early = static_graph && it > 0;
        require(at_last_used - before == (early ? 1u : 0u),
                at + std::to_string(at_last_used - before) + " collectives during backward");
        require(pg->sequence_number() - before == (early ? 1u : 2u),
                at + std::to_string(pg->sequence_number() - before) + " collectives in all");
      }
    }
  });
}

// A later iteration that uses another set of parameters is an error naming them and saying
// what to do, on every rank; the next iteration with the original set works again.
TEST(DDPStaticGraph, ChangedParameterSetIsAnError) {
  EMBER_REQUIRE_GLOO();
  for (int n : {2, 4}) {
    run_group(n, [](std::shared_ptr<ProcessGroup> pg, int rank) {
      auto model = std::make_shared<Switchable>();
      DDPOptions o;
      o.static_graph = true;
      DistributedDataParallel ddp(model, pg, o);
      mse(ddp, batch_of(rank, 0)).backward();  // a only
      model->use_b = true;
      std::string msg = message_of([&] { mse(ddp, batch_of(rank, 1)).backward(); });
      require(has(msg, "static_graph = true, but in iteration 2") &&
                  has(msg, "'b.weight' got a gradient (it got none in the first iteration)") &&
                  has(msg, "find_unused_parameters = true") && !has(msg, "'a.weight'"),
              "b added: '" + msg + "'");
      model->use_b = false;
      model->zero_grad();
      mse(ddp, batch_of(rank, 2)).backward();
      require(model->a->tensor("weight").grad().defined(), "recovered iteration");
    });
    // The reverse: first both layers, then one goes missing.
    run_group(n, [](std::shared_ptr<ProcessGroup> pg, int rank) {
      auto model = std::make_shared<Switchable>();
      model->use_b = true;
      DDPOptions o;
      o.static_graph = true;
      DistributedDataParallel ddp(model, pg, o);
      mse(ddp, batch_of(rank, 0)).backward();
      model->use_b = false;
      std::string msg = message_of([&] { mse(ddp, batch_of(rank, 1)).backward(); });
      require(has(msg, "'b.weight' got no gradient (it got one in the first iteration)") &&
                  has(msg, "'b.bias' got no gradient"),
              "b removed: '" + msg + "'");
    });
  }
}

// ---- errors ----------------------------------------------------------------------------------

// Identity forward; its backward can throw, or run a second (reentrant) backward pass through
// `reused` (like activation checkpointing that recomputes with a shared parameter).
struct Trap : autograd::Function<Trap> {
  static inline int mode = 0;  // 0: plain, 1: reentrant backward, 2: throw
  static inline Tensor reused;
  static Tensor forward(autograd::Context*, const Tensor& x) { return x.clone(); }
  static autograd::TensorList backward(autograd::Context*, autograd::TensorList g) {
    if (mode == 2) throw std::runtime_error("trap: backward failed");
    if (mode == 1) {
      EnableGradGuard enable;
      autograd::backward({(reused * 2.0).sum()});
    }
    return {g[0]};
  }
};

// a -> Trap -> b: b's gradients arrive first, then Trap's backward runs.
struct Trapped : nn::Module {
  Trapped() {
    manual_seed(4);
    a = register_module("a", std::make_shared<nn::Linear>(kIn, 6));
    b = register_module("b", std::make_shared<nn::Linear>(6, kOut));
  }
  Tensor forward(const Tensor& x) override { return b->forward(Trap::apply(a->forward(x))); }
  std::shared_ptr<nn::Linear> a, b;
};

TEST(DDPErrors, ReadyTwiceThenUnfinishedReductionThenRecovery) {
  EMBER_REQUIRE_GLOO();
  for (int n : {2, 4}) {
    run_group(n, [](std::shared_ptr<ProcessGroup> pg, int rank) {
      auto model = std::make_shared<Trapped>();
      DDPOptions o;
      o.bucket_cap_mb = 1e-6;  // b's buckets launch before the trap fires
      DistributedDataParallel ddp(model, pg, o);
      Trap::reused = model->b->tensor("weight");

      // A reentrant backward through b.weight: ready twice, named, with the causes.
      Trap::mode = 1;
      std::string msg = message_of([&] { mse(ddp, batch_of(rank, 0)).backward(); });
      require(has(msg, "parameter 'b.weight' (index 2) was marked ready twice") &&
                  has(msg, "reentrant") && has(msg, "no_sync()"),
              "ready twice: '" + msg + "'");

      // That backward never finished: the next forward says so, naming what got no gradient.
      Trap::mode = 0;
      msg = message_of([&] { mse(ddp, batch_of(rank, 1)); });
      require(has(msg, "expected the previous iteration's gradient reduction to have finished") &&
                  has(msg, "these did not: 'a.weight', 'a.bias'") &&
                  has(msg, "find_unused_parameters = true"),
              "unfinished: '" + msg + "'");

      // A backward that throws midway: the same at the next forward.
      Trap::mode = 2;
      msg = message_of([&] { mse(ddp, batch_of(rank, 2)).backward(); });
      require(has(msg, "trap: backward failed"), "trap: '" + msg + "'");
      Trap::mode = 0;
      msg = message_of([&] { mse(ddp, batch_of(rank, 3)); });
      require(has(msg, "2 of 4 parameters got their gradients"), "unfinished 2: '" + msg + "'");

      // Reset: a normal iteration works and averages.
      model->zero_grad();
      mse(ddp, batch_of(rank, 4)).backward();
      Tensor g = model->a->tensor("bias").grad().clone();
      Tensor all = zeros({pg->size() * g.numel()}, kFloat32);
      pg->allgather_into_tensor(all, g)->wait();
      require_close("a.bias grad equal on all ranks", all.narrow(0, 0, g.numel()),
                    all.narrow(0, (pg->size() - 1) * g.numel(), g.numel()), 0);
    });
  }
}

// Two backward passes through one synchronised forward (retain_graph): the second would not be
// synchronised, so it is an error naming a parameter and pointing at no_sync(); under
// no_sync() the same pattern is fine.
TEST(DDPErrors, SecondBackwardAfterSynchronisedOneIsAnError) {
  EMBER_REQUIRE_GLOO();
  run_group(2, [](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto model = std::make_shared<Counted>(3);
    DistributedDataParallel ddp(model, pg);
    Tensor loss = mse(ddp, batch_of(rank, 0));
    loss.backward({}, true);
    std::string msg = message_of([&] { loss.backward(); });
    require(has(msg, "got a gradient in a second backward pass") && has(msg, "'net.2.") &&
                has(msg, "no_sync()") && has(msg, "retain_graph"),
            "second backward: '" + msg + "'");
    {
      auto guard = ddp.no_sync();
      Tensor l2 = mse(ddp, batch_of(rank, 1));
      l2.backward({}, true);
      l2.backward();  // unsynchronised accumulation, allowed
    }
    mse(ddp, batch_of(rank, 2)).backward();  // synced again
  });
}

// ---- debug modes ----------------------------------------------------------------------------

// Sets an environment variable for the rest of a forked child (no restore needed).
void child_env(const char* name, const char* value) { ::setenv(name, value, 1); }

TEST(DistributedDebug, LevelFromEnvironment) {
  const char* old = std::getenv("EMBER_DISTRIBUTED_DEBUG");
  const std::string saved = old ? old : "";
  ::setenv("EMBER_DISTRIBUTED_DEBUG", "detail", 1);
  EXPECT_EQ(debug_level(), DebugLevel::Detail);
  ::setenv("EMBER_DISTRIBUTED_DEBUG", "INFO", 1);
  EXPECT_EQ(debug_level(), DebugLevel::Info);
  ::setenv("EMBER_DISTRIBUTED_DEBUG", "LOUD", 1);
  try {
    (void)debug_level();
    ADD_FAILURE() << "LOUD accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("expected OFF, INFO or DETAIL, got 'LOUD'"),
              std::string::npos)
        << e.what();
  }
  ::unsetenv("EMBER_DISTRIBUTED_DEBUG");
  EXPECT_EQ(debug_level(), DebugLevel::Off);
  if (old) ::setenv("EMBER_DISTRIBUTED_DEBUG", saved.c_str(), 1);
}

// DETAIL: rank 1 wraps the model with another bucket cap, so its first bucket all-reduce has
// another shape. Every rank gets the same DistError naming ranks 0 and 1 and both calls, instead
// of a hang or a corrupted average. Ranks with matching settings train normally under DETAIL.
TEST(DistributedDebug, DetailNamesBothRanksOfAMismatchedCollective) {
  EMBER_REQUIRE_GLOO();
  for (int n : {2, 4}) {
    run_group(n, [n](std::shared_ptr<ProcessGroup> pg, int rank) {
      child_env("EMBER_DISTRIBUTED_DEBUG", "DETAIL");
      {  // matching ranks: checked and correct
        auto model = std::make_shared<Counted>(7);
        DistributedDataParallel ddp(model, pg);
        require(dynamic_cast<CheckedProcessGroup*>(ddp.comm_group().get()) != nullptr,
                "DETAIL did not wrap the group");
        auto ref = std::make_shared<Counted>(999);
        ref->load_state_dict(model->state_dict());
        mse(ddp, batch_of(rank, 0)).backward();
        Tensor loss;
        for (int r = 0; r < n; ++r) {
          Tensor l = mse(*ref->net, batch_of(r, 0));
          loss = loss.defined() ? loss + l : l;
        }
        (loss / n).backward();
        const auto a = model->named_parameters();
        const auto b = ref->named_parameters();
        for (size_t i = 0; i < a.size(); ++i) {
          require_close("DETAIL grad " + a[i].first, a[i].second.grad(), b[i].second.grad());
        }
      }
      auto model = std::make_shared<Counted>(7);
      DDPOptions o;
      if (rank == 1) o.bucket_cap_mb = 1e-6;  // one bucket per parameter on rank 1 only
      DistributedDataParallel ddp(model, pg, o);
      std::string msg = message_of([&] { mse(ddp, batch_of(rank, 0)).backward(); });
      // Rank 0's single bucket holds every parameter: 6*5+6+3*6+3 = 57 floats; rank 1's first
      // holds net.2.bias (3). (Over shared memory the buckets all-reduce the gradients in
      // place, Note [DDP in place]: checked as the allreduce of their concatenation.)
      require(has(msg, "differs across ranks: rank 0 called allreduce(float32 [57], avg)") &&
                  has(msg, "but rank 1 called allreduce(float32 [3], avg)") &&
                  has(msg, "bucket_cap_mb"),
              "rank " + std::to_string(rank) + ": '" + msg + "'");
    });
  }
}

// The checker on its own: rank 0 all-reduces while the others broadcast.
TEST(DistributedDebug, CheckedGroupCatchesDifferentCollectives) {
  EMBER_REQUIRE_GLOO();
  run_group(4, [](std::shared_ptr<ProcessGroup> pg, int rank) {
    CheckedProcessGroup checked(pg);
    Tensor t = full({4}, 1.0);
    checked.allreduce(t)->wait();  // agreeing calls pass
    require(t.to_vector<float>()[0] == 4.0f, "checked allreduce result");
    std::string msg = message_of([&] {
      if (rank == 0) {
        checked.allreduce(t);
      } else {
        checked.broadcast(t, BroadcastOptions{});
      }
    });
    require(has(msg, "collective #1") && has(msg, "rank 0 called allreduce(float32 [4], sum)") &&
                has(msg, "rank 1 called broadcast(float32 [4], root 0)"),
            "rank " + std::to_string(rank) + ": '" + msg + "'");
  });
}

// INFO: the bucket layout at construction and after the rebuild, then averaged timings every
// EMBER_DDP_LOG_EVERY iterations, one stderr line each (through ember::log), holding "[ddp rank R]".
TEST(DistributedDebug, InfoLogsLayoutAndTimings) {
  EMBER_REQUIRE_GLOO();
  test::TempDir dir;
  const std::string base = dir.file("stderr");
  run_group(2, [&base](std::shared_ptr<ProcessGroup> pg, int rank) {
    child_env("EMBER_DISTRIBUTED_DEBUG", "INFO");
    child_env("EMBER_DDP_LOG_EVERY", "2");
    const std::string path = base + std::to_string(rank);
    std::FILE* f = std::fopen(path.c_str(), "w");
    require(f != nullptr, "cannot open " + path);
    std::fflush(stderr);
    const int saved = ::dup(2);
    ::dup2(::fileno(f), 2);
    {
      auto model = std::make_shared<Counted>(8);
      DDPOptions o;
      o.bucket_cap_mb = 100.0 / (1024 * 1024);
      DistributedDataParallel ddp(model, pg, o);
      for (int it = 0; it < 4; ++it) mse(ddp, batch_of(rank, it)).backward();
    }
    std::fflush(stderr);
    ::dup2(saved, 2);
    ::close(saved);
    std::fclose(f);
    std::ifstream in(path);
    std::vector<std::string> lines;
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    const std::string prefix = "[ddp rank " + std::to_string(rank) + "] ";
    std::string all;
    for (const auto& l : lines) {
      require(l.find(prefix) != std::string::npos, "line without the prefix: '" + l + "'");
      all += l + "\n";
    }
    require(lines.size() == 4, "want 4 lines, got:\n" + all);
    require(has(lines[0], "bucket(s) at construction (reverse registration order): [0]") &&
                has(lines[0], "{net.2.bias"),
            "layout line: " + lines[0]);
    require(has(lines[1], "after the rebuild"), "rebuild line: " + lines[1]);
    require(has(lines[2], "iterations 1-2 average: forward ") && has(lines[2], "communication") &&
                has(lines[2], "overlapped with backward"),
            "timing line: " + lines[2]);
    require(has(lines[3], "iterations 3-4 average"), "second timing line: " + lines[3]);
  });
}

}  // namespace
}  // namespace ember::dist
