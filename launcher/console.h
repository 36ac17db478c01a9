// emberrun's own output on its console: its "emberrun: ..." lines, writes that survive a reader
// that went away, and the names of signals in its messages. Used by every part of the launcher;
// depends on none of them.
#pragma once

#include <string>

namespace ember::launcher {

/// Writes "emberrun: <s>\n" to stderr (dropped if stderr is gone).
void log_line(const std::string& s);

/// Writes all of `s` to `fd`, retrying short writes and EINTR; drops the rest when the reader is
/// gone (EPIPE: SIGPIPE is ignored while the agent runs).
void write_all(int fd, const std::string& s);

/// "SIGTERM", or "signal N" for a signal without a name.
std::string signal_name(int sig);

}  // namespace ember::launcher
