#include <ember/distributed/backends/net.h>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>

#include <ember/tensor/error.h>

namespace ember::dist::net {

namespace {
/// The numeric form of a socket address ("" for families other than IPv4 and IPv6).
std::string numeric(const sockaddr* a) {
  char buf[INET6_ADDRSTRLEN] = {};
  const void* raw = nullptr;
  if (a->sa_family == AF_INET) {
    raw = &reinterpret_cast<const sockaddr_in*>(a)->sin_addr;
  } else if (a->sa_family == AF_INET6) {
    raw = &reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr;
  }
  if (raw == nullptr || ::inet_ntop(a->sa_family, raw, buf, sizeof(buf)) == nullptr) return {};
  return buf;
}
}  // namespace

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

// A UDP socket connected to `host` (connect sends nothing) is bound by the kernel to the
// outgoing interface's address.
std::string local_address_towards(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), "9", &hints, &res) != 0 || res == nullptr) return {};
  std::string out;
  const int fd = ::socket(res->ai_family, SOCK_DGRAM, 0);
  if (fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      out = numeric(reinterpret_cast<const sockaddr*>(&local));
    }
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(res);
  return out;
}

std::string interface_with_address(const std::string& address) {
  if (address.empty()) return {};
  ifaddrs* all = nullptr;
  if (::getifaddrs(&all) != 0) return {};
  std::string out;
  for (const ifaddrs* i = all; i != nullptr && out.empty(); i = i->ifa_next) {
    if (i->ifa_addr != nullptr && numeric(i->ifa_addr) == address) out = i->ifa_name;
  }
  ::freeifaddrs(all);
  return out;
}

std::string interface_towards(const std::string& host) {
  return interface_with_address(local_address_towards(host));
}

std::string addresses_of(const std::string& name) {
  ifaddrs* all = nullptr;
  if (::getifaddrs(&all) != 0) return "none";
  std::string out;
  for (const ifaddrs* i = all; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || name != i->ifa_name) continue;
    const std::string a = numeric(i->ifa_addr);
    if (!a.empty()) out += (out.empty() ? "" : ", ") + a;
  }
  ::freeifaddrs(all);
  return out.empty() ? "none" : out;
}

std::string nccl_socket_ifname(const std::string& master_addr) {
  const char* set = std::getenv("NCCL_SOCKET_IFNAME");
  if ((set != nullptr && *set) || master_addr.empty()) return {};
  const std::string name = interface_towards(master_addr);
  // NCCL matches a plain name as a prefix (eth1 would take eth10 too); '=' asks for exactly it.
  return name.empty() ? name : "=" + name;
}

std::string nccl_network_summary() {
  const char* ifname = std::getenv("NCCL_SOCKET_IFNAME");
  const char* master = std::getenv("MASTER_ADDR");
  std::string s = ifname != nullptr && *ifname
                      ? ::ember::detail::str_cat("NCCL_SOCKET_IFNAME=", ifname, " (",
                                        addresses_of(ifname[0] == '=' ? ifname + 1 : ifname),
                                        ")")
                      : std::string("NCCL_SOCKET_IFNAME unset (NCCL picks an interface)");
  if (master != nullptr && *master) s += ::ember::detail::str_cat(", MASTER_ADDR=", master);
  return s;
}

}  // namespace ember::dist::net
