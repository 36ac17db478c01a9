// Inputs the launcher_config fuzz target (fuzz/launcher_config_fuzzer.cpp) found to break
// parse_args, each kept as a case here so the fix stays (docs/reliability.md).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <string>
#include <vector>

#include <ember/launcher/config.h>

namespace ember::launcher {
namespace {

// parse_args must refuse `args` with a UsageError whose message contains `names`.
void expect_usage_error(const std::vector<std::string>& args, const std::string& names) {
  try {
    const LaunchConfig c = parse_args(args);
    ADD_FAILURE() << "accepted, program '" << c.program << "'";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find(names), std::string::npos) << e.what();
  }
}

class LauncherFuzzRegression : public ::testing::Test {
 protected:
  void SetUp() override { unsetenv("EMBER_NPROC_PER_NODE"); }
};

// The empty input: one empty argument was taken as the program, and the agent would later
// fail to exec "" with a message that names no option.
TEST_F(LauncherFuzzRegression, EmptyProgramIsAUsageError) {
  expect_usage_error({""}, "PROGRAM");
  expect_usage_error({"--nproc-per-node", "2", ""}, "PROGRAM");
  expect_usage_error({"--", ""}, "PROGRAM");
}

// --nnodes 65536 --nproc-per-node 65536 passed every range check, and LaunchConfig::world_size()
// then overflowed int (UBSan: signed integer overflow), giving the workers a negative or
// wrapped WORLD_SIZE.
TEST_F(LauncherFuzzRegression, WorldSizeThatOverflowsIntIsAUsageError) {
  expect_usage_error({"--nnodes", "65536", "--nproc-per-node", "65536", "prog"}, "--nnodes");
  expect_usage_error({"--nnodes", "1:65536", "--nproc-per-node", "32768", "prog"}, "ranks");
  const LaunchConfig c = parse_args({"--nnodes", "2", "--nproc-per-node", "65536", "prog"});
  EXPECT_EQ(c.world_size(), 131072);
}

}  // namespace
}  // namespace ember::launcher
