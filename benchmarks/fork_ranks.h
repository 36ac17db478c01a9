// Ranks as forked processes for the distributed benchmarks, joined as torchrun's would be.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include <ember/distributed/store/tcp_store.h>

namespace bench {

/// Forks `n` ranks with RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT (a port the OS
/// picked) set, so each may call init_process_group({}); runs body(rank) there, its result the
/// rank's exit code (an exception is printed naming `who` and the rank, and exits 1); waits for
/// every rank. Returns 0 if every rank exited 0.
inline int fork_ranks(const char* who, int n, const std::function<int(int rank)>& body) {
  uint16_t port = 0;
  {
    ember::dist::TCPStoreServerOptions so;
    so.host = "127.0.0.1";
    ember::dist::TCPStoreServer probe(so);  // the OS's pick, released for rank 0's own server
    port = probe.port();
  }
  std::vector<pid_t> kids;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(n).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      int rc = 1;
      try {
        rc = body(r);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "%s: rank %d: %s\n", who, r, e.what());
      }
      std::fflush(stdout);
      ::_exit(rc);
    }
    kids.push_back(pid);
  }
  int rc = 0;
  for (pid_t pid : kids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) rc = 1;
  }
  return rc;
}

}  // namespace bench
