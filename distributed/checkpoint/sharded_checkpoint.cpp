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

#include <ember/distributed/sharding/detail/byte_exchange.h>
#include <ember/nn/atomic_file.h>
#include <ember/nn/serialize.h>
#include <ember/tensor/creation.h>
#include <ember/tensor/log.h>

namespace ember::dist {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr const char* kSaveOp = "[save_sharded]";
constexpr const char* kReadOp = "[ShardedCheckpoint]";
constexpr const char* kIndexName = "index.json";
constexpr const char* kFormat = "ember.sharded_checkpoint";
// Version 2 added boxes and replicated pieces, version 3 each piece's checksum; older indexes
// read as ever (without checksums to check).
constexpr int kVersion = 3;

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::mutex& hook_mutex() {
  static std::mutex m;
  return m;
}
std::function<void(int)>& save_hook() {
  static std::function<void(int)> hook;
  return hook;
}

std::string shape_str(const std::vector<int64_t>& shape) { return Json(shape).dump(); }

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Whether `shape` is one a tensor can have: at most kMaxDims sizes, none negative, a product
// that fits int64 (checked before numel_of is trusted with a shape from a user or a file).
bool valid_shape(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) return false;
  }
  return static_cast<int64_t>(shape.size()) <= kMaxDims;
}

// What is wrong with `box` of a tensor of `shape` ("" if nothing): a view of another element
// count, dimensions that do not match, or a block outside the view.
std::string box_error(const std::vector<int64_t>& shape, const Box& box) {
  if (box.whole()) {
    return box.view.empty() && box.offset.empty() ? "" : "a box without a shape has a view or offset";
  }
  const std::vector<int64_t>& dims = box.view.empty() ? shape : box.view;
  if (!valid_shape(box.view) || numel_of(dims) != numel_of(shape)) {
    return "a box's view " + shape_str(box.view) + " does not have the tensor's " +
           std::to_string(numel_of(shape)) + " elements";
  }
  if (box.offset.size() != dims.size() || box.shape.size() != dims.size()) {
    return "a box at " + shape_str(box.offset) + " of shape " + shape_str(box.shape) +
           " does not have the " + std::to_string(dims.size()) + " dimensions of " +
           shape_str(dims);
  }
  for (size_t d = 0; d < dims.size(); ++d) {
    if (box.offset[d] < 0 || box.shape[d] < 0 || box.offset[d] > dims[d] - box.shape[d]) {
      return "a box at " + shape_str(box.offset) + " of shape " + shape_str(box.shape) +
             " is outside " + shape_str(dims);
    }
  }
  return "";
}

int64_t box_numel(const std::vector<int64_t>& shape, const Box& box) {
  return numel_of(box.whole() ? shape : box.shape);
}

// A run of consecutive elements of the whole tensor.
struct Span {
  int64_t start = 0;
  int64_t length = 0;
};

// The runs of the whole tensor (of `shape`, row-major) that elements [offset, offset + numel)
// of `box` (valid: box_error() is "") are, in the box's order, adjacent runs merged. A block
// whose trailing dimensions are whole is one run per index of the dimensions before them.
std::vector<Span> spans_of(const std::vector<int64_t>& shape, const Box& box, int64_t offset,
                           int64_t numel) {
  std::vector<Span> out;
  if (numel <= 0) return out;
  if (box.whole()) return {{offset, numel}};
  const std::vector<int64_t>& dims = box.view.empty() ? shape : box.view;
  const int n = static_cast<int>(dims.size());
  // d: the last dimension the box does not span whole; the run is its extent times what follows.
  int d = n - 1;
  while (d > 0 && box.offset[static_cast<size_t>(d)] == 0 &&
         box.shape[static_cast<size_t>(d)] == dims[static_cast<size_t>(d)]) {
    --d;
  }
  std::vector<int64_t> stride(static_cast<size_t>(n), 1);
  for (int k = n - 2; k >= 0; --k) {
    stride[static_cast<size_t>(k)] = stride[static_cast<size_t>(k) + 1] * dims[static_cast<size_t>(k) + 1];
  }
  const int64_t run = box.shape[static_cast<size_t>(d)] * stride[static_cast<size_t>(d)];
  for (int64_t p = offset; p < offset + numel;) {
    int64_t row = p / run;
    const int64_t within = p % run;
    const int64_t len = std::min(run - within, offset + numel - p);
    int64_t start = box.offset[static_cast<size_t>(d)] * stride[static_cast<size_t>(d)] + within;
    for (int k = d - 1; k >= 0; --k) {
      const auto kk = static_cast<size_t>(k);
      start += (box.offset[kk] + row % box.shape[kk]) * stride[kk];
      row /= box.shape[kk];
    }
    if (!out.empty() && out.back().start + out.back().length == start) {
      out.back().length += len;
    } else {
      out.push_back({start, len});
    }
    p += len;
  }
  return out;
}

Json box_json(const Box& box) {
  return {{"view", box.view}, {"offset", box.offset}, {"shape", box.shape}};
}

std::string rank_file_name(const std::string& save_id, int rank) {
  return save_id + ".rank" + std::to_string(rank) + ".safetensors";
}

// The name of a piece inside its rank's file, by the flat index of its first element: unique,
// since the non-empty pieces one rank writes of a tensor do not overlap.
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

// Entry::runs from its pieces, sorted by start.
void make_runs(ShardedCheckpoint::Entry& e) {
  e.runs.clear();
  for (size_t i = 0; i < e.pieces.size(); ++i) {
    const auto& p = e.pieces[i];
    int64_t at = 0;
    for (const Span& s : spans_of(e.shape, p.box, p.offset, p.numel)) {
      e.runs.push_back({s.start, s.length, i, at});
      at += s.length;
    }
  }
  std::sort(e.runs.begin(), e.runs.end(),
            [](const auto& a, const auto& b) { return a.start < b.start; });
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
  EMBER_CHECK(errors.empty(), kSaveOp, " bad pieces", errors);
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
      entry.pieces.push_back({w->rank, w->offset, w->numel, -1, w->box});
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
// crashed saves'. Failures only warn: the new set is complete already.
void remove_stale_files(const std::string& dir, const std::string& keep_id) {
  // Also the temp files an interrupted atomic write leaves (nn/atomic_file.h names them
  // ".<target>.tmp-*").
  static const std::regex rank_file(R"(\.?([0-9a-f]{16})\.rank[0-9]+\.safetensors(\.tmp-.*)?)");
  std::error_code ec;
  for (const auto& f : fs::directory_iterator(dir, ec)) {
    std::smatch m;
    const std::string name = f.path().filename().string();
    if (std::regex_match(name, m, rank_file) && m[1] != keep_id) {
      std::error_code rm;
      fs::remove(f.path(), rm);
      if (rm)
        logging::warn(kSaveOp, " could not remove stale ", f.path().string(), ": ", rm.message());
    }
  }
}

// Throws (on every rank alike) if any rank's outcome holds an error.
void check_outcomes(const std::vector<std::string>& outcomes, const std::string& step) {
  std::string errors;
  for (size_t r = 0; r < outcomes.size(); ++r) {
    const Json o = Json::parse(outcomes[r]);
    if (o.contains("error"))
      errors += detail::str_cat("; rank ", r, ": ", o["error"].get<std::string>());
  }
  if (!errors.empty()) {
    throw Error(detail::str_cat(kSaveOp, " ", step, " failed", errors,
                                " (the previous checkpoint, if any, is still the current one)"));
  }
}

}  // namespace

}  // namespace ember::dist

namespace ember::dist::detail {

struct PreparedSave {
  std::string dir;
  std::vector<ShardPiece> pieces;
  SavePlan plan;
  std::string save_id;
  std::map<std::string, std::string> metadata;
  Json rank_metadata;  // every rank's, or null when none has any
  int rank = 0, world = 0;
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
  const std::string path = (fs::path(dir) / rank_file_name(save.save_id, me)).string();
  const std::vector<std::string> written = exchange_bytes(
      pg, write_rank_file(path, save.pieces, save.plan.writes[static_cast<size_t>(me)], me));
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
      outcome = error_json(e.what());
    }
  }
  const std::vector<std::string> indexed = exchange_bytes(pg, outcome);
  try {
    check_outcomes(indexed, "writing the index");
  } catch (...) {
    fs::remove(path, ec);  // the index was not written, so it never names this file
    throw;
  }
}

}  // namespace ember::dist::detail

namespace ember::dist {

void save_sharded(const std::string& dir, const std::vector<ShardPiece>& pieces, ProcessGroup& pg,
                  const std::map<std::string, std::string>& metadata,
                  const std::map<std::string, std::string>& rank_metadata) {
  auto save = detail::prepare_sharded_save(dir, pieces, pg, metadata, rank_metadata);
  detail::commit_sharded_save(*save, pg);
}

// ---- reading ----

namespace {

// A field of the index, or ValueError naming the index file and what is wrong.
template <typename T>
T field(const Json& j, const char* key, const std::string& path, const std::string& where) {
  EMBER_CHECK(j.is_object() && j.contains(key), kReadOp, " ", path, ": ", where, "has no '", key,
              "'");
  try {
    return j.at(key).get<T>();
  } catch (const Json::exception& e) {
    EMBER_CHECK(false, kReadOp, " ", path, ": ", where, "'", key, "' has the wrong type (",
                e.what(), ")");
  }
  return T();
}

ShardedCheckpoint::Entry parse_entry(const Json& t, const std::string& name, int world,
                                     const std::string& path) {
  const std::string where = "tensor '" + name + "' ";
  ShardedCheckpoint::Entry e;
  e.shape = field<std::vector<int64_t>>(t, "shape", path, where);
  EMBER_CHECK(valid_shape(e.shape), kReadOp, " ", path, ": ", where, "has a bad shape ",
              shape_str(e.shape));
  const int64_t total = numel_of(e.shape);
  try {
    e.dtype = dtype_from_name(field<std::string>(t, "dtype", path, where));
  } catch (const ValueError& err) {
    EMBER_CHECK(false, kReadOp, " ", path, ": ", where, err.what());
  }
  const Json pieces = field<Json>(t, "pieces", path, where);
  EMBER_CHECK(pieces.is_array(), kReadOp, " ", path, ": ", where, "'pieces' is not an array");
  int64_t covered = 0;
  for (const Json& p : pieces) {
    ShardedCheckpoint::Piece x{
        field<int>(p, "rank", path, where), field<int64_t>(p, "offset", path, where),
        field<int64_t>(p, "numel", path, where), field<int64_t>(p, "file_offset", path, where)};
    if (p.contains("box")) {
      const Json b = field<Json>(p, "box", path, where);
      x.box = {field<std::vector<int64_t>>(b, "view", path, where + "box "),
               field<std::vector<int64_t>>(b, "offset", path, where + "box "),
               field<std::vector<int64_t>>(b, "shape", path, where + "box ")};
    }
    if (p.contains("xxh3")) {
      const std::string h = field<std::string>(p, "xxh3", path, where);
      EMBER_CHECK(h.size() == 16 && h.find_first_not_of("0123456789abcdef") == std::string::npos,
                  kReadOp, " ", path, ": ", where, "has a bad checksum '", h,
                  "' (expected 16 hexadecimal digits)");
      x.checksum = std::stoull(h, nullptr, 16);
    }
    const std::string bad_box = box_error(e.shape, x.box);
    EMBER_CHECK(bad_box.empty(), kReadOp, " ", path, ": ", where, "has a bad piece ", p.dump(),
                ": ", bad_box);
    const int64_t in_box = box_numel(e.shape, x.box);
    int64_t bytes = 0, file_end = 0;
    EMBER_CHECK(
        x.rank >= 0 && x.rank < world && x.offset >= 0 && x.numel > 0 &&
            x.numel <= in_box - x.offset && x.numel <= total - covered && x.file_offset >= 0 &&
            !__builtin_mul_overflow(x.numel, itemsize(e.dtype), &bytes) &&
            !__builtin_add_overflow(x.file_offset, bytes, &file_end),
        kReadOp, " ", path, ": ", where, "has a bad piece ", p.dump(), " (expected rank in [0, ",
        world, "), numel in [1, ", std::min(in_box - x.offset, total - covered),
        "], a range inside its box)");
    covered += x.numel;
    e.pieces.push_back(x);
  }
  EMBER_CHECK(covered == total, kReadOp, " ", path, ": ", where, "pieces cover ", covered,
              " of the ", total, " elements of shape ", shape_str(e.shape));
  make_runs(e);
  int64_t end = 0;  // as many elements as the tensor: a gap is an overlap too
  for (const auto& r : e.runs) {
    EMBER_CHECK(r.start == end, kReadOp, " ", path, ": ", where, "has pieces that overlap at "
                "element ", std::min(r.start, end));
    end += r.length;
  }
  return e;
}

Json read_index(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw Error(detail::str_cat(kReadOp, " cannot open the checkpoint index ", path, ": ",
                                std::strerror(errno),
                                " (not a sharded checkpoint, or its save "
                                "never completed)"));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return Json::parse(ss.str());
  } catch (const Json::exception& e) {
    EMBER_CHECK(false, kReadOp, " ", path, " is not valid JSON: ", e.what());
  }
  return {};
}

// An open file, closed on scope exit.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// Reads exactly n bytes at `at` of `fd` into `out`; ember::Error naming `path` if it cannot.
void pread_exact(int fd, void* out, int64_t n, int64_t at, const std::string& path,
                 const std::string& name) {
  auto* dst = static_cast<char*>(out);
  while (n > 0) {
    const ssize_t k = ::pread(fd, dst, static_cast<size_t>(n), at);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      throw Error(detail::str_cat(kReadOp, " reading tensor '", name, "' from ", path, ": ",
                                  k < 0 ? std::strerror(errno) : "the file ends early (truncated)",
                                  " at byte ", at));
    }
    dst += k;
    at += k;
    n -= k;
  }
}

}  // namespace

struct ShardedCheckpoint::Verified {
  std::mutex mu;
  std::set<std::pair<std::string, size_t>> pieces;
};

ShardedCheckpoint::ShardedCheckpoint(const std::string& dir)
    : dir_(dir), verified_(std::make_shared<Verified>()) {
  const std::string path = (fs::path(dir) / kIndexName).string();
  const Json index = read_index(path);
  EMBER_CHECK(field<std::string>(index, "format", path, "") == kFormat, kReadOp, " ", path,
              ": format is not ", kFormat);
  const int version = field<int>(index, "version", path, "");
  EMBER_CHECK(version >= 1 && version <= kVersion, kReadOp, " ", path, ": format version ",
              version, ", this reader knows 1 to ", kVersion);
  save_id_ = field<std::string>(index, "save_id", path, "");
  world_size_ = field<int>(index, "world_size", path, "");
  EMBER_CHECK(world_size_ > 0, kReadOp, " ", path, ": world_size ", world_size_);
  metadata_ = field<std::map<std::string, std::string>>(index, "metadata", path, "");
  if (index.contains("rank_metadata")) {
    rank_metadata_ =
        field<std::vector<std::map<std::string, std::string>>>(index, "rank_metadata", path, "");
    EMBER_CHECK(static_cast<int>(rank_metadata_.size()) == world_size_, kReadOp, " ", path,
                ": rank_metadata has ", rank_metadata_.size(), " entries for ", world_size_,
                " ranks");
  }
  std::map<int, std::pair<int64_t, std::string>> needed;  // rank -> bytes, a tensor there
  for (const Json& t : field<Json>(index, "tensors", path, "")) {
    const std::string name = field<std::string>(t, "name", path, "a tensor ");
    EMBER_CHECK(!entries_.count(name), kReadOp, " ", path, ": tensor '", name, "' appears twice");
    Entry e = parse_entry(t, name, world_size_, path);
    for (const Piece& p : e.pieces) {
      const int64_t end = p.file_offset + p.numel * itemsize(e.dtype);
      if (end > needed[p.rank].first) needed[p.rank] = {end, name};
    }
    order_.push_back(name);
    entries_.emplace(name, std::move(e));
  }
  for (const auto& [rank, need] : needed) {
    const std::string file = rank_file(rank);
    struct stat st {};
    EMBER_CHECK(::stat(file.c_str(), &st) == 0, kReadOp, " rank ", rank, "'s file ", file,
                " is missing (", std::strerror(errno), "); the index names it for tensor '",
                need.second, "'");
    EMBER_CHECK(st.st_size >= need.first, kReadOp, " rank ", rank, "'s file ", file,
                " is truncated: ", st.st_size, " bytes, but tensor '", need.second,
                "' ends at byte ", need.first);
  }
}

std::map<std::string, std::string> ShardedCheckpoint::rank_metadata(int rank) const {
  if (rank < 0 || rank >= static_cast<int>(rank_metadata_.size())) return {};
  return rank_metadata_[static_cast<size_t>(rank)];
}

const ShardedCheckpoint::Entry& ShardedCheckpoint::entry(const std::string& name) const {
  auto it = entries_.find(name);
  EMBER_CHECK_TYPE(IndexError, it != entries_.end(), kReadOp, " no tensor '", name,
                   "' in the checkpoint ", dir_, " (it has ", order_.size(), " tensors)");
  return it->second;
}

const std::vector<int64_t>& ShardedCheckpoint::shape(const std::string& name) const {
  return entry(name).shape;
}
Dtype ShardedCheckpoint::dtype(const std::string& name) const { return entry(name).dtype; }
int64_t ShardedCheckpoint::numel(const std::string& name) const {
  return numel_of(entry(name).shape);
}

std::string ShardedCheckpoint::rank_file(int rank) const {
  return (fs::path(dir_) / rank_file_name(save_id_, rank)).string();
}

Tensor ShardedCheckpoint::read(const std::string& name, int64_t offset, int64_t numel,
                               const Box& box) const {
  EMBER_CHECK_TYPE(IndexError, numel >= 0, kReadOp, " read('", name, "', offset ", offset,
                   ", numel ", numel, "): negative numel");
  Tensor out = empty({numel}, dtype(name));
  read_into(name, offset, out, box);
  return out;
}

void ShardedCheckpoint::read_into(const std::string& name, int64_t offset, Tensor& out,
                                  const Box& box) const {
  const Entry& e = entry(name);
  EMBER_CHECK(out.defined() && (out.is_cpu() || out.is_cuda()) && out.is_contiguous() &&
                  out.dim() == 1 && out.dtype() == e.dtype,
              kReadOp, " read_into('", name,
              "'): expected a contiguous 1-D CPU or CUDA tensor of dtype ", e.dtype, ", got ",
              out.defined()
                  ? detail::str_cat(out.dtype(), " ", out.shape(), " on ", out.device().str(),
                                    out.is_contiguous() ? "" : ", strided")
                  : "an undefined tensor");
  if (out.is_cuda()) {  // pread fills host memory: the bytes go through a host buffer
    out.copy_(read(name, offset, out.numel(), box));
    return;
  }
  const std::string bad_box = box_error(e.shape, box);
  EMBER_CHECK_TYPE(IndexError, bad_box.empty(), kReadOp, " read('", name, "') of shape ",
                   shape_str(e.shape), ": ", bad_box);
  const int64_t numel = out.numel(), total = box_numel(e.shape, box);
  EMBER_CHECK_TYPE(IndexError, offset >= 0 && offset <= total - numel, kReadOp, " read('", name,
                   "', offset ", offset, ", numel ", numel, "): outside the ",
                   box.whole() ? "tensor's " : "box's ", total, " elements");
  const int64_t isz = itemsize(e.dtype);
  std::map<int, Fd> files;  // each file opened once per read
  char* dst = static_cast<char*>(out.data_ptr());
  for (const Span& want : spans_of(e.shape, box, offset, numel)) {
    // The first run that ends after want.start, then every run that starts before its end.
    auto it = std::upper_bound(e.runs.begin(), e.runs.end(), want.start,
                               [](int64_t s, const Run& r) { return s < r.start; });
    if (it != e.runs.begin()) --it;
    for (; it != e.runs.end() && it->start < want.start + want.length; ++it) {
      const int64_t lo = std::max(want.start, it->start);
      const int64_t hi = std::min(want.start + want.length, it->start + it->length);
      if (lo >= hi) continue;
      const Piece& p = e.pieces[it->piece];
      // A read of the whole piece is hashed as it lands; a part of one is checked first.
      const bool whole_piece = it->at == 0 && hi - lo == p.numel;
      if (!whole_piece) verify_piece(name, it->piece);
      const std::string file = rank_file(p.rank);
      Fd& f = files[p.rank];
      if (f.fd < 0) f.fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
      if (f.fd < 0) {
        throw Error(detail::str_cat(kReadOp, " reading tensor '", name, "': cannot open ", file,
                                    ": ", std::strerror(errno)));
      }
      char* at = dst + (lo - want.start) * isz;
      pread_exact(f.fd, at, (hi - lo) * isz, p.file_offset + (it->at + lo - it->start) * isz,
                  file, name);
      if (whole_piece) check_piece(name, it->piece, XXH3_64bits(at, static_cast<size_t>((hi - lo) * isz)));
    }
    dst += want.length * isz;
  }
}

// Hashes the piece's bytes in the file, in chunks, once per piece (later reads trust it: the
// file is not expected to change under a reader).
void ShardedCheckpoint::verify_piece(const std::string& name, size_t piece) const {
  const Entry& e = entry(name);
  const Piece& p = e.pieces.at(piece);
  if (!p.checksum) return;
  {
    std::lock_guard<std::mutex> lock(verified_->mu);
    if (verified_->pieces.count({name, piece}) != 0) return;
  }
  const std::string file = rank_file(p.rank);
  Fd f;
  f.fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd < 0) {
    throw Error(detail::str_cat(kReadOp, " reading tensor '", name, "': cannot open ", file, ": ",
                                std::strerror(errno)));
  }
  constexpr int64_t kChunk = 4 << 20;
  std::vector<char> buf(static_cast<size_t>(std::min<int64_t>(kChunk, p.numel * itemsize(e.dtype))));
  XXH3_state_t* st = XXH3_createState();
  EMBER_CHECK_TYPE(Error, st != nullptr, kReadOp, " out of memory for a checksum state");
  struct Free {
    XXH3_state_t* s;
    ~Free() { XXH3_freeState(s); }
  } free_state{st};
  XXH3_64bits_reset(st);
  const int64_t bytes = p.numel * itemsize(e.dtype);
  for (int64_t done = 0; done < bytes;) {
    const int64_t n = std::min<int64_t>(kChunk, bytes - done);
    pread_exact(f.fd, buf.data(), n, p.file_offset + done, file, name);
    XXH3_64bits_update(st, buf.data(), static_cast<size_t>(n));
    done += n;
  }
  check_piece(name, piece, XXH3_64bits_digest(st));
}

// Throws unless `got` is the piece's checksum; remembers a piece that passed.
void ShardedCheckpoint::check_piece(const std::string& name, size_t piece, uint64_t got) const {
  const Piece& p = entry(name).pieces.at(piece);
  if (!p.checksum) return;
  if (got != *p.checksum) {
    throw Error(detail::str_cat(kReadOp, " tensor '", name, "': its piece of ", p.numel,
                                " elements at byte ", p.file_offset, " of ", rank_file(p.rank),
                                " fails its checksum (xxh3 ", hex64(got), ", the index says ",
                                hex64(*p.checksum),
                                "): the file is corrupted or belongs to another save"));
  }
  std::lock_guard<std::mutex> lock(verified_->mu);
  verified_->pieces.insert({name, piece});
}

void ShardedCheckpoint::verify() const {
  for (const std::string& name : order_) {
    for (size_t i = 0; i < entry(name).pieces.size(); ++i) verify_piece(name, i);
  }
}

Tensor ShardedCheckpoint::read_full(const std::string& name) const {
  return read(name, 0, numel(name)).reshape(shape(name));
}

Tensor ShardedCheckpoint::read_box(const std::string& name, const Box& box) const {
  if (box.whole()) return read_full(name);
  const std::string bad_box = box_error(shape(name), box);
  EMBER_CHECK_TYPE(IndexError, bad_box.empty(), kReadOp, " read_box('", name, "') of shape ",
                   shape_str(shape(name)), ": ", bad_box);
  return read(name, 0, numel_of(box.shape), box).reshape(box.shape);
}

void ShardedCheckpoint::consolidate(const std::string& out_file) const {
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const std::string& name : order_) tensors.emplace_back(name, read_full(name));
  nn::save_safetensors(out_file, tensors, metadata_);
}

}  // namespace ember::dist

namespace ember::dist::detail {
void set_sharded_save_hook(std::function<void(int rank)> hook) {
  std::lock_guard<std::mutex> lock(dist::hook_mutex());
  dist::save_hook() = std::move(hook);
}
}  // namespace ember::dist::detail
