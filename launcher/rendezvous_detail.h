// Small helpers shared by rendezvous.cpp and rendezvous_etcd.cpp (not part of the interface).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

#include <ember/distributed/store/store.h>
#include <ember/launcher/rendezvous.h>

namespace ember::launcher::detail {

inline std::string to_s(const dist::Bytes& b) { return std::string(b.begin(), b.end()); }
inline dist::Bytes to_b(const std::string& s) { return dist::Bytes(s.begin(), s.end()); }

inline std::chrono::milliseconds to_ms(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0 + 0.5));
}

// "<k> <what>", as the failed key holds it.
inline RoundFailure parse_failure(const std::string& v) {
  const auto sp = v.find(' ');
  return {std::stoi(v.substr(0, sp)), v.substr(sp + 1)};
}

inline std::string seconds_str(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g s", s);
  return buf;
}

// The address of this machine's interface on the route to host:port (no packet is sent), or
// its host name when there is none.
std::string route_address(const std::string& host, int port);

// Waits are cut in chunks of this to notice signals and closed runs.
inline constexpr std::chrono::milliseconds kPollChunk{200};
// etcd: how often an agent retries a round's leader key, and a leader re-reads which nodes of
// the last round still hold a lease.
inline constexpr std::chrono::milliseconds kLeaseCheck{1000};

}  // namespace ember::launcher::detail
