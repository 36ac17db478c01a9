#include <ember/launcher/flight_analysis.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

namespace ember::launcher {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

struct Entry {
  uint64_t seq = 0;
  std::string op;
  std::string signature;  // op, dtypes and sizes: what must agree across ranks
  std::string state;
  std::string error;
};

struct GroupDump {
  std::string backend;
  std::vector<int> global_ranks;
  std::map<uint64_t, Entry> entries;  // by sequence number: the collectives
  int p2p = 0;                        // sends and receives in the ring beside them
};

struct RankDump {
  std::string file;
  std::map<std::string, GroupDump> groups;  // by name
};

[[noreturn]] void bad(const std::string& file, const std::string& what) {
  throw FlightDumpError(file + ": " + what);
}

const json& field(const std::string& file, const json& obj, const char* key, json::value_t type,
                  const std::string& where) {
  auto it = obj.find(key);
  if (it == obj.end()) bad(file, where + " has no \"" + key + "\"");
  const bool ok = type == json::value_t::number_integer
                      ? it->is_number_integer()
                      : (type == json::value_t::number_unsigned ? it->is_number_unsigned()
                                                                : it->type() == type);
  if (!ok) {
    bad(file, where + "'s \"" + key + "\" is " + it->type_name() + ", not the expected type");
  }
  return *it;
}

std::string signature(const std::string& op, const json& sizes, const json& dtypes) {
  std::string s = op + "(";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) s += ", ";
    s += (i < dtypes.size() ? dtypes[i].get<std::string>() : std::string("?")) + " [";
    for (size_t d = 0; d < sizes[i].size(); ++d) {
      s += (d ? ", " : "") + std::to_string(sizes[i][d].get<int64_t>());
    }
    s += "]";
  }
  return s + ")";
}

RankDump read_dump(const fs::path& path, int rank_in_name) {
  const std::string file = path.string();
  std::ifstream in(path);
  if (!in) bad(file, "cannot be read");
  json doc;
  try {
    doc = json::parse(in);
  } catch (const json::exception& e) {
    bad(file, std::string("is not JSON: ") + e.what());
  }
  if (!doc.is_object() || doc.value("format", "") != "ember-flight-recorder") {
    bad(file, "is not a flight recorder dump (no \"format\": \"ember-flight-recorder\")");
  }
  if (doc.value("version", 0) != 1) bad(file, "has an unknown \"version\" (expected 1)");
  const int rank = field(file, doc, "rank", json::value_t::number_integer, "the dump")
                       .get<int>();
  if (rank != rank_in_name) {
    bad(file, "holds rank " + std::to_string(rank) + ", not the rank its name says");
  }
  RankDump out{file, {}};
  for (const json& g : field(file, doc, "groups", json::value_t::array, "the dump")) {
    if (!g.is_object()) bad(file, "a group is not an object");
    const std::string name = field(file, g, "name", json::value_t::string, "a group");
    const std::string where = "group \"" + name + "\"";
    GroupDump gd;
    gd.backend = field(file, g, "backend", json::value_t::string, where);
    for (const json& r : field(file, g, "global_ranks", json::value_t::array, where)) {
      if (!r.is_number_integer()) bad(file, where + "'s global_ranks holds a non-integer");
      gd.global_ranks.push_back(r.get<int>());
    }
    if (std::find(gd.global_ranks.begin(), gd.global_ranks.end(), rank) == gd.global_ranks.end()) {
      bad(file, where + " does not list the dump's rank " + std::to_string(rank));
    }
    for (const json& e : field(file, g, "entries", json::value_t::array, where)) {
      if (!e.is_object()) bad(file, where + ": an entry is not an object");
      // Sends and receives are numbered apart from the collectives, and ranks issue different
      // numbers of them: they are not compared across ranks.
      if (e.contains("p2p")) {
        if (!e["p2p"].is_boolean()) bad(file, where + ": an entry's p2p is not true or false");
        if (e["p2p"].get<bool>()) {
          ++gd.p2p;
          continue;
        }
      }
      Entry en;
      en.seq = field(file, e, "seq", json::value_t::number_unsigned, where + "'s entry")
                   .get<uint64_t>();
      const std::string at = where + "'s entry #" + std::to_string(en.seq);
      en.op = field(file, e, "op", json::value_t::string, at);
      const json& sizes = field(file, e, "sizes", json::value_t::array, at);
      const json& dtypes = field(file, e, "dtypes", json::value_t::array, at);
      for (const json& s : sizes) {
        if (!s.is_array() ||
            !std::all_of(s.begin(), s.end(), [](const json& d) { return d.is_number_integer(); }))
          bad(file, at + "'s sizes are not lists of integers");
      }
      if (!std::all_of(dtypes.begin(), dtypes.end(), [](const json& d) { return d.is_string(); }))
        bad(file, at + "'s dtypes are not strings");
      en.signature = signature(en.op, sizes, dtypes);
      en.state = field(file, e, "state", json::value_t::string, at);
      static const std::set<std::string> kStates = {"enqueued", "started", "completed", "failed"};
      if (!kStates.count(en.state)) bad(file, at + " has an unknown state \"" + en.state + "\"");
      en.error = e.value("error", "");
      gd.entries[en.seq] = std::move(en);
    }
    out.groups[name] = std::move(gd);
  }
  return out;
}

std::string list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) {
    s += (i == 0 ? "" : (i + 1 == ranks.size() ? " and " : ", ")) + std::to_string(ranks[i]);
  }
  return s;
}

std::string ranks_word(const std::vector<int>& ranks) {
  return (ranks.size() == 1 ? "rank " : "ranks ") + list(ranks);
}

// The first divergence among the members' entries of one group, or nothing. `undumped`: the
// group's ranks that left no dump (not in `members`).
std::optional<FlightFinding> first_divergence(const std::string& name,
                                              const std::map<int, const GroupDump*>& members,
                                              const std::vector<int>& undumped) {
  // Ranks whose dump lacks the group never issued on it: no entries.
  uint64_t start = 0, end = 0;
  bool any = false;
  for (const auto& [rank, g] : members) {
    if (g == nullptr || g->entries.empty()) continue;
    start = std::max(start, g->entries.begin()->first);  // older ones left some rings
    end = any ? std::max(end, g->entries.rbegin()->first) : g->entries.rbegin()->first;
    any = true;
  }
  if (!any) return std::nullopt;
  auto entry = [&](int rank, uint64_t seq) -> const Entry* {
    const GroupDump* g = members.at(rank);
    if (g == nullptr) return nullptr;
    auto it = g->entries.find(seq);
    return it == g->entries.end() ? nullptr : &it->second;
  };
  for (uint64_t s = start; s <= end; ++s) {
    std::map<std::string, std::vector<int>> by_sig;
    std::vector<int> absent;
    for (const auto& [rank, g] : members) {
      if (const Entry* e = entry(rank, s)) {
        by_sig[e->signature].push_back(rank);
      } else if (g == nullptr || !g->entries.empty() || g->p2p == 0) {
        absent.push_back(rank);
      }
      // else: a ring of sends and receives only, which pushed its collectives out (a pipeline
      // stage's): where this rank stands is unknown, not absent.
    }
    if (by_sig.empty()) continue;
    // The signature most ranks called (the lowest rank's on a tie) is taken as the intended one.
    auto major = by_sig.begin();
    for (auto it = by_sig.begin(); it != by_sig.end(); ++it) {
      if (it->second.size() > major->second.size() ||
          (it->second.size() == major->second.size() && it->second[0] < major->second[0])) {
        major = it;
      }
    }
    const std::vector<int>& agree = major->second;
    const Entry& intended = *entry(agree[0], s);
    if (by_sig.size() > 1) {
      std::vector<int> others;
      std::string what;
      bool skipped = true;
      const Entry* next = entry(agree[0], s + 1);
      for (const auto& [sig, ranks] : by_sig) {
        if (sig == major->first) continue;
        others.insert(others.end(), ranks.begin(), ranks.end());
        what += "; " + ranks_word(ranks) + " called " + sig;
        skipped = skipped && next != nullptr && sig == next->signature;
        // When the others failed at the mismatch (gloo and threads check every collective),
        // nothing follows it to prove a skip; but in a training loop a rank that skipped one
        // collective issues the loop's next one, which the others issued before.
        const GroupDump* g = members.at(agree[0]);
        for (auto it = std::make_reverse_iterator(g->entries.find(s)); it != g->entries.rend();
             ++it) {
          if (it->second.signature != sig) continue;
          what += " (what " + ranks_word(agree) + " called at #" + std::to_string(it->first) +
                  ": in a loop, " + ranks_word(ranks) + " likely skipped " + intended.op + " #" +
                  std::to_string(s) + ")";
          break;
        }
      }
      std::sort(others.begin(), others.end());
      FlightFinding f{skipped ? FlightFinding::Kind::Skipped : FlightFinding::Kind::Mismatch,
                      name, s, intended.op, others, ""};
      if (skipped) {
        f.message = ranks_word(others) + " skipped " + intended.op + " #" + std::to_string(s) +
                    ", " + intended.signature + ", which " + ranks_word(agree) +
                    " called: from #" + std::to_string(s) + " on " +
                    (others.size() == 1 ? "its" : "their") + " collectives are one behind (" +
                    (others.size() == 1 ? "its" : "their") + " #" + std::to_string(s) + " is " +
                    next->signature + ", the others' #" + std::to_string(s + 1) + ")";
      } else {
        f.message = intended.op + " #" + std::to_string(s) + " differs across ranks: " +
                    ranks_word(agree) + " called " + intended.signature + what;
      }
      return f;
    }
    if (!absent.empty()) {
      std::set<std::string> states;
      for (int r : agree) states.insert(entry(r, s)->state);
      std::string st;
      for (const std::string& x : states) st += (st.empty() ? "" : "/") + x;
      const bool waiting = !states.count("completed");
      FlightFinding f{FlightFinding::Kind::Missing, name, s, intended.op, absent, ""};
      f.message = ranks_word(absent) + " never called " + intended.op + " #" +
                  std::to_string(s) + ", " + intended.signature + "; " + ranks_word(agree) +
                  (waiting ? " wait in it (" + st + ")" : " called it (" + st + ")");
      return f;
    }
    std::vector<int> failed, stuck, done;
    for (int r : agree) {
      const std::string& st = entry(r, s)->state;
      (st == "failed" ? failed : st == "completed" ? done : stuck).push_back(r);
    }
    if (!failed.empty()) {
      FlightFinding f{FlightFinding::Kind::Failed, name, s, intended.op, failed, ""};
      f.message = intended.op + " #" + std::to_string(s) + ", " + intended.signature +
                  ", failed on " + ranks_word(failed) + ": " + entry(failed[0], s)->error;
      return f;
    }
    if (!stuck.empty()) {
      FlightFinding f{FlightFinding::Kind::Stuck, name, s, intended.op, stuck, ""};
      f.message = ranks_word(stuck) + (stuck.size() == 1 ? " is" : " are") + " stuck in " +
                  intended.op + " #" + std::to_string(s) + ", " + intended.signature +
                  " (issued, not completed when dumped)";
      if (!done.empty()) {
        f.message += "; " + ranks_word(done) + " completed it";
      } else if (undumped.empty()) {
        f.message += ", on every rank";
      } else {
        // The rank a collective waits for is usually busy elsewhere (computing, or stuck
        // before it) and killed without failing itself: it writes no dump.
        f.message += "; " + ranks_word(undumped) + " left no dump, so where " +
                     (undumped.size() == 1 ? "it stands" : "they stand") +
                     " is unknown: likely the one" + (undumped.size() == 1 ? "" : "s") +
                     " that never reached it";
      }
      return f;
    }
  }
  return std::nullopt;
}

}  // namespace

FlightReport analyze_flight_dumps(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw FlightDumpError(dir + ": not a folder");
  std::map<int, RankDump> dumps;
  for (const auto& de : fs::directory_iterator(dir, ec)) {
    const std::string name = de.path().filename().string();
    const std::string prefix = "flight_rank", suffix = ".json";
    if (name.size() <= prefix.size() + suffix.size() || name.rfind(prefix, 0) != 0 ||
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
      continue;
    }
    const std::string digits =
        name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
    if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
        digits.size() > 9) {
      continue;
    }
    const int rank = std::stoi(digits);
    dumps.emplace(rank, read_dump(de.path(), rank));
  }
  if (ec) throw FlightDumpError(dir + ": cannot be listed: " + ec.message());
  if (dumps.empty()) throw FlightDumpError(dir + ": no flight_rank<R>.json dumps in it");

  FlightReport report;
  for (const auto& [rank, d] : dumps) report.files.push_back(d.file);
  // Every group any rank dumped, with its members.
  std::map<std::string, std::vector<int>> groups;
  for (const auto& [rank, d] : dumps) {
    for (const auto& [name, g] : d.groups) {
      auto [it, fresh] = groups.emplace(name, g.global_ranks);
      if (!fresh && it->second != g.global_ranks) {
        throw FlightDumpError(d.file + ": group \"" + name + "\" lists other ranks than in " +
                              dumps.begin()->second.file);
      }
    }
  }
  std::set<int> no_dump;
  for (const auto& [name, ranks] : groups) {
    std::map<int, const GroupDump*> members;
    std::vector<int> undumped;
    for (int r : ranks) {
      auto d = dumps.find(r);
      if (d == dumps.end()) {
        no_dump.insert(r);
        undumped.push_back(r);
        continue;
      }
      auto g = d->second.groups.find(name);
      members[r] = g == d->second.groups.end() ? nullptr : &g->second;
    }
    if (auto f = first_divergence(name, members, undumped)) {
      f->message = "group " + name + ": " + f->message;
      report.findings.push_back(std::move(*f));
    }
  }
  for (int r : no_dump) {
    report.findings.push_back({FlightFinding::Kind::NoDump, "", 0, "", {r},
                               "rank " + std::to_string(r) +
                                   " left no dump (it exited before the failure, or could not "
                                   "write to the folder); its collectives are unknown"});
  }
  return report;
}

}  // namespace ember::launcher
