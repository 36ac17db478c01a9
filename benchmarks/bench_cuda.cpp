// GPU throughput of Ember's CUDA paths: device copies, elementwise ops, reductions, softmax,
// cuBLAS matmul, cuDNN convolution, caching-allocator churn and one training step of the
// Fashion-MNIST CNN (forward, cross-entropy, backward, SGD). Prints BENCH lines (bench_util.h);
// benchmarks/run_cuda_bench.py runs it beside the same cases in PyTorch on the same GPU
// (bench_cuda_torch.py) and prints the ratios. Without a CUDA device it says why and exits 0
// having run nothing.
#include <cstdio>
#include <memory>
#include <vector>

#include "bench_util.h"
#include "fashion_cnn.h"
#include <ember/nn/functional.h>
#include <ember/nn/optim/sgd.h>
#include <ember/tensor/conv.h>
#include <ember/tensor/cuda.h>
#include <ember/tensor/ops.h>
#include <ember/tensor/random.h>

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

}  // namespace

int main(int argc, char** argv) {
  const bench::Options o = bench::parse(argc, argv);
  if (!cuda::is_available()) {
    std::printf("# bench_cuda: skipped, %s\n", cuda::unavailable_reason());
    return 0;
  }
  run_cases(o);
  return 0;
}
