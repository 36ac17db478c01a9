// Pipeline schedules measured (docs/pipeline_parallel.md, docs/benchmarks.md):
//   bubble  each schedule's idle fraction per rank, measured by the executor around its actions
//           (the same spans EMBER_TRACE records), beside the analytic one. The stages' work is
//           a wait of --work-ms per forward (and per input and per weight backward; a full
//           backward waits both), not arithmetic: p ranks on a 2-core machine would otherwise
//           measure core contention, not the schedule.
//   memory  --memory: the allocator's peak per rank of a real MLP (8 blocks of --width) under
//           GPipe and 1F1B above what lives between steps (parameters and gradients): the
//           activations of --batch rows in --microbatches micro-batches.
//
//   bench_pipeline [--ranks 4] [--microbatches 8] [--work-ms 20] [--steps 3]
//   bench_pipeline --memory [--ranks 2] [--microbatches 8] [--width 512] [--batch 512]
//
// Ranks are forked processes over gloo on 127.0.0.1 (one schedule per fork, so each peak is
// its own); rank 0 prints one line per schedule.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <thread>

#include "benchmarks/fork_ranks.h"
#include <ember/autograd/autograd.h>
#include <ember/distributed/init.h>
#include <ember/distributed/pipelining/pipeline.h>
#include <ember/nn/nn.h>
#include <ember/tensor/allocator.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops.h>
#include <ember/tensor/ops/random.h>

using namespace ember;
namespace pp = ember::dist::pipelining;

namespace {

struct Args {
  int ranks = 4;
  int microbatches = 8;
  double work_ms = 20;
  int steps = 3;
  bool memory = false;
  int64_t width = 512;
  int64_t batch = 512;
  std::vector<std::string> schedules;
};

// y = x * w (w = 1), taking `ms` per forward and per each of the two backward halves: the
// input's gradient (needs_input_grad(0)) and the weight's (needs_input_grad(1)).
struct Wait : autograd::Function<Wait> {
  static Tensor forward(autograd::Context* ctx, const Tensor& x, const Tensor& w, double ms) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["ms"] = ms;
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
    return x * w;
  }
  static autograd::TensorList backward(autograd::Context* ctx, autograd::TensorList g) {
    const double ms = std::any_cast<double>(ctx->saved_data["ms"]);
    const auto s = ctx->saved();
    autograd::TensorList r(2);
    if (ctx->needs_input_grad(0)) {
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
      r[0] = g[0] * s[1];
    }
    if (ctx->needs_input_grad(1)) {
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
      r[1] = (g[0] * s[0]).sum().reshape({1});
    }
    return r;
  }
};

class WaitStage : public nn::Module {
 public:
  explicit WaitStage(double ms) : ms_(ms) { w_ = register_parameter("w", ones({1})); }
  std::string name() const override { return "WaitStage"; }
  Tensor forward(const Tensor& x) override { return Wait::apply(x, w_, ms_); }

 private:
  double ms_;
  Tensor w_;
};

Tensor mse(const Tensor& out, const Tensor& y) { return nn::functional::mse_loss(out, y); }

// One rank's run of `kind`: returns (idle fraction, peak bytes above the start) of the
// median step.
std::pair<double, double> run_rank(const Args& a, pp::ScheduleKind kind, int rank) {
  const int p = a.ranks, v = pp::default_stages_per_rank(kind), S = p * v;
  const int64_t base = cpu_allocator_stats().allocated;
  std::vector<std::shared_ptr<pp::PipelineStage>> stages;
  std::shared_ptr<nn::Sequential> model;
  std::vector<std::shared_ptr<pp::SequentialPart>> parts;
  if (a.memory) {
    manual_seed(1);
    model = std::make_shared<nn::Sequential>();
    for (int i = 0; i < 8; ++i) {
      model->push_back(std::make_shared<nn::Linear>(a.width, a.width));
      model->push_back(std::make_shared<nn::GELU>());
    }
    parts = pp::split_sequential_evenly(*model, S);
  }
  for (int s = 0; s < S; ++s) {
    if (pp::stage_rank(kind, s, S, p) != rank) continue;
    std::shared_ptr<nn::Module> m =
        a.memory ? std::shared_ptr<nn::Module>(parts[s]) : std::make_shared<WaitStage>(a.work_ms / v);
    stages.push_back(std::make_shared<pp::PipelineStage>(m, s, S));
  }
  pp::PipelineSchedule schedule(stages, a.microbatches, kind, {.loss_fn = mse});
  const int64_t rows = a.memory ? a.batch : a.microbatches;
  const int64_t cols = a.memory ? a.width : 1;
  // The batch requires grad, so that stage 0's backward also waits for its input's gradient
  // (a real first stage differentiates through its layers): every stage costs the same.
  const Tensor x = ones({rows, cols}).requires_grad_(!a.memory), y = zeros({rows, cols});
  const bool first = rank == pp::stage_rank(kind, 0, S, p);
  const bool last = rank == pp::stage_rank(kind, S - 1, S, p);
  std::vector<double> idle;
  int64_t between = base;
  for (int t = 0; t <= a.steps; ++t) {  // step 0 learns the shapes: not timed
    schedule.step(first ? x : Tensor(), last ? y : Tensor());
    if (t > 0) idle.push_back(1.0 - schedule.last_step().busy_fraction());
    // Between steps only the parameters and their gradients are alive; a later step's peak
    // above that is its activations (and what its backward allocates on the way).
    if (t == 0) between = cpu_allocator_stats().allocated;
  }
  std::sort(idle.begin(), idle.end());
  return {idle[idle.size() / 2], static_cast<double>(cpu_allocator_stats().peak_allocated - between)};
}

double analytic(pp::ScheduleKind k, int p, int m) {
  if (k == pp::ScheduleKind::GPipe || k == pp::ScheduleKind::OneFOneB) return (p - 1.0) / (m + p - 1.0);
  if (k == pp::ScheduleKind::Interleaved1F1B) return (p - 1.0) / (2.0 * m + p - 1.0);
  return -1;
}

void report(const Args& a, const std::string& name, pp::ScheduleKind kind,
            const std::vector<double>& v) {
  double mean = 0, worst = 0, peak_max = 0;
  std::string per_rank;
  for (int k = 0; k < a.ranks; ++k) {
    mean += v[2 * k] / a.ranks;
    worst = std::max(worst, v[2 * k]);
    peak_max = std::max(peak_max, v[2 * k + 1]);
    per_rank += (k ? "," : "") + std::to_string(v[2 * k]).substr(0, 5);
  }
  if (a.memory) {
    std::printf("schedule=%s ranks=%d microbatches=%d activation_peak_bytes_max=%.0f\n",
                name.c_str(), a.ranks, a.microbatches, peak_max);
  } else {
    std::printf("schedule=%s ranks=%d microbatches=%d idle_mean=%.3f idle_max=%.3f "
                "analytic=%.3f per_rank=%s\n",
                name.c_str(), a.ranks, a.microbatches, mean, worst,
                analytic(kind, a.ranks, a.microbatches), per_rank.c_str());
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"Pipeline schedules: measured bubble beside the analytic one, and peak memory"};
  app.add_option("--ranks", a.ranks)->check(CLI::Range(2, 16));
  app.add_option("--microbatches", a.microbatches)->check(CLI::Range(1, 1024));
  app.add_option("--work-ms", a.work_ms, "wait per forward and per backward half")->check(CLI::Range(0.1, 1000.0));
  app.add_option("--steps", a.steps)->check(CLI::Range(1, 1000));
  app.add_flag("--memory", a.memory, "peak memory of a real MLP under GPipe and 1F1B");
  app.add_option("--width", a.width);
  app.add_option("--batch", a.batch);
  app.add_option("--schedule", a.schedules, "schedules to run (default: all; --memory: gpipe 1f1b)");
  CLI11_PARSE(app, argc, argv);
  if (a.schedules.empty()) {
    a.schedules = a.memory ? std::vector<std::string>{"gpipe", "1f1b"}
                           : std::vector<std::string>{"gpipe", "1f1b", "interleaved-1f1b",
                                                      "looped-bfs", "zero-bubble", "zbv"};
  }
  int rc = 0;
  for (const std::string& name : a.schedules) {
    const pp::ScheduleKind kind = pp::parse_schedule(name);
    rc |= bench::fork_ranks("bench_pipeline", a.ranks, [&](int r) {
      dist::init_process_group({.backend = "gloo"});
      auto pg = dist::default_group();
      const auto [idle, peak] = run_rank(a, kind, r);
      Tensor mine = from_vector(std::vector<double>{idle, peak});
      Tensor all = zeros({a.ranks, 2}, kFloat64);
      pg->allgather_into_tensor(all, mine)->wait();
      if (r == 0) report(a, name, kind, all.to_vector<double>());
      dist::destroy_process_group();
      return 0;
    });
  }
  return rc;
}
