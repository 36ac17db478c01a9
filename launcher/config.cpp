#include <ember/launcher/config.h>
#include <ember/version.h>

#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <tuple>

#include <ember/distributed/store/tcp_store.h>
#include <ember/launcher/rendezvous_backend.h>

namespace ember::launcher {
namespace {

// A whole-string integer in [lo, hi]; UsageError naming the option otherwise.
// A number for an error message: 1e+308, not std::to_string's 309 digits.
std::string shown(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

int parse_int(const std::string& option, const std::string& value, int lo, int hi) {
  int v = 0;
  auto [p, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (value.empty() || ec != std::errc() || p != value.data() + value.size() || v < lo || v > hi) {
    throw UsageError(option + ": expected an integer in [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "], got '" + value + "'");
  }
  return v;
}

// The CUDA devices the workers will see (CUDA_VISIBLE_DEVICES honoured), counted by the driver
// itself; 0, with the reason in *why, when there is none. The driver is loaded at run time so
// that emberrun links no CUDA library (it also runs on login and CPU-only nodes). cuInit
// creates no context, and the workers are new programs (exec), so they start CUDA afresh.
int count_gpus(std::string* why) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* e = dlerror();
    *why = std::string("no CUDA driver (") + (e != nullptr ? e : "libcuda.so.1 not found") + ")";
    return 0;
  }
  using Init = int (*)(unsigned);
  using Count = int (*)(int*);
  using Name = int (*)(int, const char**);
  auto init = reinterpret_cast<Init>(dlsym(lib, "cuInit"));
  auto count = reinterpret_cast<Count>(dlsym(lib, "cuDeviceGetCount"));
  auto name = reinterpret_cast<Name>(dlsym(lib, "cuGetErrorName"));
  if (init == nullptr || count == nullptr) {
    *why = "libcuda.so.1 has no cuInit or cuDeviceGetCount";
    return 0;
  }
  int n = 0;
  int r = init(0);
  if (r == 0) r = count(&n);
  if (r != 0) {
    const char* text = nullptr;
    if (name == nullptr || name(r, &text) != 0 || text == nullptr) text = "unknown error";
    *why = "the CUDA driver reports " + std::string(text) + " (" + std::to_string(r) + ")";
    return 0;
  }
  if (n == 0) *why = "the CUDA driver sees no device";
  return n;
}

std::vector<std::string> split(const std::string& s, const std::string& seps) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (seps.find(c) != std::string::npos) {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

}  // namespace

int available_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

int pick_free_port(bool any_address) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw std::runtime_error(std::string("[emberrun] socket: ") + std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(any_address ? INADDR_ANY : INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    int e = errno;
    close(fd);
    throw std::runtime_error(std::string("[emberrun] could not pick a free port: ") +
                             std::strerror(e));
  }
  close(fd);
  return ntohs(a.sin_port);
}

std::pair<std::string, int> split_host_port(const std::string& option, const std::string& value,
                                            int default_port) {
  std::string host = value, port;
  if (!value.empty() && value[0] == '[') {  // [v6] or [v6]:port
    auto close = value.find(']');
    if (close == std::string::npos) throw UsageError(option + ": unclosed '[' in '" + value + "'");
    host = value.substr(1, close - 1);
    if (close + 1 < value.size()) {
      if (value[close + 1] != ':') {
        throw UsageError(option + ": expected [HOST]:PORT, got '" + value + "'");
      }
      port = value.substr(close + 2);
    }
  } else if (std::count(value.begin(), value.end(), ':') == 1) {
    auto colon = value.find(':');
    host = value.substr(0, colon);
    port = value.substr(colon + 1);
  }
  if (host.empty()) throw UsageError(option + ": expected HOST[:PORT], got '" + value + "'");
  int p = port.empty() ? default_port : parse_int(option + " port", port, 1, 65535);
  return {host, p};
}

std::vector<StreamMask> parse_std_spec(const std::string& option, const std::string& value,
                                       int nproc) {
  auto mask = [&](const std::string& v) {
    int m = parse_int(option, v, 0, 3);
    return StreamMask{(m & 1) != 0, (m & 2) != 0};
  };
  std::vector<StreamMask> out(nproc);
  if (value.find(':') == std::string::npos) {
    StreamMask m = mask(value);
    for (auto& o : out) o = m;
    return out;
  }
  for (const auto& item : split(value, ",")) {
    auto colon = item.find(':');
    if (colon == std::string::npos) {
      throw UsageError(option + ": expected LOCAL_RANK:MODE pairs such as '0:3,1:1', got '" +
                       value + "'");
    }
    int r = parse_int(option, item.substr(0, colon), 0, 1 << 20);
    if (r >= nproc) {
      throw UsageError(option + ": local rank " + std::to_string(r) + " in '" + value +
                       "' is not below --nproc-per-node " + std::to_string(nproc));
    }
    out[r] = mask(item.substr(colon + 1));
  }
  return out;
}

namespace {

// The options given as text or checked after parsing; everything else CLI11 writes straight
// into the LaunchConfig.
struct RawOptions {
  std::string nnodes = "1", nproc = "1", redirects = "0", tee = "0", filter;
  std::optional<int> master_port;
  std::optional<int> node_rank;
  std::string max_restarts = "0";  // parsed by check_limits: a clear range, not CLI11's
                                   // "Could not convert" for a number past int
  std::string rdzv_conf, start_method;
  std::optional<double> heartbeat_interval;  // unset: 5 s, or less for a short timeout
  // --store-*, one per dist::store_limits(), in its order; "" = not given
  std::vector<std::string> store_limits = std::vector<std::string>(dist::store_limits().size());
  bool no_python = false, module = false, run_path = false;
};

// Where an option's value came from; a lower value is the stronger source.
enum class Source { kCommandLine, kEmberEnv, kTorchEnv, kDefault };

// One option and the suffix of its variables (EMBER_<var>, and PET_<var> when torchrun has it).
struct EnvOption {
  CLI::Option* option;
  std::string var;
  bool torch;
};

// --rdzv-backend's help, from the registry: each backend's names and what it is, "static or c10d
// (node 0's agent hosts the store), or etcd (...)".
std::string backends_help() {
  std::vector<std::pair<std::string, const RendezvousBackendType*>> groups;
  for (const auto& b : rendezvous_backends()) {
    if (!groups.empty() && groups.back().second == b.type) {
      groups.back().first += std::string(" or ") + b.name;
    } else {
      groups.emplace_back(b.name, b.type);
    }
  }
  std::string out;
  for (size_t i = 0; i < groups.size(); ++i) {
    out += i == 0 ? "" : i + 1 == groups.size() ? ", or " : ", ";
    out += groups[i].first + " (" + groups[i].second->help + ")";
  }
  return out;
}

std::vector<EnvOption> add_options(CLI::App& app, RawOptions& raw, LaunchConfig& c) {
  std::vector<EnvOption> out;
  auto opt = [&](const std::string& names, auto& var, const std::string& env,
                 const std::string& help, bool torch = true) {
    out.push_back({app.add_option(names, var, help), env, torch});
  };
  auto flag = [&](const std::string& names, bool& var, const std::string& env,
                  const std::string& help) {
    out.push_back({app.add_flag(names, var, help), env, true});
  };
  opt("--nnodes", raw.nnodes, "NNODES", "Number of nodes, N or MIN:MAX");
  opt("--nproc-per-node,--nproc_per_node", raw.nproc, "NPROC_PER_NODE",
      "Ranks on this node: an integer, cpu, gpu or auto");
  opt("--node-rank,--node_rank", raw.node_rank, "NODE_RANK",
      "This node's rank (multi-node: omitted = assigned by arrival, the store's host is 0; "
      "ignored with --rdzv-backend etcd)");
  opt("--master-addr,--master_addr", c.master_addr, "MASTER_ADDR",
      "Address of rank 0's store (MASTER_ADDR)");
  opt("--master-port,--master_port", raw.master_port, "MASTER_PORT",
      "Port of rank 0's store (MASTER_PORT), default 29500");
  opt("--rdzv-endpoint,--rdzv_endpoint", c.rdzv_endpoint, "RDZV_ENDPOINT",
      "Rendezvous store host[:port] (multi-node; port 29400 if omitted; default: "
      "--master-addr:--master-port)");
  opt("--rdzv-id,--rdzv_id", c.rdzv_id, "RDZV_ID", "Run id (names the log folder)");
  opt("--rdzv-backend,--rdzv_backend", c.rdzv_backend, "RDZV_BACKEND",
      "Rendezvous backend: " + backends_help());
  opt("--rdzv-conf,--rdzv_conf", raw.rdzv_conf, "RDZV_CONF",
      "Rendezvous settings key=value,...: join_timeout, timeout (both --rdzv-timeout), "
      "last_call_timeout (--rdzv-last-call), read_timeout (one store request, 10 s); etcd: "
      "protocol=https, cacert, cert, key (TLS), user, password_file (authentication)");
  opt("--local-addr,--local_addr", c.local_addr, "LOCAL_ADDR",
      "This node's address, given to the workers as MASTER_ADDR when it is node 0");
  opt("--rdzv-timeout,--rdzv_timeout,--join-timeout,--join_timeout", c.rdzv_timeout_s,
      "RDZV_TIMEOUT", "Seconds the nodes may take to join a rendezvous round (900)", false);
  opt("--rdzv-last-call,--rdzv_last_call", c.last_call_s, "RDZV_LAST_CALL",
      "With --nnodes MIN:MAX: seconds to wait for more nodes once MIN joined (30)", false);
  opt("--heartbeat-interval,--heartbeat_interval", raw.heartbeat_interval, "HEARTBEAT_INTERVAL",
      "Multi-node: seconds between an agent's heartbeats in the rendezvous store (5, or "
      "--heartbeat-timeout / 3 when that is less)",
      false);
  opt("--heartbeat-timeout,--heartbeat_timeout", c.heartbeat_timeout_s, "HEARTBEAT_TIMEOUT",
      "Multi-node: node 0 (etcd: any agent) ends the round when a node's heartbeat is this many "
      "seconds old (25); with etcd also the agents' lease TTL",
      false);
  flag("--standalone", c.standalone, "STANDALONE", "Single node, free port picked automatically");
  opt("--max-restarts,--max_restarts", raw.max_restarts, "MAX_RESTARTS",
      "Restarts of the worker group before failing");
  opt("--monitor-interval,--monitor_interval", c.monitor_interval_s, "MONITOR_INTERVAL",
      "Seconds between worker checks");
  opt("--grace-period,--grace_period", c.grace_period_s, "GRACE_PERIOD",
      "Seconds between SIGTERM and SIGKILL when stopping workers (Ember extension)", false);
  for (size_t i = 0; i < dist::store_limits().size(); ++i) {
    const dist::StoreLimit& l = dist::store_limits()[i];
    opt(l.option, raw.store_limits[i], std::string(l.env).substr(std::strlen("EMBER_")), l.help,
        false);
  }
  opt("--log-dir,--log_dir", c.log_dir, "LOG_DIR", "Folder for per-rank log files");
  opt("-r,--redirects", raw.redirects, "REDIRECTS",
      "Streams sent to the log file only: 0 none, 1 stdout, 2 stderr, 3 both, or 0:3,1:1");
  opt("-t,--tee", raw.tee, "TEE", "Streams sent to console and log file (same format)");
  opt("--local-ranks-filter,--local_ranks_filter", raw.filter, "LOCAL_RANKS_FILTER",
      "Console shows only these local ranks, e.g. 0 or 0,2");
  opt("--role", c.role, "ROLE", "The workers' ROLE_NAME (default: default)");
  opt("--start-method,--start_method", raw.start_method, "START_METHOD",
      "torchrun's spawn, fork or forkserver: accepted, no effect (workers are programs)");
  flag("--no-python,--no_python", raw.no_python, "NO_PYTHON",
       "torchrun's flag: accepted, no effect (workers are always programs)");
  flag("-m,--module", raw.module, "MODULE", "torchrun's flag: refused (emberrun runs programs)");
  flag("--run-path,--run_path", raw.run_path, "RUN_PATH",
       "torchrun's flag: refused (emberrun runs programs)");
  return out;
}

// PROGRAM and its ARGS: what CLI11 left after emberrun's options.
void take_program(const CLI::App& app, const std::vector<std::string>& args, LaunchConfig& c) {
  std::vector<std::string> rest = app.remaining();
  if (!rest.empty() && rest.front() == "--") rest.erase(rest.begin());
  if (rest.empty()) throw UsageError("missing PROGRAM: emberrun [OPTIONS] PROGRAM [ARGS...]");
  bool after_dashes = std::find(args.begin(), args.end(), "--") != args.end();
  if (rest.front().size() > 1 && rest.front()[0] == '-' && !after_dashes) {
    throw UsageError("unknown option '" + rest.front() + "'");
  }
  if (rest.front().empty()) throw UsageError("PROGRAM must not be empty");
  c.program = rest.front();
  c.args.assign(rest.begin() + 1, rest.end());
}

// --nnodes N or MIN:MAX, --nproc-per-node and --node-rank.
void resolve_topology(const RawOptions& raw, LaunchConfig& c) {
  const std::string& nnodes = raw.nnodes;
  auto colon = nnodes.find(':');
  if (colon == std::string::npos) {
    c.min_nodes = c.max_nodes = parse_int("--nnodes", nnodes, 1, 1 << 16);
  } else {
    c.min_nodes = parse_int("--nnodes", nnodes.substr(0, colon), 1, 1 << 16);
    c.max_nodes = parse_int("--nnodes", nnodes.substr(colon + 1), 1, 1 << 16);
    if (c.min_nodes > c.max_nodes) {
      throw UsageError("--nnodes: MIN must not exceed MAX, got '" + nnodes + "'");
    }
  }
  if (raw.nproc == "cpu") {
    c.nproc_per_node = available_cpus();
  } else if (raw.nproc == "gpu" || raw.nproc == "auto") {
    std::string why;
    const int g = count_gpus(&why);
    if (raw.nproc == "gpu" && g == 0) {
      const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
      throw UsageError("--nproc-per-node gpu: no GPU visible to this process: " + why +
                       (visible != nullptr ? std::string(" (CUDA_VISIBLE_DEVICES=") + visible + ")"
                                           : std::string()));
    }
    c.nproc_per_node = g > 0 ? g : available_cpus();
  } else {
    c.nproc_per_node = parse_int("--nproc-per-node", raw.nproc, 1, 1 << 16);
  }
  // Ranks are ints: max_nodes * nproc_per_node (world_size()) must fit one.
  if (int64_t{c.max_nodes} * c.nproc_per_node > std::numeric_limits<int>::max()) {
    throw UsageError("--nnodes " + nnodes + " with --nproc-per-node " +
                     std::to_string(c.nproc_per_node) + " makes more than " +
                     std::to_string(std::numeric_limits<int>::max()) + " ranks");
  }
  if (raw.node_rank) {
    const int r = *raw.node_rank;
    if (r < 0 || r >= c.max_nodes) {
      throw UsageError("--node-rank: expected a value in [0, " + std::to_string(c.max_nodes) +
                       "), got " + std::to_string(r));
    }
    if (c.min_nodes != c.max_nodes) {
      throw UsageError("--node-rank " + std::to_string(r) + " needs a fixed --nnodes, got '" +
                       nnodes + "' (omit --node-rank to have ranks assigned by arrival)");
    }
    c.node_rank = r;
    c.node_rank_given = true;
  }
  if (c.multi_node() && c.standalone) {
    throw UsageError("--standalone is single-node, but --nnodes is '" + nnodes + "'");
  }
}

// --heartbeat-timeout and --heartbeat-interval: a timeout must leave room for a few beats, or
// a healthy node would be declared lost between two of them.
void check_heartbeat(const RawOptions& raw, LaunchConfig& c) {
  std::ostringstream os;
  if (!(c.heartbeat_timeout_s > 0) || c.heartbeat_timeout_s > 1e6) {
    os << "--heartbeat-timeout: expected seconds in (0, 1e6], got " << c.heartbeat_timeout_s;
    throw UsageError(os.str());
  }
  if (!raw.heartbeat_interval) {
    c.heartbeat_interval_s = std::min(5.0, c.heartbeat_timeout_s / 3);
    return;
  }
  c.heartbeat_interval_s = *raw.heartbeat_interval;
  if (!(c.heartbeat_interval_s > 0) || !(c.heartbeat_interval_s < c.heartbeat_timeout_s)) {
    os << "--heartbeat-interval: expected seconds in (0, --heartbeat-timeout "
       << c.heartbeat_timeout_s << "), got " << c.heartbeat_interval_s;
    throw UsageError(os.str());
  }
}

// The timing options and the restart count.
void check_limits(const RawOptions& raw, LaunchConfig& c) {
  if (!(c.rdzv_timeout_s > 0) || c.rdzv_timeout_s > 1e6) {
    throw UsageError("--rdzv-timeout: expected seconds in (0, 1e6], got " +
                     shown(c.rdzv_timeout_s));
  }
  if (!(c.last_call_s >= 0) || c.last_call_s > 1e6) {
    throw UsageError("--rdzv-last-call: expected seconds in [0, 1e6], got " +
                     shown(c.last_call_s));
  }
  if (c.rdzv_read_timeout_s > 1e6) {
    throw UsageError("--rdzv-conf read_timeout: expected seconds in (0, 1e6], got " +
                     shown(c.rdzv_read_timeout_s));
  }
  check_heartbeat(raw, c);
  c.max_restarts = parse_int("--max-restarts", raw.max_restarts, 0, 1'000'000);
  if (!(c.monitor_interval_s > 0) || c.monitor_interval_s > 3600) {
    throw UsageError("--monitor-interval: expected seconds in (0, 3600], got " +
                     shown(c.monitor_interval_s));
  }
  if (!(c.grace_period_s >= 0) || c.grace_period_s > 3600) {
    throw UsageError("--grace-period: expected seconds in [0, 3600], got " +
                     shown(c.grace_period_s));
  }
  for (size_t i = 0; i < dist::store_limits().size(); ++i) {
    const std::string& v = raw.store_limits[i];
    if (v.empty()) continue;
    const dist::StoreLimit& l = dist::store_limits()[i];
    dist::TCPStoreServerOptions checked;
    try {
      dist::set_store_limit(checked, l, v, l.option);
    } catch (const Error& e) {
      throw UsageError(e.what());
    }
    c.store_limits.emplace_back(l.env, v);
  }
}

// The rendezvous backend, rank 0's address and port, and the output routing.
void resolve_addresses_and_output(const RawOptions& raw, LaunchConfig& c) {
  const RendezvousBackendType* backend = find_rendezvous_backend(c.rdzv_backend);
  if (backend == nullptr) {
    throw UsageError("--rdzv-backend: expected " + rendezvous_backend_names() + ", got '" +
                     c.rdzv_backend + "'");
  }
  if (backend->check_options != nullptr) backend->check_options(c);
  // One node with an --rdzv-endpoint: torchrun's agent then gives the workers a free
  // MASTER_PORT of its own, so that jobs stacked on one host (each with its own endpoint) never
  // share the default 29500, clash or join each other's rendezvous. The endpoint is checked as
  // on several nodes.
  const bool single_with_endpoint = !c.multi_node() && !c.rdzv_endpoint.empty();
  if (single_with_endpoint) {
    (void)split_host_port("--rdzv-endpoint", c.rdzv_endpoint, backend->default_port);
  }
  if (raw.master_port) {
    c.master_port = parse_int("--master-port", std::to_string(*raw.master_port), 1, 65535);
  } else if (c.standalone || single_with_endpoint) {
    c.pick_master_port = true;
    c.master_port = pick_free_port();
  }
  if (c.master_addr.empty()) throw UsageError("--master-addr: must not be empty");
  if (c.multi_node()) {  // a bad --rdzv-endpoint is a usage error
    std::tie(c.rdzv_host, c.rdzv_port) =
        c.rdzv_endpoint.empty()
            ? std::pair(c.master_addr, c.master_port)
            : split_host_port("--rdzv-endpoint", c.rdzv_endpoint, backend->default_port);
  }
  c.redirects = parse_std_spec("--redirects", raw.redirects, c.nproc_per_node);
  c.tee = parse_std_spec("--tee", raw.tee, c.nproc_per_node);
  if (!raw.filter.empty()) {
    std::vector<int> ranks;
    for (const auto& s : split(raw.filter, ", ")) {
      ranks.push_back(parse_int("--local-ranks-filter", s, 0, c.nproc_per_node - 1));
    }
    c.local_ranks_filter = ranks;
  }
}

// An option's value in seconds from --rdzv-conf; UsageError quoting the pair otherwise.
double conf_seconds(const std::string& key, const std::string& value) {
  double v = 0;
  auto [p, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (value.empty() || ec != std::errc() || p != value.data() + value.size() || !(v > 0)) {
    throw UsageError("--rdzv-conf: " + key + " expects seconds > 0, got '" + value + "'");
  }
  return v;
}

// --rdzv-conf's etcd keys: TLS (torchrun's etcd backend's protocol, cacert, cert, key) and
// authentication (user, password_file).
const std::vector<std::string> kEtcdConfKeys = {"protocol", "cacert", "cert",
                                                "key",      "user",   "password_file"};

// "key=value,..." into its pairs, refusing malformed pairs and unknown keys.
std::vector<std::pair<std::string, std::string>> parse_rdzv_conf(const std::string& text) {
  static const std::vector<std::string> known = [] {
    std::vector<std::string> k = {"join_timeout", "last_call_timeout", "timeout", "read_timeout"};
    k.insert(k.end(), kEtcdConfKeys.begin(), kEtcdConfKeys.end());
    return k;
  }();
  std::vector<std::pair<std::string, std::string>> pairs;
  for (const auto& item : split(text, ",")) {
    const auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == item.size()) {
      throw UsageError("--rdzv-conf: malformed pair '" + item + "' in '" + text +
                       "' (expected key=value,...)");
    }
    std::string key = item.substr(0, eq);
    if (std::find(known.begin(), known.end(), key) == known.end()) {
      std::string names;
      for (const auto& k : known) names += (names.empty() ? "" : ", ") + k;
      throw UsageError("--rdzv-conf: unknown key '" + key + "' (known: " + names + ")");
    }
    pairs.emplace_back(std::move(key), item.substr(eq + 1));
  }
  return pairs;
}

// Sets `target` (the value of `option`, from `option_src`) to a --rdzv-conf key's value (from
// `conf_src`) unless the option's source is stronger; the same source disagreeing is an error.
void merge_conf_value(const std::string& pair, double value, Source conf_src,
                      const std::string& option, Source option_src, double& target) {
  if (option_src < conf_src) return;
  if (option_src == conf_src && target != value) {
    std::ostringstream os;
    os << "--rdzv-conf " << pair << " contradicts " << option << " " << target
       << " (give one of them)";
    throw UsageError(os.str());
  }
  target = value;
}

// Applies one of kEtcdConfKeys; returns whether `key` was one of them.
bool apply_etcd_conf(const std::string& key, const std::string& value, LaunchConfig& c) {
  if (std::find(kEtcdConfKeys.begin(), kEtcdConfKeys.end(), key) == kEtcdConfKeys.end()) {
    return false;
  }
  if (c.rdzv_backend != "etcd") {
    throw UsageError("--rdzv-conf " + key + "=" + value +
                     " is for --rdzv-backend etcd (its TLS and authentication settings), got "
                     "--rdzv-backend " +
                     c.rdzv_backend);
  }
  if (key == "user") {
    c.etcd_user = value;
    return true;
  }
  if (key == "protocol") {
    std::string p = value;
    std::transform(p.begin(), p.end(), p.begin(), [](unsigned char ch) { return std::tolower(ch); });
    if (p != "http" && p != "https") {
      throw UsageError("--rdzv-conf protocol: expected http or https, got '" + value + "'");
    }
    c.etcd_https = p == "https";
    return true;
  }
  if (::access(value.c_str(), R_OK) != 0) {
    throw UsageError("--rdzv-conf " + key + ": cannot read '" + value + "': " +
                     std::strerror(errno));
  }
  if (key == "password_file") {
    std::ifstream in(value);
    std::getline(in, c.etcd_password);  // the first line, without its newline
    if (!c.etcd_password.empty() && c.etcd_password.back() == '\r') c.etcd_password.pop_back();
    if (c.etcd_password.empty()) {
      throw UsageError("--rdzv-conf password_file: '" + value + "' holds no password (first line)");
    }
    return true;
  }
  (key == "cacert" ? c.etcd_cacert : key == "cert" ? c.etcd_cert : c.etcd_key) = value;
  return true;
}

// --rdzv-conf onto the options it maps to (see parse_args' contract for the precedence).
void apply_rdzv_conf(const std::string& text, const std::map<std::string, Source>& sources,
                     LaunchConfig& c) {
  auto source = [&](const std::string& var) {
    auto it = sources.find(var);
    return it == sources.end() ? Source::kDefault : it->second;
  };
  const Source conf_src = source("RDZV_CONF");
  std::optional<std::pair<std::string, double>> join;  // join_timeout or timeout
  for (const auto& [key, value] : parse_rdzv_conf(text)) {
    if (apply_etcd_conf(key, value, c)) continue;
    const double v = conf_seconds(key, value);
    const std::string pair = key + "=" + value;
    if (key == "read_timeout") {
      c.rdzv_read_timeout_s = v;
    } else if (key == "last_call_timeout") {
      merge_conf_value(pair, v, conf_src, "--rdzv-last-call", source("RDZV_LAST_CALL"),
                       c.last_call_s);
    } else {  // torch's static backend calls the join limit "timeout", the c10d one join_timeout
      if (join && join->second != v) {
        throw UsageError("--rdzv-conf: " + join->first + " and " + pair +
                         " both set the join timeout");
      }
      join = {pair, v};
      merge_conf_value(pair, v, conf_src, "--rdzv-timeout", source("RDZV_TIMEOUT"),
                       c.rdzv_timeout_s);
    }
  }
  if (!c.etcd_https && !(c.etcd_cacert.empty() && c.etcd_cert.empty() && c.etcd_key.empty())) {
    throw UsageError("--rdzv-conf cacert, cert and key are TLS settings: they need protocol=https");
  }
  if (c.etcd_user.empty() != c.etcd_password.empty()) {
    throw UsageError(std::string("--rdzv-conf ") +
                     (c.etcd_user.empty() ? "password_file needs user" : "user needs password_file") +
                     " (etcd's authentication takes both)");
  }
  if (!c.etcd_key.empty() && c.etcd_cert.empty()) {
    throw UsageError("--rdzv-conf key=" + c.etcd_key +
                     " needs cert (the client certificate it is the key of)");
  }
}

// torchrun's Python-only options: refused or accepted with a notice.
void check_python_options(const RawOptions& raw, LaunchConfig& c) {
  const std::string why =
      ": emberrun runs programs, not Python modules or scripts through an interpreter of its "
      "own; to run Python, give the interpreter as the program: emberrun [OPTIONS] python3 ";
  if (raw.module) throw UsageError("-m/--module is not supported" + why + "-m MODULE [ARGS...]");
  if (raw.run_path) throw UsageError("--run-path is not supported" + why + "script.py [ARGS...]");
  if (raw.no_python) {
    c.notices.push_back("--no-python has no effect: workers are always run as programs");
  }
  if (!raw.start_method.empty()) {
    if (raw.start_method != "spawn" && raw.start_method != "fork" &&
        raw.start_method != "forkserver") {
      throw UsageError("--start-method: expected spawn, fork or forkserver, got '" +
                       raw.start_method + "'");
    }
    c.notices.push_back(
        "--start-method has no effect: workers are always run as programs "
        "(fork and exec)");
  }
  if (c.role.empty()) throw UsageError("--role: must not be empty");
}

void parse_into(CLI::App& app, const std::vector<std::string>& args) {
  std::vector<std::string> rev(args.rbegin(), args.rend());
  try {
    app.parse(rev);
  } catch (const CLI::CallForHelp&) {
    throw HelpRequested(app.help());
  } catch (const CLI::CallForVersion& v) {
    throw HelpRequested(std::string(v.what()) + "\n");
  } catch (const CLI::ParseError& e) {
    throw UsageError(e.what());
  }
}

constexpr const char* kDescription =
    "emberrun: launch PROGRAM as a group of ranks (torchrun's interface for programs).\n"
    "An option not on the command line is read from its EMBER_* variable, else from torchrun's "
    "PET_* one\n(EMBER_NPROC_PER_NODE, PET_NPROC_PER_NODE, ...).";

void setup_app(CLI::App& app) {
  app.prefix_command();  // everything from PROGRAM on belongs to the program
  app.set_help_flag("-h,--help", "Print this help and exit");
  app.set_version_flag("--version", "emberrun (Ember) " EMBER_VERSION);
}

// The options the command line leaves unset but an EMBER_* or PET_* variable sets, as
// "--option=value" arguments to put before the command line, and each option's source. A
// first parse of the command line alone tells which options it sets.
std::vector<std::string> environment_args(const std::vector<std::string>& args,
                                          std::map<std::string, Source>& sources) {
  CLI::App app{kDescription, "emberrun"};
  setup_app(app);
  RawOptions raw;
  LaunchConfig c;
  const auto options = add_options(app, raw, c);
  parse_into(app, args);
  std::vector<std::string> out;
  for (const auto& o : options) {
    if (o.option->count() > 0) {
      sources[o.var] = Source::kCommandLine;
      continue;
    }
    // An empty variable counts as unset, as CLI11's envname() treats it.
    auto get = [](const std::string& name) {
      const char* v = std::getenv(name.c_str());
      return v != nullptr && *v != '\0' ? v : nullptr;
    };
    const char* v = get("EMBER_" + o.var);
    Source s = Source::kEmberEnv;
    if (v == nullptr && o.torch) {
      v = get("PET_" + o.var);
      s = Source::kTorchEnv;
    }
    if (v == nullptr) continue;
    sources[o.var] = s;
    out.push_back(o.option->get_name() + "=" + v);
  }
  return out;
}

}  // namespace

LaunchConfig parse_args(const std::vector<std::string>& args) {
  std::map<std::string, Source> sources;
  std::vector<std::string> all = environment_args(args, sources);
  all.insert(all.end(), args.begin(), args.end());
  CLI::App app{kDescription, "emberrun"};
  setup_app(app);
  RawOptions raw;
  LaunchConfig c;
  add_options(app, raw, c);
  parse_into(app, all);
  take_program(app, all, c);
  check_python_options(raw, c);
  resolve_topology(raw, c);
  if (!raw.rdzv_conf.empty()) apply_rdzv_conf(raw.rdzv_conf, sources, c);
  check_limits(raw, c);
  resolve_addresses_and_output(raw, c);
  return c;
}

}  // namespace ember::launcher
