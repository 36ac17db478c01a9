// emberrun --rdzv-backend etcd: the agents' rendezvous store is an etcd server (a private one per
// test, tests/distributed/store/etcd_test_util.h, or one in a network namespace of its own) instead
// of node 0's agent, and no agent leads for good (Note [Leaderless rounds] in
// launcher/rendezvous_etcd.cpp): node ranks go by arrival, and node 0 may be lost as any other.
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include <ember/distributed/store/etcd_store.h>
#include "emberrun_harness.h"
#include "netns.h"
#include "tests/distributed/store/etcd_test_util.h"

namespace {

using namespace emberrun_test;
namespace fs = std::filesystem;

std::string dist_worker() { return build_dir() + "/launcher/test_workers/dist_worker"; }

// Why a test cannot run here: `etcd_why` (etcd or a tool it needs is missing), else the
// worker program not built; "" when it can.
std::string unready(const std::string& etcd_why, const std::string& worker) {
  if (!etcd_why.empty()) return etcd_why;
  return fs::exists(worker) ? "" : worker + " not built";
}

std::vector<std::string> etcd_job(const std::string& endpoint) {
  return {"--nnodes",  "2",       "--nproc-per-node", "2", "--rdzv-backend",  "etcd",
          "--rdzv-id", "etcdjob", "--grace-period",   "5", "--rdzv-endpoint", endpoint,
          "--heartbeat-timeout", "2"};
}

TEST(EtcdRendezvous, TwoNodesRunOneJobThroughEtcd) {
  const std::string why = unready(ember::test::etcd_unavailable_reason(), dist_worker());
  if (!why.empty()) GTEST_SKIP() << why;
  ember::test::EtcdServer etcd;
  TempDir d;
  const auto args = cat(etcd_job(etcd.endpoint()), {dist_worker(), d.path()});
  Emberrun n0(args), n1(args);  // nobody hosts anything: ranks by arrival
  Result r0 = n0.wait(), r1 = n1.wait();
  ASSERT_EQ(r0.exit_code, 0) << describe(r0) << "\netcd's log:\n" << etcd.log_tail();
  ASSERT_EQ(r1.exit_code, 0) << describe(r1);
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(read_file(d.path() + "/sum_" + std::to_string(i)), "10 4") << "rank " << i;
  EXPECT_TRUE(contains(r0.err, "rendezvous 127.0.0.1:")) << describe(r0);
  EXPECT_TRUE(contains(r0.err + r1.err, "node 0 (") && contains(r0.err + r1.err, "node 1 ("))
      << describe(r0) << describe(r1);
  // The round's keys are in etcd (under EtcdStore's default prefix "ember"), not in an agent.
  ember::dist::EtcdStoreOptions o;
  o.prefix = "ember/emberrun/etcdjob";
  o.timeout = std::chrono::seconds(60);
  ember::dist::EtcdStore keys(etcd.endpoint(), o);
  // The agents are gone: their leased keys (heartbeats, the leader's) expire with their leases
  // (--heartbeat-timeout 2), the round's records stay.
  const auto deadline = Clock::now() + kTimeout;
  while (Clock::now() < deadline &&
         (keys.check({"r0/beat/0"}) || keys.check({"r0/beat/1"}) || keys.check({"r0/leader"})))
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(keys.check({"r0/beat/0"}) || keys.check({"r0/beat/1"}) ||
               keys.check({"r0/leader"}));
  EXPECT_TRUE(keys.check({"r0/node/0", "r0/node/1", "r0/nnodes", "r0/master", "closed"}));
  const ember::dist::Bytes closed = keys.get("closed");  // by the last node to finish
  EXPECT_EQ(std::string(closed.begin(), closed.end()), "the run finished");
  // etcd keeps them, so an agent reusing the id is told so instead of joining a dead run.
  Result again = run(args);
  EXPECT_EQ(again.exit_code, 1) << describe(again);
  EXPECT_TRUE(contains(again.err, "the rendezvous id 'etcdjob' at etcd " + etcd.endpoint() +
                                      " belongs to a run that is over (the run finished): give "
                                      "every job its own --rdzv-id"))
      << describe(again);
}

// torchrun's --rdzv-conf protocol=https,cacert=...,cert=...,key=... against an etcd that serves
// TLS and requires client certificates (a throwaway PKI from the openssl CLI).
TEST(EtcdRendezvous, TwoNodesRunOneJobThroughEtcdOverTls) {
  const std::string why = unready(ember::test::etcd_tls_unavailable_reason(), dist_worker());
  if (!why.empty()) GTEST_SKIP() << why;
  ember::test::TestPki pki;
  ember::test::EtcdServer etcd({&pki, /*client_cert_auth=*/true});
  TempDir d;
  const std::string client = ",cert=" + pki.crt("client") + ",key=" + pki.key("client");
  auto job = [&](const std::string& conf, std::vector<std::string> rest) {
    return cat(cat(etcd_job(etcd.endpoint()), {"--rdzv-conf", conf, "--join-timeout", "30"}),
               rest);
  };
  const auto args =
      job("protocol=https,cacert=" + pki.crt("ca") + client, {dist_worker(), d.path()});
  Emberrun n0(args), n1(args);
  Result r0 = n0.wait(), r1 = n1.wait();
  ASSERT_EQ(r0.exit_code, 0) << describe(r0) << describe(r1) << "\netcd's log:\n"
                             << etcd.log_tail();
  ASSERT_EQ(r1.exit_code, 0) << describe(r1);
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(read_file(d.path() + "/sum_" + std::to_string(i)), "10 4") << "rank " << i;
  // TLS failures end the agent at once (not after --join-timeout), naming etcd and the cause.
  const std::string store = "cannot use the rendezvous store at " + etcd.endpoint() + ": ";
  const auto start = Clock::now();
  Result wrong_ca = run(job("protocol=https,cacert=" + pki.crt("other_ca") + client,
                            {worker(), "env", "/nonexistent"}));
  EXPECT_EQ(wrong_ca.exit_code, 1) << describe(wrong_ca);
  EXPECT_TRUE(contains(wrong_ca.err, store) &&
              contains(wrong_ca.err, "etcd at https://" + etcd.endpoint()) &&
              contains(wrong_ca.err, "TLS handshake failed: certificate verify failed") &&
              contains(wrong_ca.err, pki.crt("other_ca")))
      << describe(wrong_ca);
  Result no_cert =
      run(job("protocol=https,cacert=" + pki.crt("ca"), {worker(), "env", "/nonexistent"}));
  EXPECT_EQ(no_cert.exit_code, 1) << describe(no_cert);
  EXPECT_TRUE(contains(no_cert.err, store) && contains(no_cert.err, "TLS failed") &&
              contains(no_cert.err, "--client-cert-auth needs a client certificate") &&
              contains(no_cert.err, "(none given: cert_file, key_file)"))
      << describe(no_cert);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(20)) << "a TLS failure was retried";
  // The TLS keys are checked as usage errors.
  for (const auto& [conf, msg] : std::vector<std::pair<std::string, std::string>>{
           {"protocol=ftp", "--rdzv-conf protocol: expected http or https, got 'ftp'"},
           {"cacert=" + pki.crt("ca"), "they need protocol=https"},
           {"protocol=https,cacert=" + pki.crt("nope"), "--rdzv-conf cacert: cannot read"},
           {"protocol=https,key=" + pki.key("client"), "needs cert"}}) {
    Result r = run(job(conf, {worker(), "env", "/nonexistent"}));
    EXPECT_EQ(r.exit_code, 2) << conf << describe(r);
    EXPECT_TRUE(contains(r.err, msg)) << conf << describe(r);
  }
  Result c10d = run({"--nnodes", "2", "--rdzv-endpoint", etcd.endpoint(), "--rdzv-conf",
                     "protocol=https", worker(), "env", "/nonexistent"});
  EXPECT_EQ(c10d.exit_code, 2) << describe(c10d);
  EXPECT_TRUE(contains(c10d.err, "is for --rdzv-backend etcd")) << describe(c10d);
}

// --rdzv-conf user=...,password_file=... against an etcd with authentication enabled.
TEST(EtcdRendezvous, TwoNodesRunOneJobThroughEtcdWithAuthentication) {
  const std::string why = unready(ember::test::etcd_auth_unavailable_reason(), dist_worker());
  if (!why.empty()) GTEST_SKIP() << why;
  ember::test::EtcdServer etcd;
  ember::test::enable_etcd_auth(etcd, "s3cret");
  TempDir d;
  const std::string good = d.file("good"), bad = d.file("bad");
  std::ofstream(good) << "s3cret\n";
  std::ofstream(bad) << "guess\n";
  auto job = [&](const std::string& conf, std::vector<std::string> rest) {
    return cat(cat(etcd_job(etcd.endpoint()), {"--rdzv-conf", conf, "--join-timeout", "30"}),
               rest);
  };
  const auto args = job("user=root,password_file=" + good, {dist_worker(), d.path()});
  Emberrun n0(args), n1(args);
  Result r0 = n0.wait(), r1 = n1.wait();
  ASSERT_EQ(r0.exit_code, 0) << describe(r0) << describe(r1) << "\netcd's log:\n"
                             << etcd.log_tail();
  ASSERT_EQ(r1.exit_code, 0) << describe(r1);
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(read_file(d.path() + "/sum_" + std::to_string(i)), "10 4") << "rank " << i;
  // Refused credentials end the agent at once, naming etcd and its answer.
  const std::string store = "cannot use the rendezvous store at " + etcd.endpoint() + ": ";
  Result wrong = run(job("user=root,password_file=" + bad, {worker(), "env", "/nonexistent"}));
  EXPECT_EQ(wrong.exit_code, 1) << describe(wrong);
  EXPECT_TRUE(contains(wrong.err, store) && contains(wrong.err, "authenticating as 'root'") &&
              contains(wrong.err, "authentication failed"))
      << describe(wrong);
  Result none = run(job("read_timeout=5", {worker(), "env", "/nonexistent"}));
  EXPECT_EQ(none.exit_code, 1) << describe(none);
  EXPECT_TRUE(contains(none.err, store) && contains(none.err, "give a user name and password"))
      << describe(none);
  Result half = run(job("user=root", {worker(), "env", "/nonexistent"}));
  EXPECT_EQ(half.exit_code, 2) << describe(half);
  EXPECT_TRUE(contains(half.err, "--rdzv-conf user needs password_file")) << describe(half);
}

TEST(EtcdRendezvous, NeedsTheEndpointAndIgnoresNodeRank) {
  Result r = run({"--nnodes", "2", "--rdzv-backend", "etcd", "--node-rank", "1", worker(), "env",
                  "/nonexistent"});
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_TRUE(contains(r.err, "--rdzv-backend etcd needs --rdzv-endpoint")) << describe(r);
  // Ranks go by arrival: --node-rank is ignored, saying so (here etcd is not there either).
  const std::string endpoint = "127.0.0.1:" + std::to_string(ember::test::unused_port());
  r = run({"--nnodes", "2", "--rdzv-backend", "etcd", "--node-rank", "1", "--rdzv-endpoint",
           endpoint, "--join-timeout", "0.5", worker(), "env", "/nonexistent"});
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_TRUE(contains(r.err, "--node-rank 1 is ignored with --rdzv-backend etcd")) << describe(r);
  r = run({"--nnodes", "2", "--rdzv-backend", "zookeeper", worker(), "env", "/nonexistent"});
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_TRUE(contains(r.err, "expected static, c10d or etcd, got 'zookeeper'")) << describe(r);
}

TEST(EtcdRendezvous, UnreachableEtcdIsAClearError) {
  const std::string endpoint = "127.0.0.1:" + std::to_string(ember::test::unused_port());
  std::vector<std::string> a = etcd_job(endpoint);
  a.insert(a.end(), {"--join-timeout", "0.5", worker(), "env", "/nonexistent"});
  Result r = run(a);
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_TRUE(contains(r.err, "could not reach etcd at " + endpoint)) << describe(r);
}

// The agents of an elastic job through etcd: 2 to 3 nodes, one restart, a 3 s heartbeat
// timeout (also the TTL of every agent's lease).
std::vector<std::string> elastic_etcd_job(const std::string& endpoint, const std::string& id,
                                          const std::string& last_call = "30") {
  return {"--nnodes",           "2:3", "--nproc-per-node",      "1",   "--rdzv-backend",
          "etcd",               "--rdzv-endpoint", endpoint,    "--rdzv-id",     id,
          "--max-restarts",     "1",   "--heartbeat-timeout",   "3",   "--heartbeat-interval",
          "0.5",                "--rdzv-last-call", last_call,  "--grace-period", "5"};
}

// Waits (bounded) until the etcd key `key` (under the emberrun keys of run `id`) exists.
bool wait_for_etcd_key(const std::string& endpoint, const std::string& id, const std::string& key) {
  ember::dist::EtcdStoreOptions o;
  o.prefix = "ember/emberrun/" + id;
  o.timeout = std::chrono::seconds(5);
  ember::dist::EtcdStore keys(endpoint, o);
  const auto deadline = Clock::now() + kTimeout;
  while (Clock::now() < deadline) {
    if (keys.check({key})) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

TEST(EtcdRendezvous, LeaderKilledDuringTheJoinIsReplaced) {
  // The first agent arrives alone, becomes round 0's node 0 and its leader, and waits for a
  // second node; it is killed there. The two agents started then find its leader key held
  // until its lease expires; one of them takes over and closes round 0 (with the dead node 0,
  // which registered), the dead node is found silent, and round 1 runs on the two.
  const std::string why = unready(ember::test::etcd_unavailable_reason(), step_worker());
  if (!why.empty()) GTEST_SKIP() << why;
  ember::test::EtcdServer etcd;
  TempDir d;
  const auto job =
      cat(elastic_etcd_job(etcd.endpoint(), "takeover"), {step_worker(), d.path(), "3"});
  auto first = std::make_unique<Emberrun>(job);
  ASSERT_TRUE(wait_for_etcd_key(etcd.endpoint(), "takeover", "r0/leader"))
      << describe(first->wait());
  const pid_t dead = first->pid();
  kill(dead, SIGKILL);
  Result rf = first->wait();
  Emberrun b(job), c(job);
  Result rb = b.wait(), rc = c.wait();
  ASSERT_EQ(rb.exit_code, 0) << describe(rb) << describe(rc) << "\netcd's log:\n" << etcd.log_tail();
  ASSERT_EQ(rc.exit_code, 0) << describe(rc);
  const std::string err = rb.err + rc.err, out = rb.out + rc.out;
  EXPECT_TRUE(contains(err, " leads rendezvous round 0 in place of ") &&
              contains(err, " pid " + std::to_string(dead) + ", whose lease expired"))
      << describe(rb) << describe(rc);
  EXPECT_TRUE(contains(err, "node 0 (") && contains(err, " pid " + std::to_string(dead) + ") lost"))
      << describe(rb) << describe(rc);
  for (int r : {0, 1}) {
    const std::string line = "rank " + std::to_string(r) + " of 2: finished\n";
    EXPECT_TRUE(contains(out, line)) << "missing: " << line << describe(rb) << describe(rc);
  }
}

TEST(EtcdRendezvous, AgentKilledRightAfterItsArrivalDoesNotStallTheRound) {
  // The first agent takes arrival 0 of round 0 and SIGKILLs itself at once (a test-only hook),
  // before anything else of its join. Its arrival is its registration (and, as node 0, its
  // MASTER_ADDR), written in one etcd transaction, so the two agents started then do not wait
  // for a node that will never register: they close round 0 with the dead node 0, find it
  // silent within --heartbeat-timeout and finish in round 1, long before --rdzv-timeout.
  const std::string why = unready(ember::test::etcd_unavailable_reason(), step_worker());
  if (!why.empty()) GTEST_SKIP() << why;
  ember::test::EtcdServer etcd;
  TempDir d;
  const auto job = cat(elastic_etcd_job(etcd.endpoint(), "arrival"),
                       {"--rdzv-timeout", "20", step_worker(), d.path(), "3"});
  Result rx = run(job, {"EMBER_TEST_KILL_AFTER_ARRIVAL=1"});
  ASSERT_EQ(rx.exit_code, -1) << "expected the hook's SIGKILL: " << describe(rx);
  ASSERT_TRUE(wait_for_etcd_key(etcd.endpoint(), "arrival", "r0/restarts"));
  const auto start = Clock::now();
  Emberrun b(job), c(job);
  Result rb = b.wait(), rc = c.wait();
  const double took = std::chrono::duration<double>(Clock::now() - start).count();
  ASSERT_EQ(rb.exit_code, 0) << describe(rb) << describe(rc) << "\netcd's log:\n"
                             << etcd.log_tail();
  ASSERT_EQ(rc.exit_code, 0) << describe(rc);
  EXPECT_LT(took, 20.0) << "the round waited for the dead node until --rdzv-timeout";
  const std::string err = rb.err + rc.err, out = rb.out + rc.out;
  EXPECT_TRUE(contains(err, "node 0 (") && contains(err, ") lost: no heartbeat"))
      << describe(rb) << describe(rc);
  for (int r : {0, 1}) {
    const std::string line = "rank " + std::to_string(r) + " of 2: finished\n";
    EXPECT_TRUE(contains(out, line)) << "missing: " << line << describe(rb) << describe(rc);
  }
}

TEST(EtcdRendezvous, LostEtcdStopsEveryNodeNamingTheEndpoint) {
  const std::string why = ember::test::etcd_unavailable_reason();
  if (!why.empty()) GTEST_SKIP() << why;
  ember::test::EtcdServer etcd;
  TempDir d;
  const auto job = cat({"--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                        etcd.endpoint(), "--rdzv-id", "lost", "--grace-period", "5"},
                       {worker(), "block", d.path()});
  Emberrun a(job), b(job);
  std::vector<pid_t> workers;
  for (int r : {0, 1}) {
    const std::string f = d.path() + "/pid_" + std::to_string(r);
    ASSERT_TRUE(wait_for_file(f)) << "rank " << r << " never started";
    workers.push_back(std::atoi(read_file(f).c_str()));
    a.track(workers.back());
  }
  etcd.stop();
  Result ra = a.wait(), rb = b.wait();
  for (const Result* r : {&ra, &rb}) {
    EXPECT_EQ(r->exit_code, 1) << describe(*r);
    EXPECT_TRUE(contains(r->err, "lost the rendezvous store at " + etcd.endpoint()) &&
                contains(r->err, "(etcd gone?)"))
        << describe(*r);
  }
  for (pid_t w : workers) EXPECT_TRUE(wait_until_gone(w)) << "worker " << w << " outlived etcd";
}

// ---- across network namespaces: node 0 is lost ---------------------------------------------

struct AfterNode0;

// Three agent nodes and a fourth namespace that runs etcd alone (as a cluster outside the
// job's machines would be), all on one bridge.
class EtcdNetns : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string why = unready(ember::test::etcd_unavailable_reason(), step_worker());
    if (!why.empty()) GTEST_SKIP() << why;
    std::string net_why;
    net_ = NetnsNodes::create(4, &net_why);
    if (!net_) GTEST_SKIP() << net_why;
    start_etcd();
  }
  void TearDown() override {
    etcd_.reset();  // kills etcd (its process group) and reaps it
    net_.reset();   // kills leftovers, deletes the namespaces; data_ goes after
  }

  std::string endpoint() const { return net_->addr[3] + ":2379"; }
  AfterNode0 kill_node0(const std::string& dir, const std::string& hold,
                        const std::string& last_call);

  void start_etcd() {
    const std::string url = "http://" + net_->addr[3];
    const std::string cmd = "exec " + std::string(ember::test::kEtcdBinary) +
                            " --name=ember-netns --data-dir=" + data_.path() + "/data" +
                            " --listen-client-urls=" + url + ":2379 --advertise-client-urls=" +
                            url + ":2379 --listen-peer-urls=" + url +
                            ":2380 --initial-advertise-peer-urls=" + url +
                            ":2380 --initial-cluster=ember-netns=" + url +
                            ":2380 --log-level=warn > " + data_.path() + "/etcd.log 2>&1";
    etcd_ = std::make_unique<Emberrun>(std::vector<std::string>{"sh", "-c", cmd},
                                       std::vector<std::string>{}, net_->exec_prefix(3),
                                       /*raw=*/true);
    const auto deadline = Clock::now() + kTimeout;
    bool up = false;
    while (!up && Clock::now() < deadline && process_exists(etcd_->pid())) {
      up = in_netns(net_->ns[3], [&] {
        try {
          ember::dist::EtcdStoreOptions o;
          o.timeout = std::chrono::milliseconds(500);
          ember::dist::EtcdStore probe(endpoint(), o);
          return true;
        } catch (const ember::dist::DistError&) {
          return false;  // not up yet; the probe's own connect retries paced this loop
        }
      });
    }
    ASSERT_TRUE(up) << "etcd did not start in " << net_->ns[3] << "; its log:\n"
                    << read_file(data_.file("etcd.log"));
  }

  std::unique_ptr<NetnsNodes> net_;
  TempDir data_;  // etcd's data and log
  std::unique_ptr<Emberrun> etcd_;
};

// Nanoseconds since the epoch (as step_worker's started_* files hold them).
long long wall_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<long long>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

// What the two agents left after node 0's death printed, and which namespaces they ran in.
struct AfterNode0 {
  Result r[2];
  int node[2] = {-1, -1};  // the survivors' namespaces
  int dead = -1;           // node 0's namespace
  pid_t agent = -1;        // node 0's agent
  std::string err, out, all;
  double restart_s = 0;    // from the kill until round 1's workers started
};

// Three agents run `hold` (step_worker's K@W spec for step 3 of 6) until rank 0 holds at step 3;
// then node 0's agent and worker (rank 0, which hosts the workers' store) are SIGKILLed.
AfterNode0 EtcdNetns::kill_node0(const std::string& dir, const std::string& hold,
                                 const std::string& last_call) {
  const auto job =
      cat(elastic_etcd_job(endpoint(), "node0", last_call), {step_worker(), dir, "6", hold});
  std::vector<std::unique_ptr<Emberrun>> a;
  for (int i = 0; i < 3; ++i)
    a.push_back(std::make_unique<Emberrun>(job, std::vector<std::string>{}, net_->exec_prefix(i)));
  AfterNode0 k;
  EXPECT_TRUE(wait_for_file(dir + "/held_3_0_3")) << "rank 0 never held at step 3";
  std::istringstream held(read_file(dir + "/held_3_0_3"));
  pid_t rank0 = -1;
  held >> k.agent >> rank0;
  for (int i = 0; i < 3; ++i)
    if (a[i]->pid() == k.agent) k.dead = i;
  EXPECT_GE(k.dead, 0) << "rank 0's agent " << k.agent << " is none of the three";
  if (k.dead < 0) return k;
  const long long killed_at = wall_ns();
  kill(k.agent, SIGKILL);
  kill(rank0, SIGKILL);
  for (int i = 0, s = 0; i < 3; ++i) {
    if (i == k.dead) continue;
    k.node[s] = i;
    k.r[s] = a[i]->wait();
    k.err += k.r[s].err;
    k.out += k.r[s].out;
    k.all += describe(k.r[s]);
    ++s;
  }
  EXPECT_TRUE(wait_until_gone(rank0));
  long long started = 0;
  for (int rank : {0, 1}) {
    const std::string f = dir + "/started_1_" + std::to_string(rank);
    started = std::max(started, std::atoll(read_file(f).c_str()));
  }
  k.restart_s = (started - killed_at) / 1e9;
  return k;
}

// Both survivors finished round 1 at world size 2 from the checkpoint, with the workers' store
// on one of them.
void expect_finished_on_two(const AfterNode0& k, NetnsNodes& net, const std::string& dir) {
  for (const Result& r : k.r) EXPECT_EQ(r.exit_code, 0) << k.all;
  for (int rank : {0, 1}) {
    const std::string line = "rank " + std::to_string(rank) +
                             " of 2: resuming from step 3 (restarts 1, MASTER_ADDR ";
    EXPECT_TRUE(contains(k.out, line)) << "missing: " << line << k.all;
    EXPECT_TRUE(contains(k.out, "rank " + std::to_string(rank) + " of 2: finished\n")) << k.all;
  }
  EXPECT_FALSE(contains(k.out, "(restarts 1, MASTER_ADDR " + net.addr[k.dead] + ":"))
      << "round 1's store on the dead node\n" << k.all;
  EXPECT_TRUE(contains(k.out, "(restarts 1, MASTER_ADDR " + net.addr[k.node[0]] + ":") ||
              contains(k.out, "(restarts 1, MASTER_ADDR " + net.addr[k.node[1]] + ":"))
      << k.all;
  EXPECT_TRUE(contains(k.err, " of 2: ranks 0..0 of 2, MASTER_ADDR=") &&
              contains(k.err, " of 2: ranks 1..1 of 2, MASTER_ADDR="))
      << k.all;
  EXPECT_EQ(read_file(dir + "/ckpt"), "6");
  std::printf("[ measure ] node 0 killed -> round 1's workers started: %.2f s\n", k.restart_s);
}

TEST_F(EtcdNetns, Node0KilledAndTheOthersFinishOnTwo) {
  // Every rank holds at step 3 (as between two collectives): the others find node 0 silent.
  TempDir d;
  const AfterNode0 k = kill_node0(d.path(), "3@2", "30");
  if (k.dead < 0) return;
  expect_finished_on_two(k, *net_, d.path());
  EXPECT_TRUE(contains(k.err, "node 0 (") &&
              contains(k.err, " pid " + std::to_string(k.agent) + ") lost: no heartbeat for "))
      << k.all;
  EXPECT_TRUE(contains(k.err, "restarting the group on every node (1/1)")) << k.all;
}

TEST_F(EtcdNetns, Node0KilledMidCollectiveAndTheOthersFinishOnTwo) {
  // Only rank 0 holds; the others wait in step 3's allreduce and fail when node 0 dies, before
  // anyone finds it silent, so round 1 expects it back. Its lease expires, and the leader stops
  // waiting for it: without that, round 1 would wait the whole last call (120 s, past the
  // harness's 60 s).
  TempDir d;
  const AfterNode0 k = kill_node0(d.path(), "3@2/0", "120");
  if (k.dead < 0) return;
  expect_finished_on_two(k, *net_, d.path());
  EXPECT_TRUE(contains(k.err, "rendezvous round 1 now expects 2 nodes: 1 of round 0 gone (etcd "
                              "lease expired)"))
      << k.all;
}
}  // namespace
