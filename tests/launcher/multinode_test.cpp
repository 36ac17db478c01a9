// Multi-node emberrun: several agents rendezvous through the store node 0's agent hosts.
//
// MultiNodeLoopback: the agents run side by side on 127.0.0.1 (always possible): rendezvous,
// ranks, restarts, failures on one node stopping the others, join timeouts, a lost store.
// MultiNodeNetns: two network namespaces joined by a veth pair (tests/launcher/netns.h) are two
// nodes with their own addresses; one emberrun per namespace, and mpirun across both. Skipped,
// with the reason, where namespaces cannot be created (not root).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <memory>
#include <string>
#include <vector>

#include <ember/distributed/store/tcp_store.h>
#include "emberrun_harness.h"
#include "netns.h"

namespace {

using namespace emberrun_test;
namespace fs = std::filesystem;

std::string dist_worker() { return build_dir() + "/launcher/test_workers/dist_worker"; }

// A port nothing listens on now (racy, as every such pick).
int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  EXPECT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  close(fd);
  return ntohs(a.sin_port);
}

// Options every agent of a loopback job shares.
std::vector<std::string> loopback(int port, int nproc = 1) {
  return {"--master-addr",    "127.0.0.1",           "--master-port",  std::to_string(port),
          "--nproc-per-node", std::to_string(nproc), "--grace-period", "5"};
}

// Waits (bounded) until the rendezvous store on 127.0.0.1:port holds `key`: where the agents
// stand, read from the store itself.
void wait_for_key(int port, const std::string& key) {
  ember::dist::TCPStoreOptions o;
  o.timeout = std::chrono::seconds(60);
  ember::dist::TCPStore store("127.0.0.1", static_cast<uint16_t>(port), o);
  store.wait({key}, std::chrono::seconds(60));
}

// "rank R of W: allreduce(rank+1) = S" from dist_worker, for every rank, in `out`.
void expect_allreduce_lines(const std::string& out, int world) {
  const int sum = world * (world + 1) / 2;
  for (int r = 0; r < world; ++r) {
    const std::string line = "[rank " + std::to_string(r) + "]: rank " + std::to_string(r) +
                             " of " + std::to_string(world) +
                             ": allreduce(rank+1) = " + std::to_string(sum) + "\n";
    EXPECT_TRUE(contains(out, line)) << "missing: " << line << "in:\n" << out;
  }
}

// dist_worker's "rank R: allreduce over <how>" for every rank (gloo groups).
void expect_transport(const std::string& out, int world, const std::string& how) {
  for (int r = 0; r < world; ++r) {
    const std::string line = "[rank " + std::to_string(r) + "]: rank " + std::to_string(r) +
                             ": allreduce over " + how + "\n";
    EXPECT_TRUE(contains(out, line)) << "missing: " << line << "in:\n" << out;
  }
}

TEST(MultiNodeLoopback, TwoAgentsWithStaticNodeRanksRunOneJob) {
  if (!fs::exists(dist_worker())) GTEST_SKIP() << dist_worker() << " not built";
  TempDir d;
  const int port = free_port();
  const auto common = cat(loopback(port, 2), {"--nnodes", "2"});
  Emberrun n1(cat(common, {"--node-rank", "1", dist_worker(), d.path()}));  // before node 0
  Emberrun n0(cat(common, {"--node-rank", "0", dist_worker(), d.path()}));
  Result r0 = n0.wait(), r1 = n1.wait();
  ASSERT_EQ(r0.exit_code, 0) << describe(r0);
  ASSERT_EQ(r1.exit_code, 0) << describe(r1);
  expect_allreduce_lines(r0.out + r1.out, 4);  // 1+2+3+4 = 10 on every rank
  // Two "nodes" on one machine in one network namespace: shared memory.
  expect_transport(r0.out + r1.out, 4, "shared memory");
  EXPECT_TRUE(contains(r1.out, "[rank 2]:") && contains(r1.out, "[rank 3]:")) << describe(r1);
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(read_file(d.path() + "/sum_" + std::to_string(i)), "10 4") << "rank " << i;
  EXPECT_TRUE(contains(r0.err, "node 0 (")) << describe(r0);
  EXPECT_TRUE(contains(r1.err, "node 1 (")) << describe(r1);
}

// The store limits apply to the rendezvous store node 0's agent hosts too: with a 10-byte
// quota its own first write is refused, and emberrun ends naming the quota, not a hang until
// --rdzv-timeout.
TEST(MultiNodeLoopback, Node0HostsTheRendezvousStoreWithTheGivenQuota) {
  const int port = free_port();
  Emberrun n0(cat(loopback(port), {"--nnodes", "2", "--node-rank", "0", "--rdzv-timeout", "600",
                                   "--store-max-stored-bytes", "10", "/bin/true"}));
  Result r = n0.wait();
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_TRUE(contains(r.err, "the store is full")) << describe(r);
  EXPECT_TRUE(contains(r.err, "past max_stored_bytes 10")) << describe(r);
}

TEST(MultiNodeLoopback, RanksByArrivalWithMinMaxAndUnevenNproc) {
  // No --node-rank: the agent that wins the endpoint's port hosts the store and is node 0; the
  // other gets node rank 1 by arrival. 1:2 nodes with a long last call: the round closes as soon
  // as the second node arrives. Node 1 runs 3 ranks, node 0 one: ranks follow the nodes.
  TempDir d;
  const int port = free_port();
  const std::vector<std::string> common = {
      "--nnodes",  "1:2",    "--rdzv-endpoint",  "127.0.0.1:" + std::to_string(port),
      "--rdzv-id", "arrive", "--rdzv-last-call", "60"};
  Emberrun a(cat(common, {"--nproc-per-node", "1", worker(), "env", d.path()}));
  Emberrun b(cat(common, {"--nproc-per-node", "3", worker(), "env", d.path()}));
  Result ra = a.wait(), rb = b.wait();
  ASSERT_EQ(ra.exit_code, 0) << describe(ra);
  ASSERT_EQ(rb.exit_code, 0) << describe(rb);
  // Which agent became node 0 depends on who bound the port first: read it from the output.
  const bool a_first = contains(ra.err, "node 0 (");
  const Result& first = a_first ? ra : rb;
  const Result& second = a_first ? rb : ra;
  const int n0 = a_first ? 1 : 3;
  EXPECT_TRUE(contains(second.err, "node 1 (")) << describe(second);
  for (int rank = 0; rank < 4; ++rank) {
    const std::string env = read_file(d.path() + "/env_" + std::to_string(rank) + ".txt");
    EXPECT_TRUE(contains(env, "WORLD_SIZE=4\n")) << "rank " << rank << "\n" << env;
    const int group = rank < n0 ? 0 : 1;
    EXPECT_TRUE(contains(env, "GROUP_RANK=" + std::to_string(group) + "\n")) << rank << env;
    EXPECT_TRUE(contains(env, "LOCAL_RANK=" + std::to_string(rank - (group ? n0 : 0)) + "\n"))
        << rank << env;
    EXPECT_TRUE(contains((group ? second : first).out, "hello from rank " + std::to_string(rank)))
        << describe(group ? second : first);
  }
}

TEST(MultiNodeLoopback, FailureOnOneNodeRestartsEveryNode) {
  TempDir d;
  const int port = free_port();
  const auto common = cat(loopback(port), {"--nnodes", "2", "--max-restarts", "1"});
  Emberrun n0(cat(common, {"--node-rank", "0", worker(), "flaky", d.path(), "1"}));
  Emberrun n1(cat(common, {"--node-rank", "1", worker(), "flaky", d.path(), "1"}));
  Result r0 = n0.wait(), r1 = n1.wait();
  ASSERT_EQ(r0.exit_code, 0) << describe(r0);
  ASSERT_EQ(r1.exit_code, 0) << describe(r1);
  EXPECT_TRUE(contains(r1.err,
                       "rank 1 exited with code 3; restarting the group on every node "
                       "(1/1)"))
      << describe(r1);
  EXPECT_TRUE(contains(r0.err, "node 1 failed (node 1 (")) << describe(r0);
  EXPECT_EQ(read_file(d.file("done_0")), "restarts=1 world=2 group=0/2");
  EXPECT_EQ(read_file(d.file("done_1")), "restarts=1 world=2 group=1/2");
  // Rank 0's first-attempt worker (which waited to be stopped) is gone.
  pid_t p = std::atoi(read_file(d.file("ready_0")).c_str());
  ASSERT_GT(p, 0);
  EXPECT_FALSE(process_exists(p)) << "rank 0's stopped worker outlived its agent";
}

TEST(MultiNodeLoopback, FailureWithoutRestartsStopsEveryNode) {
  TempDir d;
  const int port = free_port();
  const auto common = cat(loopback(port, 2), {"--nnodes", "2"});
  Emberrun n0(cat(common, {"--node-rank", "0", worker(), "exit", d.path(), "3", "5"}));
  Emberrun n1(cat(common, {"--node-rank", "1", worker(), "exit", d.path(), "3", "5"}));
  Result r0 = n0.wait(), r1 = n1.wait();
  EXPECT_EQ(r1.exit_code, 1) << describe(r1);
  EXPECT_TRUE(contains(r1.err, "FAILED")) << describe(r1);
  EXPECT_TRUE(contains(r1.err, "rank       : 3 (local_rank: 1)")) << describe(r1);
  EXPECT_TRUE(contains(r1.err, "exitcode   : 5")) << describe(r1);
  EXPECT_EQ(r0.exit_code, 1) << describe(r0);
  EXPECT_FALSE(contains(r0.err, "FAILED")) << "only the failing node prints the summary\n"
                                           << describe(r0);
  EXPECT_TRUE(contains(r0.err, "the run failed on node 1 (node 1 (")) << describe(r0);
  EXPECT_TRUE(contains(r0.err, "rank 3 exited with code 5")) << describe(r0);
  for (int rank : {0, 1, 2}) {
    const std::string f = d.path() + "/ready_" + std::to_string(rank);
    if (!fs::exists(f)) continue;  // stopped before it started
    pid_t p = std::atoi(read_file(f).c_str());
    EXPECT_FALSE(p > 0 && process_exists(p)) << "rank " << rank << " outlived its agent";
  }
}

TEST(MultiNodeLoopback, JoinTimeoutNamesTheNodesThatNeverArrived) {
  const int port = free_port();
  Result r = run(cat(loopback(port), {"--nnodes", "3", "--node-rank", "0", "--rdzv-timeout", "0.5",
                                      worker(), "env", "/nonexistent"}));
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_TRUE(contains(r.err, "nodes 1, 2 never arrived")) << describe(r);
  EXPECT_TRUE(contains(r.err, "--rdzv-timeout")) << describe(r);
  EXPECT_TRUE(contains(r.err, "127.0.0.1:" + std::to_string(port))) << describe(r);
}

TEST(MultiNodeLoopback, SignalDuringTheRendezvousEndsItAtOnce) {
  const int port = free_port();
  Emberrun n0(cat(loopback(port), {"--nnodes", "2", "--node-rank", "0", "--rdzv-id", "sig",
                                   worker(), "env", "/nonexistent"}));
  // node 0 has registered: it is waiting for node 1 (for up to 900 s)
  wait_for_key(port, "emberrun/sig/r0/node/0");
  kill(n0.pid(), SIGINT);
  Result r = n0.wait();
  EXPECT_EQ(r.exit_code, 128 + SIGINT) << describe(r);
  EXPECT_TRUE(contains(r.err, "received SIGINT during the rendezvous")) << describe(r);
}

TEST(MultiNodeLoopback, UnreachableStoreIsAClearError) {
  const int port = free_port();
  Result r = run(cat(loopback(port), {"--nnodes", "2", "--node-rank", "1", "--join-timeout", "0.5",
                                      worker(), "env", "/nonexistent"}));
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_TRUE(
      contains(r.err, "could not reach the rendezvous store at 127.0.0.1:" + std::to_string(port)))
      << describe(r);
}

TEST(MultiNodeLoopback, DuplicateNodeRankIsRefused) {
  // Node 1 has registered (seen in the store itself) before a second agent claims node rank 1:
  // the second is refused with the first's name; then node 2 arrives and the job runs.
  TempDir d;
  const int port = free_port();
  const auto common = cat(loopback(port), {"--nnodes", "3", "--rdzv-id", "dup"});
  Emberrun n0(cat(common, {"--node-rank", "0", worker(), "env", d.path()}));
  Emberrun n1(cat(common, {"--node-rank", "1", worker(), "env", d.path()}));
  wait_for_key(port, "emberrun/dup/r0/node/1");
  Result rd = run(cat(common, {"--node-rank", "1", worker(), "env", d.path()}));
  EXPECT_EQ(rd.exit_code, 1) << describe(rd);
  EXPECT_TRUE(contains(rd.err, "node rank 1 of round 0 is already taken by ")) << describe(rd);
  EXPECT_TRUE(contains(rd.err, "pid " + std::to_string(n1.pid()))) << describe(rd);
  Result r2 = run(cat(common, {"--node-rank", "2", worker(), "env", d.path()}));
  Result r0 = n0.wait(), r1 = n1.wait();
  for (const Result* r : {&r0, &r1, &r2}) EXPECT_EQ(r->exit_code, 0) << describe(*r);
}

TEST(MultiNodeLoopback, LostStoreStopsTheOtherNodes) {
  TempDir d;
  const int port = free_port();
  const auto common = cat(loopback(port), {"--nnodes", "2"});
  Emberrun n0(cat(common, {"--node-rank", "0", worker(), "block", d.path()}),
              {"TMPDIR=" + d.path()});
  Emberrun n1(cat(common, {"--node-rank", "1", worker(), "block", d.path()}));
  auto pids0 = wait_for_pids(n0, d.path(), 1);
  std::vector<pid_t> pids1;
  {
    const std::string f = d.file("pid_1");
    ASSERT_TRUE(wait_for_file(f));
    pids1.push_back(std::atoi(read_file(f).c_str()));
    n1.track(pids1[0]);
  }
  ASSERT_EQ(pids0.size(), 1u);
  kill(n0.pid(), SIGKILL);  // node 0's agent and its store vanish
  Result r1 = n1.wait();
  EXPECT_EQ(r1.exit_code, 1) << describe(r1);
  EXPECT_TRUE(contains(r1.err, "lost the rendezvous store at 127.0.0.1:" + std::to_string(port)))
      << describe(r1);
  EXPECT_TRUE(wait_until_gone(pids1[0])) << "node 1's worker outlived its agent";
  EXPECT_TRUE(wait_until_gone(pids0[0])) << "node 0's worker outlived its agent";
  n0.wait();
}

TEST(MultiNodeLoopback, StoppedAgentIsLostAfterNode0Finished) {
  // Node 0's workers are done and it waits for node 1 to report its end; node 1's agent is
  // stopped (SIGSTOP), so its heartbeat goes stale and node 0 ends the run instead of waiting
  // --rdzv-timeout (900 s) for it.
  TempDir d;
  const int port = free_port();
  const auto common = cat(loopback(port), {"--nnodes", "2", "--heartbeat-timeout", "3"});
  Emberrun n1(cat(common, {"--node-rank", "1", worker(), "block", d.path()}));
  Emberrun n0(cat(common, {"--node-rank", "0", worker(), "env", d.path()}));
  ASSERT_TRUE(wait_for_file(d.file("pid_1")));
  n1.track(std::atoi(read_file(d.file("pid_1")).c_str()));
  ASSERT_TRUE(wait_for_file(d.file("env_0.txt")));
  kill(n1.pid(), SIGSTOP);
  Result r0 = n0.wait();
  kill(n1.pid(), SIGCONT);
  EXPECT_FALSE(r0.timed_out) << describe(r0);
  EXPECT_EQ(r0.exit_code, 1) << describe(r0);
  EXPECT_TRUE(contains(r0.err, "node 1 failed after node 0's workers had finished"))
      << describe(r0);
  EXPECT_TRUE(contains(r0.err, " pid " + std::to_string(n1.pid()) + ") lost: no heartbeat for "))
      << describe(r0);
  Result r1 = n1.wait();  // resumed, it finds the store gone
  EXPECT_EQ(r1.exit_code, 1) << describe(r1);
}

TEST(MultiNodeLoopback, ElasticJobGoesOnWithoutANodeThatCannotStartItsWorkers) {
  // --nnodes 2:3: node 0 hosts (it registered before the others started); one of the other
  // two cannot create its workers' folder (--log-dir is a file). It leaves the job without
  // closing it, and the two others restart without it (world size 2) and finish.
  TempDir d;
  const int port = free_port();
  const std::string file = d.file("not_a_folder");
  std::ofstream(file) << "x";
  const auto common = cat(loopback(port), {"--nnodes", "2:3", "--rdzv-id", "leave",
                                           "--max-restarts", "1", "--rdzv-last-call", "30"});
  const std::vector<std::string> job = {worker(), "elastic", d.path(), "2", "0@2"};
  Emberrun n0(cat(common, job));
  wait_for_key(port, "emberrun/leave/r0/node/0");
  Emberrun bad(cat(common, cat({"--log-dir", file}, job)));
  Emberrun good(cat(common, job));
  Result rb = bad.wait(), r0 = n0.wait(), rg = good.wait();
  EXPECT_EQ(rb.exit_code, 1) << describe(rb);
  EXPECT_TRUE(contains(rb.err, "could not create " + file)) << describe(rb);
  ASSERT_EQ(r0.exit_code, 0) << describe(r0) << describe(rb);
  ASSERT_EQ(rg.exit_code, 0) << describe(rg);
  EXPECT_TRUE(contains(r0.err, "; it leaves the job)")) << describe(r0);
  EXPECT_TRUE(contains(r0.err, "restarting the group on every node (1/1)")) << describe(r0);
  for (int r : {0, 1})
    EXPECT_EQ(read_file(d.path() + "/done_" + std::to_string(r)), "world=2 resumed_from=0");
}

TEST(MultiNodeLoopback, AgentKilledRightAfterItsArrivalDoesNotStallTheRound) {
  // --nnodes 2:3: node 0 hosts; the next agent takes its arrival in round 0 and SIGKILLs itself
  // at once (a test-only hook), before anything else of its join. Its arrival is its
  // registration (the first free r0/node/<k>), so node 0 does not wait for a node that will
  // never register: with the third agent it closes round 0 with the dead node, finds it silent
  // within --heartbeat-timeout and the two live nodes finish in round 1, long before
  // --rdzv-timeout. Had the arrival been a rank taken before registering, node 0 would wait
  // for that node until --rdzv-timeout and end the run.
  if (!fs::exists(step_worker())) GTEST_SKIP() << step_worker() << " not built";
  TempDir d;
  const int port = free_port();
  const int rdzv_timeout_s = 20;
  const auto job = cat(loopback(port), {"--nnodes", "2:3", "--rdzv-id", "arrival",
                                        "--max-restarts", "1", "--heartbeat-timeout", "3",
                                        "--heartbeat-interval", "0.5", "--rdzv-last-call", "30",
                                        "--rdzv-timeout", std::to_string(rdzv_timeout_s),
                                        step_worker(), d.path(), "3"});
  const auto start = Clock::now();
  Emberrun n0(job);
  wait_for_key(port, "emberrun/arrival/r0/node/0");
  Result rx = run(job, {"EMBER_TEST_KILL_AFTER_ARRIVAL=1"});
  ASSERT_EQ(rx.exit_code, -1) << "expected the hook's SIGKILL: " << describe(rx);
  Emberrun c(job);
  Result r0 = n0.wait(), rc = c.wait();
  const double took = std::chrono::duration<double>(Clock::now() - start).count();
  ASSERT_EQ(r0.exit_code, 0) << describe(r0) << describe(rc);
  ASSERT_EQ(rc.exit_code, 0) << describe(rc);
  EXPECT_LT(took, rdzv_timeout_s) << "the round waited for the dead node until --rdzv-timeout";
  EXPECT_TRUE(contains(r0.err, "node 1 (") && contains(r0.err, ") lost: no heartbeat"))
      << describe(r0);
  const std::string out = r0.out + rc.out;
  for (int r : {0, 1}) {
    const std::string line = "rank " + std::to_string(r) + " of 2: finished\n";
    EXPECT_TRUE(contains(out, line)) << "missing: " << line << describe(r0) << describe(rc);
  }
}

TEST(MultiNodeLoopback, NodeArrivingAtAFullElasticRoundWaitsBoundedAndAlone) {
  // --nnodes 1:2 with both nodes running: a third agent waits for a round that never comes
  // (the round has MAX nodes) and gives up after its --rdzv-timeout, naming itself and the
  // round; a fourth, interrupted while it waits, ends alone: the job runs on.
  TempDir d;
  const int port = free_port();
  const auto common = cat(loopback(port), {"--nnodes", "1:2", "--rdzv-id", "full"});
  const std::vector<std::string> job = {worker(), "block", d.path()};
  Emberrun n0(cat(common, job));
  wait_for_key(port, "emberrun/full/r0/node/0");
  Emberrun n1(cat(common, job));
  auto workers = wait_for_pids(n0, d.path(), 2);
  ASSERT_EQ(workers.size(), 2u);
  n1.track(workers[1]);
  Emberrun late(cat(common, cat({"--rdzv-timeout", "1"}, job)));
  Result rl = late.wait();
  EXPECT_EQ(rl.exit_code, 1) << describe(rl);
  const std::string who = " pid " + std::to_string(late.pid());
  EXPECT_TRUE(contains(rl.err, who + " arrived after rendezvous round 0 filled up: waiting to "
                                     "join round 1 (--nnodes 1:2)"))
      << describe(rl);
  EXPECT_TRUE(contains(rl.err, who + " waited 1 s (--rdzv-timeout) at 127.0.0.1:" +
                                   std::to_string(port) + " for rendezvous round 1, which node 0 "
                                   "did not open: round 0 kept running"))
      << describe(rl);
  Emberrun waiter(cat(common, job));
  wait_for_key(port, "emberrun/full/r0/wait/1");
  kill(waiter.pid(), SIGTERM);
  Result rw = waiter.wait();
  EXPECT_EQ(rw.exit_code, 128 + SIGTERM) << describe(rw);
  for (pid_t w : workers) EXPECT_TRUE(process_exists(w)) << "worker " << w << " was stopped";
  {
    ember::dist::TCPStoreOptions o;
    o.timeout = std::chrono::seconds(60);
    ember::dist::TCPStore store("127.0.0.1", static_cast<uint16_t>(port), o);
    EXPECT_FALSE(store.check({"emberrun/full/closed"})) << "a waiting node closed the run";
  }
  kill(n0.pid(), SIGTERM);
  Result r0 = n0.wait(), r1 = n1.wait();
  EXPECT_EQ(r0.exit_code, 128 + SIGTERM) << describe(r0);
  EXPECT_EQ(r1.exit_code, 1) << describe(r1);
}

TEST(MultiNodeLoopback, SignalOnOneNodeEndsTheRunOnEveryNode) {
  TempDir d;
  const int port = free_port();
  // Restarts remain, but an interrupted node closes the run: node 0 must not wait for it.
  const auto common = cat(loopback(port), {"--nnodes", "2", "--max-restarts", "3"});
  Emberrun n0(cat(common, {"--node-rank", "0", worker(), "block", d.path()}));
  Emberrun n1(cat(common, {"--node-rank", "1", worker(), "block", d.path()}));
  auto p0 = wait_for_pids(n0, d.path(), 1);
  ASSERT_TRUE(wait_for_file(d.file("pid_1")));
  pid_t p1 = std::atoi(read_file(d.file("pid_1")).c_str());
  n1.track(p1);
  kill(n1.pid(), SIGTERM);
  Result r1 = n1.wait(), r0 = n0.wait();
  EXPECT_EQ(r1.exit_code, 128 + SIGTERM) << describe(r1);
  EXPECT_EQ(r0.exit_code, 1) << describe(r0);
  EXPECT_TRUE(contains(r0.err, "closed by another node: node 1 (")) << describe(r0);
  EXPECT_TRUE(contains(r0.err, "received SIGTERM")) << describe(r0);
  for (pid_t p : {p0.at(0), p1}) EXPECT_FALSE(process_exists(p)) << "worker " << p << " left";
}

// ---- across network namespaces ----------------------------------------------------------

class MultiNodeNetns : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    net_ = NetnsNodes::create(2, &why);
    if (!net_) GTEST_SKIP() << why;
  }
  void TearDown() override { net_.reset(); }  // kills leftovers, deletes the namespaces

  // No EMBER_GLOO_HOSTNAME: gloo finds the veth address itself (the interface that reaches
  // MASTER_ADDR), although the machine's host name resolves to 127.0.0.1 in both namespaces.
  std::vector<std::string> env(int) const { return {}; }
  std::unique_ptr<NetnsNodes> net_;
};

TEST_F(MultiNodeNetns, GlooAllreduceAcrossTwoNamespaces) {
  if (!fs::exists(dist_worker())) GTEST_SKIP() << dist_worker() << " not built";
  TempDir d;
  const std::vector<std::string> common = {
      "--nnodes",      "2",           "--nproc-per-node", "2",
      "--master-addr", net_->addr[0], "--master-port",    "29400"};
  Emberrun n1(cat(common, {"--node-rank", "1", dist_worker(), d.path()}), env(1),
              net_->exec_prefix(1));
  Emberrun n0(cat(common, {"--node-rank", "0", dist_worker(), d.path()}), env(0),
              net_->exec_prefix(0));
  Result r0 = n0.wait(), r1 = n1.wait();
  ASSERT_EQ(r0.exit_code, 0) << describe(r0);
  ASSERT_EQ(r1.exit_code, 0) << describe(r1);
  expect_allreduce_lines(r0.out + r1.out, 4);
  // Network namespaces count as machines: each node reduces over shared memory, the two node
  // leaders over TCP (process_group_hierarchical.h).
  expect_transport(r0.out + r1.out, 4, "shared memory within the node, tcp between 2 nodes");
  EXPECT_TRUE(contains(r1.err, "MASTER_ADDR=" + net_->addr[0] + ":")) << describe(r1);
}

TEST_F(MultiNodeNetns, RanksByArrivalThroughTheEndpoint) {
  // No --node-rank: the agent in the namespace owning the endpoint's address hosts the store
  // and is node 0, although the other one starts first.
  if (!fs::exists(dist_worker())) GTEST_SKIP() << dist_worker() << " not built";
  TempDir d;
  const std::vector<std::string> common = {
      "--nnodes",  "2",        "--nproc-per-node", "2", "--rdzv-endpoint", net_->addr[0] + ":29500",
      "--rdzv-id", "netns-job"};
  Emberrun b(cat(common, {dist_worker(), d.path()}), env(1), net_->exec_prefix(1));
  Emberrun a(cat(common, {dist_worker(), d.path()}), env(0), net_->exec_prefix(0));
  Result ra = a.wait(), rb = b.wait();
  ASSERT_EQ(ra.exit_code, 0) << describe(ra);
  ASSERT_EQ(rb.exit_code, 0) << describe(rb);
  EXPECT_TRUE(contains(ra.err, "node 0 (")) << describe(ra);
  EXPECT_TRUE(contains(rb.err, "node 1 (")) << describe(rb);
  expect_allreduce_lines(ra.out + rb.out, 4);
}

// The link between the nodes is cut while both run blocked workers (as ranks waiting in a
// collective whose peer is gone would be). Node 1 loses the store and stops; node 0's store
// only sees silence, so without heartbeats its worker would wait until it gave up on its own
// (here its 60 s alarm; over TCP the kernel's timeout, about 15 minutes). With
// --heartbeat-timeout 3 node 0 ends the round within a few seconds, naming the lost node.
struct Partitioned {
  Result r0, r1;
  std::chrono::duration<double> node0_after_cut{};  // from the cut until node 0's agent ended
  std::vector<pid_t> workers;
  pid_t r1_pid = -1;  // node 1's agent (under `ip netns exec`, which execs it)
};

Partitioned run_and_cut_link(NetnsNodes& net, const std::vector<std::string>& extra) {
  TempDir d;
  const auto common = cat(cat({"--nnodes", "2", "--master-addr", net.addr[0], "--master-port",
                               "29400", "--grace-period", "5"},
                              {"--heartbeat-timeout", "3", "--heartbeat-interval", "0.5"}),
                          extra);
  Emberrun n0(cat(common, {"--node-rank", "0", worker(), "block", d.path()}), {},
              net.exec_prefix(0));
  Emberrun n1(cat(common, {"--node-rank", "1", worker(), "block", d.path()}), {},
              net.exec_prefix(1));
  Partitioned p;
  p.r1_pid = n1.pid();
  for (int rank : {0, 1}) {
    const std::string f = d.path() + "/pid_" + std::to_string(rank);
    EXPECT_TRUE(wait_for_file(f)) << "rank " << rank << " never started";
    p.workers.push_back(std::atoi(read_file(f).c_str()));
    (rank ? n1 : n0).track(p.workers.back());
  }
  std::string out;
  EXPECT_EQ(shell("ip -n " + net.ns[1] + " link set " + net.ifname[1] + " down", &out), 0) << out;
  const auto cut = Clock::now();
  p.r0 = n0.wait();
  p.node0_after_cut = Clock::now() - cut;
  p.r1 = n1.wait();
  return p;
}

TEST_F(MultiNodeNetns, PartitionedNodeEndsTheRoundOnNode0) {
  Partitioned p = run_and_cut_link(*net_, {});
  EXPECT_FALSE(p.r0.timed_out) << describe(p.r0);
  EXPECT_EQ(p.r0.exit_code, 1) << describe(p.r0);
  EXPECT_TRUE(contains(p.r0.err, "the run failed on node 1 (node 1 (")) << describe(p.r0);
  EXPECT_TRUE(contains(p.r0.err, " pid " + std::to_string(p.r1_pid) + ") lost: no heartbeat for "))
      << describe(p.r0);
  EXPECT_TRUE(contains(p.r0.err, "(--heartbeat-timeout 3 s;")) << describe(p.r0);
  EXPECT_TRUE(contains(p.r0.err, "no restarts left")) << describe(p.r0);
  // A bound, not a timing: 3 s of silence, a check a second, a stop and the exit, on a loaded
  // machine; without heartbeats node 0 would wait for its worker's 60 s alarm.
  EXPECT_LT(p.node0_after_cut.count(), 30.0) << describe(p.r0);
  EXPECT_EQ(p.r1.exit_code, 1) << describe(p.r1);
  EXPECT_TRUE(contains(p.r1.err, "lost the rendezvous store at " + net_->addr[0]))
      << describe(p.r1);
  for (pid_t w : p.workers)
    EXPECT_TRUE(wait_until_gone(w)) << "worker " << w << " outlived its agent";
}

TEST_F(MultiNodeNetns, PartitionedNodeRestartsTheRoundWhenAllowed) {
  // Node 0 restarts the round and waits for node 1 for --rdzv-timeout, as for any failure.
  Partitioned p = run_and_cut_link(*net_, {"--max-restarts", "1", "--rdzv-timeout", "2"});
  EXPECT_FALSE(p.r0.timed_out) << describe(p.r0);
  EXPECT_EQ(p.r0.exit_code, 1) << describe(p.r0);
  EXPECT_TRUE(contains(p.r0.err, ") lost: no heartbeat for ")) << describe(p.r0);
  EXPECT_TRUE(contains(p.r0.err, "restarting the group on every node (1/1)")) << describe(p.r0);
  EXPECT_TRUE(contains(p.r0.err, "rendezvous round 1 at " + net_->addr[0] + ":29400 timed out"))
      << describe(p.r0);
  EXPECT_TRUE(contains(p.r0.err, "nodes 1 never arrived")) << describe(p.r0);
  EXPECT_LT(p.node0_after_cut.count(), 30.0) << describe(p.r0);
  EXPECT_EQ(p.r1.exit_code, 1) << describe(p.r1);
  for (pid_t w : p.workers)
    EXPECT_TRUE(wait_until_gone(w)) << "worker " << w << " outlived its agent";
}

// ---- elastic membership (--nnodes MIN:MAX) across namespace nodes -------------------------

// Agents on namespace nodes running test_worker's "elastic" mode: the workers train from a
// checkpoint and hold at given steps (until the world size they wait for) while the test
// removes or adds a node, so every change happens at a known step. Ranks by arrival; the agent
// of node 0's namespace owns the endpoint's address and hosts the store.
class ElasticNetns : public ::testing::Test {
 protected:
  void create(int nodes) {
    std::string why;
    net_ = NetnsNodes::create(nodes, &why);
    if (!net_) GTEST_SKIP() << why;
  }
  void TearDown() override { net_.reset(); }  // kills leftovers, deletes the namespaces

  // The agent in namespace i. A heartbeat timeout of 5 s: short, yet robust to a loaded
  // machine; a long last call that no round should wait for (3 nodes close round 0 at MAX,
  // later rounds close when the nodes node 0 expects joined).
  std::unique_ptr<Emberrun> agent(int i, const std::vector<std::string>& job) {
    return std::make_unique<Emberrun>(
        cat({"--nnodes", "2:3", "--rdzv-endpoint", net_->addr[0] + ":29400", "--rdzv-id",
             "elastic", "--max-restarts", "1", "--heartbeat-timeout", "5",
             "--heartbeat-interval", "0.5", "--rdzv-last-call", "30", "--grace-period", "5"},
            job),
        std::vector<std::string>{}, net_->exec_prefix(i));
  }
  // Waits until ranks 0..world-1 hold at `step` at that world size.
  static void wait_held(const std::string& dir, int step, int world) {
    for (int r = 0; r < world; ++r) {
      const std::string f = dir + "/held_" + std::to_string(step) + "_" + std::to_string(r) + "_" +
                            std::to_string(world);
      ASSERT_TRUE(wait_for_file(f)) << "rank " << r << " never held at step " << step;
    }
  }
  // Three agents in namespaces 0..2 at step 3 of world 3; then the agent of namespace 2 (node
  // 1 or 2, by arrival) is killed.
  std::vector<std::unique_ptr<Emberrun>> start_three_and_kill_one(
      const std::vector<std::string>& job, const std::string& dir) {
    std::vector<std::unique_ptr<Emberrun>> a;
    for (int i = 0; i < 3; ++i) a.push_back(agent(i, job));
    wait_held(dir, 3, 3);
    killed_ = a[2]->pid();
    kill(killed_, SIGKILL);  // its worker dies with it (PR_SET_PDEATHSIG)
    return a;
  }
  // Node 0 found the killed agent's node lost and restarted without it.
  void expect_lost(const Result& r0) const {
    EXPECT_TRUE(contains(r0.err, " pid " + std::to_string(killed_) + ") lost: no heartbeat for "))
        << describe(r0);
    EXPECT_TRUE(contains(r0.err, "restarting the group on every node (1/1)")) << describe(r0);
  }

  std::unique_ptr<NetnsNodes> net_;
  pid_t killed_ = -1;
};

TEST_F(ElasticNetns, LostNodeLeavesAndTheJobFinishesOnTwo) {
  create(3);
  if (IsSkipped()) return;
  TempDir d;
  // 6 steps; at step 3 the workers hold until the world has 2 ranks.
  auto a = start_three_and_kill_one({worker(), "elastic", d.path(), "6", "3@2"}, d.path());
  Result r0 = a[0]->wait(), r1 = a[1]->wait();
  ASSERT_EQ(r0.exit_code, 0) << describe(r0) << describe(r1);
  ASSERT_EQ(r1.exit_code, 0) << describe(r1);
  expect_lost(r0);
  // Renumbered contiguously: ranks 0 and 1 of 2, resumed from the checkpoint at step 3.
  for (int r : {0, 1}) {
    const std::string line = "[rank " + std::to_string(r) + "]: rank " + std::to_string(r) +
                             " of 2: resuming from step 3 (restarts 1)\n";
    EXPECT_TRUE(contains(r0.out + r1.out, line)) << "missing: " << line << describe(r0)
                                                 << describe(r1);
    EXPECT_EQ(read_file(d.path() + "/done_" + std::to_string(r)), "world=2 resumed_from=3");
  }
  EXPECT_FALSE(fs::exists(d.file("done_2")));
  EXPECT_EQ(read_file(d.file("ckpt")), "6");
  EXPECT_TRUE(contains(r0.err, " of 2: ranks 0..0 of 2, MASTER_ADDR=")) << describe(r0);
}

TEST_F(ElasticNetns, LateNodeJoinsAtTheNextRestartAndTheJobGrows) {
  // The job of the test above shrinks to 2 nodes, which hold at step 6 until the world has 3
  // ranks; a fourth agent, started then, waits and is admitted by a restart of the round.
  create(4);
  if (IsSkipped()) return;
  TempDir d;
  const std::vector<std::string> job = {worker(), "elastic", d.path(), "9", "3@2", "6@3"};
  auto a = start_three_and_kill_one(job, d.path());
  wait_held(d.path(), 6, 2);
  auto late = agent(3, job);
  Result r0 = a[0]->wait(), r1 = a[1]->wait(), r3 = late->wait();
  ASSERT_EQ(r0.exit_code, 0) << describe(r0) << describe(r1) << describe(r3);
  ASSERT_EQ(r1.exit_code, 0) << describe(r1);
  ASSERT_EQ(r3.exit_code, 0) << describe(r3);
  expect_lost(r0);
  EXPECT_TRUE(contains(r3.err, " arrived after rendezvous round 1 closed with 2 nodes: waiting "
                               "to join round 2 (--nnodes 2:3)"))
      << describe(r3);
  EXPECT_TRUE(contains(r0.err, "1 node waits to join (") &&
              contains(r0.err, " pid " + std::to_string(late->pid()) +
                                   "); round 1 has 2 of at most 3 nodes"))
      << describe(r0);
  // A membership change is no failure: the restart count stays 1.
  EXPECT_TRUE(contains(r0.err, "to admit the new nodes (no failure: 1/1 restarts used)"))
      << describe(r0);
  const std::string out = r0.out + r1.out + r3.out;
  for (int r : {0, 1, 2}) {
    const std::string line = "[rank " + std::to_string(r) + "]: rank " + std::to_string(r) +
                             " of 3: resuming from step 6 (restarts 1)\n";
    EXPECT_TRUE(contains(out, line)) << "missing: " << line << describe(r0) << describe(r1)
                                     << describe(r3);
    EXPECT_EQ(read_file(d.path() + "/done_" + std::to_string(r)), "world=3 resumed_from=6");
  }
  EXPECT_EQ(read_file(d.file("ckpt")), "9");
  EXPECT_TRUE(contains(r3.err, " of 3: ranks ") && contains(r3.err, " of 3, MASTER_ADDR="))
      << describe(r3);
}

TEST_F(MultiNodeNetns, MpirunAcrossTwoNamespaces) {
  if (!fs::exists(dist_worker())) GTEST_SKIP() << dist_worker() << " not built";
  std::string mpirun;
  if (shell("sh -c \"command -v mpirun\"", &mpirun) != 0)
    GTEST_SKIP() << "mpirun not found on PATH";
  TempDir d;
  // mpirun starts its remote daemons through an rsh agent ("AGENT HOST COMMAND..."); ours runs
  // the command in the namespace that owns HOST instead of over ssh.
  const std::string agent = d.file("netns_rsh.sh");
  {
    std::ofstream out(agent);
    out << "#!/bin/sh\nhost=$1; shift\ncase \"$host\" in\n"
        << "  " << net_->addr[0] << ") ns=" << net_->ns[0] << ";;\n"
        << "  " << net_->addr[1] << ") ns=" << net_->ns[1] << ";;\n"
        << "  *) echo \"netns_rsh.sh: unknown host $host\" >&2; exit 1;;\nesac\n"
        << "exec ip netns exec \"$ns\" /bin/sh -c \"$*\"\n";
  }
  fs::permissions(agent, fs::perms::owner_all);
  const std::string hosts = d.file("hosts");
  std::ofstream(hosts) << net_->addr[0] << " slots=2\n" << net_->addr[1] << " slots=2\n";
  std::vector<std::string> args = {"mpirun", "-np", "4", "--hostfile", hosts};
  if (geteuid() == 0) args.push_back("--allow-run-as-root");
  for (std::string a :
       {std::string("--bind-to"), std::string("none"), std::string("--mca"),
        std::string("plm_rsh_agent"), agent, std::string("--mca"), std::string("btl"),
        std::string("self,tcp"), std::string("--mca"), std::string("btl_tcp_if_include"),
        net_->subnet, std::string("--mca"), std::string("oob_tcp_if_include"), net_->subnet,
        std::string("--mca"), std::string("pml"), std::string("ob1")})
    args.push_back(a);
  args.push_back(dist_worker());
  args.push_back(d.path());
  args.push_back("mpi");
  Emberrun job(args, {}, net_->exec_prefix(0), /*raw=*/true);
  Result r = job.wait();
  if (contains(r.err + r.out, "built with EMBER_WITH_MPI=OFF"))
    GTEST_SKIP() << "Ember built without MPI";
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  for (int rank = 0; rank < 4; ++rank) {
    const std::string line = "rank " + std::to_string(rank) + " of 4: allreduce(rank+1) = 10\n";
    EXPECT_TRUE(contains(r.out, line)) << "missing: " << line << describe(r);
    EXPECT_EQ(read_file(d.path() + "/sum_" + std::to_string(rank)), "10 4") << "rank " << rank;
  }
}

}  // namespace
