// bench_collectives: collective bandwidth in the style of nccl-tests, beside torch.distributed.
//
//   emberrun -np 2 bench_collectives --backend gloo --op allreduce     (or mpirun -np 2 ...)
//   bench_collectives --np 2 --op allreduce --torch                     (forks its own ranks)
//
// Rank 0 prints one line per size: bytes, element count, time per call (µs), algbw and busbw
// (GB/s, as nccl-tests defines them) and #wrong (elements that differ from the closed form
// after one checked call). With --torch it also runs
// benchmarks/collectives/bench_collectives_torch.py (torch.distributed, gloo, same sizes and
// process count) and prints its time and the ratio.
//
// Options: --backend gloo, --op allreduce|broadcast|allgather|reduce_scatter|alltoall,
// --min-bytes 4096, --max-bytes 16777216 (doubling), --iters 20, --warmup 5, --np N (fork N
// local ranks instead of reading RANK/WORLD_SIZE), --torch, --rounds R (default 5: Ember's pass
// over the sizes and torch's alternate R times; each time printed is the median of the R
// rounds), --mode pipelined|latency (pipelined, as nccl-tests: issue `iters` calls, then wait
// for the last; latency: wait for each call before issuing the next).
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "benchmarks/bench_util.h"
#include "distributed/init.h"
#include "distributed/tcp_store.h"
#include "tensor/ops.h"

#ifndef EMBER_SOURCE_DIR
#define EMBER_SOURCE_DIR "."
#endif

using namespace ember;
using namespace ember::dist;

namespace {

struct Args {
  std::string backend = "gloo";
  std::string op = "allreduce";
  int64_t min_bytes = 4096;
  int64_t max_bytes = 16 << 20;
  int iters = 20;
  int warmup = 5;
  int np = 0;
  bool torch = false;
  int rounds = 5;
  std::string mode = "pipelined";
};

Args parse(int argc, char** argv) {
  Args a;
  CLI::App app{"bench_collectives: collective bandwidth in the style of nccl-tests"};
  app.add_option("--backend", a.backend, "process group backend")
      ->check(CLI::IsMember({"gloo", "mpi", "nccl"}));
  app.add_option("--op", a.op, "the collective")
      ->check(CLI::IsMember({"allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall"}));
  app.add_option("--min-bytes", a.min_bytes, "smallest size")->check(CLI::Range(1, 1 << 30));
  app.add_option("--max-bytes", a.max_bytes, "largest size (doubling)")
      ->check(CLI::Range(1, 1 << 30));
  app.add_option("--iters", a.iters, "timed calls per size")->check(CLI::Range(1, 1 << 30));
  app.add_option("--warmup", a.warmup, "untimed calls per size")->check(CLI::Range(0, 1 << 30));
  app.add_option("--np", a.np, "fork this many local ranks instead of reading RANK/WORLD_SIZE")
      ->check(CLI::Range(0, 1 << 30));
  app.add_flag("--torch", a.torch, "also run torch.distributed's gloo and print the ratio");
  app.add_option("--rounds", a.rounds, "alternate Ember's and torch's passes this many times")
      ->check(CLI::Range(1, 1 << 30));
  app.add_option("--mode", a.mode, "pipelined (nccl-tests) or latency (wait for each call)")
      ->check(CLI::IsMember({"pipelined", "latency"}));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e) == 0 ? 0 : 2);
  }
  return a;
}

// nccl-tests' bus bandwidth factor: what each rank's links must carry relative to algbw.
double bus_factor(const std::string& op, int n) {
  if (op == "allreduce") return 2.0 * (n - 1) / n;
  if (op == "allgather" || op == "reduce_scatter" || op == "alltoall") return double(n - 1) / n;
  return 1.0;  // broadcast
}

struct Row {
  int64_t bytes;
  double us;
  int64_t wrong;
};

// One call of `op` on float32 buffers of `count` elements per rank; returns the Work.
struct Bufs {
  Tensor a, out;
  std::vector<Tensor> ins, outs;
};

Bufs make_bufs(const std::string& op, int64_t count, int n, int rank) {
  Bufs b;
  const double v = rank + 1;
  if (op == "allreduce" || op == "broadcast") {
    b.a = full({count}, v, kFloat32);
  } else if (op == "allgather") {
    b.a = full({count / n}, v, kFloat32);
    b.out = empty({(count / n) * n}, kFloat32);
  } else if (op == "reduce_scatter") {
    for (int r = 0; r < n; ++r) b.ins.push_back(full({count / n}, v, kFloat32));
    b.out = empty({count / n}, kFloat32);
  } else if (op == "alltoall") {
    for (int r = 0; r < n; ++r) {
      b.ins.push_back(full({count / n}, v, kFloat32));
      b.outs.push_back(empty({count / n}, kFloat32));
    }
  } else {
    std::fprintf(stderr, "bench_collectives: unknown --op %s\n", op.c_str());
    std::exit(2);
  }
  return b;
}

WorkPtr issue(ProcessGroup& pg, const std::string& op, Bufs& b) {
  if (op == "allreduce") return pg.allreduce(b.a);
  if (op == "broadcast") return pg.broadcast(b.a);
  if (op == "allgather") return pg.allgather_into_tensor(b.out, b.a);
  if (op == "reduce_scatter") return pg.reduce_scatter(b.out, b.ins);
  return pg.alltoall(b.outs, b.ins);
}

// Elements that differ from the closed form after one call on fresh buffers.
int64_t count_wrong(const std::string& op, Bufs& b, int n) {
  auto wrong_in = [](const Tensor& t, const std::function<double(int64_t)>& want) {
    const std::vector<float> v = t.to_vector<float>();
    int64_t w = 0;
    for (size_t i = 0; i < v.size(); ++i) w += v[i] != static_cast<float>(want(i));
    return w;
  };
  if (op == "allreduce") return wrong_in(b.a, [&](int64_t) { return n * (n + 1) / 2.0; });
  if (op == "broadcast") return wrong_in(b.a, [](int64_t) { return 1.0; });
  if (op == "allgather") {
    const int64_t k = b.a.numel();
    return wrong_in(b.out, [&](int64_t i) { return double(i / k + 1); });
  }
  if (op == "reduce_scatter") return wrong_in(b.out, [&](int64_t) { return n * (n + 1) / 2.0; });
  int64_t w = 0;
  for (int r = 0; r < n; ++r) w += wrong_in(b.outs[r], [&](int64_t) { return double(r + 1); });
  return w;
}

std::vector<Row> run_rank(const Args& a) {
  auto pg = default_group();
  const int n = pg->size(), rank = pg->rank();
  std::vector<Row> rows;
  for (int64_t bytes = a.min_bytes; bytes <= a.max_bytes; bytes *= 2) {
    int64_t count = bytes / 4;
    if (a.op != "allreduce" && a.op != "broadcast") count = std::max<int64_t>(count / n, 1) * n;
    Bufs b = make_bufs(a.op, count, n, rank);
    issue(*pg, a.op, b)->wait();
    int64_t wrong = count_wrong(a.op, b, n);
    Tensor w = full({1}, static_cast<double>(wrong), kInt64);
    pg->allreduce(w)->wait();
    for (int i = 0; i < a.warmup; ++i) issue(*pg, a.op, b)->wait();
    pg->barrier()->wait();
    const auto t0 = std::chrono::steady_clock::now();
    WorkPtr last;
    for (int i = 0; i < a.iters; ++i) {
      last = issue(*pg, a.op, b);
      if (a.mode == "latency") last->wait();
    }
    last->wait();
    const double us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
        a.iters;
    rows.push_back({count * 4, us, w.to_vector<int64_t>()[0]});
  }
  return rows;
}

// torch's time per size (µs), from bench_collectives_torch.py's "bytes us" lines.
std::map<int64_t, double> run_torch(const Args& a, int n) {
  std::ostringstream cmd;
  cmd << bench::python_script(EMBER_SOURCE_DIR, "benchmarks/collectives/bench_collectives_torch.py")
      << " --np " << n << " --op " << a.op << " --min-bytes " << a.min_bytes << " --max-bytes "
      << a.max_bytes << " --iters " << a.iters << " --warmup " << a.warmup << " --mode " << a.mode;
  std::map<int64_t, double> out;
  FILE* p = ::popen(cmd.str().c_str(), "r");
  if (!p) return out;
  char line[256];
  while (std::fgets(line, sizeof(line), p)) {
    long long bytes = 0;
    double us = 0;
    if (std::sscanf(line, "%lld %lf", &bytes, &us) == 2) out[bytes] = us;
  }
  ::pclose(p);
  return out;
}

void print(const Args& a, int n, const std::vector<Row>& rows,
           const std::map<int64_t, double>& torch) {
  std::printf(
      "# bench_collectives: %s, backend %s, %d ranks, float32, %d iters, %s, median of %d "
      "rounds%s\n",
      a.op.c_str(), a.backend.c_str(), n, a.iters, a.mode.c_str(), a.rounds,
      a.torch ? " (Ember's and torch's rounds alternate)" : "");
  std::printf("%12s %12s %10s %9s %9s %7s", "bytes", "count", "time(us)", "algbw", "busbw",
              "#wrong");
  if (a.torch) std::printf(" %14s %9s %8s", "torch time(us)", "tbusbw", "speedup");
  std::printf("\n");
  for (const Row& r : rows) {
    const double algbw = r.bytes / (r.us * 1e3);  // bytes per µs / 1e3 = GB/s
    const double busbw = algbw * bus_factor(a.op, n);
    std::printf("%12lld %12lld %10.1f %9.3f %9.3f %7lld", (long long)r.bytes,
                (long long)(r.bytes / 4), r.us, algbw, busbw, (long long)r.wrong);
    if (a.torch) {
      auto it = torch.find(r.bytes);
      if (it != torch.end()) {
        std::printf(" %14.1f %9.3f %7.2fx", it->second,
                    r.bytes / (it->second * 1e3) * bus_factor(a.op, n), it->second / r.us);
      } else {
        std::printf(" %14s %9s %8s", "-", "-", "-");
      }
    }
    std::printf("\n");
  }
  std::fflush(stdout);
}

int rank_main(const Args& a) {
  InitOptions o;
  o.backend = a.backend;
  init_process_group(o);
  const int n = get_world_size(), rank = get_rank();
  // Rounds alternate Ember's pass and torch's (rank 0 runs torch while the others wait at a
  // barrier), so slow phases of a noisy machine hit both; medians over rounds.
  std::vector<std::vector<Row>> ours;
  std::vector<std::map<int64_t, double>> theirs;
  for (int r = 0; r < a.rounds; ++r) {
    ours.push_back(run_rank(a));
    if (a.torch && rank == 0) theirs.push_back(run_torch(a, n));
    default_group()->barrier(CollectiveOptions{std::chrono::minutes(30)})->wait();
  }
  destroy_process_group();
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };
  std::vector<Row> rows = ours[0];
  std::map<int64_t, double> torch;
  for (size_t i = 0; i < rows.size(); ++i) {
    std::vector<double> us, tus;
    for (const auto& round : ours) {
      us.push_back(round[i].us);
      rows[i].wrong = std::max(rows[i].wrong, round[i].wrong);
    }
    for (const auto& round : theirs) {
      if (auto it = round.find(rows[i].bytes); it != round.end()) tus.push_back(it->second);
    }
    rows[i].us = median(us);
    if (!tus.empty()) torch[rows[i].bytes] = median(tus);
  }
  if (rank == 0) print(a, n, rows, torch);
  int64_t wrong = 0;
  for (const Row& r : rows) wrong += r.wrong;
  return wrong == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  try {
    if (a.np <= 0) return rank_main(a);
    // --np: fork the ranks here, rendezvous on a free port of 127.0.0.1.
    TCPStoreServerOptions so;
    so.host = "127.0.0.1";
    uint16_t port = 0;
    {
      TCPStoreServer probe(so);  // the OS's pick, then released for rank 0's own server
      port = probe.port();
    }
    std::vector<pid_t> kids;
    for (int r = 0; r < a.np; ++r) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        ::setenv("RANK", std::to_string(r).c_str(), 1);
        ::setenv("WORLD_SIZE", std::to_string(a.np).c_str(), 1);
        ::setenv("MASTER_ADDR", "127.0.0.1", 1);
        ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
        try {
          ::_exit(rank_main(a));
        } catch (const std::exception& e) {
          std::fprintf(stderr, "rank %d: %s\n", r, e.what());
          ::_exit(1);
        }
      }
      kids.push_back(pid);
    }
    int rc = 0;
    for (pid_t pid : kids) {
      int status = 0;
      ::waitpid(pid, &status, 0);
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) rc = 1;
    }
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_collectives: %s\n", e.what());
    return 1;
  }
}
