// ProcessGroupGloo's latency fast path (Note [inline collectives] in process_group_gloo.cpp):
// on a group with shared memory, a small allreduce, allreduce_coalesced or barrier issued while
// nothing of this rank is in flight runs on the calling thread and returns a completed Work,
// with the same results, errors and callbacks as one run by a worker; the barrier meets the
// ranks through shared memory and still orders every earlier collective.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <ember/distributed/backends/process_group_gloo.h>
#include <ember/distributed/store/prefix_store.h>
#include <ember/distributed/store/tcp_store.h>
#include <ember/tensor/ops.h>
#include "tests/distributed/store/store_test_util.h"
#include "tests/distributed/require_gloo.h"

namespace ember::dist {
namespace {

using namespace std::chrono_literals;
using test::require;

using Body = std::function<void(ProcessGroupGloo& pg, int rank, Store& store)>;

/// Forks n ranks joined into a gloo group with shared memory (checked) and a collective timeout
/// of `timeout`; returns the ranks' failures, one line each.
std::vector<std::string> run_ranks(int n, Duration timeout, const Body& body) {
  test::Children kids(n, [&](int rank, const std::string& port) {
    TCPStoreOptions so;
    so.timeout = 60s;
    auto store =
        std::make_shared<TCPStore>("127.0.0.1", static_cast<uint16_t>(std::stoi(port)), so);
    ProcessGroupGloo pg(std::make_shared<PrefixStore>("pg", store), rank, n,
                        ProcessGroupGloo::GlooOptions{timeout, "127.0.0.1"});
    require(pg.uses_shared_memory(), "rank " + std::to_string(rank) + ": no shared memory");
    body(pg, rank, *store);
  });
  TCPStoreServerOptions o;
  o.host = "127.0.0.1";
  TCPStoreServer server(o);
  kids.go(std::to_string(server.port()));
  return kids.join(120000);
}

// Every element of t equals `want` (exact: the test values are small integers).
void require_all(const std::string& what, const Tensor& t, double want) {
  if (equal(t, full(t.shape(), want, t.dtype()))) return;
  const std::vector<double> got = t.to(kFloat64).reshape({-1}).to_vector<double>();
  for (size_t i = 0; i < got.size(); ++i) {
    require(got[i] == want, what + ": index " + std::to_string(i) + " is " +
                                std::to_string(got[i]) + ", want " + std::to_string(want));
  }
}

/// The message of w's error ("" if it succeeded); w must already be completed.
std::string error_of(const WorkPtr& w) {
  require(w->is_completed(), w->describe() + " is not completed when the call returned");
  try {
    w->wait();
  } catch (const DistError& e) {
    return e.what();
  }
  return {};
}

class GlooFastPath : public ::testing::TestWithParam<int> {};

TEST_P(GlooFastPath, SmallCollectivesCompleteBeforeTheCallReturns) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  test::expect_children_ok(run_ranks(n, 60s, [n](ProcessGroupGloo& pg, int rank, Store&) {
    const double sum = n * (n + 1) / 2.0;
    for (int k = 0; k < 20; ++k) {
      Tensor t = full({1024}, rank + 1.0, kFloat32);  // 4 KiB
      WorkPtr w = pg.allreduce(t);
      require(error_of(w).empty(), "allreduce failed");
      require_all("allreduce #" + std::to_string(k), t, sum);

      Tensor avg = full({7}, 2.0 * (rank + 1), kFloat64);
      w = pg.allreduce(avg, {ReduceOp::Avg, {}});
      require(error_of(w).empty(), "allreduce (avg) failed");
      require_all("allreduce (avg)", avg, n + 1.0);

      std::vector<Tensor> ts = {full({3}, rank + 1.0, kInt64), full({2, 5}, rank + 1.0, kInt64)};
      w = pg.allreduce_coalesced(ts);
      require(error_of(w).empty(), "allreduce_coalesced failed");
      require_all("allreduce_coalesced[0]", ts[0], sum);
      require_all("allreduce_coalesced[1]", ts[1], sum);

      require(error_of(pg.barrier()).empty(), "barrier failed");
    }
  }));
}

// A large allreduce goes to a worker; a small one issued while it is in flight waits behind it
// (it is queued, not run inline ahead of it), and a barrier after both completes only after
// both, over shared memory.
TEST_P(GlooFastPath, SmallCollectivesBehindALargeOneKeepTheirOrder) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  test::expect_children_ok(run_ranks(n, 60s, [n](ProcessGroupGloo& pg, int rank, Store&) {
    const double sum = n * (n + 1) / 2.0;
    for (int k = 0; k < 3; ++k) {
      Tensor big = full({int64_t{1} << 21}, rank + 1.0, kFloat32);  // 8 MiB
      Tensor small = full({16}, rank + 1.0, kFloat32);
      WorkPtr wb = pg.allreduce(big);
      WorkPtr ws = pg.allreduce(small);
      pg.barrier()->wait();
      for (const WorkPtr& w : {wb, ws}) {
        require(w->is_completed(), w->describe() + " still running after the barrier");
        require(w->is_success(), w->describe() + " failed");
      }
      require_all("large allreduce", big, sum);
      require_all("small allreduce behind it", small, sum);
    }
  }));
}

// The barrier meets the ranks: a store key that every rank sets before the barrier is there
// for every rank after it, round after round.
TEST_P(GlooFastPath, BarrierOverSharedMemoryWaitsForEveryRank) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  test::expect_children_ok(run_ranks(n, 60s, [n](ProcessGroupGloo& pg, int rank, Store& store) {
    for (int k = 0; k < 20; ++k) {
      // A rank that is slow to arrive: the others must not pass the barrier before it does.
      if (rank == k % n) std::this_thread::sleep_for(20ms);
      store.set("before/" + std::to_string(k) + "/" + std::to_string(rank), std::string("1"));
      WorkPtr w = pg.barrier();
      require(error_of(w).empty(), "barrier failed");
      std::vector<std::string> keys;
      for (int r = 0; r < n; ++r)
        keys.push_back("before/" + std::to_string(k) + "/" + std::to_string(r));
      require(store.check(keys), "rank " + std::to_string(rank) + " passed barrier " +
                                     std::to_string(k) + " before every rank reached it");
    }
  }));
}

TEST_P(GlooFastPath, ThenCallbackRunsAndStillCannotIssueCollectives) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  test::expect_children_ok(run_ranks(n, 60s, [n](ProcessGroupGloo& pg, int rank, Store&) {
    Tensor t = full({256}, rank + 1.0, kFloat32);
    WorkPtr w = pg.allreduce(t);
    bool ran = false;
    std::string refused;
    auto next = w->future()->then([&](Future& f) {
      ran = true;
      Tensor other = zeros({1});
      try {
        pg.allreduce(other);
      } catch (const ValueError& e) {
        refused = e.what();
      }
      return std::vector<Tensor>{f.value()[0] * 2.0};
    });
    require(ran, "the then() callback of a completed allreduce did not run");
    require(refused.find("Future callback") != std::string::npos,
            "a collective issued from the callback was not refused: '" + refused + "'");
    next->wait(10s);
    require_all("then()'s value", next->value()[0], n * (n + 1.0));
    // The group is still in step: the refused collective took no sequence number or ticket.
    Tensor u = full({8}, 1.0, kFloat32);
    pg.allreduce(u)->wait();
    require_all("allreduce after the callback", u, n);
  }));
}

// Ranks that pass different counts get a failed Work (the call itself does not throw) whose
// error names both ranks and counts; the group is then unusable and says so.
TEST_P(GlooFastPath, MismatchedCountsFailTheWorkNamingTheRanks) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  test::expect_children_ok(run_ranks(n, 20s, [](ProcessGroupGloo& pg, int rank, Store&) {
    Tensor t = full({100 + rank}, 1.0, kFloat32);
    WorkPtr w = pg.allreduce(t);
    const std::string msg = error_of(w);
    require(!w->is_success() && w->exception(), "the Work does not record the error");
    // This rank's finding, or a peer's carried by its abort record (Note [abort through the
    // store]), which names that peer's count instead.
    const bool heard = msg.find(" aborted the group at its allreduce #0") != std::string::npos;
    std::vector<std::string> parts = {"[gloo] allreduce #0 on rank " + std::to_string(rank),
                                      "ranks disagree", " passed ", " elements", " but rank "};
    if (!heard) {
      parts.push_back("rank " + std::to_string(rank) + " passed ");
      parts.push_back(" " + std::to_string(100 + rank) + " elements");
    }
    for (const std::string& part : parts) {
      require(msg.find(part) != std::string::npos, "message lacks '" + part + "': " + msg);
    }
    const std::string again = error_of(pg.barrier());
    require(again.find("[gloo] barrier #1") != std::string::npos &&
                again.find("unusable") != std::string::npos,
            "barrier after the failure: " + again);
  }));
}

// A killed peer is named (by its exit, long before the timeout) in the Work of a small
// allreduce run on the calling thread.
TEST_P(GlooFastPath, DeadPeerIsNamedInTheWork) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  const int victim = n - 1;
  std::vector<std::string> errors =
      run_ranks(n, 60s, [victim](ProcessGroupGloo& pg, int rank, Store&) {
        Tensor t = full({64}, 1.0, kFloat32);
        pg.allreduce(t)->wait();
        if (rank == victim) ::kill(::getpid(), SIGKILL);
        const std::string msg = error_of(pg.allreduce(t));
        const std::string named = "rank " + std::to_string(victim) + " (pid ";
        require(
            msg.find("[gloo] allreduce #1 on rank " + std::to_string(rank)) != std::string::npos,
            "message lacks the collective: " + msg);
        // Named by this rank, or by a survivor that saw it first and made the group give up.
        require(msg.find(named) != std::string::npos || msg.find("gave up") != std::string::npos,
                "message names neither the dead rank nor the survivor that gave up: " + msg);
      });
  ASSERT_FALSE(errors.empty()) << "the victim should have died without a report";
  EXPECT_NE(errors.back().find("child " + std::to_string(victim) + ": died"), std::string::npos)
      << errors.back();
  errors.pop_back();
  test::expect_children_ok(errors);
}

// A peer that never joins: the call returns (at the call's timeout) a Work failed with a
// timeout error, rather than throwing.
TEST_P(GlooFastPath, StalledPeerTimesOutAsAWorkError) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  test::expect_children_ok(run_ranks(n, 60s, [n](ProcessGroupGloo& pg, int rank, Store& store) {
    if (rank == n - 1) {
      for (int r = 0; r < n - 1; ++r) store.get("seen/" + std::to_string(r), 60s);
      return;
    }
    Tensor t = full({64}, 1.0, kFloat32);
    WorkPtr w = pg.allreduce(t, {ReduceOp::Sum, 300ms});
    const std::string msg = error_of(w);
    store.set("seen/" + std::to_string(rank), std::string("1"));
    require(msg.find("timed out after 300 ms") != std::string::npos ||
                msg.find("gave up") != std::string::npos,
            "not a timeout: " + msg);
    require(w->exception() != nullptr, "the Work does not record the error");
  }));
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, GlooFastPath, ::testing::Values(2, 3),
                         [](const auto& info) { return "n" + std::to_string(info.param); });

}  // namespace
}  // namespace ember::dist
