// Tensor parallelism: parallelize_module's styles on small models against the same model in one
// process (outputs, every parameter's gradient as its shard of the whole one, and SGD steps), at
// 2 and 4 rank threads; sequence parallelism; loss_parallel against cross_entropy; what one
// transformer block moves (Megatron's count); the plan's errors.
#include <ember/distributed/tensor_parallel/parallelize.h>

#include <gtest/gtest.h>

#include <map>

#include <ember/autograd/autograd.h>
#include <ember/distributed/backends/process_group_threads.h>
#include <ember/distributed/debug/delaying_group.h>
#include <ember/distributed/forwarding_process_group.h>
#include <ember/distributed/init.h>
#include <ember/distributed/tensor_parallel/clip_grad.h>
#include <ember/distributed/tensor_parallel/loss_parallel.h>
#include <ember/nn/nn.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops.h>
#include <ember/tensor/ops/random.h>
#include "examples/gpt_model.h"
#include "examples/gpt_parallel.h"
#include "tests/distributed/ddp/ddp_test_util.h"
#include "tests/distributed/dtensor/dtensor_test_util.h"
#include "tests/distributed/store/store_test_util.h"

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
    if (d) {
      require_close(name, got.reshape(d->local().shape()),
                    test::shard_of(want, *d->device_mesh(), d->placements()), tol);
    } else {
      require_close(name, got, want, tol);
    }
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

// A sequence that does not divide by the ranks (7 over 2: shards of 4 and 3) entering a
// column-parallel Linear, as after a row-parallel layer with Shard(1) output at an odd length:
// the same output and input gradient as one process (the fused all-gather takes even shards
// only; this goes the padded way).
TEST(TensorParallel, ColwiseTakesAnUnevenSequenceShard) {
  run_rank_threads(
      2,
      [](int) {
        auto mesh = init_device_mesh("cpu", {2});
        manual_seed(4);
        auto ref = std::make_shared<nn::Linear>(16, 8);
        manual_seed(4);
        auto lin = std::make_shared<nn::Linear>(16, 8);
        parallelize_module(
            lin, mesh, ColwiseParallel({.input_layouts = Shard(1), .output_layouts = Replicate()}));
        manual_seed(5);
        const Tensor x = randn({2, 7, 16}), c = randn({2, 7, 8});
        Tensor whole = x.clone().requires_grad_();
        ((*ref)(whole)*c).sum().backward();
        Tensor local = distribute_tensor(x, mesh, {Shard(1)}).local().detach().requires_grad_();
        register_dtensor(local, DTensor::from_local(local, mesh, {Shard(1)}, x.shape()));
        const Tensor y = (*lin)(local);
        require_close("output", y, (*ref)(x), 1e-5);
        (y * c).sum().backward();
        require_close("input gradient", local.grad(),
                      test::shard_of(whole.grad(), *mesh, {Shard(1)}), 1e-5);
      },
      kTimeout);
}

// clip_grad_norm_ of a tensor-parallel model finds the whole model's norm, also over another
// mesh of the same ranks (a second init_device_mesh, as a layout that merges two dimensions
// builds), whose groups are other objects than the parameters' mesh's.
TEST(TensorParallel, ClipGradNormIsTheWholeModelsOverAnyMeshOfTheSameRanks) {
  run_rank_threads(
      4,
      [](int) {
        // 2-D, so that each tp group is a group of its own (a 1-D mesh's is the world's).
        auto mesh = (*init_device_mesh("cpu", {2, 2}, {"dp", "tp"}))["tp"];
        auto other = (*init_device_mesh("cpu", {2, 2}, {"dp", "tp"}))["tp"];
        require(mesh->get_group() != other->get_group(), "two meshes' tp groups are two groups");
        auto ref = make_mlp(16);
        auto model = make_mlp(16);
        parallelize_module(model, mesh, {{"fc", ColwiseParallel()}, {"proj", RowwiseParallel()}});
        manual_seed(7);
        const Tensor x = randn({2, 8, 16});
        const Tensor y_ref = (*ref)(x), y = (*model)(x);
        ((y_ref * y_ref).sum() * 0.01).backward();
        ((y * y).sum() * 0.01).backward();
        const double want = nn::clip_grad_norm_(ref->parameters(), 1e9).item<double>();
        for (const auto& [what, m] : {std::pair{"the parameters' mesh", mesh},
                                      std::pair{"another mesh of the same ranks", other}}) {
          const double got = clip_grad_norm_(model->parameters(), 1e9, *m).item<double>();
          require(std::fabs(got - want) <= 1e-5 * want,
                  std::string("norm over ") + what + ": " + std::to_string(got) +
                      ", one process's " + std::to_string(want));
        }
      },
      kTimeout);
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
      require_close(std::string(reduction) + " logits grad", local.grad(),
                    test::shard_of(whole.grad(), *mesh, {Shard(-1)}), 1e-5);
    }
    // 6 classes on 4 ranks are chunks of 2, 2, 2, 0, and 3 are 1, 1, 1, 0: a rank without
    // classes still takes part in every collective.
    for (int64_t v : {6, 3}) {
      const Tensor lg = randn({4, v});
      const Tensor tg = randint(0, v, {4});
      Tensor whole = lg.clone().requires_grad_();
      const Tensor want = nn::functional::cross_entropy(whole, tg);
      want.backward();
      Tensor local = distribute_tensor(lg, mesh, {Shard(-1)}).local().detach().requires_grad_();
      const Tensor got = loss_parallel::cross_entropy(
          DTensor::from_local(local, mesh, {Shard(-1)}, lg.shape()), tg);
      const std::string what = std::to_string(v) + " classes";
      require_close(what + ": loss", got, want, 1e-5);
      got.backward();
      require_close(what + ": logits grad", local.grad(),
                    test::shard_of(whole.grad(), *mesh, {Shard(-1)}), 1e-5);
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
    // Two entries reaching one module would shard its shards.
    expect_error(
        [&] {
          parallelize_module(make_mlp(16), mesh,
                             {{"fc", ColwiseParallel()}, {"fc", ColwiseParallel()}});
        },
        {"[distribute_parameter] the parameter is already distributed as DTensor(float32 [64, "
         "16]"});
    auto mesh2 = init_device_mesh("cpu", {1, 2}, {"dp", "tp"});
    expect_error([&] { parallelize_module(make_mlp(16), mesh2, {{"fc", ColwiseParallel()}}); },
                 {"expected a 1-D mesh", "mesh[\"tp\"]"});
  }, kTimeout);
}

// Records every collective issued through it: kind and bytes moved by this rank's input.
class Recording final : public ForwardingProcessGroup {
 public:
  using ForwardingProcessGroup::ForwardingProcessGroup;
  struct Call {
    OpType op;
    int64_t bytes;
  };
  WorkPtr allreduce(Tensor& t, const AllreduceOptions& o) override {
    calls.push_back({OpType::Allreduce, t.nbytes()});
    return inner_->allreduce(t, o);
  }
  WorkPtr allgather_into_tensor(Tensor& out, const Tensor& in,
                                const CollectiveOptions& o) override {
    calls.push_back({OpType::AllgatherIntoTensor, out.nbytes()});
    return inner_->allgather_into_tensor(out, in, o);
  }
  WorkPtr reduce_scatter_tensor(Tensor& out, const Tensor& in,
                                const ReduceScatterOptions& o) override {
    calls.push_back({OpType::ReduceScatterTensor, in.nbytes()});
    return inner_->reduce_scatter_tensor(out, in, o);
  }
  WorkPtr broadcast(Tensor& t, const BroadcastOptions& o) override {
    calls.push_back({OpType::Broadcast, t.nbytes()});
    return inner_->broadcast(t, o);
  }
  std::vector<Call> calls;
};

// A count of `calls` by kind: "allreduce x2 (2048 B), ...".
std::string summary(const std::vector<Recording::Call>& calls) {
  std::map<std::string, std::pair<int, int64_t>> by;
  for (const auto& c : calls) {
    auto& e = by[to_string(c.op)];
    ++e.first;
    e.second += c.bytes;
  }
  std::string s;
  for (const auto& [k, v] : by) {
    s += (s.empty() ? "" : ", ") + k + " x" + std::to_string(v.first) + " (" +
         std::to_string(v.second) + " B)";
  }
  return s;
}

// Megatron's analysis of one transformer block at tp 2 (activations [B, T, C] = [2, 8, 16],
// float32, 1024 B): without sequence parallelism, 2 all-reduces forward (after the attention's
// and the MLP's row-parallel layers) and 2 backward (f before their column-parallel layers);
// with it, each all-reduce becomes an all-gather and a reduce-scatter moving the same bytes,
// and backward adds the LayerNorms' replicated parameters' all-reduces (4 of C values) and, as
// Megatron does to keep only the shards, the two column-parallel inputs' all-gathers again.
TEST(TensorParallel, ABlockMovesWhatMegatronsAnalysisSays) {
  run_rank_threads(2, [](int r) {
    const int64_t act = 2 * 8 * 16 * 4;  // bytes of one [2, 8, 16] float32 activation
    for (bool sp : {false, true}) {
      auto rec = std::make_shared<Recording>(default_group());
      auto mesh = DeviceMesh::from_group({rec}, "cpu");
      manual_seed(1);
      auto block = std::make_shared<examples::Block>(16, 4, 0.0);
      ParallelizePlan plan;
      for (const PlanEntry& e : examples::gpt_tensor_parallel_plan(sp, false)) {
        if (e.path.rfind("blocks.*.", 0) == 0) plan.push_back({e.path.substr(9), e.style});
      }
      parallelize_module(block, mesh, plan);
      rec->calls.clear();  // the parameters' broadcasts
      manual_seed(2);
      const Tensor x = randn({2, 8, 16});
      const Tensor in = sp ? x.narrow(1, 4 * r, 4) : x;
      const Tensor y = (*block)(in.detach().requires_grad_());
      const std::vector<Recording::Call> fwd = rec->calls;
      rec->calls.clear();
      y.sum().backward();
      const std::vector<Recording::Call> bwd = rec->calls;
      const std::string want_fwd =
          sp ? "allgather_into_tensor x2 (" + std::to_string(2 * act) +
                   " B), reduce_scatter_tensor x2 (" + std::to_string(2 * act) + " B)"
             : "allreduce x2 (" + std::to_string(2 * act) + " B)";
      const std::string want_bwd =
          sp ? "allgather_into_tensor x4 (" + std::to_string(4 * act) + " B), allreduce x4 (" +
                   std::to_string(4 * 16 * 4) + " B), reduce_scatter_tensor x2 (" +
                   std::to_string(2 * act) + " B)"
             : "allreduce x2 (" + std::to_string(2 * act) + " B)";
      require(summary(fwd) == want_fwd, std::string(sp ? "sp" : "plain") + " forward: " +
                                            summary(fwd) + ", expected " + want_fwd);
      require(summary(bwd) == want_bwd, std::string(sp ? "sp" : "plain") + " backward: " +
                                            summary(bwd) + ", expected " + want_bwd);
    }
  }, kTimeout);
}

// The same block through a DelayingGroup (every collective's result written late): a result
// read before its wait would be stale; the outputs and gradients equal the undelayed run's.
TEST(TensorParallel, NoCollectiveIsReadBeforeItsWait) {
  run_rank_threads(2, [](int r) {
    auto run = [&](std::shared_ptr<ProcessGroup> g) {
      auto mesh = DeviceMesh::from_group({g}, "cpu");
      manual_seed(1);
      auto block = std::make_shared<examples::Block>(16, 4, 0.0);
      ParallelizePlan plan;
      for (const PlanEntry& e : examples::gpt_tensor_parallel_plan(true, false)) {
        if (e.path.rfind("blocks.*.", 0) == 0) plan.push_back({e.path.substr(9), e.style});
      }
      parallelize_module(block, mesh, plan);
      manual_seed(2);
      const Tensor x = randn({2, 8, 16}).narrow(1, 4 * r, 4).detach().requires_grad_();
      const Tensor y = (*block)(x);
      y.sum().backward();
      return std::vector<Tensor>{y.detach(), x.grad(), block->named_parameters()[0].second.grad()};
    };
    const auto plain = run(default_group());
    const auto delayed = run(std::make_shared<DelayingGroup>(
        default_group(), DelayOptions{.cpu_delay = std::chrono::milliseconds(3), .scale = 1.0}));
    for (size_t i = 0; i < plain.size(); ++i) {
      require_close("delayed result " + std::to_string(i), delayed[i], plain[i], 0);
    }
  }, kTimeout);
}

}  // namespace
}  // namespace ember::dist
