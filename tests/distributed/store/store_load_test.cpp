// The store server under load, as a large job's rendezvous and a stranger's connections load
// it: a thousand clients connected at once and a hundred thousand keys, with a client that keeps
// asking throughout. The server runs in a process of its own so that its memory can be read.
// Latencies are printed, not asserted (benchmarks/store/bench_store measures them).
#include <gtest/gtest.h>

#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <memory>
#include <thread>

#include <ember/distributed/store/tcp_store.h>
#include "tests/distributed/store/store_test_util.h"

namespace ember::dist {
namespace {

using namespace std::chrono_literals;
using test::to_bytes;
using test::to_string;

constexpr int kClients = 1000;
constexpr int kKeys = 100000;
constexpr int kLoaders = 4;

// What the loaded server may grow by. Under AddressSanitizer every allocation carries redzones
// and freed blocks stay resident in its quarantine (256 MB by default), so the same server reads
// larger; the bound there still catches a per-connection or per-frame maximum (1000 x 1 MiB).
#if defined(__SANITIZE_ADDRESS__)
constexpr int64_t kMaxGrowth = int64_t{320} << 20;
#else
constexpr int64_t kMaxGrowth = int64_t{96} << 20;
#endif

// Resident memory of process `pid` in bytes (VmRSS), or -1.
int64_t rss_bytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

// Raises the soft limit on open files to what the test needs (the hard limit allowing): the
// clients' sockets here and the server's in its child, which inherits it.
bool enough_files(rlim_t need) {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0) return false;
  if (r.rlim_cur >= need) return true;
  if (r.rlim_max < need) return false;
  r.rlim_cur = need;
  return ::setrlimit(RLIMIT_NOFILE, &r) == 0;
}

TEST(StoreUnderLoad, AThousandClientsAndAHundredThousandKeysWithBoundedMemory) {
  constexpr rlim_t kFiles = 4 * kClients;
  if (!enough_files(kFiles)) GTEST_SKIP() << "needs " << kFiles << " open files (ulimit -n)";
  const uint16_t port = test::unused_port();
  // The server's process: serves until the test says "done", reporting its counters first.
  test::Children server(1, [](int, const std::string& message) {
    TCPStoreServer srv({.host = "127.0.0.1", .port = static_cast<uint16_t>(std::stoi(message))});
    TCPStore self("127.0.0.1", srv.port(), {.timeout = 300s});
    self.wait({"report"}, 300s);
    const TCPStoreServer::Stats s = srv.stats();
    self.set("stats", to_bytes(std::to_string(s.active) + " " + std::to_string(s.buffered_bytes) +
                               " " + std::to_string(s.protocol_errors)));
    self.wait({"done"}, 300s);
  });
  server.go(std::to_string(port));
  TCPStore probe("127.0.0.1", port, {.timeout = 60s});
  probe.set("probe", to_bytes("0"));
  const int64_t rss_idle = rss_bytes(server.pid(0));

  // A client that keeps setting and reading its key while the others connect and load.
  std::atomic<bool> loading{true};
  std::vector<double> latency_us;
  std::thread prober([&] {
    for (int64_t i = 1; loading.load(); ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      probe.set("probe", to_bytes(std::to_string(i)));
      const std::string got = to_string(probe.get("probe", 10s));
      latency_us.push_back(std::chrono::duration<double, std::micro>(
                               std::chrono::steady_clock::now() - t0).count());
      if (got != std::to_string(i)) throw std::runtime_error("probe read " + got);
    }
  });
  std::vector<std::unique_ptr<TCPStore>> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.push_back(
        std::make_unique<TCPStore>("127.0.0.1", port, TCPStoreOptions{.timeout = 60s}));
    clients.back()->add("connected", 1);  // each holds an open (pooled) connection from here on
  }
  std::vector<std::thread> loaders;
  for (int l = 0; l < kLoaders; ++l) {
    loaders.emplace_back([&, l] {
      TCPStore& c = *clients[l];
      for (int k = l; k < kKeys; k += kLoaders) {
        c.set("key/" + std::to_string(k), to_bytes("value " + std::to_string(k)));
      }
    });
  }
  for (auto& t : loaders) t.join();
  loading = false;
  prober.join();

  EXPECT_EQ(probe.add("connected", 0), kClients);
  EXPECT_EQ(probe.num_keys(), kKeys + 2);  // the keys, "connected", "probe"
  for (int k : {0, 1, kKeys / 2, kKeys - 1}) {
    EXPECT_EQ(to_string(clients[k % kClients]->get("key/" + std::to_string(k), 10s)),
              "value " + std::to_string(k));
  }
  const int64_t rss_loaded = rss_bytes(server.pid(0));
  probe.set("report", to_bytes("1"));
  std::istringstream stats(to_string(probe.get("stats", 60s)));
  int64_t active = 0, buffered = 0, protocol_errors = 0;
  stats >> active >> buffered >> protocol_errors;
  probe.set("done", to_bytes("1"));
  test::expect_children_ok(server.join(60000));

  // Every client is still connected; the idle ones hold no receive buffers to speak of; the
  // keys cost their bytes and bookkeeping, not a per-connection or per-frame maximum.
  EXPECT_GE(active, kClients + 2);
  EXPECT_EQ(protocol_errors, 0);
  EXPECT_LT(buffered, int64_t{kClients} * 4096) << "receive buffers of idle connections";
  ASSERT_GT(rss_idle, 0);
  const int64_t grown = rss_loaded - rss_idle;
  EXPECT_LT(grown, kMaxGrowth) << "the server grew by " << grown << " bytes";
  std::sort(latency_us.begin(), latency_us.end());
  ASSERT_FALSE(latency_us.empty());
  std::printf("server RSS %.1f MB idle, %.1f MB with %d clients and %d keys; probe set+get: %zu "
              "calls, median %.0f us, p99 %.0f us, max %.0f us\n",
              rss_idle / 1e6, rss_loaded / 1e6, kClients, kKeys, latency_us.size(),
              latency_us[latency_us.size() / 2], latency_us[latency_us.size() * 99 / 100],
              latency_us.back());
}

}  // namespace
}  // namespace ember::dist
