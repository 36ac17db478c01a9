// Ember's one logger: what the library reports on its own (a stuck MPI worker at exit, a dropped
// store connection, DDP's bucket layout when asked, an exception a callback swallowed) goes here,
// never to stdout. Lines go to stderr as "[HH:MM:SS.mmm] [level] [rank R] message" (the rank
// once distributed::init_process_group has set it), through spdlog, which stays out of this
// header. The threshold is EMBER_LOG_LEVEL (trace, debug, info, warn, error, off; default
// info), read at the first use; set_level overrides it. Thread-safe.
#pragma once

#include <string>
#include <string_view>

#include <ember/tensor/error.h>

namespace ember::logging {

enum class Level { Trace, Debug, Info, Warn, Error, Off };

/// The current threshold: messages below it are dropped without being formatted.
Level level();
/// Overrides EMBER_LOG_LEVEL for the rest of the process.
void set_level(Level level);
/// Parses "trace", "debug", "info", "warn"/"warning", "error", "off" (any case); throws
/// ValueError naming EMBER_LOG_LEVEL and the accepted names otherwise.
Level parse_level(std::string_view name);
/// Adds "[rank R]" to every later line (R < 0 removes it).
void set_rank(int rank);
/// Writes one line at `level` if the threshold lets it through.
void write(Level level, std::string_view message);

inline bool enabled(Level l) { return l >= level() && l != Level::Off; }

template <typename... Args> void debug(const Args&... args) {
  if (enabled(Level::Debug)) write(Level::Debug, detail::str_cat(args...));
}
template <typename... Args> void info(const Args&... args) {
  if (enabled(Level::Info)) write(Level::Info, detail::str_cat(args...));
}
template <typename... Args> void warn(const Args&... args) {
  if (enabled(Level::Warn)) write(Level::Warn, detail::str_cat(args...));
}
template <typename... Args> void error(const Args&... args) {
  if (enabled(Level::Error)) write(Level::Error, detail::str_cat(args...));
}

}  // namespace ember::logging
