// emberrun --rdzv-backend etcd: the agents' rendezvous store is an etcd server (a private one per
// test, tests/distributed/etcd_test_util.h) instead of node 0's agent. Node 0 still leads the
// rounds, so these tests give every agent its --node-rank.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <ember/distributed/etcd_store.h>
#include "emberrun_harness.h"
#include "tests/distributed/etcd_test_util.h"

namespace {

using namespace emberrun_test;
namespace fs = std::filesystem;

std::string dist_worker() { return build_dir() + "/launcher/test_workers/dist_worker"; }

std::vector<std::string> etcd_job(const std::string& endpoint, const std::string& node_rank) {
  return {"--nnodes",       "2",         "--nproc-per-node", "2",           "--rdzv-backend",
          "etcd",           "--rdzv-id", "etcdjob",          "--node-rank", node_rank,
          "--grace-period", "5",         "--rdzv-endpoint",  endpoint};
}

TEST(EtcdRendezvous, TwoNodesRunOneJobThroughEtcd) {
  const std::string why = ember::test::etcd_unavailable_reason();
  if (!why.empty()) GTEST_SKIP() << why;
  if (!fs::exists(dist_worker())) GTEST_SKIP() << dist_worker() << " not built";
  ember::test::EtcdServer etcd;
  TempDir d;
  auto args = [&](const std::string& rank) {
    auto a = etcd_job(etcd.endpoint(), rank);
    a.push_back(dist_worker());
    a.push_back(d.path);
    return a;
  };
  Emberrun n1(args("1"));  // before node 0: nobody hosts anything
  Emberrun n0(args("0"));
  Result r0 = n0.wait(), r1 = n1.wait();
  ASSERT_EQ(r0.exit_code, 0) << describe(r0) << "\netcd's log:\n" << etcd.log_tail();
  ASSERT_EQ(r1.exit_code, 0) << describe(r1);
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(read_file(d.path + "/sum_" + std::to_string(i)), "10 4") << "rank " << i;
  EXPECT_TRUE(contains(r0.err, "rendezvous 127.0.0.1:")) << describe(r0);
  // The round's keys are in etcd (under EtcdStore's default prefix "ember"), not in an agent.
  ember::dist::EtcdStoreOptions o;
  o.prefix = "ember/emberrun/etcdjob";
  o.timeout = std::chrono::seconds(60);
  ember::dist::EtcdStore keys(etcd.endpoint(), o);
  EXPECT_TRUE(keys.check({"r0/node/0", "r0/node/1", "r0/nnodes"}));
}

TEST(EtcdRendezvous, NeedsTheEndpointAndEveryNodeRank) {
  Result r = run({"--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:2379",
                  worker(), "env", "/nonexistent"});
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_TRUE(contains(r.err, "--rdzv-backend etcd needs --rdzv-endpoint")) << describe(r);
  r = run({"--nnodes", "2", "--rdzv-backend", "etcd", "--node-rank", "1", worker(), "env",
           "/nonexistent"});
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  r = run({"--nnodes", "2", "--rdzv-backend", "zookeeper", worker(), "env", "/nonexistent"});
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_TRUE(contains(r.err, "expected static, c10d or etcd, got 'zookeeper'")) << describe(r);
}

TEST(EtcdRendezvous, UnreachableEtcdIsAClearError) {
  const std::string endpoint = "127.0.0.1:" + std::to_string(ember::test::unused_port());
  std::vector<std::string> a = etcd_job(endpoint, "1");
  a.insert(a.end(), {"--join-timeout", "0.5", worker(), "env", "/nonexistent"});
  Result r = run(a);
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_TRUE(contains(r.err, "could not reach etcd at " + endpoint)) << describe(r);
}

}  // namespace
