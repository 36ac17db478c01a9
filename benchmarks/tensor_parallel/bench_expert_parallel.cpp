// Expert parallelism measured (docs/tensor_parallel.md, docs/benchmarks.md): a mixture-of-experts
// layer's forward and backward (--experts SwiGLU experts of width --dim and hidden --hidden,
// top --top-k, float32) over --tokens tokens per rank, three ways on the same --ranks cores:
//   one process:   the layer over every rank's tokens at once, on --ranks kernel threads;
//   replicated:    --ranks rank threads (one kernel thread each), each holding every expert and
//                  running its own tokens (data parallelism without the gradients' all-reduce);
//   expert-parallel: the same rank threads, each holding experts / ranks experts, its rows sent
//                  to their experts' ranks and back (dist::parallelize_experts).
// Prints each one's median step time over --rounds interleaved rounds, the ratio of the one
// process's time to each, and the expert weights each rank holds.
//
//   bench_expert_parallel [--tokens 2048] [--dim 256] [--hidden 512] [--experts 8] [--top-k 2]
//                         [--ranks 2] [--rounds 5]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include <ember/autograd/autograd.h>
#include <ember/distributed/backends/process_group_threads.h>
#include <ember/distributed/tensor_parallel/expert_parallel.h>
#include <ember/tensor/ops.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops/random.h>
#include <ember/tensor/threading.h>
#include "benchmarks/tensor_parallel/timing.h"

using namespace ember;
using bench::Clock;
using bench::median;
using bench::since_ms;

namespace {

std::shared_ptr<nn::MoE> layer(const nn::MoEOptions& o) {
  manual_seed(1);
  return std::make_shared<nn::MoE>(o);
}

// One forward and backward of `moe` over x; ms.
double step(nn::MoE& moe, const Tensor& x, const Tensor& w) {
  Tensor in = x.detach().requires_grad_();
  moe.zero_grad();
  const auto t0 = Clock::now();
  (moe.forward(in) * w).sum().backward();
  return since_ms(t0);
}

// `n` rank threads, one kernel thread each, each stepping its own layer over its tokens; the
// step's wall time on rank 0 between two barriers.
double ranks_step(std::vector<std::shared_ptr<nn::MoE>>& layers, const std::vector<Tensor>& x,
                  const std::vector<Tensor>& w,
                  const std::vector<std::shared_ptr<dist::ProcessGroup>>& groups) {
  const int n = static_cast<int>(layers.size());
  set_num_threads(1);
  double ms = 0;
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r) {
    ranks.emplace_back([&, r] {
      set_num_threads(1);
      groups[r]->barrier()->wait();
      const auto t0 = Clock::now();
      (void)step(*layers[r], x[r], w[r]);
      groups[r]->barrier()->wait();
      if (r == 0) ms = since_ms(t0);
    });
  }
  for (auto& t : ranks) t.join();
  return ms;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"A mixture-of-experts layer: one process, replicated ranks, expert-parallel ranks"};
  int64_t tokens = 2048, dim = 256, hidden = 512, experts = 8, top_k = 2;
  int ranks = 2, rounds = 5;
  app.add_option("--tokens", tokens, "tokens per rank")->check(CLI::PositiveNumber);
  app.add_option("--dim", dim, "token width")->check(CLI::PositiveNumber);
  app.add_option("--hidden", hidden, "an expert's hidden width")->check(CLI::PositiveNumber);
  app.add_option("--experts", experts, "experts in the layer")->check(CLI::PositiveNumber);
  app.add_option("--top-k", top_k, "experts per token")->check(CLI::PositiveNumber);
  app.add_option("--ranks", ranks, "ranks (and the one process's kernel threads)")
      ->check(CLI::PositiveNumber);
  app.add_option("--rounds", rounds, "interleaved rounds")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  if (experts % ranks != 0) {
    std::fprintf(stderr, "--ranks %d must divide --experts %lld\n", ranks,
                 static_cast<long long>(experts));
    return 2;
  }
  const nn::MoEOptions o{.dim = dim, .hidden = hidden, .experts = experts, .top_k = top_k};
  manual_seed(2);
  std::vector<Tensor> x, w;
  for (int r = 0; r < ranks; ++r) {
    x.push_back(randn({tokens, dim}));
    w.push_back(randn({tokens, dim}));
  }
  const Tensor all_x = cat(x, 0), all_w = cat(w, 0);

  auto whole = layer(o);
  auto world = dist::ThreadWorld::create(ranks);
  std::vector<std::shared_ptr<dist::ProcessGroup>> groups;
  for (int r = 0; r < ranks; ++r) {
    groups.push_back(std::make_shared<dist::ProcessGroupThreads>(world, r));
  }
  std::vector<std::shared_ptr<nn::MoE>> replicated, sharded;
  for (int r = 0; r < ranks; ++r) {
    replicated.push_back(layer(o));
    sharded.push_back(layer(o));
  }
  // Not collective: each rank's layer is sharded from this thread.
  for (int r = 0; r < ranks; ++r) dist::parallelize_experts(sharded[r], groups[r]);

  std::vector<double> one_ms, rep_ms, ep_ms;
  for (int i = 0; i <= rounds; ++i) {  // round 0 warms up
    set_num_threads(ranks);
    const double a = step(*whole, all_x, all_w);
    const double b = ranks_step(replicated, x, w, groups);
    const double c = ranks_step(sharded, x, w, groups);
    if (i == 0) continue;
    one_ms.push_back(a);
    rep_ms.push_back(b);
    ep_ms.push_back(c);
  }
  const double one = median(one_ms), rep = median(rep_ms), ep = median(ep_ms);
  auto mb = [](const nn::MoE& m) {
    return static_cast<double>((m.w1.numel() + m.w3.numel() + m.w2.numel()) * 4) / 1e6;
  };
  std::printf(
      "MoE forward+backward: %lld tokens x %d ranks, dim %lld, hidden %lld, %lld experts, "
      "top %lld, float32, median of %d rounds\n",
      static_cast<long long>(tokens), ranks, static_cast<long long>(dim),
      static_cast<long long>(hidden), static_cast<long long>(experts),
      static_cast<long long>(top_k), rounds);
  std::printf("%-18s %10s %8s %16s\n", "", "ms", "ratio", "expert MB/rank");
  std::printf("%-18s %10.2f %8.2f %16.2f\n", "one process", one, 1.0, mb(*whole));
  std::printf("%-18s %10.2f %8.2f %16.2f\n", "replicated ranks", rep, one / rep,
              mb(*replicated[0]));
  std::printf("%-18s %10.2f %8.2f %16.2f\n", "expert-parallel", ep, one / ep, mb(*sharded[0]));
  return 0;
}
