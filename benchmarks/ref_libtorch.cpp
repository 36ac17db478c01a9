// The same benchmark cases as Ember's bench_* programs, run through libtorch's C++ API
// (Debian's libtorch-dev, PyTorch 1.13): the fair reference for per-op overhead and kernels,
// since it pays no Python cost. Case names match Ember's; run_tensor_bench.py interleaves them.
// Threads: torch::set_num_threads(EMBER_NUM_THREADS or 1).
#include <torch/torch.h>

#include <cstdlib>

#include "bench_util.h"

namespace F = torch::nn::functional;

namespace {

constexpr int64_t M16 = 16 << 20;

// ---- kernels (bench_matmul.cpp, bench_conv.cpp, bench_elementwise.cpp, bench_reduce.cpp) ----

void matmul_and_conv(const bench::Options& o) {
  for (int64_t n : {512, 1024, 2048}) {
    const std::string name = "matmul_" + std::to_string(n) + "_f32";
    if (!bench::selected(o, name)) continue;
    auto a = torch::randn({n, n}), b = torch::randn({n, n});
    auto c = torch::empty({n, n});
    bench::run(o, name, [&] { at::mm_out(c, a, b); }, 2.0 * n * n * n);
  }
  {
    auto x = torch::randn({64, 32, 28, 28}), w = torch::randn({64, 32, 3, 3}) * 0.1,
         bias = torch::randn({64});
    if (bench::selected(o, "conv2d_fwd_b64_c32_64_k3_28")) {
      bench::run(o, "conv2d_fwd_b64_c32_64_k3_28", [&] {
        auto y = F::conv2d(x, w, F::Conv2dFuncOptions().bias(bias).padding(1));
        bench::do_not_optimize(y.data_ptr());
      }, 2.0 * 64 * 64 * 28 * 28 * 32 * 9);
    }
    if (bench::selected(o, "conv2d_fwdbwd_b64_c32_64_k3_28")) {
      torch::AutoGradMode grad(true);
      auto xg = x.clone().requires_grad_(true), wg = w.clone().requires_grad_(true),
           bg = bias.clone().requires_grad_(true);
      bench::run(o, "conv2d_fwdbwd_b64_c32_64_k3_28", [&] {
        auto y = F::conv2d(xg, wg, F::Conv2dFuncOptions().bias(bg).padding(1));
        y.backward(torch::ones_like(y));
        xg.mutable_grad() = torch::Tensor();
        wg.mutable_grad() = torch::Tensor();
        bg.mutable_grad() = torch::Tensor();
      }, 3 * 2.0 * 64 * 64 * 28 * 28 * 32 * 9);
    }
    if (bench::selected(o, "maxpool2d_idx_b64_c32_28")) {
      bench::run(o, "maxpool2d_idx_b64_c32_28", [&] {
        auto y = F::max_pool2d_with_indices(x, F::MaxPool2dFuncOptions(2));
        bench::do_not_optimize(std::get<0>(y).data_ptr());
      });
    }
    if (bench::selected(o, "maxpool2d_b64_c32_28")) {
      bench::run(o, "maxpool2d_b64_c32_28", [&] {
        auto y = F::max_pool2d(x, F::MaxPool2dFuncOptions(2));
        bench::do_not_optimize(y.data_ptr());
      }, 0, 4.0 * x.numel() * 1.25);
    }
  }
}

void elementwise(const bench::Options& o) {
  {
    auto a = torch::rand({M16}), b = torch::rand({M16}), c = torch::empty({M16});
    if (bench::selected(o, "add_16M_f32_out"))
      bench::run(o, "add_16M_f32_out", [&] { at::add_out(c, a, b); }, 0, 12.0 * M16);
    if (bench::selected(o, "add_16M_f32_fresh"))
      bench::run(o, "add_16M_f32_fresh", [&] {
        auto r = a + b;
        bench::do_not_optimize(r.data_ptr());
      }, 0, 12.0 * M16);
    if (bench::selected(o, "mul_scalar_16M_f32_out"))
      bench::run(o, "mul_scalar_16M_f32_out", [&] { at::mul_out(c, a, torch::scalar_tensor(2.5)); },
                 0, 8.0 * M16);
    if (bench::selected(o, "exp_16M_f32_fresh"))
      bench::run(o, "exp_16M_f32_fresh", [&] {
        auto r = a.exp();
        bench::do_not_optimize(r.data_ptr());
      }, 0, 8.0 * M16);
    if (bench::selected(o, "sum_16M_f32"))
      bench::run(o, "sum_16M_f32", [&] {
        auto s = a.sum();
        bench::do_not_optimize(s.data_ptr());
      }, 0, 4.0 * M16);
    if (bench::selected(o, "rand_16M_f32"))
      bench::run(o, "rand_16M_f32", [&] { c.uniform_(); }, 0, 4.0 * M16);
    if (bench::selected(o, "randn_16M_f32"))
      bench::run(o, "randn_16M_f32", [&] { c.normal_(); }, 0, 4.0 * M16);
    if (bench::selected(o, "cat_2x8M_f32")) {
      auto h1 = torch::rand({M16 / 2}), h2 = torch::rand({M16 / 2});
      bench::run(o, "cat_2x8M_f32", [&] {
        auto r = torch::cat({h1, h2});
        bench::do_not_optimize(r.data_ptr());
      }, 0, 8.0 * M16);
    }
  }
}

void reductions_and_indexing(const bench::Options& o) {
  {
    auto m = torch::rand({4096, 4096});
    if (bench::selected(o, "sum_dim0_4096x4096_f32"))
      bench::run(o, "sum_dim0_4096x4096_f32", [&] {
        auto s = m.sum(0);
        bench::do_not_optimize(s.data_ptr());
      }, 0, 4.0 * m.numel());
    if (bench::selected(o, "sum_dim1_4096x4096_f32"))
      bench::run(o, "sum_dim1_4096x4096_f32", [&] {
        auto s = m.sum(1);
        bench::do_not_optimize(s.data_ptr());
      }, 0, 4.0 * m.numel());
    auto s2 = torch::randn({4096, 1024});
    if (bench::selected(o, "softmax_4096x1024_f32"))
      bench::run(o, "softmax_4096x1024_f32", [&] {
        auto s = torch::softmax(s2, 1);
        bench::do_not_optimize(s.data_ptr());
      }, 0, 8.0 * s2.numel());
    if (bench::selected(o, "argmax_4096x1024_f32"))
      bench::run(o, "argmax_4096x1024_f32", [&] {
        auto s = s2.argmax(1);
        bench::do_not_optimize(s.data_ptr());
      }, 0, 4.0 * s2.numel());
  }
  if (bench::selected(o, "index_select_rows_1Mx64_f32")) {
    auto table = torch::rand({65536, 64});
    auto idx = torch::randint(0, 65536, {65536}, torch::kLong);
    bench::run(o, "index_select_rows_1Mx64_f32", [&] {
      auto r = table.index_select(0, idx);
      bench::do_not_optimize(r.data_ptr());
    });
  }
  if (bench::selected(o, "embedding_b64x128_d256")) {
    auto table = torch::rand({32768, 256});
    auto ids = torch::randint(0, 32768, {64, 128}, torch::kLong);
    bench::run(o, "embedding_b64x128_d256", [&] {
      auto r = F::embedding(ids, table);
      bench::do_not_optimize(r.data_ptr());
    });
  }
}

void per_op_overhead(const bench::Options& o) {
  auto a = torch::rand({1}), b = torch::rand({1});
  if (bench::selected(o, "add_1_f32"))
    bench::run(o, "add_1_f32", [&] {
      auto r = a + b;
      bench::do_not_optimize(r.data_ptr());
    });
  if (bench::selected(o, "add_1_f32_inplace"))
    bench::run(o, "add_1_f32_inplace", [&] { a.add_(b); });
}

// ---- autograd overhead (bench_autograd.cpp) ----

void autograd_overhead(const bench::Options& o) {
  if (bench::selected(o, "autograd_chain100_fwdbwd")) {
    torch::AutoGradMode grad(true);
    auto x = torch::randn({16}).requires_grad_(true), w = torch::randn({16}).requires_grad_(true);
    auto chain = [&] {
      torch::Tensor h = x;
      for (int i = 0; i < 100; ++i) {
        switch (i % 4) {
          case 0: h = h * w; break;
          case 1: h = h + w; break;
          case 2: h = h.tanh(); break;
          default: h = h * 0.5; break;
        }
      }
      return h.sum();
    };
    bench::run(o, "autograd_chain100_fwdbwd", [&] {
      chain().backward();
      x.mutable_grad() = torch::Tensor();
      w.mutable_grad() = torch::Tensor();
    });
  }
  if (bench::selected(o, "autograd_mlp_b64_fwdbwd")) {
    torch::AutoGradMode grad(true);
    std::vector<torch::Tensor> p = {torch::randn({784, 256}) * 0.05, torch::zeros({256}),
                                    torch::randn({256, 128}) * 0.05, torch::zeros({128}),
                                    torch::randn({128, 10}) * 0.05, torch::zeros({10})};
    for (auto& t : p) t.requires_grad_(true);
    auto x = torch::randn({64, 784});
    auto y = torch::randint(0, 10, {64});
    const double flops = 3 * 2.0 * 64 * (784 * 256 + 256 * 128 + 128 * 10);
    bench::run(o, "autograd_mlp_b64_fwdbwd", [&] {
      auto h1 = torch::relu(torch::addmm(p[1], x, p[0]));
      auto h2 = torch::relu(torch::addmm(p[3], h1, p[2]));
      auto logits = torch::addmm(p[5], h2, p[4]);
      auto loss = -torch::log_softmax(logits, 1).gather(1, y.unsqueeze(1)).mean();
      loss.backward();
      torch::NoGradGuard ng;
      for (auto& t : p) {
        t.add_(t.grad(), -1e-4);
        t.mutable_grad() = torch::Tensor();
      }
    }, flops);
  }
}

// ---- nn building blocks (bench_nn.cpp) ----

void nn_blocks(const bench::Options& o) {
  torch::AutoGradMode grad(true);
  {
    if (bench::selected(o, "cross_entropy_b256_c1000_fwdbwd")) {
      auto x = torch::randn({256, 1000}).requires_grad_(true);
      auto y = torch::randint(0, 1000, {256});
      bench::run(o, "cross_entropy_b256_c1000_fwdbwd", [&] {
        F::cross_entropy(x, y).backward();
        x.mutable_grad() = torch::Tensor();
      });
    }
    if (bench::selected(o, "cross_entropy_b16384_c256_fwdbwd")) {
      auto x = torch::randn({16384, 256}).requires_grad_(true);
      auto y = torch::randint(0, 256, {16384});
      bench::run(o, "cross_entropy_b16384_c256_fwdbwd", [&] {
        F::cross_entropy(x, y).backward();
        x.mutable_grad() = torch::Tensor();
      });
    }
    if (bench::selected(o, "batch_norm2d_b32_c64_28_fwdbwd")) {
      auto x = torch::randn({32, 64, 28, 28}).requires_grad_(true);
      auto w = torch::ones({64}).requires_grad_(true), b = torch::zeros({64}).requires_grad_(true);
      auto rm = torch::zeros({64}), rv = torch::ones({64});
      bench::run(o, "batch_norm2d_b32_c64_28_fwdbwd", [&] {
        F::batch_norm(x, rm, rv, F::BatchNormFuncOptions().weight(w).bias(b).training(true))
            .sum()
            .backward();
        x.mutable_grad() = torch::Tensor();
        w.mutable_grad() = torch::Tensor();
        b.mutable_grad() = torch::Tensor();
      });
    }
    if (bench::selected(o, "layer_norm_b64x128_d512_fwdbwd")) {
      auto x = torch::randn({64, 128, 512}).requires_grad_(true);
      auto w = torch::ones({512}).requires_grad_(true), b = torch::zeros({512}).requires_grad_(true);
      bench::run(o, "layer_norm_b64x128_d512_fwdbwd", [&] {
        F::layer_norm(x, F::LayerNormFuncOptions({512}).weight(w).bias(b)).sum().backward();
        x.mutable_grad() = torch::Tensor();
        w.mutable_grad() = torch::Tensor();
        b.mutable_grad() = torch::Tensor();
      });
    }
    if (bench::selected(o, "gelu_tanh_b32x128_d2048_fwdbwd")) {
      auto x = torch::randn({32, 128, 2048}).requires_grad_(true);
      bench::run(o, "gelu_tanh_b32x128_d2048_fwdbwd", [&] {
        F::gelu(x, F::GELUFuncOptions().approximate("tanh")).sum().backward();
        x.mutable_grad() = torch::Tensor();
      });
    }
    if (bench::selected(o, "cnn_step_b64_28_fwdbwd")) {
      torch::nn::Sequential model(
          torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3).padding(1)),
          torch::nn::BatchNorm2d(16), torch::nn::ReLU(), torch::nn::MaxPool2d(2),
          torch::nn::Flatten(), torch::nn::Linear(16 * 14 * 14, 10));
      torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
      auto x = torch::randn({64, 1, 28, 28});
      auto y = torch::randint(0, 10, {64});
      bench::run(o, "cnn_step_b64_28_fwdbwd", [&] {
        opt.zero_grad();
        F::cross_entropy(model->forward(x), y).backward();
        opt.step();
      });
    }
    if (bench::selected(o, "adam_step_1M")) {
      std::vector<torch::Tensor> ps;
      for (int i = 0; i < 16; ++i) {
        auto p = torch::randn({256, 256}).requires_grad_(true);
        p.mutable_grad() = torch::randn({256, 256});
        ps.push_back(p);
      }
      torch::optim::Adam opt(ps, torch::optim::AdamOptions(1e-3));
      bench::run(o, "adam_step_1M", [&] { opt.step(); }, 0, 16.0 * 65536 * 4 * 7);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bench::Options o = bench::parse(argc, argv);
  const char* nt = std::getenv("EMBER_NUM_THREADS");
  torch::set_num_threads(nt ? std::atoi(nt) : 1);
  torch::manual_seed(0);
  torch::NoGradGuard no_grad_default;
  matmul_and_conv(o);
  elementwise(o);
  reductions_and_indexing(o);
  per_op_overhead(o);
  autograd_overhead(o);
  nn_blocks(o);
  return 0;
}
