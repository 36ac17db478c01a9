// TCPStore and TCPStoreServer: real processes sharing one server, connection retry and
// timeouts, the shared secret, and a server that survives malformed or hostile input.
// Every server binds 127.0.0.1 on a port the OS picks.
#include <ember/distributed/store/tcp_store.h>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/tcp.h>
#include <sys/resource.h>

#include <array>
#include <atomic>

#include <ember/distributed/store/detail/store_protocol.h>
#include <ember/distributed/store/prefix_store.h>
#include "tests/distributed/store/store_test_util.h"

namespace ember::dist {
namespace {

using namespace std::chrono_literals;
using test::expect_error;
using test::to_bytes;
using test::to_string;
namespace wire = ember::dist::detail::store_wire;

constexpr Duration kLong = std::chrono::seconds(60);

TCPStoreServerOptions local(std::optional<std::string> secret = std::string()) {
  TCPStoreServerOptions o;
  o.host = "127.0.0.1";
  o.secret = std::move(secret);
  return o;
}

TCPStoreOptions client_options(std::optional<std::string> secret = std::string()) {
  TCPStoreOptions o;
  o.timeout = kLong;
  o.secret = std::move(secret);
  return o;
}

std::string hex(const std::array<uint8_t, 32>& h) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (uint8_t b : h) s += {d[b >> 4], d[b & 15]};
  return s;
}

// A hand-driven client socket for sending what a real client never would.
class Raw {
 public:
  explicit Raw(uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port);
    if (fd_ < 0 || ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      throw std::runtime_error("Raw: cannot connect");
    }
  }
  ~Raw() { ::close(fd_); }

  // Sends bytes; errors are ignored (the server may already have closed).
  void send(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    while (n) {
      const ssize_t k = ::send(fd_, p, n, MSG_NOSIGNAL);
      if (k <= 0) return;
      p += k;
      n -= static_cast<size_t>(k);
    }
  }
  void send(const Bytes& b) { send(b.data(), b.size()); }

  // "127.0.0.1:port" of this end, as the server names it in its log.
  std::string address() const {
    sockaddr_in a{};
    socklen_t len = sizeof(a);
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    return "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  }
  void send(const std::string& s) { send(s.data(), s.size()); }

  // Reads one frame; throws if the connection ends or nothing comes within 60 s.
  std::pair<uint8_t, Bytes> frame() {
    uint8_t h[wire::kHeaderSize];
    read(h, sizeof(h));
    std::string why;
    const auto hdr = wire::parse_header(h, &why);
    if (!hdr) throw std::runtime_error("Raw: bad frame: " + why);
    Bytes payload(hdr->length);
    read(payload.data(), payload.size());
    return {hdr->type, payload};
  }

  // Completes the handshake (empty proof without a secret).
  void authenticate(const std::string& secret = "") {
    auto [type, payload] = frame();
    if (type != uint8_t(wire::Type::kChallenge)) throw std::runtime_error("Raw: no challenge");
    wire::PayloadReader r(payload.data(), payload.size());
    Bytes nonce;
    r.blob(64, &nonce);
    const Bytes proof = secret.empty() ? Bytes{} : wire::auth_proof(secret, nonce);
    send(wire::FrameWriter(wire::Type::kAuth).blob(proof).finish());
    if (frame().first != uint8_t(wire::Type::kOk)) throw std::runtime_error("Raw: auth refused");
  }

  // True once the server closes the connection (EOF or reset); whatever it sends before that
  // is read and dropped. False if it stays open for timeout_ms.
  bool closed_by_server(int timeout_ms = 60000) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    char buf[4096];
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                            deadline - std::chrono::steady_clock::now())
                            .count();
      if (left <= 0) return false;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
      const ssize_t k = ::recv(fd_, buf, sizeof(buf), 0);
      if (k == 0 || (k < 0 && errno == ECONNRESET)) return true;
    }
  }

 private:
  void read(uint8_t* p, size_t n) {
    while (n) {
      pollfd pf{fd_, POLLIN, 0};
      if (::poll(&pf, 1, 60000) <= 0) throw std::runtime_error("Raw: read timed out");
      const ssize_t k = ::recv(fd_, p, n, 0);
      if (k <= 0) throw std::runtime_error("Raw: connection ended");
      p += k;
      n -= static_cast<size_t>(k);
    }
  }
  int fd_ = -1;
};

// A header with any type and length (for frames the real writer refuses to build).
Bytes header(uint8_t type, uint32_t length, uint32_t magic = wire::kMagic) {
  Bytes h(wire::kHeaderSize, 0);
  for (int i = 0; i < 4; ++i) h[i] = uint8_t(magic >> (8 * i));
  h[4] = wire::kVersion;
  h[5] = type;
  for (int i = 0; i < 4; ++i) h[8 + i] = uint8_t(length >> (8 * i));
  return h;
}

// The server still serves: a new client can set and read back a key.
void expect_serving(uint16_t port, const std::string& key, std::optional<std::string> secret = "") {
  TCPStore c("127.0.0.1", port, client_options(secret));
  c.set(key, std::string("alive"));
  EXPECT_EQ(c.get_string(key), "alive") << "the server stopped serving after " << key;
}

// ---- protocol pieces ----

TEST(StoreProtocol, HmacAndProofMatchTheStandards) {
  // RFC 4231 test cases 1, 2 and 6 (a key longer than SHA-256's block is hashed first), and an
  // empty key (checked with Python's hmac).
  const std::string hi = "Hi There";
  EXPECT_EQ(hex(wire::hmac_sha256(std::string(20, '\x0b'), hi.data(), hi.size())),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  const std::string q = "what do ya want for nothing?";
  EXPECT_EQ(hex(wire::hmac_sha256("Jefe", q.data(), q.size())),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  const std::string big = "Test Using Larger Than Block-Size Key - Hash Key First";
  EXPECT_EQ(hex(wire::hmac_sha256(std::string(131, '\xaa'), big.data(), big.size())),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  const std::string abc = "abc";
  EXPECT_EQ(hex(wire::hmac_sha256("", abc.data(), abc.size())),
            "fd7adb152c05ef80dccf50a1fa4c05d5a3ec6da95575fc312ae7c5d091836351");
  // The handshake proof on the wire, HMAC-SHA256(secret, "ember-store-auth-v1" + nonce): a
  // change here breaks every peer built before it.
  const Bytes proof = wire::auth_proof("s3cret", Bytes(wire::kNonceSize, 0));
  ASSERT_EQ(proof.size(), 32u);
  std::array<uint8_t, 32> mac{};
  std::copy(proof.begin(), proof.end(), mac.begin());
  EXPECT_EQ(hex(mac), "cfe825cbfee2f5b7d605d1d0f7483db9f9d716fe2fa9c05eb813341f5f4e7861");
  EXPECT_TRUE(wire::constant_time_equal(to_bytes("abc"), to_bytes("abc")));
  EXPECT_FALSE(wire::constant_time_equal(to_bytes("abc"), to_bytes("abd")));
  EXPECT_FALSE(wire::constant_time_equal(to_bytes("abc"), to_bytes("ab")));
  EXPECT_TRUE(wire::constant_time_equal(Bytes{}, Bytes{}));
}

TEST(StoreProtocol, ReaderRejectsOverrunsAndOverlongFields) {
  const Bytes f = wire::FrameWriter(wire::Type::kSet).blob(std::string("key")).u64(7).finish();
  ASSERT_EQ(f.size(), wire::kHeaderSize + 4 + 3 + 8);
  const uint8_t* p = f.data() + wire::kHeaderSize;
  {
    wire::PayloadReader r(p, f.size() - wire::kHeaderSize);
    std::string k;
    uint64_t v = 0;
    EXPECT_TRUE(r.blob(16, &k) && r.u64(&v) && r.done());
    EXPECT_EQ(k, "key");
    EXPECT_EQ(v, 7u);
  }
  {
    wire::PayloadReader r(p, f.size() - wire::kHeaderSize);
    std::string k;
    EXPECT_FALSE(r.blob(2, &k)) << "a blob over its limit must fail";
    uint64_t v = 0;
    EXPECT_FALSE(r.u64(&v)) << "reads after a failure fail too";
  }
  {
    wire::PayloadReader r(p, 6);  // cut inside the key
    std::string k;
    EXPECT_FALSE(r.blob(16, &k));
  }
  std::string why;
  EXPECT_FALSE(wire::parse_header(header(11, 0, 0x12345678).data(), &why));
  EXPECT_NE(why.find("magic"), std::string::npos) << why;
}

// ---- processes ----

// Four client processes and this one share a server: counters, a compare_set race, waits and
// gets across processes, and the launcher-style wait for workers.
TEST(TCPStore, FiveProcessesShareOneServer) {
  constexpr int kChildren = 4, kAdds = 200;
  test::Children kids(kChildren, [&](int i, const std::string& port) {
    TCPStoreOptions o = client_options();
    o.world_size = kChildren + 1;
    TCPStore s("127.0.0.1", static_cast<uint16_t>(std::stoi(port)), o);
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
    s.add("done", 1);
  });
  TCPStoreServer server(local());  // threads start only after the fork
  kids.go(std::to_string(server.port()));
  TCPStoreOptions o = client_options();
  o.world_size = kChildren + 1;
  TCPStore s("127.0.0.1", server.port(), o);
  server.wait_for_workers(kChildren + 1, kLong);
  EXPECT_EQ(server.num_workers(), kChildren + 1);
  s.set("rank/parent", std::string("p"));
  std::vector<std::string> ranks;
  for (int r = 0; r < kChildren; ++r) ranks.push_back("rank/" + std::to_string(r));
  s.wait(ranks);
  s.set("from_parent", std::string("hello"));
  test::expect_children_ok(kids.join());
  EXPECT_EQ(s.add("counter", 0), kChildren * kAdds);
  EXPECT_EQ(s.add("done", 0), kChildren);
  const std::string leader = s.get_string("leader");
  EXPECT_EQ(leader.rfind("child", 0), 0u) << leader;
  for (int i = 0; i < kChildren; ++i) {
    EXPECT_EQ(s.get_string("saw_leader/" + std::to_string(i)), leader)
        << "child " << i << " saw another compare_set winner";
  }
  // counter, leader, 4 saw_leader, 5 rank, from_parent, done; the join counter is not a key.
  EXPECT_EQ(s.num_keys(), 2 + 4 + 5 + 1 + 1);
  EXPECT_EQ(server.stats().protocol_errors, 0);
}

TEST(TCPStore, AClientKilledWhileWaitingIsForgottenAndOthersGoOn) {
  test::Children kids(1, [](int, const std::string& port) {
    TCPStore s("127.0.0.1", static_cast<uint16_t>(std::stoi(port)), client_options());
    s.get("never", kLong);  // parked until the parent kills this process
  });
  TCPStoreServer server(local());
  kids.go(std::to_string(server.port()));
  ASSERT_TRUE(test::eventually([&] { return server.stats().waiting == 1; }))
      << "the child's get never reached the server";
  kids.kill(0);
  EXPECT_TRUE(test::eventually([&] {
    const auto st = server.stats();
    return st.waiting == 0 && st.active == 0;
  })) << "the dead client's connection and parked get were not cleaned up";
  expect_serving(server.port(), "after_kill");
}

TEST(TCPStore, StoppingTheServerWakesWaitingClientProcessesWithAnError) {
  test::Children kids(2, [](int, const std::string& port) {
    TCPStore s("127.0.0.1", static_cast<uint16_t>(std::stoi(port)), client_options());
    try {
      s.wait({"never"}, kLong);
    } catch (const DistNetworkError& e) {
      test::require(std::string(e.what()).find("lost the connection") != std::string::npos,
                    std::string("unexpected message: ") + e.what());
      return;
    }
    throw std::runtime_error("wait returned although the server stopped");
  });
  TCPStoreServer server(local());
  kids.go(std::to_string(server.port()));
  ASSERT_TRUE(test::eventually([&] { return server.stats().waiting == 2; }));
  const auto t0 = std::chrono::steady_clock::now();
  server.stop();
  test::expect_children_ok(kids.join(30000));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 30s) << "clients hung after the stop";
}

// ---- connecting ----

TEST(TCPStore, ConnectingGivesUpAtTheTimeoutNamingHostPortAndTimeout) {
  const uint16_t port = test::unused_port();
  TCPStoreOptions o = client_options();
  o.timeout = 300ms;
  const auto t0 = std::chrono::steady_clock::now();
  expect_error<DistNetworkError>(
      [&] { TCPStore("127.0.0.1", port, o); },
      {"could not connect", "127.0.0.1:" + std::to_string(port), "300 ms", "refused"});
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 300ms) << "gave up before the timeout";
  expect_error<ValueError>([&] { TCPStore("127.0.0.1", 0, client_options()); },
                           {"port 0", "is_server"});
}

TEST(TCPStore, AClientRetriesUntilTheServerComesUp) {
  const uint16_t port = test::unused_port();
  std::string error;
  std::unique_ptr<TCPStore> client;
  std::thread t([&] {
    try {
      client = std::make_unique<TCPStore>("127.0.0.1", port, client_options());
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  // Not a synchronisation: the test passes whichever comes first; the pause only makes it
  // likely that the client meets a refused connection and has to retry.
  std::this_thread::sleep_for(200ms);
  TCPStoreServerOptions so = local();
  so.port = port;
  TCPStoreServer server(so);
  t.join();
  ASSERT_EQ(error, "");
  client->set("k", std::string("v"));
  EXPECT_EQ(client->get_string("k"), "v");
}

TEST(TCPStore, ServerRankWaitsForWorkers) {
  const uint16_t port = test::unused_port();
  std::vector<std::thread> workers;
  std::vector<std::string> errors(2);
  for (int i = 0; i < 2; ++i) {
    workers.emplace_back([&, i] {
      try {
        TCPStoreOptions o = client_options();
        o.world_size = 3;
        TCPStore s("127.0.0.1", port, o);
        s.set("worker" + std::to_string(i), std::string("up"));
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    });
  }
  TCPStoreOptions o = client_options();
  o.is_server = true;
  o.listen_host = "127.0.0.1";
  o.world_size = 3;
  TCPStore rank0("127.0.0.1", port, o);  // returns once all three joined
  EXPECT_EQ(rank0.server()->num_workers(), 3);
  EXPECT_EQ(rank0.port(), port);
  for (auto& w : workers) w.join();
  for (const auto& e : errors) EXPECT_EQ(e, "");
  rank0.wait({"worker0", "worker1"}, kLong);
  EXPECT_EQ(rank0.num_keys(), 2) << "the join counter is not a key";

  TCPStoreOptions alone = client_options();
  alone.is_server = true;
  alone.listen_host = "127.0.0.1";
  alone.world_size = 2;
  alone.timeout = 200ms;
  expect_error<DistTimeoutError>([&] { TCPStore("127.0.0.1", 0, alone); },
                                 {"wait_for_workers", "200 ms", "2 workers", "1 joined"});
  alone.wait_for_workers = false;
  TCPStore no_wait("127.0.0.1", 0, alone);
  EXPECT_NE(no_wait.port(), 0);
  EXPECT_EQ(no_wait.server()->num_workers(), 1);
}

TEST(TCPStore, ListeningOnABusyPortFailsClearly) {
  TCPStoreServer first(local());
  TCPStoreServerOptions so = local();
  so.port = first.port();
  expect_error<DistNetworkError>(
      [&] { TCPStoreServer second(so); },
      {"cannot listen", "127.0.0.1:" + std::to_string(first.port()), "in use"});
}

TEST(TCPStore, LimitsAreCheckedBeforeSending) {
  TCPStoreServer server(local());
  TCPStore c("127.0.0.1", server.port(), client_options());
  const std::string long_key(wire::kMaxKeySize + 1, 'k');
  expect_error<ValueError>([&] { c.set(long_key, std::string("v")); },
                           {"TCPStore set", "4097 bytes", "4096"});
  expect_error<ValueError>([&] { c.set("k", Bytes(wire::kMaxValueSize + 1)); },
                           {"TCPStore set", "'k'", "67108865 bytes"});
  expect_error<ValueError>(
      [&] { c.wait(std::vector<std::string>(wire::kMaxKeysPerRequest + 1, "k"), kLong); },
      {"TCPStore wait", "4097 keys"});
  c.set(std::string(wire::kMaxKeySize, 'k'), std::string("at the limit"));
  EXPECT_EQ(c.get_string(std::string(wire::kMaxKeySize, 'k')), "at the limit");
}

TEST(TCPStore, ANonEmberServerIsReportedNotRetried) {
  // A listener that answers like a web server.
  const int lfd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  ASSERT_EQ(::bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::listen(lfd, 4), 0);
  ASSERT_EQ(::getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  const uint16_t port = ntohs(a.sin_port);
  std::thread web([&] {
    const int c = ::accept(lfd, nullptr, nullptr);
    if (c < 0) return;
    const std::string reply = "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n";
    (void)!::send(c, reply.data(), reply.size(), MSG_NOSIGNAL);
    char buf[256];
    while (::recv(c, buf, sizeof(buf), 0) > 0) {
    }
    ::close(c);
  });
  expect_error<DistStoreError>(
      [&] { TCPStore("127.0.0.1", port, client_options()); },
      {"not an Ember TCPStore", "127.0.0.1:" + std::to_string(port), "magic"});
  web.join();
  ::close(lfd);
}

// ---- secret ----

TEST(TCPStore, AWrongOrMissingSecretIsRefused) {
  TCPStoreServer server(local("s3cret"));
  const std::string where = "127.0.0.1:" + std::to_string(server.port());
  expect_error<DistStoreError>(
      [&] { TCPStore("127.0.0.1", server.port(), client_options("wrong")); },
      {"store at " + where +
           " refused the connection: wrong or missing secret (EMBER_STORE_SECRET)",
       "secret differs"});
  expect_error<DistStoreError>([&] { TCPStore("127.0.0.1", server.port(), client_options("")); },
                               {"refused the connection", "no secret"});
  EXPECT_EQ(server.stats().auth_failures, 2);
  expect_serving(server.port(), "with_secret", "s3cret");

  // A stranger who skips the handshake and sends a request is dropped, and sets nothing.
  {
    Raw raw(server.port());
    raw.send(wire::FrameWriter(wire::Type::kSet)
                 .blob(std::string("stolen"))
                 .blob(std::string("x"))
                 .finish());
    EXPECT_TRUE(raw.closed_by_server());
  }
  // A stranger who replays some other connection's proof fails: the nonce differs.
  {
    Raw raw(server.port());
    raw.frame();  // its challenge, ignored
    raw.send(wire::FrameWriter(wire::Type::kAuth)
                 .blob(wire::auth_proof("s3cret", Bytes(wire::kNonceSize, 0)))
                 .finish());
    EXPECT_EQ(raw.frame().first, uint8_t(wire::Type::kAuthFailed));
    EXPECT_TRUE(raw.closed_by_server());
  }
  TCPStore c("127.0.0.1", server.port(), client_options("s3cret"));
  EXPECT_FALSE(c.check({"stolen"}));
  EXPECT_EQ(server.stats().auth_failures, 3);
}

TEST(TCPStore, TheSecretComesFromTheEnvironmentByDefault) {
  ASSERT_EQ(::setenv(kStoreSecretEnv, "from-env", 1), 0);
  struct Unset {
    ~Unset() { ::unsetenv(kStoreSecretEnv); }
  } unset;
  TCPStoreServer server(local(std::nullopt));  // reads EMBER_STORE_SECRET
  TCPStore ok("127.0.0.1", server.port(), client_options(std::nullopt));
  ok.set("k", std::string("v"));
  expect_error<DistStoreError>([&] { TCPStore("127.0.0.1", server.port(), client_options("")); },
                               {"wrong or missing secret"});
  // A server without a secret accepts a client that has one.
  TCPStoreServer open(local(""));
  TCPStore c("127.0.0.1", open.port(), client_options(std::nullopt));
  c.set("k", std::string("v"));
  EXPECT_EQ(c.get_string("k"), "v");
}

// ---- malformed input ----

TEST(TCPStore, GarbageDropsOnlyThatConnection) {
  TCPStoreServer server(local());
  TCPStore before("127.0.0.1", server.port(), client_options());
  before.set("k", std::string("v"));
  {
    Raw raw(server.port());
    raw.send(std::string("GET / HTTP/1.1\r\nHost: x\r\n\r\n"));
    EXPECT_TRUE(raw.closed_by_server()) << "garbage before authenticating";
  }
  {
    Raw raw(server.port());
    raw.authenticate();
    std::string noise(100000, '\0');
    for (size_t i = 0; i < noise.size(); ++i) noise[i] = static_cast<char>(i * 7919 % 251);
    raw.send(noise);
    EXPECT_TRUE(raw.closed_by_server()) << "garbage after authenticating";
  }
  EXPECT_EQ(server.stats().protocol_errors, 2);
  EXPECT_EQ(before.get_string("k"), "v") << "a connected client must be unaffected";
  expect_serving(server.port(), "after_garbage");
}

// A client that sends gets of a large value without reading the replies: the server reads its
// next request only once the last reply is written, so one reply at most is queued for it
// (each get used to queue another copy of the value: emberrun's store grew by 400 MB for 100
// gets of 4 MiB), and the others are served meanwhile.
TEST(TCPStore, AClientThatSendsWithoutReadingQueuesOneReplyAtMost) {
  TCPStoreServer server(local());
  TCPStore c("127.0.0.1", server.port(), client_options());
  constexpr int64_t kValue = 8 << 20;
  c.set("big", std::string(kValue, 'x'));
  Raw raw(server.port());
  raw.authenticate();
  const Bytes get = wire::FrameWriter(wire::Type::kGet).blob(std::string("big")).u64(1000).finish();
  for (int i = 0; i < 32; ++i) raw.send(get);  // and never read
  int64_t most = 0;
  for (int i = 0; i < 200; ++i) most = std::max(most, server.stats().queued_bytes);
  EXPECT_GT(most, 0) << "the first reply is queued: the client reads nothing";
  EXPECT_LE(most, kValue + 64) << "more than one reply queued for one connection";
  expect_serving(server.port(), "beside_a_client_that_does_not_read");
}

TEST(TCPStore, OversizedLengthsAreRefusedWithoutAllocating) {
  TCPStoreServer server(local());
  {
    Raw raw(server.port());  // before authenticating, 256 bytes is the limit
    raw.send(header(uint8_t(wire::Type::kAuth), 257));
    EXPECT_TRUE(raw.closed_by_server());
  }
  {
    Raw raw(server.port());
    raw.authenticate();
    raw.send(header(uint8_t(wire::Type::kSet), 0xffffffffu));
    EXPECT_TRUE(raw.closed_by_server());
  }
  {
    Raw raw(server.port());
    raw.authenticate();
    raw.send(header(uint8_t(wire::Type::kSet), uint32_t(wire::kMaxPayload + 1)));
    EXPECT_TRUE(raw.closed_by_server());
  }
  {
    // A key blob longer than 4 KiB inside a frame of acceptable size.
    Raw raw(server.port());
    raw.authenticate();
    raw.send(wire::FrameWriter(wire::Type::kSet)
                 .blob(std::string(wire::kMaxKeySize + 1, 'k'))
                 .blob(std::string("v"))
                 .finish());
    EXPECT_TRUE(raw.closed_by_server());
  }
  {
    // A key count of a billion with nothing behind it.
    Raw raw(server.port());
    raw.authenticate();
    raw.send(wire::FrameWriter(wire::Type::kCheck).u64(1000000000).finish());
    EXPECT_TRUE(raw.closed_by_server());
  }
  EXPECT_EQ(server.stats().protocol_errors, 5);
  expect_serving(server.port(), "after_oversized");
}

TEST(TCPStore, MalformedFramesAreDropped) {
  TCPStoreServer server(local());
  auto after_auth = [&](const Bytes& bytes) {
    Raw raw(server.port());
    raw.authenticate();
    raw.send(bytes);
    return raw.closed_by_server();
  };
  // A field length that runs past the payload.
  Bytes bad_field = header(uint8_t(wire::Type::kSet), 8);
  for (int b : {0xff, 0xff, 0, 0, 0x61, 0x62, 0x63, 0x64}) bad_field.push_back(uint8_t(b));
  EXPECT_TRUE(after_auth(bad_field)) << "field past the payload";
  // Bytes left over after the fields.
  Bytes extra = wire::FrameWriter(wire::Type::kNumKeys).u64(1).finish();
  EXPECT_TRUE(after_auth(extra)) << "trailing bytes";
  EXPECT_TRUE(after_auth(header(99, 0))) << "unknown type";
  EXPECT_TRUE(after_auth(header(uint8_t(wire::Type::kOk), 0))) << "a reply type as request";
  Bytes bad_version = header(uint8_t(wire::Type::kNumKeys), 0);
  bad_version[4] = 7;
  EXPECT_TRUE(after_auth(bad_version)) << "another protocol version";
  Bytes flags = header(uint8_t(wire::Type::kNumKeys), 0);
  flags[6] = 1;
  EXPECT_TRUE(after_auth(flags)) << "nonzero flags";
  // A second request while a wait is parked.
  Bytes two =
      wire::FrameWriter(wire::Type::kWait).u64(60000).u64(1).blob(std::string("x")).finish();
  const Bytes num = wire::FrameWriter(wire::Type::kNumKeys).finish();
  two.insert(two.end(), num.begin(), num.end());
  EXPECT_TRUE(after_auth(two)) << "pipelined request behind a wait";
  EXPECT_EQ(server.stats().protocol_errors, 7);
  EXPECT_EQ(server.stats().waiting, 0) << "the dropped connection's wait was not cancelled";
  expect_serving(server.port(), "after_malformed");
}

TEST(TCPStore, ATruncatedMessageDoesNotBlockOtherClients) {
  TCPStoreServer server(local());
  Raw raw(server.port());
  raw.authenticate();
  Bytes partial = header(uint8_t(wire::Type::kSet), 100);
  partial.resize(partial.size() + 10, 'x');
  raw.send(partial);  // 10 of 100 payload bytes, and the connection stays open
  expect_serving(server.port(), "while_truncated");
  Raw stalled(server.port());
  stalled.send(header(uint8_t(wire::Type::kAuth), 50).data(), 6);  // half a header
  expect_serving(server.port(), "while_half_header");
}

TEST(TCPStore, AConnectionThatNeverAuthenticatesIsClosed) {
  TCPStoreServerOptions so = local();
  so.handshake_timeout = 200ms;
  TCPStoreServer server(so);
  Raw idle(server.port());
  EXPECT_TRUE(idle.closed_by_server()) << "idle unauthenticated connection kept open";
  expect_serving(server.port(), "after_idle");
}

// ---- hostile peers: memory, stalls and the log ----

// The attack of issue 22: a header claiming the largest payload, one byte of it, then
// nothing. The server must not allocate what the header claims.
TEST(TCPStore, HeadersClaimingTheLargestPayloadCostOnlyWhatArrives) {
  TCPStoreServer server(local());
  std::vector<std::unique_ptr<Raw>> raws;
  for (int i = 0; i < 8; ++i) {
    raws.push_back(std::make_unique<Raw>(server.port()));
    raws.back()->authenticate();
    const int64_t before = server.stats().buffered_bytes;
    Bytes attack = header(uint8_t(wire::Type::kSet), uint32_t(wire::kMaxPayload));
    attack.push_back('x');  // 13 bytes in all
    raws.back()->send(attack);
    ASSERT_TRUE(test::eventually([&] { return server.stats().buffered_bytes > before; }))
        << "the server never made room for connection " << i << "'s payload";
  }
  const int64_t held = server.stats().buffered_bytes;
  EXPECT_LE(held, int64_t{8} << 20) << "8 headers claiming " << wire::kMaxPayload
                                    << " bytes each, with one byte sent, hold " << held;
  expect_serving(server.port(), "during_large_claims");
  raws.clear();
  EXPECT_TRUE(test::eventually([&] { return server.stats().active == 0; }));
  EXPECT_EQ(server.stats().buffered_bytes, 0) << "buffers of closed connections still counted";
}

TEST(TCPStore, AStalledPartialFrameIsDroppedAndLoggedWithThePeer) {
  TCPStoreServerOptions so = local();
  so.partial_frame_timeout = 200ms;
  TCPStoreServer server(so);
  TCPStore legit("127.0.0.1", server.port(), client_options());
  legit.set("before", std::string("1"));  // its pooled connection then idles past the timeout

  testing::internal::CaptureStderr();
  Raw payload_stall(server.port());
  payload_stall.authenticate();
  Bytes partial = header(uint8_t(wire::Type::kSet), 1000);
  partial.resize(partial.size() + 10, 'x');
  payload_stall.send(partial);
  const bool payload_closed = payload_stall.closed_by_server(20000);
  Raw header_stall(server.port());
  header_stall.authenticate();
  header_stall.send(header(uint8_t(wire::Type::kSet), 50).data(), 6);  // half a header
  const bool header_closed = header_stall.closed_by_server(20000);
  const std::string log = testing::internal::GetCapturedStderr();

  EXPECT_TRUE(payload_closed) << "a payload that stopped arriving kept its connection open";
  EXPECT_TRUE(header_closed) << "a header that stopped arriving kept its connection open";
  EXPECT_EQ(server.stats().frame_timeouts, 2);
  EXPECT_NE(log.find("dropped " + payload_stall.address() +
                     ": partial frame timed out: 22 of "
                     "1012 bytes"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("dropped " + header_stall.address() + ": partial frame timed out"),
            std::string::npos)
      << log;
  legit.set("after", std::string("2"));  // an idle connection is not a partial frame
  EXPECT_EQ(legit.get_string("before"), "1");
}

// A frame whose bytes keep trickling (a byte every 50 ms: never a stall) is dropped at
// max_frame_time from its first byte, so a sender cannot hold its buffer share for good (issue
// 42, T5); a legitimate client is served throughout.
TEST(TCPStore, AFrameThatTricklesIsDroppedAtMaxFrameTime) {
  TCPStoreServerOptions so = local();
  so.partial_frame_timeout = 5s;
  so.max_frame_time = 400ms;
  TCPStoreServer server(so);
  TCPStore legit("127.0.0.1", server.port(), client_options());
  testing::internal::CaptureStderr();
  Raw trickle(server.port());
  trickle.authenticate();
  trickle.send(header(uint8_t(wire::Type::kSet), 1000));
  bool closed = false;
  for (int i = 0; i < 400 && !closed; ++i) {  // at most 20 s, far past max_frame_time
    trickle.send(std::string("x"));
    closed = trickle.closed_by_server(50);
  }
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_TRUE(closed) << "a trickling frame kept its connection past max_frame_time";
  EXPECT_EQ(server.stats().frame_timeouts, 1);
  EXPECT_NE(log.find("frame too slow: "), std::string::npos) << log;
  EXPECT_NE(log.find("(max_frame_time)"), std::string::npos) << log;
  legit.set("k", std::string("v"));
  EXPECT_EQ(legit.get_string("k"), "v");
}

// The stored keys and values are capped by max_stored_bytes (T7): a write past it is refused
// with DistStoreError naming the key and the quota, the store keeps serving, and replacing or
// deleting values frees their bytes.
TEST(TCPStore, StoredBytesAreCappedByTheQuota) {
  TCPStoreServerOptions so = local();
  so.max_stored_bytes = 1000;
  TCPStoreServer server(so);
  TCPStore c("127.0.0.1", server.port(), client_options());
  c.set("a", std::string(600, 'a'));
  EXPECT_EQ(server.stats().stored_bytes, 601);
  try {
    c.set("b", std::string(600, 'b'));
    ADD_FAILURE() << "a set past max_stored_bytes was taken";
  } catch (const DistStoreError& e) {
    EXPECT_NE(std::string(e.what()).find("the store is full: setting 'b' to 600 bytes would make "
                                         "its keys and values 1202 bytes, past max_stored_bytes "
                                         "1000"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(server.stats().quota_refusals, 1);
  EXPECT_FALSE(c.check({"b"}));
  const std::string big(600, 'b');
  EXPECT_THROW(c.compare_set("b", Bytes(), Bytes(big.begin(), big.end())), DistStoreError);
  c.set("a", std::string(100, 'a'));  // replacing frees the difference
  c.set("b", std::string(600, 'b'));
  EXPECT_EQ(server.stats().stored_bytes, 101 + 601);
  EXPECT_TRUE(c.delete_key("b"));
  EXPECT_EQ(server.stats().stored_bytes, 101);
  EXPECT_EQ(c.add("n", 5), 5);
  EXPECT_EQ(c.get_string("a"), std::string(100, 'a'));
}

// A job's limits reach the store rank 0 hosts: TCPStoreOptions::server_limits, filled by
// init_process_group from the EMBER_STORE_* variables emberrun exports.
TEST(TCPStore, AServerRankTakesItsLimitsFromItsOptionsAndTheEnvironment) {
  TCPStoreOptions o = client_options();
  o.is_server = true;
  o.server_limits.max_stored_bytes = 1000;
  TCPStore host("127.0.0.1", 0, o);
  host.set("a", std::string(600, 'a'));
  EXPECT_THROW(host.set("b", std::string(600, 'b')), DistStoreError);
  EXPECT_EQ(host.server()->stats().quota_refusals, 1);

  ::setenv("EMBER_STORE_MAX_STORED_BYTES", "4096", 1);
  ::setenv("EMBER_STORE_MAX_BUFFERED_BYTES", "65536", 1);
  ::setenv("EMBER_STORE_MAX_CONNECTIONS", "300", 1);
  ::setenv("EMBER_STORE_MAX_FRAME_TIME", "0.5", 1);
  ::setenv("EMBER_STORE_MAX_CONNECTION_BUFFERED_BYTES", "32768", 1);
  ::setenv("EMBER_STORE_IDLE_TIMEOUT", "90", 1);
  TCPStoreServerOptions env = store_limits_from_env();
  EXPECT_EQ(env.idle_timeout, std::chrono::seconds(90));
  ::unsetenv("EMBER_STORE_IDLE_TIMEOUT");
  EXPECT_EQ(env.max_stored_bytes, 4096u);
  EXPECT_EQ(env.max_buffered_bytes, 65536u);
  EXPECT_EQ(env.max_connection_buffered_bytes, 32768u);
  EXPECT_EQ(env.max_connections, 300u);
  EXPECT_EQ(env.max_frame_time, 500ms);
  ::setenv("EMBER_STORE_MAX_FRAME_TIME", "", 1);  // empty: the default stays
  EXPECT_EQ(store_limits_from_env().max_frame_time, TCPStoreServerOptions{}.max_frame_time);
  ::setenv("EMBER_STORE_MAX_CONNECTIONS", "many", 1);
  try {
    (void)store_limits_from_env();
    ADD_FAILURE() << "a bad EMBER_STORE_MAX_CONNECTIONS was taken";
  } catch (const ValueError& e) {
    EXPECT_STREQ(e.what(),
                 "EMBER_STORE_MAX_CONNECTIONS: expected an integer in [1, 1048576], got 'many'");
  }
  for (const char* v : {"EMBER_STORE_MAX_STORED_BYTES", "EMBER_STORE_MAX_BUFFERED_BYTES",
                        "EMBER_STORE_MAX_CONNECTIONS", "EMBER_STORE_MAX_FRAME_TIME",
                        "EMBER_STORE_MAX_CONNECTION_BUFFERED_BYTES"}) {
    ::unsetenv(v);
  }
  EXPECT_EQ(store_limits_from_env().max_stored_bytes, TCPStoreServerOptions{}.max_stored_bytes);
}

// max_connections follows the descriptor limit (T6): a quarter of it (at least 256) stays for
// the job, so connections that never authenticate cannot take the descriptors rank 0 needs.
TEST(TCPStore, MaxConnectionsLeavesDescriptorsForTheJob) {
  EXPECT_EQ(default_max_connections(1024), 768u);
  EXPECT_EQ(default_max_connections(4096), 3072u);
  EXPECT_EQ(default_max_connections(1 << 20), 16384u);
  EXPECT_EQ(default_max_connections(RLIM_INFINITY), 16384u);
  EXPECT_EQ(default_max_connections(200), 1u);
}

TEST(TCPStore, OversizedFramesAndAFullServerBufferAreRefusedWhileOthersAreServed) {
  TCPStoreServerOptions so = local();
  so.max_buffered_bytes = size_t{256} << 10;
  TCPStoreServer server(so);
  TCPStore legit("127.0.0.1", server.port(), client_options());
  legit.set("k0", std::string("v0"));

  testing::internal::CaptureStderr();
  Raw oversized(server.port());
  oversized.authenticate();
  oversized.send(header(uint8_t(wire::Type::kSet), uint32_t(wire::kMaxPayload + 1)));
  const bool oversized_closed = oversized.closed_by_server(20000);
  legit.set("k1", std::string("v1"));
  // 300 KB of a 1 MiB frame: more than all connections together may buffer.
  Raw hog(server.port());
  hog.authenticate();
  Bytes frame = header(uint8_t(wire::Type::kSet), uint32_t{1} << 20);
  frame.resize(frame.size() + 300000, 'x');
  hog.send(frame);
  const bool hog_closed = hog.closed_by_server(20000);
  const std::string log = testing::internal::GetCapturedStderr();

  EXPECT_TRUE(oversized_closed);
  EXPECT_TRUE(hog_closed) << "a frame beyond max_buffered_bytes kept its connection open";
  EXPECT_EQ(server.stats().buffer_refusals, 1);
  EXPECT_LE(server.stats().buffered_bytes, int64_t{64} << 10);
  EXPECT_NE(log.find("dropped " + oversized.address() + ": oversized frame: payload of " +
                     std::to_string(wire::kMaxPayload + 1) + " bytes"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("dropped " + hog.address() + ": server buffer full"), std::string::npos)
      << log;
  legit.set("k2", std::string("v2"));
  EXPECT_EQ(legit.get_string("k0") + legit.get_string("k1") + legit.get_string("k2"), "v0v1v2");
}

// max_connection_buffered_bytes: one connection's frame may not take more than its share of
// the buffer budget, even with the budget free; frames within the share are served, and so
// are other clients.
TEST(TCPStore, AConnectionIsHeldToItsShareOfTheBufferBudget) {
  TCPStoreServerOptions so = local();
  so.max_connection_buffered_bytes = size_t{256} << 10;
  TCPStoreServer server(so);
  TCPStore legit("127.0.0.1", server.port(), client_options());
  legit.set("within", std::string(200000, 'w'));  // a buffer of at most 256 KiB

  testing::internal::CaptureStderr();
  Raw hog(server.port());
  hog.authenticate();
  Bytes frame = header(uint8_t(wire::Type::kSet), uint32_t{1} << 20);
  frame.resize(frame.size() + 300000, 'x');  // past the share, far within max_buffered_bytes
  hog.send(frame);
  const bool hog_closed = hog.closed_by_server(20000);
  const std::string log = testing::internal::GetCapturedStderr();

  EXPECT_TRUE(hog_closed) << "a frame beyond the connection's share kept its connection open";
  EXPECT_EQ(server.stats().buffer_refusals, 1);
  EXPECT_NE(log.find("dropped " + hog.address() + ": connection's buffer share: a frame of " +
                     std::to_string(1 << 20) + " bytes needs a "),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("past max_connection_buffered_bytes 262144"), std::string::npos) << log;
  EXPECT_EQ(legit.get_string("within"), std::string(200000, 'w'));
  EXPECT_THROW(legit.set("past", std::string(300000, 'p')), DistError);  // the client's own too
  legit.set("after", std::string("a"));  // a new connection of the pool is served
  EXPECT_EQ(legit.get_string("after"), "a");
}

// Sends garbage from a fresh connection and waits until the server drops it.
void bad_peer(uint16_t port) {
  Raw raw(port);
  raw.send(std::string("GET / HTTP/1.1\r\n\r\n"));
  EXPECT_TRUE(raw.closed_by_server());
}

// Sends this process's stderr to a file while alive; text() reads what was written so far
// (gtest's CaptureStderr gives nothing until the capture ends, too late for polling).
class StderrFile {
 public:
  StderrFile() : file_(std::tmpfile()) {
    std::fflush(stderr);
    saved_ = ::dup(2);
    ::dup2(::fileno(file_), 2);
  }
  ~StderrFile() {
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
    std::fclose(file_);
  }
  std::string text() const {
    std::string out;
    char buf[4096];
    ssize_t n = 0;
    for (off_t at = 0; (n = ::pread(::fileno(file_), buf, sizeof(buf), at)) > 0; at += n) {
      out.append(buf, static_cast<size_t>(n));
    }
    return out;
  }

 private:
  std::FILE* file_;
  int saved_ = -1;
};

// A flood of bad peers writes a few lines a second, not one per peer, and a later line says
// how many were left out. The bound allows for however long the flood took, so a slow machine
// cannot make it fail.
TEST(TCPStore, RefusalsAreLoggedAtAFewLinesASecond) {
  TCPStoreServer server(local());
  constexpr int kPeers = 40;
  StderrFile err;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kPeers; ++i) bad_peer(server.port());
  const auto seconds =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now() - start)
          .count();
  const std::string log = err.text();
  int64_t lines = 0;
  for (size_t at = 0; (at = log.find("[TCPStoreServer]", at)) != std::string::npos; ++at) ++lines;
  EXPECT_GE(lines, 1);
  EXPECT_LE(lines, 5 * (seconds + 2)) << kPeers << " peers in about " << seconds << " s:\n" << log;
  EXPECT_EQ(server.stats().protocol_errors, kPeers);
  // Once the second is over, the next refusal is logged with the count of those left out.
  EXPECT_TRUE(test::eventually(
      [&] {
        bad_peer(server.port());
        return err.text().find("similar lines suppressed before this one") != std::string::npos;
      },
      20000))
      << err.text();
}

// True if a TCP connection to ip:port is accepted.
bool connects(const char* ip, uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  ::inet_pton(AF_INET, ip, &a.sin_addr);
  const bool ok = fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  if (fd >= 0) ::close(fd);
  return ok;
}

// Linux routes all of 127.0.0.0/8 to the loopback device, so a server on every interface is
// reached through 127.0.0.2 and one bound to 127.0.0.1 is not.
TEST(TCPStore, AServerRankOnALoopbackHostListensOnlyThere) {
  TCPStoreOptions o = client_options();
  o.is_server = true;
  TCPStore store("127.0.0.1", 0, o);
  EXPECT_TRUE(connects("127.0.0.1", store.port()));
  EXPECT_FALSE(connects("127.0.0.2", store.port()))
      << "a store for a loopback MASTER_ADDR listens on other addresses too";
  o.listen_host = "0.0.0.0";
  TCPStore everywhere("127.0.0.1", 0, o);
  EXPECT_TRUE(connects("127.0.0.2", everywhere.port())) << "an explicit listen_host is kept";
  store.set("k", std::string("v"));
  EXPECT_EQ(store.get_string("k"), "v");
}

// This machine's first IPv4 address outside 127.0.0.0/8, "" when it has none.
std::string non_loopback_ipv4() {
  ifaddrs* all = nullptr;
  if (::getifaddrs(&all) != 0) return "";
  std::string found;
  for (ifaddrs* i = all; i != nullptr && found.empty(); i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    const in_addr a = reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr;
    if ((ntohl(a.s_addr) >> 24) == 127) continue;
    char text[INET_ADDRSTRLEN] = {};
    if (::inet_ntop(AF_INET, &a, text, sizeof text) != nullptr) found = text;
  }
  ::freeifaddrs(all);
  return found;
}

// A server rank whose MASTER_ADDR is an address of this machine, written as one, listens there
// only (issue 22): the clients are told that address, so no other interface needs the store.
TEST(TCPStore, AServerRankOnALocalAddressListensOnlyThere) {
  const std::string ip = non_loopback_ipv4();
  if (ip.empty()) GTEST_SKIP() << "this machine has no IPv4 address outside 127.0.0.0/8";
  TCPStoreOptions o = client_options();
  o.is_server = true;
  TCPStore store(ip, 0, o);
  EXPECT_TRUE(connects(ip.c_str(), store.port()));
  EXPECT_FALSE(connects("127.0.0.1", store.port()))
      << "a store for MASTER_ADDR " << ip << " listens on other addresses too";
  store.set("k", std::string("v"));
  EXPECT_EQ(store.get_string("k"), "v");
}

// ---- blocking calls ----

TEST(TCPStore, StoppingTheServerWakesBlockedThreads) {
  TCPStoreServer server(local());
  TCPStore a("127.0.0.1", server.port(), client_options());
  TCPStore b("127.0.0.1", server.port(), client_options());
  std::string ea, eb;
  std::thread ta([&] {
    try {
      a.get("never", kLong);
    } catch (const DistNetworkError& e) {
      ea = e.what();
    }
  });
  std::thread tb([&] {
    try {
      b.wait({"never", "nor_this"}, kLong);
    } catch (const DistNetworkError& e) {
      eb = e.what();
    }
  });
  ASSERT_TRUE(test::eventually([&] { return server.stats().waiting == 2; }));
  server.stop();
  ta.join();
  tb.join();
  EXPECT_NE(ea.find("TCPStore get"), std::string::npos) << ea;
  EXPECT_NE(ea.find("lost the connection"), std::string::npos) << ea;
  EXPECT_NE(eb.find("'nor_this'"), std::string::npos) << eb;
  server.stop();  // idempotent
  expect_error<DistStoreError>([&] { server.wait_for_workers(1, kLong); }, {"stopped"});
  a.set_timeout(200ms);  // reconnecting is retried until the timeout
  expect_error<DistNetworkError>([&] { a.set("k", std::string("v")); },
                                 {"TCPStore set", "could not connect", "200 ms"});
}

// A write that must not wait for the store's own timeout (a group's destruction, when the rank
// that hosted the store may have exited): set_within gives up at its bound, through a
// PrefixStore too, while the client's timeout is far longer.
TEST(TCPStore, SetWithinGivesUpAtItsBoundWhenTheServerHasGone) {
  TCPStoreServer server(local());
  TCPStoreOptions o = client_options();
  o.timeout = std::chrono::minutes(10);
  auto c = std::make_shared<TCPStore>("127.0.0.1", server.port(), o);
  PrefixStore p("pg", c);
  p.set_within("k", test::to_bytes("v"), 5000ms);
  EXPECT_EQ(c->get_string("pg/k"), "v");
  server.stop();  // the pooled connection is closed; reconnecting is refused
  expect_error<DistNetworkError>([&] { c->set_within("k", test::to_bytes("v"), 200ms); },
                                 {"TCPStore set", "could not connect", "200 ms"});
  expect_error<DistNetworkError>([&] { p.set_within("k", test::to_bytes("v"), 200ms); },
                                 {"TCPStore set", "could not connect", "200 ms"});
  expect_error<ValueError>([&] { c->set_within("k", test::to_bytes("v"), 0ms); },
                           {"TCPStore set", "timeout must be positive"});
}

TEST(TCPStore, ATimedOutWaitLeavesTheClientUsable) {
  TCPStoreServer server(local());
  TCPStore c("127.0.0.1", server.port(), client_options());
  for (int i = 0; i < 3; ++i) {
    expect_error<DistTimeoutError>([&] { c.get("missing", 50ms); },
                                   {"'missing'", "50 ms", "127.0.0.1:"});
  }
  c.set("k", std::string("v"));
  EXPECT_EQ(c.get_string("k"), "v");
  EXPECT_EQ(server.stats().waiting, 0);
  EXPECT_EQ(server.stats().accepted, 1) << "timeouts reported by the server reuse the connection";
}

// ---- idle connections (issue 42's T6) ----

// An authenticated connection that sends nothing is closed after idle_timeout, counted and
// logged, so that idle connections cannot keep max_connections' places; others are served.
TEST(TCPStore, AnIdleAuthenticatedConnectionIsClosedAfterIdleTimeout) {
  TCPStoreServerOptions so = local();
  so.idle_timeout = 300ms;
  TCPStoreServer server(so);
  Raw idle(server.port());
  idle.authenticate();
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(idle.closed_by_server()) << "an idle authenticated connection kept open";
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 300ms) << "closed before idle_timeout";
  EXPECT_EQ(server.stats().idle_closes, 1);
  expect_serving(server.port(), "after_idle_close");
}

// A get parked on the server for longer than idle_timeout is not idle: it ends in the server's
// own timeout reply, not a closed connection; so does a plain wait on a key set later.
TEST(TCPStore, AParkedRequestIsNotIdle) {
  TCPStoreServerOptions so = local();
  so.idle_timeout = 300ms;
  TCPStoreServer server(so);
  TCPStore c("127.0.0.1", server.port(), client_options());
  expect_error<DistTimeoutError>([&] { c.get("never", 1000ms); }, {"'never'", "1000 ms"});
  EXPECT_EQ(server.stats().idle_closes, 0);
  std::thread later([&] {
    // Sets the key once the waiter is parked, and past an idle period: a connection opened
    // after the waiter parked and left idle has been closed by then. (Counting idle closes
    // instead raced: the count can move before the closed socket's end reaches its peer.)
    ASSERT_TRUE(test::eventually([&] { return server.stats().waiting == 1; }));
    Raw idle(server.port());
    idle.authenticate();
    ASSERT_TRUE(idle.closed_by_server()) << "an idle connection was never closed";
    TCPStore setter("127.0.0.1", server.port(), client_options());
    setter.set("late", std::string("v"));
  });
  EXPECT_EQ(c.get_string("late"), "v");
  later.join();
}

// A client whose pooled connection the server closed as idle reconnects on its next request:
// the close costs it a connection, not an error.
TEST(TCPStore, AClientReconnectsAfterTheServerClosedItsIdleConnection) {
  TCPStoreServerOptions so = local();
  so.idle_timeout = 100ms;
  TCPStoreServer server(so);
  TCPStore c("127.0.0.1", server.port(), client_options());
  c.set("k", std::string("v"));
  // One request per round, each once the server has closed the connection before it.
  for (int round = 1; round <= 4; ++round) {
    ASSERT_TRUE(test::eventually([&] { return server.stats().active == 0; }))
        << "round " << round << ": the idle connection was not closed";
    if (round % 2 == 1) {
      EXPECT_EQ(c.get_string("k"), "v") << "round " << round;
    } else {
      EXPECT_EQ(c.add("n", 1), round / 2);
    }
  }
  EXPECT_GE(server.stats().idle_closes, 4);
}

TEST(TCPStore, AServerRestartedOnTheSamePortIsReachedThroughAFreshConnection) {
  auto first = std::make_unique<TCPStoreServer>(local());
  const uint16_t port = first->port();
  TCPStore c("127.0.0.1", port, client_options());
  c.set("k", std::string("old"));
  first.reset();  // the pooled connection is now closed by the server
  TCPStoreServerOptions so = local();
  so.port = port;
  TCPStoreServer second(so);
  EXPECT_FALSE(c.check({"k"})) << "a new server starts empty";
  c.set("k", std::string("new"));
  EXPECT_EQ(c.get_string("k"), "new");
  EXPECT_EQ(second.stats().accepted, 1);
}

// A server that completes handshakes and then never answers (hung, or stopped with SIGSTOP):
// the client gives up a little after its timeout, closes that connection, and opens a fresh
// one for the next call.
TEST(TCPStore, AServerThatStopsAnsweringEndsInATimeoutAndAFreshConnection) {
  const int lfd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  ASSERT_EQ(::bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::listen(lfd, 4), 0);
  ASSERT_EQ(::getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  std::atomic<int> handshakes{0};
  std::thread mute([&] {
    auto read_exact = [](int fd, uint8_t* p, size_t n) {
      while (n) {
        pollfd pf{fd, POLLIN, 0};
        if (::poll(&pf, 1, 60000) <= 0) return false;
        const ssize_t k = ::recv(fd, p, n, 0);
        if (k <= 0) return false;
        p += k;
        n -= static_cast<size_t>(k);
      }
      return true;
    };
    std::vector<int> conns;
    for (int i = 0; i < 2; ++i) {
      pollfd pf{lfd, POLLIN, 0};
      if (::poll(&pf, 1, 60000) <= 0) break;
      const int c = ::accept(lfd, nullptr, nullptr);
      if (c < 0) break;
      conns.push_back(c);
      const Bytes challenge = wire::FrameWriter(wire::Type::kChallenge)
                                  .blob(Bytes(wire::kNonceSize, 0))
                                  .u64(0)
                                  .finish();
      (void)!::send(c, challenge.data(), challenge.size(), MSG_NOSIGNAL);
      uint8_t h[wire::kHeaderSize];
      std::string why;
      if (!read_exact(c, h, sizeof(h))) break;
      Bytes payload(wire::parse_header(h, &why)->length);
      if (!read_exact(c, payload.data(), payload.size())) break;
      const Bytes ok = wire::FrameWriter(wire::Type::kOk).finish();
      (void)!::send(c, ok.data(), ok.size(), MSG_NOSIGNAL);
      ++handshakes;
    }
    for (const int c : conns) {  // swallow requests until the client hangs up
      uint8_t buf[256];
      pollfd pf{c, POLLIN, 0};
      while (::poll(&pf, 1, 60000) > 0 && ::recv(c, buf, sizeof(buf), 0) > 0) {
      }
      ::close(c);
    }
  });
  {
    TCPStore c("127.0.0.1", ntohs(a.sin_port), client_options());
    const auto t0 = std::chrono::steady_clock::now();
    expect_error<DistTimeoutError>([&] { c.get("k", 100ms); },
                                   {"TCPStore get", "100 ms", "no reply", "'k'"});
    EXPECT_GE(std::chrono::steady_clock::now() - t0, 100ms);
    c.set_timeout(100ms);
    expect_error<DistTimeoutError>([&] { c.check({"k"}); }, {"TCPStore check", "100 ms"});
    EXPECT_EQ(handshakes.load(), 2) << "the second call must open a new connection";
  }
  mute.join();
  ::close(lfd);
}

}  // namespace
}  // namespace ember::dist
