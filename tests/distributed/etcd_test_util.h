// A private etcd server for one test: Debian's etcd-server (/usr/bin/etcd) on free loopback
// ports with its data in a fresh temporary directory, killed and removed on destruction.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ember/distributed/etcd_store.h>
#include "tests/distributed/store_test_util.h"

extern char** environ;

namespace ember::test {

inline constexpr const char* kEtcdBinary = "/usr/bin/etcd";

/// "" when an etcd server can be started here, else why not (for GTEST_SKIP).
inline std::string etcd_unavailable_reason() {
  if (::access(kEtcdBinary, X_OK) == 0) return "";
  return std::string(kEtcdBinary) +
         " is missing: install Debian's etcd-server (scripts/install-deps.sh does)";
}

/// One etcd server, started by the constructor and ready when it returns (a store answered
/// within 60 s, else std::runtime_error with the end of etcd's log). It spawns no thread in this
/// process, so Children may still fork after it.
class EtcdServer {
 public:
  EtcdServer() {
    for (int attempt = 0;; ++attempt) {
      if (start()) return;
      stop();
      // A port picked by unused_port() may have been taken before etcd bound it: try new ones.
      if (attempt == 2) throw std::runtime_error("etcd did not start; its log:\n" + log_tail());
    }
  }
  ~EtcdServer() { stop(); }
  EtcdServer(const EtcdServer&) = delete;
  EtcdServer& operator=(const EtcdServer&) = delete;

  /// "127.0.0.1:<client port>".
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(client_port_); }

  /// SIGKILLs etcd now and reaps it (idempotent).
  void stop() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }

  /// The last lines of etcd's own log.
  std::string log_tail() const {
    std::ifstream in(dir_.file("etcd.log"));
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string all = ss.str();
    return all.size() > 4000 ? all.substr(all.size() - 4000) : all;
  }

 private:
  bool start() {
    client_port_ = unused_port();
    uint16_t peer = unused_port();
    while (peer == client_port_) peer = unused_port();
    const std::string client = "http://127.0.0.1:" + std::to_string(client_port_);
    const std::string peer_url = "http://127.0.0.1:" + std::to_string(peer);
    const std::string data = dir_.file("data-" + std::to_string(client_port_));
    // --max-request-bytes: the store tests' 3 MiB value travels as 4 MiB of base64.
    std::vector<std::string> args = {kEtcdBinary,
                                     "--name=ember-test",
                                     "--data-dir=" + data,
                                     "--listen-client-urls=" + client,
                                     "--advertise-client-urls=" + client,
                                     "--listen-peer-urls=" + peer_url,
                                     "--initial-advertise-peer-urls=" + peer_url,
                                     "--initial-cluster=ember-test=" + peer_url,
                                     "--max-request-bytes=16777216",
                                     "--logger=zap",
                                     "--log-level=warn"};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    ::posix_spawn_file_actions_init(&actions);
    const std::string log = dir_.file("etcd.log");
    ::posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND,
                                       0644);
    ::posix_spawn_file_actions_adddup2(&actions, 1, 2);
    ::posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
    const int rc = ::posix_spawn(&pid_, kEtcdBinary, &actions, nullptr, argv.data(), environ);
    ::posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) throw std::runtime_error("posix_spawn " + std::string(kEtcdBinary) + " failed");
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (std::chrono::steady_clock::now() < deadline) {
      if (::waitpid(pid_, nullptr, WNOHANG) == pid_) {
        pid_ = -1;
        return false;  // exited (a port in use, say)
      }
      try {
        dist::EtcdStoreOptions o;
        o.timeout = std::chrono::milliseconds(500);
        dist::EtcdStore probe(endpoint(), o);
        return true;
      } catch (const dist::DistError&) {
        // not up yet; the probe's own connect retries paced this loop
      }
    }
    return false;
  }

  TempDir dir_;
  pid_t pid_ = -1;
  uint16_t client_port_ = 0;
};

}  // namespace ember::test
