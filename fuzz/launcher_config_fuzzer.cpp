// Fuzzes emberrun's option parsing: parse_args over a command line and EMBER_* / PET_*
// variables. Any input must either give a LaunchConfig or throw UsageError / HelpRequested; a
// crash, a sanitizer report (UBSan included: integer overflow in the sizes derived from the
// options) or another exception is a finding. A config that parses is used as the agent uses
// it (world_size, the rendezvous address) and checked against the documented ranges.
//
// Input: lines. A line "EMBER_NAME=value" or "PET_NAME=value" sets that variable for this input
// only; every other line is one argument.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <ember/launcher/config.h>

extern char** environ;

namespace {

bool is_launcher_var(const std::string& line) {
  return (line.rfind("EMBER_", 0) == 0 || line.rfind("PET_", 0) == 0) &&
         line.find('=') != std::string::npos;
}

// Unsets every EMBER_* and PET_* variable, so that an input means the same in any environment.
void clear_launcher_vars() {
  std::vector<std::string> names;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    if (is_launcher_var(kv)) names.push_back(kv.substr(0, kv.find('=')));
  }
  for (const auto& n : names) ::unsetenv(n.c_str());
}

void check(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "launcher_config_fuzzer: parse_args accepted a config with %s\n", what);
  std::abort();
}

void check_config(const ember::launcher::LaunchConfig& c) {
  check(c.min_nodes >= 1 && c.min_nodes <= c.max_nodes, "nnodes out of range");
  check(c.nproc_per_node >= 1, "nproc_per_node < 1");
  check(c.world_size() >= c.nproc_per_node, "a world size below nproc_per_node");
  check(c.node_rank >= 0 && c.node_rank < c.max_nodes, "node_rank out of range");
  check(c.master_port >= 1 && c.master_port <= 65535, "master_port out of range");
  check(c.redirects.size() == static_cast<size_t>(c.nproc_per_node) &&
            c.tee.size() == static_cast<size_t>(c.nproc_per_node),
        "redirects/tee not per local rank");
  check(!c.program.empty(), "no program");
  if (c.multi_node()) {
    const auto [host, port] = c.rdzv_host_port();
    check(!host.empty() && port >= 1 && port <= 65535, "a bad rendezvous address");
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  clear_launcher_vars();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> args;
  std::vector<std::string> set;
  const std::string text(reinterpret_cast<const char*>(data), size);
  size_t at = 0;
  while (at <= text.size()) {
    size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(at, end - at);
    at = end + 1;
    if (line.find('\0') != std::string::npos) continue;  // no such argument or variable exists
    if (is_launcher_var(line)) {
      const size_t eq = line.find('=');
      const std::string name = line.substr(0, eq);
      ::setenv(name.c_str(), line.c_str() + eq + 1, 1);
      set.push_back(name);
    } else {
      args.push_back(std::move(line));
    }
  }
  try {
    check_config(ember::launcher::parse_args(args));
  } catch (const ember::launcher::UsageError&) {
  } catch (const ember::launcher::HelpRequested&) {
  }
  for (const auto& n : set) ::unsetenv(n.c_str());
  return 0;
}
