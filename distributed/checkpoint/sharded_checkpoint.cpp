// Writing sharded checkpoints (sharded_checkpoint.h): the plan the ranks agree on, each rank's
// file, the index; sharded_checkpoint_read.cpp reads them.
#include <ember/distributed/checkpoint/sharded_checkpoint.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <set>
#include <sstream>

#include <xxhash.h>

#include <ember/distributed/checkpoint/detail/sharded_checkpoint.h>
#include <ember/distributed/sharding/detail/byte_exchange.h>
#include <ember/nn/io/atomic_file.h>
#include <ember/nn/io/serialize.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/observe/log.h>

namespace ember::dist {
namespace {

using namespace sharded_format;  // NOLINT: the format's own helpers

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr const char* kSaveOp = "[save_sharded]";
constexpr const char* kReadOp = "[ShardedCheckpoint]";
std::mutex& hook_mutex() {
  static std::mutex m;
  return m;
}
std::function<void(int)>& save_hook() {
  static std::function<void(int)> hook;
  return hook;
}

std::string piece_key(const std::string& name, int64_t first) {
  return name + "@" + std::to_string(first);
}

// One rank's non-empty piece as every rank sees it after the exchange: its index among the
// rank's pieces, its range and box.
struct Desc {
  int rank = 0;
  size_t index = 0;
  int64_t offset = 0;
  int64_t numel = 0;
  Box box;
  bool replicated = false;
  bool same_piece(const Desc& o) const {
    return offset == o.offset && numel == o.numel && box == o.box;
  }
};

// {"error": what}, with any invalid UTF-8 in `what` (a bad name it quotes) replaced, so that
// reporting an error cannot itself throw and leave the other ranks waiting.
std::string error_json(const std::string& what) {
  return Json{{"error", what}}.dump(-1, ' ', false, Json::error_handler_t::replace);
}

bool valid_utf8(const std::string& s) {
  try {
    (void)Json(s).dump();  // nlohmann refuses invalid UTF-8 when it writes
    return true;
  } catch (const Json::exception&) {
    return false;
  }
}

// This rank's descriptors as JSON, or the first thing wrong with its pieces as "error" (sent
// rather than thrown, so that every rank learns of it and none waits for this one).
std::string describe_pieces(const std::vector<ShardPiece>& pieces) {
  Json out = {{"pieces", Json::array()}};
  for (size_t i = 0; i < pieces.size(); ++i) {
    const ShardPiece& p = pieces[i];
    std::string what;
    if (p.name.empty()) {
      what = "has an empty name";
    } else if (!valid_utf8(p.name)) {
      what = "has a name that is not valid UTF-8";
    } else if (!p.data.defined()) {
      what = "has undefined data";
    } else if (p.data.dim() != 1) {
      what = detail::str_cat("has data of shape ", p.data.shape(), " (expected 1-D)");
    } else if (!valid_shape(p.shape)) {
      what = "has an invalid shape " + shape_str(p.shape) + " (negative, over " +
             std::to_string(kMaxDims) + " dimensions, or too many elements)";
    } else if (const std::string bad = box_error(p.shape, p.box); !bad.empty()) {
      what = "of shape " + shape_str(p.shape) + ": " + bad;
    } else if (p.offset < 0 || p.offset > box_numel(p.shape, p.box) - p.data.numel()) {
      what = detail::str_cat("covers elements [", p.offset, ", ", p.offset + p.data.numel(),
                             "), outside the ", box_numel(p.shape, p.box), " of ",
                             p.box.whole() ? "shape " + shape_str(p.shape)
                                           : "its box of shape " + shape_str(p.box.shape));
    }
    if (!what.empty()) {
      return error_json(detail::str_cat("piece ", i, " ('", p.name, "') ", what));
    }
    Json d = {{"name", p.name},
              {"shape", p.shape},
              {"dtype", std::string(dtype_name(p.data.dtype()))},
              {"offset", p.offset},
              {"numel", p.data.numel()}};
    if (!p.box.whole()) d["box"] = box_json(p.box);
    if (p.replicated) d["replicated"] = true;
    out["pieces"].push_back(d);
  }
  return out.dump();
}

// A run of the whole tensor and the rank whose piece holds it.
struct Covered {
  int rank = 0;
  int64_t start = 0;
  int64_t length = 0;
};

// Throws ValueError naming the tensor and the ranks unless `covered` (sorted by start) tile
// [0, numel) exactly.
void check_tiling(const std::string& name, const std::vector<int64_t>& shape,
                  const std::vector<Covered>& covered) {
  const int64_t numel = numel_of(shape);
  const std::string what = "tensor '" + name + "' (shape " + shape_str(shape) + ", " +
                           std::to_string(numel) + " elements): ";
  int64_t end = 0;
  int last = -1;
  for (const Covered& d : covered) {
    EMBER_CHECK(d.start >= end, kSaveOp, " ", what, "rank ", d.rank, "'s piece [", d.start, ", ",
                d.start + d.length, ") overlaps rank ", last, "'s piece ending at ", end, " on [",
                d.start, ", ", std::min(end, d.start + d.length), ")");
    EMBER_CHECK(
        d.start <= end, kSaveOp, " ", what, "elements [", end, ", ", d.start,
        ") are in no rank's piece (a gap ",
        last < 0 ? std::string("before") : "between rank " + std::to_string(last) + "'s piece and",
        " rank ", d.rank, "'s piece)");
    end = d.start + d.length;
    last = d.rank;
  }
  EMBER_CHECK(end == numel, kSaveOp, " ", what, "elements [", end, ", ", numel,
              ") are in no rank's piece",
              last < 0 ? std::string(" (no rank gave any)")
                       : " (a gap after rank " + std::to_string(last) + "'s piece)");
}

// What every rank agrees to write: the checkpoint's tensors in order of first appearance, and
// per rank the indices of its pieces it writes (a replicated piece is written by one rank).
struct SavePlan {
  std::vector<std::pair<std::string, ShardedCheckpoint::Entry>> tensors;
  std::vector<std::set<size_t>> writes;
};

// The plan from every rank's descriptors; the same on every rank, so a violation throws the
// same error everywhere.
SavePlan plan_save(const std::vector<std::string>& all) {
  std::vector<Json> ranks;
  std::string errors;
  for (size_t r = 0; r < all.size(); ++r) {
    ranks.push_back(Json::parse(all[r]));
    if (ranks.back().contains("error")) {
      errors += detail::str_cat("; rank ", r, ": ", ranks.back()["error"].get<std::string>());
    }
  }
  EMBER_CHECK(errors.empty(), kSaveOp, " the save cannot start", errors);
  SavePlan plan;
  plan.writes.resize(all.size());
  std::map<std::string, size_t> at;
  std::map<std::string, std::pair<int, std::vector<Desc>>> descs;  // first rank, pieces
  for (int r = 0; r < static_cast<int>(ranks.size()); ++r) {
    const Json& pieces = ranks[static_cast<size_t>(r)]["pieces"];
    for (size_t i = 0; i < pieces.size(); ++i) {
      const Json& p = pieces[i];
      const std::string name = p["name"];
      const auto shape = p["shape"].get<std::vector<int64_t>>();
      const Dtype dtype = dtype_from_name(p["dtype"].get<std::string>());
      auto [it, added] = at.emplace(name, plan.tensors.size());
      if (added) {
        plan.tensors.push_back({name, {shape, dtype, {}, {}}});
        descs[name].first = r;
      }
      const auto& e = plan.tensors[it->second].second;
      const int first = descs[name].first;
      EMBER_CHECK(e.shape == shape, kSaveOp, " tensor '", name, "': rank ", r, " gives shape ",
                  shape_str(shape), " but rank ", first, " gives ", shape_str(e.shape));
      EMBER_CHECK(e.dtype == dtype, kSaveOp, " tensor '", name, "': rank ", r, " gives dtype ",
                  dtype, " but rank ", first, " gives ", e.dtype);
      Desc d{r, i, p["offset"].get<int64_t>(), p["numel"].get<int64_t>(), {}, p.contains("replicated")};
      if (p.contains("box")) {
        d.box = {p["box"]["view"].get<std::vector<int64_t>>(),
                 p["box"]["offset"].get<std::vector<int64_t>>(),
                 p["box"]["shape"].get<std::vector<int64_t>>()};
      }
      if (d.numel > 0) descs[name].second.push_back(std::move(d));
    }
  }
  // Replicated copies of one piece: one writer each, the rank with the fewest bytes so far
  // (after every piece only one rank holds), the lowest of those on a tie.
  std::vector<int64_t> bytes(all.size(), 0);
  std::vector<std::vector<std::vector<const Desc*>>> copies(plan.tensors.size());
  for (size_t t = 0; t < plan.tensors.size(); ++t) {
    const int64_t isz = itemsize(plan.tensors[t].second.dtype);
    for (const Desc& d : descs[plan.tensors[t].first].second) {
      auto& groups = copies[t];
      auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& c) {
        return d.replicated && c.front()->replicated && c.front()->same_piece(d);
      });
      if (g == groups.end()) {
        groups.push_back({&d});
      } else {
        g->push_back(&d);
      }
    }
    for (const auto& c : copies[t]) {
      if (c.size() == 1) bytes[static_cast<size_t>(c.front()->rank)] += c.front()->numel * isz;
    }
  }
  for (size_t t = 0; t < plan.tensors.size(); ++t) {
    auto& [name, entry] = plan.tensors[t];
    std::vector<Covered> covered;
    for (const auto& c : copies[t]) {
      const Desc* w = c.front();
      for (const Desc* d : c) {
        if (bytes[static_cast<size_t>(d->rank)] < bytes[static_cast<size_t>(w->rank)]) w = d;
      }
      if (c.size() > 1) bytes[static_cast<size_t>(w->rank)] += w->numel * itemsize(entry.dtype);
      plan.writes[static_cast<size_t>(w->rank)].insert(w->index);
      entry.pieces.push_back({w->rank, w->offset, w->numel, -1, w->box, std::nullopt});
    }
    make_runs(entry);
    for (const auto& run : entry.runs) {
      covered.push_back({entry.pieces[run.piece].rank, run.start, run.length});
    }
    check_tiling(name, entry.shape, covered);
  }
  return plan;
}

// Where each tensor's bytes start in the safetensors file at `path`: 8 + header size + its
// data_offsets' begin.
std::map<std::string, int64_t> data_offsets(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, '\0');
  in.read(header.data(), static_cast<std::streamsize>(n));
  EMBER_CHECK(in.good(), kSaveOp, " could not read back the header of ", path);
  std::map<std::string, int64_t> out;
  const Json parsed = Json::parse(header);
  for (const auto& [key, v] : parsed.items()) {
    if (key != "__metadata__") {
      out[key] = 8 + static_cast<int64_t>(n) + v["data_offsets"][0].get<int64_t>();
    }
  }
  return out;
}

// Writes this rank's pieces the plan gives it (if any) to its file; returns the outcome as
// JSON: {"offsets": {key: byte offset}} or {"error": why}.
std::string write_rank_file(const std::string& path, const std::vector<ShardPiece>& pieces,
                            const std::set<size_t>& writes, int rank) {
  try {
    std::vector<std::pair<std::string, Tensor>> tensors;
    Json checksums = Json::object();
    for (size_t i : writes) {
      const ShardPiece& p = pieces[i];
      const int64_t first = spans_of(p.shape, p.box, p.offset, p.data.numel()).front().start;
      const Tensor bytes = p.data.detach().to(kCPU).contiguous();
      const std::string key = piece_key(p.name, first);
      checksums[key] = hex64(XXH3_64bits(bytes.data_ptr(), static_cast<size_t>(bytes.nbytes())));
      tensors.emplace_back(key, bytes);
    }
    Json offsets = Json::object();
    if (!tensors.empty()) {
      nn::save_safetensors(path, tensors);
      offsets = data_offsets(path);
    }
    std::function<void(int)> hook;
    {
      std::lock_guard<std::mutex> lock(hook_mutex());
      hook = save_hook();
    }
    if (hook) hook(rank);
    return Json{{"offsets", offsets}, {"checksums", checksums}}.dump();
  } catch (const std::exception& e) {
    return error_json(e.what());
  }
}

// A fresh save id, unique with overwhelming probability, so a save never writes over a file
// the current index names.
std::string new_save_id() {
  std::random_device rd;
  std::mt19937_64 gen(
      (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(gen()));
  return buf;
}

Json index_json(const std::string& save_id, int world,
                const std::map<std::string, std::string>& metadata,
                const std::vector<std::pair<std::string, ShardedCheckpoint::Entry>>& plan) {
  Json tensors = Json::array();
  for (const auto& [name, e] : plan) {
    Json pieces = Json::array();
    for (const auto& p : e.pieces) {
      Json j = {{"rank", p.rank},
                {"offset", p.offset},
                {"numel", p.numel},
                {"file_offset", p.file_offset}};
      if (!p.box.whole()) j["box"] = box_json(p.box);
      if (p.checksum) j["xxh3"] = hex64(*p.checksum);
      pieces.push_back(j);
    }
    tensors.push_back({{"name", name},
                       {"shape", e.shape},
                       {"dtype", std::string(dtype_name(e.dtype))},
                       {"pieces", pieces}});
  }
  return {{"format", kFormat},   {"version", kVersion},  {"save_id", save_id},
          {"world_size", world}, {"metadata", metadata}, {"tensors", tensors}};
}

// Removes the rank files in `dir` that `keep_id`'s save did not write: earlier saves' and
// crashed saves'; and the index's temp files a save killed while writing its index left (this
// save's index is in place, so none is being written). Failures only warn: the new set is
// complete already.
void remove_stale_files(const std::string& dir, const std::string& keep_id) {
  // Also the temp files an interrupted atomic write leaves (nn/io/atomic_file.h names them
  // ".<target>.tmp-*").
  static const std::regex rank_file(R"(\.?([0-9a-f]{16})\.rank[0-9]+\.safetensors(\.tmp-.*)?)");
  static const std::regex index_temp(R"(\.index\.json\.tmp-.*)");
  std::error_code ec;
  // increment(ec), not a range-for: a directory read failing halfway must only warn.
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::smatch m;
    const std::string name = it->path().filename().string();
    if ((std::regex_match(name, m, rank_file) && m[1] != keep_id) ||
        std::regex_match(name, index_temp)) {
      std::error_code rm;
      fs::remove(it->path(), rm);
      if (rm)
        logging::warn(kSaveOp, " could not remove stale ", it->path().string(), ": ", rm.message());
    }
  }
  if (ec) logging::warn(kSaveOp, " could not list ", dir, " for stale files: ", ec.message());
}

// Whether `dir`'s index names save `id`: after a failed index write, whether the rename had
// already put the new index in place (only making it durable failed).
bool index_names(const std::string& dir, const std::string& id) {
  try {
    std::ifstream in(fs::path(dir) / kIndexName);
    return in && Json::parse(in).value("save_id", std::string()) == id;
  } catch (const std::exception&) {
    return false;
  }
}

// Throws (on every rank alike) if any rank's outcome holds an error.
void check_outcomes(const std::vector<std::string>& outcomes, const std::string& step) {
  std::string errors;
  bool indexed = false;
  for (size_t r = 0; r < outcomes.size(); ++r) {
    const Json o = Json::parse(outcomes[r]);
    if (o.contains("error"))
      errors += detail::str_cat("; rank ", r, ": ", o["error"].get<std::string>());
    indexed = indexed || o.value("indexed", false);
  }
  if (!errors.empty()) {
    throw Error(detail::str_cat(
        kSaveOp, " ", step, " failed", errors,
        indexed ? " (the new checkpoint is in place, but may not survive a power cut; no file "
                  "was removed)"
                : " (the previous checkpoint, if any, is still the current one)"));
  }
}

}  // namespace

}  // namespace ember::dist

namespace ember::dist::detail {

namespace {

// The saves in flight in this process, by directory and rank (ranks may be threads of one
// process): a second save to the same directory before the first has committed would delete the
// first's files as stale, and the last index would then name deleted files.
struct InFlight {
  std::mutex mu;
  std::set<std::pair<std::string, int>> saves;
};
InFlight& in_flight() {
  static InFlight* f = new InFlight();  // never destroyed: a save may end after statics
  return *f;
}
std::string dir_key(const std::string& dir) {
  std::error_code ec;
  const fs::path p = fs::weakly_canonical(fs::absolute(dir, ec), ec);
  return (ec ? fs::path(dir) : p).lexically_normal().string();
}

}  // namespace

struct PreparedSave {
  std::string dir;
  std::vector<ShardPiece> pieces;
  SavePlan plan;
  std::string save_id;
  std::map<std::string, std::string> metadata;
  Json rank_metadata;  // every rank's, or null when none has any
  int rank = 0, world = 0;
  std::string failed;  // fail_sharded_save's reason: commit sends it instead of writing
  // This rank's entry in in_flight(), removed when the save is done with (committed, failed, or
  // dropped before commit).
  std::shared_ptr<void> registration;
};

std::shared_ptr<PreparedSave> prepare_sharded_save(
    const std::string& dir, std::vector<ShardPiece> pieces, ProcessGroup& pg,
    const std::map<std::string, std::string>& metadata,
    const std::map<std::string, std::string>& rank_metadata) {
  auto save = std::make_shared<PreparedSave>();
  save->rank = pg.rank();
  save->world = pg.size();
  // The save id travels with rank 0's descriptors, each rank's own strings with its own: one
  // exchange for all.
  Json mine = Json::parse(describe_pieces(pieces));
  {
    InFlight& f = in_flight();
    const std::pair<std::string, int> key{dir_key(dir), save->rank};
    std::lock_guard<std::mutex> lock(f.mu);
    if (f.saves.insert(key).second) {
      save->registration = std::shared_ptr<void>(nullptr, [key](void*) {
        InFlight& g = in_flight();
        std::lock_guard<std::mutex> l(g.mu);
        g.saves.erase(key);
      });
    } else {
      // Sent, not thrown, so that every rank refuses alike.
      mine = Json::parse(error_json(
          detail::str_cat("a save to ", dir,
                          " is still in flight on this rank (an async save not yet waited "
                          "for?): wait for it to finish, or save to another directory")));
    }
  }
  if (save->rank == 0) mine["save_id"] = new_save_id();
  if (!rank_metadata.empty()) mine["rank_metadata"] = rank_metadata;
  const std::vector<std::string> all = exchange_bytes(pg, mine.dump());
  save->plan = plan_save(all);
  save->save_id = Json::parse(all[0])["save_id"];
  bool any = false;
  Json per_rank = Json::array();
  for (const std::string& a : all) {
    Json j = Json::parse(a);
    any = any || j.contains("rank_metadata");
    per_rank.push_back(j.contains("rank_metadata") ? j["rank_metadata"] : Json::object());
  }
  if (any) save->rank_metadata = std::move(per_rank);
  save->dir = dir;
  save->pieces = std::move(pieces);
  save->metadata = metadata;
  return save;
}

void stage_sharded_save(PreparedSave& save,
                        const std::function<Tensor(size_t, const Tensor&)>& copy) {
  const std::set<size_t>& mine = save.plan.writes[static_cast<size_t>(save.rank)];
  for (size_t i = 0; i < save.pieces.size(); ++i) {
    Tensor& d = save.pieces[i].data;
    d = mine.count(i) != 0 ? copy(i, d) : Tensor();
  }
}

void commit_sharded_save(PreparedSave& save, ProcessGroup& pg) {
  const int me = save.rank;
  EMBER_CHECK(pg.rank() == me && pg.size() == save.world, kSaveOp, " committing on rank ",
              pg.rank(), " of ", pg.size(), " a save prepared on rank ", me, " of ", save.world);
  const std::string& dir = save.dir;
  std::error_code ec;
  fs::create_directories(dir, ec);  // every rank, in case `dir` is not shared; errors show below
  // However the commit ends, this rank's save is no longer in flight.
  struct Done {
    PreparedSave& s;
    ~Done() { s.registration.reset(); }
  } done{save};
  const std::string path = (fs::path(dir) / rank_file_name(save.save_id, me)).string();
  const std::vector<std::string> written = exchange_bytes(
      pg, save.failed.empty()
              ? write_rank_file(path, save.pieces, save.plan.writes[static_cast<size_t>(me)], me)
              : error_json(save.failed));
  try {
    check_outcomes(written, "writing the rank files");
  } catch (...) {
    fs::remove(path, ec);  // the index never names it
    throw;
  }

  std::string outcome = "{}";
  if (me == 0) {
    try {
      std::vector<Json> offsets, checksums;
      for (const std::string& w : written) {
        const Json o = Json::parse(w);
        offsets.push_back(o["offsets"]);
        checksums.push_back(o["checksums"]);
      }
      for (auto& [name, e] : save.plan.tensors) {
        for (auto& p : e.pieces) {
          const int64_t first = spans_of(e.shape, p.box, p.offset, p.numel).front().start;
          const auto r = static_cast<size_t>(p.rank);
          p.file_offset = offsets[r].at(piece_key(name, first));
          p.checksum = std::stoull(checksums[r].at(piece_key(name, first)).get<std::string>(),
                                   nullptr, 16);
        }
      }
      Json index = index_json(save.save_id, save.world, save.metadata, save.plan.tensors);
      if (!save.rank_metadata.is_null()) index["rank_metadata"] = save.rank_metadata;
      nn::write_file_atomic((fs::path(dir) / kIndexName).string(), index.dump(1));
      remove_stale_files(dir, save.save_id);
    } catch (const std::exception& e) {
      Json o = Json::parse(error_json(e.what()));
      // The rename may have put the new index in place before a later step failed (the
      // directory's fsync): then the new files are the checkpoint and must stay, and so must
      // the old ones, until a save is known durable.
      if (index_names(dir, save.save_id)) o["indexed"] = true;
      outcome = o.dump(-1, ' ', false, Json::error_handler_t::replace);
    }
  }
  const std::vector<std::string> indexed = exchange_bytes(pg, outcome);
  try {
    check_outcomes(indexed, "writing the index");
  } catch (...) {
    // Only a file the index never names is removed.
    if (!Json::parse(indexed[0]).value("indexed", false)) fs::remove(path, ec);
    throw;
  }
}

void fail_sharded_save(PreparedSave& save, std::string why) {
  if (save.failed.empty()) save.failed = std::move(why);
}

}  // namespace ember::dist::detail

namespace ember::dist {

void save_sharded(const std::string& dir, const std::vector<ShardPiece>& pieces, ProcessGroup& pg,
                  const std::map<std::string, std::string>& metadata,
                  const std::map<std::string, std::string>& rank_metadata) {
  auto save = detail::prepare_sharded_save(dir, pieces, pg, metadata, rank_metadata);
  detail::commit_sharded_save(*save, pg);
}

}  // namespace ember::dist

namespace ember::dist::detail {
void set_sharded_save_hook(std::function<void(int rank)> hook) {
  std::lock_guard<std::mutex> lock(dist::hook_mutex());
  dist::save_hook() = std::move(hook);
}
}  // namespace ember::dist::detail
