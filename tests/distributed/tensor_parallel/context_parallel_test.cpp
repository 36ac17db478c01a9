// Context parallelism as a user runs it: the sequence of q, k and v split over rank threads (or
// gloo processes) by context_parallel_shard, context_parallel_attention on each rank's part, and
// the parts' outputs and gradients equal to the ones of scaled_dot_product_attention over the
// whole sequence in one process, causal or not, load-balanced or not, keys and values all-gathered
// or sent round the ring, at 1 to 4 ranks.
#include <ember/distributed/tensor_parallel/context_parallel.h>

#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include <ember/autograd/autograd.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/ops.h>
#include <ember/tensor/ops/attention_parts.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops/random.h>
#include "tests/distributed/backends/threads_test_util.h"
#include "tests/distributed/ddp/ddp_test_util.h"

namespace ember::dist {
namespace {

using test::require;
using test::require_close;

// The whole sequences and one process's answer: the output and the gradients of a weighted sum
// of it (weights w, so every output element's gradient differs).
struct Whole {
  Tensor q, k, v, w, out, dq, dk, dv;
};

Whole whole(bool causal, Dtype dt = kFloat32, int64_t t = 48, int64_t ev = 8) {
  manual_seed(3);
  Whole s;
  s.q = randn({2, 3, t, 8}).to(dt);
  s.k = randn({2, 3, t, 8}).to(dt);
  s.v = randn({2, 3, t, ev}).to(dt);
  s.w = randn({2, 3, t, ev}).to(dt);
  Tensor q = s.q.detach().requires_grad_(), k = s.k.detach().requires_grad_(),
         v = s.v.detach().requires_grad_();
  s.out = scaled_dot_product_attention(q, k, v, {}, 0.0, causal);
  (s.out * s.w).sum().backward();
  s.out = s.out.detach();
  s.dq = q.grad();
  s.dk = k.grad();
  s.dv = v.grad();
  return s;
}

// On every rank of `n` threads (on `device`): its parts of q, k, v train through
// context_parallel_attention; its output and gradients are its parts of the whole's, and the
// output's parts put back together are the whole output.
void run_case(int n, bool causal, bool balanced, ContextParallelRotate rotate, Device device = kCPU,
              Dtype dt = kFloat32, double tol = 2e-5, int64_t ev = 8) {
  const Whole s = whole(causal, dt, 48, ev);
  test::ThreadsSetup setup;
  setup.n = n;
  setup.device = device;
  const std::string what = std::to_string(n) + " ranks, " + (causal ? "causal" : "not causal") +
                           (balanced ? ", load-balanced" : "") +
                           (rotate == ContextParallelRotate::Ring ? ", ring" : ", all-gather");
  test::run_threads(setup, [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto part = [&](const Tensor& t) {
      return context_parallel_shard(t, 2, rank, n, balanced).to(device);
    };
    Tensor q = part(s.q).requires_grad_(), k = part(s.k).requires_grad_(),
           v = part(s.v).requires_grad_();
    const Tensor out = context_parallel_attention(
        q, k, v, pg, {.is_causal = causal, .load_balance = balanced, .rotate = rotate});
    const std::string at = what + ", rank " + std::to_string(rank);
    require(out.device() == device && out.dtype() == dt, at + ": output's device and dtype");
    require_close(at + " out", out.cpu(), part(s.out).cpu(), tol);
    (out * part(s.w)).sum().backward();
    require_close(at + " dq", q.grad().cpu(), part(s.dq).cpu(), tol);
    require_close(at + " dk", k.grad().cpu(), part(s.dk).cpu(), tol);
    require_close(at + " dv", v.grad().cpu(), part(s.dv).cpu(), tol);
    require_close(at + " unsharded out",
                  context_parallel_unshard(out.detach(), 2, pg, balanced).cpu(), s.out, tol);
  });
}

// Two gloo processes over shared memory, as under emberrun, with keys and values strided as a
// model's head split leaves them. First in the file, so that a run of the whole binary forks
// before any case started a kernel's or BLAS's threads; each child computes the whole after the
// fork.
TEST(ContextParallelGloo, TwoProcesses) {
  test::run_gloo_ranks(2, [&](std::shared_ptr<ProcessGroupGloo> pg, int rank) {
    const Whole s = whole(true);
    auto part = [&](const Tensor& t) { return context_parallel_shard(t, 2, rank, 2); };
    for (ContextParallelRotate rotate :
         {ContextParallelRotate::AllGather, ContextParallelRotate::Ring}) {
      const std::string what = rotate == ContextParallelRotate::Ring ? "ring " : "all-gather ";
      // [B, T, H, D] leaves, attended as [B, H, T, D] views.
      auto heads_last = [&](const Tensor& t) {
        return part(t).transpose(1, 2).contiguous().requires_grad_();
      };
      Tensor q = heads_last(s.q), k = heads_last(s.k), v = heads_last(s.v);
      ASSERT_FALSE(k.transpose(1, 2).is_contiguous());
      const Tensor out = context_parallel_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                    v.transpose(1, 2), pg, {.rotate = rotate});
      require_close(what + "out", out, part(s.out), 2e-5);
      (out * part(s.w)).sum().backward();
      require_close(what + "dq", q.grad().transpose(1, 2), part(s.dq), 2e-5);
      require_close(what + "dk", k.grad().transpose(1, 2), part(s.dk), 2e-5);
      require_close(what + "dv", v.grad().transpose(1, 2), part(s.dv), 2e-5);
    }
  });
}

class ContextParallel
    : public ::testing::TestWithParam<std::tuple<int, bool, bool, ContextParallelRotate>> {};

TEST_P(ContextParallel, PartsEqualTheWholeSequencesAttention) {
  const auto [n, causal, balanced, rotate] = GetParam();
  run_case(n, causal, balanced, rotate);
}

INSTANTIATE_TEST_SUITE_P(
    Ranks, ContextParallel,
    ::testing::Combine(::testing::Values(1, 2, 3, 4), ::testing::Bool(), ::testing::Bool(),
                       ::testing::Values(ContextParallelRotate::AllGather,
                                         ContextParallelRotate::Ring)),
    [](const auto& info) {
      return "n" + std::to_string(std::get<0>(info.param)) +
             (std::get<1>(info.param) ? "_causal" : "_full") +
             (std::get<2>(info.param) ? "_balanced" : "_contiguous") +
             (std::get<3>(info.param) == ContextParallelRotate::Ring ? "_ring" : "_allgather");
    });

// Values of another head dim than the keys', and bfloat16 (the CPU kernels compute in float32;
// the blocks are combined in float32).
TEST(ContextParallelShapes, ValueHeadDimOfItsOwn) {
  for (auto rotate : {ContextParallelRotate::AllGather, ContextParallelRotate::Ring})
    run_case(2, true, true, rotate, kCPU, kFloat32, 2e-5, 4);
}
TEST(ContextParallelShapes, Bfloat16) {
  for (auto rotate : {ContextParallelRotate::AllGather, ContextParallelRotate::Ring}) {
    for (int n : {2, 3}) run_case(n, true, true, rotate, kCPU, kBFloat16, 2e-2);
  }
}

// On one GPU, each rank thread on its own stream: float32 through Ember's kernels, bfloat16
// through cuDNN's flash attention where it takes the call.
TEST(ContextParallelCuda, FourRankThreadsOnOneGpu) {
  if (!cuda::is_available()) GTEST_SKIP() << "needs a CUDA device";
  for (auto rotate : {ContextParallelRotate::AllGather, ContextParallelRotate::Ring}) {
    run_case(4, true, true, rotate, cuda_device(0), kFloat32, 1e-4);
    run_case(2, true, true, rotate, cuda_device(0), kBFloat16, 3e-2);
  }
}

template <typename F>
void expect_error(const F& f, const std::string& text) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing: " << text;
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

TEST(ContextParallelErrors, RefusedWithClearMessages) {
  const Tensor t = randn({1, 2, 12, 4});
  expect_error([&] { context_parallel_shard(t, 2, 0, 4); },
               "[context_parallel_shard] dim 2 of size 12 does not divide into 8 chunks (4 ranks, "
               "two chunks each for the load balance)");
  expect_error([&] { context_parallel_shard(t, 2, 2, 2); },
               "[context_parallel_shard] expected a rank in [0, 2), got 2");
  expect_error([&] { context_parallel_shard(t, 5, 0, 2); },
               "[context_parallel_shard] dim 5 is out of range for a tensor of 4 dims");
  test::ThreadsSetup setup;
  test::run_threads(setup, [&](std::shared_ptr<ProcessGroup> pg, int) {
    const Tensor odd = randn({1, 2, 3, 4}), even = randn({1, 2, 4, 4});
    expect_error([&] { context_parallel_attention(odd, odd, odd, pg); },
                 "[context_parallel_attention] this rank's part of 3 positions does not hold the "
                 "two equal chunks of a load-balanced part");
    expect_error(
        [&] {
          context_parallel_attention(even, randn({1, 2, 6, 4}), even, pg);
        },
        "[context_parallel_attention] expected query, key and value of one rank >= 2 "
        "holding this rank's part of one sequence");
    expect_error([&] { context_parallel_attention(even, even, even, nullptr); },
                 "[context_parallel_attention] expected a process group, got null");
  });
}

// A rank that never joins the ring: the others' sends and receives time out within the group's
// timeout, naming the operation, the rank and its peer, instead of waiting forever.
TEST(ContextParallelErrors, ARankMissingFromTheRingFailsTheOthersWithinTheTimeout) {
  test::ThreadsSetup setup;
  setup.n = 3;
  setup.timeout = std::chrono::milliseconds(500);
  std::vector<std::string> errors(3);
  test::run_threads(setup, [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    if (rank == 2) return;
    const Tensor t = randn({1, 2, 4, 4});
    try {
      context_parallel_attention(t, t, t, pg, {.rotate = ContextParallelRotate::Ring});
    } catch (const std::exception& e) {
      errors[rank] = e.what();
    }
  });
  EXPECT_NE(errors[0].find("recv #1 on rank 0 of 3 from rank 2 (tag 0) timed out after 500 ms"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("on rank 1 of 3 to rank 2 (tag 0) timed out after 500 ms"),
            std::string::npos)
      << errors[1];
  for (int r : {0, 1})
    EXPECT_NE(errors[r].find("rank(s) 2 did not call the matching send/recv"), std::string::npos)
        << errors[r];
}

// The parts as plain ops: the forward's lse is the logsumexp of the scaled scores; two key
// blocks combined by it are the whole attention, and their backward calls with the combined
// output and lse sum to the whole's gradients.
TEST(AttentionParts, BlocksCombineToTheWholeAttentionForwardAndBackward) {
  manual_seed(9);
  const Tensor q = randn({2, 5, 6}), k = randn({2, 7, 6}), v = randn({2, 7, 3});
  const double scale = 0.3;
  const AttentionForward f = scaled_dot_product_attention_forward(q, k, v, false, scale);
  const Tensor scores = matmul(q, k.transpose(-2, -1)) * scale;
  require_close("lse", f.lse, logsumexp(scores, {-1}), 1e-5);
  require_close("out", f.out, scaled_dot_product_attention(q, k, v, {}, 0.0, false, scale), 1e-5);
  const AttentionForward a =
      scaled_dot_product_attention_forward(q, k.narrow(1, 0, 3), v.narrow(1, 0, 3), false, scale);
  const AttentionForward b =
      scaled_dot_product_attention_forward(q, k.narrow(1, 3, 4), v.narrow(1, 3, 4), false, scale);
  const Tensor lse = logsumexp(stack({a.lse, b.lse}, 0), {0});
  const Tensor out =
      a.out * exp(a.lse - lse).unsqueeze(-1) + b.out * exp(b.lse - lse).unsqueeze(-1);
  require_close("combined out", out, f.out, 1e-5);
  require_close("combined lse", lse, f.lse, 1e-5);
  const Tensor dout = randn({2, 5, 3});
  const AttentionGrads whole =
      scaled_dot_product_attention_backward(dout, q, k, v, f.out, f.lse, false, scale);
  Tensor qa = q.detach().requires_grad_(), ka = k.detach().requires_grad_(),
         va = v.detach().requires_grad_();
  (scaled_dot_product_attention(qa, ka, va, {}, 0.0, false, scale) * dout).sum().backward();
  require_close("dq", whole.dq, qa.grad(), 1e-5);
  require_close("dk", whole.dk, ka.grad(), 1e-5);
  require_close("dv", whole.dv, va.grad(), 1e-5);
  const AttentionGrads ga = scaled_dot_product_attention_backward(
      dout, q, k.narrow(1, 0, 3), v.narrow(1, 0, 3), out, lse, false, scale);
  const AttentionGrads gb = scaled_dot_product_attention_backward(
      dout, q, k.narrow(1, 3, 4), v.narrow(1, 3, 4), out, lse, false, scale);
  require_close("blocks' dq", ga.dq + gb.dq, whole.dq, 1e-5);
  require_close("blocks' dk", cat({ga.dk, gb.dk}, 1), whole.dk, 1e-5);
  require_close("blocks' dv", cat({ga.dv, gb.dv}, 1), whole.dv, 1e-5);
  expect_error(
      [&] {
        scaled_dot_product_attention_backward(dout, q, k, v, f.out, randn({2, 4}), false);
      },
      "[scaled_dot_product_attention_backward] expected lse of shape [2, 5] on cpu, got "
      "[2, 4] on cpu");
  expect_error(
      [&] {
        scaled_dot_product_attention_forward(q, randn({2, 7, 5}), v);
      },
      "[scaled_dot_product_attention_forward] last dim of key must equal last dim of "
      "query");
}

}  // namespace
}  // namespace ember::dist
