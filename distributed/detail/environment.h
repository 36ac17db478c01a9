// Reading the environment for init_process_group, its init methods and the backends' factories
// (EMBER_GLOO_THREADS, ...): one parser, one way of echoing what was found in errors. Internal.
#pragma once

#include <map>
#include <optional>
#include <string>

#include <ember/distributed/errors.h>

namespace ember::dist::detail {

using Environment = std::map<std::string, std::string>;

/// A snapshot of this process's environment.
Environment environment();

/// `value` (of `name`) as an integer in [lo, hi]; throws ValueError "[init_process_group]
/// name='value' is not an integer (found)" or "... is out of range [lo, hi] (found)".
int parse_int(const std::string& name, const std::string& value, int lo, int hi,
              const std::string& found);

/// The integer in environment variable `name`, in [lo, hi]; nullopt when unset or empty.
/// `meaning` ("1: ..., 0: ...") goes into the error for a bad value.
std::optional<int> int_from_env(const char* name, int lo, int hi, const char* meaning);

/// Whether `name` is set to something non-empty in `env`.
bool env_set(const Environment& env, const char* name);

/// The launcher variables found in `env`, for errors: "found RANK=1, WORLD_SIZE=2", or which
/// were looked for when none is set.
std::string echo(const Environment& env);

/// Throws ValueError naming `where` unless size >= 1 and 0 <= rank < size.
void check_rank_size(int rank, int size, const std::string& where);

}  // namespace ember::dist::detail
