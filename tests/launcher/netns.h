// Network namespaces as "nodes" on one machine for the multi-node launcher tests: each node's
// namespace has one end of a veth pair, whose other end is attached to a bridge in a "switch"
// namespace of its own, so the nodes reach each other and nothing else. Needs root
// (CAP_SYS_ADMIN and CAP_NET_ADMIN) and the `ip` tool.
//
//   std::string why;
//   auto net = NetnsNodes::create(3, &why);
//   if (!net) GTEST_SKIP() << why;
//   Emberrun a(args, env, net->exec_prefix(0));   // runs inside node 0's namespace
//
// Names are unique (pid + random), addresses are 10.<random>.<random>.1, .2, ... /24. The
// destructor kills every process left in the nodes' namespaces and deletes them all (the veth
// pairs go with them); create() undoes its own partial work when a step fails, and removes
// namespaces that earlier test processes (now dead) left behind. Cutting a node off:
// `ip -n <ns[i]> link set <ifname[i]> down`. in_netns() runs code of the test itself inside a
// node's namespace (a client of a server that listens there).
#pragma once

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
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

/// Runs fn() on a thread of its own that entered the network namespace `ns` (setns affects
/// that thread only; the sockets fn opens stay in `ns`). Returns fn's result, or false when the
/// namespace cannot be entered. The thread is joined before it returns, so a test may fork.
inline bool in_netns(const std::string& ns, const std::function<bool()>& fn) {
  bool ok = false;
  std::thread t([&] {
    const int fd = open(("/var/run/netns/" + ns).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    const bool entered = setns(fd, CLONE_NEWNET) == 0;
    close(fd);
    if (entered) ok = fn();
  });
  t.join();
  return ok;
}

class NetnsNodes {
 public:
  std::vector<std::string> ns;      // the nodes' namespace names
  std::vector<std::string> addr;    // 10.a.b.1, 10.a.b.2, ...
  std::string subnet;               // 10.a.b.0/24
  std::vector<std::string> ifname;  // each node's end of its veth pair, in its namespace
  std::string switch_ns;            // holds the bridge the other veth ends are attached to

  /// Creates `n` nodes, or returns nullptr with the reason in *why (not root, no `ip`, ...).
  static std::unique_ptr<NetnsNodes> create(int n, std::string* why) {
    remove_stale();
    std::random_device rd;
    std::mt19937 gen(rd() ^ static_cast<unsigned>(getpid()));
    auto net = std::unique_ptr<NetnsNodes>(new NetnsNodes);
    const std::string id = std::to_string(getpid()) + "-" + std::to_string(gen() % 100000);
    const std::string short_id = std::to_string(getpid() % 100000) + std::to_string(gen() % 100);
    const std::string base =
        "10." + std::to_string(1 + gen() % 254) + "." + std::to_string(gen() % 256) + ".";
    net->subnet = base + "0/24";
    net->switch_ns = "ember-" + id + "-s";
    const std::string br = "-n " + net->switch_ns + " link ";
    std::vector<std::string> steps = {"ip netns add " + net->switch_ns,
                                      "ip " + br + "add br0 type bridge",
                                      "ip " + br + "set br0 up"};
    for (int i = 0; i < n; ++i) {
      const std::string name = "ember-" + id + "-" + std::to_string(i);
      const std::string ifn = "ev" + short_id + "n" + std::to_string(i);  // <= 15 characters
      const std::string peer = "ev" + short_id + "s" + std::to_string(i);
      net->ns.push_back(name);
      net->addr.push_back(base + std::to_string(i + 1));
      net->ifname.push_back(ifn);
      for (const std::string& step :
           {"ip netns add " + name, "ip link add " + ifn + " type veth peer name " + peer,
            "ip link set " + ifn + " netns " + name,
            "ip link set " + peer + " netns " + net->switch_ns,
            "ip " + br + "set " + peer + " master br0", "ip " + br + "set " + peer + " up",
            "ip -n " + name + " addr add " + net->addr.back() + "/24 dev " + ifn,
            "ip -n " + name + " link set " + ifn + " up", "ip -n " + name + " link set lo up",
            "ip netns exec " + name + " true"})  // entering one works too (mounts /sys)
        steps.push_back(step);
    }
    for (const auto& step : steps) {
      std::string out;
      if (shell(step, &out) != 0) {
        *why = "cannot create network namespaces ('" + step + "' failed: " + out +
               "); run as root with the ip tool to test across namespaces";
        net->teardown();  // the destructor would too; this keeps the failure path explicit
        // A veth pair not yet moved into a namespace lives in ours: remove it.
        for (const auto& ifn : net->ifname) shell("ip link del " + ifn);
        return nullptr;
      }
    }
    return net;
  }

  ~NetnsNodes() { teardown(); }
  NetnsNodes(const NetnsNodes&) = delete;
  NetnsNodes& operator=(const NetnsNodes&) = delete;

  /// The command prefix that runs a program inside node i's namespace.
  std::vector<std::string> exec_prefix(int i) const { return {"ip", "netns", "exec", ns[i]}; }

  /// Kills every process in the namespaces, then deletes them. Idempotent.
  void teardown() {
    for (const auto& n : ns) {
      kill_all_in(n);
      shell("ip netns del " + n);
    }
    if (!switch_ns.empty()) shell("ip netns del " + switch_ns);
    ns.clear();
    switch_ns.clear();
  }

 private:
  NetnsNodes() = default;

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
