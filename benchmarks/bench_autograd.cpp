// Autograd overhead: forward + backward of a chain of 100 small ops, and one training step of
// a 3-layer MLP (forward, backward, SGD update). Same cases in ref_libtorch.cpp and
// run_tensor_bench.py (PyTorch from Python); chain time / 100 is the per-op cost of recording
// plus running the backward rule.
#include <cmath>
#include <cstdio>

#include <ember/autograd/autograd.h>
#include "bench_util.h"

using namespace ember;

namespace {

constexpr int kChain = 100;

Tensor chain(const Tensor& x, const Tensor& w) {
  Tensor h = x;
  for (int i = 0; i < kChain; ++i) {
    switch (i % 4) {
      case 0: h = h * w; break;
      case 1: h = h + w; break;
      case 2: h = h.tanh(); break;
      default: h = h * 0.5; break;
    }
  }
  return h.sum();
}

struct Mlp {
  Tensor w1 = randn({784, 256}) * 0.05, b1 = zeros({256});
  Tensor w2 = randn({256, 128}) * 0.05, b2 = zeros({128});
  Tensor w3 = randn({128, 10}) * 0.05, b3 = zeros({10});
  std::vector<Tensor> params() const { return {w1, b1, w2, b2, w3, b3}; }

  Tensor loss(const Tensor& x, const Tensor& y) const {
    Tensor h1 = relu(addmm(b1, x, w1));
    Tensor h2 = relu(addmm(b2, h1, w2));
    Tensor logits = addmm(b3, h2, w3);
    return -gather(log_softmax(logits, 1), 1, y.unsqueeze(1)).mean();
  }

  void step(const Tensor& x, const Tensor& y, double lr) {
    loss(x, y).backward();
    NoGradGuard no_grad;
    for (Tensor p : params()) {
      p.add_(p.grad(), -lr);
      p.set_grad({});
    }
  }
};

}  // namespace

int main(int argc, char** argv) {
  bench::Options o = bench::parse(argc, argv);
  manual_seed(0);
  if (bench::selected(o, "autograd_chain100_fwdbwd")) {
    Tensor x = randn({16}), w = randn({16});
    x.requires_grad_();
    w.requires_grad_();
    chain(x, w).backward();
    const float g0 = w.grad().to_vector<float>()[0];
    std::printf("# chain check: dloss/dw[0] = %g\n", g0);
    if (!std::isfinite(g0)) {
      std::fprintf(stderr, "chain gradient is not finite\n");
      return 1;
    }
    bench::run(o, "autograd_chain100_fwdbwd", [&] {
      chain(x, w).backward();
      x.set_grad({});
      w.set_grad({});
    });
  }
  if (bench::selected(o, "autograd_mlp_b64_fwdbwd")) {
    Mlp m;
    for (Tensor p : m.params()) p.requires_grad_();
    Tensor x = randn({64, 784}), y = randint(0, 10, {64});
    const float before = m.loss(x, y).item<float>();
    for (int i = 0; i < 20; ++i) m.step(x, y, 0.1);
    const float after = m.loss(x, y).item<float>();
    std::printf("# mlp check: loss %.4f -> %.4f after 20 steps\n", before, after);
    if (!(after < before)) {
      std::fprintf(stderr, "mlp loss did not decrease\n");
      return 1;
    }
    const double flops = 3 * 2.0 * 64 * (784 * 256 + 256 * 128 + 128 * 10);
    bench::run(o, "autograd_mlp_b64_fwdbwd", [&] { m.step(x, y, 1e-4); }, flops);
  }
  return 0;
}
