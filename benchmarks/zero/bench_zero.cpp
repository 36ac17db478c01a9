// bench_zero: DDP with Adam on every rank against DDP with ZeroRedundancyOptimizer(Adam), without
// and with overlap_with_ddp (hook_with_zero_step), beside torch 1.13's DDP +
// ZeroRedundancyOptimizer over gloo in the same run.
//
//   bench_zero --np 2 --torch          (forks its ranks; rank 0 prints the table)
//
// Each rank trains three copies of a ~10M-parameter MLP (bench_ddp's) on its own random batches,
// one with a full Adam per rank, one with the ZeRO-sharded Adam and one with the sharded Adam
// stepped from DDP's hook, in alternating sub-blocks of 10 steps with a barrier before each.
// Per mode: the median step time (mean over ranks) and the optimizer state bytes per rank (the
// largest rank's). With --torch, each round of Ember's blocks is followed by
// benchmarks/zero/bench_zero_torch.py (the same measurement with torch) while Ember's ranks
// wait; medians over --rounds.
//
// Options: --np N (default 2), --batch 32 (per rank), --steps 30, --warmup 3, --rounds 3,
// --bucket-view (DDP's gradient_as_bucket_view in every mode),
// --threads T (per rank; default cores / ranks), --torch.
#include <sched.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <thread>

#include "benchmarks/bench_util.h"
#include "benchmarks/fork_ranks.h"
#include "cmake/build_paths.h"
#include <ember/distributed/ddp/ddp.h>
#include <ember/distributed/init.h>
#include <ember/distributed/sharding/zero.h>
#include <ember/distributed/sharding/zero_hook.h>
#include <ember/distributed/store/tcp_store.h>
#include <ember/nn/nn.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops/random.h>
#include <ember/tensor/threading.h>


using namespace ember;
using Clock = std::chrono::steady_clock;

namespace {

struct Args {
  int np = 2, batch = 32, steps = 30, warmup = 3, rounds = 3, threads = 0;
  bool torch = false, bucket_view = false;
};

Args parse(int argc, char** argv) {
  Args a;
  CLI::App app{"bench_zero: DDP + Adam against DDP + ZeroRedundancyOptimizer(Adam)"};
  app.add_option("--np", a.np, "ranks to fork")->check(CLI::Range(1, 64));
  app.add_option("--batch", a.batch, "batch per rank")->check(CLI::Range(1, 1 << 20));
  app.add_option("--steps", a.steps, "timed steps per mode per round")->check(CLI::Range(1, 1 << 20));
  app.add_option("--warmup", a.warmup, "untimed steps first")->check(CLI::Range(0, 1 << 20));
  app.add_option("--rounds", a.rounds, "rounds (Ember's and torch's alternate)")
      ->check(CLI::Range(1, 1000));
  app.add_option("--threads", a.threads, "threads per rank (default: cores / ranks)")
      ->check(CLI::Range(0, 1024));
  app.add_flag("--torch", a.torch, "also run torch's DDP + ZeroRedundancyOptimizer");
  app.add_flag("--bucket-view", a.bucket_view,
               "DDP's gradient_as_bucket_view in every mode (a hook otherwise copies the "
               "gradients into the buckets and back)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e) == 0 ? 0 : 2);
  }
  return a;
}

std::shared_ptr<nn::Module> make_mlp() {
  return std::make_shared<nn::Sequential>(
      std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(784, 2048),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(2048, 2048),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(2048, 2048),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(2048, 10));
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

int64_t state_bytes(const nn::optim::Optimizer& opt) {
  int64_t n = 0;
  for (const auto& [name, t] : opt.state_dict().state) n += t.nbytes();
  return n;
}

// One mode's model, optimizer and step.
struct Mode {
  std::shared_ptr<dist::DistributedDataParallel> ddp;
  std::function<void()> zero_grad, step;
  std::function<int64_t()> state;
};

struct Result {
  double ddp_ms = 0, zero_ms = 0, overlap_ms = 0;
  int64_t ddp_state = 0, zero_state = 0, overlap_state = 0;
};

class RankBench {
 public:
  RankBench(const Args& a, std::shared_ptr<dist::ProcessGroup> pg) : a_(a), pg_(std::move(pg)) {
    const nn::optim::AdamOptions adam{.lr = 1e-4};
    manual_seed(0);
    plain_.ddp = std::make_shared<dist::DistributedDataParallel>(make_mlp(), pg_, ddp_options());
    auto opt = std::make_shared<nn::optim::Adam>(plain_.ddp->parameters(), adam);
    plain_.zero_grad = [opt] { opt->zero_grad(); };
    plain_.step = [opt] { opt->step(); };
    plain_.state = [opt] { return state_bytes(*opt); };
    sharded_ = make_zero(adam, false);
    overlapped_ = make_zero(adam, true);
    manual_seed(1000 + static_cast<uint64_t>(pg_->rank()));
    for (int i = 0; i < 4; ++i) {
      xs_.push_back(randn({a.batch, 1, 28, 28}));
      ys_.push_back(randint(0, 10, {a.batch}));
    }
  }

  Result round() {
    for (int i = 0; i < a_.warmup; ++i) {
      for (Mode* m : {&plain_, &sharded_, &overlapped_}) train(*m);
    }
    std::vector<double> plain_ms, zero_ms, overlap_ms;
    for (int done = 0; done < a_.steps; done += 10) {
      for (auto [mode, out] : {std::pair{&plain_, &plain_ms}, std::pair{&sharded_, &zero_ms},
                               std::pair{&overlapped_, &overlap_ms}}) {
        pg_->barrier()->wait();
        for (int i = 0; i < std::min(10, a_.steps - done); ++i) {
          const auto t0 = Clock::now();
          train(*mode);
          out->push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
        }
      }
    }
    Tensor r =
        from_vector(std::vector<double>{median(plain_ms), median(zero_ms), median(overlap_ms)});
    pg_->allreduce(r)->wait();
    Tensor s = from_vector(std::vector<double>{static_cast<double>(plain_.state()),
                                               static_cast<double>(sharded_.state()),
                                               static_cast<double>(overlapped_.state())});
    dist::AllreduceOptions max;
    max.op = dist::ReduceOp::Max;
    pg_->allreduce(s, max)->wait();
    const auto v = r.to_vector<double>(), st = s.to_vector<double>();
    return {v[0] / pg_->size(),          v[1] / pg_->size(),          v[2] / pg_->size(),
            static_cast<int64_t>(st[0]), static_cast<int64_t>(st[1]), static_cast<int64_t>(st[2])};
  }

 private:
  dist::DDPOptions ddp_options() const {
    dist::DDPOptions o;
    o.gradient_as_bucket_view = a_.bucket_view;
    return o;
  }

  // DDP + ZeRO(Adam); `overlap`: stepped from DDP's hook (step() then only checks).
  Mode make_zero(const nn::optim::AdamOptions& adam, bool overlap) {
    Mode m;
    manual_seed(0);
    m.ddp = std::make_shared<dist::DistributedDataParallel>(make_mlp(), pg_, ddp_options());
    auto zero = std::make_shared<dist::ZeroRedundancyOptimizer>(
        m.ddp->parameters(),
        [adam](std::vector<nn::optim::ParamGroup> g) {
          return std::make_unique<nn::optim::Adam>(std::move(g), adam);
        },
        pg_, dist::ZeroOptions{.overlap_with_ddp = overlap});
    if (overlap) {
      m.ddp->register_comm_hook(dist::hook_with_zero_step(dist::allreduce_hook, *m.ddp, *zero));
    }
    m.zero_grad = [zero] { zero->zero_grad(); };
    m.step = [zero] { zero->step(); };
    m.state = [zero] { return state_bytes(zero->optimizer()); };
    return m;
  }

  void train(Mode& m) {
    m.zero_grad();
    nn::functional::cross_entropy(m.ddp->forward(xs_[next_]), ys_[next_]).backward();
    m.step();
    next_ = (next_ + 1) % static_cast<int>(xs_.size());
  }

  const Args& a_;
  std::shared_ptr<dist::ProcessGroup> pg_;
  Mode plain_, sharded_, overlapped_;
  std::vector<Tensor> xs_, ys_;
  int next_ = 0;
};

// torch's "RESULT ddp_ms zero_ms ddp_state_bytes zero_state_bytes" line.
std::optional<Result> run_torch(const Args& a, int threads) {
  std::ostringstream cmd;
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  cmd << "OMP_WAIT_POLICY=" << (policy && *policy ? policy : "PASSIVE") << " timeout 1800 "
      << bench::python_script(EMBER_SOURCE_DIR, "benchmarks/zero/bench_zero_torch.py") << " --np "
      << a.np << " --batch " << a.batch << " --steps " << a.steps << " --warmup " << a.warmup
      << " --threads " << threads;
  FILE* p = ::popen(cmd.str().c_str(), "r");
  if (!p) return std::nullopt;
  char line[512];
  std::optional<Result> out;
  while (std::fgets(line, sizeof line, p)) {
    Result r;
    long long ds = 0, zs = 0;
    if (std::sscanf(line, "RESULT %lf %lf %lld %lld", &r.ddp_ms, &r.zero_ms, &ds, &zs) == 4) {
      r.ddp_state = ds;
      r.zero_state = zs;
      out = r;
    }
  }
  ::pclose(p);
  return out;
}

int cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

void print(const Args& a, int threads, const std::vector<Result>& ours,
           const std::vector<Result>& theirs) {
  auto med = [](const std::vector<Result>& v, double Result::*f) {
    std::vector<double> x;
    for (const Result& r : v) x.push_back(r.*f);
    return median(x);
  };
  std::printf("# bench_zero: %d ranks, MLP 784-2048-2048-2048-10 (10.0M parameters), Adam, batch "
              "%d per rank, %d threads per rank, median of %d rounds of %d steps%s\n",
              a.np, a.batch, threads, a.rounds, a.steps,
              a.bucket_view ? ", gradient_as_bucket_view" : "");
  std::printf("%-24s %12s %14s %12s %14s %8s\n", "mode", "step(ms)", "state/rank(MB)",
              "torch(ms)", "t.state(MB)", "speedup");
  for (auto [name, ms, st] :
       {std::tuple{"DDP + Adam", &Result::ddp_ms, &Result::ddp_state},
        std::tuple{"DDP + ZeRO(Adam)", &Result::zero_ms, &Result::zero_state},
        std::tuple{"DDP + ZeRO overlapped", &Result::overlap_ms, &Result::overlap_state}}) {
    const double mine = med(ours, ms);
    std::printf("%-24s %12.1f %14.2f", name, mine, ours.back().*st / 1e6);
    if (!theirs.empty() && ms != &Result::overlap_ms) {  // torch's overlap is not run
      const double t = med(theirs, ms);
      std::printf(" %12.1f %14.2f %7.2fx", t, theirs.back().*st / 1e6, t / mine);
    }
    std::printf("\n");
  }
  std::fflush(stdout);
}

int rank_main(const Args& a, int threads) {
  set_num_threads(threads);
  dist::init_process_group({.backend = "gloo"});
  auto pg = dist::default_group();
  std::vector<Result> ours, theirs;
  {
    RankBench bench(a, pg);
    for (int r = 0; r < a.rounds; ++r) {
      ours.push_back(bench.round());
      if (a.torch && pg->rank() == 0) {
        if (auto t = run_torch(a, threads)) theirs.push_back(*t);
      }
      pg->barrier(dist::CollectiveOptions{std::chrono::minutes(30)})->wait();
    }
  }
  if (pg->rank() == 0) print(a, threads, ours, theirs);
  dist::destroy_process_group();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  const int threads = a.threads > 0 ? a.threads : std::max(1, cores() / a.np);
  try {
    return bench::fork_ranks("bench_zero", a.np, [&](int) { return rank_main(a, threads); });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_zero: %s\n", e.what());
    return 1;
  }
}
