// Store semantics, the same for every implementation (HashStore, FileStore, TCPStore,
// PrefixStore over two of them, EtcdStore over a private etcd server), then HashStore, PrefixStore
// and FileStore specifics, with FileStore used by several real processes at once. TCPStore's own
// tests are in tcp_store_test.cpp.
//
// Expected values follow torch.distributed (c10d); the compare_set and add cases were checked
// with Debian's PyTorch 1.13 (/usr/bin/python3, dist.HashStore()):
//   compare_set("k", "x", "y") on a missing key -> b'x' (key stays missing)
//   compare_set("k", "", "y")  -> b'y';  compare_set("k", "z", "w") -> b'y';
//   compare_set("k", "y", "w") -> b'w';  add("c", 5) -> 5, add("c", -7) -> -2, get -> b'-2'
//   set("n", "12"); add("n", 1) -> 13;   add on "abc" raises.
#include <fcntl.h>
#include <sys/file.h>

#include <atomic>
#include <climits>
#include <fstream>

#include <ember/distributed/store/etcd_store.h>
#include <ember/distributed/store/file_store.h>
#include <ember/distributed/store/hash_store.h>
#include <ember/distributed/store/prefix_store.h>
#include <ember/distributed/store/tcp_store.h>
#include "tests/distributed/store/etcd_test_util.h"
#include "tests/distributed/store/store_test_util.h"

namespace ember::dist {
namespace {

using namespace std::chrono_literals;
using test::expect_error;
using test::to_bytes;
using test::to_string;

constexpr Duration kLong = std::chrono::seconds(60);  // generous: tests run on loaded machines

enum class Kind { kHash, kFile, kTCP, kPrefixHash, kPrefixTCP, kEtcd, kEtcdTls };

std::string kind_name(Kind k) {
  switch (k) {
    case Kind::kHash:
      return "Hash";
    case Kind::kFile:
      return "File";
    case Kind::kTCP:
      return "TCP";
    case Kind::kPrefixHash:
      return "PrefixOverHash";
    case Kind::kPrefixTCP:
      return "PrefixOverTCP";
    case Kind::kEtcd:
      return "Etcd";
    case Kind::kEtcdTls:
      return "EtcdOverTls";
  }
  return "?";
}

// One store under test plus whatever keeps it alive, and a way to open another handle on the
// same keys (a second client, a second FileStore on the file, ...).
struct Env {
  std::unique_ptr<test::TestPki> pki;  // outlives the etcd server that uses its files
  std::unique_ptr<test::EtcdServer> etcd;
  std::unique_ptr<test::TempDir> dir;
  std::unique_ptr<TCPStoreServer> server;
  std::shared_ptr<Store> base;
  std::function<std::shared_ptr<Store>()> another;
  std::shared_ptr<Store> store;
};

std::shared_ptr<Store> tcp_client(uint16_t port) {
  TCPStoreOptions o;
  o.timeout = kLong;
  return std::make_shared<TCPStore>("127.0.0.1", port, o);
}

std::unique_ptr<TCPStoreServer> local_server() {
  TCPStoreServerOptions so;
  so.host = "127.0.0.1";
  so.secret = "";
  return std::make_unique<TCPStoreServer>(so);
}

Env make_env(Kind kind) {
  Env env;
  switch (kind) {
    case Kind::kHash: {
      auto h = std::make_shared<HashStore>(kLong);
      env.another = [h] { return h; };
      break;
    }
    case Kind::kFile: {
      env.dir = std::make_unique<test::TempDir>();
      const std::string path = env.dir->file("store");
      env.another = [path] { return std::make_shared<FileStore>(path, -1, kLong); };
      break;
    }
    case Kind::kTCP:
    case Kind::kPrefixTCP: {
      env.server = local_server();
      const uint16_t port = env.server->port();
      env.another = [port] { return tcp_client(port); };
      break;
    }
    case Kind::kPrefixHash: {
      auto h = std::make_shared<HashStore>(kLong);
      env.another = [h] { return h; };
      break;
    }
    case Kind::kEtcd:
    case Kind::kEtcdTls: {
      // Over TLS, with client certificates: every request, on every client's connections.
      if (kind == Kind::kEtcdTls) env.pki = std::make_unique<test::TestPki>();
      env.etcd = std::make_unique<test::EtcdServer>(
          test::EtcdServerTls{env.pki.get(), /*client_cert_auth=*/true});
      env.another = [endpoint = env.etcd->endpoint(), tls = env.etcd->client_options()] {
        EtcdStoreOptions o = tls;
        o.prefix = "job";
        o.timeout = kLong;
        return std::make_shared<EtcdStore>(endpoint, o);
      };
      break;
    }
  }
  if (kind == Kind::kPrefixHash || kind == Kind::kPrefixTCP) {
    auto inner = env.another;
    env.another = [inner] { return std::make_shared<PrefixStore>("job", inner()); };
  }
  env.store = env.another();
  return env;
}

void PrintTo(Kind k, std::ostream* os) { *os << kind_name(k); }

// Messages name keys as the underlying store sees them ('job/k' through a PrefixStore), so
// the tests look for the key's end: "k'".
class StoreTest : public ::testing::TestWithParam<Kind> {
 protected:
  void SetUp() override {
    if (GetParam() == Kind::kEtcd && !test::etcd_unavailable_reason().empty()) {
      GTEST_SKIP() << test::etcd_unavailable_reason();
    }
    if (GetParam() == Kind::kEtcdTls && !test::etcd_tls_unavailable_reason().empty()) {
      GTEST_SKIP() << test::etcd_tls_unavailable_reason();
    }
    env_ = make_env(GetParam());
  }
  Store& store() { return *env_.store; }
  Env env_;
};

TEST_P(StoreTest, SetGetOverwriteAndBinaryData) {
  store().set("a", std::string("1"));
  EXPECT_EQ(store().get_string("a"), "1");
  store().set("a", std::string("2"));
  auto other = env_.another();
  EXPECT_EQ(other->get_string("a"), "2") << "a second handle must see the overwrite";

  std::string key("k\0ey\xff", 5);
  Bytes all(256);
  for (int i = 0; i < 256; ++i) all[i] = static_cast<uint8_t>(i);
  store().set(key, all);
  EXPECT_EQ(other->get(key), all) << "keys and values are arbitrary bytes";
  store().set("empty", Bytes{});
  EXPECT_TRUE(other->get("empty").empty());
  EXPECT_TRUE(other->check({"empty"})) << "an empty value is still a key";
}

TEST_P(StoreTest, AddCountsFromZeroAndStoresDecimalText) {
  EXPECT_EQ(store().add("c", 5), 5);
  EXPECT_EQ(store().add("c", -7), -2);
  EXPECT_EQ(store().get_string("c"), "-2");
  store().set("n", std::string("12"));
  EXPECT_EQ(env_.another()->add("n", 1), 13);
  EXPECT_EQ(store().add("zero", 0), 0);
  EXPECT_TRUE(store().check({"zero"})) << "add(key, 0) creates the key";
  EXPECT_EQ(store().add("big", INT64_MIN), INT64_MIN);
  EXPECT_EQ(store().get_string("big"), "-9223372036854775808");
  EXPECT_EQ(store().add("big", INT64_MAX), -1);
}

TEST_P(StoreTest, AddOnNonIntegerOrOverflowThrows) {
  store().set("t", std::string("abc"));
  expect_error<DistStoreError>([&] { store().add("t", 1); }, {"add", "t'", "'abc'", "int64"});
  EXPECT_EQ(store().get_string("t"), "abc") << "a failed add must not change the value";
  store().set("s", std::string("1 "));
  expect_error<DistStoreError>([&] { store().add("s", 1); }, {"add", "'1 '"});
  EXPECT_EQ(store().add("o", INT64_MAX), INT64_MAX);
  expect_error<DistStoreError>([&] { store().add("o", 1); },
                               {"add", "9223372036854775807", "overflows"});
  EXPECT_EQ(store().add("o", -1), INT64_MAX - 1) << "the store stays usable after an error";
}

TEST_P(StoreTest, CompareSetFollowsTorch) {
  EXPECT_EQ(to_string(store().compare_set("k", to_bytes("x"), to_bytes("y"))), "x");
  EXPECT_FALSE(store().check({"k"})) << "a missing key with non-empty expected stays missing";
  EXPECT_EQ(to_string(store().compare_set("k", {}, to_bytes("y"))), "y");
  EXPECT_EQ(store().get_string("k"), "y");
  EXPECT_EQ(to_string(store().compare_set("k", to_bytes("z"), to_bytes("w"))), "y");
  EXPECT_EQ(store().get_string("k"), "y");
  EXPECT_EQ(to_string(store().compare_set("k", to_bytes("y"), to_bytes("w"))), "w");
  EXPECT_EQ(env_.another()->get_string("k"), "w");
}

TEST_P(StoreTest, CheckDeleteAndNumKeys) {
  EXPECT_EQ(store().num_keys(), 0);
  EXPECT_TRUE(store().check({}));
  EXPECT_FALSE(store().check({"x"}));
  store().set("x", std::string("1"));
  store().set("y", std::string("2"));
  store().add("z", 3);
  EXPECT_TRUE(store().check({"x", "y", "z"}));
  EXPECT_FALSE(store().check({"x", "nope"}));
  EXPECT_EQ(store().num_keys(), 3);
  EXPECT_TRUE(store().delete_key("x"));
  EXPECT_FALSE(env_.another()->delete_key("x"));
  EXPECT_FALSE(store().check({"x"}));
  EXPECT_EQ(store().num_keys(), 2);
  store().set("x", std::string("again"));
  EXPECT_EQ(store().get_string("x"), "again");
}

TEST_P(StoreTest, GetAndWaitTimeOutNamingKeysAndTimeout) {
  const auto t0 = std::chrono::steady_clock::now();
  expect_error<DistTimeoutError>([&] { store().get("missing", 150ms); },
                                 {"get", "missing'", "150 ms"});
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 150ms) << "gave up before the timeout";
  store().set("have", std::string("1"));
  expect_error<DistTimeoutError>(
      [&] {
        store().wait({"have", "nope"}, 120ms);
      },
      {"wait", "120 ms", "have'", "missing: [", "nope'"});
  // The store is still usable after timeouts (a TCP connection is reused or reopened).
  EXPECT_EQ(store().get_string("have"), "1");
  store().wait({"have"}, 100ms);
  store().wait({}, 100ms);
}

TEST_P(StoreTest, DefaultTimeoutIsTheStoresAndMustBePositive) {
  store().set_timeout(100ms);
  expect_error<DistTimeoutError>([&] { store().get("x"); }, {"x'", "100 ms"});
  expect_error<DistTimeoutError>([&] { store().wait({"x"}); }, {"x'", "100 ms"});
  expect_error<ValueError>([&] { store().get("x", 0ms); }, {"get", "timeout must be positive"});
  expect_error<ValueError>([&] { store().wait({"x"}, -5ms); }, {"wait", "-5 ms"});
}

TEST_P(StoreTest, BlockedGetAndWaitWakeWhenAnotherHandleSets) {
  auto waiter = env_.another();
  std::string got;
  std::string error;
  std::thread t([&] {
    try {
      waiter->wait({"k1", "k2", "k1"}, kLong);
      got = to_string(waiter->get("k2", kLong));
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  store().set("k1", std::string("one"));
  store().set("k2", std::string("two"));
  t.join();
  EXPECT_EQ(error, "");
  EXPECT_EQ(got, "two");
}

TEST_P(StoreTest, OneHandleServesManyThreadsAtOnce) {
  // A thread blocked in get must not hold up the others on the same handle.
  std::string got;
  std::thread t([&] {
    try {
      got = to_string(store().get("late", kLong));
    } catch (const std::exception& e) {
      got = e.what();
    }
  });
  constexpr int kThreads = 4, kAdds = 100;
  std::vector<std::thread> adders;
  for (int i = 0; i < kThreads; ++i) {
    adders.emplace_back([&] {
      for (int j = 0; j < kAdds; ++j) store().add("n", 1);
    });
  }
  for (auto& a : adders) a.join();
  store().set("late", std::string("here"));
  t.join();
  EXPECT_EQ(got, "here");
  EXPECT_EQ(store().add("n", 0), kThreads * kAdds);
}

TEST_P(StoreTest, ADeletedKeyMustBeSetAgainToEndAWait) {
  store().set("k", std::string("v"));
  EXPECT_TRUE(store().delete_key("k"));
  expect_error<DistTimeoutError>([&] { store().wait({"k"}, 100ms); }, {"k'"});
}

TEST_P(StoreTest, LargeValueRoundTrips) {
  Bytes big(3 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>(i * 131 + (i >> 12));
  store().set("big", big);
  const Bytes back = env_.another()->get("big");
  ASSERT_EQ(back.size(), big.size());
  EXPECT_TRUE(back == big) << "a 3 MiB value came back different";
}

INSTANTIATE_TEST_SUITE_P(AllStores, StoreTest,
                         ::testing::Values(Kind::kHash, Kind::kFile, Kind::kTCP, Kind::kPrefixHash,
                                           Kind::kPrefixTCP, Kind::kEtcd, Kind::kEtcdTls),
                         [](const auto& info) { return kind_name(info.param); });

// ---- PrefixStore ----

TEST(PrefixStore, KeysOfDifferentPrefixesDoNotMix) {
  auto base = std::make_shared<HashStore>(kLong);
  PrefixStore a("a", base), b("b", base);
  a.set("k", std::string("1"));
  b.set("k", std::string("2"));
  EXPECT_EQ(a.get_string("k"), "1");
  EXPECT_EQ(b.get_string("k"), "2");
  EXPECT_EQ(base->get_string("a/k"), "1") << "torch joins prefix and key with '/'";
  a.set("only_a", std::string("x"));
  EXPECT_FALSE(b.check({"only_a"}));
  expect_error<DistTimeoutError>([&] { b.wait({"only_a"}, 100ms); }, {"'b/only_a'", "100 ms"});
  EXPECT_EQ(a.add("n", 2), 2);
  EXPECT_EQ(b.add("n", 5), 5);
  EXPECT_TRUE(a.delete_key("k"));
  EXPECT_EQ(b.get_string("k"), "2") << "deleting a/k must leave b/k";
  EXPECT_EQ(a.num_keys(), base->num_keys()) << "num_keys is the underlying store's (torch)";
  PrefixStore nested("x", std::make_shared<PrefixStore>("y", base));
  nested.set("k", std::string("deep"));
  EXPECT_EQ(base->get_string("y/x/k"), "deep");
  EXPECT_EQ(a.prefix(), "a");
  EXPECT_EQ(a.underlying_store(), base);
}

TEST(PrefixStore, TakesTheUnderlyingTimeoutAndRejectsNull) {
  auto base = std::make_shared<HashStore>(1234ms);
  PrefixStore p("p", base);
  EXPECT_EQ(p.timeout(), 1234ms);
  expect_error<ValueError>([] { PrefixStore("p", nullptr); }, {"PrefixStore", "'p'", "null"});
  // One timeout, shared both ways (c10d's): a change to either is the other's, and a call
  // without a timeout through the prefix waits the store's current one.
  base->set_timeout(50ms);
  EXPECT_EQ(p.timeout(), 50ms);
  expect_error<DistTimeoutError>([&] { p.get("missing"); }, {"get", "50 ms"});
  p.set_timeout(70ms);
  EXPECT_EQ(base->timeout(), 70ms);
}

// ---- HashStore ----

TEST(HashStore, WaitersInManyThreadsAllWake) {
  HashStore s(kLong);
  constexpr int kThreads = 8;
  std::atomic<int> woke{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      s.wait({"go"}, kLong);
      s.set("t" + std::to_string(i), std::to_string(i));
      ++woke;
    });
  }
  s.set("go", std::string("1"));
  std::vector<std::string> all;
  for (int i = 0; i < kThreads; ++i) all.push_back(std::string("t").append(std::to_string(i)));
  s.wait(all, kLong);
  for (auto& t : threads) t.join();
  EXPECT_EQ(woke.load(), kThreads);
  EXPECT_EQ(s.num_keys(), kThreads + 1);
}

// ---- FileStore ----

TEST(FileStore, KeysPersistAcrossHandlesAndTheLastOfWorldSizeRemovesTheFile) {
  test::TempDir dir;
  const std::string path = dir.file("fs");
  {
    FileStore a(path, 2, kLong);
    a.set("k", std::string("v"));
    {
      FileStore b(path, 2, kLong);
      EXPECT_EQ(b.get_string("k"), "v");
      EXPECT_EQ(b.num_keys(), 1) << "internal reference counters are not keys";
    }
    EXPECT_TRUE(std::filesystem::exists(path)) << "one of two users is still there";
  }
  EXPECT_FALSE(std::filesystem::exists(path)) << "the last of world_size=2 users removes it";

  {
    FileStore c(path, -1, kLong);
    c.set("kept", std::string("yes"));
  }
  ASSERT_TRUE(std::filesystem::exists(path)) << "without a world size the file is kept";
  FileStore d(path, -1, kLong);
  EXPECT_EQ(d.get_string("kept"), "yes");
  EXPECT_EQ(d.path(), path);
}

TEST(FileStore, ErrorsNameThePath) {
  test::TempDir dir;
  expect_error<DistStoreError>([&] { FileStore(dir.file("no/such/dir"), -1, kLong); },
                               {"FileStore", dir.file("no/such/dir"), "No such file"});
  const std::string other = dir.file("other");
  std::ofstream(other) << "hello, this is not a store";
  expect_error<DistStoreError>([&] { FileStore(other, -1, kLong); },
                               {other, "not a FileStore file"});
  expect_error<ValueError>([&] { FileStore(dir.file("x"), -1, 0ms); }, {"FileStore", "0 ms"});
}

TEST(FileStore, ATornRecordFromACrashedWriterIsCutOff) {
  test::TempDir dir;
  const std::string path = dir.file("fs");
  { FileStore(path, -1, kLong).set("a", std::string("1")); }
  {
    // What a writer killed mid-append leaves: a record header promising more than is there.
    std::ofstream f(path, std::ios::app | std::ios::binary);
    const char torn[] = {1, 5, 0, 0, 0, 100, 0, 0, 0, 'a', 'b'};
    f.write(torn, sizeof(torn));
  }
  const auto torn_size = std::filesystem::file_size(path);
  FileStore s(path, -1, kLong);
  EXPECT_EQ(s.get_string("a"), "1");
  s.set("b", std::string("2"));
  FileStore t(path, -1, kLong);
  EXPECT_EQ(t.get_string("b"), "2");
  EXPECT_EQ(t.get_string("a"), "1");
  EXPECT_EQ(t.num_keys(), 2);
  EXPECT_LT(std::filesystem::file_size(path), torn_size + 40) << "the torn bytes were not cut";

  {
    std::ofstream f(path, std::ios::app | std::ios::binary);
    const char bad[] = {0x77, 0, 0, 0, 0, 0, 0, 0, 0};
    f.write(bad, sizeof(bad));
  }
  expect_error<DistStoreError>([&] { t.set("c", std::string("3")); },
                               {"FileStore set", path, "corrupt", "kind 119"});
}

TEST(FileStore, ALockHeldElsewhereEndsInATimeout) {
  test::TempDir dir;
  const std::string path = dir.file("fs");
  FileStore s(path, -1, kLong);
  s.set_timeout(150ms);
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);  // another open file description: flock excludes it
  expect_error<DistTimeoutError>([&] { s.set("k", std::string("v")); },
                                 {"FileStore set", "could not lock", path, "150 ms"});
  expect_error<DistTimeoutError>([&] { s.get("k", 120ms); }, {"FileStore get", "120 ms"});
  ::flock(fd, LOCK_UN);
  ::close(fd);
  s.set("k", std::string("v"));
  EXPECT_EQ(s.get_string("k"), "v");
}

// Four processes and this one share a FileStore: counters, a compare_set race, waits and
// gets across processes, and the world-size clean-up at the end.
TEST(FileStore, FiveProcessesShareOneFile) {
  test::TempDir dir;
  const std::string path = dir.file("shared");
  constexpr int kChildren = 4, kAdds = 100;
  test::Children kids(kChildren, [&](int i, const std::string&) {
    FileStore s(path, kChildren + 1, kLong);
    for (int j = 0; j < kAdds; ++j) s.add("counter", 1);
    const Bytes leader = s.compare_set("leader", {}, to_bytes("child" + std::to_string(i)));
    s.set("saw_leader/" + std::to_string(i), leader);
    s.set("rank/" + std::to_string(i), "value" + std::to_string(i));
    std::vector<std::string> ranks{"rank/parent"};
    for (int r = 0; r < kChildren; ++r) ranks.push_back("rank/" + std::to_string(r));
    s.wait(ranks);
    for (int r = 0; r < kChildren; ++r) {
      test::require(s.get_string("rank/" + std::to_string(r)) == "value" + std::to_string(r),
                    "rank/" + std::to_string(r) + " has the wrong value");
    }
    test::require(s.get_string("from_parent") == "hello", "from_parent has the wrong value");
  });
  {
    FileStore s(path, kChildren + 1, kLong);
    kids.go("");
    s.set("rank/parent", std::string("p"));
    std::vector<std::string> ranks;
    for (int r = 0; r < kChildren; ++r) ranks.push_back("rank/" + std::to_string(r));
    s.wait(ranks);
    s.set("from_parent", std::string("hello"));
    test::expect_children_ok(kids.join());
    EXPECT_EQ(s.add("counter", 0), kChildren * kAdds);
    const std::string leader = s.get_string("leader");
    EXPECT_EQ(leader.rfind("child", 0), 0u) << leader;
    for (int i = 0; i < kChildren; ++i) {
      EXPECT_EQ(s.get_string("saw_leader/" + std::to_string(i)), leader)
          << "child " << i << " saw another compare_set winner";
    }
    EXPECT_TRUE(std::filesystem::exists(path));
  }
  EXPECT_FALSE(std::filesystem::exists(path)) << "the last of the 5 users removes the file";
}

}  // namespace
}  // namespace ember::dist
