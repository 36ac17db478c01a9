// bench_collectives: collective bandwidth in the style of nccl-tests, beside torch.distributed.
//
//   emberrun -np 2 bench_collectives --backend gloo --op allreduce     (or mpirun -np 2 ...)
//   bench_collectives --np 2 --op all --torch                           (forks its own ranks)
//
// Rank 0 prints one table per op: one line per size with bytes, element count, time per call
// (µs), algbw and busbw (GB/s, as nccl-tests defines them), busbw as a fraction of this
// machine's one-core memcpy bandwidth (measured in the same run: bytes copied per second by one
// memcpy of a 16 MiB buffer, median of several) and #wrong (elements that differ from the closed
// form after one checked call). With --torch it also runs
// benchmarks/collectives/bench_collectives_torch.py (torch.distributed, gloo, same sizes and
// process count) and prints its time, busbw and the ratio.
//
// "bytes" is the size of the largest buffer of one rank: the tensor for allreduce, broadcast
// and reduce; the gathered output for allgather, allgather_list and gather; the input for
// reduce_scatter, reduce_scatter_list, scatter and alltoall. Barrier moves no bytes: one line.
//
// Options: --backend gloo, --op all or a comma-separated list of allreduce, broadcast, reduce,
// allgather (into one tensor), allgather_list, reduce_scatter (from one tensor),
// reduce_scatter_list, gather, scatter, alltoall, barrier; --min-bytes 4096, --max-bytes
// 16777216 (doubling), --iters 20, --warmup 5, --np N (fork N local ranks instead of reading
// RANK/WORLD_SIZE), --torch, --rounds R (default 5: Ember's pass over the sizes and torch's
// alternate R times; each time printed is the median of the R rounds), --mode
// pipelined|latency (pipelined, as nccl-tests: issue `iters` calls, then wait for the last;
// latency: wait for each call before issuing the next), --shareable (every buffer from
// dist::empty_shareable(): over gloo's shared memory the reductions then reduce straight from
// the peers' buffers, Note [mapped reductions]), --pin (with --np: rank r on core r mod cores).
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "benchmarks/bench_util.h"
#include "cmake/build_paths.h"
#include "benchmarks/fork_ranks.h"
#include <ember/distributed/backends/shareable.h>
#include <ember/distributed/init.h>
#include <ember/distributed/store/tcp_store.h>
#include <ember/tensor/ops.h>


using namespace ember;
using namespace ember::dist;

namespace {

struct Args {
  std::string backend = "gloo";
  std::string op = "allreduce";
  std::vector<std::string> ops;  // --op split at commas ("all": every op)
  int64_t min_bytes = 4096;
  int64_t max_bytes = 16 << 20;
  int iters = 20;
  int warmup = 5;
  int np = 0;
  bool torch = false;
  int rounds = 5;
  std::string mode = "pipelined";
  bool shareable = false;
  bool pin = false;
};

const std::vector<std::string> kOps = {
    "allreduce", "broadcast",  "reduce",  "allgather", "allgather_list", "reduce_scatter",
    "reduce_scatter_list",     "gather",  "scatter",   "alltoall",       "barrier"};

std::string join(const std::vector<std::string>& v, const char* sep = ", ") {
  std::string s;
  for (const std::string& x : v) s += (s.empty() ? "" : sep) + x;
  return s;
}

std::vector<std::string> split_ops(const std::string& v) {
  if (v == "all") return kOps;
  std::vector<std::string> out;
  std::stringstream ss(v);
  for (std::string op; std::getline(ss, op, ',');) out.push_back(op);
  return out;
}

Args parse(int argc, char** argv) {
  Args a;
  CLI::App app{"bench_collectives: collective bandwidth in the style of nccl-tests"};
  app.add_option("--backend", a.backend, "process group backend")
      ->check(CLI::IsMember({"gloo", "mpi", "nccl"}));
  app.add_option("--op", a.op, "all, or a comma-separated list of collectives")
      ->check([](const std::string& v) -> std::string {
        for (const std::string& op : split_ops(v)) {
          if (std::find(kOps.begin(), kOps.end(), op) == kOps.end()) {
            return "unknown collective '" + op + "' (expected all or some of " + join(kOps) + ")";
          }
        }
        return "";
      });
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
  app.add_flag("--pin", a.pin,
               "with --np: pin rank r to core r mod cores (the scheduler may otherwise put two "
               "ranks on one core, and a rank then waits for its peer's time slice)");
  app.add_flag("--shareable", a.shareable,
               "buffers from dist::empty_shareable() (the mapped reductions over gloo)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e) == 0 ? 0 : 2);
  }
  a.ops = split_ops(a.op);
  return a;
}

// nccl-tests' bus bandwidth factor: what each rank's links must carry relative to algbw.
// Gather and scatter as nccl-tests' alltoall-like ops: the root's link carries (n-1)/n of the
// buffer.
double bus_factor(const std::string& op, int n) {
  if (op == "allreduce") return 2.0 * (n - 1) / n;
  if (op == "broadcast" || op == "reduce") return 1.0;
  return double(n - 1) / n;
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
  const int64_t k = count / n;
  auto list = [&](double fill) {
    std::vector<Tensor> l;
    for (int r = 0; r < n; ++r) l.push_back(fill > 0 ? full({k}, fill, kFloat32) : empty({k}, kFloat32));
    return l;
  };
  if (op == "allreduce" || op == "broadcast" || op == "reduce") {
    b.a = full({count}, v, kFloat32);
  } else if (op == "allgather" || op == "allgather_list" || op == "gather") {
    b.a = full({k}, v, kFloat32);
    if (op == "allgather") b.out = empty({k * n}, kFloat32);
    if (op == "allgather_list" || (op == "gather" && rank == 0)) b.outs = list(0);
  } else if (op == "reduce_scatter") {
    b.a = full({k * n}, v, kFloat32);
    b.out = empty({k}, kFloat32);
  } else if (op == "reduce_scatter_list" || op == "scatter") {
    if (op == "reduce_scatter_list" || rank == 0) b.ins = list(v);
    b.out = empty({k}, kFloat32);
  } else if (op == "alltoall") {
    b.ins = list(v);
    b.outs = list(0);
  }
  return b;
}

// The same buffers, each moved into memory from empty_shareable().
void make_shareable(Bufs& b) {
  auto move = [](Tensor& t) {
    if (!t.defined()) return;
    Tensor s = empty_shareable(t.shape(), t.dtype());
    s.copy_(t);
    t = s;
  };
  move(b.a);
  move(b.out);
  for (Tensor& t : b.ins) move(t);
  for (Tensor& t : b.outs) move(t);
}

WorkPtr issue(ProcessGroup& pg, const std::string& op, Bufs& b) {
  if (op == "allreduce") return pg.allreduce(b.a);
  if (op == "broadcast") return pg.broadcast(b.a);
  if (op == "reduce") return pg.reduce(b.a);
  if (op == "allgather") return pg.allgather_into_tensor(b.out, b.a);
  if (op == "allgather_list") return pg.allgather(b.outs, b.a);
  if (op == "gather") return pg.gather(b.outs, b.a);
  if (op == "reduce_scatter") return pg.reduce_scatter_tensor(b.out, b.a);
  if (op == "reduce_scatter_list") return pg.reduce_scatter(b.out, b.ins);
  if (op == "scatter") return pg.scatter(b.out, b.ins);
  if (op == "alltoall") return pg.alltoall(b.outs, b.ins);
  return pg.barrier();
}

// Elements that differ from the closed form after one call on fresh buffers (rank r holds r+1;
// root 0).
int64_t count_wrong(const std::string& op, Bufs& b, int n, int rank) {
  auto wrong_in = [](const Tensor& t, const std::function<double(int64_t)>& want) {
    const std::vector<float> v = t.to_vector<float>();
    int64_t w = 0;
    for (size_t i = 0; i < v.size(); ++i) w += v[i] != static_cast<float>(want(i));
    return w;
  };
  auto each_from_rank = [&](const std::vector<Tensor>& l) {
    int64_t w = 0;
    for (int r = 0; r < static_cast<int>(l.size()); ++r)
      w += wrong_in(l[r], [&](int64_t) { return double(r + 1); });
    return w;
  };
  const double sum = n * (n + 1) / 2.0;
  if (op == "allreduce") return wrong_in(b.a, [&](int64_t) { return sum; });
  if (op == "reduce") return rank == 0 ? wrong_in(b.a, [&](int64_t) { return sum; }) : 0;
  if (op == "broadcast") return wrong_in(b.a, [](int64_t) { return 1.0; });
  if (op == "allgather") {
    const int64_t k = b.a.numel();
    return wrong_in(b.out, [&](int64_t i) { return double(i / k + 1); });
  }
  if (op == "allgather_list" || op == "gather" || op == "alltoall") return each_from_rank(b.outs);
  if (op == "reduce_scatter" || op == "reduce_scatter_list")
    return wrong_in(b.out, [&](int64_t) { return sum; });
  if (op == "scatter") return wrong_in(b.out, [](int64_t) { return 1.0; });
  return 0;  // barrier
}

std::vector<Row> run_rank(const Args& a, const std::string& op) {
  auto pg = default_group();
  const int n = pg->size(), rank = pg->rank();
  std::vector<Row> rows;
  const bool barrier = op == "barrier";
  for (int64_t bytes = a.min_bytes; bytes <= a.max_bytes; bytes *= 2) {
    int64_t count = barrier ? 0 : bytes / 4;
    if (!barrier && op != "allreduce" && op != "broadcast" && op != "reduce")
      count = std::max<int64_t>(count / n, 1) * n;
    Bufs b = make_bufs(op, count, n, rank);
    if (a.shareable) make_shareable(b);
    issue(*pg, op, b)->wait();
    int64_t wrong = count_wrong(op, b, n, rank);
    Tensor w = full({1}, static_cast<double>(wrong), kInt64);
    pg->allreduce(w)->wait();
    for (int i = 0; i < a.warmup; ++i) issue(*pg, op, b)->wait();
    pg->barrier()->wait();
    const auto t0 = std::chrono::steady_clock::now();
    WorkPtr last;
    for (int i = 0; i < a.iters; ++i) {
      last = issue(*pg, op, b);
      if (a.mode == "latency") last->wait();
    }
    last->wait();
    const double us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
        a.iters;
    rows.push_back({count * 4, us, w.to_vector<int64_t>()[0]});
    if (barrier) break;
  }
  return rows;
}

// torch's time per op and size (µs), from bench_collectives_torch.py's "op bytes us" lines.
using TorchTimes = std::map<std::string, std::map<int64_t, double>>;

TorchTimes run_torch(const Args& a, int n) {
  std::ostringstream cmd;
  cmd << bench::python_script(EMBER_SOURCE_DIR, "benchmarks/collectives/bench_collectives_torch.py")
      << " --np " << n << " --op " << join(a.ops, ",") << " --min-bytes " << a.min_bytes
      << " --max-bytes " << a.max_bytes << " --iters " << a.iters << " --warmup " << a.warmup
      << " --mode " << a.mode;
  TorchTimes out;
  FILE* p = ::popen(cmd.str().c_str(), "r");
  if (!p) return out;
  char line[256], op[64];
  while (std::fgets(line, sizeof(line), p)) {
    long long bytes = 0;
    double us = 0;
    if (std::sscanf(line, "%63s %lld %lf", op, &bytes, &us) == 3) out[op][bytes] = us;
  }
  ::pclose(p);
  return out;
}

// Bytes copied per second by one memcpy of a 16 MiB buffer on one core (GB/s), median of 9.
double memcpy_gbps() {
  const size_t n = size_t{16} << 20;
  std::vector<char> src(n, 1), dst(n, 0);
  std::vector<double> gbps;
  for (int i = 0; i < 10; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(dst.data(), src.data(), n);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i > 0) gbps.push_back(n / s / 1e9);  // the first call faults the pages in
  }
  std::sort(gbps.begin(), gbps.end());
  return gbps[gbps.size() / 2];
}

void print(const Args& a, const std::string& op, int n, const std::vector<Row>& rows,
           const std::map<int64_t, double>& torch, double memcpy) {
  std::printf(
      "# bench_collectives: %s, backend %s, %d ranks, float32, %d iters, %s, median of %d "
      "rounds%s%s; one-core memcpy %.2f GB/s\n",
      op.c_str(), a.backend.c_str(), n, a.iters, a.mode.c_str(), a.rounds,
      a.torch ? " (Ember's and torch's rounds alternate)" : "",
      a.shareable ? ", shareable buffers" : "", memcpy);
  std::printf("%12s %12s %10s %9s %9s %8s %7s", "bytes", "count", "time(us)", "algbw", "busbw",
              "/memcpy", "#wrong");
  if (a.torch) std::printf(" %14s %9s %8s", "torch time(us)", "tbusbw", "speedup");
  std::printf("\n");
  for (const Row& r : rows) {
    const double algbw = r.bytes / (r.us * 1e3);  // bytes per µs / 1e3 = GB/s
    const double busbw = algbw * bus_factor(op, n);
    std::printf("%12lld %12lld %10.1f %9.3f %9.3f %8.2f %7lld", (long long)r.bytes,
                (long long)(r.bytes / 4), r.us, algbw, busbw, busbw / memcpy, (long long)r.wrong);
    if (a.torch) {
      auto it = torch.find(r.bytes);
      if (it != torch.end()) {
        std::printf(" %14.1f %9.3f %7.2fx", it->second,
                    r.bytes / (it->second * 1e3) * bus_factor(op, n), it->second / r.us);
      } else {
        std::printf(" %14s %9s %8s", "-", "-", "-");
      }
    }
    std::printf("\n");
  }
  std::fflush(stdout);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Per size: the median over rounds of Ember's time (and the worst #wrong) and of torch's time.
std::vector<Row> medians(const std::vector<std::vector<Row>>& ours,
                         const std::vector<std::map<int64_t, double>>& theirs,
                         std::map<int64_t, double>* torch) {
  std::vector<Row> rows = ours[0];
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
    if (!tus.empty()) (*torch)[rows[i].bytes] = median(tus);
  }
  return rows;
}

int rank_main(const Args& a) {
  InitOptions o;
  o.backend = a.backend;
  init_process_group(o);
  const int n = get_world_size(), rank = get_rank();
  // Rounds alternate Ember's pass over every op and torch's (rank 0 runs torch while the others
  // wait at a barrier), so slow phases of a noisy machine hit both; medians over rounds.
  std::map<std::string, std::vector<std::vector<Row>>> ours;
  std::map<std::string, std::vector<std::map<int64_t, double>>> theirs;
  for (int r = 0; r < a.rounds; ++r) {
    for (const std::string& op : a.ops) ours[op].push_back(run_rank(a, op));
    if (a.torch && rank == 0) {
      for (auto& [op, times] : run_torch(a, n)) theirs[op].push_back(std::move(times));
    }
    default_group()->barrier(CollectiveOptions{std::chrono::minutes(30)})->wait();
  }
  destroy_process_group();
  const double memcpy = rank == 0 ? memcpy_gbps() : 0;  // the other ranks are done by now
  int64_t wrong = 0;
  for (const std::string& op : a.ops) {
    std::map<int64_t, double> torch;
    const std::vector<Row> rows = medians(ours[op], theirs[op], &torch);
    if (rank == 0) print(a, op, n, rows, torch, memcpy);
    for (const Row& r : rows) wrong += r.wrong;
  }
  return wrong == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  try {
    if (a.np <= 0) return rank_main(a);
    // --np: fork the ranks here, rendezvous on a free port of 127.0.0.1.
    return bench::fork_ranks("bench_collectives", a.np, [&](int r) {
      if (a.pin) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(r % static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN)), &set);
        if (::sched_setaffinity(0, sizeof(set), &set) != 0) std::perror("sched_setaffinity");
      }
      return rank_main(a);
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_collectives: %s\n", e.what());
    return 1;
  }
}
