// bench_ddp: DistributedDataParallel step time, split into compute and exposed communication,
// beside PyTorch's DDP over gloo (issue 6).
//
//   bench_ddp --np 1,2,4 --model cnn,mlp --torch       (forks its own ranks, one set per row)
//   emberrun --nproc-per-node 2 bench_ddp --model mlp   (or mpirun -np 2 ...: RANK/WORLD_SIZE)
//
// Each rank trains two copies of the model on the same random batches (fixed seed, one pool of
// batches per rank): the DDP-wrapped one and a plain local one, in alternating sub-blocks of 10
// steps with a barrier before each, so both run under the same load (every rank busy at once).
//   step     median time of one DDP step (zero_grad, forward, cross-entropy, backward, SGD step)
//   compute  median time of the identical step of the local model (no communication)
//   exposed  step - compute: the communication backward did not hide
//   allred   median time of one all-reduce of every gradient as one flat float32 buffer with no
//            compute beside it, i.e. what communication would cost if nothing were hidden
//   hidden   1 - exposed / allred, clamped to [0, 100%] (100%: communication entirely behind
//            backward; 0%: none of it, or DDP's own work (bucket copies) outweighs what was hidden)
// A block is `--warmup` untimed steps of each kind, then `--steps` timed steps of each kind;
// every row runs `--repeats` blocks, and with --torch each Ember block is followed by a block of
// benchmarks/ddp/bench_ddp_torch.py (same model, batch, threads, ranks and measurement; with
// OMP_WAIT_POLICY=PASSIVE unless set, as emberrun gives Ember's workers) while the
// Ember ranks wait. The row shows the median over blocks of each block's median (averaged over
// ranks), steps/s of both frameworks and Ember's speed-up (target: 1.3x).
// At the end every rank's DDP parameters are compared with rank 0's: "params agree: yes" (not
// expected under --comm-hook post_localsgd, whose replicas differ between averagings).
// --comm-hook SPEC registers any registered hook (docs/ddp.md) and prints its byte summary;
// benchmarks/ddp/compression.sh runs it between two shaped network namespaces.
//
// Options: --np LIST (fork the ranks; a list runs one row per count; without it RANK and
// WORLD_SIZE from a launcher, or one process), --model LIST (cnn, mlp), --batch 64 (per rank),
// --steps 50, --warmup 5, --repeats 3, --threads T (per rank; default cores / ranks), --torch,
// --bucket-view (gradient_as_bucket_view: grad() lives in the buckets, which over gloo's shared
// memory come from dist::empty_shareable(), so the bucket all-reduces are mapped reductions).
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "benchmarks/bench_util.h"
#include "benchmarks/fashion_cnn.h"
#include "cmake/build_paths.h"
#include <ember/distributed/ddp/ddp.h>
#include <ember/distributed/ddp/hook_registry.h>
#include <ember/distributed/init.h>
#include <ember/distributed/store/hash_store.h>
#include <ember/distributed/store/tcp_store.h>
#include <ember/nn/nn.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops/indexing.h>
#include <ember/tensor/ops/random.h>
#include <ember/tensor/threading.h>


using namespace ember;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kSubBlock = 10;    // steps of one kind before switching to the other
constexpr int kPoolBatches = 4;  // distinct random batches per rank, cycled
constexpr int kAllreduceIters = 5;

struct Args {
  std::vector<int> np;  // empty: launcher or one process
  std::vector<std::string> models{"cnn"};
  int64_t batch = 64;
  int steps = 50;
  int warmup = 5;
  int repeats = 3;
  int threads = 0;  // 0: cores / ranks
  bool torch = false;
  bool bucket_view = false;
  double bucket_cap_mb = 25;  // DDPOptions' default, torch's
  std::string comm_hook = "none";  // a dist::make_comm_hook spec
};

Args parse(int argc, char** argv) {
  Args a;
  CLI::App app{"bench_ddp: DDP step time, compute against exposed communication"};
  app.add_option("--np", a.np, "fork these rank counts, e.g. 1,2,4 (default: the launcher's)")
      ->delimiter(',')
      ->check(CLI::Range(1, 1 << 30));
  app.add_option("--model", a.models, "cnn, mlp or both (cnn,mlp)")
      ->delimiter(',')
      ->check(CLI::IsMember({"cnn", "mlp", "mlp512"}));
  app.add_option("--batch", a.batch, "batch per rank")->check(CLI::Range(1, 1 << 30));
  app.add_option("--steps", a.steps, "timed steps per repeat")->check(CLI::Range(1, 1 << 30));
  app.add_option("--warmup", a.warmup, "untimed steps first")->check(CLI::Range(0, 1 << 30));
  app.add_option("--repeats", a.repeats, "timed repeats; the median is reported")
      ->check(CLI::Range(1, 1 << 30));
  app.add_option("--threads", a.threads, "threads per rank (default: cores / ranks)")
      ->check(CLI::Range(1, 1 << 30));
  app.add_flag("--torch", a.torch, "also run torch's DDP and print the ratio (without a hook)");
  app.add_option("--comm-hook", a.comm_hook,
                 "a registered comm hook, NAME[:key=value,...] (docs/ddp.md), or none");
  app.add_flag("--bucket-view", a.bucket_view,
               "DDPOptions::gradient_as_bucket_view (over gloo's shared memory the buckets are "
               "then reduced from the peers' mapped buckets)");
  app.add_option("--bucket-cap-mb", a.bucket_cap_mb, "DDPOptions::bucket_cap_mb (default 25)")
      ->check(CLI::PositiveNumber);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e) == 0 ? 0 : 2);
  }
  return a;
}

int cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

int threads_per_rank(const Args& a, int world) {
  return a.threads > 0 ? a.threads : std::max(1, cores() / world);
}

// The models of examples/fashion_mnist.cpp ("cnn", "mlp512") and a ~10M-parameter MLP whose
// gradients take long enough to reduce that overlapping them with backward matters.
std::shared_ptr<nn::Module> make_model(const std::string& name) {
  if (name == "cnn") return bench::fashion_cnn();
  if (name == "mlp512") {
    return std::make_shared<nn::Sequential>(
        std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(784, 512),
        std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(512, 512),
        std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(512, 10));
  }
  return std::make_shared<nn::Sequential>(
      std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(784, 2048),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(2048, 2048),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(2048, 2048),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(2048, 10));
}

int64_t numel_of(const std::vector<Tensor>& ts) {
  int64_t n = 0;
  for (const Tensor& t : ts) n += t.numel();
  return n;
}

double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// One block's numbers on one rank (milliseconds).
struct BlockResult {
  double step = 0, compute = 0, allreduce = 0;
};

// What torch's script reports for one block (milliseconds); ok false if it failed.
struct TorchResult {
  bool ok = false;
  double step = 0, compute = 0, allreduce = 0;
};

class RankBench {
 public:
  RankBench(const Args& a, const std::string& model_name, std::shared_ptr<dist::ProcessGroup> pg)
      : a_(a), pg_(std::move(pg)) {
    // Same seed everywhere: identical initial weights (DDP broadcasts rank 0's anyway), and the
    // local model starts where the DDP model does.
    manual_seed(0);
    auto wrapped = make_model(model_name);
    manual_seed(0);
    local_ = make_model(model_name);
    dist::DDPOptions o;
    o.gradient_as_bucket_view = a.bucket_view;
    o.bucket_cap_mb = a.bucket_cap_mb;
    ddp_ = std::make_shared<dist::DistributedDataParallel>(wrapped, pg_, o);
    if (a.comm_hook != "none") {
      hook_ = dist::make_comm_hook(a.comm_hook, pg_);
      ddp_->register_comm_hook(hook_.hook, hook_.name);
    }
    const nn::optim::SGDOptions sgd{.lr = 0.01, .momentum = 0.9};
    ddp_opt_ = std::make_unique<nn::optim::SGD>(ddp_->parameters(), sgd);
    local_opt_ = std::make_unique<nn::optim::SGD>(local_->parameters(), sgd);
    numel_ = numel_of(local_->parameters());
    // Each rank its own data, as in data-parallel training.
    manual_seed(1000 + static_cast<uint64_t>(pg_->rank()));
    for (int i = 0; i < kPoolBatches; ++i) {
      xs_.push_back(randn({a.batch, 1, 28, 28}));
      ys_.push_back(randint(0, 10, {a.batch}));
    }
    flat_ = zeros({numel_});
  }

  int64_t numel() const { return numel_; }
  const dist::MadeCommHook& hook() const { return hook_; }

  BlockResult block() {
    for (int i = 0; i < a_.warmup; ++i) ddp_step();
    for (int i = 0; i < a_.warmup; ++i) local_step();
    std::vector<double> ddp_ms, local_ms, ar_ms;
    for (int done = 0; done < a_.steps; done += kSubBlock) {
      const int n = std::min(kSubBlock, a_.steps - done);
      pg_->barrier()->wait();
      for (int i = 0; i < n; ++i) {
        const auto t0 = Clock::now();
        ddp_step();
        ddp_ms.push_back(ms_since(t0));
      }
      pg_->barrier()->wait();
      for (int i = 0; i < n; ++i) {
        const auto t0 = Clock::now();
        local_step();
        local_ms.push_back(ms_since(t0));
      }
    }
    pg_->barrier()->wait();
    for (int i = 0; i < kAllreduceIters; ++i) {
      const auto t0 = Clock::now();
      pg_->allreduce(flat_)->wait();
      ar_ms.push_back(ms_since(t0));
    }
    // The mean over ranks of each rank's medians.
    Tensor r = from_vector(std::vector<double>{median(ddp_ms), median(local_ms), median(ar_ms)});
    pg_->allreduce(r)->wait();
    const std::vector<double> v = r.to_vector<double>();
    const double w = pg_->size();
    return {v[0] / w, v[1] / w, v[2] / w};
  }

  // Largest |p - p_rank0| over every DDP parameter, the same on every rank.
  double max_param_diff() {
    std::vector<Tensor> flat;
    for (const Tensor& p : ddp_->parameters()) flat.push_back(p.detach().reshape({-1}));
    Tensor mine = cat(flat);
    Tensor theirs = mine.clone();
    pg_->broadcast(theirs)->wait();
    Tensor d = (mine - theirs).abs().max().to(kFloat64).reshape({1});
    dist::AllreduceOptions max;
    max.op = dist::ReduceOp::Max;
    pg_->allreduce(d, max)->wait();
    return d.to_vector<double>()[0];
  }

 private:
  // One training step of `model` on the next batch of the pool.
  void step(nn::Module& model, nn::optim::SGD& opt, int& next) {
    opt.zero_grad();
    nn::functional::cross_entropy(model.forward(xs_[next]), ys_[next]).backward();
    opt.step();
    next = (next + 1) % kPoolBatches;
  }
  void ddp_step() {
    step(*ddp_, *ddp_opt_, next_ddp_);
    if (hook_.after_step) hook_.after_step(ddp_->parameters());
  }
  void local_step() { step(*local_, *local_opt_, next_local_); }

  const Args& a_;
  std::shared_ptr<dist::ProcessGroup> pg_;
  std::shared_ptr<dist::DistributedDataParallel> ddp_;
  dist::MadeCommHook hook_;
  std::shared_ptr<nn::Module> local_;
  std::unique_ptr<nn::optim::SGD> ddp_opt_, local_opt_;
  std::vector<Tensor> xs_, ys_;
  Tensor flat_;
  int64_t numel_ = 0;
  int next_ddp_ = 0, next_local_ = 0;
};

// One block of bench_ddp_torch.py, whose rank 0 prints "RESULT step_ms compute_ms allreduce_ms".
TorchResult run_torch_block(const Args& a, const std::string& model, int world, int threads) {
  std::ostringstream cmd;
  // As emberrun gives Ember's workers (and vs_pytorch/run.py both sides): torch 1.13's
  // OpenMP threads otherwise spin against Debian's pthread OpenBLAS pool and the comparison
  // would measure that contention (docs/benchmarks.md has the numbers).
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  cmd << "OMP_WAIT_POLICY=" << (policy && *policy ? policy : "PASSIVE") << " timeout 1800 "
      << bench::python_script(EMBER_SOURCE_DIR, "benchmarks/ddp/bench_ddp_torch.py") << " --np "
      << world << " --model " << model << " --batch " << a.batch << " --steps " << a.steps
      << " --warmup " << a.warmup << " --threads " << threads;
  TorchResult r;
  FILE* p = ::popen(cmd.str().c_str(), "r");
  if (!p) return r;
  char line[512];
  while (std::fgets(line, sizeof(line), p)) {
    double s = 0, c = 0, ar = 0;
    if (std::sscanf(line, "RESULT %lf %lf %lf", &s, &c, &ar) == 3) r = {true, s, c, ar};
  }
  if (::pclose(p) != 0) r.ok = false;
  return r;
}

void print_header(const Args& a) {
  std::printf(
      "# bench_ddp: batch %lld per rank, SGD momentum 0.9, %d timed steps of each kind per "
      "block, %d blocks, times in ms (median over steps, mean over ranks, median over "
      "blocks); %d cores\n",
      static_cast<long long>(a.batch), a.steps, a.repeats, cores());
  std::printf("%-5s %5s %4s %9s | %8s %8s %8s %8s %7s %8s", "model", "ranks", "thr", "params",
              "step", "compute", "exposed", "allred", "hidden", "steps/s");
  if (a.torch) {
    std::printf(" | %8s %8s %8s %8s %8s | %7s", "t.step", "t.comp", "t.expos", "t.allred",
                "t.step/s", "speedup");
  }
  std::printf("\n");
  std::fflush(stdout);
}

double hidden_pct(double step, double compute, double allreduce) {
  if (!(allreduce > 0)) return 0;
  return 100.0 * std::clamp(1.0 - (step - compute) / allreduce, 0.0, 1.0);
}

// Every rank runs this for one model; rank 0 prints the row. Returns whether the parameters
// agree across ranks.
bool run_row(const Args& a, const std::string& model,
             const std::shared_ptr<dist::ProcessGroup>& pg) {
  const int world = pg->size(), rank = pg->rank();
  const int threads = threads_per_rank(a, world);
  set_num_threads(threads);
  RankBench bench(a, model, pg);
  std::vector<double> step, compute, allred, t_step, t_compute, t_allred;
  bool torch_ok = true;
  for (int r = 0; r < a.repeats; ++r) {
    const BlockResult b = bench.block();
    step.push_back(b.step);
    compute.push_back(b.compute);
    allred.push_back(b.allreduce);
    if (a.torch) {
      pg->barrier()->wait();
      if (rank == 0) {
        const TorchResult t = run_torch_block(a, model, world, threads);
        torch_ok = torch_ok && t.ok;
        if (t.ok) {
          t_step.push_back(t.step);
          t_compute.push_back(t.compute);
          t_allred.push_back(t.allreduce);
        }
      }
      // The other ranks sleep here (gloo waits on its sockets) while rank 0 runs torch; longer
      // than the script's own 30-minute limit.
      pg->barrier({.timeout = std::chrono::minutes(35)})->wait();
    }
  }
  const double diff = bench.max_param_diff();
  if (rank == 0) {
    const double s = median(step), c = median(compute), ar = median(allred);
    // World size 1 communicates nothing: no hidden fraction to speak of.
    const std::string hidden =
        world > 1 ? std::to_string(std::lround(hidden_pct(s, c, ar))) + "%" : "-";
    std::printf("%-5s %5d %4d %9lld | %8.2f %8.2f %8.2f %8.2f %7s %8.1f", model.c_str(), world,
                threads, static_cast<long long>(bench.numel()), s, c, s - c, ar, hidden.c_str(),
                1000.0 / s);
    if (a.torch) {
      if (!t_step.empty()) {
        const double ts = median(t_step), tc = median(t_compute), tar = median(t_allred);
        std::printf(" | %8.2f %8.2f %8.2f %8.2f %8.1f | %6.2fx", ts, tc, ts - tc, tar, 1000.0 / ts,
                    ts / s);
      } else {
        std::printf(" | %8s %8s %8s %8s %8s | %7s", "-", "-", "-", "-", "-", "-");
      }
    }
    std::printf("\n  params agree: %s (max abs diff %g)%s\n", diff == 0 ? "yes" : "no", diff,
                a.torch && !torch_ok ? "; a torch block failed (see its stderr)" : "");
    if (bench.hook().summary) std::printf("  %s\n", bench.hook().summary().c_str());
    std::fflush(stdout);
  }
  // Under local SGD the replicas drift apart between two averagings by design.
  return diff == 0 || bench.hook().after_step != nullptr;
}

// One process of a run: every model in turn on the group from RANK/WORLD_SIZE (or a world of
// one). Returns the exit status.
int run_rank(const Args& a, bool launched, bool header) {
  dist::InitOptions o;
  o.backend = "gloo";
  if (!launched) {
    o.store = std::make_shared<dist::HashStore>();
    o.rank = 0;
    o.world_size = 1;
  }
  auto pg = dist::init_process_group(o);
  if (header && pg->rank() == 0) print_header(a);
  bool agree = true;
  for (const std::string& m : a.models) agree = run_row(a, m, pg) && agree;
  pg->barrier()->wait();
  dist::destroy_process_group();
  return agree ? 0 : 1;
}

// Forks `n` ranks rendezvousing on a free port of 127.0.0.1, each running `models`; kills the
// others if one fails. Returns the exit status.
int fork_ranks(const Args& a, int n, const std::vector<std::string>& models) {
  dist::TCPStoreServerOptions so;
  so.host = "127.0.0.1";
  uint16_t port = 0;
  {
    dist::TCPStoreServer probe(so);  // the OS's pick, then released for rank 0's own server
    port = probe.port();
  }
  Args row = a;
  row.models = models;
  std::fflush(stdout);
  std::vector<pid_t> kids;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("bench_ddp: fork");
      for (pid_t k : kids) {
        ::kill(k, SIGKILL);
        ::waitpid(k, nullptr, 0);
      }
      return 1;
    }
    if (pid == 0) {
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(n).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      int rc = 1;
      try {
        rc = run_rank(row, true, false);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_ddp: rank %d: %s\n", r, e.what());
      }
      std::fflush(stdout);
      std::fflush(stderr);
      ::_exit(rc);
    }
    kids.push_back(pid);
  }
  int rc = 0;
  size_t left = kids.size();
  while (left > 0) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, 0);
    if (pid < 0) break;
    auto it = std::find(kids.begin(), kids.end(), pid);
    if (it == kids.end()) continue;
    *it = -1;
    --left;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      // One rank failed: the others would only wait for it until the collective timeout.
      if (rc == 0) {
        for (pid_t k : kids) {
          if (k > 0) ::kill(k, SIGKILL);
        }
      }
      rc = 1;
    }
  }
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  try {
    // Under emberrun/torchrun (RANK), mpirun or Slurm: this process is one rank.
    const bool launched = std::getenv("RANK") || std::getenv("OMPI_COMM_WORLD_RANK") ||
                          std::getenv("PMI_RANK") || std::getenv("SLURM_PROCID");
    if (launched || a.np.empty()) return run_rank(a, launched, true);
    print_header(a);
    int rc = 0;
    for (int n : a.np) {
      for (const std::string& m : a.models) rc |= fork_ranks(a, n, {m});
    }
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_ddp: %s\n", e.what());
    return 1;
  }
}
