// Expert parallelism as a user runs it: every rank builds the same mixture of experts, shards its
// experts with parallelize_experts, and routes its own tokens; each rank's outputs and gradients
// are what one process computes over every rank's tokens with the losses averaged, at 1 to 4
// rank threads (a rank without tokens among them) and 2 gloo processes; with DDP over the rest
// of the model, training steps are one process's steps over the whole batch.
#include <ember/distributed/tensor_parallel/expert_parallel.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include <ember/autograd/autograd.h>
#include <ember/distributed/checkpoint/model_checkpoint.h>
#include <ember/distributed/ddp/ddp.h>
#include <ember/distributed/mesh/device_mesh.h>
#include <ember/distributed/tensor_parallel/clip_grad.h>
#include <ember/distributed/functional/collectives.h>
#include <ember/nn/functional.h>
#include <ember/nn/clip_grad.h>
#include <ember/nn/layers.h>
#include <ember/nn/optim/sgd.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/ops.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops/random.h>
#include "tests/distributed/backends/threads_test_util.h"
#include "tests/distributed/ddp/ddp_test_util.h"
#include "tests/temp_dir.h"

namespace ember::dist {
namespace {

using test::require;
using test::require_close;

Tensor or_zeros(const Tensor& grad, const Tensor& like) {
  return grad.defined() ? grad : zeros_like(like);
}

// Each rank's layer (all built from one seed), tokens and output weights, and one process's
// answer: the layer over every rank's tokens, the loss the mean over ranks of sum(y_r * w_r).
struct Experts {
  int n = 1;
  nn::MoEOptions options;
  std::vector<std::shared_ptr<nn::MoE>> layers;
  std::vector<Tensor> x, w, y, dx;
  Tensor drouter, dw1, dw3, dw2;
};

Experts make_setup(int n, const std::vector<int64_t>& tokens, const nn::MoEOptions& options) {
  Experts s;
  s.n = n;
  s.options = options;
  for (int r = 0; r <= n; ++r) {  // the last: the one process's
    manual_seed(7);
    s.layers.push_back(std::make_shared<nn::MoE>(options));
  }
  const std::shared_ptr<nn::MoE> one = s.layers.back();
  s.layers.pop_back();
  nn::MoE& whole = *one;
  manual_seed(8);
  Tensor loss = zeros({});
  std::vector<Tensor> leaves;
  for (int r = 0; r < n; ++r) {
    s.x.push_back(randn({tokens[r], options.dim}));
    s.w.push_back(randn({tokens[r], options.dim}));
    leaves.push_back(s.x.back().detach().requires_grad_());
    const Tensor y = whole.forward(leaves.back());
    s.y.push_back(y.detach());
    loss = loss + (y * s.w.back()).sum() / static_cast<double>(n);
  }
  loss.backward();
  for (const Tensor& l : leaves) s.dx.push_back(l.grad());
  s.drouter = whole.router->weight.grad();
  s.dw1 = or_zeros(whole.w1.grad(), whole.w1);
  s.dw3 = or_zeros(whole.w3.grad(), whole.w3);
  s.dw2 = or_zeros(whole.w2.grad(), whole.w2);
  return s;
}

// One rank's part: its outputs, its tokens' gradients, the router's gradient averaged over ranks
// (what DDP would do) and its experts' gradients against the one process's.
void check_rank(const Experts& s, const std::shared_ptr<ProcessGroup>& pg, int rank,
                const std::string& what, Device device = kCPU, double tol = 1e-5) {
  const std::shared_ptr<nn::MoE>& moe = s.layers[rank];
  moe->to(device);
  parallelize_experts(moe, pg);
  const int64_t local = s.options.experts / s.n;
  require(moe->local_experts() == local && moe->first_expert() == rank * local,
          what + ": the experts kept");
  Tensor x = s.x[rank].to(device).detach().requires_grad_();
  const Tensor y = moe->forward(x);
  require(y.device() == device, what + ": the output's device");
  require_close(what + " y", y.cpu(), s.y[rank], tol);
  (y * s.w[rank].to(device)).sum().backward();
  require_close(what + " dx", x.grad().cpu() / static_cast<double>(s.n), s.dx[rank], tol);
  const Tensor drouter = functional::all_reduce(moe->router->weight.grad(), ReduceOp::Sum, pg) /
                         static_cast<double>(s.n);
  require_close(what + " drouter", drouter.cpu(), s.drouter, tol);
  require_close(what + " dw1", or_zeros(moe->w1.grad(), moe->w1).cpu(),
                s.dw1.narrow(0, rank * local, local), tol);
  require_close(what + " dw3", or_zeros(moe->w3.grad(), moe->w3).cpu(),
                s.dw3.narrow(0, rank * local, local), tol);
  require_close(what + " dw2", or_zeros(moe->w2.grad(), moe->w2).cpu(),
                s.dw2.narrow(0, rank * local, local), tol);
}

// Two gloo processes over shared memory, as under emberrun. First in the file, so that a run of
// the whole binary forks before any case started a kernel's or BLAS's threads.
TEST(ExpertParallelGloo, TwoProcesses) {
  test::run_gloo_ranks(2, [&](std::shared_ptr<ProcessGroupGloo> pg, int rank) {
    const Experts s = make_setup(2, {7, 4}, {.dim = 6, .hidden = 8, .experts = 4, .top_k = 2});
    check_rank(s, pg, rank, "gloo rank " + std::to_string(rank));
  });
}

TEST(ExpertParallel, EachRanksPartIsOneProcessOverEveryRanksTokens) {
  struct Case {
    int n;
    std::vector<int64_t> tokens;
    nn::MoEOptions options;
  };
  const std::vector<Case> cases = {
      {1, {9}, {.dim = 6, .hidden = 8, .experts = 4, .top_k = 2}},
      {2, {5, 9}, {.dim = 6, .hidden = 8, .experts = 8, .top_k = 2}},
      {3, {4, 7, 2}, {.dim = 5, .hidden = 4, .experts = 3, .top_k = 3, .normalize_weights = false}},
      // Rank 1 has no tokens (it still serves its experts); top-1 routing.
      {4,
       {6, 0, 3, 11},
       {.dim = 6, .hidden = 8, .experts = 8, .top_k = 1, .normalize_weights = false}},
  };
  for (const Case& c : cases) {
    const Experts s = make_setup(c.n, c.tokens, c.options);
    test::ThreadsSetup setup;
    setup.n = c.n;
    test::run_threads(setup, [&](std::shared_ptr<ProcessGroup> pg, int rank) {
      check_rank(s, pg, rank,
                 std::to_string(c.n) + " ranks, top " + std::to_string(c.options.top_k) +
                     ", rank " + std::to_string(rank));
    });
  }
}

// Rank threads sharing one GPU, a stream each: the routing (topk's CUDA kernel), the exchanges
// between streams and the experts' matmuls on the device give one process's CPU answer.
TEST(ExpertParallelCuda, RankThreadsOnOneGpu) {
  EMBER_REQUIRE_CUDA();
  const Experts s = make_setup(4, {6, 0, 3, 11}, {.dim = 6, .hidden = 8, .experts = 8});
  test::ThreadsSetup setup;
  setup.n = 4;
  setup.device = cuda_device(0);
  test::run_threads(setup, [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    check_rank(s, pg, rank, "cuda, 4 ranks, rank " + std::to_string(rank), setup.device, 1e-4);
  });
}

// A model with an MoE in the middle, trained for three SGD steps with the balance loss: ranks
// under DDP (the experts left to expert parallelism) against one process over both ranks'
// batches, with the per-rank losses averaged as DDP averages gradients; the gradient's norm
// over the ranks is one process's. The ranks' checkpoint then loads into one process and into
// four expert-parallel ranks, each getting its part of the trained weights and momentum.
TEST(ExpertParallel, TrainsUnderDdpAsOneProcessOverTheWholeBatchAndCheckpoints) {
  constexpr int kRanks = 2, kSteps = 3;
  const nn::MoEOptions options{.dim = 6, .hidden = 8, .experts = 4, .top_k = 2};
  auto build = [&] {
    manual_seed(21);
    return std::make_shared<nn::Sequential>(std::make_shared<nn::Linear>(5, 6),
                                            std::make_shared<nn::MoE>(options),
                                            std::make_shared<nn::Linear>(6, 3));
  };
  auto moe_of = [](nn::Sequential& m) {
    return std::dynamic_pointer_cast<nn::MoE>(m.children()[1]);
  };
  // The task's loss plus the balance loss of the forward it ran.
  auto loss_of = [&](nn::Module& m, nn::MoE& moe, const Tensor& x, const Tensor& t) {
    const Tensor y = m.forward(x);
    return nn::functional::mse_loss(y, t) + 0.01 * moe.aux_loss();
  };
  manual_seed(22);
  std::vector<std::vector<Tensor>> x(kRanks), t(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    for (int i = 0; i < kSteps; ++i) {
      x[r].push_back(randn({8, 5}));
      t[r].push_back(randn({8, 3}));
    }
  }
  auto whole = build();
  nn::optim::SGD whole_opt(whole->parameters(), {.lr = 0.2, .momentum = 0.9});
  double whole_norm = 0;
  for (int i = 0; i < kSteps; ++i) {
    whole_opt.zero_grad();
    Tensor loss = zeros({});
    for (int r = 0; r < kRanks; ++r)
      loss = loss + loss_of(*whole, *moe_of(*whole), x[r][i], t[r][i]) / kRanks;
    loss.backward();
    whole_norm = nn::clip_grad_norm_(whole->parameters(), 1e9).item<float>();
    whole_opt.step();
  }
  const test::TempDir dir("ember_ep_ckpt");
  std::vector<std::shared_ptr<nn::Sequential>> models;
  for (int r = 0; r < kRanks; ++r) models.push_back(build());
  test::ThreadsSetup setup;
  setup.n = kRanks;
  test::run_threads(setup, [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto model = models[rank];
    parallelize_experts(moe_of(*model), pg);
    const std::vector<std::string> experts = expert_parameter_names(*model);
    require(experts == std::vector<std::string>{"1.w1", "1.w3", "1.w2"}, "expert names");
    auto ddp = std::make_shared<DistributedDataParallel>(model, pg,
                                                         DDPOptions{.ignored_parameters = experts});
    nn::optim::SGD opt(ddp->parameters(), {.lr = 0.2, .momentum = 0.9});
    const auto mesh = DeviceMesh::from_group({pg}, "cpu");
    for (int i = 0; i < kSteps; ++i) {
      opt.zero_grad();
      loss_of(*ddp, *moe_of(*model), x[rank][i], t[rank][i]).backward();
      const double norm = clip_grad_norm_(model->parameters(), 1e9, *mesh).item<float>();
      require(i + 1 < kSteps || std::abs(norm - whole_norm) < 1e-5 * whole_norm,
              "the gradient norm " + std::to_string(norm) + ", one process's " +
                  std::to_string(whole_norm));
      opt.step();
    }
    save_model_checkpoint(dir.path(), *model, &opt, *pg);
    // DDP's buckets hold every position of the module's parameters but the experts'.
    std::vector<size_t> bucketed;
    for (const auto& b : ddp->bucket_indices()) bucketed.insert(bucketed.end(), b.begin(), b.end());
    std::sort(bucketed.begin(), bucketed.end());
    const nn::NamedTensors named = model->named_parameters();
    std::vector<size_t> want_bucketed;
    for (size_t p = 0; p < named.size(); ++p) {
      if (std::find(experts.begin(), experts.end(), named[p].first) == experts.end()) {
        want_bucketed.push_back(p);
      }
    }
    require(bucketed == want_bucketed, "DDP's buckets hold the module's non-expert positions");
    const nn::NamedTensors got = model->named_parameters(), want = whole->named_parameters();
    require(got.size() == want.size(), "parameter count");
    for (size_t p = 0; p < got.size(); ++p) {
      const bool expert = std::find(experts.begin(), experts.end(), got[p].first) != experts.end();
      const Tensor w = expert ? want[p].second.narrow(0, rank * 2, 2) : want[p].second;
      require_close("rank " + std::to_string(rank) + " " + got[p].first, got[p].second, w, 1e-5);
    }
  });

  // One process: the whole experts, assembled from both ranks' parts; then a step from the
  // loaded momentum equals the reference's next step.
  auto plain = build();
  nn::optim::SGD plain_opt(plain->parameters(), {.lr = 0.2, .momentum = 0.9});
  load_model_checkpoint(dir.path(), *plain, &plain_opt);
  const nn::MoE& loaded = *moe_of(*plain);
  const std::vector<Tensor> saved = {loaded.w1.detach().clone(), loaded.w3.detach().clone(),
                                     loaded.w2.detach().clone()};
  auto next_step = [&](nn::Sequential& m, nn::optim::SGD& opt) {
    opt.zero_grad();
    loss_of(m, *moe_of(m), x[0][0], t[0][0]).backward();
    opt.step();
  };
  next_step(*plain, plain_opt);
  next_step(*whole, whole_opt);
  const nn::NamedTensors want = whole->named_parameters(), got = plain->named_parameters();
  for (size_t p = 0; p < got.size(); ++p) {
    require_close("one process " + got[p].first, got[p].second, want[p].second, 1e-5);
  }
  // Four expert-parallel ranks: one expert each.
  std::vector<std::shared_ptr<nn::Sequential>> four;
  for (int r = 0; r < 4; ++r) four.push_back(build());
  setup.n = 4;
  test::run_threads(setup, [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    parallelize_experts(moe_of(*four[rank]), pg);
    load_model_checkpoint(dir.path(), *four[rank], nullptr);
    const nn::MoE& moe = *moe_of(*four[rank]);
    const std::vector<Tensor> mine = {moe.w1, moe.w3, moe.w2};
    for (size_t i = 0; i < mine.size(); ++i) {
      require_close("4 ranks, rank " + std::to_string(rank), mine[i], saved[i].narrow(0, rank, 1),
                    0);
    }
  });
}

// A rank that never runs its layer: the others' exchange fails within the group's timeout,
// naming the receive, the rank and the one that did not call, instead of waiting forever.
TEST(ExpertParallelErrors, ARankMissingFromTheExchangeFailsTheOthersWithinTheTimeout) {
  const nn::MoEOptions options{.dim = 4, .hidden = 4, .experts = 3, .top_k = 3};
  std::vector<std::shared_ptr<nn::MoE>> layers;
  for (int r = 0; r < 3; ++r) layers.push_back(std::make_shared<nn::MoE>(options));
  test::ThreadsSetup setup;
  setup.n = 3;
  setup.timeout = std::chrono::milliseconds(500);
  std::vector<std::string> errors(3);
  test::run_threads(setup, [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    parallelize_experts(layers[rank], pg);
    if (rank == 2) return;
    try {
      (void)layers[rank]->forward(randn({4, 4}));  // top 3 of 3: every rank gets rows
    } catch (const std::exception& e) {
      errors[rank] = e.what();
    }
  });
  for (int r : {0, 1}) {
    EXPECT_NE(errors[r].find("timed out after 500 ms"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("rank(s) 2 did not call"), std::string::npos) << errors[r];
  }
}

TEST(ExpertParallelErrors, RefusedWithClearMessages) {
  auto expect_error = [](const std::function<void()>& f, const std::string& text) {
    try {
      f();
      ADD_FAILURE() << "expected an error with: " << text;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  test::ThreadsSetup setup;
  setup.n = 2;
  test::run_threads(setup, [&](std::shared_ptr<ProcessGroup> pg, int) {
    expect_error(
        [&] {
          parallelize_experts(std::make_shared<nn::MoE>(
                                  nn::MoEOptions{.dim = 4, .hidden = 4, .experts = 3, .top_k = 1}),
                              pg);
        },
        "[parallelize_experts] the group's 2 ranks do not divide the 3 experts");
    auto moe = std::make_shared<nn::MoE>(nn::MoEOptions{.dim = 4, .hidden = 4, .experts = 4});
    parallelize_experts(moe, pg);
    expect_error([&] { parallelize_experts(moe, pg); },
                 "[parallelize_experts] the layer already holds only experts");
    // A bad option leaves the layer as it was.
    auto whole = std::make_shared<nn::MoE>(nn::MoEOptions{.dim = 4, .hidden = 4, .experts = 4});
    expect_error([&] { parallelize_experts(whole, pg, {.gradient_divide_factor = 0.0}); },
                 "[parallelize_experts] expected gradient_divide_factor > 0, got 0");
    require(whole->local_experts() == 4, "the layer still holds every expert");
    require(expert_parameter_names(*whole).empty(), "a replicated layer's experts are not named");
    expect_error(
        [&] {
          functional::all_to_all_single(randn({3, 2}), {1, 2}, {2, 2}, pg);
        },
        "[all_to_all_single] input_split_sizes add up to 4 rows, but the input has 3");
    expect_error(
        [&] {
          functional::all_to_all_single(randn({3, 2}), {}, {}, pg);
        },
        "[all_to_all_single] without input_split_sizes dim 0 of size 3 must divide "
        "into the group's 2 ranks");
    expect_error(
        [&] {
          functional::all_to_all_single(randn({3, 2}), {1}, {1, 2}, pg);
        },
        "[all_to_all_single] expected 2 output_split_sizes (one per rank of the group), "
        "got 1");
    expect_error(
        [&] { DistributedDataParallel(moe, pg, {.ignored_parameters = {"w4"}}); },
        "[DistributedDataParallel] ignored_parameters names 'w4', which is not a parameter");
  });
}

}  // namespace
}  // namespace ember::dist
