// Fuzzes the TCPStore wire protocol as the server parses it: every input is what one client
// sends to a fresh TCPStoreServer (no secret, 127.0.0.1) after the server's challenge. So the
// whole receive path is attacked as a stranger would attack it: the header checks, the
// buffer that grows as bytes arrive, the handshake, each request's fields, parked get/wait.
//
// Input: byte 0 is flags, the rest the bytes sent. Flag bit 0 sends a valid handshake (kAuth
// with an empty proof) first, so that mutations reach the requests instead of dying at the
// handshake. The client then half-closes, and reads until the server closes: the server must
// close every connection that has sent all it will (EOF), whatever it sent, within a bound
// (kHangLimitMs, else the input is reported as a hang), and everything it sends back must be
// well-formed frames.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <ember/distributed/store/detail/store_protocol.h>
#include <ember/distributed/store/tcp_store.h>
#include <ember/tensor/observe/log.h>

namespace {

namespace wire = ember::dist::detail::store_wire;

constexpr int kHangLimitMs = 10000;

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "store_protocol_fuzzer: %s: %s\n", what, std::strerror(errno));
  std::abort();
}

// Every input is a new connection, and each leaves one end in TIME_WAIT for a minute: thousands
// of inputs a second can find no free ephemeral port for a moment (EADDRNOTAVAIL), a limit of
// this harness's churn, not a finding about the server, so connect() is tried again then, as
// when a signal interrupts it (EINTR: libFuzzer's own timers). Any other failure (a server that
// does not listen) aborts.
int connect_loopback(uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  int fd = -1;
  for (int attempt = 0;; ++attempt) {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) fail("socket() failed");
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) break;
    const int err = errno;
    ::close(fd);
    errno = err;
    if ((err != EADDRNOTAVAIL && err != EINTR) || attempt == 1000) fail("connect() failed");
  }
  const int one = 1;  // a large input goes out in several segments: none may wait for an ACK
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

// Sends what it can; the server may drop the connection midway, which is no error here.
void send_all(int fd, const uint8_t* p, size_t n) {
  while (n > 0) {
    const ssize_t r = ::send(fd, p, n, MSG_NOSIGNAL);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return;
    p += r;
    n -= static_cast<size_t>(r);
  }
}

// Everything the server sends until it closes; aborts if it keeps the connection open.
std::vector<uint8_t> read_until_closed(int fd) {
  std::vector<uint8_t> got;
  uint8_t buf[4096];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, kHangLimitMs);
    if (ready == 0) fail("the server kept a connection open after the client's EOF (hang)");
    if (ready < 0 && errno == EINTR) continue;  // libFuzzer's -timeout ticks with SIGALRM
    if (ready < 0) fail("poll() failed");
    const ssize_t r = ::recv(fd, buf, sizeof buf, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return got;  // EOF, or a reset after the server dropped the connection
    got.insert(got.end(), buf, buf + r);
  }
}

// Every whole frame the server sends must be well-formed, the first one the challenge. (A
// dropped connection may end in a partial frame, and a reset may discard what was not yet
// read, so neither a partial end nor a missing challenge is an error.)
void check_replies(const std::vector<uint8_t>& got) {
  size_t at = 0;
  bool first = true;
  while (at + wire::kHeaderSize <= got.size()) {
    std::string why;
    const auto h = wire::parse_header(got.data() + at, &why);
    if (!h) fail("the server sent a malformed frame header");
    const auto type = static_cast<wire::Type>(h->type);
    if (first != (type == wire::Type::kChallenge)) fail("the first frame is not the challenge");
    if (h->length > wire::kMaxPayload) fail("the server sent an oversized frame");
    at += wire::kHeaderSize + h->length;
    first = false;
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Dropped peers are logged at warn: one line per malformed input would drown the output.
  ember::logging::set_level(ember::logging::Level::Error);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  ember::dist::TCPStoreServerOptions opts;
  opts.host = "127.0.0.1";
  opts.secret = "";
  ember::dist::TCPStoreServer server(opts);
  const int fd = connect_loopback(server.port());
  // One send of everything: two would wait out Nagle's algorithm for the server's delayed ACK.
  wire::Bytes out;
  if (data[0] & 1) out = wire::FrameWriter(wire::Type::kAuth).blob(wire::Bytes{}).finish();
  out.insert(out.end(), data + 1, data + size);
  send_all(fd, out.data(), out.size());
  ::shutdown(fd, SHUT_WR);
  const auto replies = read_until_closed(fd);
  ::close(fd);
  check_replies(replies);
  return 0;
}
