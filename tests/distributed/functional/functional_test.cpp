// dist::functional: each differentiable collective's forward (all_to_all_single with uneven
// splits among them) against closed forms and its backward against the adjoint collective's
// closed form, at 4 rank threads; Megatron's column- then row-parallel MLP written with
// copy_to_group / reduce_from_group equals the same MLP on one rank, outputs and gradients; the
// errors.
#include <ember/distributed/functional/collectives.h>

#include <gtest/gtest.h>

#include <ember/autograd/autograd.h>
#include <ember/distributed/backends/process_group_threads.h>
#include <ember/distributed/init.h>
#include <ember/nn/functional.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops/indexing.h>
#include <ember/tensor/ops.h>
#include <ember/tensor/ops/random.h>
#include "tests/distributed/ddp/ddp_test_util.h"
#include "tests/distributed/store/store_test_util.h"

namespace ember::dist {
namespace {

using namespace std::chrono_literals;
using test::expect_error;
using test::require;
using test::require_close;
namespace F = functional;

constexpr int kRanks = 4;
constexpr Duration kTimeout = 60s;

Tensor leaf(Tensor t) { return t.requires_grad_(); }
// A rank-dependent weight, so the loss's gradient differs per rank: loss = sum(y * (r + 1)).
Tensor weighted_loss(const Tensor& y, int r) { return (y * static_cast<double>(r + 1)).sum(); }
Tensor f32(const std::vector<float>& v, IntList shape) { return from_vector(v, shape); }

TEST(Functional, AllReduceSumsForwardAndBackward) {
  run_rank_threads(kRanks, [](int r) {
    Tensor x = leaf(full({3}, static_cast<double>(r + 1)));
    Tensor y = F::all_reduce(x);
    require_close("all_reduce", y, full({3}, 10.0), 0);
    weighted_loss(y, r).backward();
    // d/dx_r of sum_s (s+1) * sum(all_reduce(x)) = sum_s (s + 1) = 10.
    require_close("all_reduce grad", x.grad(), full({3}, 10.0), 0);
    Tensor m = leaf(full({2}, static_cast<double>(r)));
    Tensor mean = F::all_reduce(m, ReduceOp::Avg);
    require_close("avg", mean, full({2}, 1.5), 0);
    weighted_loss(mean, r).backward();
    require_close("avg grad", m.grad(), full({2}, 2.5), 0);  // the mean of 1, 2, 3, 4
  }, kTimeout);
}

TEST(Functional, AllGatherAlongADimAndItsReduceScatterBackward) {
  run_rank_threads(kRanks, [](int r) {
    Tensor x = leaf(full({2, 3}, static_cast<double>(r)));
    Tensor y = F::all_gather(x, 1);
    require(y.shape() == Shape({2, 12}), "gathered shape");
    for (int s = 0; s < kRanks; ++s) {
      require_close("block " + std::to_string(s), y.narrow(1, 3 * s, 3), full({2, 3}, s), 0);
    }
    weighted_loss(y, r).backward();
    // Each rank's gradient of its own block, summed over ranks: 1 + 2 + 3 + 4.
    require_close("all_gather grad", x.grad(), full({2, 3}, 10.0), 0);
  }, kTimeout);
}

TEST(Functional, ReduceScatterAndItsAllGatherBackward) {
  run_rank_threads(kRanks, [](int r) {
    // x_r[i] = i + r: block b of the sum over ranks is sum_r (i + r) = 4i + 6 for i in block b.
    Tensor x = leaf(arange(0, 8, 1, TensorOptions(kFloat32)) + static_cast<double>(r));
    Tensor y = F::reduce_scatter(x, 0);
    require_close("reduce_scatter", y,
                  f32({4.0f * (2 * r) + 6, 4.0f * (2 * r + 1) + 6}, {2}), 0);
    weighted_loss(y, r).backward();
    // x_r's element in block b gets rank b's weight b + 1.
    require_close("reduce_scatter grad", x.grad(), f32({1, 1, 2, 2, 3, 3, 4, 4}, {8}), 0);
  }, kTimeout);
}

TEST(Functional, AllToAllAndTheReverseInBackward) {
  run_rank_threads(kRanks, [](int r) {
    // Row j of rank r's [4, 2] input is 10r + j; rank r receives row r of every rank s.
    Tensor x = leaf((arange(0, 4, 1, TensorOptions(kFloat32)) + 10.0 * r).reshape({4, 1}) *
                    ones({1, 2}));
    Tensor y = F::all_to_all(x, 0, 0);
    Tensor want = ((arange(0, 4, 1, TensorOptions(kFloat32)) * 10.0 + r).reshape({4, 1}) *
                   ones({1, 2}));
    require_close("all_to_all", y, want, 0);
    weighted_loss(y, r).backward();
    // Row j went to rank j, whose weight is j + 1.
    require_close("all_to_all grad", x.grad(),
                  (arange(1, 5, 1, TensorOptions(kFloat32))).reshape({4, 1}) * ones({1, 2}), 0);
  }, kTimeout);
}

TEST(Functional, AllToAllSingleWithUnevenSplitsAndTheReverseInBackward) {
  run_rank_threads(
      kRanks,
      [](int r) {
        // Rank r sends (r + d) % 3 rows to rank d (none to some), row i of them 100 r + 10 d + i.
        auto count = [](int from, int to) { return static_cast<int64_t>((from + to) % 3); };
        std::vector<int64_t> in_sizes, out_sizes;
        std::vector<float> rows, want, want_grad;
        for (int d = 0; d < kRanks; ++d) {
          in_sizes.push_back(count(r, d));
          out_sizes.push_back(count(d, r));
          for (int64_t i = 0; i < count(r, d); ++i) {
            rows.push_back(static_cast<float>(100 * r + 10 * d + i));
            want_grad.push_back(static_cast<float>(d + 1));  // rank d's loss weight
          }
          for (int64_t i = 0; i < count(d, r); ++i)
            want.push_back(static_cast<float>(100 * d + 10 * r + i));
        }
        const int64_t n = static_cast<int64_t>(rows.size()), m = static_cast<int64_t>(want.size());
        Tensor x = leaf(f32(rows, {n, 1}) * ones({1, 3}));
        Tensor y = F::all_to_all_single(x, out_sizes, in_sizes);
        require_close("all_to_all_single", y, f32(want, {m, 1}) * ones({1, 3}), 0);
        weighted_loss(y, r).backward();
        require_close("all_to_all_single grad", x.grad(), f32(want_grad, {n, 1}) * ones({1, 3}), 0);
      },
      kTimeout);
}

TEST(Functional, BroadcastAndItsReduceToTheSource) {
  run_rank_threads(kRanks, [](int r) {
    Tensor x = leaf(full({2}, static_cast<double>(r)));
    Tensor y = F::broadcast(x, 1);
    require_close("broadcast", y, full({2}, 1.0), 0);
    weighted_loss(y, r).backward();
    require_close("broadcast grad", x.grad(), full({2}, r == 1 ? 10.0 : 0.0), 0);
  }, kTimeout);
}

// Megatron's MLP: w1 split by output columns, w2 by input rows, f before and g after. Each rank
// holds a quarter of each weight; the output and every gradient equal the one-rank MLP's.
TEST(Functional, MegatronMlpEqualsTheUnsplitMlp) {
  manual_seed(3);
  const Tensor x0 = randn({5, 8}), w1 = randn({16, 8}) * 0.3, w2 = randn({8, 16}) * 0.3;
  Tensor xf = leaf(x0.clone()), w1f = leaf(w1.clone()), w2f = leaf(w2.clone());
  Tensor yf = nn::functional::linear(gelu(nn::functional::linear(xf, w1f)), w2f);
  (yf * yf).sum().backward();
  run_rank_threads(kRanks, [&](int r) {
    Tensor x = leaf(x0.clone());
    Tensor a = leaf(w1.narrow(0, 4 * r, 4).clone());  // [4, 8]: this rank's hidden units
    Tensor b = leaf(w2.narrow(1, 4 * r, 4).clone());  // [8, 4]: their outgoing weights
    Tensor h = gelu(nn::functional::linear(F::copy_to_group(x), a));
    Tensor y = F::reduce_from_group(nn::functional::linear(h, b));
    require_close("output", y, yf, 1e-5);
    (y * y).sum().backward();
    require_close("x grad", x.grad(), xf.grad(), 1e-5);
    require_close("w1 grad", a.grad(), w1f.grad().narrow(0, 4 * r, 4), 1e-5);
    require_close("w2 grad", b.grad(), w2f.grad().narrow(1, 4 * r, 4), 1e-5);
  }, kTimeout);
}

TEST(Functional, ErrorsNameTheOpAndTheSizes) {
  run_rank_threads(2, [](int) {
    expect_error([] { F::reduce_scatter(ones({3}), 0); },
                 {"[reduce_scatter] dim 0 of size 3 (shape [3]) is not divisible by the "
                  "group's 2 ranks"});
    expect_error([] { F::all_gather(ones({3}), 2); },
                 {"[all_gather] dim 2 is out of range for a tensor of 1 dims"});
    expect_error([] { F::broadcast(ones({3}), 5); }, {"[broadcast] src 5 is not a rank"});
    Tensor x = leaf(ones({2}));
    Tensor y = F::all_reduce(x, ReduceOp::Max);
    expect_error([&] { y.sum().backward(); }, {"[all_reduce] the gradient of a max reduction"});
  }, kTimeout);
}

}  // namespace
}  // namespace ember::dist
