// Tensor parallelism: parallelize_module's styles on small models against the same model in one
// process (outputs, every parameter's gradient as its shard of the whole one, and SGD steps), at
// 2 and 4 rank threads; sequence parallelism; loss_parallel against cross_entropy; what one
// transformer block moves (Megatron's count); the plan's errors.
#include <ember/distributed/tensor_parallel/parallelize.h>

#include <gtest/gtest.h>

#include <ember/autograd/autograd.h>
#include <ember/distributed/backends/process_group_threads.h>
#include <ember/distributed/forwarding_process_group.h>
#include <ember/distributed/init.h>
#include <ember/distributed/tensor_parallel/loss_parallel.h>
#include <ember/nn/nn.h>
#include <ember/tensor/creation.h>
#include <ember/tensor/ops.h>
#include <ember/tensor/random.h>
#include "tests/distributed/ddp_test_util.h"
#include "tests/distributed/store_test_util.h"

namespace ember::dist {
namespace {

using namespace std::chrono_literals;
using test::expect_error;
using test::require;
using test::require_close;

constexpr Duration kTimeout = 60s;

// x -> ln -> fc (4x wide) -> gelu -> proj, with dropout off: a transformer's MLP half.
class Mlp : public nn::Module {
 public:
  explicit Mlp(int64_t dim)
      : ln(register_module("ln", std::make_shared<nn::LayerNorm>(dim))),
        fc(register_module("fc", std::make_shared<nn::Linear>(dim, 4 * dim))),
        proj(register_module("proj", std::make_shared<nn::Linear>(4 * dim, dim))) {}
  Tensor forward(const Tensor& x) override {
    return x + (*proj)(gelu((*fc)((*ln)(x)), "tanh"));
  }
  std::shared_ptr<nn::LayerNorm> ln;
  std::shared_ptr<nn::Linear> fc, proj;
};

std::shared_ptr<Mlp> make_mlp(int64_t dim) {
  manual_seed(5);
  auto m = std::make_shared<Mlp>(dim);
  for (auto& [name, p] : m->named_parameters()) {
    if (name.find("ln") == std::string::npos) nn::init::normal_(p, 0.0, 0.1);
  }
  return m;
}

// This rank's part of the whole tensor `full` as `p` lays it out on `mesh`.
Tensor part(const Tensor& full, const DTensor& d) {
  Tensor t = full;
  const DeviceMesh& mesh = *d.device_mesh();
  for (int i = 0; i < mesh.ndim(); ++i) {
    if (!d.placements()[i].is_shard()) continue;
    const int64_t dim = d.placements()[i].dim(), n = mesh.size(i), k = mesh.get_local_rank(i);
    t = t.narrow(dim, shard_offset(full.size(dim), n, k), shard_length(full.size(dim), n, k));
  }
  return t;
}

// Every parameter of `tp` (sharded or replicated) against the one-process model `ref`.
void require_params_match(const std::string& what, const nn::Module& tp, const nn::Module& ref,
                          bool grads, double tol = 1e-5) {
  const auto a = tp.named_parameters(), b = ref.named_parameters();
  require(a.size() == b.size(), what + ": parameter count");
  for (size_t i = 0; i < a.size(); ++i) {
    const Tensor want = grads ? b[i].second.grad() : b[i].second;
    const Tensor got = grads ? a[i].second.grad() : a[i].second;
    const std::string name = what + ": " + a[i].first + (grads ? " grad" : "");
    // Parameters no style laid out are replicated.
    const std::optional<DTensor> d = as_dtensor(a[i].second);
    require_close(name, d ? got.reshape(d->local().shape()) : got, d ? part(want, *d) : want, tol);
  }
}

// Trains `steps` SGD steps of the MLP on the same batches with and without tensor parallelism
// (`plan`, input laid out as `input_seq_sharded` says) and compares after each.
void train_alike(int tp, const ParallelizePlan& plan, bool input_seq_sharded, int steps = 4) {
  run_rank_threads(tp, [&](int r) {
    auto mesh = init_device_mesh("cpu", {tp}, {"tp"});
    auto ref = make_mlp(16);
    auto model = make_mlp(16);
    parallelize_module(model, mesh, plan);
    nn::optim::SGD opt_ref(ref->parameters(), {.lr = 0.1});
    nn::optim::SGD opt(model->parameters(), {.lr = 0.1});
    for (int step = 0; step < steps; ++step) {
      manual_seed(100 + step);
      const Tensor x = randn({2, 8, 16}) * 0.5;
      const Tensor y_ref = (*ref)(x);
      // Under sequence parallelism each rank holds a quarter of the sequence, in and out.
      const Tensor in = input_seq_sharded ? x.narrow(1, 8 / tp * r, 8 / tp) : x;
      Tensor y = (*model)(in);
      const Tensor want = input_seq_sharded ? y_ref.narrow(1, 8 / tp * r, 8 / tp) : y_ref;
      require_close("step " + std::to_string(step) + " output", y, want, 1e-5);
      ((y_ref * y_ref).sum() * 0.01).backward();
      // Replicated: every rank's loss is the whole loss. Sequence parallel: each rank's is its
      // part's, and the parts sum to the whole.
      ((y * y).sum() * 0.01).backward();
      require_params_match("step " + std::to_string(step), *model, *ref, /*grads=*/true);
      opt_ref.step();
      opt.step();
      opt_ref.zero_grad();
      opt.zero_grad();
    }
    require_params_match("after training", *model, *ref, /*grads=*/false);
  }, kTimeout);
}

TEST(TensorParallel, ColumnThenRowMlpTrainsLikeOneProcess) {
  for (int tp : {2, 4}) {
    train_alike(tp, {{"fc", ColwiseParallel()}, {"proj", RowwiseParallel()}}, false);
  }
}

TEST(TensorParallel, SequenceParallelMlpTrainsLikeOneProcess) {
  for (int tp : {2, 4}) {
    train_alike(tp,
                {{"ln", SequenceParallel()},
                 {"fc", ColwiseParallel({.input_layouts = Shard(1)})},
                 {"proj", RowwiseParallel({.output_layouts = Shard(1)})}},
                true);
  }
}

// loss_parallel's cross-entropy of vocabulary-sharded logits equals cross_entropy of the whole
// logits, with an ignored target, and so do the logits' gradients (each rank its classes').
TEST(TensorParallel, LossParallelEqualsCrossEntropy) {
  run_rank_threads(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    manual_seed(3);
    const Tensor logits = randn({2, 5, 11}) * 3.0;  // 11 classes: 3, 3, 3, 2
    Tensor target = randint(0, 11, {2, 5});
    target.narrow(1, 0, 1).fill_(Scalar(-100));
    for (const char* reduction : {"mean", "sum", "none"}) {
      Tensor whole = logits.clone().requires_grad_();
      const Tensor want = nn::functional::cross_entropy(
          whole.reshape({10, 11}), target.reshape({10}), {.reduction = reduction});
      (want * want).sum().backward();
      DTensor d = distribute_tensor(logits, mesh, {Shard(-1)});
      Tensor local = d.local().detach().requires_grad_();
      const Tensor got = loss_parallel::cross_entropy(
          DTensor::from_local(local, mesh, {Shard(-1)}, logits.shape()), target, reduction);
      require_close(std::string(reduction) + " loss", got.reshape({-1}), want.reshape({-1}), 1e-5);
      (got * got).sum().backward();
      require_close(std::string(reduction) + " logits grad", local,
                    part(whole.grad(), d).detach() * 0.0 + local.detach(), 0);
      require_close(std::string(reduction) + " logits grad", local.grad(), part(whole.grad(), d),
                    1e-5);
    }
    expect_error([&] {
      loss_parallel::cross_entropy(distribute_tensor(logits, mesh, {Shard(0)}), target);
    }, {"[loss_parallel::cross_entropy] expected logits sharded on the class dim (Shard(2))"});
    expect_error([&] {
      loss_parallel::cross_entropy(distribute_tensor(logits, mesh, {Shard(-1)}), target.reshape({10}));
    }, {"expected integer class indices of shape [2, 5]"});
  }, kTimeout);
}

TEST(TensorParallel, PlanErrorsNameThePathAndTheSizes) {
  run_rank_threads(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    expect_error([&] { parallelize_module(make_mlp(16), mesh, {{"fc2", ColwiseParallel()}}); },
                 {"[parallelize_module] the plan names 'fc2', which matches no submodule: no "
                  "'fc2' in the model (it has: ln, fc, proj)"});
    auto odd = [] {
      return std::make_shared<nn::Sequential>(std::make_shared<nn::Linear>(4, 7),
                                              std::make_shared<nn::Linear>(7, 4));
    };
    expect_error([&] { parallelize_module(odd(), mesh, {{"1", RowwiseParallel()}}); },
                 {"RowwiseParallel at '1': in_features (7) is not divisible by the mesh's 2 ranks"});
    expect_error([&] { parallelize_module(odd(), mesh, {{"0", ColwiseParallel()}}); },
                 {"ColwiseParallel at '0': out_features / output_chunks (7) is not divisible"});
    expect_error([&] {
      parallelize_module(make_mlp(16), mesh, {{"fc", ColwiseParallel({.output_chunks = 3})}});
    }, {"ColwiseParallel at 'fc': out_features (64) is not divisible by output_chunks (3)"});
    expect_error([&] { parallelize_module(make_mlp(16), mesh, {{"ln", RowwiseParallel()}}); },
                 {"RowwiseParallel at 'ln' supports Linear and Embedding, got LayerNorm"});
    auto mesh2 = init_device_mesh("cpu", {1, 2}, {"dp", "tp"});
    expect_error([&] { parallelize_module(make_mlp(16), mesh2, {{"fc", ColwiseParallel()}}); },
                 {"expected a 1-D mesh", "mesh[\"tp\"]"});
  }, kTimeout);
}

}  // namespace
}  // namespace ember::dist
