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

namespace ember::test {

/// A unique folder under the system's temp dir, removed (with its contents) at the end even when
/// the test fails.
struct TempDir {
  std::string path;
  explicit TempDir(const char* prefix = "ember_example_test") {
    std::string t = (std::filesystem::temp_directory_path() / (std::string(prefix) + "_XXXXXX")).string();
    EXPECT_NE(mkdtemp(t.data()), nullptr) << std::strerror(errno);
    path = t;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string operator/(const std::string& name) const { return path + "/" + name; }
  /// The names in the folder, sorted.
  std::vector<std::string> list() const {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(path))
      names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }
};

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
