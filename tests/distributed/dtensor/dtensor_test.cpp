// DTensor: every redistribute pair (Shard(0), Shard(1), Replicate, Partial, on a 1-D mesh of 4
// and a 2 x 2 mesh) against the full tensor, with even and uneven shards, and the gradient that
// reaches the source's local tensor through it; from_local, distribute_tensor, full_tensor,
// run_check and the errors.
#include <ember/distributed/dtensor/dtensor.h>
#include <ember/distributed/dtensor/distribute_module.h>

#include <gtest/gtest.h>

#include <ember/autograd/autograd.h>
#include <ember/distributed/backends/process_group_threads.h>
#include <ember/distributed/forwarding_process_group.h>
#include <ember/distributed/functional/collectives.h>
#include <ember/distributed/init.h>
#include <ember/nn/nn.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops.h>
#include <ember/tensor/ops/random.h>
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

// The part `p` gives this rank of `full` (Partial: the whole value on the mesh dimension's
// first rank, zeros elsewhere), as distribute_tensor makes it.
Tensor expected_local(const Tensor& full, const DeviceMesh& mesh, const Placements& p) {
  Tensor t = test::shard_of(full, mesh, p);
  for (int i = 0; i < mesh.ndim(); ++i) {
    if (p[i].is_partial() && mesh.get_local_rank(i) != 0) t = zeros_like(t);
  }
  return t;
}

std::vector<Placement> kinds() { return {Shard(0), Shard(1), Replicate(), Partial()}; }

// For every pair of placements on `mesh` (every combination per mesh dimension that shards no
// tensor dimension twice): the redistributed local parts are full's, the full tensor is full,
// and d(sum(full_tensor() * c))/d(source local) is c's part for a Shard source and c for a
// Replicate or Partial one.
void every_pair(const std::shared_ptr<DeviceMesh>& mesh, IntList shape) {
  manual_seed(7);
  const Tensor full = randn(shape), c = randn(shape);
  std::vector<Placements> all;
  if (mesh->ndim() == 1) {
    for (const Placement& a : kinds()) all.push_back({a});
  } else {
    for (const Placement& a : kinds()) {
      for (const Placement& b : kinds()) {
        if (a.is_shard() && b.is_shard() && a.dim() == b.dim()) continue;
        all.push_back({a, b});
      }
    }
  }
  for (const Placements& from : all) {
    for (const Placements& to : all) {
      const std::string what = to_string(from) + " -> " + to_string(to);
      DTensor src = distribute_tensor(full, mesh, from);
      Tensor leaf = src.local().detach().requires_grad_();
      DTensor d = DTensor::from_local(leaf, mesh, from, full.shape());
      DTensor r = d.redistribute(to);
      require(r.placements() == to, what + ": placements");
      const Tensor local = r.local();
      bool partial = false;
      for (const Placement& q : to) partial = partial || q.is_partial();
      if (!partial) require_close(what + ": local part", local, expected_local(full, *mesh, to), 1e-6);
      Tensor whole = r.full_tensor();
      require_close(what + ": full_tensor", whole, full, 1e-5);
      (whole * c).sum().backward();
      Placements grad_as = from;
      for (Placement& q : grad_as) {
        if (q.is_partial()) q = Replicate();
      }
      require_close(what + ": gradient at the source", leaf.grad(),
                    expected_local(c, *mesh, grad_as), 1e-5);
    }
  }
}

TEST(DTensor, EveryRedistributePairOnFourRanksEvenAndUneven) {
  run_rank_threads(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    every_pair(mesh, {8, 12});  // even
    every_pair(mesh, {7, 6});   // uneven: chunks of 2, 2, 2, 1 and 2, 2, 2, 0
    every_pair(mesh, {3, 2});   // shorter than the mesh: empty shards
  }, kTimeout);
}

TEST(DTensor, EveryRedistributePairOnATwoByTwoMesh) {
  run_rank_threads(4, [](int) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    every_pair(mesh, {4, 6});
    every_pair(mesh, {5, 3});
  }, kTimeout);
}

TEST(DTensor, FromLocalDistributeAndRunCheck) {
  run_rank_threads(4, [](int r) {
    auto mesh = init_device_mesh("cpu", {4});
    // Even shards by default: each rank's [2, 3] is a quarter of [8, 3].
    DTensor d = DTensor::from_local(full({2, 3}, static_cast<double>(r)), mesh, {Shard(0)});
    require(d.shape() == Shape({8, 3}) && d.size(-2) == 8, "inferred global shape");
    const Tensor whole = d.full_tensor();
    for (int s = 0; s < 4; ++s) require_close("row block", whole.narrow(0, 2 * s, 2), full({2, 3}, s), 0);
    // Uneven, given the global shape: [7] as 2, 2, 2, 1.
    DTensor u = DTensor::from_local(ones({r == 3 ? 1 : 2}), mesh, {Shard(-1)}, Shape({7}), true);
    require(u.placements()[0] == Placement(Shard(0)), "Shard(-1) wrapped to Shard(0)");
    // run_check broadcasts a Replicate from the first rank.
    DTensor rep = DTensor::from_local(full({2}, static_cast<double>(r)), mesh, {Replicate()},
                                      std::nullopt, true);
    require_close("replicate synced", rep.local(), zeros({2}), 0);
    // The sync is not a gradient path: a Replicate's gradient stays whole on every rank.
    Tensor leaf = ones({3}).requires_grad_();
    DTensor::from_local(leaf, mesh, {Replicate()}, std::nullopt, true).to_local().sum().backward();
    require_close("run_check: the Replicate's gradient", leaf.grad(), ones({3}), 0);
    // distribute_tensor takes the first rank's data.
    DTensor dist = distribute_tensor(full({4}, static_cast<double>(r)), mesh, {Shard(0)});
    require_close("rank 0's data", dist.local(), zeros({1}), 0);
    require(dist.str().rfind("DTensor(float32 [4], (Shard(0),) on DeviceMesh(cpu, (4,)", 0) == 0,
            "str(): " + dist.str());
  }, kTimeout);
}

TEST(DTensor, ErrorsNameThePlacementsAndShapes) {
  run_rank_threads(2, [](int r) {
    auto mesh = init_device_mesh("cpu", {2}, {"tp"});
    expect_error([&] { DTensor::from_local(ones({2}), mesh, {Shard(0), Replicate()}); },
                 {"[DTensor.from_local] expected one placement per mesh dimension (1), got 2"});
    expect_error([&] { DTensor::from_local(ones({2}), mesh, {Shard(1)}); },
                 {"Shard(1) is out of range for a tensor of 1 dims"});
    expect_error([&] { DTensor::from_local(ones({3}), mesh, {Shard(0)}, Shape({4})); },
                 {"the local tensor has shape [3] but this rank's part of [4] placed (Shard(0),)",
                  "is [2]"});
    // Ranks that disagree on the global shape ([4] and [3]; each local shape fits its own
    // view): every rank throws, none is left waiting in its next collective.
    expect_error(
        [&] {
          DTensor::from_local(ones({r == 0 ? 2 : 1}), mesh, {Shard(0)}, Shape({4 - r}), true);
        },
        {"[DTensor.from_local] run_check: on mesh dimension 0 rank 1 gives the global shape [3] "
         "but rank 0 gives [4]"});
    // Agreeing on the shape, rank 1's local part is wrong: both ranks throw, naming rank 1,
    // though rank 0's own part is right.
    expect_error(
        [&] { DTensor::from_local(ones({r == 0 ? 2 : 1}), mesh, {Shard(0)}, Shape({4}), true); },
        {"run_check: rank 1 of mesh dimension 0 has local size 1 in dim 0 but its part of [4] ",
         "has 2"});
    // Local tensors of different dims.
    expect_error(
        [&] {
          DTensor::from_local(r == 0 ? ones({2}) : ones({2, 1}), mesh, {Replicate()}, std::nullopt,
                              true);
        },
        {"run_check: on mesh dimension 0 rank 1 has a local tensor of 2 dims"});
    auto mesh2 = init_device_mesh("cpu", {1, 2}, {"dp", "tp"});
    expect_error([&] { DTensor::from_local(ones({2, 2}), mesh2, {Shard(0), Shard(0)}); },
                 {"shard tensor dimension 0 over two mesh dimensions, which is not supported"});
    DTensor p = distribute_tensor(ones({2}), mesh, {Partial()});
    expect_error([&] { p.redistribute({Partial(ReduceOp::Max)}); },
                 {"[DTensor.redistribute] Partial(sum) -> Partial(max)"});
  }, kTimeout);
}

// Replicate -> Partial of each reduction the parts can hold (PyTorch's _partition_value): the
// parts reduce back to the value, from distribute_tensor and from redistribute, and for sum and
// avg the Replicate's gradient is the whole one. Product has no split and is refused.
TEST(DTensor, ReplicateToPartialOfEachReduction) {
  run_rank_threads(
      4,
      [](int) {
        auto mesh = init_device_mesh("cpu", {4});
        manual_seed(3);
        const Tensor x = randn({5, 3}), c = randn({5, 3});  // the same on every rank
        for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
          const std::string what = std::string("Partial(") + to_string(op) + ")";
          require_close(what + " from distribute_tensor",
                        distribute_tensor(x, mesh, {Partial(op)}).full_tensor(), x, 1e-6);
          Tensor leaf = x.clone().requires_grad_();
          const DTensor p =
              DTensor::from_local(leaf, mesh, {Replicate()}).redistribute({Partial(op)});
          require(p.placements()[0] == Placement(Partial(op)), what + ": placements");
          const Tensor whole = p.full_tensor();
          require_close(what + " from redistribute", whole, x, 1e-6);
          if (op == ReduceOp::Sum || op == ReduceOp::Avg) {
            (whole * c).sum().backward();
            require_close(what + ": the Replicate's gradient", leaf.grad(), c, 1e-5);
          }
        }
        expect_error(
            [&] { distribute_tensor(x, mesh, {Partial(ReduceOp::Product)}); },
            {"[distribute_tensor] Replicate -> Partial(product) on mesh dimension 0 is not "
             "supported"});
        expect_error(
            [&] {
              distribute_tensor(x, mesh, {Replicate()}).redistribute({Partial(ReduceOp::Product)});
            },
            {"[DTensor.redistribute] Replicate -> Partial(product)"});
      },
      kTimeout);
}

// A redistribute's backward owns its process group: a graph that outlives the mesh and the
// group it was built over (from_group with a wrapper) still runs backward.
TEST(DTensor, BackwardOutlivesTheMeshAndItsGroup) {
  run_rank_threads(
      2,
      [](int r) {
        Tensor leaf = full({2}, static_cast<double>(r + 1)).requires_grad_();
        Tensor loss;
        {
          auto g = std::make_shared<ForwardingProcessGroup>(default_group());
          auto mesh = DeviceMesh::from_group({g}, "cpu");
          loss = (DTensor::from_local(leaf, mesh, {Shard(0)}).full_tensor() * 3.0).sum();
        }
        loss.backward();
        require_close("gradient after the group is gone", leaf.grad(), full({2}, 3.0), 0);
      },
      kTimeout);
}

// The record of a tensor's placements keeps nothing alive: a recorded module output is freed
// with its last handle, and its record is then never found for another tensor.
TEST(DTensor, RecordsDoNotKeepTensorsAlive) {
  run_rank_threads(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    std::weak_ptr<TensorImpl> seen;
    {
      Tensor t = ones({4});
      register_dtensor(t, DTensor::from_local(t, mesh, {Shard(0)}));
      require(as_dtensor(t).has_value(), "recorded");
      seen = t.impl_ptr();
    }
    require(seen.expired(), "the record kept the tensor alive");
    require(!as_dtensor(ones({4})).has_value(), "an unrecorded tensor");
  }, kTimeout);
}

struct Mlp : nn::Module {
  std::shared_ptr<nn::Linear> fc1 = register_module("fc1", std::make_shared<nn::Linear>(8, 16));
  std::shared_ptr<nn::Linear> fc2 =
      register_module("fc2", std::make_shared<nn::Linear>(16, 8, /*bias=*/false));
  Tensor forward(const Tensor& x) override { return (*fc2)(relu((*fc1)(x))); }
};

std::shared_ptr<Mlp> seeded_mlp(uint64_t seed) {
  manual_seed(seed);
  return std::make_shared<Mlp>();
}

// distribute_module as a user writes Megatron's MLP with it: a partition that shards fc1 by
// rows and fc2 by columns, f before the forward and g after (dist::functional). At 4 rank
// threads the output and every parameter's gradient are the unsplit model's (1e-5); what the
// partition leaves is replicated from rank 0 and recorded, as is what it lays out.
TEST(DistributeModule, MegatronMlpFromAPartitionAndInputOutputFunctions) {
  const auto whole = seeded_mlp(1);
  manual_seed(2);
  const Tensor x = randn({5, 8});
  const Tensor y_ref = (*whole)(x);
  (y_ref * y_ref).sum().backward();
  run_rank_threads(4, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {4}, {"tp"});
    auto mlp = seeded_mlp(1);
    distribute_module(
        mlp, mesh,
        [](const std::string& name, nn::Module& m, const std::shared_ptr<DeviceMesh>& mesh) {
          if (name == "fc1") {
            auto& l = dynamic_cast<nn::Linear&>(m);
            distribute_parameter(l.weight, mesh, {Shard(0)});
            distribute_parameter(l.bias, mesh, {Shard(0)});
          } else if (name == "fc2") {
            distribute_parameter(dynamic_cast<nn::Linear&>(m).weight, mesh, {Shard(1)});
          }
        },
        [](nn::Module&, const Tensor& in, const std::shared_ptr<DeviceMesh>& mesh) {
          return functional::copy_to_group(in, mesh->get_group());
        },
        [](nn::Module&, const Tensor& out, const std::shared_ptr<DeviceMesh>& mesh) {
          return functional::reduce_from_group(out, mesh->get_group());
        });
    const Tensor y = (*mlp)(x);
    require_close("output", y, y_ref, 1e-5);
    (y * y).sum().backward();
    const nn::NamedTensors want = whole->named_parameters();
    const nn::NamedTensors got = mlp->named_parameters();
    for (size_t i = 0; i < got.size(); ++i) {
      const std::optional<DTensor> d = as_dtensor(got[i].second);
      require(d.has_value(), got[i].first + " is recorded");
      require_close(got[i].first + "'s gradient", got[i].second.grad(),
                    expected_local(want[i].second.grad(), *mesh, d->placements()), 1e-5);
    }
    require(as_dtensor(mlp->fc1->weight)->placements()[0].is_shard(0), "fc1 by rows");
    require(as_dtensor(mlp->fc2->weight)->placements()[0].is_shard(1), "fc2 by columns");
    (void)rank;
  }, kTimeout);
}

// Without a partition every parameter is replicated from each mesh dimension's first rank (the
// ranks' own values differ here) and recorded as Replicate; a null module or mesh is refused.
TEST(DistributeModule, DefaultReplicatesFromTheFirstRank) {
  const auto first = seeded_mlp(10);
  run_rank_threads(4, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    auto mlp = seeded_mlp(10 + static_cast<uint64_t>(rank));
    distribute_module(mlp, mesh);
    const nn::NamedTensors want = first->named_parameters();
    const nn::NamedTensors got = mlp->named_parameters();
    for (size_t i = 0; i < got.size(); ++i) {
      require_close(got[i].first, got[i].second, want[i].second, 0);
      const std::optional<DTensor> d = as_dtensor(got[i].second);
      require(d && d->placements()[0].is_replicate() && d->placements()[1].is_replicate(),
              got[i].first + " recorded as Replicate on both mesh dimensions");
    }
    expect_error([&] { distribute_module(nullptr, mesh); },
                 {"[distribute_module] expected a module, got null"});
    expect_error([&] { distribute_module(mlp, nullptr); },
                 {"[distribute_module] expected a mesh, got null"});
  }, kTimeout);
}

}  // namespace
}  // namespace ember::dist
