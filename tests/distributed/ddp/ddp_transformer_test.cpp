// DistributedDataParallel with the transformer pieces of issue 18, over gloo with 2 forked
// ranks: a tied weight (an LM head sharing the embedding's) is reduced once and its averaged
// gradient sums both uses; activation checkpointing inside the wrapped module gives the same
// averaged gradients as the plain model. Every expected value is computed in the same rank
// without DDP, so no literals.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include <ember/distributed/ddp/ddp.h>
#include <ember/nn/activation_checkpoint.h>
#include <ember/nn/layers/embedding.h>
#include <ember/nn/functional.h>
#include <ember/nn/layers/linear.h>
#include <ember/nn/optim/sgd.h>
#include <ember/nn/layers/transformer.h>
#include <ember/tensor/ops/random.h>
#include "tests/distributed/ddp/ddp_test_util.h"
#include "tests/distributed/require_gloo.h"

namespace ember::dist {
namespace {

using test::require;
using test::require_close;
using test::require_same_on_all_ranks;

constexpr int kRanks = 2;

/// Embedding -> Linear -> tanh -> LM head tied to the embedding (GPT-2's tying).
class TiedLm : public nn::Module {
 public:
  explicit TiedLm(uint64_t seed) {
    manual_seed(seed);
    emb = register_module("emb", std::make_shared<nn::Embedding>(11, 6));
    mid = register_module("mid", std::make_shared<nn::Linear>(6, 6));
    lm_head = register_module("lm_head", std::make_shared<nn::Linear>(6, 11, false));
    lm_head->set_parameter("weight", emb->weight);
  }
  Tensor forward(const Tensor& tokens) override {
    return lm_head->forward(tanh(mid->forward(emb->forward(tokens))));
  }
  std::shared_ptr<nn::Embedding> emb;
  std::shared_ptr<nn::Linear> mid, lm_head;
};

/// Tokens and next-token targets for rank `rank` (each rank its own rows).
struct Tokens {
  Tensor x, y;
};
Tokens tokens_of(int rank) {
  manual_seed(50 + rank);
  return {randint(0, 11, {3, 5}), randint(0, 11, {15})};
}

Tensor lm_loss(nn::Module& m, const Tokens& t) {
  return nn::functional::cross_entropy(m.forward(t.x).reshape({-1, 11}), t.y);
}

/// The average over the ranks of `t` (each rank passes its own).
Tensor average(ProcessGroup& pg, const Tensor& t) {
  Tensor s = t.detach().clone();
  pg.allreduce(s)->wait();
  return s / static_cast<double>(pg.size());
}

std::vector<Tensor> grads_of(const nn::Module& m) {
  std::vector<Tensor> g;
  for (const Tensor& p : m.parameters()) g.push_back(p.grad().detach().clone());
  return g;
}

void tied_weight_case(bool shm) {
  test::run_gloo_ranks(
      kRanks,
      [](std::shared_ptr<ProcessGroupGloo> pg, int rank) {
        auto model = std::make_shared<TiedLm>(7);
        TiedLm local(7);  // the same weights, trained without DDP
        // A tiny bucket cap: each parameter its own bucket, so a second reduction of the tied
        // weight would be a separate, visible one.
        DistributedDataParallel ddp(model, pg, {.bucket_cap_mb = 1e-6, .first_bucket_cap_mb = 1e-6});
        require(ddp.stats().parameters == 3, "DDP synchronises 3 parameters (tied once), got " +
                                                 std::to_string(ddp.stats().parameters));
        nn::optim::SGD opt(ddp.parameters(), {.lr = 0.5});
        nn::optim::SGD local_opt(local.parameters(), {.lr = 0.5});
        const Tokens t = tokens_of(rank);
        for (int step = 0; step < 3; ++step) {
          opt.zero_grad();
          local_opt.zero_grad();
          lm_loss(ddp, t).backward();
          lm_loss(local, t).backward();
          const std::vector<Tensor> got = grads_of(*model), mine = grads_of(local);
          require(got.size() == 3, "3 gradients");
          for (size_t i = 0; i < got.size(); ++i) {
            // the average of the ranks' local gradients, each the sum of both uses
            local.parameters()[i].grad().copy_(average(*pg, mine[i]));
            require_close("step " + std::to_string(step) + " grad " + std::to_string(i),
                          got[i], local.parameters()[i].grad(), 1e-5);
          }
          opt.step();
          local_opt.step();
          require(model->lm_head->weight.is_same(model->emb->weight), "still tied");
        }
        require_same_on_all_ranks(*pg, *model);
        for (size_t i = 0; i < 3; ++i) {
          require_close("weights after 3 steps " + std::to_string(i), model->parameters()[i],
                        local.parameters()[i], 1e-5);
        }
      },
      shm);
}

TEST(DDPTransformer, TiedWeightIsReducedOnceSharedMemory) {
  EMBER_REQUIRE_GLOO();
  tied_weight_case(true);
}

TEST(DDPTransformer, TiedWeightIsReducedOnceTcp) {
  EMBER_REQUIRE_GLOO();
  tied_weight_case(false);
}

/// Two transformer encoder layers with dropout; forward checkpoints each layer (or not).
class Blocks : public nn::Module {
 public:
  Blocks(uint64_t seed, bool ckpt) : ckpt_(ckpt) {
    manual_seed(seed);
    for (int i = 0; i < 2; ++i) {
      layers_.push_back(register_module(
          std::to_string(i), std::make_shared<nn::TransformerEncoderLayer>(
                                 8, 2, nn::TransformerEncoderLayerOptions{.dim_feedforward = 16,
                                                                          .dropout = 0.2,
                                                                          .batch_first = true})));
    }
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = x;
    for (const auto& l : layers_) h = ckpt_ ? nn::checkpoint(l, h) : l->forward(h);
    return square(h).mean();
  }

 private:
  bool ckpt_;
  std::vector<std::shared_ptr<nn::TransformerEncoderLayer>> layers_;
};

void checkpoint_case(bool shm) {
  test::run_gloo_ranks(
      kRanks,
      [](std::shared_ptr<ProcessGroupGloo> pg, int rank) {
        auto plain = std::make_shared<Blocks>(3, false), ckpt = std::make_shared<Blocks>(3, true);
        Blocks local(3, false);
        DistributedDataParallel ddp_plain(plain, pg), ddp_ckpt(ckpt, pg);
        nn::optim::SGD opt_plain(ddp_plain.parameters(), {.lr = 0.1});
        nn::optim::SGD opt_ckpt(ddp_ckpt.parameters(), {.lr = 0.1});
        manual_seed(60 + rank);
        const Tensor x = randn({2, 5, 8}, kFloat64).to(kFloat32);
        // two steps: the second runs with the buckets rebuilt in the checkpointed order
        for (int step = 0; step < 2; ++step) {
          const uint64_t seed = 100 + 10 * step + rank;  // dropout masks differ per rank
          opt_plain.zero_grad();
          opt_ckpt.zero_grad();
          local.zero_grad();
          manual_seed(seed);
          ddp_plain.forward(x).backward();
          manual_seed(seed);
          ddp_ckpt.forward(x).backward();
          manual_seed(seed);
          local.forward(x).backward();
          const auto gp = grads_of(*plain), gc = grads_of(*ckpt), gl = grads_of(local);
          require(gc.size() == gp.size() && gc.size() == gl.size(), "gradient counts");
          for (size_t i = 0; i < gc.size(); ++i) {
            const std::string what = "step " + std::to_string(step) + " grad " + std::to_string(i);
            require_close(what + " (checkpointed vs plain DDP)", gc[i], gp[i], 0.0);
            // averaged over the ranks: DDP's hooks fired for the checkpointed parameters
            require_close(what + " (vs the ranks' average)", gc[i], average(*pg, gl[i]), 1e-5);
          }
          opt_plain.step();
          opt_ckpt.step();
          NoGradGuard no_grad;
          for (size_t i = 0; i < gl.size(); ++i) local.parameters()[i].copy_(plain->parameters()[i]);
        }
        require(ddp_ckpt.buckets_rebuilt(), "buckets rebuilt after the first iteration");
        require_same_on_all_ranks(*pg, *ckpt);
      },
      shm);
}

TEST(DDPTransformer, CheckpointedLayersGiveThePlainAveragedGradsSharedMemory) {
  EMBER_REQUIRE_GLOO();
  checkpoint_case(true);
}

TEST(DDPTransformer, CheckpointedLayersGiveThePlainAveragedGradsTcp) {
  EMBER_REQUIRE_GLOO();
  checkpoint_case(false);
}

}  // namespace
}  // namespace ember::dist
