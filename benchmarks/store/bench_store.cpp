// bench_store: the TCPStore server's operations per second and a client's latency under load,
// beside torch.distributed.TCPStore in the same run.
//
//   bench_store [--ops set,get,add,wait] [--clients 1,8,32] [--seconds 1] [--idle 1000]
//               [--keys 100000] [--rounds 3] [--torch]
//
// Each case runs C clients (threads, each with its own TCPStore and connection) doing one
// operation in a loop for --seconds; ops/s is their total over the time. The cases run first on
// an empty store, then with --idle more clients connected and --keys keys stored ("loaded"); the
// loading itself (the idle clients connecting, 4 clients setting the keys) is timed from a probe
// client doing set+get throughout. With --torch, benchmarks/store/bench_store_torch.py runs the
// same cases against torch's TCPStore after each of Ember's rounds; the table gives medians over
// the rounds and the ratio.
#include <CLI/CLI.hpp>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <ember/distributed/store/tcp_store.h>
#include "benchmarks/bench_util.h"
#include "cmake/build_paths.h"

namespace {

using namespace ember::dist;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

struct Args {
  std::vector<std::string> ops{"set", "get", "add", "wait"};
  std::vector<int> clients{1, 8, 32};
  double seconds = 1.0;
  int idle = 1000;
  int keys = 100000;
  int rounds = 3;
  bool torch = false;
};

// (op, clients, loaded) -> ops/s per round; "probe" -> {p50, p99, max} per round.
using Key = std::tuple<std::string, int, int>;
struct Results {
  std::map<Key, std::vector<double>> ops;
  std::vector<std::vector<double>> probe;
};

const Bytes kValue(64, 'x');

Bytes bytes_of(const std::string& s) { return Bytes(s.begin(), s.end()); }

void do_op(TCPStore& s, const std::string& op, int tid, int64_t i) {
  if (op == "set") {
    s.set("b/" + std::to_string(tid) + "/" + std::to_string(i % 1024), kValue);
  } else if (op == "get") {
    s.get("pre/" + std::to_string(i % 1024), 60s);
  } else if (op == "add") {
    s.add("counter", 1);
  } else {  // wait on a key that exists: returns at once
    s.wait({"pre/" + std::to_string(i % 1024)}, 60s);
  }
}

double rate(uint16_t port, const std::string& op, int clients, double seconds) {
  std::vector<std::unique_ptr<TCPStore>> stores;
  for (int t = 0; t < clients; ++t) {
    stores.push_back(
        std::make_unique<TCPStore>("127.0.0.1", port, TCPStoreOptions{.timeout = 60s}));
    do_op(*stores.back(), op, t, 0);  // connected and warm before the clock starts
  }
  std::atomic<int64_t> total{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < clients; ++t) {
    threads.emplace_back([&, t] {
      while (!go.load()) std::this_thread::yield();
      const auto end = Clock::now() + std::chrono::duration<double>(seconds);
      int64_t n = 0;
      do {
        for (int k = 0; k < 16; ++k) do_op(*stores[t], op, t, n++);
      } while (Clock::now() < end);
      total += n;
    });
  }
  go = true;
  for (auto& th : threads) th.join();
  return static_cast<double>(total.load()) / seconds;
}

// Connects `idle` clients and sets `keys` keys from 4 clients while a probe client times
// set+get; returns {p50, p99, max} in µs. The idle clients stay connected in `held`.
std::vector<double> load_with_probe(uint16_t port, const Args& a,
                                    std::vector<std::unique_ptr<TCPStore>>* held) {
  TCPStore probe("127.0.0.1", port, {.timeout = 60s});
  std::atomic<bool> loading{true};
  std::vector<double> lat;
  std::thread prober([&] {
    for (int64_t i = 0; loading.load(); ++i) {
      const auto t0 = Clock::now();
      probe.set("probe", bytes_of(std::to_string(i)));
      probe.get("probe", 60s);
      lat.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
  });
  for (int c = 0; c < a.idle; ++c) {
    held->push_back(std::make_unique<TCPStore>("127.0.0.1", port, TCPStoreOptions{.timeout = 60s}));
    held->back()->add("connected", 1);
  }
  std::vector<std::thread> setters;
  for (int p = 0; p < 4; ++p) {
    setters.emplace_back([&, p] {
      TCPStore s("127.0.0.1", port, {.timeout = 60s});
      for (int k = p; k < a.keys; k += 4) {
        s.set("key/" + std::to_string(k), bytes_of("value " + std::to_string(k)));
      }
    });
  }
  for (auto& t : setters) t.join();
  loading = false;
  prober.join();
  std::sort(lat.begin(), lat.end());
  if (lat.empty()) return {0, 0, 0};
  return {lat[lat.size() / 2], lat[lat.size() * 99 / 100], lat.back()};
}

void ember_round(const Args& a, Results* r) {
  TCPStoreServer server({.host = "127.0.0.1", .port = 0});
  TCPStore master("127.0.0.1", server.port(), {.timeout = 60s});
  for (int i = 0; i < 1024; ++i) master.set("pre/" + std::to_string(i), kValue);
  for (int loaded = 0; loaded < 2; ++loaded) {
    std::vector<std::unique_ptr<TCPStore>> held;
    if (loaded) r->probe.push_back(load_with_probe(server.port(), a, &held));
    for (const auto& op : a.ops) {
      for (int c : a.clients) {
        r->ops[{op, c, loaded}].push_back(rate(server.port(), op, c, a.seconds));
      }
    }
  }
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ",") + x;
  return s;
}

void torch_round(const Args& a, Results* r) {
  std::string clients;
  for (int c : a.clients) clients += (clients.empty() ? "" : ",") + std::to_string(c);
  std::ostringstream cmd;
  cmd << bench::python_script(EMBER_SOURCE_DIR, "benchmarks/store/bench_store_torch.py")
      << " --ops " << join(a.ops) << " --clients " << clients << " --seconds " << a.seconds
      << " --idle " << a.idle << " --keys " << a.keys;
  FILE* p = ::popen(cmd.str().c_str(), "r");
  if (!p) return;
  char line[256], op[32];
  while (std::fgets(line, sizeof(line), p)) {
    int c = 0, loaded = 0;
    double v = 0, p50 = 0, p99 = 0, mx = 0;
    if (std::sscanf(line, "ops %31s %d %d %lf", op, &c, &loaded, &v) == 4) {
      r->ops[{op, c, loaded}].push_back(v);
    } else if (std::sscanf(line, "probe %lf %lf %lf", &p50, &p99, &mx) == 3) {
      r->probe.push_back({p50, p99, mx});
    }
  }
  ::pclose(p);
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void print(const Args& a, const Results& e, const Results& t) {
  std::printf("\n%-6s %7s %-6s %14s", "op", "clients", "store", "Ember ops/s");
  if (a.torch) std::printf(" %14s %8s", "torch ops/s", "ratio");
  std::printf("\n");
  for (int loaded = 0; loaded < 2; ++loaded) {
    for (const auto& op : a.ops) {
      for (int c : a.clients) {
        const Key k{op, c, loaded};
        const double ev = median(e.ops.count(k) ? e.ops.at(k) : std::vector<double>{});
        std::printf("%-6s %7d %-6s %14.0f", op.c_str(), c, loaded ? "loaded" : "empty", ev);
        if (a.torch) {
          const double tv = median(t.ops.count(k) ? t.ops.at(k) : std::vector<double>{});
          std::printf(" %14.0f %7.1fx", tv, tv > 0 ? ev / tv : 0.0);
        }
        std::printf("\n");
      }
    }
  }
  auto probe = [](const char* who, const Results& r) {
    std::vector<double> p50, p99, mx;
    for (const auto& v : r.probe) {
      p50.push_back(v[0]);
      p99.push_back(v[1]);
      mx.push_back(v[2]);
    }
    std::printf("%s probe set+get while loading: median %.0f us, p99 %.0f us, max %.0f us "
                "(medians over %zu rounds)\n", who, median(p50), median(p99), median(mx),
                r.probe.size());
  };
  std::printf("\n(loaded: %d more clients connected, %d keys stored)\n", a.idle, a.keys);
  probe("Ember", e);
  if (a.torch) probe("torch", t);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"bench_store: TCPStore operations per second and latency under load"};
  app.add_option("--ops", a.ops, "operations: set, get, add, wait")->delimiter(',')
      ->check(CLI::IsMember({"set", "get", "add", "wait"}));
  app.add_option("--clients", a.clients, "concurrent clients per case")->delimiter(',')
      ->check(CLI::Range(1, 4096));
  app.add_option("--seconds", a.seconds, "seconds per case")->check(CLI::Range(0.05, 600.0));
  app.add_option("--idle", a.idle, "clients connected during the loaded cases")
      ->check(CLI::Range(0, 100000));
  app.add_option("--keys", a.keys, "keys stored during the loaded cases")
      ->check(CLI::Range(0, 10000000));
  app.add_option("--rounds", a.rounds, "Ember's and torch's rounds, alternating")
      ->check(CLI::Range(1, 100));
  app.add_flag("--torch", a.torch, "also run torch.distributed.TCPStore (bench_store_torch.py)");
  CLI11_PARSE(app, argc, argv);
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) == 0 && r.rlim_cur < r.rlim_max) {
    r.rlim_cur = r.rlim_max;  // the idle clients and the server's side of them
    ::setrlimit(RLIMIT_NOFILE, &r);
  }
  Results ember, torch;
  for (int round = 0; round < a.rounds; ++round) {
    std::fprintf(stderr, "round %d/%d: Ember\n", round + 1, a.rounds);
    ember_round(a, &ember);
    if (a.torch) {
      std::fprintf(stderr, "round %d/%d: torch\n", round + 1, a.rounds);
      torch_round(a, &torch);
    }
  }
  print(a, ember, torch);
  return 0;
}
