// SyncBatchNorm over gloo with 2 and 4 real processes on 127.0.0.1. Every rank holds a slice of
// one fixed batch (drawn from the same seed on every rank) and checks its results against a
// plain BatchNorm run in the same process on the whole batch, so expected values need no
// literals (BatchNorm itself is checked against PyTorch in tests/nn).
#include <ember/distributed/ddp/sync_batch_norm.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <numeric>

#include <ember/distributed/backends/process_group_gloo.h>
#include <ember/distributed/ddp/ddp.h>
#include <ember/distributed/store/hash_store.h>
#include <ember/distributed/store/prefix_store.h>
#include <ember/distributed/store/tcp_store.h>
#include <ember/nn/layers/activation.h>
#include <ember/nn/layers/container.h>
#include <ember/nn/layers/conv.h>
#include <ember/nn/layers/flatten.h>
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

void run_group(int n, const std::function<void(std::shared_ptr<ProcessGroup>, int)>& body) {
  test::run_gloo_ranks(n, [&](std::shared_ptr<ProcessGroupGloo> pg, int rank) { body(pg, rank); });
}


// The single-process reference: BatchNorm with any input rank >= 2 (BatchNorm1d/2d only take
// 2-3 and 4 dims; the arithmetic is the same).
class AnyBatchNorm : public nn::BatchNorm {
 public:
  using nn::BatchNorm::BatchNorm;
  std::string name() const override { return "AnyBatchNorm"; }

 protected:
  void check_input_dim(const Tensor&) const override {}
};

double tol_of(Dtype dt) { return dt == kFloat64 ? 1e-12 : 1e-5; }

// One layer on `sizes[rank]` rows of a batch of sum(sizes) rows shaped [*, feature...]
// (feature[0] = channels), over `steps` training steps, against AnyBatchNorm on the whole
// batch: outputs, input gradients, weight/bias gradients summed over ranks, running
// statistics; then eval mode, which must not communicate.
void check_against_full_batch(const std::shared_ptr<ProcessGroup>& pg, int rank,
                              const std::vector<int64_t>& sizes, const Shape& feature, Dtype dt,
                              const nn::BatchNormOptions& opts, int steps = 2) {
  const int64_t c = feature[0];
  const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  const int64_t offset = std::accumulate(sizes.begin(), sizes.begin() + rank, int64_t{0});
  const double tol = tol_of(dt);
  const std::string tag =
      ember::detail::str_cat("rank ", rank, " feature ", feature, " ", dtype_name(dt), ": ");
  SyncBatchNorm sync(c, opts, pg);
  AnyBatchNorm ref(c, opts);
  if (opts.affine) {
    manual_seed(11);
    NoGradGuard no_grad;
    const Tensor w = randn({c}), b = randn({c});
    sync.weight.copy_(w);
    sync.bias.copy_(b);
    ref.weight.copy_(w);
    ref.bias.copy_(b);
  }
  sync.to(dt);
  ref.to(dt);
  Shape full = feature;
  full.insert(0, total);
  for (int step = 0; step < steps; ++step) {
    manual_seed(100 + step);
    // An offset mean (3) and scale (2) per element, so var = E[x^2] - mean^2 would lose digits.
    const Tensor x_full = (randn(full) * 2 + 3).to(dt);
    const Tensor g_full = randn(full).to(dt);
    Tensor x = x_full.narrow(0, offset, sizes[rank]).clone().requires_grad_();
    Tensor xr = x_full.clone().requires_grad_();
    sync.zero_grad();
    ref.zero_grad();
    const Tensor y = sync(x);
    const Tensor yr = ref(xr);
    (y * g_full.narrow(0, offset, sizes[rank])).sum().backward();
    (yr * g_full).sum().backward();
    const std::string at = tag + "step " + std::to_string(step) + " ";
    require_close(at + "output", y, yr.narrow(0, offset, sizes[rank]), tol);
    require_close(at + "input grad", x.grad(), xr.grad().narrow(0, offset, sizes[rank]), tol);
    if (opts.affine) {
      // Local sums (torch's convention; DDP averages them): their sum is the full gradient.
      for (const char* name : {"weight", "bias"}) {
        Tensor g = sync.tensor(name).grad().clone();
        pg->allreduce(g)->wait();
        require_close(at + name + " grad summed over ranks", g, ref.tensor(name).grad(), tol);
      }
    }
    if (opts.track_running_stats) {
      require_close(at + "running_mean", sync.running_mean, ref.running_mean, tol);
      require_close(at + "running_var", sync.running_var, ref.running_var, tol);
      require(sync.num_batches_tracked.item<int64_t>() == step + 1, at + "num_batches_tracked");
    }
  }
  // Eval mode: BatchNorm's result (running statistics, or the local batch's when not
  // tracking), forward and backward without a single collective.
  sync.eval();
  ref.eval();
  manual_seed(7);
  const Tensor x_full = randn(full).to(dt);
  if (sizes[rank] < 2 && !opts.track_running_stats) return;  // no local batch statistics
  Tensor x = x_full.narrow(0, offset, sizes[rank]).clone().requires_grad_();
  Tensor xr = x.detach().clone().requires_grad_();
  const uint64_t seq = pg->sequence_number();
  const Tensor y = sync(x);
  y.sum().backward();
  const Tensor yr = ref(xr);
  yr.sum().backward();
  require(pg->sequence_number() == seq, tag + "eval mode issued a collective");
  require_close(tag + "eval output", y, yr, tol);
  require_close(tag + "eval input grad", x.grad(), xr.grad(), tol);
}

using WorldDtype = std::tuple<int, Dtype>;
class SyncBNWorld : public ::testing::TestWithParam<WorldDtype> {};

// Equal slices of inputs with 0 to 3 trailing dims.
TEST_P(SyncBNWorld, MatchesBatchNormOnWholeBatch) {
  EMBER_REQUIRE_GLOO();
  const auto [n, dt] = GetParam();
  run_group(n, [n, dt](std::shared_ptr<ProcessGroup> pg, int rank) {
    const std::vector<int64_t> sizes(n, 3);
    for (const Shape& feature : {Shape{4}, Shape{3, 5}, Shape{2, 3, 4}, Shape{3, 2, 2, 3}}) {
      check_against_full_batch(pg, rank, sizes, feature, dt, {});
    }
  });
}

// Different local batch sizes (one rank empty with 4 ranks), with the cumulative average
// (momentum None), without affine parameters or running statistics.
TEST_P(SyncBNWorld, UnevenLocalBatches) {
  EMBER_REQUIRE_GLOO();
  const auto [n, dt] = GetParam();
  run_group(n, [n, dt](std::shared_ptr<ProcessGroup> pg, int rank) {
    const std::vector<int64_t> sizes =
        n == 2 ? std::vector<int64_t>{1, 6} : std::vector<int64_t>{3, 0, 1, 5};
    nn::BatchNormOptions cumulative;
    cumulative.momentum = std::nullopt;
    nn::BatchNormOptions bare;
    bare.affine = false;
    bare.track_running_stats = false;
    for (const auto& opts : {nn::BatchNormOptions{}, cumulative, bare}) {
      check_against_full_batch(pg, rank, sizes, Shape{3, 4}, dt, opts, 3);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, SyncBNWorld,
                         ::testing::Combine(::testing::Values(2, 4),
                                            ::testing::Values(kFloat32, kFloat64)),
                         [](const auto& info) {
                           return "N" + std::to_string(std::get<0>(info.param)) + "_" +
                                  std::string(dtype_name(std::get<1>(info.param)));
                         });

// Errors that every rank raises alike: one value per channel over all ranks (after the
// allgather, so no rank is left waiting), and double backward.
TEST(SyncBatchNorm, CollectiveErrorsAreRaisedOnEveryRank) {
  EMBER_REQUIRE_GLOO();
  run_group(2, [](std::shared_ptr<ProcessGroup> pg, int rank) {
    SyncBatchNorm bn(3, {}, pg);
    Tensor one = rank == 0 ? randn({1, 3}) : randn({0, 3});
    try {
      bn(one);
      require(false, "one value per channel over 2 ranks did not throw");
    } catch (const ValueError& e) {
      const std::string m = e.what();
      require(m.find("more than 1 value per channel") != std::string::npos &&
                  m.find("got 1 over the 2 ranks") != std::string::npos,
              "message: " + m);
    }
    Tensor x = randn({2, 3}).requires_grad_();
    const Tensor y = bn(x);
    try {
      autograd::grad({y.sum()}, {x}, {}, {}, /*create_graph=*/true);
      require(false, "double backward did not throw");
    } catch (const NotImplementedError& e) {
      require(std::string(e.what()).find("double backward") != std::string::npos, e.what());
    }
    // The group still works: a normal step goes through.
    Tensor x2 = randn({2, 3}).requires_grad_();
    bn(x2).sum().backward();
    require(x2.grad().defined(), "no grad after the errors");
  });
}

// ---- convert_sync_batchnorm + DDP ------------------------------------------------------------

constexpr int64_t kBatch = 8;  // divisible by 2 and 4 ranks

std::shared_ptr<nn::Sequential> make_cnn(uint64_t seed) {
  manual_seed(seed);
  return std::make_shared<nn::Sequential>(
      std::make_shared<nn::Conv2d>(3, 4, 3, nn::Conv2dOptions{.padding = 1}),
      std::make_shared<nn::BatchNorm2d>(4), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(4 * 4 * 4, 6),
      std::make_shared<nn::BatchNorm1d>(6), std::make_shared<nn::Linear>(6, 3));
}

class SyncBNDDP : public ::testing::TestWithParam<int> {};

// DDP + SyncBatchNorm, 3 SGD steps on slices = one process with BatchNorm on the whole batch:
// parameters and running statistics. (With plain BatchNorm in the DDP model the statistics are
// per slice and this fails.)
TEST_P(SyncBNDDP, TrainsLikeOneProcessOnWholeBatch) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_group(n, [n](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto model = convert_sync_batchnorm(make_cnn(5), pg);
    require(std::dynamic_pointer_cast<SyncBatchNorm>(
                std::dynamic_pointer_cast<nn::Sequential>(model)->at<nn::Module>(1)) != nullptr,
            "not converted");
    auto ref = make_cnn(5);
    auto ddp = std::make_shared<DistributedDataParallel>(model, pg);
    nn::optim::SGD opt(ddp->parameters(), {.lr = 0.1, .momentum = 0.9});
    nn::optim::SGD ref_opt(ref->parameters(), {.lr = 0.1, .momentum = 0.9});
    const int64_t per = kBatch / n;
    for (int step = 0; step < 3; ++step) {
      manual_seed(40 + step);
      const Tensor x = randn({kBatch, 3, 4, 4});
      const Tensor y = randn({kBatch, 3});
      opt.zero_grad();
      ref_opt.zero_grad();
      nn::functional::mse_loss(ddp->forward(x.narrow(0, rank * per, per)),
                               y.narrow(0, rank * per, per))
          .backward();
      nn::functional::mse_loss(ref->forward(x), y).backward();
      opt.step();
      ref_opt.step();
    }
    const auto got = model->state_dict();
    const auto want = ref->state_dict();
    require(got.size() == want.size(), "state_dict size");
    for (size_t i = 0; i < got.size(); ++i) {
      require(got[i].first == want[i].first, "key " + got[i].first + " vs " + want[i].first);
      require_close("rank " + std::to_string(rank) + " trained " + got[i].first, got[i].second,
                    want[i].second, 1e-4);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, SyncBNDDP, ::testing::Values(2, 4),
                         [](const auto& info) { return "N" + std::to_string(info.param); });

// The converted tree holds the very same tensors under the same names, keeps the other modules,
// options and training modes.
TEST(ConvertSyncBatchnorm, SequentialKeepsTensorsNamesAndModes) {
  nn::BatchNormOptions o;
  o.eps = 1e-3;
  o.momentum = 0.3;
  auto conv = std::make_shared<nn::Conv2d>(3, 4, 3);
  auto bn = std::make_shared<nn::BatchNorm2d>(4, o);
  auto relu = std::make_shared<nn::ReLU>();
  auto inner = std::make_shared<nn::Sequential>(std::make_shared<nn::Linear>(2, 5),
                                                std::make_shared<nn::BatchNorm1d>(5));
  auto plain = std::make_shared<nn::Sequential>(std::make_shared<nn::Linear>(2, 2));
  auto model = std::make_shared<nn::Sequential>(conv, bn, relu, inner, plain);
  bn->eval();
  const auto before = model->state_dict();

  auto out = convert_sync_batchnorm(model);
  auto seq = std::dynamic_pointer_cast<nn::Sequential>(out);
  ASSERT_NE(seq, nullptr);
  EXPECT_EQ((*seq)[0], conv);
  EXPECT_EQ((*seq)[2], relu);
  EXPECT_EQ((*seq)[4], plain) << "a subtree without BatchNorm is kept as is";
  auto sync = seq->at<SyncBatchNorm>(1);
  EXPECT_EQ(sync->num_features, 4);
  EXPECT_EQ(sync->options.eps, 1e-3);
  EXPECT_EQ(sync->options.momentum, 0.3);
  EXPECT_EQ(sync->process_group(), nullptr);
  EXPECT_FALSE(sync->is_training());
  EXPECT_TRUE(seq->is_training());
  EXPECT_TRUE(seq->at<nn::Sequential>(3)->at<SyncBatchNorm>(1)->is_training());
  EXPECT_TRUE(sync->weight.is_same(bn->weight));
  EXPECT_TRUE(sync->running_var.is_same(bn->running_var));

  // state_dict() holds detached handles: same names, same memory.
  const auto after = out->state_dict();
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < after.size(); ++i) {
    EXPECT_EQ(after[i].first, before[i].first);
    EXPECT_EQ(after[i].second.data_ptr(), before[i].second.data_ptr()) << after[i].first;
  }
  // Parameters and buffers: the very same tensor handles.
  for (const bool params : {true, false}) {
    const auto got = params ? out->named_parameters() : out->named_buffers();
    const auto want = params ? model->named_parameters() : model->named_buffers();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].first, want[i].first);
      EXPECT_TRUE(got[i].second.is_same(want[i].second)) << got[i].first;
    }
  }
}

TEST(ConvertSyncBatchnorm, RootAndUntrackedBatchNorm) {
  nn::BatchNormOptions bare;
  bare.affine = false;
  bare.track_running_stats = false;
  auto bn = std::make_shared<nn::BatchNorm1d>(3, bare);
  auto out = std::dynamic_pointer_cast<SyncBatchNorm>(convert_sync_batchnorm(bn));
  ASSERT_NE(out, nullptr);
  EXPECT_TRUE(out->state_dict().empty());
  EXPECT_FALSE(out->weight.defined());

  auto linear = std::make_shared<nn::Linear>(2, 2);
  EXPECT_EQ(convert_sync_batchnorm(linear), linear);
}

TEST(ConvertSyncBatchnorm, BatchNormInsideOtherModuleNamesPath) {
  struct Block : nn::Module {
    Block() { bn = register_module("bn", std::make_shared<nn::BatchNorm1d>(3)); }
    std::string name() const override { return "Block"; }
    std::shared_ptr<nn::BatchNorm1d> bn;
  };
  auto model = std::make_shared<nn::Sequential>(std::make_shared<nn::Linear>(2, 3),
                                                std::make_shared<Block>());
  try {
    convert_sync_batchnorm(model);
    FAIL() << "no error";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("inside '1' (a Block)"), std::string::npos) << e.what();
  }
}

// ---- single process ---------------------------------------------------------------------------

TEST(SyncBatchNorm, WrongChannelCountNamesLayerAndBothNumbers) {
  SyncBatchNorm bn(4);
  try {
    bn(randn({2, 3, 5}));
    FAIL() << "no error";
  } catch (const ValueError& e) {
    EXPECT_STREQ(e.what(),
                 "[SyncBatchNorm] expected input with 4 channels (dim 1), got 3 channels in "
                 "input of shape [2, 3, 5]");
  }
  EXPECT_THROW(bn(randn({4})), ValueError);
}

TEST(SyncBatchNorm, TrainingWithoutAnyGroupThrows) {
  SyncBatchNorm bn(2);
  try {
    bn(randn({3, 2}));
    FAIL() << "no error";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("default group is not initialized"), std::string::npos)
        << e.what();
  }
  bn.eval();  // running statistics: no group needed
  EXPECT_EQ(bn(randn({3, 2})).shape(), Shape({3, 2}));
}

// World size 1 is BatchNorm, without collectives.
TEST(SyncBatchNorm, WorldSizeOneIsBatchNorm) {
  EMBER_REQUIRE_GLOO();
  auto pg = std::make_shared<ProcessGroupGloo>(std::make_shared<HashStore>(), 0, 1);
  SyncBatchNorm sync(3, {}, pg);
  nn::BatchNorm1d ref(3);
  manual_seed(3);
  const Tensor x = randn({5, 3, 2});
  Tensor a = x.clone().requires_grad_(), b = x.clone().requires_grad_();
  sync(a).pow(2).sum().backward();
  ref(b).pow(2).sum().backward();
  EXPECT_EQ(pg->sequence_number(), 0u);
  require_close("input grad", a.grad(), b.grad(), 0);
  require_close("running_var", sync.running_var, ref.running_var, 0);
}

}  // namespace
}  // namespace ember::dist
