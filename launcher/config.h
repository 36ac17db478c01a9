// Reading emberrun's settings (launcher/launch_config.h): the command line (torchrun's options),
// their EMBER_* variables and torchrun's PET_* ones; and the small helpers they need.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ember/launcher/launch_config.h>

namespace ember::launcher {

/// A bad command line or EMBER_* value; main() prints it with the usage hint and exits 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// --help was given: what() is the help text; main() prints it and exits 0.
class HelpRequested : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Parses emberrun's command line (argv[0] excluded). An option not on the command line is
/// read from its EMBER_* variable (EMBER_NPROC_PER_NODE, EMBER_MASTER_PORT, ...), else, for
/// torchrun's options, from torchrun's PET_* one (PET_NPROC_PER_NODE, ...), else takes its
/// default. --rdzv-conf keys override the options they map onto unless those come from a
/// stronger source (command line > EMBER_* > PET_*); given at the same level with different
/// values they are an error. Throws UsageError naming the option and the offending value, or
/// HelpRequested.
LaunchConfig parse_args(const std::vector<std::string>& args);

/// Parses a --redirects/--tee value for `nproc` local ranks: "3" (all ranks) or "0:3,1:1"
/// (per local rank; ranks not named get 0). Throws UsageError naming `option`.
std::vector<StreamMask> parse_std_spec(const std::string& option, const std::string& value,
                                       int nproc);

/// The number of CPUs this process may run on (sched_getaffinity), at least 1.
int available_cpus();

/// A TCP port on which nothing listens now (bound with port 0 and released): what --standalone
/// uses (on 127.0.0.1) and what node 0 picks for MASTER_PORT across nodes (any_address: on
/// every interface). Racy by nature, as torch's. Throws std::runtime_error on failure.
int pick_free_port(bool any_address = false);

/// Splits "host", "host:port", "[v6]:port" or "[v6]"; port is `default_port` when absent.
/// Throws UsageError naming `option` for an empty host or a bad port.
std::pair<std::string, int> split_host_port(const std::string& option, const std::string& value,
                                            int default_port);

}  // namespace ember::launcher
