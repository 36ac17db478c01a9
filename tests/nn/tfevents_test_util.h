// Reading TensorBoard event files back in tests through the independent Python reader,
// tests/nn/tfevents_reader.py (framing, both CRCs, Event decoding), run with /usr/bin/python3.
#pragma once

#include <gtest/gtest.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cmake/build_paths.h"

namespace ember::test {

/// Whether /usr/bin/python3 can import the reader's packages (checked once).
inline bool tfevents_reader_available() {
  static const bool ok =
      ::access("/usr/bin/python3", X_OK) == 0 &&
      std::system("/usr/bin/python3 -c 'import crc32c, google.protobuf' >/dev/null 2>&1") == 0;
  return ok;
}

/// Skips the test (saying what to install) unless the reader can run.
#define EMBER_REQUIRE_TFEVENTS_READER()                                                  \
  if (!::ember::test::tfevents_reader_available())                                       \
  GTEST_SKIP() << "/usr/bin/python3 with python3-protobuf and python3-crc32c is needed " \
                  "to read event files back (scripts/install-deps.sh installs them)"

struct TfeventsResult {
  int status = -1;           // the reader's exit status (1: a broken file)
  std::string error_output;  // what it printed on stderr
  nlohmann::json events;     // {path: [event, ...]} when status is 0
};

/// Runs the reader on `paths` (event files, or folders searched recursively).
inline TfeventsResult run_tfevents_reader(const std::vector<std::string>& paths) {
  TfeventsResult r;
  const std::string script =
      (std::filesystem::path(EMBER_SOURCE_DIR) / "tests/nn/tfevents_reader.py").string();
  char err_path[] = "/tmp/tfevents_reader_stderr_XXXXXX";
  const int fd = ::mkstemp(err_path);
  if (fd < 0) return r;
  ::close(fd);
  std::string cmd = "/usr/bin/python3 '" + script + "'";
  for (const auto& p : paths) cmd += " '" + p + "'";
  cmd += std::string(" 2>'") + err_path + "'";
  std::string out;
  if (FILE* p = ::popen(cmd.c_str(), "r")) {
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
    const int st = ::pclose(p);
    r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  }
  if (FILE* e = std::fopen(err_path, "r")) {
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, e)) > 0;) r.error_output.append(buf, n);
    std::fclose(e);
  }
  std::filesystem::remove(err_path);
  if (r.status == 0) r.events = nlohmann::json::parse(out, nullptr, /*allow_exceptions=*/false);
  return r;
}

/// The reader's events of `paths`; fails the test (with the reader's message) when it fails.
inline nlohmann::json read_tfevents(const std::vector<std::string>& paths) {
  TfeventsResult r = run_tfevents_reader(paths);
  EXPECT_EQ(r.status, 0) << "tfevents_reader.py failed: " << r.error_output;
  EXPECT_FALSE(r.events.is_discarded()) << "tfevents_reader.py printed no JSON";
  return r.status == 0 ? r.events : nlohmann::json::object();
}

}  // namespace ember::test
