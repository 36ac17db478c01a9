// A downstream data-parallel loop built against the installed library: a linear regression on
// synthetic data, each rank its own shard, DDP averaging the gradients. Exits non-zero unless the
// loss fell and every rank ended with the same weights. `train_ddp PLUGIN SPEC` loads a comm-hook
// plug-in and trains with the hook SPEC names.
#include <cstdio>

#include <ember/ember.h>

namespace nn = ember::nn;
namespace dist = ember::dist;

int main(int argc, char** argv) {
  auto pg = dist::init_process_group({.backend = "gloo"});  // from emberrun's environment
  ember::manual_seed(0);
  auto model = std::make_shared<nn::Linear>(8, 1);
  dist::DistributedDataParallel ddp(model, pg);
  if (argc == 3) {
    dist::load_comm_hook_plugin(argv[1]);
    dist::MadeCommHook made = dist::make_comm_hook(argv[2], pg);
    ddp.register_comm_hook(made.hook, made.name);
  }
  nn::optim::SGD opt(ddp.parameters(), {.lr = 0.1});

  ember::Generator data(1234 + pg->rank());  // a different shard per rank
  const ember::Tensor w_true = ember::arange(1, 9, 1).to(ember::kFloat32).reshape({8, 1}) / 8.0;
  double first = 0, last = 0;
  for (int step = 0; step < 50; ++step) {
    const ember::Tensor x = ember::randn({32, 8}, ember::kFloat32, &data);
    opt.zero_grad();
    ember::Tensor loss = nn::functional::mse_loss(ddp.forward(x), x.matmul(w_true));
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  // Identical weights on every rank: their max and min over the ranks agree.
  ember::Tensor hi = model->weight.detach().clone(), lo = model->weight.detach().clone();
  pg->allreduce(hi, {.op = dist::ReduceOp::Max})->wait();
  pg->allreduce(lo, {.op = dist::ReduceOp::Min})->wait();
  const bool same = ember::equal(hi, lo);
  std::printf("downstream%s: rank %d of %d, loss %.4f -> %.4f, weights %s\n",
              argc == 3 ? " with a plug-in's hook" : "", pg->rank(), pg->size(),
              first, last, same ? "identical across ranks" : "DIFFER across ranks");
  dist::destroy_process_group();
  return same && last < 0.1 * first ? 0 : 1;
}
