// Reading sharded checkpoints (sharded_checkpoint.h): the index, checksums, ranges of any box.
#include <ember/distributed/checkpoint/sharded_checkpoint.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <set>
#include <sstream>
#include <type_traits>

#include <xxhash.h>

#include <ember/distributed/checkpoint/detail/sharded_checkpoint.h>
#include <ember/nn/io/serialize.h>
#include <ember/tensor/ops/creation.h>

namespace ember::dist {

using namespace sharded_format;  // NOLINT: the format's own helpers

namespace {
namespace fs = std::filesystem;
constexpr const char* kReadOp = "[ShardedCheckpoint]";
}  // namespace

namespace {

// A field of the index, or ValueError naming the index file and what is wrong.
// Whether `v` is a JSON integer that I holds. nlohmann converts a float to an integer with a
// cast, undefined outside I's range ("version": 4.4e29, found by fuzz_checkpoint_index) and a
// silent truncation inside it.
template <typename I>
bool holds_integer(const Json& v) {
  if (v.is_number_unsigned()) {
    return v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<I>::max());
  }
  if (!v.is_number_integer()) return false;
  const int64_t x = v.get<int64_t>();
  return x >= static_cast<int64_t>(std::numeric_limits<I>::min()) &&
         static_cast<uint64_t>(x) <= static_cast<uint64_t>(std::numeric_limits<I>::max());
}

template <typename T>
struct IsIntegerVector : std::false_type {};
template <typename I>
struct IsIntegerVector<std::vector<I>> : std::bool_constant<std::is_integral_v<I>> {};

template <typename T>
T field(const Json& j, const char* key, const std::string& path, const std::string& where) {
  EMBER_CHECK(j.is_object() && j.contains(key), kReadOp, " ", path, ": ", where, "has no '", key,
              "'");
  const Json& v = j.at(key);
  auto shown = [&v] {
    const std::string d = v.dump();
    return d.size() > 64 ? d.substr(0, 64) + "..." : d;
  };
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    EMBER_CHECK(holds_integer<T>(v), kReadOp, " ", path, ": ", where, "'", key,
                "' must be an integer in [", std::numeric_limits<T>::min(), ", ",
                std::numeric_limits<T>::max(), "], got ", shown());
  } else if constexpr (IsIntegerVector<T>::value) {
    using I = typename T::value_type;
    EMBER_CHECK(!v.is_array() || std::all_of(v.begin(), v.end(), holds_integer<I>), kReadOp, " ",
                path, ": ", where, "'", key, "' must hold integers in [",
                std::numeric_limits<I>::min(), ", ", std::numeric_limits<I>::max(), "], got ",
                shown());
  }
  try {
    return v.get<T>();
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
        field<int64_t>(p, "numel", path, where), field<int64_t>(p, "file_offset", path, where), {}, std::nullopt};
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

// An index far larger than any checkpoint's (a million tensors of a thousand pieces stay under it)
// is not read: a link to /dev/zero or a huge foreign file must not exhaust memory.
constexpr uint64_t kMaxIndexBytes = uint64_t{1} << 30;

Json read_index(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(path, ec))) {
    throw Error(detail::str_cat(kReadOp, " cannot open the checkpoint index ", path,
                                ": no such file (not a sharded checkpoint, or its save never "
                                "completed)"));
  }
  const std::string text = nn::read_small_file(path, kMaxIndexBytes, kReadOp);
  try {
    return Json::parse(text);
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
