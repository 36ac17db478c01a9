// What the example tests share: a temporary folder and running a command line as a user would.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "tests/temp_dir.h"

namespace ember::test {

struct CommandResult {
  int status = -1;     // exit status, or 128 + signal
  std::string output;  // stdout and stderr together
};

/// Runs a shell command line under coreutils' timeout (SIGTERM after limit_s, SIGKILL 10 s
/// later; emberrun then stops its workers) and returns its status and output.
inline CommandResult run_command(const std::string& cmd, int limit_s) {
  CommandResult r;
  const std::string full = "timeout -k 10 " + std::to_string(limit_s) + " " + cmd + " 2>&1";
  FILE* p = popen(full.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  const int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

}  // namespace ember::test
