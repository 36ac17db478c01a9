#include <ember/tensor/detail/thread_count.h>

#include <algorithm>
#include <charconv>
#include <regex>
#include <sstream>

namespace ember::detail {

namespace {

using Env = std::map<std::string, std::string>;

/// The non-negative integer spelled by all of `s`, or -1.
int parse_count(const std::string& s) {
  int v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  return ec == std::errc() && end == s.data() + s.size() && v >= 0 ? v : -1;
}

/// The positive integer spelled by all of `s`, or 0.
int parse_positive(const std::string& s) { return std::max(0, parse_count(s)); }

int positive_variable(const Env& env, const char* name) {
  const auto it = env.find(name);
  return it == env.end() ? 0 : parse_positive(it->second);
}

std::string assignment(const char* name, const std::string& value) {
  return std::string(name) + "=" + value;
}

struct LocalRanks {
  int ranks = 1;
  std::string source;  // "OMPI_COMM_WORLD_LOCAL_SIZE=4"; empty when nothing said
};

/// How many ranks a launcher other than emberrun started on this node.
LocalRanks local_ranks(const Env& env) {
  for (const char* name : {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"}) {
    if (const int n = positive_variable(env, name)) return {n, assignment(name, env.at(name))};
  }
  // The batch script's own process sees the job's task layout too, but it is one process: only
  // the tasks of an srun step share the node.
  if (env.count("SLURM_STEP_ID") == 0) return {};
  const auto node_id = env.find("SLURM_NODEID");
  const int node = node_id == env.end() ? 0 : parse_count(node_id->second);
  if (node < 0) return {};
  for (const char* name : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
    const auto it = env.find(name);
    if (it == env.end()) continue;
    if (const int n = slurm_tasks_on_node(it->second, node)) {
      return {n, assignment(name, it->second) + " (node " + std::to_string(node) + ")"};
    }
  }
  if (const int n = positive_variable(env, "SLURM_NTASKS_PER_NODE")) {
    return {n, assignment("SLURM_NTASKS_PER_NODE", env.at("SLURM_NTASKS_PER_NODE"))};
  }
  return {};
}

}  // namespace

int slurm_tasks_on_node(const std::string& tasks_per_node, int node_id) {
  // Slurm compresses runs of nodes with the same count: "N(xR)" is R nodes of N tasks each.
  static const std::regex kEntry(R"(([0-9]+)(?:\(x([0-9]+)\))?)");
  std::stringstream entries(tasks_per_node);
  std::string entry;
  long first_node = 0;
  int found = 0;
  // The whole list is read, so that a malformed one is refused on every node alike.
  while (std::getline(entries, entry, ',')) {
    std::smatch m;
    if (!std::regex_match(entry, m, kEntry)) return 0;
    const int tasks = parse_positive(m[1].str());
    const int repeat = m[2].matched ? parse_positive(m[2].str()) : 1;
    if (tasks == 0 || repeat == 0) return 0;
    if (node_id >= first_node && node_id < first_node + repeat) found = tasks;
    first_node += repeat;
  }
  return !tasks_per_node.empty() && tasks_per_node.back() != ',' ? found : 0;
}

ThreadCount default_thread_count(const Env& env, int affinity_cpus, int online_cpus) {
  std::string skipped;
  for (const char* name : {"EMBER_NUM_THREADS", "OMP_NUM_THREADS"}) {
    const auto it = env.find(name);
    if (it == env.end()) continue;
    if (const int n = parse_positive(it->second))
      return {n, skipped + assignment(name, it->second)};
    skipped += std::string(name) + "='" + it->second + "' is not a positive integer, skipped; ";
  }

  const int cpus = std::max(1, affinity_cpus);
  ThreadCount t{cpus, skipped + std::to_string(cpus) + (cpus == 1 ? " CPU" : " CPUs") +
                          " in the affinity mask"};
  // A mask narrower than the machine was set for this process (taskset, srun's task binding, a
  // cpuset), so its CPUs are its own; a whole-machine mask is shared with the node's other ranks.
  if (affinity_cpus >= online_cpus) {
    const LocalRanks local = local_ranks(env);
    if (local.ranks > 1) {
      t.threads = std::max(1, cpus / local.ranks);
      t.reason += " shared by " + local.source + " ranks";
    }
  }
  if (const int per_task = positive_variable(env, "SLURM_CPUS_PER_TASK");
      per_task > 0 && per_task < t.threads) {
    t.threads = per_task;
    t.reason += ", at most " + assignment("SLURM_CPUS_PER_TASK", env.at("SLURM_CPUS_PER_TASK"));
  }
  return t;
}

}  // namespace ember::detail
