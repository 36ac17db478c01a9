#include <ember/launcher/trace_merge.h>

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <stdexcept>
#include <vector>

namespace ember::launcher {

namespace fs = std::filesystem;

namespace {

fs::path rank_file(const std::string& dir, int rank) {
  return fs::path(dir) / ("trace_rank" + std::to_string(rank) + ".json");
}

// One rank's file in the recorder's layout: a header line ending in "traceEvents":[, one event
// per line (each but the last ending in ','), then "]}". Appends its events to `events` and
// returns its otherData object.
std::string read_rank_file(const fs::path& path, std::vector<std::string>& events) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error("cannot read " + path.string());
  std::string header;
  std::getline(f, header);
  const std::string key = "\"otherData\":";
  const size_t from = header.find(key);
  const size_t to = header.rfind(",\"traceEvents\":[");
  if (from == std::string::npos || to == std::string::npos || to < from)
    throw std::runtime_error(path.string() + " is not a trace file of Ember's recorder (its "
                             "first line has no otherData and traceEvents)");
  std::string line;
  bool closed = false;
  while (std::getline(f, line)) {
    if (line == "]}") {
      closed = true;
      break;
    }
    if (!line.empty() && line.back() == ',') line.pop_back();
    events.push_back(std::move(line));
  }
  if (!closed) throw std::runtime_error(path.string() + " ends before its closing \"]}\"");
  return header.substr(from + key.size(), to - from - key.size());
}

}  // namespace

std::map<int, fs::file_time_type> list_rank_traces(const std::string& dir) {
  std::map<int, fs::file_time_type> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("trace_rank", 0) != 0 || entry.path().extension() != ".json") continue;
    // Only the names the recorder writes: "trace_rank07.json" would be read as rank 7's, whose
    // file is another, and a number past int's range threw out of emberrun.
    const std::string digits = name.substr(10, name.size() - 10 - 5);
    if (digits.empty() || digits.size() > 9 ||
        digits.find_first_not_of("0123456789") != std::string::npos ||
        (digits.size() > 1 && digits[0] == '0')) {
      continue;
    }
    out[std::stoi(digits)] = entry.last_write_time(ec);
  }
  return out;
}

int merge_rank_traces(const std::string& dir, const std::map<int, fs::file_time_type>& before) {
  std::vector<std::string> events, ranks;
  for (const auto& [rank, time] : list_rank_traces(dir)) {
    auto old = before.find(rank);
    if (old != before.end() && old->second == time) continue;
    ranks.push_back(read_rank_file(rank_file(dir, rank), events));
  }
  if (ranks.empty()) return 0;
  const fs::path path = fs::path(dir) / "trace.json";
  // A temp name of its own (mkstemp: O_EXCL), not one from the pid: the folder may be shared by
  // the nodes, where each node's emberrun merges at its end and pids repeat across hosts.
  std::string name = path.string() + ".tmp.XXXXXX";
  const int fd = ::mkstemp(name.data());
  if (fd < 0) throw std::runtime_error("cannot create a temp file beside " + path.string());
  (void)::fchmod(fd, 0644);  // mkstemp's 0600 would keep the merged file from the others
  ::close(fd);
  const fs::path tmp = name;
  std::error_code ec;
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"ranks\":[";
    for (size_t i = 0; i < ranks.size(); ++i) f << (i ? "," : "") << ranks[i];
    f << "]},\"traceEvents\":[\n";
    for (size_t i = 0; i < events.size(); ++i) f << (i ? ",\n" : "") << events[i];
    f << "\n]}\n";
    f.flush();
    if (!f) {
      fs::remove(tmp, ec);
      throw std::runtime_error("cannot write " + tmp.string());
    }
  }
  fs::rename(tmp, path, ec);
  if (ec) {
    fs::remove(tmp, ec);
    throw std::runtime_error("cannot rename " + tmp.string() + " to " + path.string());
  }
  return static_cast<int>(ranks.size());
}

}  // namespace ember::launcher
