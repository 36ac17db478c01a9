#include <ember/launcher/worker_failure.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include <ember/launcher/console.h>

namespace ember::launcher {

std::string describe_exit(const WorkerFailure& f) {
  return "rank " + std::to_string(f.rank) + " " +
         (f.signal ? "was killed by " + signal_name(f.signal)
                   : "exited with code " + std::to_string(f.exit_code));
}

bool read_error_file(const std::string& path, std::string* message, std::string* where) {
  std::ifstream in(path);
  if (!in) return false;
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return false;
  auto text = [](const nlohmann::json& v) {
    return v.is_string() ? v.get<std::string>() : v.dump();
  };
  if (j.contains("message") && j["message"].is_object()) {  // torch's layout
    const auto& m = j["message"];
    if (m.contains("message")) *message = text(m["message"]);
    if (m.contains("extraInfo") && m["extraInfo"].is_object() &&
        m["extraInfo"].contains("py_callstack"))
      *where = text(m["extraInfo"]["py_callstack"]);
  } else if (j.contains("message")) {
    *message = text(j["message"]);
  }
  if (j.contains("where")) *where = text(j["where"]);
  return true;
}

std::string format_failure_summary(const std::string& program,
                                   const std::vector<WorkerFailure>& failures) {
  std::ostringstream os;
  auto describe = [&](const WorkerFailure& f, bool full) {
    os << "  rank       : " << f.rank << " (local_rank: " << f.local_rank << ")\n";
    os << "  time       : " << f.time << "\n";
    if (f.signal) {
      os << "  exitcode   : -" << f.signal << " (killed by signal " << f.signal << ", "
         << signal_name(f.signal) << "; pid " << f.pid << ")\n";
    } else {
      os << "  exitcode   : " << f.exit_code << " (pid " << f.pid << ")\n";
    }
    if (!f.error_message.empty()) {
      os << "  error      : " << f.error_message << "\n";
      if (!f.error_where.empty()) os << "  where      : " << f.error_where << "\n";
      if (!f.error_file.empty()) os << "  error_file : " << f.error_file << "\n";
    } else {
      os << "  error_file : <N/A> (the worker wrote none; see EMBER_ERROR_FILE)\n";
    }
    if (full) {
      if (f.log_tail.empty()) {
        os << "  log tail   : <no output>\n";
      } else {
        os << "  log tail (last " << f.log_tail.size() << " lines):\n";
        for (const auto& l : f.log_tail) os << "    " << l << "\n";
      }
    }
  };
  os << "emberrun: " << program << " FAILED\n";
  os << "Root cause (first observed failure):\n";
  if (!failures.empty()) describe(failures.front(), true);
  if (failures.size() > 1) {
    os << "Other failures:\n";
    for (size_t i = 1; i < failures.size(); ++i) describe(failures[i], false);
  }
  return os.str();
}

}  // namespace ember::launcher
