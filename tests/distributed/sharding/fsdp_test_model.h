// The model, batches and optimizer options the FSDP tests (threads, gloo, MPI) share: a residual
// MLP (input layer, blocks of LayerNorm -> Linear -> tanh -> Linear, output layer) whose blocks
// are the sharded modules.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ember/nn/activation_checkpoint.h>
#include <ember/nn/functional.h>
#include <ember/nn/layers/linear.h>
#include <ember/nn/layers/norm.h>
#include <ember/nn/optim/adam.h>
#include <ember/tensor/ops.h>
#include <ember/tensor/ops/random.h>
#include "tests/distributed/ddp/ddp_test_util.h"

namespace ember::test {

constexpr int64_t kFsdpIn = 5, kWidth = 12, kFsdpOut = 3, kFsdpBatch = 24;

class FsdpBlock : public nn::Module {
 public:
  FsdpBlock() {
    ln = register_module("ln", std::make_shared<nn::LayerNorm>(kWidth));
    fc1 = register_module("fc1", std::make_shared<nn::Linear>(kWidth, 2 * kWidth));
    fc2 = register_module("fc2", std::make_shared<nn::Linear>(2 * kWidth, kWidth));
  }
  std::string name() const override { return "FsdpBlock"; }
  Tensor forward(const Tensor& x) override { return x + (*fc2)(tanh((*fc1)((*ln)(x)))); }
  std::shared_ptr<nn::LayerNorm> ln;
  std::shared_ptr<nn::Linear> fc1, fc2;
};

class FsdpNet : public nn::Module {
 public:
  explicit FsdpNet(int n_blocks) {
    inp = register_module("inp", std::make_shared<nn::Linear>(kFsdpIn, kWidth));
    for (int i = 0; i < n_blocks; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), std::make_shared<FsdpBlock>()));
    }
    head = register_module("head", std::make_shared<nn::Linear>(kWidth, kFsdpOut));
  }
  std::string name() const override { return "FsdpNet"; }
  Tensor forward(const Tensor& x) override {
    Tensor h = (*inp)(x);
    for (const auto& b : blocks) h = checkpoint ? nn::checkpoint(b, h) : (*b)(h);
    return (*head)(h);
  }
  std::shared_ptr<nn::Linear> inp, head;
  std::vector<std::shared_ptr<FsdpBlock>> blocks;
  bool checkpoint = false;
};

inline std::shared_ptr<FsdpNet> make_fsdp_net(int n_blocks = 3) {
  manual_seed(17);
  return std::make_shared<FsdpNet>(n_blocks);
}

inline std::vector<Batch> fsdp_batches(int n, uint64_t seed) {
  manual_seed(seed);
  std::vector<Batch> out;
  for (int i = 0; i < n; ++i) {
    out.push_back({randn({kFsdpBatch, kFsdpIn}), randn({kFsdpBatch, kFsdpOut})});
  }
  return out;
}

inline nn::optim::AdamOptions fsdp_adam() { return {.lr = 1e-2, .weight_decay = 1e-3}; }

inline Tensor fsdp_loss(nn::Module& m, const Batch& b) {
  return nn::functional::mse_loss(m(b.x), b.y);
}

inline std::vector<Tensor> trainable(const nn::Module& m) {
  std::vector<Tensor> out;
  for (const Tensor& p : m.parameters()) {
    if (p.requires_grad()) out.push_back(p);
  }
  return out;
}

/// Throws unless f() throws an error whose message contains `needle`.
inline void require_throws_with(const std::string& what, const std::function<void()>& f,
                                const std::string& needle) {
  const std::string msg = message_of(f);
  require(!msg.empty(), what + ": expected an error containing '" + needle + "', got none");
  require(msg.find(needle) != std::string::npos,
          what + ": expected an error containing '" + needle + "', got: " + msg);
}

}  // namespace ember::test
