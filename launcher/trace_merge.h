// emberrun's end-of-job step under EMBER_TRACE=DIR: merges the ranks' timelines
// (DIR/trace_rank<R>.json, written by tensor/observe/trace.h at each rank's exit, timestamps
// already on rank 0's clock) into DIR/trace.json, one process row per rank.
#pragma once

#include <filesystem>
#include <map>
#include <string>

namespace ember::launcher {

/// The trace_rank<R>.json files in `dir` and their modification times, by rank.
std::map<int, std::filesystem::file_time_type> list_rank_traces(const std::string& dir);

/// Merges the rank files in `dir` that are not in `before` with the same time (so that files
/// an earlier job left are not mixed in) into dir/trace.json, written atomically (a temp file
/// renamed over it). Returns the number of ranks merged (0: nothing written). Throws
/// std::runtime_error naming the file when one cannot be read or is not in the recorder's layout.
int merge_rank_traces(const std::string& dir,
                      const std::map<int, std::filesystem::file_time_type>& before = {});

}  // namespace ember::launcher
