// Helpers of the tests that drive ShmAllreduce itself (shm_single_copy_test, shm_mapped_test):
// ranks as forked processes sharing a TCPStore, or as threads of this process sharing a
// HashStore, and a group made under a prefix of that store.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <ember/distributed/backends/detail/shm_allreduce.h>
#include <ember/distributed/store/hash_store.h>
#include <ember/distributed/store/prefix_store.h>
#include <ember/distributed/store/tcp_store.h>
#include <gtest/gtest.h>

#include "tests/distributed/store/store_test_util.h"

namespace ember::test {

using dist::HashStore;
using dist::PrefixStore;
using dist::Store;
using dist::TCPStore;
using dist::TCPStoreOptions;
using dist::TCPStoreServer;
using dist::TCPStoreServerOptions;

using ShmClock = ember::dist::detail::ShmAllreduce::Clock;

inline ShmClock::time_point soon() { return ShmClock::now() + std::chrono::seconds(30); }

inline std::shared_ptr<TCPStore> shm_test_client(const std::string& port) {
  TCPStoreOptions o;
  o.timeout = std::chrono::seconds(60);
  return std::make_shared<TCPStore>("127.0.0.1", static_cast<uint16_t>(std::stoi(port)), o);
}

/// body(rank, store) in n forked ranks sharing a TCPStore.
inline void run_processes(int n, const std::function<void(int, Store&)>& body) {
  Children kids(n, [&](int rank, const std::string& port) {
    auto store = shm_test_client(port);
    body(rank, *store);
  });
  TCPStoreServerOptions o;
  o.host = "127.0.0.1";
  TCPStoreServer server(o);
  kids.go(std::to_string(server.port()));
  expect_children_ok(kids.join());
}

/// body(rank, store) in n threads of this process sharing a HashStore; the first error wins.
inline void run_threads(int n, const std::function<void(int, Store&)>& body) {
  HashStore store(std::chrono::seconds(60));
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r, store);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = "thread " + std::to_string(r) + ": " + e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const std::string& e : errors) EXPECT_EQ(e, "");
}

/// The shared-memory group of `n` ranks under `prefix` of `store` (2 channels), asking for
/// single copies from `single_copy` bytes (SIZE_MAX: none).
inline std::unique_ptr<ember::dist::detail::ShmAllreduce> make_shm(Store& store, const char* prefix,
                                                             int rank, int n,
                                                             size_t single_copy) {
  PrefixStore p(prefix, std::shared_ptr<Store>(&store, [](Store*) {}));
  auto shm = ember::dist::detail::ShmAllreduce::create(p, rank, n, 2, std::chrono::seconds(60),
                                                 single_copy);
  require(shm != nullptr, "rank " + std::to_string(rank) + ": no shared-memory group");
  return shm;
}

}  // namespace ember::test
