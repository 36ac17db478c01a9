// emberrun: torchrun's interface for C++ programs. See docs/launcher.md.
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "launcher/agent.h"
#include "launcher/config.h"

int main(int argc, char** argv) {
  using namespace ember::launcher;
  std::vector<std::string> args(argv + 1, argv + argc);
  LaunchConfig config;
  try {
    config = parse_args(args);
    for (const auto& n : config.notices) std::fprintf(stderr, "emberrun: %s\n", n.c_str());
  } catch (const HelpRequested& h) {
    std::fputs(h.what(), stdout);
    return 0;
  } catch (const UsageError& e) {
    std::fprintf(stderr, "emberrun: error: %s\nRun 'emberrun --help' for the options.\n",
                 e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "emberrun: error: %s\n", e.what());
    return 1;
  }
  try {
    return LocalAgent(std::move(config)).run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "emberrun: error: %s\n", e.what());
    return 1;
  }
}
