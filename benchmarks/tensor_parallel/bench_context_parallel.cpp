// Context parallelism's attention measured (docs/tensor_parallel.md, docs/benchmarks.md): one
// causal attention forward and backward over a sequence of --seq positions (B x H = --heads,
// head dim --dim, float32), the whole sequence in one process on --ranks kernel threads, beside
// dist::context_parallel_attention over --ranks rank threads (ProcessGroupThreads, one kernel
// thread each: the same cores), with the load-balanced split and with contiguous parts, keys and
// values all-gathered, and load-balanced with ring attention (ContextParallelRotate::Ring).
// Prints each one's median step time over --rounds interleaved rounds and the ratio of the
// whole's time to each (with contiguous parts the last rank attends over every key and the first
// over its own: the step waits for the last), and the host allocator's peak during the step
// above what the inputs hold, per rank (the ranks' sum over their number).
//
//   bench_context_parallel [--seq 4096] [--heads 8] [--dim 64] [--ranks 2] [--rounds 5]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include <ember/autograd/autograd.h>
#include <ember/distributed/backends/process_group_threads.h>
#include <ember/distributed/tensor_parallel/context_parallel.h>
#include <ember/tensor/allocator.h>
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

struct Inputs {
  Tensor q, k, v, w;
};

// The whole sequence's attention forward and backward on `threads` kernel threads; ms.
double whole_step(const Inputs& in, int threads) {
  set_num_threads(threads);
  Tensor q = in.q.detach().requires_grad_(), k = in.k.detach().requires_grad_(),
         v = in.v.detach().requires_grad_();
  const auto t0 = Clock::now();
  (scaled_dot_product_attention(q, k, v, {}, 0.0, true) * in.w).sum().backward();
  return since_ms(t0);
}

struct Step {
  double ms = 0;
  int64_t peak_bytes = 0;  // per rank, above the inputs
};

// context_parallel_attention over `n` rank threads, one kernel thread each: the step's wall time
// on rank 0 between two barriers (the groups' set-up and the threads' start left out), and the
// allocator's peak over the step.
Step cp_step(const Inputs& in, int n, bool balanced,
             dist::ContextParallelRotate rotate = dist::ContextParallelRotate::AllGather) {
  set_num_threads(1);
  auto world = dist::ThreadWorld::create(n);
  std::vector<Inputs> parts(n);
  for (int r = 0; r < n; ++r) {
    for (auto [from, to] : {std::pair{&in.q, &parts[r].q}, std::pair{&in.k, &parts[r].k},
                            std::pair{&in.v, &parts[r].v}, std::pair{&in.w, &parts[r].w}}) {
      *to = dist::context_parallel_shard(*from, 2, r, n, balanced).contiguous();
    }
  }
  Step step;
  const int64_t base = cpu_allocator_stats().allocated;
  cpu_reset_peak_stats();
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r) {
    ranks.emplace_back([&, r] {
      auto pg = std::make_shared<dist::ProcessGroupThreads>(world, r);
      Tensor q = parts[r].q.requires_grad_(), k = parts[r].k.requires_grad_(),
             v = parts[r].v.requires_grad_();
      pg->barrier()->wait();
      const auto t0 = Clock::now();
      Tensor out = dist::context_parallel_attention(q, k, v, pg,
                                                    {.load_balance = balanced, .rotate = rotate});
      (out * parts[r].w).sum().backward();
      pg->barrier()->wait();
      if (r == 0) step.ms = since_ms(t0);
    });
  }
  for (auto& t : ranks) t.join();
  step.peak_bytes = (cpu_allocator_stats().peak_allocated - base) / n;
  return step;
}

double median_ms(const std::vector<Step>& steps) {
  std::vector<double> ms;
  for (const Step& s : steps) ms.push_back(s.ms);
  return median(ms);
}

double median_mb(const std::vector<Step>& steps) {
  std::vector<double> mb;
  for (const Step& s : steps) mb.push_back(static_cast<double>(s.peak_bytes) / (1 << 20));
  return median(mb);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t seq = 4096, heads = 8, dim = 64;
  int ranks = 2, rounds = 5;
  CLI::App app{"context_parallel_attention beside the whole sequence's attention"};
  app.add_option("--seq", seq, "sequence length")->check(CLI::Range(int64_t{8}, int64_t{1} << 20));
  app.add_option("--heads", heads, "batch x heads")->check(CLI::PositiveNumber);
  app.add_option("--dim", dim, "head dim")->check(CLI::PositiveNumber);
  app.add_option("--ranks", ranks, "context-parallel ranks (threads)")->check(CLI::Range(1, 64));
  app.add_option("--rounds", rounds, "interleaved rounds; medians reported")
      ->check(CLI::Range(1, 1000));
  CLI11_PARSE(app, argc, argv);
  if (seq % (2 * ranks) != 0) {
    std::fprintf(stderr, "bench_context_parallel: --seq %lld must divide into %d chunks\n",
                 static_cast<long long>(seq), 2 * ranks);
    return 2;
  }
  manual_seed(0);
  const Inputs in{randn({1, heads, seq, dim}), randn({1, heads, seq, dim}),
                  randn({1, heads, seq, dim}), randn({1, heads, seq, dim})};
  whole_step(in, ranks);  // warm-up: allocator, pools
  cp_step(in, ranks, true);
  std::vector<double> whole;
  std::vector<Step> bal, con, ring;
  for (int i = 0; i < rounds; ++i) {
    whole.push_back(whole_step(in, ranks));
    bal.push_back(cp_step(in, ranks, true));
    con.push_back(cp_step(in, ranks, false));
    ring.push_back(cp_step(in, ranks, true, dist::ContextParallelRotate::Ring));
  }
  std::printf(
      "causal attention forward+backward, B*H=%lld, T=%lld, D=%lld, float32, %d ranks "
      "(rank threads, 1 kernel thread each) vs the whole sequence on %d threads, medians "
      "of %d rounds\n",
      static_cast<long long>(heads), static_cast<long long>(seq), static_cast<long long>(dim),
      ranks, ranks, rounds);
  const double w = median(whole);
  std::printf("whole: %.1f ms\n", w);
  for (auto [name, steps] :
       {std::pair{"all-gather, load-balanced", &bal},
        std::pair{"all-gather, contiguous parts", &con}, std::pair{"ring, load-balanced", &ring}}) {
    std::printf("context parallel, %s: %.1f ms (%.2fx the whole's speed), peak %.1f MB per rank\n",
                name, median_ms(*steps), w / median_ms(*steps), median_mb(*steps));
  }
  return 0;
}
