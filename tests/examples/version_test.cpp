// Every program says which Ember it is (--version, exit 0) and the library agrees with the
// headers; minimal_ddp's one argument is checked (--help does not train); docs/quickstart.md
// shows minimal_ddp.cpp as it is.
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <ember/tensor/version.h>
#include "cmake/build_paths.h"
#include "tests/examples/example_test_util.h"

namespace ember {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(Version, TheLibraryIsTheHeaders) {
  EXPECT_STREQ(version(), EMBER_VERSION);
  EXPECT_EQ(std::string(EMBER_VERSION),
            std::to_string(EMBER_VERSION_MAJOR) + "." + std::to_string(EMBER_VERSION_MINOR) + "." +
                std::to_string(EMBER_VERSION_PATCH));
}

// Every program built in examples/ (found, so a new one is covered) and emberrun: --version
// prints the version, --help its usage, both with status 0 and without running anything.
TEST(Version, EveryProgramPrintsItAndItsHelp) {
  const std::string bin = EMBER_BINARY_DIR;
  std::vector<std::string> programs{"launcher/emberrun"};
  for (const auto& e : std::filesystem::directory_iterator(bin + "/examples")) {
    if (e.is_regular_file() && access(e.path().c_str(), X_OK) == 0) {
      programs.push_back("examples/" + e.path().filename().string());
    }
  }
  ASSERT_GE(programs.size(), 8u) << "the examples were not found in " << bin << "/examples";
  for (const std::string& program : programs) {
    const std::string name = program.substr(program.find('/') + 1);
    auto r = test::run_command(bin + "/" + program + " --version", 30);
    EXPECT_EQ(r.status, 0) << program << "\n" << r.output;
    EXPECT_EQ(r.output, name + " (Ember) " EMBER_VERSION "\n") << program;
    r = test::run_command(bin + "/" + program + " --help", 30);
    EXPECT_EQ(r.status, 0) << program << " --help\n" << r.output;
    EXPECT_NE(r.output.find(name), std::string::npos) << program << " --help names it\n" << r.output;
  }
}

TEST(Version, MinimalDdpChecksItsArgument) {
  const std::string minimal = std::string(EMBER_BINARY_DIR) + "/examples/minimal_ddp";
  auto r = test::run_command(minimal + " --help", 30);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output, "usage: minimal_ddp [EPOCHS] (3)\n");
  for (const char* bad : {"two", "-1", "3x", "100000"}) {
    r = test::run_command(minimal + " " + bad, 30);
    EXPECT_EQ(r.status, 2) << bad << "\n" << r.output;
    EXPECT_NE(r.output.find(std::string("EPOCHS must be an integer in [0, 1000], got '") + bad),
              std::string::npos)
        << r.output;
  }
}

// The loop docs/quickstart.md prints is examples/minimal_ddp.cpp, its header comment aside.
TEST(Version, QuickstartShowsMinimalDdpAsItIs) {
  const std::string doc = read_file(std::string(EMBER_SOURCE_DIR) + "/docs/quickstart.md");
  std::string src = read_file(std::string(EMBER_SOURCE_DIR) + "/examples/minimal_ddp.cpp");
  src = src.substr(src.find("#include"));
  EXPECT_NE(doc.find("```cpp\n" + src + "```"), std::string::npos)
      << "docs/quickstart.md's loop differs from examples/minimal_ddp.cpp";
}

}  // namespace
}  // namespace ember
