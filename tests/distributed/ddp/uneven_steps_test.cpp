// Ranks that run uneven numbers of steps (one rank issues a collective the other never issues):
// every rank's collective fails within the group's timeout, naming the collective and where the
// other rank is (its sequence number, or that it left the group), with debug off or
// EMBER_DISTRIBUTED_DEBUG=DETAIL (CheckedProcessGroup), over shared memory or Gloo's TCP. And a
// group's destruction ends within its bound when the store's host goes away meanwhile.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ember/distributed/backends/process_group_gloo.h>
#include <ember/distributed/debug/debug.h>
#include <ember/distributed/store/prefix_store.h>
#include <ember/distributed/store/tcp_store.h>
#include "tests/distributed/store/store_test_util.h"
#include "tests/distributed/require_gloo.h"

namespace ember::dist {
namespace {

using namespace std::chrono_literals;
using test::require;
using test::to_string;

constexpr auto kTimeout = 5000ms;
constexpr int kSteps = 3;  // allreduces both ranks issue before rank 1's extra one

/// What rank 0 does while rank 1 issues its extra allreduce.
enum class Rank0 {
  Exits,          // destroys its group and its process ends
  Leaves,         // destroys its group but its process waits (for rank 1's verdict)
  Idles,          // keeps its group but issues nothing (waits for rank 1's verdict)
  Barrier,        // issues a barrier instead
  Allreduce,      // issues an allreduce of another size
  EvalBarrier,    // the same on the gloo group itself, as an evaluation does beside DDP's
  EvalAllreduce,  // checked group under DETAIL (examples/fashion_mnist's evaluate())
};
const char* name(Rank0 r) {
  switch (r) {
    case Rank0::Exits:
      return "Exits";
    case Rank0::Leaves:
      return "Leaves";
    case Rank0::Idles:
      return "Idles";
    case Rank0::Barrier:
      return "Barrier";
    case Rank0::Allreduce:
      return "Allreduce";
    case Rank0::EvalBarrier:
      return "EvalBarrier";
    case Rank0::EvalAllreduce:
      return "EvalAllreduce";
  }
  return "?";
}

struct Case {
  bool detail;  // wrapped in CheckedProcessGroup (EMBER_DISTRIBUTED_DEBUG=DETAIL's checks)
  bool shm;     // GlooOptions::shared_memory
  Rank0 rank0;
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << (c.detail ? "DETAIL" : "OFF") << (c.shm ? " shm" : " tcp") << ", rank 0 " << name(c.rank0);
}

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Runs `f` (a collective and its wait) and returns its error, checking that it came within the
// timeout (plus the slack that GlooWork's wait allows the worker's own error).
std::string failure_of(const std::function<void()>& f, const std::string& who) {
  const auto start = std::chrono::steady_clock::now();
  const std::string msg = test::message_of(f);
  const auto took = std::chrono::steady_clock::now() - start;
  require(!msg.empty(), who + ": did not fail");
  require(took < kTimeout + 2s,
          who + ": failed only after " +
              std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()) +
              " ms: " + msg);
  return msg;
}

void require_has(const std::string& msg, const std::string& part, const std::string& who) {
  require(has(msg, part), who + "'s error lacks '" + part + "': " + msg);
}

// One of several diagnoses, any of which is right: which a rank gives depends on which of the
// failure's paths reaches it first (its own finding, or a peer's abort record naming the peer's
// collective).
void require_any(const std::string& msg, const std::vector<std::string>& parts,
                 const std::string& who) {
  std::string all;
  for (const std::string& p : parts) {
    if (has(msg, p)) return;
    all += (all.empty() ? "'" : " or '") + p + "'";
  }
  require(false, who + "'s error has none of " + all + ": " + msg);
}

// `msg` names `label` as rank `r`'s position: where it failed or, under DETAIL, what it issued
// last (written as it issued it: the peer may read that before the failure's), or, when rank r
// found the failure first and aborted the group before this rank's own check ended (a loaded
// machine), where it aborted.
void require_at(const std::string& msg, int r, const std::string& label, const std::string& who) {
  const std::string rank = "rank " + std::to_string(r);
  require(has(msg, rank + " was at " + label + " when it failed") ||
              has(msg, rank + " last issued " + label + " (EMBER_DISTRIBUTED_DEBUG=DETAIL)") ||
              has(msg, rank + " aborted the group at its " + label),
          who + "'s error does not place " + rank + " at " + label + ": " + msg);
}

// Rank 1's error for its extra allreduce, given what rank 0 did.
void check_rank1(const Case& c, const std::string& msg) {
  // Under DETAIL each checked collective is the check's all-gather then the collective on the
  // gloo group, which so counts two operations per checked one.
  const int gloo_seq = c.detail ? 2 * kSteps : kSteps;
  const std::string who = "rank 1";
  const bool checked_both = c.detail && (c.rank0 == Rank0::Barrier || c.rank0 == Rank0::Allreduce);
  if (checked_both) {  // the check itself finds the difference
    require_has(msg,
                "[CheckedProcessGroup] collective #3 on rank 1 of 2 differs across ranks: ", who);
    require_has(msg, "but rank 1 called allreduce(float32 [1000], sum) (its collective #3)", who);
  } else if (c.detail) {
    require_has(msg,
                "[CheckedProcessGroup] rank 1 of 2: the check before its collective #3, "
                "allreduce(float32 [1000], sum), failed: ",
                who);
    require_has(msg, "[gloo] allgather_into_tensor #" + std::to_string(gloo_seq), who);
  } else {
    require_has(msg, "[gloo] allreduce #3 on rank 1 of 2", who);
  }
  switch (c.rank0) {
    case Rank0::Exits:
    case Rank0::Leaves:
      require_has(msg,
                  "rank 0 left the group after issuing " + std::to_string(gloo_seq) +
                      " operations (the last: allreduce #" + std::to_string(gloo_seq - 1) + ")",
                  who);
      break;
    case Rank0::Idles:  // under DETAIL every rank records each operation as it issues it
      require_has(msg, c.detail ? "rank 0 last issued allreduce #5" : "rank(s) 0 wrote no position",
                  who);
      break;
    case Rank0::Barrier:
      if (c.detail) {
        require_has(msg, "rank 0 called barrier() (its collective #3)", who);
      } else {
        // The disagreement (over TCP "issued", over shared memory "passed") names rank 0's
        // barrier too: rank 0 may write its position later than this rank waits for it on a
        // loaded machine.
        require_any(msg, {"rank 0 was at barrier #3 when it failed",
                          "rank 0 aborted the group at its barrier #3",
                          "ranks disagree: rank 0 issued barrier as its collective #3",
                          "rank 0 passed barrier"}, who);
      }
      break;
    case Rank0::Allreduce:
      if (c.detail) {
        require_has(msg, "rank 0 called allreduce(float64 [3], sum) (its collective #3)", who);
      } else {
        require_any(msg, {"rank 0 was at allreduce #3 when it failed",
                          "rank 0 aborted the group at its allreduce #3",
                          "ranks disagree: rank 0 issued allreduce (sum) of 3 elements of float64 "
                          "as its collective #3",
                          "rank 0 passed allreduce (sum) of 3 elements of float64"}, who);
      }
      break;
    case Rank0::EvalBarrier:
    case Rank0::EvalAllreduce:
      require_at(msg, 0,
                 std::string(c.rank0 == Rank0::EvalBarrier ? "barrier" : "allreduce") + " #" +
                     std::to_string(gloo_seq),
                 who);
      break;
  }
}

class UnevenSteps : public ::testing::TestWithParam<Case> {};

TEST_P(UnevenSteps, EveryRankFailsWithinTheTimeoutNamingBothSequences) {
  EMBER_REQUIRE_GLOO();
  const Case c = GetParam();
  test::Children kids(2, [&](int rank, const std::string& port) {
    if (c.detail) ::setenv("EMBER_DISTRIBUTED_DEBUG", "DETAIL", 1);  // in this child only
    TCPStoreOptions so;
    so.timeout = 60s;
    auto store =
        std::make_shared<TCPStore>("127.0.0.1", static_cast<uint16_t>(std::stoi(port)), so);
    ProcessGroupGloo::GlooOptions o{kTimeout, "127.0.0.1"};
    o.shared_memory = c.shm;
    auto gloo =
        std::make_shared<ProcessGroupGloo>(std::make_shared<PrefixStore>("pg", store), rank, 2, o);
    require(gloo->uses_shared_memory() == c.shm, "uses_shared_memory()");
    std::shared_ptr<ProcessGroup> pg = gloo;
    if (c.detail) pg = std::make_shared<CheckedProcessGroup>(gloo);
    Tensor t = full({1000}, 1.0, kFloat32);
    for (int i = 0; i < kSteps; ++i) pg->allreduce(t)->wait();
    if (rank == 1) {
      const std::string msg = failure_of([&] { pg->allreduce(t)->wait(); }, "rank 1");
      store->set("verdict_1", std::string("1"));
      check_rank1(c, msg);
      return;
    }
    const bool eval = c.rank0 == Rank0::EvalBarrier || c.rank0 == Rank0::EvalAllreduce;
    ProcessGroup& group = eval ? *gloo : *pg;
    Tensor other = full({3}, 1.0, kFloat64);
    std::string msg;
    switch (c.rank0) {
      case Rank0::Exits:
        return;
      case Rank0::Leaves:
        pg.reset();
        gloo.reset();
        store->get("verdict_1", 60s);
        return;
      case Rank0::Idles:
        store->get("verdict_1", 60s);
        return;
      case Rank0::Barrier:
      case Rank0::EvalBarrier:
        msg = failure_of([&] { group.barrier()->wait(); }, "rank 0");
        break;
      case Rank0::Allreduce:
      case Rank0::EvalAllreduce:
        msg = failure_of([&] { group.allreduce(other)->wait(); }, "rank 0");
        break;
    }
    // Rank 0 names its own collective and rank 1's allreduce (or, under DETAIL, its check).
    require_has(
        msg, c.rank0 == Rank0::Barrier || c.rank0 == Rank0::EvalBarrier ? "barrier" : "allreduce",
        "rank 0");
    if (c.detail && !eval) {
      require_has(msg, "rank 1 called allreduce(float32 [1000], sum) (its collective #3)",
                  "rank 0");
    } else if (c.shm && !c.detail && has(msg, "ranks disagree: ")) {
      // Over shared memory rank 0 may see rank 1's allreduce in the segment before any
      // position is written (or learn of rank 1's own finding through its abort): that finding
      // names it too.
      require_has(msg, "rank 1 passed allreduce (sum) of 1000 elements of float32", "rank 0");
    } else {
      require_at(msg, 1, c.detail ? "allgather_into_tensor #6" : "allreduce #3", "rank 0");
    }
  });
  TCPStoreServerOptions so;
  so.host = "127.0.0.1";
  TCPStoreServer server(so);
  kids.go(std::to_string(server.port()));
  test::expect_children_ok(kids.join(60000));
}

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (bool detail : {false, true}) {
    for (bool shm : {true, false}) {
      for (Rank0 r : {Rank0::Exits, Rank0::Leaves, Rank0::Idles, Rank0::Barrier, Rank0::Allreduce,
                      Rank0::EvalBarrier, Rank0::EvalAllreduce}) {
        const bool eval = r == Rank0::EvalBarrier || r == Rank0::EvalAllreduce;
        if (!eval || detail) out.push_back({detail, shm, r});  // without DETAIL: the same
      }
    }
  }
  return out;
}
INSTANTIATE_TEST_SUITE_P(Cases, UnevenSteps, ::testing::ValuesIn(all_cases()),
                         [](const auto& info) {
                           const Case& c = info.param;
                           return std::string(c.detail ? "Detail" : "Off") +
                                  (c.shm ? "Shm" : "Tcp") + "_Rank0" + name(c.rank0);
                         });

// A client of the group's store, whose server this child hosts (in `*server`) when `hosts`; the
// host tells the others its port through the parent's store.
std::shared_ptr<TCPStore> job_store(TCPStore& parent, bool hosts, const TCPStoreOptions& so,
                                    std::unique_ptr<TCPStoreServer>* server) {
  if (hosts) {
    TCPStoreServerOptions o;
    o.host = "127.0.0.1";
    *server = std::make_unique<TCPStoreServer>(o);
    parent.set("port", std::to_string((*server)->port()));
  }
  const std::string port = to_string(parent.get("port", 60s));
  return std::make_shared<TCPStore>("127.0.0.1", static_cast<uint16_t>(std::stoi(port)), so);
}

// As under emberrun, rank 0's process hosts the group's store: when it exits, the store goes
// with it, and rank 1's extra allreduce must still fail within the timeout (the store's own
// timeout is a minute here), saying where rank 0 stands if it could still read it.
TEST(UnevenStepsStore, RankThatHostsTheStoreExits) {
  EMBER_REQUIRE_GLOO();
  for (bool shm : {true, false}) {
    test::Children kids(2, [&](int rank, const std::string& port) {
      TCPStoreOptions so;
      so.timeout = 60s;
      TCPStore parent("127.0.0.1", static_cast<uint16_t>(std::stoi(port)), so);
      std::unique_ptr<TCPStoreServer> server;
      auto store = job_store(parent, rank == 0, so, &server);
      ProcessGroupGloo::GlooOptions o{kTimeout, "127.0.0.1"};
      o.shared_memory = shm;
      ProcessGroupGloo pg(std::make_shared<PrefixStore>("pg", store), rank, 2, o);
      Tensor t = full({1000}, 1.0, kFloat32);
      for (int i = 0; i < kSteps; ++i) pg.allreduce(t)->wait();
      if (rank == 0) return;  // the group, then the store's server, then the process end
      const std::string msg = failure_of([&] { pg.allreduce(t)->wait(); }, "rank 1");
      require_has(msg, "[gloo] allreduce #3 on rank 1 of 2", "rank 1");
      require(has(msg, "rank 0 left the group after issuing 3 operations") ||
                  has(msg, "the group's store did not answer"),
              "rank 1's error: " + msg);
    });
    TCPStoreServerOptions so;
    so.host = "127.0.0.1";
    TCPStoreServer server(so);
    kids.go(std::to_string(server.port()));
    test::expect_children_ok(kids.join(60000));
  }
}

// A group's store that stops the store's server right after answering one read of `probe` once
// armed: the process that hosts the store exits between the probe that a group's destruction
// makes and its write of where the rank stands (Note [where a rank stands]). Records the
// bounded write that follows and what it threw.
class StoreHostExitsAfterProbe : public Store {
 public:
  StoreHostExitsAfterProbe(std::shared_ptr<Store> inner, TCPStoreServer* server, std::string probe)
      : Store(inner->timeout()), inner_(std::move(inner)), server_(server), probe_(probe) {}
  void arm() { armed_ = true; }
  bool server_stopped() const { return stopped_; }
  std::string write_seen() {
    std::lock_guard<std::mutex> lock(mu_);
    return write_seen_;
  }

  void set(const std::string& key, const Bytes& value) override { inner_->set(key, value); }
  void set_within(const std::string& key, const Bytes& value, Duration timeout) override {
    if (!stopped_) return inner_->set_within(key, value, timeout);
    std::string seen = key + " within " + std::to_string(timeout.count()) + " ms: ";
    try {
      inner_->set_within(key, value, timeout);
      seen += "written";
    } catch (const std::exception& e) {
      seen += e.what();
      record(seen);
      throw;
    }
    record(seen);
  }
  Bytes get(const std::string& key, Duration timeout) override {
    Bytes b = inner_->get(key, timeout);
    if (key == probe_ && armed_.exchange(false)) {
      server_->stop();
      stopped_ = true;
    }
    return b;
  }
  int64_t add(const std::string& key, int64_t delta) override { return inner_->add(key, delta); }
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override {
    return inner_->compare_set(key, expected, desired);
  }
  bool check(const std::vector<std::string>& keys) override { return inner_->check(keys); }
  void wait(const std::vector<std::string>& keys, Duration timeout) override {
    inner_->wait(keys, timeout);
  }
  bool delete_key(const std::string& key) override { return inner_->delete_key(key); }
  int64_t num_keys() override { return inner_->num_keys(); }

 private:
  void record(const std::string& seen) {
    std::lock_guard<std::mutex> lock(mu_);
    write_seen_ = seen;
  }

  std::shared_ptr<Store> inner_;
  TCPStoreServer* server_;
  std::string probe_;
  std::atomic<bool> armed_{false}, stopped_{false};
  std::mutex mu_;
  std::string write_seen_;
};

// The race behind a job that ended with one rank never exiting: the rank that hosts the store
// exits just after another rank's group, being destroyed, found the store answering, and that
// rank's write of where it stands then retried the refused connection for the store's own
// timeout (ten minutes here). Its destruction must end within the bound instead; the children
// are given a minute.
TEST(UnevenStepsStore, StoreHostExitingDuringAGroupsDestructionCostsOnlyTheBound) {
  EMBER_REQUIRE_GLOO();
  test::Children kids(2, [&](int rank, const std::string& port) {
    TCPStoreOptions so;
    so.timeout = std::chrono::minutes(10);
    TCPStore parent("127.0.0.1", static_cast<uint16_t>(std::stoi(port)), so);
    std::unique_ptr<TCPStoreServer> server;  // the group's store, hosted by rank 1 here
    std::shared_ptr<Store> store = job_store(parent, rank == 1, so, &server);
    auto host_exits = std::make_shared<StoreHostExitsAfterProbe>(
        store, server.get(), "pg/ember_socket_addresses_" + std::to_string(rank));
    if (rank == 1) store = host_exits;
    ProcessGroupGloo::GlooOptions o{kTimeout, "127.0.0.1"};
    auto pg =
        std::make_unique<ProcessGroupGloo>(std::make_shared<PrefixStore>("pg", store), rank, 2, o);
    Tensor t = full({1000}, 1.0, kFloat32);
    pg->allreduce(t)->wait();
    parent.set("done_" + std::to_string(rank), std::string("1"));
    parent.wait({"done_0", "done_1"}, 60s);  // rank 0 leaves while the store still answers
    if (rank == 0) {
      pg.reset();
      parent.set("left_0", std::string("1"));
      return;
    }
    parent.wait({"left_0"}, 60s);
    host_exits->arm();
    pg.reset();
    require(host_exits->server_stopped(), "the group's destruction made no probe");
    const std::string seen = host_exits->write_seen();
    require(has(seen, "pg/ember_position_1 within 250 ms: ") &&
                has(seen, "could not connect to the store"),
            "rank 1's write of where it stands: '" + seen + "'");
  });
  TCPStoreServerOptions so;
  so.host = "127.0.0.1";
  TCPStoreServer server(so);
  kids.go(std::to_string(server.port()));
  test::expect_children_ok(kids.join(60000));
}

}  // namespace
}  // namespace ember::dist
