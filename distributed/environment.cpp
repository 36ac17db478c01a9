// What init_process_group reads from the environment: env://'s variables (emberrun, torchrun,
// mpirun, srun), the local rank and its GPU, timeouts; and the parsing helpers the init methods
// and backend factories share (detail/environment.h).
#include <ember/distributed/environment.h>

#include <cstdlib>
#include <optional>

#include <ember/distributed/detail/environment.h>
#include <ember/tensor/gpu/cuda.h>

extern char** environ;

namespace ember::dist {

namespace detail {

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

std::optional<int> int_from_env(const char* name, int lo, int hi, const char* meaning) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return parse_int(name, v, lo, hi, meaning);
}

Environment environment() {
  Environment env;
  for (char** e = environ; e && *e; ++e) {
    const std::string kv = *e;
    const size_t eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return env;
}

std::string echo(const Environment& env) {
  static const char* kNames[] = {
      "RANK",           "WORLD_SIZE",           "MASTER_ADDR",          "MASTER_PORT",
      "LOCAL_RANK",     "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK",
      "PMI_SIZE",       "SLURM_PROCID",         "SLURM_NTASKS",         "SLURM_JOB_NODELIST",
      "SLURM_NODELIST", "SLURM_JOB_ID",         "SLURM_STEP_ID"};
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

void check_rank_size(int rank, int size, const std::string& where) {
  EMBER_CHECK(size >= 1, "[init_process_group] world_size must be >= 1, got ", size, " (", where,
              ")");
  EMBER_CHECK(rank >= 0 && rank < size, "[init_process_group] rank must be in [0, ", size,
              "), got ", rank, " (", where, ")");
}

bool env_set(const Environment& env, const char* name) {
  auto it = env.find(name);
  return it != env.end() && !it->second.empty();
}

}  // namespace detail

namespace {

using detail::check_rank_size;
using detail::echo;
using detail::environment;
using detail::parse_int;

// The variables that carry the rank and the world size, in the order they are looked for:
// emberrun/torchrun, Open MPI, MPICH/Intel MPI (PMI), Slurm.
constexpr std::pair<const char*, const char*> kRankFamilies[] = {
    {"RANK", "WORLD_SIZE"},
    {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
    {"PMI_RANK", "PMI_SIZE"},
    {"SLURM_PROCID", "SLURM_NTASKS"}};

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

// A batch script's own process sees the job's SLURM_NTASKS, and SLURM_PROCID=0, but it is the
// only process of the batch step: a program started there without srun would wait for peers
// that never come until the store's timeout. srun's tasks carry SLURM_STEP_ID (and its older
// spelling SLURM_STEPID) and the batch step neither, so the mistake is named at once instead.
void check_not_batch_step(const std::map<std::string, std::string>& env, int ntasks,
                          const std::string& found) {
  if (ntasks <= 1 || !detail::env_set(env, "SLURM_JOB_ID") ||
      detail::env_set(env, "SLURM_STEP_ID") || detail::env_set(env, "SLURM_STEPID")) {
    return;
  }
  throw ValueError(detail::str_cat(
      "[init_process_group] SLURM_NTASKS=", ntasks, " but this process is the batch script of ",
      "Slurm job ", env.at("SLURM_JOB_ID"), ", not one of its srun tasks (no SLURM_STEP_ID), ",
      "so its ", ntasks - 1, " peer", ntasks == 2 ? "" : "s", " would never come: start each ",
      "rank with `srun PROGRAM`, or one emberrun per node with `srun emberrun ...`; see ",
      "docs/launcher.md#slurm (", found, ")"));
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
    if (std::string(rname) == "SLURM_PROCID") check_not_batch_step(env, r.world_size, found);
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

std::optional<int> local_world_size(const std::map<std::string, std::string>& env) {
  for (const char* name : {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"}) {
    const auto it = env.find(name);
    if (it != env.end()) return parse_int(name, it->second, 1, 1 << 30, "the local world size");
  }
  return std::nullopt;
}

std::optional<int> local_world_size() { return local_world_size(environment()); }

std::optional<Duration> timeout_from_env(const char* name) {
  const char* t = std::getenv(name);
  if (t == nullptr || *t == '\0') return std::nullopt;
  return std::chrono::seconds(parse_int(name, t, 1, 7 * 24 * 3600, "a timeout in whole seconds"));
}

namespace {
// " (CUDA_VISIBLE_DEVICES=...)" when the variable is set: the usual reason a process sees fewer
// GPUs than the machine has.
std::string visible_devices_note(const std::map<std::string, std::string>& env) {
  const auto visible = env.find("CUDA_VISIBLE_DEVICES");
  return visible == env.end() ? ""
                              : detail::str_cat(" (CUDA_VISIBLE_DEVICES=", visible->second, ")");
}

// local_cuda_device with the caller's name (`who`, `what`) in its messages.
int local_rank_gpu(const std::map<std::string, std::string>& env, int device_count,
                   const std::string& who, const std::string& what) {
  const char* name = local_rank_variable(env);
  const std::string seen = visible_devices_note(env);
  EMBER_CHECK_TYPE(NotImplementedError, device_count > 0, "[", who, "] ", what,
                   "no CUDA device is visible to this process", seen);
  if (name == nullptr) return 0;
  const int lr = *local_rank(env);
  // A modulo here would put two ranks on one GPU, which NCCL refuses much later ("Duplicate
  // GPU"); a launcher that starts more ranks than devices is the mistake to name.
  EMBER_CHECK(lr < device_count, "[", who, "] ", what, name, "=", lr, " but this process sees ",
              device_count, " CUDA device", device_count == 1 ? "" : "s", seen,
              ": one GPU per rank needs at most ", device_count, " ranks per node");
  return lr;
}
}  // namespace

int local_cuda_device(const std::map<std::string, std::string>& env, int device_count) {
  return local_rank_gpu(env, device_count, "local_cuda_device", "");
}

int local_cuda_device() { return local_cuda_device(environment(), cuda::device_count()); }

namespace {
// `spec` as a Device, nullopt for "auto"; ValueError naming `who` for anything else.
std::optional<Device> parse_device_spec(const std::string& spec, const std::string& who) {
  if (spec == "auto") return std::nullopt;
  try {
    return Device(spec);
  } catch (const ValueError&) {
    throw ValueError(detail::str_cat("[", who, "] device '", spec,
                                     "': expected 'auto', 'cpu', 'cuda' or 'cuda:N' (N a GPU "
                                     "index)"));
  }
}
}  // namespace

Device local_device(const std::string& spec, const std::map<std::string, std::string>& env,
                    int device_count, const std::string& who) {
  const std::optional<Device> asked = parse_device_spec(spec, who);
  const std::string what = detail::str_cat("device '", spec, "': ");
  if (!asked) {
    return device_count > 0 ? cuda_device(local_rank_gpu(env, device_count, who, what)) : kCPU;
  }
  if (asked->is_cpu()) return *asked;
  if (spec == "cuda") return cuda_device(local_rank_gpu(env, device_count, who, what));
  EMBER_CHECK_TYPE(NotImplementedError, device_count > 0, "[", who, "] ", what,
                   "no CUDA device is visible to this process", visible_devices_note(env));
  EMBER_CHECK(asked->index < device_count, "[", who, "] ", what, "this process sees ",
              device_count, " CUDA device", device_count == 1 ? "" : "s",
              visible_devices_note(env), ", numbered from 0");
  return *asked;
}

Device local_device(const std::string& spec, const std::string& who) {
  const std::optional<Device> asked = parse_device_spec(spec, who);
  const int count = cuda::device_count();
  // Without a GPU the runtime knows why (no driver, a build without CUDA): say that rather than
  // only "none visible". "auto" is then the CPU.
  EMBER_CHECK_TYPE(NotImplementedError, count > 0 || !asked || asked->is_cpu(), "[", who,
                   "] device '", spec, "': ", cuda::unavailable_reason());
  const Device device = local_device(spec, environment(), count, who);
  if (device.is_cuda()) cuda::set_device(device.index);
  return device;
}

}  // namespace ember::dist
