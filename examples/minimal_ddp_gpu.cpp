// minimal_ddp.cpp on GPUs, one per rank, over NCCL: docs/choosing_a_backend.md walks through it.
//   emberrun --nproc-per-node 2 build/examples/minimal_ddp_gpu [EPOCHS]
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include <ember/distributed/ddp/ddp.h>
#include <ember/distributed/init.h>
#include <ember/distributed/sampler.h>
#include <ember/nn/nn.h>
#include <ember/tensor/ops/random.h>
#include <ember/tensor/version.h>

namespace nn = ember::nn;
namespace dist = ember::dist;

int main(int argc, char** argv) try {
  int epochs = 3;
  if (argc > 1) {
    const std::string arg = argv[1];
    char* end = nullptr;
    const long n = std::strtol(arg.c_str(), &end, 10);
    if (arg == "-h" || arg == "--help") return std::puts("usage: minimal_ddp_gpu [EPOCHS] (3)"), 0;
    if (arg == "--version") return std::printf("minimal_ddp_gpu (Ember) %s\n", ember::version()), 0;
    if (arg.empty() || *end != '\0' || n < 0 || n > 1000) {
      std::fprintf(stderr, "minimal_ddp_gpu: EPOCHS must be an integer in [0, 1000], got '%s'\n",
                   arg.c_str());
      return 2;
    }
    epochs = static_cast<int>(n);
  }
  // 1. This rank's GPU: cuda:LOCAL_RANK, made current (an error without one, or with more ranks
  //    on the node than GPUs). Then the job: with a GPU the default backend is NCCL.
  const ember::Device gpu = dist::local_device("cuda", "minimal_ddp_gpu");
  auto pg = dist::init_process_group();  // nccl, from the environment (env://)

  // 2. The same model on every rank, on this rank's GPU.
  ember::manual_seed(0);
  auto model = std::make_shared<nn::Sequential>(
      std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(784, 512),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(512, 10));
  model->to(gpu);

  // 3. Each rank reads its own share of every epoch.
  auto train = std::make_shared<nn::data::FashionMNIST>();  // from Debian's package
  auto sampler = dist::distributed_sampler(*train);  // the group's size and this rank
  nn::data::DataLoader loader(train, {.batch_size = 64, .sampler = sampler});

  // 4. Wrap the model; NCCL averages the gradients on the GPUs while backward runs.
  dist::DistributedDataParallel ddp(model, pg);
  nn::optim::SGD opt(ddp.parameters(), {.lr = 0.05, .momentum = 0.9});

  for (int epoch = 0; epoch < epochs; ++epoch) {
    loader.set_epoch(epoch);
    for (const auto& batch : loader) {
      opt.zero_grad();
      auto out = ddp.forward(batch.data.to(gpu));  // each batch goes to the GPU
      auto loss = nn::functional::cross_entropy(out, batch.target.to(gpu));
      loss.backward();
      opt.step();
    }
  }
  if (pg->rank() == 0) nn::save_state_dict("model.safetensors", model->state_dict());
  dist::destroy_process_group();
} catch (const std::exception& e) {
  std::fprintf(stderr, "minimal_ddp_gpu: error: %s\n", e.what());
  return 1;
}
