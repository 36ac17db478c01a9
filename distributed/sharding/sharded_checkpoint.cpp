#include <ember/distributed/sharding/sharded_checkpoint.h>

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
#include <sstream>

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
constexpr int kVersion = 1;

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

std::string rank_file_name(const std::string& save_id, int rank) {
  return save_id + ".rank" + std::to_string(rank) + ".safetensors";
}

// The name of a piece inside its rank's file: unique, since a rank's non-empty pieces of one
// tensor do not overlap.
std::string piece_key(const std::string& name, int64_t offset) {
  return name + "@" + std::to_string(offset);
}

// One rank's non-empty piece as every rank sees it after the exchange.
struct Desc {
  int rank = 0;
  int64_t offset = 0;
  int64_t numel = 0;
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
    } else if (p.offset < 0 || p.offset > numel_of(p.shape) - p.data.numel()) {
      what =
          detail::str_cat("covers elements [", p.offset, ", ", p.offset + p.data.numel(),
                          "), outside the ", numel_of(p.shape), " of shape ", shape_str(p.shape));
    }
    if (!what.empty()) {
      return error_json(detail::str_cat("piece ", i, " ('", p.name, "') ", what));
    }
    out["pieces"].push_back({{"name", p.name},
                             {"shape", p.shape},
                             {"dtype", std::string(dtype_name(p.data.dtype()))},
                             {"offset", p.offset},
                             {"numel", p.data.numel()}});
  }
  return out.dump();
}

// Throws ValueError naming the tensor and the ranks unless `descs` (sorted by offset) tile
// [0, numel) exactly.
void check_tiling(const std::string& name, const std::vector<int64_t>& shape,
                  const std::vector<Desc>& descs) {
  const int64_t numel = numel_of(shape);
  const std::string what = "tensor '" + name + "' (shape " + shape_str(shape) + ", " +
                           std::to_string(numel) + " elements): ";
  int64_t end = 0;
  int last = -1;
  for (const Desc& d : descs) {
    EMBER_CHECK(d.offset >= end, kSaveOp, " ", what, "rank ", d.rank, "'s piece [", d.offset, ", ",
                d.offset + d.numel, ") overlaps rank ", last, "'s piece ending at ", end, " on [",
                d.offset, ", ", std::min(end, d.offset + d.numel), ")");
    EMBER_CHECK(
        d.offset <= end, kSaveOp, " ", what, "elements [", end, ", ", d.offset,
        ") are in no rank's piece (a gap ",
        last < 0 ? std::string("before") : "between rank " + std::to_string(last) + "'s piece and",
        " rank ", d.rank, "'s piece)");
    end = d.offset + d.numel;
    last = d.rank;
  }
  EMBER_CHECK(end == numel, kSaveOp, " ", what, "elements [", end, ", ", numel,
              ") are in no rank's piece",
              last < 0 ? std::string(" (no rank gave any)")
                       : " (a gap after rank " + std::to_string(last) + "'s piece)");
}

// The checkpoint's tensors from every rank's descriptors, in order of first appearance; the
// same on every rank, so a violation throws the same error everywhere.
std::vector<std::pair<std::string, ShardedCheckpoint::Entry>> plan_save(
    const std::vector<std::string>& all) {
  std::vector<Json> ranks;
  std::string errors;
  for (size_t r = 0; r < all.size(); ++r) {
    ranks.push_back(Json::parse(all[r]));
    if (ranks.back().contains("error")) {
      errors += detail::str_cat("; rank ", r, ": ", ranks.back()["error"].get<std::string>());
    }
  }
  EMBER_CHECK(errors.empty(), kSaveOp, " bad pieces", errors);
  std::vector<std::pair<std::string, ShardedCheckpoint::Entry>> plan;
  std::map<std::string, size_t> at;
  std::map<std::string, std::pair<int, std::vector<Desc>>> descs;  // first rank, pieces
  for (int r = 0; r < static_cast<int>(ranks.size()); ++r) {
    for (const Json& p : ranks[static_cast<size_t>(r)]["pieces"]) {
      const std::string name = p["name"];
      const auto shape = p["shape"].get<std::vector<int64_t>>();
      const Dtype dtype = dtype_from_name(p["dtype"].get<std::string>());
      auto [it, added] = at.emplace(name, plan.size());
      if (added) {
        plan.push_back({name, {shape, dtype, {}}});
        descs[name].first = r;
      }
      const auto& e = plan[it->second].second;
      const int first = descs[name].first;
      EMBER_CHECK(e.shape == shape, kSaveOp, " tensor '", name, "': rank ", r, " gives shape ",
                  shape_str(shape), " but rank ", first, " gives ", shape_str(e.shape));
      EMBER_CHECK(e.dtype == dtype, kSaveOp, " tensor '", name, "': rank ", r, " gives dtype ",
                  dtype, " but rank ", first, " gives ", e.dtype);
      const int64_t n = p["numel"];
      if (n > 0) descs[name].second.push_back({r, p["offset"].get<int64_t>(), n});
    }
  }
  for (auto& [name, entry] : plan) {
    auto& d = descs[name].second;
    std::stable_sort(d.begin(), d.end(),
                     [](const Desc& a, const Desc& b) { return a.offset < b.offset; });
    check_tiling(name, entry.shape, d);
    for (const Desc& x : d) entry.pieces.push_back({x.rank, x.offset, x.numel, -1});
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

// Writes this rank's non-empty pieces (if any) to its file; returns the outcome as JSON:
// {"offsets": {key: byte offset}} or {"error": why}.
std::string write_rank_file(const std::string& path, const std::vector<ShardPiece>& pieces,
                            int rank) {
  try {
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (const ShardPiece& p : pieces) {
      if (p.data.numel() > 0) tensors.emplace_back(piece_key(p.name, p.offset), p.data.detach());
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
    return Json{{"offsets", offsets}}.dump();
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
      pieces.push_back({{"rank", p.rank},
                        {"offset", p.offset},
                        {"numel", p.numel},
                        {"file_offset", p.file_offset}});
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

void save_sharded(const std::string& dir, const std::vector<ShardPiece>& pieces, ProcessGroup& pg,
                  const std::map<std::string, std::string>& metadata) {
  const int me = pg.rank();
  // The save id travels with rank 0's descriptors: one exchange for both.
  Json mine = Json::parse(describe_pieces(pieces));
  if (me == 0) mine["save_id"] = new_save_id();
  const std::vector<std::string> all = detail::exchange_bytes(pg, mine.dump());
  auto plan = plan_save(all);
  const std::string save_id = Json::parse(all[0])["save_id"];

  std::error_code ec;
  fs::create_directories(dir, ec);  // every rank, in case `dir` is not shared; errors show below
  const std::string path = (fs::path(dir) / rank_file_name(save_id, me)).string();
  const std::vector<std::string> written =
      detail::exchange_bytes(pg, write_rank_file(path, pieces, me));
  try {
    check_outcomes(written, "writing the rank files");
  } catch (...) {
    fs::remove(path, ec);  // the index never names it
    throw;
  }

  std::string outcome = "{}";
  if (me == 0) {
    try {
      std::map<std::string, size_t> at;
      for (size_t i = 0; i < plan.size(); ++i) at[plan[i].first] = i;
      for (auto& [name, e] : plan) {
        for (auto& p : e.pieces) {
          p.file_offset = Json::parse(written[static_cast<size_t>(p.rank)])["offsets"].at(
              piece_key(name, p.offset));
        }
      }
      const Json index = index_json(save_id, pg.size(), metadata, plan);
      nn::write_file_atomic((fs::path(dir) / kIndexName).string(), index.dump(1));
      remove_stale_files(dir, save_id);
    } catch (const std::exception& e) {
      outcome = error_json(e.what());
    }
  }
  const std::vector<std::string> indexed = detail::exchange_bytes(pg, outcome);
  try {
    check_outcomes(indexed, "writing the index");
  } catch (...) {
    fs::remove(path, ec);  // the index was not written, so it never names this file
    throw;
  }
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
  int64_t end = 0;
  for (const Json& p : pieces) {
    ShardedCheckpoint::Piece x{
        field<int>(p, "rank", path, where), field<int64_t>(p, "offset", path, where),
        field<int64_t>(p, "numel", path, where), field<int64_t>(p, "file_offset", path, where)};
    int64_t bytes = 0, file_end = 0;
    EMBER_CHECK(
        x.rank >= 0 && x.rank < world && x.offset == end && x.numel > 0 && x.numel <= total - end &&
            x.file_offset >= 0 && !__builtin_mul_overflow(x.numel, itemsize(e.dtype), &bytes) &&
            !__builtin_add_overflow(x.file_offset, bytes, &file_end),
        kReadOp, " ", path, ": ", where, "has a bad piece ", p.dump(), " (expected rank in [0, ",
        world, "), offset ", end, ", numel in [1, ", total - end, "])");
    end += x.numel;
    e.pieces.push_back(x);
  }
  EMBER_CHECK(end == total, kReadOp, " ", path, ": ", where, "pieces cover ", end, " of the ",
              total, " elements of shape ", shape_str(e.shape));
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

ShardedCheckpoint::ShardedCheckpoint(const std::string& dir) : dir_(dir) {
  const std::string path = (fs::path(dir) / kIndexName).string();
  const Json index = read_index(path);
  EMBER_CHECK(field<std::string>(index, "format", path, "") == kFormat, kReadOp, " ", path,
              ": format is not ", kFormat);
  const int version = field<int>(index, "version", path, "");
  EMBER_CHECK(version == kVersion, kReadOp, " ", path, ": format version ", version,
              ", this reader knows ", kVersion);
  save_id_ = field<std::string>(index, "save_id", path, "");
  world_size_ = field<int>(index, "world_size", path, "");
  EMBER_CHECK(world_size_ > 0, kReadOp, " ", path, ": world_size ", world_size_);
  metadata_ = field<std::map<std::string, std::string>>(index, "metadata", path, "");
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

Tensor ShardedCheckpoint::read(const std::string& name, int64_t offset, int64_t numel) const {
  EMBER_CHECK_TYPE(IndexError, numel >= 0, kReadOp, " read('", name, "', offset ", offset,
                   ", numel ", numel, "): negative numel");
  Tensor out = empty({numel}, dtype(name));
  read_into(name, offset, out);
  return out;
}

void ShardedCheckpoint::read_into(const std::string& name, int64_t offset, Tensor& out) const {
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
    out.copy_(read(name, offset, out.numel()));
    return;
  }
  const int64_t numel = out.numel(), total = numel_of(e.shape);
  EMBER_CHECK_TYPE(IndexError, offset >= 0 && offset <= total - numel, kReadOp, " read('", name,
                   "', offset ", offset, ", numel ", numel, "): outside the tensor's ", total,
                   " elements");
  const int64_t isz = itemsize(e.dtype);
  std::map<int, Fd> files;  // each file opened once per read
  for (const Piece& p : e.pieces) {
    const int64_t lo = std::max(offset, p.offset);
    const int64_t hi = std::min(offset + numel, p.offset + p.numel);
    if (lo >= hi) continue;
    const std::string file = rank_file(p.rank);
    Fd& f = files[p.rank];
    if (f.fd < 0) f.fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
    if (f.fd < 0) {
      throw Error(detail::str_cat(kReadOp, " reading tensor '", name, "': cannot open ", file, ": ",
                                  std::strerror(errno)));
    }
    pread_exact(f.fd, static_cast<char*>(out.data_ptr()) + (lo - offset) * isz, (hi - lo) * isz,
                p.file_offset + (lo - p.offset) * isz, file, name);
  }
}

Tensor ShardedCheckpoint::read_full(const std::string& name) const {
  return read(name, 0, numel(name)).reshape(shape(name));
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
