// Two network namespaces joined by a veth pair: two "nodes" on one machine for the multi-node
// launcher tests. Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and the `ip` tool.
//
//   std::string why;
//   auto net = NetnsPair::create(&why);
//   if (!net) GTEST_SKIP() << why;
//   Emberrun a(args, env, net->exec_prefix(0));   // runs inside namespace 0
//
// Names are unique (pid + random), addresses are 10.<random>.<random>.1 and .2 /24. The
// destructor kills every process left in either namespace and deletes both (the veth pair goes
// with them); create() undoes its own partial work when a step fails, and removes namespaces
// that earlier test processes (now dead) left behind.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace emberrun_test {

/// Runs a shell command (bounded by `timeout 30`), returns its exit status; output in *out.
inline int shell(const std::string& cmd, std::string* out = nullptr) {
  std::string full = "timeout 30 " + cmd + " 2>&1";
  FILE* p = popen(full.c_str(), "r");
  if (!p) return -1;
  std::string text;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) text.append(buf, n);
  int st = pclose(p);
  if (out) *out = text;
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

class NetnsPair {
 public:
  std::string ns[2];      // namespace names
  std::string addr[2];    // 10.a.b.1, 10.a.b.2
  std::string subnet;     // 10.a.b.0/24
  std::string ifname[2];  // the veth ends, one in each namespace

  /// Creates the pair, or returns nullptr with the reason in *why (not root, no `ip`, ...).
  static std::unique_ptr<NetnsPair> create(std::string* why) {
    remove_stale();
    std::random_device rd;
    std::mt19937 gen(rd() ^ static_cast<unsigned>(getpid()));
    auto net = std::unique_ptr<NetnsPair>(new NetnsPair);
    const std::string id = std::to_string(getpid()) + "-" + std::to_string(gen() % 100000);
    const std::string short_id = std::to_string(getpid() % 100000) + std::to_string(gen() % 100);
    const std::string base =
        "10." + std::to_string(1 + gen() % 254) + "." + std::to_string(gen() % 256) + ".";
    net->subnet = base + "0/24";
    for (int i = 0; i < 2; ++i) {
      net->ns[i] = "ember-" + id + (i ? "-b" : "-a");
      net->addr[i] = base + std::to_string(i + 1);
      net->ifname[i] = "ev" + short_id + (i ? "b" : "a");  // at most 15 characters
    }
    const std::vector<std::string> steps = {
        "ip netns add " + net->ns[0],
        "ip netns add " + net->ns[1],
        "ip link add " + net->ifname[0] + " type veth peer name " + net->ifname[1],
        "ip link set " + net->ifname[0] + " netns " + net->ns[0],
        "ip link set " + net->ifname[1] + " netns " + net->ns[1],
        "ip -n " + net->ns[0] + " addr add " + net->addr[0] + "/24 dev " + net->ifname[0],
        "ip -n " + net->ns[1] + " addr add " + net->addr[1] + "/24 dev " + net->ifname[1],
        "ip -n " + net->ns[0] + " link set " + net->ifname[0] + " up",
        "ip -n " + net->ns[1] + " link set " + net->ifname[1] + " up",
        "ip -n " + net->ns[0] + " link set lo up",
        "ip -n " + net->ns[1] + " link set lo up",
        "ip netns exec " + net->ns[0] + " true",  // entering one works too (mounts /sys)
    };
    for (const auto& step : steps) {
      std::string out;
      if (shell(step, &out) != 0) {
        *why = "cannot create network namespaces ('" + step + "' failed: " + out +
               "); run as root with the ip tool to test across namespaces";
        net->teardown();  // the destructor would too; this keeps the failure path explicit
        // A veth end not yet moved into a namespace lives in ours: remove it.
        shell("ip link del " + net->ifname[0]);
        return nullptr;
      }
    }
    return net;
  }

  ~NetnsPair() { teardown(); }
  NetnsPair(const NetnsPair&) = delete;
  NetnsPair& operator=(const NetnsPair&) = delete;

  /// The command prefix that runs a program inside namespace i.
  std::vector<std::string> exec_prefix(int i) const { return {"ip", "netns", "exec", ns[i]}; }

  /// Kills every process in both namespaces, then deletes them. Idempotent.
  void teardown() {
    for (const auto& n : ns) {
      if (n.empty()) continue;
      kill_all_in(n);
      shell("ip netns del " + n);
    }
  }

 private:
  NetnsPair() = default;

  static void kill_all_in(const std::string& name) {
    std::string pids;
    if (shell("ip netns pids " + name, &pids) != 0) return;
    std::istringstream in(pids);
    for (int pid; in >> pid;)
      if (pid > 0 && pid != getpid()) kill(pid, SIGKILL);
  }

  // Namespaces "ember-<pid>-..." whose creating test process is gone (it crashed or was
  // killed before its teardown ran).
  static void remove_stale() {
    std::string list;
    if (shell("ip netns list", &list) != 0) return;
    std::istringstream in(list);
    for (std::string line; std::getline(in, line);) {
      std::string name = line.substr(0, line.find(' '));
      if (name.rfind("ember-", 0) != 0) continue;
      const int pid = std::atoi(name.c_str() + 6);
      if (pid <= 0 || kill(pid, 0) == 0 || errno != ESRCH) continue;
      kill_all_in(name);
      shell("ip netns del " + name);
    }
  }
};

}  // namespace emberrun_test
