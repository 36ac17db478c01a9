// The DTensor ops' sharding rules: each rule's result, and the gradient each argument's local
// tensor gets, against the same op on whole tensors in one process (4 rank threads, uneven
// sizes where the rule allows them); the rules' errors.
#include <ember/distributed/dtensor/ops.h>

#include <gtest/gtest.h>

#include <ember/autograd/autograd.h>
#include <ember/distributed/backends/process_group_threads.h>
#include <ember/distributed/init.h>
#include <ember/nn/functional.h>
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
using test::shard_of;

constexpr Duration kTimeout = 60s;

struct Arg {
  Tensor full;
  Placements placements;
};

// Runs `dop` on DTensors made of `args` and `op` on the whole tensors; checks the result's
// placements, its full tensor, and every argument's gradient (loss: sum(result * c)).
void check(const std::string& what, const std::shared_ptr<DeviceMesh>& mesh,
           const std::vector<Arg>& args, const Placements& want,
           const std::function<DTensor(const std::vector<DTensor>&)>& dop,
           const std::function<Tensor(const std::vector<Tensor>&)>& op, double tol = 1e-5) {
  std::vector<Tensor> wholes, leaves;
  std::vector<DTensor> ds;
  for (const Arg& a : args) {
    const bool grad = a.full.is_floating_point();
    Tensor w = a.full.clone();
    if (grad) w.requires_grad_();
    wholes.push_back(w);
    Tensor local = distribute_tensor(a.full, mesh, a.placements).local().detach();
    if (grad) local.requires_grad_();
    leaves.push_back(local);
    ds.push_back(DTensor::from_local(local, mesh, a.placements, a.full.shape()));
  }
  const Tensor y = op(wholes);
  const DTensor dy = dop(ds);
  require(dy.placements() == want, what + ": placements " + to_string(dy.placements()) +
                                       ", expected " + to_string(want));
  require(dy.shape() == y.shape(), what + ": global shape");
  manual_seed(99);
  const Tensor c = randn(y.shape());
  const Tensor got = dy.full_tensor();
  require_close(what + ": value", got, y, tol);
  (y * c).sum().backward();
  (got * c).sum().backward();
  for (size_t i = 0; i < args.size(); ++i) {
    if (!wholes[i].requires_grad()) continue;
    require_close(what + ": gradient of argument " + std::to_string(i), leaves[i].grad(),
                  shard_of(wholes[i].grad(), *mesh, args[i].placements), tol);
  }
}

Tensor rnd(IntList shape, uint64_t seed) {
  manual_seed(seed);
  return randn(shape);
}

const Placement R = Replicate();
const Placement P = Partial();
Placement S(int64_t d) { return Shard(d); }

TEST(DTensorOps, LinearColumnRowBatchAndPartial) {
  run_rank_threads(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    const Tensor x = rnd({3, 5, 8}, 1), w = rnd({12, 8}, 2), b = rnd({12}, 3);
    auto dlin = [](const std::vector<DTensor>& a) { return linear(a[0], a[1], a[2]); };
    auto lin = [](const std::vector<Tensor>& a) { return nn::functional::linear(a[0], a[1], a[2]); };
    check("column parallel", mesh, {{x, {R}}, {w, {S(0)}}, {b, {S(0)}}}, {S(2)}, dlin, lin);
    const Tensor w2 = rnd({6, 8}, 4), b2 = rnd({6}, 5);
    check("row parallel", mesh, {{x, {S(-1)}}, {w2, {S(1)}}, {b2, {R}}}, {P}, dlin, lin);
    check("sequence sharded", mesh, {{x, {S(1)}}, {w2, {R}}, {b2, {R}}}, {S(1)}, dlin, lin);
    check("replicated", mesh, {{x, {R}}, {w2, {R}}, {b2, {R}}}, {R}, dlin, lin);
    check("partial input", mesh, {{x, {P}}, {w2, {R}}, {b2, {R}}}, {P}, dlin, lin);
    // Uneven: 7 output features over 4 ranks.
    const Tensor w7 = rnd({7, 8}, 6), b7 = rnd({7}, 7);
    check("column parallel, uneven", mesh, {{x, {R}}, {w7, {S(0)}}, {b7, {S(0)}}}, {S(2)}, dlin,
          lin);
  }, kTimeout);
}

TEST(DTensorOps, MatmulRules) {
  run_rank_threads(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    const Tensor a = rnd({4, 6, 8}, 1), b = rnd({4, 8, 5}, 2);
    auto dmm = [](const std::vector<DTensor>& v) { return matmul(v[0], v[1]); };
    auto mm = [](const std::vector<Tensor>& v) { return ember::matmul(v[0], v[1]); };
    check("rows", mesh, {{a, {S(1)}}, {b, {R}}}, {S(1)}, dmm, mm);
    check("columns", mesh, {{a, {R}}, {b, {S(2)}}}, {S(2)}, dmm, mm);
    check("inner", mesh, {{a, {S(2)}}, {b, {S(1)}}}, {P}, dmm, mm);
    check("batch", mesh, {{a, {S(0)}}, {b, {S(0)}}}, {S(0)}, dmm, mm);
    // A batch dim of a sharded, b replicated: each rank narrows b to its batches, unless b
    // broadcasts them. Even, uneven (3 batches on 4 ranks: one rank has none), broadcast.
    check("batch of a, b replicated", mesh, {{a, {S(0)}}, {b, {R}}}, {S(0)}, dmm, mm);
    const Tensor a3 = rnd({3, 6, 8}, 3), b3 = rnd({3, 8, 5}, 4), b1 = rnd({1, 8, 5}, 5);
    check("batch of a, b replicated, uneven", mesh, {{a3, {S(0)}}, {b3, {R}}}, {S(0)}, dmm, mm);
    check("batch of a, b broadcast", mesh, {{a3, {S(0)}}, {b1, {R}}}, {S(0)}, dmm, mm);
    // A batch dim that a broadcasts cannot be a's shard of the output.
    const Tensor a1 = rnd({1, 6, 8}, 6);
    expect_error(
        [&] { matmul(distribute_tensor(a1, mesh, {S(0)}), distribute_tensor(b, mesh, {R})); },
        {"[dist::matmul] no sharding rule for a (Shard(0),), b (Replicate(),)"});
  }, kTimeout);
}

TEST(DTensorOps, ElementwiseRulesWithBroadcasting) {
  run_rank_threads(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    const Tensor x = rnd({3, 6, 8}, 1), y = rnd({3, 6, 8}, 2), bias = rnd({8}, 3),
                 pos = rnd({6, 8}, 4);
    auto dadd = [](const std::vector<DTensor>& v) { return add(v[0], v[1]); };
    auto tadd = [](const std::vector<Tensor>& v) { return v[0] + v[1]; };
    check("shard + shard", mesh, {{x, {S(1)}}, {y, {S(1)}}}, {S(1)}, dadd, tadd);
    check("shard(seq) + replicate [T, C]", mesh, {{x, {S(1)}}, {pos, {R}}}, {S(1)}, dadd, tadd);
    check("shard(seq) + replicate [C]", mesh, {{x, {S(1)}}, {bias, {R}}}, {S(1)}, dadd, tadd);
    check("shard(hidden) + replicate [C]", mesh, {{x, {S(2)}}, {bias, {R}}}, {S(2)}, dadd, tadd);
    check("partial + partial", mesh, {{x, {P}}, {y, {P}}}, {P}, dadd, tadd);
    auto dmul = [](const std::vector<DTensor>& v) { return mul(v[0], v[1]); };
    auto tmul = [](const std::vector<Tensor>& v) { return v[0] * v[1]; };
    check("partial * replicate", mesh, {{x, {P}}, {y, {R}}}, {P}, dmul, tmul);
    check("replicate * shard", mesh, {{x, {R}}, {y, {S(0)}}}, {S(0)}, dmul, tmul);
    auto dgelu = [](const std::vector<DTensor>& v) {
      return map(v[0], [](const Tensor& t) { return gelu(t, "tanh"); }, "gelu");
    };
    auto tgelu = [](const std::vector<Tensor>& v) { return gelu(v[0], "tanh"); };
    check("gelu on a shard", mesh, {{x, {S(2)}}}, {S(2)}, dgelu, tgelu);
  }, kTimeout);
}

TEST(DTensorOps, EmbeddingVocabularyAndColumnParallel) {
  run_rank_threads(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    manual_seed(5);
    const Tensor ids = randint(0, 10, {3, 5}), w = rnd({10, 6}, 6);  // 10 rows: 3, 3, 3, 1
    auto demb = [](const std::vector<DTensor>& v) { return embedding(v[0], v[1]); };
    auto temb = [](const std::vector<Tensor>& v) { return nn::functional::embedding(v[0], v[1]); };
    check("vocabulary parallel", mesh, {{ids, {R}}, {w, {S(0)}}}, {P}, demb, temb);
    check("column parallel", mesh, {{ids, {R}}, {w, {S(1)}}}, {S(2)}, demb, temb);
    check("sequence sharded ids", mesh, {{ids, {S(1)}}, {w, {R}}}, {S(1)}, demb, temb);
  }, kTimeout);
}

TEST(DTensorOps, LayerNormDropoutSoftmaxSumAndViews) {
  run_rank_threads(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4});
    const Tensor x = rnd({2, 8, 12}, 1), g = rnd({12}, 2), b = rnd({12}, 3);
    check("layer_norm, sequence sharded", mesh, {{x, {S(1)}}, {g, {R}}, {b, {R}}}, {S(1)},
          [](const std::vector<DTensor>& v) { return layer_norm(v[0], {12}, v[1], v[2]); },
          [](const std::vector<Tensor>& v) { return ember::layer_norm(v[0], {12}, v[1], v[2]); });
    // Dropout on a shard draws the mask one process would: same seed, same result.
    check("dropout, sequence sharded", mesh, {{x, {S(1)}}}, {S(1)},
          [](const std::vector<DTensor>& v) {
            manual_seed(42);
            return dropout(v[0], 0.3);
          },
          [](const std::vector<Tensor>& v) {
            manual_seed(42);
            return nn::functional::dropout(v[0], 0.3);
          });
    check("softmax over an unsharded dim", mesh, {{x, {S(1)}}}, {S(1)},
          [](const std::vector<DTensor>& v) { return softmax(v[0], -1); },
          [](const std::vector<Tensor>& v) { return ember::softmax(v[0], -1); });
    check("sum over the sharded dim", mesh, {{x, {S(1)}}}, {P},
          [](const std::vector<DTensor>& v) { return sum(v[0], {1}); },
          [](const std::vector<Tensor>& v) { return ember::sum(v[0], {1}); });
    check("sum over another dim", mesh, {{x, {S(1)}}}, {S(0)},
          [](const std::vector<DTensor>& v) { return sum(v[0], {0}); },
          [](const std::vector<Tensor>& v) { return ember::sum(v[0], {0}); });
    // Heads: [B, T, C] sharded on C -> [B, T, H, D] sharded on H, then H moved forward.
    check("reshape into heads, transpose", mesh, {{x, {S(2)}}}, {S(1)},
          [](const std::vector<DTensor>& v) { return transpose(reshape(v[0], {2, 8, 4, 3}), 1, 2); },
          [](const std::vector<Tensor>& v) { return v[0].reshape({2, 8, 4, 3}).transpose(1, 2); });
  }, kTimeout);
}

// Meshes compare by value: a sub-mesh taken twice is two objects but one mesh, so DTensors on
// each meet in an op.
TEST(DTensorOps, ASubMeshTakenTwiceIsTheSameMesh) {
  run_rank_threads(
      2,
      [](int) {
        auto mesh = init_device_mesh("cpu", {1, 2}, {"dp", "tp"});
        DTensor x = distribute_tensor(ones({5}), (*mesh)["tp"], {S(0)});
        DTensor y = distribute_tensor(full({5}, 2.0), (*mesh)["tp"], {S(0)});
        require_close("x + y", add(x, y).full_tensor(), full({5}, 3.0), 0);
        DTensor z = distribute_tensor(ones({5}), (*mesh)["dp"], {R});
        expect_error([&] { add(x, z); }, {"[dist::add] the arguments are on different meshes"});
      },
      kTimeout);
}

TEST(DTensorOps, OpsWithoutARuleNameTheOpAndThePlacements) {
  run_rank_threads(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    DTensor x = distribute_tensor(ones({4, 6}), mesh, {S(0)});
    DTensor w = distribute_tensor(ones({6, 6}), mesh, {S(0)});
    expect_error([&] { linear(x, w); },
                 {"[dist::linear] no sharding rule for x (Shard(0),), weight (Shard(0),) on mesh "
                  "dimension 0", "Redistribute the arguments first"});
    expect_error([&] { softmax(x, 0); }, {"[dist::softmax] no sharding rule", "loss_parallel"});
    DTensor p = distribute_tensor(ones({4, 6}), mesh, {P});
    expect_error([&] { dropout(p, 0.5); }, {"[dist::dropout] no sharding rule for x (Partial(sum),)"});
    expect_error([&] { add(p, distribute_tensor(ones({4, 6}), mesh, {R})); },
                 {"[dist::add] no sharding rule for a (Partial(sum),), b (Replicate(),)"});
    expect_error([&] { map(p, [](const Tensor& t) { return t * t; }, "square"); },
                 {"[dist::square] no sharding rule", "not linear"});
    // Only sum and avg partials commute with add and linear maps: the max of the parts' sums
    // is not the sum of their maxima.
    DTensor pmax = distribute_tensor(ones({4, 6}), mesh, {Partial(ReduceOp::Max)});
    expect_error([&] { add(pmax, pmax); },
                 {"[dist::add] no sharding rule for a (Partial(max),), b (Partial(max),)"});
    expect_error(
        [&] {
          map(
              pmax, [](const Tensor& t) { return -t; }, "neg", true);
        },
        {"[dist::neg] no sharding rule", "only a Partial(sum) or Partial(avg)"});
    DTensor pavg = distribute_tensor(ones({4, 6}), mesh, {Partial(ReduceOp::Avg)});
    require_close("avg + avg", add(pavg, pavg).full_tensor(), full({4, 6}, 2.0), 0);
    // Columns sharded: flattening [4, 6] interleaves the ranks' parts.
    DTensor cols = distribute_tensor(ones({4, 6}), mesh, {S(1)});
    expect_error([&] { reshape(cols, {24}); },
                 {"[dist::reshape] no sharding rule", "not at its outer end"});
  }, kTimeout);
}

}  // namespace
}  // namespace ember::dist
