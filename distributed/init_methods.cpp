// The init methods init_process_group knows by itself: env://, tcp://host:port and
// file:///path (torch's three), each a row of init.h's registry. MPI's own, for mpirun, is
// registered by the MPI backend (backends/process_group_mpi.cpp).
#include <ember/distributed/detail/environment.h>
#include <ember/distributed/init.h>
#include <ember/distributed/store/file_store.h>
#include <ember/distributed/store/tcp_store.h>

namespace ember::dist {

namespace {

using detail::check_rank_size;
using detail::echo;
using detail::environment;
using detail::parse_int;

// "tcp://host:port?rank=1&world_size=2" -> host, port, query fields.
struct Url {
  std::string host;
  int port = -1;
  std::string path;
  std::map<std::string, std::string> query;
};

// The fields of a URL's query, "rank=1&world_size=2" (what follows '?'; none without one).
std::map<std::string, std::string> parse_query(const std::string& url) {
  std::map<std::string, std::string> out;
  const size_t q = url.find('?');
  if (q == std::string::npos) return out;
  const std::string qs = url.substr(q + 1);
  size_t start = 0;
  while (start <= qs.size()) {
    size_t amp = qs.find('&', start);
    if (amp == std::string::npos) amp = qs.size();
    const std::string kv = qs.substr(start, amp - start);
    const size_t eq = kv.find('=');
    if (eq != std::string::npos) out[kv.substr(0, eq)] = kv.substr(eq + 1);
    start = amp + 1;
  }
  return out;
}

Url parse_url(const std::string& url, const std::string& scheme) {
  Url u;
  std::string rest = url.substr(scheme.size());
  u.query = parse_query(rest);
  rest = rest.substr(0, rest.find('?'));
  if (scheme == "file://") {
    u.path = rest;
    return u;
  }
  std::string host = rest, port;
  if (!rest.empty() && rest[0] == '[') {  // [ipv6]:port
    const size_t close = rest.find(']');
    EMBER_CHECK(close != std::string::npos, "[init_process_group] bad address in '", url, "'");
    host = rest.substr(1, close - 1);
    if (close + 1 < rest.size() && rest[close + 1] == ':') port = rest.substr(close + 2);
  } else if (const size_t colon = rest.rfind(':'); colon != std::string::npos) {
    host = rest.substr(0, colon);
    port = rest.substr(colon + 1);
  }
  EMBER_CHECK(!host.empty() && !port.empty(),
              "[init_process_group] expected tcp://host:port, got '", url, "'");
  u.host = host;
  u.port = parse_int("port", port, 1, 65535, "in " + url);
  return u;
}

// Rank and size for tcp:// and file://: options, then the URL's query, then RANK/WORLD_SIZE.
void rank_size_for_url(const InitOptions& o, const Url& u, const std::string& url, int* rank,
                       int* size) {
  const auto env = environment();
  auto pick = [&](int given, const char* qname, const char* ename) {
    if (given >= 0) return given;
    if (auto it = u.query.find(qname); it != u.query.end()) {
      return parse_int(qname, it->second, 0, 1 << 30, "in " + url);
    }
    if (auto it = env.find(ename); it != env.end()) {
      return parse_int(ename, it->second, 0, 1 << 30, echo(env));
    }
    throw ValueError(detail::str_cat("[init_process_group] ", url, " needs ", qname,
                                     ": pass it, add ?", qname, "=... to the URL or set ", ename,
                                     " (", echo(env), ")"));
  };
  *rank = pick(o.rank, "rank", "RANK");
  *size = pick(o.world_size, "world_size", "WORLD_SIZE");
  check_rank_size(*rank, *size, url);
}

std::shared_ptr<Store> rendezvous_tcp_store(const std::string& host, int port, int rank, int size,
                                            Duration timeout) {
  TCPStoreOptions so;
  so.is_server = rank == 0;
  // The job's store limits (emberrun's --store-* options reach rank 0 so).
  if (so.is_server) so.server_limits = store_limits_from_env();
  so.world_size = size;
  so.timeout = timeout;
  return std::make_shared<TCPStore>(host, static_cast<uint16_t>(port), so);
}

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// As torch's: rank and world size from the options, then the URL's query
// ("env://?rank=0&world_size=1"), then RANK and WORLD_SIZE; the address from MASTER_ADDR and
// MASTER_PORT.
Rendezvous env_rendezvous(const std::string& url, const InitOptions& o, Duration timeout) {
  const auto query = parse_query(url);
  auto pick = [&](int given, const char* name) {
    if (given >= 0) return given;
    const auto it = query.find(name);
    return it == query.end() ? -1 : parse_int(name, it->second, 0, 1 << 30, "in " + url);
  };
  const EnvRendezvous r =
      parse_env_rendezvous(environment(), pick(o.rank, "rank"), pick(o.world_size, "world_size"));
  return {rendezvous_tcp_store(r.master_addr, r.master_port, r.rank, r.world_size, timeout),
          r.rank, r.world_size, r.master_addr, nullptr};
}

Rendezvous tcp_rendezvous(const std::string& url, const InitOptions& o, Duration timeout) {
  const Url u = parse_url(url, "tcp://");
  Rendezvous r;
  rank_size_for_url(o, u, url, &r.rank, &r.world_size);
  r.master_addr = u.host;
  r.store = rendezvous_tcp_store(u.host, u.port, r.rank, r.world_size, timeout);
  return r;
}

Rendezvous file_rendezvous(const std::string& url, const InitOptions& o, Duration timeout) {
  const Url u = parse_url(url, "file://");
  EMBER_CHECK(!u.path.empty(), "[init_process_group] file:// needs a path, got '", url, "'");
  Rendezvous r;
  rank_size_for_url(o, u, url, &r.rank, &r.world_size);
  r.store = std::make_shared<FileStore>(u.path, r.world_size, timeout);
  return r;
}

const bool kRegistered = [] {
  register_init_method({"env://", [](const std::string& url, const std::string&) {
                          return starts_with(url, "env://");
                        },
                        env_rendezvous});
  register_init_method({"tcp://host:port", [](const std::string& url, const std::string&) {
                          return starts_with(url, "tcp://");
                        },
                        tcp_rendezvous});
  register_init_method({"file:///path", [](const std::string& url, const std::string&) {
                          return starts_with(url, "file://");
                        },
                        file_rendezvous});
  return true;
}();

}  // namespace

}  // namespace ember::dist
