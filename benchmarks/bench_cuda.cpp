// GPU throughput of Ember's CUDA paths: device copies, elementwise ops, reductions, softmax,
// cuBLAS matmul, cuDNN convolution, caching-allocator churn, one training step of the
// Fashion-MNIST CNN (forward, cross-entropy, backward, SGD), and the ops of one step of
// examples/gpt at its GPU size (gpt_* cases, below). Prints BENCH lines (bench_util.h);
// benchmarks/run_cuda_bench.py runs it beside the same cases in PyTorch on the same GPU
// (bench_cuda_torch.py) and prints the ratios. Without a CUDA device it says why and exits 0
// having run nothing.
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "bench_util.h"
#include "examples/gpt_model.h"
#include "fashion_cnn.h"
#include <ember/nn/layers/activation.h>
#include <ember/nn/attention.h>
#include <ember/nn/clip_grad.h>
#include <ember/nn/layers/embedding.h>
#include <ember/nn/functional.h>
#include <ember/nn/layers/linear.h>
#include <ember/nn/layers/norm.h>
#include <ember/nn/optim/adam.h>
#include <ember/nn/optim/sgd.h>
#include <ember/tensor/autocast.h>
#include <ember/tensor/ops/conv.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/gpu/cuda_graph.h>
#include <ember/tensor/ops.h>
#include <ember/tensor/ops/random.h>

using namespace ember;

namespace {

constexpr int64_t kM = 1 << 20;

void run_cases(const bench::Options& o) {
  const Device gpu = cuda_device(0);
  auto sync = [] { cuda::synchronize(); };
  auto on_gpu = [&](IntList shape, Dtype d) { return randn(shape).to(gpu, d); };

  // Device-to-device copy: the bandwidth every memory-bound op is measured against.
  if (bench::selected(o, "copy_f32_64M")) {
    Tensor a = on_gpu({64 * kM}, kFloat32), b = empty({64 * kM}, TensorOptions(gpu));
    bench::run(o, "copy_f32_64M", [&] { b.copy_(a); }, 0, 2.0 * 4 * 64 * kM, sync);
  }
  for (Dtype d : {kFloat32, kBFloat16}) {
    const std::string n = "add_" + std::string(dtype_name(d)) + "_16M";
    if (bench::selected(o, n)) {
      Tensor a = on_gpu({16 * kM}, d), b = on_gpu({16 * kM}, d);
      bench::run(o, n, [&] { bench::do_not_optimize(add(a, b)); }, 16.0 * kM,
                 3.0 * itemsize(d) * 16 * kM, sync);
    }
  }
  if (bench::selected(o, "add_bcast_f32_4096x4096")) {
    Tensor a = on_gpu({4096, 4096}, kFloat32), b = on_gpu({4096}, kFloat32);
    bench::run(o, "add_bcast_f32_4096x4096", [&] { bench::do_not_optimize(add(a, b)); },
               16.0 * kM, 2.0 * 4 * 16 * kM, sync);
  }
  if (bench::selected(o, "sum_f32_64M")) {
    Tensor a = on_gpu({64 * kM}, kFloat32);
    bench::run(o, "sum_f32_64M", [&] { bench::do_not_optimize(sum(a)); }, 64.0 * kM,
               4.0 * 64 * kM, sync);
  }
  if (bench::selected(o, "sum_dim1_f32_8192x8192")) {
    Tensor a = on_gpu({8192, 8192}, kFloat32);
    bench::run(o, "sum_dim1_f32_8192x8192", [&] { bench::do_not_optimize(sum(a, {1})); },
               64.0 * kM, 4.0 * 64 * kM, sync);
  }
  if (bench::selected(o, "sum_dim0_f32_8192x8192")) {
    Tensor a = on_gpu({8192, 8192}, kFloat32);
    bench::run(o, "sum_dim0_f32_8192x8192", [&] { bench::do_not_optimize(sum(a, {0})); },
               64.0 * kM, 4.0 * 64 * kM, sync);
  }
  if (bench::selected(o, "softmax_f32_8192x4096")) {
    Tensor a = on_gpu({8192, 4096}, kFloat32);
    bench::run(o, "softmax_f32_8192x4096", [&] { bench::do_not_optimize(softmax(a, 1)); }, 0,
               2.0 * 4 * 32 * kM, sync);
  }
  for (auto [d, n] : {std::pair{kFloat32, 4096}, std::pair{kBFloat16, 8192},
                      std::pair{kFloat16, 8192}}) {
    const std::string name = "matmul_" + std::string(dtype_name(d)) + "_" + std::to_string(n);
    if (bench::selected(o, name)) {
      Tensor a = on_gpu({n, n}, d), b = on_gpu({n, n}, d);
      bench::run(o, name, [&] { bench::do_not_optimize(mm(a, b)); }, 2.0 * n * n * n,
                 3.0 * itemsize(d) * n * n, sync);
    }
  }
  if (bench::selected(o, "conv3x3_f32_n64_c128_28")) {
    Tensor x = on_gpu({64, 128, 28, 28}, kFloat32), w = on_gpu({128, 128, 3, 3}, kFloat32);
    Conv2dParams p;
    p.padding = {1, 1};
    bench::run(o, "conv3x3_f32_n64_c128_28", [&] { bench::do_not_optimize(conv2d(x, w, {}, p)); },
               2.0 * 64 * 128 * 28 * 28 * 128 * 9, 0, sync);
  }
  // Caching-allocator churn: 64 byte tensors of mixed sizes (4 KiB to 32 MiB, not powers of
  // two), each replacing the oldest of 8 live ones, as a training step's temporaries come and go.
  if (bench::selected(o, "alloc_churn_mixed_64")) {
    std::vector<int64_t> sizes;
    for (int64_t i = 0; i < 64; ++i) {
      sizes.push_back((int64_t{4096} << (i * 7 % 14)) + i * 37 % 11 * 512);
    }
    std::vector<Tensor> live(8);
    auto churn = [&] {
      for (size_t i = 0; i < sizes.size(); ++i) {
        live[i % live.size()] = empty({sizes[i]}, TensorOptions(kUInt8).device(gpu));
      }
    };
    bench::run(o, "alloc_churn_mixed_64", churn, 0, 0, sync);
  }
  for (int64_t batch : {64, 1024}) {
    const std::string name = "cnn_train_step_b" + std::to_string(batch);
    if (!bench::selected(o, name)) continue;
    manual_seed(0);
    auto model = bench::fashion_cnn();
    model->to(gpu);
    nn::optim::SGD opt(model->parameters(), {.lr = 0.01, .momentum = 0.9});
    Tensor x = on_gpu({batch, 1, 28, 28}, kFloat32);
    Tensor y = randint(0, 10, {batch}).to(gpu);
    bench::run(
        o, name,
        [&] {
          opt.zero_grad();
          nn::functional::cross_entropy(model->forward(x), y).backward();
          opt.step();
        },
        0, 0, sync);
  }
}

// ---- one step of examples/gpt, op by op ----
// The GPU run of examples/gpt: 6 layers, 6 heads, width 384, context 256, batch 64 (16384
// tokens), vocabulary 256, bf16 autocast. Each case runs one op (or module) forward and, where
// the step has one, backward through autograd, as the step does; dtypes are those autocast
// gives the op there (bfloat16 for what follows a linear, float32 for layer_norm, softmax and
// the loss). Gradients of leaves are cleared before each call so every call does the same work.
// bench_cuda_torch.py holds the same cases.

constexpr int64_t kTokens = 16384, kWidth = 384, kHeads = 6, kContext = 256, kVocab = 256,
                  kLayers = 6;

// examples/gpt at the GPU run's size (the gpt_block case runs one of its blocks).
const examples::GPTConfig kGpuGpt{
    .vocab = kVocab, .layers = kLayers, .heads = kHeads, .dim = kWidth, .context = kContext};

// The GPT's parameters (76 tensors, 10.8M float32 values), each with a gradient.
std::vector<Tensor> gpt_params_with_grads(Device gpu) {
  examples::GPT model(kGpuGpt);
  model.to(gpu);
  std::vector<Tensor> params = model.parameters();
  for (Tensor& p : params) p.set_grad((randn(p.shape()) * 1e-3).to(gpu));
  return params;
}

// Runs forward(), then backward with a fixed output gradient, after clearing the leaves' grads.
void run_fwd_bwd(const bench::Options& o, const std::string& name, const std::vector<Tensor>& leaves,
                 const std::function<Tensor()>& forward, double nbytes) {
  Tensor dy;
  {
    Tensor y = forward();
    dy = y.dim() == 0 ? Tensor() : randn(y.shape()).to(y.device(), y.dtype());
  }
  bench::run(
      o, name,
      [&] {
        for (const Tensor& t : leaves) t.set_grad({});
        forward().backward(dy);
      },
      0, nbytes, [] { cuda::synchronize(); });
}

void run_gpt_cases(const bench::Options& o) {
  namespace F = nn::functional;
  const Device gpu = cuda_device(0);
  auto sync = [] { cuda::synchronize(); };
  auto leaf = [&](IntList shape, Dtype d) { return randn(shape).to(gpu, d).requires_grad_(); };
  auto on_gpu_bf16 = [&](IntList shape) { return randn(shape).to(gpu, kBFloat16); };
  if (bench::selected(o, "gpt_layernorm_fwdbwd_f32_16384x384")) {
    auto ln = std::make_shared<nn::LayerNorm>(kWidth);
    ln->to(gpu);
    Tensor x = leaf({kTokens, kWidth}, kFloat32);
    std::vector<Tensor> leaves = ln->parameters();
    leaves.push_back(x);
    // forward reads x, writes y; backward reads dy, x, writes dx (weight/bias sums are small)
    run_fwd_bwd(o, "gpt_layernorm_fwdbwd_f32_16384x384", leaves, [&] { return ln->forward(x); },
                5.0 * 4 * kTokens * kWidth);
  }
  if (bench::selected(o, "gpt_gelu_tanh_fwdbwd_bf16_16384x1536")) {
    Tensor x = leaf({kTokens, 4 * kWidth}, kBFloat16);
    run_fwd_bwd(o, "gpt_gelu_tanh_fwdbwd_bf16_16384x1536", {x}, [&] { return gelu(x, "tanh"); },
                5.0 * 2 * kTokens * 4 * kWidth);
  }
  if (bench::selected(o, "gpt_bias_add_bf16_16384x1536")) {
    Tensor a = on_gpu_bf16({kTokens, 4 * kWidth}), b = on_gpu_bf16({4 * kWidth});
    bench::run(o, "gpt_bias_add_bf16_16384x1536", [&] { bench::do_not_optimize(add(a, b)); },
               double(kTokens) * 4 * kWidth, 2.0 * 2 * kTokens * 4 * kWidth, sync);
  }
  if (bench::selected(o, "gpt_linear_fwdbwd_bf16_16384x384x1536")) {
    // The MLP's first Linear under bf16 autocast: a GEMM with the bias added (cuBLASLt's
    // epilogue), its two backward GEMMs and the bias gradient's column sum.
    auto fc = std::make_shared<nn::Linear>(kWidth, 4 * kWidth);
    fc->to(gpu);
    Tensor x = leaf({kTokens, kWidth}, kFloat32);
    std::vector<Tensor> leaves = fc->parameters();
    leaves.push_back(x);
    run_fwd_bwd(o, "gpt_linear_fwdbwd_bf16_16384x384x1536", leaves,
                [&] {
                  AutocastGuard autocast(gpu, kBFloat16);
                  return fc->forward(x);
                },
                0);
  }
  if (bench::selected(o, "gpt_bias_grad_sum0_bf16_16384x1536")) {
    Tensor g = on_gpu_bf16({kTokens, 4 * kWidth});
    bench::run(o, "gpt_bias_grad_sum0_bf16_16384x1536",
               [&] { bench::do_not_optimize(sum(g, {0})); }, double(kTokens) * 4 * kWidth,
               2.0 * kTokens * 4 * kWidth, sync);
  }
  if (bench::selected(o, "gpt_softmax_causal_fwdbwd_f32_384x256x256")) {
    Tensor s = leaf({kHeads * 64, kContext, kContext}, kFloat32);
    Tensor col = arange(0, kContext, 1, TensorOptions(kInt64));
    Tensor mask = masked_fill(zeros({kContext, kContext}), gt(col.unsqueeze(0), col.unsqueeze(1)),
                              -std::numeric_limits<double>::infinity())
                      .to(gpu);
    // forward: reads s and the mask, writes s + mask, reads it, writes y; backward: reads dy
    // and y, writes ds (the mask add's backward passes ds through)
    run_fwd_bwd(o, "gpt_softmax_causal_fwdbwd_f32_384x256x256", {s},
                [&] { return softmax(s + mask, -1); }, 7.0 * 4 * s.numel());
  }
  if (bench::selected(o, "gpt_cross_entropy_fwdbwd_f32_16384x256")) {
    Tensor logits = leaf({kTokens, kVocab}, kFloat32);
    Tensor target = randint(0, kVocab, {kTokens}).to(gpu);
    run_fwd_bwd(o, "gpt_cross_entropy_fwdbwd_f32_16384x256", {logits},
                [&] { return F::cross_entropy(logits, target); }, 3.0 * 4 * logits.numel());
  }
  if (bench::selected(o, "gpt124m_cross_entropy_fwdbwd_bf16_amp_16384x50304")) {
    // GPT-2 124M's loss at batch 16: bfloat16 logits under autocast (the fused row kernels read
    // them as they are). Forward reads the logits, backward reads them and writes their gradient.
    constexpr int64_t kRows = 16384, kClasses = 50304;
    Tensor logits = randn({kRows, kClasses}, TensorOptions(kFloat32).device(gpu))
                        .to(kBFloat16)
                        .requires_grad_();
    Tensor target = randint(0, kClasses, {kRows}).to(gpu);
    run_fwd_bwd(
        o, "gpt124m_cross_entropy_fwdbwd_bf16_amp_16384x50304", {logits},
        [&] {
          AutocastGuard amp(gpu, kBFloat16);
          return F::cross_entropy(logits, target);
        },
        3.0 * 2 * logits.numel());
  }
  if (bench::selected(o, "gpt_embedding_fwdbwd_f32_256x384_16384")) {
    auto emb = std::make_shared<nn::Embedding>(kVocab, kWidth);
    emb->to(gpu);
    Tensor idx = randint(0, kVocab, {64, kContext}).to(gpu);
    run_fwd_bwd(o, "gpt_embedding_fwdbwd_f32_256x384_16384", emb->parameters(),
                [&] { return emb->forward(idx); }, 2.0 * 4 * kTokens * kWidth);
  }
  if (bench::selected(o, "gpt_adamw_step_f32_10.8M")) {
    std::vector<Tensor> params = gpt_params_with_grads(gpu);
    nn::optim::AdamW opt(params, {.lr = 1e-3, .betas = {0.9, 0.95}, .weight_decay = 0.1});
    // reads param, grad, exp_avg, exp_avg_sq; writes param, exp_avg, exp_avg_sq
    bench::run(o, "gpt_adamw_step_f32_10.8M", [&] { opt.step(); }, 0, 7.0 * 4 * 10844160, sync);
  }
  if (bench::selected(o, "gpt_clip_grad_norm_f32_10.8M")) {
    std::vector<Tensor> params = gpt_params_with_grads(gpu);
    // reads every gradient for the norm, then reads and writes it to scale
    bench::run(o, "gpt_clip_grad_norm_f32_10.8M",
               [&] { bench::do_not_optimize(nn::clip_grad_norm_(params, 1.0)); }, 0,
               3.0 * 4 * 10844160, sync);
  }
  // The whole training step of examples/gpt at its GPU size (bf16 autocast, the loss,
  // clipping, AdamW), run eagerly and replayed as a CUDA graph (Note [CUDA graphs]); the second
  // line's ratio is the measure. At batch 8 launches weigh more than at 64.
  for (int64_t batch : {8, 64}) {
    const std::string name = "gpt_train_step_bf16_b" + std::to_string(batch) + "_t256";
    if (!bench::selected(o, name)) continue;
    double eager_s = 0;
    for (const bool graphed : {false, true}) {
      manual_seed(0);
      examples::GPT model(kGpuGpt);
      model.to(gpu);
      nn::optim::AdamW opt(
          model.parameters(),
          {.lr = 1e-3, .betas = {0.9, 0.95}, .weight_decay = 0.1, .capturable = graphed});
      Tensor x = randint(0, kVocab, {batch, kContext}).to(gpu);
      Tensor y = randint(0, kVocab, {batch, kContext}).to(gpu);
      Tensor loss;
      auto step = [&] {
        opt.zero_grad();
        {
          AutocastGuard autocast(gpu, kBFloat16);
          loss = F::cross_entropy(model(x).view({-1, kVocab}), y.view({-1}));
        }
        loss.backward();
        nn::clip_grad_norm_(model.parameters(), 1.0);
        opt.step();
      };
      const double flops = static_cast<double>(batch * kContext) *
                           static_cast<double>(examples::flops_per_token(kGpuGpt, kContext));
      if (!graphed) {
        eager_s = bench::run(o, name, step, flops, 0, sync);
        continue;
      }
      for (int i = 0; i < 3; ++i) step();  // warm-up: state, plans and caches before the capture
      cuda::CUDAGraph graph;
      cuda::graph(graph, step);
      const double graph_s = bench::run(
          o, name + "_cuda_graph", [&] { graph.replay(); }, flops, 0, sync);
      std::printf("# %s: CUDA graph %.3f ms, eager %.3f ms, %.2fx eager's tokens/s\n", name.c_str(),
                  graph_s * 1e3, eager_s * 1e3, eager_s / graph_s);
    }
  }
  if (bench::selected(o, "gpt_block_fwdbwd_bf16_b64_t256")) {
    manual_seed(0);
    // No dropout, examples/gpt's default.
    auto block = std::make_shared<examples::Block>(kGpuGpt.dim, kGpuGpt.heads, 0.0);
    block->to(gpu);
    Tensor x = leaf({64, kContext, kWidth}, kFloat32);
    std::vector<Tensor> leaves = block->parameters();
    leaves.push_back(x);
    run_fwd_bwd(o, "gpt_block_fwdbwd_bf16_b64_t256", leaves,
                [&] {
                  AutocastGuard autocast(gpu, kBFloat16);
                  return block->forward(x);
                },
                0);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bench::Options o = bench::parse(argc, argv);
  if (!cuda::is_available()) {
    std::printf("# bench_cuda: skipped, %s\n", cuda::unavailable_reason());
    return 0;
  }
  run_cases(o);
  run_gpt_cases(o);
  return 0;
}
