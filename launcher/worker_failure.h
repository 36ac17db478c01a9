// How a worker ended, as the agent reports it: the record of one failed worker, its error file,
// and the summary printed when the group fails for good. Shared by the worker group, which
// records failures, and the agent, which reports them.
#pragma once

#include <string>
#include <vector>

namespace ember::launcher {

/// How one worker ended (or, for the group, the first failure observed).
struct WorkerFailure {
  int rank = -1;         // global rank
  int local_rank = -1;
  int pid = -1;
  int exit_code = 0;     // exit status when it exited, else 0
  int signal = 0;        // the signal that killed it, else 0
  std::string time;      // when the agent noticed, local time "YYYY-MM-DD HH:MM:SS"
  std::string error_file;        // the path given to the worker
  std::string error_message;     // from the error file, "" if none was written
  std::string error_where;       // from the error file
  std::vector<std::string> log_tail;  // the worker's last output lines (both streams)
};

/// "rank 3 exited with code 1" / "rank 3 was killed by SIGKILL".
std::string describe_exit(const WorkerFailure& f);

/// Reads a worker's error file. Accepts Ember's {"message": "...", "where": "..."} and
/// torch's {"message": {"message": "...", "extraInfo": {"py_callstack": "..."}}}. Returns
/// false (leaving the fields alone) when the file is missing or unreadable as JSON.
bool read_error_file(const std::string& path, std::string* message, std::string* where);

/// The multi-line summary printed when the group fails for good: the first failed rank, its
/// exit code or signal, the error file's message and where, and its log tail; then the other
/// ranks that failed on their own.
std::string format_failure_summary(const std::string& program,
                                   const std::vector<WorkerFailure>& failures);

}  // namespace ember::launcher
