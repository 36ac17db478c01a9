// EtcdStore against a real etcd (Debian's etcd-server, one private server per test). The Store
// semantics every store shares are in store_test.cpp (its "Etcd" instance); these are what is
// etcd's own: prefixes over one cluster, atomicity across clients, leases, and etcd failing.
#include <atomic>
#include <functional>
#include <thread>

#include <ember/distributed/store/etcd_store.h>
#include "tests/distributed/store/etcd_test_util.h"

namespace ember::dist {
namespace {

using namespace std::chrono_literals;
using test::expect_error;
using test::to_bytes;
using test::to_string;

constexpr Duration kLong = std::chrono::seconds(60);

std::unique_ptr<EtcdStore> open(const std::string& endpoint, const std::string& prefix,
                                int64_t lease_ttl_s = 0, Duration timeout = kLong) {
  EtcdStoreOptions o;
  o.prefix = prefix;
  o.lease_ttl_s = lease_ttl_s;
  o.timeout = timeout;
  return std::make_unique<EtcdStore>(endpoint, o);
}

class EtcdStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string why = test::etcd_unavailable_reason();
    if (!why.empty()) GTEST_SKIP() << why;
    etcd_ = std::make_unique<test::EtcdServer>();
  }
  void TearDown() override {
    if (HasFailure() && etcd_) std::cerr << "etcd's log:\n" << etcd_->log_tail() << "\n";
  }
  std::string endpoint() const { return etcd_->endpoint(); }
  // `n` clients of the job "job", each with its own store (and connection).
  std::vector<std::unique_ptr<EtcdStore>> clients(int n) const {
    std::vector<std::unique_ptr<EtcdStore>> stores;
    for (int c = 0; c < n; ++c) stores.push_back(open(endpoint(), "job"));
    return stores;
  }
  // Every client calls `call` at once, each on a thread of its own; what each was answered.
  static std::vector<std::string> race(const std::vector<std::unique_ptr<EtcdStore>>& stores,
                                       const std::function<Bytes(EtcdStore&, int c)>& call) {
    std::vector<std::string> seen(stores.size());
    std::vector<std::thread> threads;
    for (size_t c = 0; c < stores.size(); ++c) {
      threads.emplace_back([&, c] { seen[c] = to_string(call(*stores[c], static_cast<int>(c))); });
    }
    for (auto& t : threads) t.join();
    return seen;
  }
  std::unique_ptr<test::EtcdServer> etcd_;
};

TEST_F(EtcdStoreTest, PrefixesSeparateJobsOnOneCluster) {
  auto a = open(endpoint(), "jobA");
  auto b = open(endpoint(), "jobB");
  a->set("k", std::string("from a"));
  b->set("k", std::string("from b"));
  b->set("only b", std::string("1"));
  EXPECT_EQ(a->get_string("k"), "from a");
  EXPECT_EQ(b->get_string("k"), "from b");
  EXPECT_EQ(a->num_keys(), 1) << "num_keys counts this prefix's keys only";
  EXPECT_EQ(b->num_keys(), 2);
  EXPECT_FALSE(a->check({"only b"}));
  auto raw = open(endpoint(), "");
  EXPECT_EQ(raw->get_string("jobA/k"), "from a") << "keys live in etcd as <prefix>/<key>";
  EXPECT_EQ(raw->num_keys(), 3) << "without a prefix, every key in the cluster";
  EXPECT_TRUE(b->delete_key("k"));
  EXPECT_EQ(a->get_string("k"), "from a");
  // A prefix that is the start of another's ("job" of "jobA") does not see its keys.
  EXPECT_EQ(open(endpoint(), "job")->num_keys(), 0);
}

TEST_F(EtcdStoreTest, ConcurrentAddsFromManyClientsSumExactly) {
  constexpr int kStores = 3, kThreadsPerStore = 2, kAdds = 40;
  std::vector<std::unique_ptr<EtcdStore>> stores;
  for (int s = 0; s < kStores; ++s) stores.push_back(open(endpoint(), "job"));
  std::vector<std::thread> threads;
  std::atomic<int> errors{0};
  for (int t = 0; t < kStores * kThreadsPerStore; ++t) {
    threads.emplace_back([&, t] {
      try {
        for (int i = 0; i < kAdds; ++i) stores[t % kStores]->add("n", t + 1);
      } catch (const std::exception& e) {
        ++errors;
        ADD_FAILURE() << e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  const int n = kStores * kThreadsPerStore;
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(stores[0]->add("n", 0), int64_t{kAdds} * n * (n + 1) / 2)
      << "sum over threads t of kAdds * (t + 1): no add may be lost to a conflict";
}

TEST_F(EtcdStoreTest, ConcurrentCompareSetHasExactlyOneWinner) {
  constexpr int kClients = 6;
  const auto stores = clients(kClients);
  const std::vector<std::string> seen = race(stores, [](EtcdStore& s, int c) {
    return s.compare_set("leader", {}, to_bytes("c" + std::to_string(c)));
  });
  const std::string leader = stores[0]->get_string("leader");
  int winners = 0;
  for (int c = 0; c < kClients; ++c) {
    EXPECT_EQ(seen[c], leader) << "client " << c << " must be answered the winner's value";
    winners += leader == std::string("c") + std::to_string(c);
  }
  EXPECT_EQ(winners, 1);
}

// create_with: one winner among concurrent clients, whose extra keys are written with its key
// and only then; a key that exists is answered, not overwritten.
TEST_F(EtcdStoreTest, CreateWithWritesTheKeyAndItsCompanionsOnlyForTheOneWinner) {
  constexpr int kClients = 6;
  const auto stores = clients(kClients);
  const std::vector<std::string> seen = race(stores, [](EtcdStore& s, int c) {
    const std::string me = "c" + std::to_string(c);
    return s.create_with("node/0", to_bytes(me),
                         {{"master", to_bytes(me + " addr")}, {"extra", to_bytes(me)}});
  });
  const std::string winner = stores[0]->get_string("node/0");
  for (int c = 0; c < kClients; ++c) EXPECT_EQ(seen[c], winner) << "client " << c;
  EXPECT_EQ(stores[0]->get_string("master"), winner + " addr") << "the winner's companions only";
  EXPECT_EQ(stores[0]->get_string("extra"), winner);
  EXPECT_EQ(stores[0]->num_keys(), 3);
  // An existing key is answered as it is; its companions are left alone.
  stores[1]->set("taken", std::string("first"));
  EXPECT_EQ(to_string(stores[2]->create_with("taken", to_bytes("second"), {{"x", to_bytes("1")}})),
            "first");
  EXPECT_FALSE(stores[0]->check({"x"}));
  EXPECT_EQ(to_string(stores[2]->create_with("alone", to_bytes("v"), {})), "v");
  std::vector<std::pair<std::string, Bytes>> too_many(128, {"k", to_bytes("v")});
  expect_error<ValueError>([&] { stores[0]->create_with("big", to_bytes("v"), too_many); },
                           {"EtcdStore create_with", "at most 127", "got 128"});
}

// A killed agent's keys vanish: a child sets keys through a store with a 2 s lease and blocks;
// while it lives its keepalive holds them beyond the TTL; once it is SIGKILLed, etcd deletes
// them after the TTL, even the counter another store has read with add(key, 0). Keys of other
// stores stay.
TEST_F(EtcdStoreTest, LeasedKeysOutliveTheirTtlWhileRenewedAndExpireWhenTheOwnerDies) {
  constexpr int64_t kTtl = 2;
  test::Children child(1, [](int, const std::string& endpoint) {
    auto s = open(endpoint, "job", kTtl);
    test::require(s->lease_id() != 0, "the store has no lease");
    s->set("agent/0", std::string("alive"));
    s->add("agents", 1);
    s->get("never set", kLong);  // blocks until the parent kills this process
  });
  child.go(endpoint());
  auto observer = open(endpoint(), "job");
  observer->set("durable", std::string("mine"));
  ASSERT_TRUE(test::eventually([&] {
    return observer->check({"agent/0", "agents"});
  })) << "the child never set its keys";
  // Three TTLs: without renewals the keys would be gone by the end.
  const auto renewed_until = std::chrono::steady_clock::now() + std::chrono::seconds(3 * kTtl);
  while (std::chrono::steady_clock::now() < renewed_until) {
    ASSERT_TRUE(observer->check({"agent/0", "agents"}))
        << "a leased key expired while its store was alive and renewing the lease";
    std::this_thread::sleep_for(50ms);
  }
  // Reading the counter through another store must not take it off the child's lease.
  EXPECT_EQ(observer->add("agents", 0), 1);
  child.kill(0);
  EXPECT_TRUE(test::eventually(
      [&] { return !observer->check({"agent/0"}) && !observer->check({"agents"}); },
      static_cast<int>(kTtl * 1000 + 10000)))
      << "the dead child's keys did not expire within its TTL plus 10 s";
  EXPECT_EQ(observer->get_string("durable"), "mine") << "an unleased key must stay";
  EXPECT_EQ(observer->num_keys(), 1);
}

TEST_F(EtcdStoreTest, EtcdKilledMidCallFailsWithinTheTimeoutNamingTheEndpoint) {
  auto s = open(endpoint(), "job", 0, 1500ms);
  s->set("k", std::string("v"));
  std::atomic<bool> started{false};
  std::string error;
  std::thread blocked([&] {
    started = true;
    error = test::message_of([&] { s->get("never set", 3000ms); });
  });
  ASSERT_TRUE(test::eventually([&] { return started.load(); }));
  etcd_->stop();
  blocked.join();
  EXPECT_NE(error.find("EtcdStore get"), std::string::npos) << error;
  EXPECT_NE(error.find(endpoint()), std::string::npos) << error;
  expect_error<DistNetworkError>([&] { s->set("k", std::string("w")); },
                                 {"EtcdStore set", endpoint(), "'job/k'", "1500 ms"});
  expect_error<DistNetworkError>([&] { open(endpoint(), "job", 0, 300ms); },
                                 {"could not reach", "etcd at " + endpoint(), "300 ms"});
}

TEST_F(EtcdStoreTest, RefusedRequestsNameEtcdsMessageAndCode) {
  auto raw = open(endpoint(), "");
  // etcd refuses an empty key.
  expect_error<DistStoreError>(
      [&] { raw->set("", std::string("x")); },
      {"EtcdStore set", endpoint(), "HTTP 400", "INVALID_ARGUMENT", "key is not provided"});
  raw->set("ok", std::string("1"));
  EXPECT_EQ(raw->get_string("ok"), "1") << "the store stays usable after a refusal";
}

// ---- TLS: etcd with a throwaway PKI (test::TestPki) --------------------------------------------

#define SKIP_WITHOUT_ETCD_TLS()                                     \
  do {                                                              \
    const std::string why = test::etcd_tls_unavailable_reason();    \
    if (!why.empty()) GTEST_SKIP() << why;                          \
  } while (0)

TEST(EtcdStoreTls, RoundTripOverHttpsAndAnUntrustedServerIsAClearError) {
  SKIP_WITHOUT_ETCD_TLS();
  test::TestPki pki;
  test::EtcdServer etcd({&pki, /*client_cert_auth=*/false});
  EtcdStoreOptions o = etcd.client_options();
  o.prefix = "job";
  o.timeout = 10s;
  o.lease_ttl_s = 2;  // the keepalive thread's connection speaks TLS too
  {
    EtcdStore s(etcd.endpoint(), o);
    s.set("k", std::string("over https"));
    EXPECT_EQ(s.add("n", 2), 2);
    // An https:// endpoint means https as well.
    EtcdStoreOptions u;
    u.prefix = "job";
    u.ca_file = pki.crt("ca");
    EtcdStore t("https://" + etcd.endpoint(), u);
    EXPECT_EQ(t.get_string("k"), "over https");
    EXPECT_EQ(t.add("n", 3), 5);
    EXPECT_EQ(s.endpoint(), etcd.endpoint());
  }
  const std::string where = "etcd at https://" + etcd.endpoint();
  o.lease_ttl_s = 0;
  o.ca_file = pki.crt("other_ca");  // not the CA that signed etcd's certificate
  expect_error<DistStoreError>([&] { EtcdStore(etcd.endpoint(), o); },
                               {where, "TLS handshake failed", "certificate verify failed",
                                "unable to get local issuer certificate", pki.crt("other_ca")});
  // Files OpenSSL cannot use, and TLS settings without https, are refused before connecting.
  o.ca_file = pki.crt("missing");
  expect_error<ValueError>([&] { EtcdStore(etcd.endpoint(), o); }, {"ca_file", pki.crt("missing")});
  o.ca_file = pki.crt("ca");
  o.cert_file = pki.crt("client");
  o.key_file = pki.key("server");
  expect_error<ValueError>([&] { EtcdStore(etcd.endpoint(), o); },
                           {"key_file", pki.key("server"), pki.crt("client"), "mismatch"});
  o.cert_file = "";
  expect_error<ValueError>([&] { EtcdStore(etcd.endpoint(), o); },
                           {"key_file", "without cert_file"});
  EtcdStoreOptions plain;
  plain.ca_file = pki.crt("ca");
  expect_error<ValueError>([&] { EtcdStore(etcd.endpoint(), plain); }, {"https"});
}

TEST(EtcdStoreTls, EtcdRequiringAClientCertificateRefusesAStoreWithout) {
  SKIP_WITHOUT_ETCD_TLS();
  test::TestPki pki;
  test::EtcdServer etcd({&pki, /*client_cert_auth=*/true});
  EtcdStoreOptions o = etcd.client_options();
  o.timeout = 10s;
  EtcdStore s(etcd.endpoint(), o);
  s.set("k", std::string("v"));
  EXPECT_EQ(s.get_string("k"), "v");
  o.cert_file = o.key_file = "";
  expect_error<DistStoreError>([&] { EtcdStore(etcd.endpoint(), o); },
                               {"etcd at https://" + etcd.endpoint(), "TLS", "certificate",
                                "--client-cert-auth", "none given: cert_file, key_file"});
  // etcd gone under a TLS connection is a network error, as over plain HTTP, not a TLS one.
  s.set_timeout(1000ms);
  etcd.stop();
  expect_error<DistNetworkError>([&] { s.set("k", std::string("w")); },
                                 {"EtcdStore set", "etcd at https://" + etcd.endpoint()});
}

// ---- etcd's user/password authentication --------------------------------------------------

TEST(EtcdStoreAuth, UserAndPasswordGetATokenRenewedWhenEtcdDropsIt) {
  const std::string why = test::etcd_auth_unavailable_reason();
  if (!why.empty()) GTEST_SKIP() << why;
  test::EtcdServer etcd;
  test::enable_etcd_auth(etcd, "s3cret");
  EtcdStoreOptions o;
  o.prefix = "job";
  o.timeout = 10s;
  o.lease_ttl_s = 2;  // lease grant and renewals need the token too
  o.username = "root";
  o.password = "s3cret";
  EtcdStore s(etcd.endpoint(), o);
  s.set("k", std::string("v"));
  EXPECT_EQ(s.add("n", 2), 2);
  // Turning authentication off and on invalidates every token: the next request gets a new one.
  test::reenable_etcd_auth(etcd, "s3cret");
  EXPECT_EQ(s.get_string("k"), "v");
  EXPECT_EQ(s.add("n", 3), 5) << "the add refused for its token must run once, not twice";
  const std::string where = "etcd at " + etcd.endpoint();
  o.lease_ttl_s = 0;
  o.password = "wrong";
  expect_error<DistStoreError>([&] { EtcdStore(etcd.endpoint(), o); },
                               {"authenticating as 'root'", where, "authentication failed"});
  o.username = o.password = "";
  expect_error<DistStoreError>([&] { EtcdStore(etcd.endpoint(), o); },
                               {where, "user name is empty", "give a user name and password"});
  o.password = "orphan";
  expect_error<ValueError>([&] { EtcdStore(etcd.endpoint(), o); }, {"without a user name"});
}

TEST(EtcdStore, EndpointsAreCheckedBeforeConnecting) {
  expect_error<ValueError>([] { EtcdStore("127.0.0.1:99999"); }, {"port", "99999"});
  expect_error<ValueError>([] { EtcdStore("127.0.0.1:"); }, {"port"});
  expect_error<ValueError>([] { EtcdStore(":2379"); }, {"host:port"});
  EtcdStoreOptions o;
  o.lease_ttl_s = -1;
  expect_error<ValueError>([&] { EtcdStore("127.0.0.1:2379", o); }, {"lease_ttl_s", "-1"});
  o.lease_ttl_s = 0;
  o.timeout = 0ms;
  expect_error<ValueError>([&] { EtcdStore("127.0.0.1:2379", o); }, {"timeout must be positive"});
}

TEST(EtcdStore, NoEtcdAtTheEndpointFailsWithinTheTimeout) {
  const std::string ep = "http://127.0.0.1:" + std::to_string(test::unused_port()) + "/";
  expect_error<DistNetworkError>(
      [&] { open(ep, "job", 0, 300ms); },
      {"[EtcdStore] could not reach etcd at 127.0.0.1:", "within 300 ms", "last error"});
}

}  // namespace
}  // namespace ember::dist
