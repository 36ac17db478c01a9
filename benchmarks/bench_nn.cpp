// nn building blocks, forward + backward (or one update), beside the same cases in
// ref_libtorch.cpp and run_tensor_bench.py: cross_entropy, batch_norm (training), layer_norm,
// GELU's tanh form (a GPT MLP's hidden activations), a small CNN training step, and an Adam step
// over 1M parameters.
#include <cstdio>

#include "bench_util.h"
#include <ember/nn/nn.h>

using namespace ember;
namespace F = ember::nn::functional;

namespace {

/// Runs fwd(inputs).sum().backward() and clears the leaves' grads.
void fwd_bwd(const std::function<Tensor()>& f, const std::vector<Tensor>& leaves) {
  f().backward();
  for (const Tensor& t : leaves) t.set_grad({});
}

}  // namespace

int main(int argc, char** argv) {
  bench::Options o = bench::parse(argc, argv);
  manual_seed(0);
  if (bench::selected(o, "cross_entropy_b256_c1000_fwdbwd")) {
    Tensor x = randn({256, 1000}).requires_grad_();
    Tensor y = randint(0, 1000, {256});
    bench::run(o, "cross_entropy_b256_c1000_fwdbwd",
               [&] { fwd_bwd([&] { return F::cross_entropy(x, y); }, {x}); });
  }
  // The byte-level GPT's loss: [batch x context, vocabulary 256].
  if (bench::selected(o, "cross_entropy_b16384_c256_fwdbwd")) {
    Tensor x = randn({16384, 256}).requires_grad_();
    Tensor y = randint(0, 256, {16384});
    bench::run(o, "cross_entropy_b16384_c256_fwdbwd",
               [&] { fwd_bwd([&] { return F::cross_entropy(x, y); }, {x}); });
  }
  if (bench::selected(o, "batch_norm2d_b32_c64_28_fwdbwd")) {
    Tensor x = randn({32, 64, 28, 28}).requires_grad_();
    Tensor w = ones({64}).requires_grad_(), b = zeros({64}).requires_grad_();
    Tensor rm = zeros({64}), rv = ones({64});
    bench::run(o, "batch_norm2d_b32_c64_28_fwdbwd", [&] {
      fwd_bwd([&] { return F::batch_norm(x, rm, rv, w, b, /*training=*/true).sum(); }, {x, w, b});
    });
  }
  if (bench::selected(o, "layer_norm_b64x128_d512_fwdbwd")) {
    Tensor x = randn({64, 128, 512}).requires_grad_();
    Tensor w = ones({512}).requires_grad_(), b = zeros({512}).requires_grad_();
    bench::run(o, "layer_norm_b64x128_d512_fwdbwd", [&] {
      fwd_bwd([&] { return F::layer_norm(x, {512}, w, b).sum(); }, {x, w, b});
    });
  }
  if (bench::selected(o, "gelu_tanh_b32x128_d2048_fwdbwd")) {
    Tensor x = randn({32, 128, 2048}).requires_grad_();
    bench::run(o, "gelu_tanh_b32x128_d2048_fwdbwd",
               [&] { fwd_bwd([&] { return gelu(x, "tanh").sum(); }, {x}); });
  }
  if (bench::selected(o, "cnn_step_b64_28_fwdbwd")) {
    auto model = std::make_shared<nn::Sequential>(
        std::make_shared<nn::Conv2d>(1, 16, 3, nn::Conv2dOptions{.padding = 1}),
        std::make_shared<nn::BatchNorm2d>(16), std::make_shared<nn::ReLU>(),
        std::make_shared<nn::MaxPool2d>(2), std::make_shared<nn::Flatten>(),
        std::make_shared<nn::Linear>(16 * 14 * 14, 10));
    nn::optim::SGD opt(model->parameters(), {.lr = 0.01, .momentum = 0.9});
    Tensor x = randn({64, 1, 28, 28}), y = randint(0, 10, {64});
    bench::run(o, "cnn_step_b64_28_fwdbwd", [&] {
      opt.zero_grad();
      F::cross_entropy(model->forward(x), y).backward();
      opt.step();
    });
  }
  if (bench::selected(o, "adam_step_1M")) {
    std::vector<Tensor> ps;
    for (int i = 0; i < 16; ++i) {
      Tensor p = randn({256, 256}).requires_grad_();
      p.set_grad(randn({256, 256}));
      ps.push_back(p);
    }
    nn::optim::Adam opt(ps, {.lr = 1e-3});
    bench::run(o, "adam_step_1M", [&] { opt.step(); }, 0, 16.0 * 65536 * 4 * 7);
  }
  return 0;
}
