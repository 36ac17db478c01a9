// emberrun: torchrun's interface for C++ programs. See docs/launcher.md.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include <ember/launcher/agent.h>
#include <ember/launcher/config.h>
#include <ember/launcher/trace_merge.h>
#include <ember/tensor/observe/trace.h>

namespace {

// EMBER_TRACE=DIR: the workers inherit it and each writes DIR/trace_rank<R>.json at exit;
// emberrun merges the files its job wrote into DIR/trace.json, whether the job succeeded or not.
void merge_traces(const char* dir,
                  const std::map<int, std::filesystem::file_time_type>& before) {
  try {
    const int n = ember::launcher::merge_rank_traces(dir, before);
    if (n > 0)
      std::fprintf(stderr, "emberrun: timeline of %d rank%s in %s/trace.json\n", n,
                   n == 1 ? "" : "s", dir);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "emberrun: EMBER_TRACE: cannot merge the ranks' traces: %s\n",
                 e.what());
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace ember::launcher;
  ember::trace::discard();  // the recorder EMBER_TRACE started here: emberrun is no rank
  const char* trace_dir = std::getenv("EMBER_TRACE");
  if (trace_dir != nullptr && *trace_dir == '\0') trace_dir = nullptr;
  const auto traces_before =
      trace_dir ? list_rank_traces(trace_dir) : std::map<int, std::filesystem::file_time_type>{};
  std::vector<std::string> args(argv + 1, argv + argc);
  LaunchConfig config;
  try {
    config = parse_args(args);
    for (const auto& n : config.notices) std::fprintf(stderr, "emberrun: %s\n", n.c_str());
    // EMBER_CHECK_ARGS=1: the command line is parsed and nothing is launched (how
    // scripts/check_doc_commands.py checks the commands the docs show).
    if (const char* check = std::getenv("EMBER_CHECK_ARGS"); check && std::string(check) == "1") {
      std::printf("emberrun: arguments ok\n");
      return 0;
    }
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
  int rc = 1;
  try {
    rc = LocalAgent(std::move(config)).run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "emberrun: error: %s\n", e.what());
  }
  if (trace_dir) merge_traces(trace_dir, traces_before);
  return rc;
}
