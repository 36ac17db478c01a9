// init_process_group, the default group and new_group.
#include <ember/distributed/init.h>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>

#include <ember/distributed/file_store.h>
#include <ember/distributed/hash_store.h>
#include <ember/distributed/net.h>
#include <ember/distributed/prefix_store.h>
#include <ember/distributed/process_group_gloo.h>
#include <ember/distributed/process_group_hierarchical.h>
#include <ember/distributed/process_group_mpi.h>
#include <ember/distributed/tcp_store.h>
#include <ember/distributed/trace_clock.h>
#include <ember/tensor/creation.h>
#include <ember/tensor/cuda.h>
#include <ember/tensor/log.h>
#include <ember/tensor/trace.h>

extern char** environ;

namespace ember::dist {

namespace {

using net::is_loopback;
using net::local_address_towards;

int parse_int(const std::string& name, const std::string& value, int lo, int hi,
              const std::string& found) {
  size_t used = 0;
  long long v = 0;
  bool ok = !value.empty();
  try {
    v = std::stoll(value, &used);
  } catch (const std::exception&) {
    ok = false;
  }
  EMBER_CHECK(ok && used == value.size(), "[init_process_group] ", name, "='", value,
              "' is not an integer (", found, ")");
  EMBER_CHECK(v >= lo && v <= hi, "[init_process_group] ", name, "=", v, " is out of range [", lo,
              ", ", hi, "] (", found, ")");
  return static_cast<int>(v);
}

// EMBER_PG_TIMEOUT: the default group's collective timeout in seconds, for programs that do not
// set one (so a job can be told to give up on a hung rank sooner than after 30 minutes).
Duration default_timeout() {
  return timeout_from_env("EMBER_PG_TIMEOUT").value_or(kDefaultCollectiveTimeout);
}

// A hierarchical group (process_group_hierarchical.h) when the ranks span several nodes and
// one node has several ranks, unless EMBER_GLOO_HIERARCHICAL=0; null otherwise. Every rank
// publishes its node key and its switch, so all take the same branch even when their
// environments differ (one rank's 0 turns it off for all).
std::shared_ptr<ProcessGroup> make_gloo_hierarchical(const BackendArgs& a,
                                                     const ProcessGroupGloo::GlooOptions& o) {
  bool wanted = true;
  if (const char* h = std::getenv("EMBER_GLOO_HIERARCHICAL"); h && *h) {
    wanted = parse_int("EMBER_GLOO_HIERARCHICAL", h, 0, 1, "1: reduce inside each node, then "
                       "between node leaders, 0: one flat ring of all ranks") == 1;
  }
  bool all_want = false;
  const NodeLayout layout =
      exchange_node_keys(*a.store, a.rank, a.size, local_node_key(), wanted, &all_want, a.timeout);
  if (!all_want || !layout.pays()) return nullptr;
  ProcessGroupHierarchical::HierarchicalOptions ho;
  ho.gloo = o;
  return std::make_shared<ProcessGroupHierarchical>(a.store, a.rank, a.size, layout, ho);
}

// Which address gloo listens on, unless EMBER_GLOO_HOSTNAME or GLOO_SOCKET_IFNAME says: loopback
// when rank 0 is on this machine's loopback; otherwise the address of the interface that
// reaches rank 0 (torch resolves the machine's hostname instead, which on many machines, and
// in network namespaces, gives 127.0.1.1 or the wrong interface and makes peers fail to connect).
std::shared_ptr<ProcessGroup> make_gloo(const BackendArgs& a) {
  if (a.rank < 0) return nullptr;  // not a member of this group
  ProcessGroupGloo::GlooOptions o;
  o.timeout = a.timeout;
  if (const char* t = std::getenv("EMBER_GLOO_THREADS"); t && *t) {
    o.threads = parse_int("EMBER_GLOO_THREADS", t, 1, 64, "the gloo worker threads");
  }
  if (const char* t = std::getenv("EMBER_GLOO_SHM"); t && *t) {
    o.shared_memory = parse_int("EMBER_GLOO_SHM", t, 0, 1, "1: allreduce through shared "
                                "memory among ranks on one machine, 0: always over TCP") == 1;
  }
  if (!std::getenv("EMBER_GLOO_HOSTNAME") && !std::getenv("GLOO_SOCKET_IFNAME")) {
    if (is_loopback(a.master_addr)) {
      o.hostname = "127.0.0.1";  // every rank is on this machine: stay on loopback
    } else if (!a.master_addr.empty()) {
      o.hostname = local_address_towards(a.master_addr);  // "" keeps gloo's hostname default
    }
  }
  if (a.size > 1) {
    if (auto pg = make_gloo_hierarchical(a, o)) return pg;
  }
  return std::make_shared<ProcessGroupGloo>(a.store, a.rank, a.size, o);
}

std::shared_ptr<ProcessGroup> make_mpi(const BackendArgs& a) {
  // MPI knows its own ranks; the store is not needed. Every process takes part in creating the
  // communicator, members or not.
  std::shared_ptr<ProcessGroup> pg = ProcessGroupMpi::create(a.global_ranks, {a.timeout});
  if (pg != nullptr) {
    EMBER_CHECK(pg->rank() == a.rank && pg->size() == a.size, "[init_process_group] the mpi "
                "backend sees rank ", pg->rank(), " of ", pg->size(), " but the rendezvous "
                "gave rank ", a.rank, " of ", a.size, " (launch with mpirun, or make RANK and "
                "WORLD_SIZE agree with MPI's)");
  }
  return pg;
}

struct State {
  std::mutex mu;
  std::map<std::string, BackendFactory> backends{{"gloo", make_gloo}, {"mpi", make_mpi}};
  std::shared_ptr<Store> store;
  std::shared_ptr<ProcessGroup> world;
  std::string backend;
  std::string master_addr;
  int next_group = 1;
  std::vector<std::shared_ptr<ProcessGroup>> groups;
};

State& state() {
  static State* s = new State();  // never destroyed: groups may outlive static destruction
  return *s;
}

std::string echo(const std::map<std::string, std::string>& env) {
  static const char* kNames[] = {
      "RANK",          "WORLD_SIZE",           "MASTER_ADDR",          "MASTER_PORT",
      "LOCAL_RANK",    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK",
      "PMI_SIZE",      "SLURM_PROCID",         "SLURM_NTASKS",         "SLURM_JOB_NODELIST",
      "SLURM_NODELIST"};
  std::string out;
  for (const char* n : kNames) {
    auto it = env.find(n);
    if (it == env.end()) continue;
    out += out.empty() ? "" : ", ";
    out += detail::str_cat(n, "=", it->second);
  }
  return out.empty() ? "found none of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, "
                       "OMPI_COMM_WORLD_*, PMI_*, SLURM_*"
                     : "found " + out;
}

std::map<std::string, std::string> environment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e && *e; ++e) {
    const std::string kv = *e;
    const size_t eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return env;
}

void check_rank_size(int rank, int size, const std::string& where) {
  EMBER_CHECK(size >= 1, "[init_process_group] world_size must be >= 1, got ", size, " (", where,
              ")");
  EMBER_CHECK(rank >= 0 && rank < size, "[init_process_group] rank must be in [0, ", size,
              "), got ", rank, " (", where, ")");
}

// "tcp://host:port?rank=1&world_size=2" -> host, port, query fields.
struct Url {
  std::string host;
  int port = -1;
  std::string path;
  std::map<std::string, std::string> query;
};

Url parse_url(const std::string& url, const std::string& scheme) {
  Url u;
  std::string rest = url.substr(scheme.size());
  const size_t q = rest.find('?');
  if (q != std::string::npos) {
    std::string qs = rest.substr(q + 1);
    rest = rest.substr(0, q);
    size_t start = 0;
    while (start <= qs.size()) {
      size_t amp = qs.find('&', start);
      if (amp == std::string::npos) amp = qs.size();
      const std::string kv = qs.substr(start, amp - start);
      const size_t eq = kv.find('=');
      if (eq != std::string::npos) u.query[kv.substr(0, eq)] = kv.substr(eq + 1);
      start = amp + 1;
    }
  }
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

// The TCPStore of an env:// or tcp:// rendezvous: rank 0 serves it, every rank connects.
bool env_set(const std::map<std::string, std::string>& env, const char* name) {
  auto it = env.find(name);
  return it != env.end() && !it->second.empty();
}

/// Whether mpirun (Open MPI, or a PMI launcher such as MPICH's) started this process and nothing
/// names rank 0's host: the ranks can then agree on the store's address through MPI itself.
bool mpi_without_master(const std::map<std::string, std::string>& env) {
  return !env_set(env, "RANK") && (env_set(env, "OMPI_COMM_WORLD_RANK") || env_set(env, "PMI_RANK")) &&
         !env_set(env, "MASTER_ADDR") && !env_set(env, "SLURM_JOB_NODELIST") &&
         !env_set(env, "SLURM_NODELIST");
}

/// Rank 0 starts the job's store on a port the OS picks and broadcasts "host:port" over MPI;
/// the others connect to it. On one node the store stays on loopback; across nodes rank 0
/// advertises its host name and listens on every interface.
std::shared_ptr<Store> mpi_bootstrap_store(const std::map<std::string, std::string>& env,
                                           Duration timeout, int* rank, int* size,
                                           std::string* master_addr) {
  auto mpi = ProcessGroupMpi::create({}, {timeout});
  *rank = mpi->rank();
  *size = mpi->size();
  constexpr int64_t kMax = 512;
  Tensor msg = zeros({kMax}, TensorOptions(kUInt8));
  std::shared_ptr<TCPStore> store;
  if (*rank == 0) {
    const char* local_size_var = env_set(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
                                     ? "OMPI_COMM_WORLD_LOCAL_SIZE"
                                     : "MPI_LOCALNRANKS";
    const bool one_node = env_set(env, local_size_var) &&
                          env.at(local_size_var) == std::to_string(*size);
    std::string host = "127.0.0.1";
    TCPStoreOptions so;
    if (!one_node) {
      char name[256] = {};
      EMBER_CHECK_TYPE(DistNetworkError, gethostname(name, sizeof(name) - 1) == 0,
                       "[init_process_group] mpi bootstrap: gethostname failed");
      host = name;
      so.listen_host = "0.0.0.0";
    }
    so.is_server = true;
    so.world_size = *size;
    so.wait_for_workers = false;
    so.timeout = timeout;
    store = std::make_shared<TCPStore>(host, 0, so);
    const std::string addr = host + ":" + std::to_string(store->port());
    EMBER_CHECK(static_cast<int64_t>(addr.size()) < kMax,
                "[init_process_group] mpi bootstrap: host name too long: ", host);
    std::copy(addr.begin(), addr.end(), msg.data<uint8_t>());
  }
  mpi->broadcast(msg, {0, timeout})->wait();
  const std::string addr(reinterpret_cast<const char*>(msg.data<uint8_t>()));
  const size_t colon = addr.rfind(':');
  EMBER_INTERNAL_ASSERT(colon != std::string::npos, "mpi bootstrap got '", addr, "'");
  *master_addr = addr.substr(0, colon);
  if (*rank != 0) {
    TCPStoreOptions so;
    so.world_size = *size;
    so.timeout = timeout;
    store = std::make_shared<TCPStore>(*master_addr, static_cast<uint16_t>(std::stoi(addr.substr(colon + 1))), so);
  }
  return store;
}

std::shared_ptr<Store> rendezvous_tcp_store(const std::string& host, int port, int rank, int size,
                                            Duration timeout) {
  TCPStoreOptions so;
  so.is_server = rank == 0;
  so.world_size = size;
  so.timeout = timeout;
  return std::make_shared<TCPStore>(host, static_cast<uint16_t>(port), so);
}

// The variables that carry the rank and the world size, in the order they are looked for:
// emberrun/torchrun, Open MPI, MPICH/Intel MPI (PMI), Slurm.
constexpr std::pair<const char*, const char*> kRankFamilies[] = {
    {"RANK", "WORLD_SIZE"},
    {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
    {"PMI_RANK", "PMI_SIZE"},
    {"SLURM_PROCID", "SLURM_NTASKS"}};

}  // namespace

// ---- env:// -------------------------------------------------------------------------------------

namespace {

int master_port_from_env(const std::map<std::string, std::string>& env, const std::string& found) {
  if (auto port = env.find("MASTER_PORT"); port != env.end() && !port->second.empty()) {
    return parse_int("MASTER_PORT", port->second, 1, 65535, found);
  }
  // Under Slurm every task of a job sees the same SLURM_JOB_ID, so a port derived from it is
  // agreed on without a launcher; two jobs sharing a node differ unless their ids are 10000
  // apart (the same rule as PyTorch Lightning's, so users see the port they would expect).
  if (auto job = env.find("SLURM_JOB_ID"); job != env.end() && !job->second.empty()) {
    return 15000 + parse_int("SLURM_JOB_ID", job->second, 0, 1 << 30, found) % 10000;
  }
  throw ValueError(detail::str_cat("[init_process_group] env:// needs MASTER_PORT (", found,
                                   ")"));
}

}  // namespace

std::string first_slurm_host(const std::string& nodelist) {
  // Top-level comma ends the first entry; commas inside [...] belong to ranges.
  int depth = 0;
  size_t end = nodelist.size();
  for (size_t i = 0; i < nodelist.size(); ++i) {
    if (nodelist[i] == '[') ++depth;
    if (nodelist[i] == ']') --depth;
    if (nodelist[i] == ',' && depth == 0) {
      end = i;
      break;
    }
  }
  const std::string entry = nodelist.substr(0, end);
  const size_t open = entry.find('[');
  if (open == std::string::npos) return entry;
  const size_t close = entry.find(']', open);
  EMBER_CHECK(close != std::string::npos, "[init_process_group] cannot parse the Slurm node list '",
              nodelist, "'");
  const std::string inside = entry.substr(open + 1, close - open - 1);
  const size_t stop = inside.find_first_of(",-");
  return entry.substr(0, open) + inside.substr(0, stop) + entry.substr(close + 1);
}

EnvRendezvous parse_env_rendezvous(const std::map<std::string, std::string>& env, int rank,
                                   int world_size) {
  const std::string found = echo(env);
  EnvRendezvous r;
  for (const auto& [rname, sname] : kRankFamilies) {
    const bool has_r = env.count(rname) > 0, has_s = env.count(sname) > 0;
    if (!has_r && !has_s) continue;
    EMBER_CHECK(has_r && has_s, "[init_process_group] env:// found ", has_r ? rname : sname,
                " but not ", has_r ? sname : rname, " (", found, ")");
    r.rank = parse_int(rname, env.at(rname), 0, 1 << 30, found);
    r.world_size = parse_int(sname, env.at(sname), 1, 1 << 30, found);
    r.source = detail::str_cat(rname, "/", sname);
    break;
  }
  if (r.source.empty()) {
    EMBER_CHECK(rank >= 0 && world_size >= 1,
                "[init_process_group] env:// needs the rank and world size: set RANK and "
                "WORLD_SIZE (or run under mpirun or srun), or pass rank and world_size (",
                found, ")");
    r.source = "arguments";
  }
  if (rank >= 0) {
    EMBER_CHECK(r.rank < 0 || r.rank == rank, "[init_process_group] rank ", rank,
                " contradicts the environment's ", r.source, " rank ", r.rank, " (", found, ")");
    r.rank = rank;
  }
  if (world_size >= 0) {
    EMBER_CHECK(r.world_size < 0 || r.world_size == world_size, "[init_process_group] world_size ",
                world_size, " contradicts the environment's ", r.source, " size ", r.world_size,
                " (", found, ")");
    r.world_size = world_size;
  }
  check_rank_size(r.rank, r.world_size, found);

  if (auto it = env.find("MASTER_ADDR"); it != env.end() && !it->second.empty()) {
    r.master_addr = it->second;
  } else if (auto nl = env.find("SLURM_JOB_NODELIST"); nl != env.end() && !nl->second.empty()) {
    r.master_addr = first_slurm_host(nl->second);
  } else if (auto nl2 = env.find("SLURM_NODELIST"); nl2 != env.end() && !nl2->second.empty()) {
    r.master_addr = first_slurm_host(nl2->second);
  } else {
    throw ValueError(
        detail::str_cat("[init_process_group] env:// needs MASTER_ADDR (rank 0's "
                        "host) or a Slurm node list, or under mpirun an Ember built with MPI (",
                        found, ")"));
  }
  r.master_port = master_port_from_env(env, found);
  return r;
}

bool launched_as_rank(const std::map<std::string, std::string>& env) {
  for (const auto& family : kRankFamilies) {
    if (env.count(family.first) > 0) return true;
  }
  return false;
}

bool launched_as_rank() { return launched_as_rank(environment()); }

namespace {
/// The first local-rank variable set in env, or null.
const char* local_rank_variable(const std::map<std::string, std::string>& env) {
  for (const char* name :
       {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}) {
    if (env.count(name) > 0) return name;
  }
  return nullptr;
}
}  // namespace

std::optional<int> local_rank(const std::map<std::string, std::string>& env) {
  const char* name = local_rank_variable(env);
  if (name == nullptr) return std::nullopt;
  return parse_int(name, env.at(name), 0, 1 << 30, "the local rank");
}

std::optional<int> local_rank() { return local_rank(environment()); }

std::optional<Duration> timeout_from_env(const char* name) {
  const char* t = std::getenv(name);
  if (t == nullptr || *t == '\0') return std::nullopt;
  return std::chrono::seconds(parse_int(name, t, 1, 7 * 24 * 3600, "a timeout in whole seconds"));
}

int local_cuda_device(const std::map<std::string, std::string>& env, int device_count) {
  const char* name = local_rank_variable(env);
  const auto visible = env.find("CUDA_VISIBLE_DEVICES");
  const std::string seen =
      visible == env.end() ? "" : detail::str_cat(" (CUDA_VISIBLE_DEVICES=", visible->second, ")");
  EMBER_CHECK_TYPE(NotImplementedError, device_count > 0, "[local_cuda_device] no CUDA device is ",
                   "visible to this process", seen);
  if (name == nullptr) return 0;
  const int lr = *local_rank(env);
  // A modulo here would put two ranks on one GPU, which NCCL refuses much later ("Duplicate
  // GPU"); a launcher that starts more ranks than devices is the mistake to name.
  EMBER_CHECK(lr < device_count, "[local_cuda_device] ", name, "=", lr, " but this process sees ",
              device_count, " CUDA device", device_count == 1 ? "" : "s", seen,
              ": one GPU per rank needs at most ", device_count, " ranks per node");
  return lr;
}

int local_cuda_device() { return local_cuda_device(environment(), cuda::device_count()); }

// ---- the default group
// ---------------------------------------------------------------------------

void register_backend(const std::string& name, BackendFactory factory) {
  EMBER_CHECK(!name.empty() && factory, "[register_backend] needs a name and a factory");
  std::lock_guard<std::mutex> lock(state().mu);
  state().backends[name] = std::move(factory);
}

std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& o) {
  State& s = state();
  std::unique_lock<std::mutex> lock(s.mu);
  EMBER_CHECK(!s.world,
              "[init_process_group] the default process group is already initialized "
              "(rank ",
              s.world ? s.world->rank() : -1, " of ", s.world ? s.world->size() : 0,
              "); call destroy_process_group first");
  auto backend = s.backends.find(o.backend);
  if (backend == s.backends.end()) {
    std::string known;
    for (const auto& [name, f] : s.backends) known += (known.empty() ? "" : ", ") + name;
    throw ValueError(detail::str_cat("[init_process_group] unknown backend '", o.backend,
                                     "' (available: ", known, ")"));
  }
  const Duration timeout = o.timeout ? *o.timeout : default_timeout();
  EMBER_CHECK(timeout.count() > 0, "[init_process_group] timeout must be positive, got ",
              timeout.count(), " ms");
  BackendFactory factory = backend->second;
  lock.unlock();  // the rendezvous may take a while; the state is only set at the end

  std::shared_ptr<Store> store;
  std::shared_ptr<ProcessGroup> pg;
  int rank = -1, size = -1;
  std::string master_addr;
  const std::string method = o.init_method.empty() && !o.store ? "env://" : o.init_method;
  if (o.backend == "mpi" && method.rfind("env://", 0) == 0 && !std::getenv("MASTER_ADDR")) {
    // Under mpirun, MPI finds the peers itself: no rendezvous and no TCP store are needed.
    // Groups made later get prefixes of this process-local store, which MPI never reads.
    pg = ProcessGroupMpi::create({}, {timeout});
    EMBER_CHECK((o.rank < 0 || o.rank == pg->rank()) &&
                    (o.world_size < 0 || o.world_size == pg->size()),
                "[init_process_group] backend mpi: MPI gives rank ", pg->rank(), " of ",
                pg->size(), " but rank ", o.rank, " and world_size ", o.world_size,
                " were passed");
    store = std::make_shared<HashStore>();
  } else if (o.store) {
    EMBER_CHECK(o.init_method.empty(),
                "[init_process_group] pass either a store or an "
                "init_method, not both (init_method '",
                o.init_method, "')");
    check_rank_size(o.rank, o.world_size, "with a given store, pass rank and world_size");
    store = o.store;
    rank = o.rank;
    size = o.world_size;
  } else if (method.rfind("env://", 0) == 0 && mpi_without_master(environment()) &&
             ProcessGroupMpi::is_available()) {
    store = mpi_bootstrap_store(environment(), timeout, &rank, &size, &master_addr);
    EMBER_CHECK((o.rank < 0 || o.rank == rank) && (o.world_size < 0 || o.world_size == size),
                "[init_process_group] MPI gives rank ", rank, " of ", size, " but rank ", o.rank,
                " and world_size ", o.world_size, " were passed");
  } else if (method.rfind("env://", 0) == 0) {
    const EnvRendezvous r = parse_env_rendezvous(environment(), o.rank, o.world_size);
    rank = r.rank;
    size = r.world_size;
    master_addr = r.master_addr;
    store = rendezvous_tcp_store(r.master_addr, r.master_port, rank, size, timeout);
  } else if (method.rfind("tcp://", 0) == 0) {
    const Url u = parse_url(method, "tcp://");
    rank_size_for_url(o, u, method, &rank, &size);
    master_addr = u.host;
    store = rendezvous_tcp_store(u.host, u.port, rank, size, timeout);
  } else if (method.rfind("file://", 0) == 0) {
    const Url u = parse_url(method, "file://");
    EMBER_CHECK(!u.path.empty(), "[init_process_group] file:// needs a path, got '", method, "'");
    rank_size_for_url(o, u, method, &rank, &size);
    store = std::make_shared<FileStore>(u.path, size, timeout);
  } else {
    throw ValueError(detail::str_cat("[init_process_group] unsupported init_method '", method,
                                     "' (expected env://, tcp://host:port or file:///path)"));
  }

  if (!pg) {
    pg = factory(BackendArgs{std::make_shared<PrefixStore>("default_pg", store), rank, size,
                             timeout, master_addr, /*global_ranks=*/{}});
  }
  if (trace::enabled() && pg) align_trace_clock(*pg);  // before any span worth aligning

  lock.lock();
  EMBER_CHECK(!s.world,
              "[init_process_group] another thread initialized the default group "
              "meanwhile");
  s.store = store;
  s.world = pg;
  logging::set_rank(pg->rank());
  s.backend = o.backend;
  s.master_addr = master_addr;
  s.next_group = 1;
  return pg;
}

bool is_initialized() {
  std::lock_guard<std::mutex> lock(state().mu);
  return state().world != nullptr;
}

std::shared_ptr<ProcessGroup> default_group() {
  std::lock_guard<std::mutex> lock(state().mu);
  EMBER_CHECK(state().world,
              "[default_group] the default process group is not initialized; "
              "call init_process_group first");
  return state().world;
}

std::shared_ptr<Store> default_store() {
  std::lock_guard<std::mutex> lock(state().mu);
  EMBER_CHECK(state().store,
              "[default_store] the default process group is not initialized; "
              "call init_process_group first");
  return state().store;
}

int get_rank(const std::shared_ptr<ProcessGroup>& group) {
  if (group) return group->rank();
  return default_group()->rank();
}

int get_world_size(const std::shared_ptr<ProcessGroup>& group) {
  if (group) return group->size();
  return default_group()->size();
}

std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks, std::optional<Duration> timeout,
                                        const std::string& backend_name) {
  State& s = state();
  std::unique_lock<std::mutex> lock(s.mu);
  EMBER_CHECK(s.world,
              "[new_group] the default process group is not initialized; call "
              "init_process_group first");
  const int world_size = s.world->size(), me = s.world->rank();
  if (ranks.empty()) {
    for (int r = 0; r < world_size; ++r) ranks.push_back(r);
  }
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  std::string listed;
  for (int r : ranks) listed += (listed.empty() ? "" : ", ") + std::to_string(r);
  EMBER_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
              "[new_group] ranks must be distinct, got [", listed, "]");
  EMBER_CHECK(sorted.front() >= 0 && sorted.back() < world_size,
              "[new_group] ranks must be in "
              "[0, ",
              world_size, "), got ", sorted.front(), "..", sorted.back());
  ranks = sorted;
  const std::string name = backend_name.empty() ? s.backend : backend_name;
  auto backend = s.backends.find(name);
  EMBER_CHECK(backend != s.backends.end(), "[new_group] unknown backend '", name, "'");
  BackendFactory factory = backend->second;
  const int id = s.next_group++;  // every rank counts every new_group, member or not
  auto store = std::make_shared<PrefixStore>(detail::str_cat("group_", id), s.store);
  const Duration t = timeout.value_or(s.world->timeout());
  const std::string master_addr = s.master_addr;
  lock.unlock();

  const auto pos = std::find(ranks.begin(), ranks.end(), me);
  const int group_rank = pos == ranks.end() ? -1 : static_cast<int>(pos - ranks.begin());
  auto pg = factory(BackendArgs{store, group_rank, static_cast<int>(ranks.size()), t,
                                master_addr, ranks});
  if (pg == nullptr) return nullptr;
  pg->set_global_ranks(ranks);
  lock.lock();
  s.groups.push_back(pg);
  return pg;
}

int get_global_rank(const ProcessGroup& group, int group_rank) {
  EMBER_CHECK(group_rank >= 0 && group_rank < group.size(), "[get_global_rank] group rank ",
              group_rank, " is not in a group of size ", group.size());
  return group.global_ranks()[group_rank];
}

int get_group_rank(const ProcessGroup& group, int global_rank) {
  const auto& g = group.global_ranks();
  const auto it = std::find(g.begin(), g.end(), global_rank);
  EMBER_CHECK(it != g.end(), "[get_group_rank] global rank ", global_rank,
              " is not a member of this group of size ", group.size());
  return static_cast<int>(it - g.begin());
}

void destroy_process_group() {
  std::vector<std::shared_ptr<ProcessGroup>> groups;
  std::shared_ptr<ProcessGroup> world;
  std::shared_ptr<Store> store;
  {
    std::lock_guard<std::mutex> lock(state().mu);
    groups.swap(state().groups);
    world.swap(state().world);
    store.swap(state().store);
    state().backend.clear();
    state().master_addr.clear();
    state().next_group = 1;
  }
  // Released here, outside the lock, groups before the store they use.
  groups.clear();
  world.reset();
  store.reset();
}

}  // namespace ember::dist
