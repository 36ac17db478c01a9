// The smallest data-parallel training loop: docs/quickstart.md walks through it.
//   emberrun --nproc-per-node 2 build/examples/minimal_ddp [EPOCHS]
#include <cstdio>
#include <cstdlib>
#include <string>

#include <ember/distributed/ddp/ddp.h>
#include <ember/distributed/init.h>
#include <ember/distributed/sampler.h>
#include <ember/nn/nn.h>
#include <ember/tensor/ops/random.h>
#include <ember/tensor/version.h>

namespace nn = ember::nn;
namespace dist = ember::dist;

int main(int argc, char** argv) {
  int epochs = 3;
  if (argc > 1) {
    const std::string arg = argv[1];
    char* end = nullptr;
    const long n = std::strtol(arg.c_str(), &end, 10);
    if (arg == "-h" || arg == "--help") return std::puts("usage: minimal_ddp [EPOCHS] (3)"), 0;
    if (arg == "--version") return std::printf("minimal_ddp (Ember) %s\n", ember::version()), 0;
    if (arg.empty() || *end != '\0' || n < 0 || n > 1000) {
      std::fprintf(stderr, "minimal_ddp: EPOCHS must be an integer in [0, 1000], got '%s'\n",
                   arg.c_str());
      return 2;
    }
    epochs = static_cast<int>(n);
  }
  // 1. Join the job: rank, world size and rank 0's address come from emberrun (RANK,
  //    WORLD_SIZE, MASTER_ADDR, MASTER_PORT), mpirun or Slurm.
  auto pg = dist::init_process_group({.backend = "gloo"});  // CPU tensors; env://

  // 2. The same model on every rank (DDP copies rank 0's weights to the others anyway).
  ember::manual_seed(0);
  auto model = std::make_shared<nn::Sequential>(
      std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(784, 512),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(512, 10));

  // 3. Each rank reads its own share of every epoch.
  auto train = std::make_shared<nn::data::FashionMNIST>();  // from Debian's package
  auto sampler = dist::distributed_sampler(*train);  // the group's size and this rank
  nn::data::DataLoader loader(train, {.batch_size = 64, .sampler = sampler});

  // 4. Wrap the model; optimise the wrapper's parameters (they are the model's).
  dist::DistributedDataParallel ddp(model, pg);
  nn::optim::SGD opt(ddp.parameters(), {.lr = 0.05, .momentum = 0.9});

  for (int epoch = 0; epoch < epochs; ++epoch) {
    loader.set_epoch(epoch);  // a new order each epoch, the same on every rank
    for (const auto& batch : loader) {
      opt.zero_grad();
      auto loss = nn::functional::cross_entropy(ddp.forward(batch.data), batch.target);
      loss.backward();  // gradients are averaged across ranks while backward runs
      opt.step();       // every rank applies the same update
    }
  }
  if (pg->rank() == 0) nn::save_state_dict("model.safetensors", model->state_dict());
  dist::destroy_process_group();
}
