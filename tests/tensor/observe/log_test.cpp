// ember::log: the threshold (EMBER_LOG_LEVEL, set_level), the rank prefix, and that lines reach
// stderr whole. stderr is redirected to a file around each check.
#include <ember/tensor/observe/log.h>

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>

#include "tests/tensor/test_util.h"

namespace ember {
namespace {

/// What `body` wrote to stderr.
std::string capture_stderr(const std::function<void()>& body) {
  char path[] = "/tmp/ember_log_test_XXXXXX";
  const int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  std::fflush(stderr);
  const int saved = dup(2);
  dup2(fd, 2);
  body();
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  close(fd);
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  unlink(path);
  return ss.str();
}

struct RestoreLevel {
  logging::Level saved = logging::level();
  ~RestoreLevel() {
    logging::set_level(saved);
    logging::set_rank(-1);
  }
};

TEST(Log, ParsesEveryLevelNameAndRefusesOthers) {
  EXPECT_EQ(logging::parse_level("trace"), logging::Level::Trace);
  EXPECT_EQ(logging::parse_level("DEBUG"), logging::Level::Debug);
  EXPECT_EQ(logging::parse_level("info"), logging::Level::Info);
  EXPECT_EQ(logging::parse_level("warn"), logging::Level::Warn);
  EXPECT_EQ(logging::parse_level("Warning"), logging::Level::Warn);
  EXPECT_EQ(logging::parse_level("error"), logging::Level::Error);
  EXPECT_EQ(logging::parse_level("off"), logging::Level::Off);
  test::expect_error<ValueError>([] { logging::parse_level("loud"); },
                                 {"[EMBER_LOG_LEVEL] expected trace, debug, info, warn, error or off",
                                  "got 'loud'"});
}

TEST(Log, ThresholdDropsLowerLevels) {
  RestoreLevel restore;
  logging::set_level(logging::Level::Warn);
  const std::string out = capture_stderr([] {
    logging::info("not shown");
    logging::warn("shown ", 1);
    logging::error("shown ", 2);
  });
  EXPECT_EQ(out.find("not shown"), std::string::npos) << out;
  EXPECT_NE(out.find("[warning] shown 1\n"), std::string::npos) << out;
  EXPECT_NE(out.find("[error] shown 2\n"), std::string::npos) << out;
  logging::set_level(logging::Level::Off);
  EXPECT_EQ(capture_stderr([] { logging::error("silenced"); }), "");
}

TEST(Log, RankPrefixOnceSet) {
  RestoreLevel restore;
  logging::set_level(logging::Level::Info);
  logging::set_rank(3);
  std::string out = capture_stderr([] { logging::info("hello"); });
  EXPECT_NE(out.find("[info] [rank 3] hello\n"), std::string::npos) << out;
  logging::set_rank(-1);
  out = capture_stderr([] { logging::info("bye"); });
  EXPECT_EQ(out.find("[rank"), std::string::npos) << out;
  EXPECT_NE(out.find("[info] bye\n"), std::string::npos) << out;
}

// Run as a child by the next case only: logs at two levels in a fresh process.
TEST(LogChild, LogsAWarningAndAnError) {
  if (std::getenv("EMBER_LOG_TEST_CHILD") == nullptr) GTEST_SKIP() << "run by EnvironmentSets...";
  logging::warn("child warn");
  logging::error("child error");
}

// LogChild's output in a fresh process with EMBER_LOG_LEVEL=`level`; fails unless it exits 0.
std::string run_child(const std::string& level) {
  const std::string cmd = "EMBER_LOG_LEVEL=" + level + " EMBER_LOG_TEST_CHILD=1 /proc/" +
                          std::to_string(getpid()) + "/exe --gtest_filter=LogChild.* 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  EXPECT_NE(p, nullptr);
  if (p == nullptr) return "";
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  EXPECT_EQ(pclose(p), 0) << out;
  return out;
}

// EMBER_LOG_LEVEL is read at the first use: a fresh process with it set shows only errors.
TEST(Log, EnvironmentSetsTheThresholdOfAFreshProcess) {
  const std::string out = run_child("error");
  EXPECT_EQ(out.find("child warn"), std::string::npos) << out;
  EXPECT_NE(out.find("[error] child error"), std::string::npos) << out;
}

// A value it cannot read is reported once, and logging goes on at info: every log call threw
// before, so a failure path that logs (a timed-out collective's) terminated the process.
TEST(Log, AnUnknownLevelIsReportedOnceAndInfoIsKept) {
  const std::string out = run_child("verbose");
  const std::string said =
      "[EMBER_LOG_LEVEL] expected trace, debug, info, warn, error or off, "
      "got 'verbose'; logging at info";
  const size_t at = out.find(said);
  EXPECT_NE(at, std::string::npos) << out;
  EXPECT_EQ(out.find(said, at + 1), std::string::npos) << "reported twice: " << out;
  EXPECT_NE(out.find("[warning] child warn"), std::string::npos) << out;
  EXPECT_NE(out.find("[error] child error"), std::string::npos) << out;
}

}  // namespace
}  // namespace ember
