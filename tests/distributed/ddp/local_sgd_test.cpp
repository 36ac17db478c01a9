// Post-local SGD and model averaging (distributed/ddp/local_sgd.h) at 4 ranks as threads, each
// with a default group of its own over the threads backend (run_rank_threads), so new_group and
// DDP work as over processes. Expected values are closed forms (means of integers) or a
// reference of the same algorithm written out in the test without DDP, hooks or averagers.
#include <ember/distributed/backends/process_group_threads.h>
#include <ember/distributed/ddp/ddp.h>
#include <ember/distributed/ddp/local_sgd.h>
#include <ember/distributed/environment.h>
#include <ember/distributed/init.h>
#include <ember/nn/layers/activation.h>
#include <ember/nn/layers/container.h>
#include <ember/nn/functional.h>
#include <ember/nn/layers/linear.h>
#include <ember/nn/optim/sgd.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops/elementwise.h>
#include <ember/tensor/grad_mode.h>
#include <ember/tensor/ops/indexing.h>
#include <ember/tensor/ops/random.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tests/distributed/ddp/ddp_test_util.h"
#include "tests/distributed/store/store_test_util.h"

namespace ember::dist {
namespace {

using namespace std::chrono_literals;
using test::require;

constexpr int kRanks = 4;

// Runs body(rank) on kRanks threads, each with its own default group; a rank's failure is
// reported as a test failure.
void run_ranks(const std::function<void(int)>& body) {
  try {
    run_rank_threads(kRanks, body, 60s);
  } catch (const RankThreadError& e) {
    FAIL() << e.what();
  }
}

// Throws unless f() throws ValueError whose message has every one of parts.
void require_error(const std::function<void()>& f, std::initializer_list<std::string> parts) {
  std::string msg;
  try {
    f();
  } catch (const ValueError& e) {
    msg = e.what();
  }
  require(!msg.empty(), "expected a ValueError mentioning '" + *parts.begin() + "'");
  for (const std::string& p : parts) {
    require(msg.find(p) != std::string::npos, "message lacks '" + p + "': " + msg);
  }
}

// Every rank's copy of `t` (float64, flattened), by rank.
std::vector<std::vector<double>> gather(ProcessGroup& pg, const Tensor& t) {
  Tensor mine = t.detach().to(kFloat64).reshape({-1}).contiguous();
  Tensor all = zeros({pg.size() * mine.numel()}, kFloat64);
  pg.allgather_into_tensor(all, mine)->wait();
  std::vector<std::vector<double>> out;
  for (int r = 0; r < pg.size(); ++r)
    out.push_back(all.narrow(0, r * mine.numel(), mine.numel()).to_vector<double>());
  return out;
}

// Sets LOCAL_WORLD_SIZE (or clears it, and the MPI launchers' equivalents) for its lifetime.
class LocalWorldSizeEnv {
 public:
  explicit LocalWorldSizeEnv(std::optional<int> n) {
    for (const char* name : kNames) {
      const char* v = std::getenv(name);
      saved_[name] = v ? std::optional<std::string>(v) : std::nullopt;
      unsetenv(name);
    }
    if (n) setenv("LOCAL_WORLD_SIZE", std::to_string(*n).c_str(), 1);
  }
  ~LocalWorldSizeEnv() {
    for (const auto& [name, v] : saved_) {
      if (v) {
        setenv(name.c_str(), v->c_str(), 1);
      } else {
        unsetenv(name.c_str());
      }
    }
  }

 private:
  static constexpr const char* kNames[] = {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                                           "MPI_LOCALNRANKS"};
  std::map<std::string, std::optional<std::string>> saved_;
};

// ---- new_subgroups ----------------------------------------------------------------------------

TEST(NewSubgroups, SplitsFourRanksIntoPairs) {
  run_ranks([](int rank) {
    Subgroups s = new_subgroups(2);
    require(s.ranks == std::vector<std::vector<int>>{{0, 1}, {2, 3}}, "every subgroup's ranks");
    require(s.group && s.group->size() == 2 && s.group->rank() == rank % 2, "this rank's pair");
    require(s.group->global_ranks() == s.ranks[rank / 2], "the pair's world ranks");
    Tensor t = full({1}, static_cast<float>(rank));
    s.group->allreduce(t)->wait();
    require(t.item<float>() == (rank < 2 ? 0 + 1 : 2 + 3), "all-reduce within the pair");

    Subgroups ones = new_subgroups(1);
    require(ones.ranks.size() == 4 && ones.group->size() == 1, "subgroups of one rank");
    Subgroups all = new_subgroups(4, default_group());
    require(all.ranks.size() == 1 && all.group->size() == 4 && all.group->rank() == rank,
            "one subgroup of the whole world");

    require_error([] { new_subgroups(3); },
                  {"[new_subgroups]", "must divide the group's size 4", "got 3"});
    require_error([] { new_subgroups(0); }, {"[new_subgroups]", "must be >= 1", "got 0"});
    require_error([] { new_subgroups(8); }, {"[new_subgroups]", "must not exceed", "4, got 8"});
    require_error([&] { new_subgroups(1, s.group); },
                  {"[new_subgroups]", "a group of the whole world (4 ranks)", "got one of 2"});
  });
}

TEST(LocalWorldSize, ReadsTheLaunchersVariables) {
  using Env = std::map<std::string, std::string>;
  EXPECT_EQ(local_world_size(Env{}), std::nullopt);
  EXPECT_EQ(local_world_size(Env{{"LOCAL_WORLD_SIZE", "8"}}), 8);
  EXPECT_EQ(local_world_size(Env{{"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}), 4);
  EXPECT_EQ(local_world_size(Env{{"MPI_LOCALNRANKS", "2"}}), 2);
  EXPECT_THROW(local_world_size(Env{{"LOCAL_WORLD_SIZE", "0"}}), ValueError);
  EXPECT_THROW(local_world_size(Env{{"LOCAL_WORLD_SIZE", "two"}}), ValueError);
}

// ---- average_parameters -----------------------------------------------------------------------

// A leaf with a gradient (average_parameters skips those without).
Tensor param(Tensor values, bool with_grad = true) {
  values.requires_grad_();
  if (with_grad) values.set_grad(zeros(values.shape(), values.dtype()));
  return values;
}

TEST(AverageParameters, ExactMeanInPlaceSkippingParametersWithoutGrad) {
  run_ranks([](int rank) {
    const float r = static_cast<float>(rank);
    Tensor a = param(full({2, 3}, 10 * r));
    Tensor b = param(arange(0, 4, 1, kFloat32) + r);
    Tensor frozen = param(full({2}, r), /*with_grad=*/false);
    Tensor d = param(full({3}, static_cast<double>(rank), kFloat64));  // another dtype
    void* const a_data = a.data_ptr();
    void* const b_data = b.data_ptr();
    average_parameters({a, frozen, b, d}, *default_group());
    // Means over ranks 0..3: 10 * 1.5 = 15; i + 1.5; 1.5.
    require(a.data_ptr() == a_data && b.data_ptr() == b_data, "parameters keep their storage");
    require(a.to_vector<float>() == std::vector<float>(6, 15.0f), "a is the mean");
    require(b.to_vector<float>() == std::vector<float>({1.5f, 2.5f, 3.5f, 4.5f}), "b is the mean");
    require(d.to_vector<double>() == std::vector<double>(3, 1.5), "float64 d is the mean");
    require(frozen.to_vector<float>() == std::vector<float>(2, r), "no grad: left alone");
    require(a.requires_grad() && a.is_leaf(), "still a leaf that requires grad");
    require_error([] { average_parameters({Tensor()}, *default_group()); },
                  {"[average_parameters]", "parameter 0 is undefined"});
  });
}

// ---- averagers --------------------------------------------------------------------------------

// Runs `averager` for `steps` steps on one parameter that holds 10 * rank + step before each
// step, and checks after each step that it holds expected(step, rank).
void check_schedule(ModelAverager& averager, int rank, int steps,
                    const std::function<double(int step, int rank)>& expected) {
  Tensor p = param(zeros({3}));
  for (int s = 0; s < steps; ++s) {
    {
      NoGradGuard no_grad;
      p.fill_(10.0 * rank + s);
    }
    require(averager.step() == s, "step() before step " + std::to_string(s));
    averager.average_parameters(std::vector<Tensor>{p});
    const double want = expected(s, rank);
    require(p.to_vector<float>() == std::vector<float>(3, static_cast<float>(want)),
            "step " + std::to_string(s) + " rank " + std::to_string(rank) + ": got " +
                std::to_string(p.to_vector<float>()[0]) + ", want " + std::to_string(want));
  }
}

// What a parameter holding 10 * rank + s becomes when averaged over all ranks, over its pair,
// or not at all.
double world_mean(int s, int) { return 15.0 + s; }
double pair_mean(int s, int rank) { return (rank < 2 ? 5.0 : 25.0) + s; }
double own(int s, int rank) { return 10.0 * rank + s; }

TEST(ModelAverager, PeriodicAveragesAfterWarmupEveryPeriod) {
  run_ranks([](int rank) {
    // warmup 2, period 3: steps 2, 5, 8.
    PeriodicModelAverager world(3, 2);
    check_schedule(world, rank, 10, [](int s, int r) {
      return s >= 2 && (s - 2) % 3 == 0 ? world_mean(s, r) : own(s, r);
    });
    // Over a pair, period 2 without warm-up: steps 0, 2, 4.
    PeriodicModelAverager pairs(2, 0, new_subgroups(2).group);
    check_schedule(pairs, rank, 6,
                   [](int s, int r) { return s % 2 == 0 ? pair_mean(s, r) : own(s, r); });

    require_error([] { PeriodicModelAverager(0); },
                  {"[PeriodicModelAverager]", "period must be >= 1", "got 0"});
    require_error([] { PeriodicModelAverager(2, -1); },
                  {"[PeriodicModelAverager]", "warmup_steps must be >= 0", "got -1"});
    require_error([&] { world.set_step(-2); }, {"[ModelAverager]", "got -2"});
  });
}

TEST(ModelAverager, HierarchicalPicksTheLargestPeriodDividingTheStep) {
  run_ranks([](int rank) {
    // Pairs every 2 steps, all 4 ranks every 4: step 0 all, 2 pairs, 4 all, 6 pairs, ...
    HierarchicalModelAverager h({{2, 2}, {4, 4}});
    check_schedule(h, rank, 9, [](int s, int r) {
      return s % 4 == 0 ? world_mean(s, r) : s % 2 == 0 ? pair_mean(s, r) : own(s, r);
    });
    require(h.group_at(4) == h.process_group() && h.group_at(6)->size() == 2 &&
                h.group_at(3) == nullptr,
            "group_at");
    // Warm-up 3: nothing before step 3; then periods divide the step itself (not step - 3).
    HierarchicalModelAverager late({{2, 2}, {4, 4}}, 3);
    check_schedule(late, rank, 9, [](int s, int r) {
      if (s < 3) return own(s, r);
      return s % 4 == 0 ? world_mean(s, r) : s % 2 == 0 ? pair_mean(s, r) : own(s, r);
    });

    using Levels = std::vector<std::pair<int64_t, int>>;
    require_error([] { HierarchicalModelAverager(Levels{}); },
                  {"[HierarchicalModelAverager]", "must not be empty"});
    require_error(
        [] {
          HierarchicalModelAverager(Levels{{0, 2}, {4, 4}});
        },
        {"[HierarchicalModelAverager]", "periods must be >= 1", "got 0"});
    require_error(
        [] {
          HierarchicalModelAverager(Levels{{4, 2}, {2, 4}});
        },
        {"[HierarchicalModelAverager]", "strictly increasing", "got 4 then 2"});
    require_error(
        [] {
          HierarchicalModelAverager(Levels{{2, 2}, {4, 2}});
        },
        {"[HierarchicalModelAverager]", "the last group size must be", "4, got 2"});
    require_error(
        [] {
          HierarchicalModelAverager(Levels{{2, 2}, {4, 4}}, -1);
        },
        {"[HierarchicalModelAverager]", "warmup_steps must be >= 0", "got -1"});
    require_error(
        [] {
          HierarchicalModelAverager(Levels{{2, 3}, {4, 4}});
        },
        {"[new_subgroups]", "must divide the group's size 4", "got 3"});
  });
}

// ---- post-local SGD end to end ----------------------------------------------------------------

constexpr int64_t kIn = 6, kHidden = 5, kOut = 2, kRows = 4;
constexpr double kLr = 0.1;

std::shared_ptr<nn::Sequential> make_mlp() {
  auto m = std::make_shared<nn::Sequential>(std::make_shared<nn::Linear>(kIn, kHidden),
                                            std::make_shared<nn::Tanh>(),
                                            std::make_shared<nn::Linear>(kHidden, kOut));
  m->to(kFloat64);
  return m;
}

// The initial weights every replica starts from (drawn once, on the test's thread).
const nn::NamedTensors& initial_weights() {
  static const nn::NamedTensors w = [] {
    manual_seed(7);
    nn::NamedTensors out;
    for (auto& [k, t] : make_mlp()->state_dict()) out.emplace_back(k, t.clone());
    return out;
  }();
  return w;
}

std::shared_ptr<nn::Sequential> initial_mlp() {
  auto m = make_mlp();
  m->load_state_dict(initial_weights());
  return m;
}

// Rank `rank`'s batch at step `step`: its own data, the same in every thread.
Tensor loss_at(nn::Module& m, int rank, int step) {
  Generator gen(1000 + 16 * static_cast<uint64_t>(step) + static_cast<uint64_t>(rank));
  Tensor x = randn({kRows, kIn}, TensorOptions(kFloat64), &gen);
  Tensor y = randn({kRows, kOut}, TensorOptions(kFloat64), &gen);
  return nn::functional::mse_loss(m.forward(x), y);
}

Tensor flat_params(const nn::Module& m) {
  std::vector<Tensor> flat;
  for (const Tensor& p : m.parameters()) flat.push_back(p.detach().reshape({-1}));
  return cat(flat, 0);
}

struct Schedule {
  int64_t start_localSGD_iter = 3;
  bool post_local_gradient_allreduce = true;
  int64_t period = 2;
  int64_t warmup = 3;
};

// The algorithm written out for all ranks at once, without DDP: every rank's gradient from its
// own batch; gradients averaged over the 4 ranks before start_localSGD_iter, then within pairs
// (or not at all); an SGD step; then the parameters averaged over the 4 ranks at steps s >=
// warmup with (s - warmup) % period == 0. Returns each step's parameters by rank.
std::vector<std::vector<Tensor>> reference_run(const Schedule& c, int steps) {
  std::vector<std::shared_ptr<nn::Sequential>> replicas;
  for (int r = 0; r < kRanks; ++r) replicas.push_back(initial_mlp());
  const size_t np = replicas[0]->parameters().size();
  std::vector<std::vector<Tensor>> out;
  for (int s = 0; s < steps; ++s) {
    std::vector<std::vector<Tensor>> g(kRanks);
    for (int r = 0; r < kRanks; ++r) {
      replicas[r]->zero_grad();
      loss_at(*replicas[r], r, s).backward();
      for (const Tensor& p : replicas[r]->parameters()) g[r].push_back(p.grad().clone());
    }
    NoGradGuard no_grad;
    for (int r = 0; r < kRanks; ++r) {
      const auto params = replicas[r]->parameters();
      for (size_t i = 0; i < np; ++i) {
        Tensor grad;
        if (s < c.start_localSGD_iter) {
          grad = (g[0][i] + g[1][i] + g[2][i] + g[3][i]) / 4.0;
        } else if (c.post_local_gradient_allreduce) {
          const int mate = r ^ 1;
          grad = (g[r][i] + g[mate][i]) / 2.0;
        } else {
          grad = g[r][i];
        }
        Tensor p = params[i];
        p.sub_(grad * kLr);
      }
    }
    if (s >= c.warmup && (s - c.warmup) % c.period == 0) {
      for (size_t i = 0; i < np; ++i) {
        Tensor mean = zeros(replicas[0]->parameters()[i].shape(), kFloat64);
        for (int r = 0; r < kRanks; ++r) mean = mean + replicas[r]->parameters()[i];
        mean = mean / static_cast<double>(kRanks);
        for (int r = 0; r < kRanks; ++r) replicas[r]->parameters()[i].copy_(mean);
      }
    }
    std::vector<Tensor> now;
    for (int r = 0; r < kRanks; ++r) now.push_back(flat_params(*replicas[r]).clone());
    out.push_back(now);
  }
  return out;
}

// One rank's training objects: the model under DDP with the hook, and the post-local optimizer.
struct Trainer {
  std::shared_ptr<nn::Sequential> model;
  std::shared_ptr<DistributedDataParallel> ddp;
  std::shared_ptr<PostLocalSGDState> hook;
  std::shared_ptr<PostLocalSGDOptimizer> opt;

  Trainer(const Schedule& c, double momentum, std::shared_ptr<ProcessGroup> pairs) {
    model = initial_mlp();
    ddp = std::make_shared<DistributedDataParallel>(model);
    hook = std::make_shared<PostLocalSGDState>(nullptr, std::move(pairs), c.start_localSGD_iter,
                                               c.post_local_gradient_allreduce);
    ddp->register_comm_hook(hook, post_localSGD_hook, "post_localSGD");
    auto sgd = std::make_shared<nn::optim::SGD>(
        ddp->parameters(), nn::optim::SGDOptions{.lr = kLr, .momentum = momentum});
    opt = std::make_shared<PostLocalSGDOptimizer>(
        sgd, std::make_shared<PeriodicModelAverager>(c.period, c.warmup));
  }
  void train_step(int rank, int step) {
    opt->zero_grad();
    loss_at(*ddp, rank, step).backward();
    opt->step();
  }
};

void check_against_reference(const Schedule& c) {
  constexpr int kSteps = 9;
  const auto ref = reference_run(c, kSteps);
  run_ranks([&](int rank) {
    Trainer t(c, /*momentum=*/0,
              c.post_local_gradient_allreduce ? new_subgroups(2).group : nullptr);
    for (int s = 0; s < kSteps; ++s) {
      t.train_step(rank, s);
      test::require_close("rank " + std::to_string(rank) + " step " + std::to_string(s),
                          flat_params(*t.model), ref[s][rank], 1e-6);
      require(t.opt->averager().step() == s + 1, "the averager counts steps");
      require(t.hook->iteration() == std::min<int64_t>(s + 1, c.start_localSGD_iter),
              "the hook counts iterations up to start_localSGD_iter");
      // Step 4 is local (not averaged: (4 - 3) % 2 == 1): replicas in different pairs must
      // differ, which a hook still all-reducing over the world would not give.
      if (s == 4) {
        const auto all = gather(*default_group(), flat_params(*t.model));
        require(all[0] != all[2] && all[1] != all[3], "ranks in different pairs differ");
        if (c.post_local_gradient_allreduce) {
          require(all[0] == all[1] && all[2] == all[3], "ranks of a pair agree");
        } else {
          require(all[0] != all[1] && all[2] != all[3], "without gradient all-reduce all differ");
        }
      }
      if (s == 5) {
        const auto all = gather(*default_group(), flat_params(*t.model));
        for (int r = 1; r < kRanks; ++r) require(all[r] == all[0], "averaged at step 5");
      }
    }
  });
}

TEST(PostLocalSGD, MatchesTheAlgorithmWrittenOut) { check_against_reference(Schedule{}); }

TEST(PostLocalSGD, WithoutGradientAllreduceAfterWarmup) {
  check_against_reference(Schedule{.post_local_gradient_allreduce = false});
}

// The reference itself: before warm-up every replica agrees; after it pairs differ.
TEST(PostLocalSGD, ReferenceSeparatesPairsAfterWarmup) {
  const auto ref = reference_run(Schedule{}, 5);
  for (int r = 1; r < kRanks; ++r) {
    EXPECT_TRUE(equal(ref[2][r], ref[2][0])) << "step 2, rank " << r;
  }
  EXPECT_FALSE(equal(ref[4][0], ref[4][2]));
  EXPECT_TRUE(equal(ref[4][0], ref[4][1]));
}

// Saving after 7 steps (a local step: the ranks differ, so each keeps its own model) and
// resuming with fresh objects gives exactly the parameters of an uninterrupted 12-step run.
TEST(PostLocalSGD, ResumesWithTheSameSchedule) {
  const Schedule c;
  run_ranks([&](int rank) {
    Tensor uninterrupted;
    {
      Trainer t(c, 0.9, new_subgroups(2).group);
      for (int s = 0; s < 12; ++s) t.train_step(rank, s);
      uninterrupted = flat_params(*t.model).clone();
    }
    nn::NamedTensors model_state, hook_state;
    nn::optim::OptimizerState opt_state;
    {
      Trainer t(c, 0.9, new_subgroups(2).group);
      for (int s = 0; s < 7; ++s) t.train_step(rank, s);
      for (auto& [k, v] : t.model->state_dict()) model_state.emplace_back(k, v.clone());
      hook_state = t.hook->state_dict();
      opt_state = t.opt->state_dict();
      for (auto& [k, v] : opt_state.state) v = v.clone();
    }
    bool has_step = false;
    for (auto& [k, v] : opt_state.state) {
      if (k == "step") has_step = v.to_vector<int64_t>() == std::vector<int64_t>{7};
    }
    require(has_step, "the optimizer's state carries the averager's step 7");

    Trainer t(c, 0.9, new_subgroups(2).group);
    // DDP's constructor gave every rank rank 0's parameters; each takes back its own.
    t.model->load_state_dict(model_state);
    t.hook->load_state_dict(hook_state);
    t.opt->load_state_dict(opt_state);
    require(t.hook->iteration() == 3 && t.opt->averager().step() == 7, "restored counters");
    for (int s = 7; s < 12; ++s) t.train_step(rank, s);
    require(equal(flat_params(*t.model), uninterrupted),
            "resumed parameters equal the uninterrupted run's, rank " + std::to_string(rank));
  });
}

TEST(PostLocalSGD, StateErrorsAndDefaults) {
  {
    LocalWorldSizeEnv env(std::nullopt);
    run_ranks([](int) {
      require_error([] { PostLocalSGDState(nullptr, nullptr, 3); },
                    {"[PostLocalSGDState]", "expected a subgroup", "LOCAL_WORLD_SIZE"});
      require_error([] { PostLocalSGDState(nullptr, nullptr, -1, false); },
                    {"[PostLocalSGDState]", "start_localSGD_iter must be >= 0", "got -1"});
      // No subgroup is needed without the post-local gradient all-reduce.
      PostLocalSGDState quiet(nullptr, nullptr, 3, false);
      require(quiet.subgroup() == nullptr && quiet.process_group() == default_group(),
              "defaults without a subgroup");

      PostLocalSGDState s(nullptr, new_subgroups(2).group, 3);
      require_error([&] { s.load_state_dict({}); }, {"[PostLocalSGDState]", "'iteration'"});
      require_error(
          [&] {
            s.load_state_dict({{"iteration", from_vector(std::vector<int64_t>{4})}});
          },
          {"[PostLocalSGDState]", "[0, 3]", "got 4"});
      PostLocalSGDState other(nullptr, s.subgroup(), 5);
      require_error([&] { s.load_state_dict(other.state_dict()); },
                    {"[PostLocalSGDState]", "start_localSGD_iter 5", "this one has 3"});
      require_error(
          [&] {
            s.load_state_dict({{"iteration", from_vector(std::vector<int64_t>{1})},
                               {"bogus", from_vector(std::vector<int64_t>{1})}});
          },
          {"[PostLocalSGDState]", "unknown entry 'bogus'"});
      require(s.iteration() == 0, "a refused load changes nothing");
    });
  }
  {
    // The default subgroup: LOCAL_WORLD_SIZE ranks per node.
    LocalWorldSizeEnv env(2);
    run_ranks([](int rank) {
      PostLocalSGDState s(nullptr, nullptr, 3);
      require(s.subgroup() && s.subgroup()->size() == 2 &&
                  s.subgroup()->global_ranks() ==
                      (rank < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3}),
              "a pair per node of 2");
    });
  }
}

TEST(PostLocalSGD, OptimizerWithoutSavedStepResetsTheAverager) {
  run_ranks([](int) {
    auto p = param(zeros({2}, kFloat32));
    auto sgd =
        std::make_shared<nn::optim::SGD>(std::vector<Tensor>{p}, nn::optim::SGDOptions{.lr = 0.1});
    auto averager = std::make_shared<PeriodicModelAverager>(2, 0);
    PostLocalSGDOptimizer opt(sgd, averager);
    opt.step();
    opt.step();
    require(averager->step() == 2, "two steps");
    nn::optim::OptimizerState without = sgd->state_dict();  // no "step"
    opt.load_state_dict(without);
    require(averager->step() == 0, "a state without a step resets the averager to 0");
    nn::optim::OptimizerState bad = opt.state_dict();
    for (auto& [k, v] : bad.state) {
      if (k == "step") v = from_vector(std::vector<int64_t>{-3});
    }
    require_error([&] { opt.load_state_dict(bad); },
                  {"[PostLocalSGDOptimizer]", "'step' >= 0", "got -3"});
    require_error([&] { PostLocalSGDOptimizer(nullptr, averager); },
                  {"[PostLocalSGDOptimizer]", "expected an optimizer"});
    require_error([&] { PostLocalSGDOptimizer(sgd, nullptr); },
                  {"[PostLocalSGDOptimizer]", "expected a model averager"});
  });
}

}  // namespace
}  // namespace ember::dist
