#include <ember/nn/io/serialize.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <string_view>
#include <system_error>
#include <tuple>
#include <unordered_set>

#include <ember/nn/io/atomic_file.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/grad_mode.h>

namespace ember::nn {

// safetensors stores little-endian data; Ember's tensors are in host order. Every platform
// Ember builds for is little-endian, so the bytes are copied as they are.
static_assert(std::endian::native == std::endian::little,
              "safetensors I/O assumes a little-endian host");

namespace {

using Json = nlohmann::ordered_json;  // keeps the header's entry order (the file order)

// The reference implementation refuses headers above 100 MB; so do we, before allocating.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// A valid header nests three levels deep (root -> entry -> shape); anything much deeper is
// refused while parsing, so a hostile "[[[[..." costs neither stack nor memory.
constexpr int kMaxJsonDepth = 8;
constexpr size_t kMaxArrayElements = 64;
// Error messages quote names and JSON values up to this many bytes.
constexpr size_t kMaxQuote = 200;

struct DtypeName {
  Dtype dtype;
  const char* name;
};
constexpr DtypeName kDtypeNames[] = {
    {kBool, "BOOL"},   {kUInt8, "U8"},      {kInt32, "I32"},   {kInt64, "I64"},
    {kFloat16, "F16"}, {kBFloat16, "BF16"}, {kFloat32, "F32"}, {kFloat64, "F64"},
};
constexpr const char* kSupportedDtypes = "BOOL, U8, I32, I64, F16, BF16, F32, F64";
// Valid safetensors dtypes that Ember has no tensor type for.
constexpr std::string_view kForeignDtypes[] = {
    "I8",      "I16",     "U16",     "U32",     "U64",     "C64",         "F4",
    "F6_E2M3", "F6_E3M2", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ",
};

const char* safetensors_dtype(Dtype t) {
  for (const auto& d : kDtypeNames) {
    if (d.dtype == t) return d.name;
  }
  EMBER_INTERNAL_ASSERT(false, "dtype ", t, " has no safetensors name");
}

std::optional<Dtype> parse_dtype(std::string_view s) {
  for (const auto& d : kDtypeNames) {
    if (s == d.name) return d.dtype;
  }
  return std::nullopt;
}

std::string clip(std::string s) {
  if (s.size() > kMaxQuote) {
    s.resize(kMaxQuote);
    s += "...";
  }
  return s;
}

// Escapes control and non-ASCII bytes: parser messages quote raw (maybe invalid) input.
std::string printable(std::string_view s) {
  std::string out;
  for (unsigned char c : s.substr(0, 4 * kMaxQuote)) {
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

std::string json_kind(const Json& j) {
  if (j.is_number_unsigned()) return "unsigned integer";
  if (j.is_number_integer()) return "negative integer";
  return j.type_name();
}

// A malformed file: ValueError naming the file and what is wrong.
template <typename... Args>
[[noreturn]] void bad_file(const std::string& path, const Args&... args) {
  throw ValueError(::ember::detail::str_cat("[load_safetensors] '", path, "': ", args...));
}

// A file that cannot be opened or read: ember::Error with the system's reason.
[[noreturn]] void os_error(const std::string& path, const std::string& what, int err,
                           const char* op = "[load_safetensors]") {
  throw Error(::ember::detail::str_cat(op, " cannot read '", path, "': ", what, ": ",
                                       std::system_category().message(err), " (errno ", err, ")"));
}

// A regular file opened for reading, without blocking on a FIFO; `op` names the reader in
// errors.
class InputFile {
 public:
  explicit InputFile(const std::string& path, const char* op = "[load_safetensors]")
      : path_(path) {
    // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever.
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd_ < 0) {
      const int err = errno;
      os_error(path, "open failed", err, op);
    }
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
      const int err = errno;
      ::close(fd_);
      os_error(path, "fstat failed", err, op);
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd_);
      throw Error(::ember::detail::str_cat(op, " cannot read '", path,
                                           "': not a regular file (a directory, FIFO or device)"));
    }
    size_ = static_cast<uint64_t>(st.st_size);
  }
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;
  ~InputFile() { ::close(fd_); }

  uint64_t size() const { return size_; }

  // Reads exactly n bytes at offset; a file that shrank since open() is a clear error.
  void read_at(void* dst, uint64_t n, uint64_t offset, const char* what) const {
    char* p = static_cast<char*>(dst);
    while (n > 0) {
      const size_t chunk = static_cast<size_t>(std::min<uint64_t>(n, uint64_t{1} << 30));
      const ssize_t r = ::pread(fd_, p, chunk, static_cast<off_t>(offset));
      if (r < 0) {
        if (errno == EINTR) continue;
        const int err = errno;
        os_error(path_, std::string("reading the ") + what + " failed", err);
      }
      if (r == 0) {
        bad_file(path_, "unexpected end of file at byte ", offset, " while reading the ", what,
                 " (the file was truncated while being read?)");
      }
      p += r;
      n -= static_cast<uint64_t>(r);
      offset += static_cast<uint64_t>(r);
    }
  }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// One tensor entry of the header, validated.
struct Entry {
  std::string name;
  Dtype dtype;
  std::vector<int64_t> shape;
  uint64_t begin, end;
};

Json parse_header(const std::string& path, const std::string& text) {
  // Duplicate keys are invalid in safetensors but silently merged by JSON parsers, so they are
  // caught while parsing: one key set per open object.
  std::vector<std::unordered_set<std::string>> keys;
  // The elements of each open array: a header's arrays are shapes and offset pairs, and a long
  // one would cost 16 bytes of tree per 2 bytes of text ("0,") before any field is checked.
  std::vector<size_t> elements;
  auto callback = [&](int depth, nlohmann::detail::parse_event_t ev, Json& parsed) {
    using Ev = nlohmann::detail::parse_event_t;
    if ((ev == Ev::object_start || ev == Ev::array_start) && depth >= kMaxJsonDepth) {
      bad_file(path, "header JSON nests deeper than ", kMaxJsonDepth,
               " levels; a safetensors header nests 3");
    }
    const bool element = ev == Ev::value || ev == Ev::object_start || ev == Ev::array_start;
    if (element && !elements.empty() && ++elements.back() > kMaxArrayElements) {
      bad_file(path, "header JSON has an array of more than ", kMaxArrayElements,
               " elements; a safetensors header's arrays are shapes (at most ", kMaxDims,
               " dims here) and offset pairs");
    }
    if (ev == Ev::array_start) elements.push_back(0);
    if (ev == Ev::array_end && !elements.empty()) elements.pop_back();
    if (ev == Ev::object_start) keys.emplace_back();
    if (ev == Ev::object_end && !keys.empty()) keys.pop_back();
    if (ev == Ev::key && !keys.empty()) {
      const std::string& k = parsed.get_ref<const std::string&>();
      if (!keys.back().insert(k).second) {
        bad_file(path, "header JSON has the key '", clip(k), "' twice",
                 keys.size() == 1 ? " (two tensors with one name)" : "");
      }
    }
    return true;
  };
  // nlohmann's parser ends its input at a NUL byte, so text after one would go unread.
  if (const size_t nul = text.find('\0'); nul != std::string::npos) {
    bad_file(path, "header holds a NUL byte at ", nul, " of its ", text.size(),
             " bytes (JSON text has none)");
  }
  try {
    return Json::parse(text, callback, /*allow_exceptions=*/true, /*ignore_comments=*/false);
  } catch (const Json::exception& e) {
    bad_file(path, "header is not valid JSON: ", printable(e.what()));
  }
}

uint64_t get_unsigned(const std::string& path, const std::string& name, const char* field,
                      const Json& v) {
  if (!v.is_number_unsigned()) {
    bad_file(path, "tensor '", name, "': ", field, " must hold non-negative integers, got ",
             clip(v.dump()), " (", json_kind(v), ")");
  }
  return v.get<uint64_t>();
}

Entry parse_entry(const std::string& path, const std::string& name, const Json& v,
                  uint64_t data_bytes) {
  if (!v.is_object()) {
    bad_file(path, "tensor '", name,
             "': expected an object with dtype, shape and data_offsets, got ", json_kind(v), " ",
             clip(v.dump()));
  }
  for (const auto& item : v.items()) {
    if (item.key() != "dtype" && item.key() != "shape" && item.key() != "data_offsets") {
      bad_file(path, "tensor '", name, "': unexpected field '", clip(item.key()),
               "' (expected dtype, shape and data_offsets)");
    }
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!v.contains(field)) bad_file(path, "tensor '", name, "': missing field '", field, "'");
  }
  Entry e;
  e.name = name;

  const Json& dt = v["dtype"];
  if (!dt.is_string()) {
    bad_file(path, "tensor '", name, "': dtype must be a string, got ", clip(dt.dump()));
  }
  const std::string& ds = dt.get_ref<const std::string&>();
  std::optional<Dtype> dtype = parse_dtype(ds);
  if (!dtype) {
    const bool foreign = std::find(std::begin(kForeignDtypes), std::end(kForeignDtypes), ds) !=
                         std::end(kForeignDtypes);
    bad_file(path, "tensor '", name, "': ", foreign ? "safetensors dtype '" : "unknown dtype '",
             clip(ds), "'", foreign ? " has no Ember equivalent" : "",
             " (supported: ", kSupportedDtypes, ")");
  }
  e.dtype = *dtype;

  const Json& sh = v["shape"];
  if (!sh.is_array()) {
    bad_file(path, "tensor '", name, "': shape must be an array, got ", clip(sh.dump()));
  }
  if (sh.size() > static_cast<size_t>(kMaxDims)) {
    bad_file(path, "tensor '", name, "': shape ", clip(sh.dump()), " has ", sh.size(),
             " dims; Ember supports at most ", kMaxDims);
  }
  // numel, refusing sizes whose product (ignoring zeros) overflows int64, so a 0-size tensor
  // of absurd extent cannot overflow stride arithmetic later.
  uint64_t prod_nonzero = 1;
  bool has_zero = false;
  for (const Json& d : sh) {
    const uint64_t n = get_unsigned(path, name, "shape", d);
    if (n == 0) {
      has_zero = true;
    } else if (__builtin_mul_overflow(prod_nonzero, n, &prod_nonzero) ||
               prod_nonzero > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      bad_file(path, "tensor '", name, "': shape ", clip(sh.dump()), " has too many elements");
    }
    e.shape.push_back(static_cast<int64_t>(n));
  }
  const uint64_t numel = has_zero ? 0 : prod_nonzero;
  uint64_t nbytes = 0;
  if (__builtin_mul_overflow(numel, static_cast<uint64_t>(itemsize(e.dtype)), &nbytes)) {
    bad_file(path, "tensor '", name, "': shape ", clip(sh.dump()), " has too many bytes");
  }

  const Json& off = v["data_offsets"];
  if (!off.is_array() || off.size() != 2) {
    bad_file(path, "tensor '", name, "': data_offsets must be an array [begin, end], got ",
             clip(off.dump()));
  }
  e.begin = get_unsigned(path, name, "data_offsets", off[0]);
  e.end = get_unsigned(path, name, "data_offsets", off[1]);
  if (e.begin > e.end || e.end > data_bytes) {
    bad_file(path, "tensor '", name, "': data_offsets [", e.begin, ", ", e.end,
             "] must satisfy begin <= end <= ", data_bytes,
             " (the size of the data after the header)");
  }
  if (e.end - e.begin != nbytes) {
    bad_file(path, "tensor '", name, "': data_offsets [", e.begin, ", ", e.end, "] span ",
             e.end - e.begin, " bytes, but dtype ", ds, " and shape ", clip(sh.dump()), " need ",
             nbytes);
  }
  return e;
}

}  // namespace

// ---- SafetensorsFile --------------------------------------------------------------------------

SafetensorsFile::SafetensorsFile(std::vector<std::pair<std::string, Tensor>> tensors,
                                 std::map<std::string, std::string> metadata)
    : tensors_(std::move(tensors)), metadata_(std::move(metadata)) {
  index_.reserve(tensors_.size());
  for (size_t i = 0; i < tensors_.size(); ++i) {
    EMBER_CHECK(index_.emplace(tensors_[i].first, i).second,
                "[SafetensorsFile] expected unique tensor names, got '", tensors_[i].first,
                "' twice");
  }
}

const Tensor* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second].second;
}

const Tensor& SafetensorsFile::at(const std::string& name) const {
  const Tensor* t = find(name);
  EMBER_CHECK_TYPE(IndexError, t != nullptr, "[SafetensorsFile] no tensor named '", name,
                   "' (the file has ", tensors_.size(), " tensors)");
  return *t;
}

// ---- save ---------------------------------------------------------------------------------------

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  const size_t n = tensors.size();
  auto check_utf8 = [&](const std::string& s, const char* what) {
    try {
      (void)Json(s).dump();
    } catch (const Json::exception&) {
      EMBER_CHECK(false, "[save_safetensors] '", path, "': ", what, " '", printable(s),
                  "' is not valid UTF-8 (safetensors headers are JSON)");
    }
  };
  std::unordered_set<std::string_view> names;
  for (const auto& [name, t] : tensors) {
    EMBER_CHECK(t.defined(), "[save_safetensors] '", path, "': tensor '", name, "' is undefined");
    EMBER_CHECK(name != "__metadata__", "[save_safetensors] '", path,
                "': '__metadata__' is reserved for the metadata and cannot name a tensor");
    EMBER_CHECK(names.insert(name).second, "[save_safetensors] '", path,
                "': expected unique tensor names, got '", name, "' twice");
    check_utf8(name, "tensor name");
  }
  for (const auto& [k, v] : metadata) {
    check_utf8(k, "metadata key");
    check_utf8(v, "metadata value");
  }

  // Data layout: by decreasing element size, keeping the given order among equal sizes, so
  // each tensor starts at a multiple of its element size (the header ends 8-aligned).
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return tensors[a].second.element_size() > tensors[b].second.element_size();
  });
  std::vector<uint64_t> begin(n);
  uint64_t cursor = 0;
  for (size_t i : order) {
    begin[i] = cursor;
    cursor += static_cast<uint64_t>(tensors[i].second.nbytes());
  }

  Json header = Json::object();
  if (!metadata.empty()) {
    Json meta = Json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header["__metadata__"] = std::move(meta);
  }
  for (size_t i = 0; i < n; ++i) {
    const Tensor& t = tensors[i].second;
    Json entry = Json::object();
    entry["dtype"] = safetensors_dtype(t.dtype());
    entry["shape"] = t.shape().vec();
    entry["data_offsets"] = {begin[i], begin[i] + static_cast<uint64_t>(t.nbytes())};
    header[tensors[i].first] = std::move(entry);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data then starts 8-byte aligned
  EMBER_CHECK(text.size() <= kMaxHeaderBytes, "[save_safetensors] '", path, "': the header of ", n,
              " tensors takes ", text.size(), " bytes; readers refuse more than ", kMaxHeaderBytes);

  write_file_atomic(path, [&](const ByteSink& sink) {
    unsigned char size_le[8];
    for (int k = 0; k < 8; ++k) size_le[k] = static_cast<unsigned char>(text.size() >> (8 * k));
    sink(size_le, 8);
    sink(text.data(), text.size());
    for (size_t i : order) {
      const Tensor& t = tensors[i].second;
      if (t.numel() == 0) continue;
      Tensor c;
      {
        NoGradGuard no_grad;       // a copy for writing, not part of any graph
        c = t.contiguous().cpu();  // contiguous first: on a GPU that is the cheap side
      }
      EMBER_INTERNAL_ASSERT(c.is_cpu() && c.is_contiguous() && c.nbytes() == t.nbytes());
      sink(c.data_ptr(), static_cast<size_t>(c.nbytes()));
    }
  });
}

void save_state_dict(const std::string& path,
                     const std::vector<std::pair<std::string, Tensor>>& state,
                     std::map<std::string, std::string> metadata) {
  metadata.emplace("format", "pt");  // keeps a format the caller gave
  save_safetensors(path, state, metadata);
}

// ---- load ---------------------------------------------------------------------------------------

std::string read_small_file(const std::string& path, uint64_t max_bytes, const char* op) {
  InputFile file(path, op);
  if (file.size() > max_bytes) {
    throw ValueError(::ember::detail::str_cat(op, " '", path, "' holds ", file.size(),
                                              " bytes, more than the ", max_bytes,
                                              " such a file may have: refused unread"));
  }
  std::string text(static_cast<size_t>(file.size()), '\0');
  file.read_at(text.data(), text.size(), 0, "file");
  return text;
}

SafetensorsFile load_safetensors(const std::string& path) {
  InputFile file(path);
  const uint64_t file_size = file.size();
  if (file_size < 8) {
    bad_file(path, "the file has ", file_size, " bytes, too few for the 8-byte header size");
  }
  unsigned char size_le[8];
  file.read_at(size_le, 8, 0, "header size");
  uint64_t header_size = 0;
  for (int k = 7; k >= 0; --k) header_size = (header_size << 8) | size_le[k];
  if (header_size > kMaxHeaderBytes) {
    bad_file(path, "header size ", header_size, " exceeds the limit of ", kMaxHeaderBytes,
             " bytes (file size ", file_size, ")");
  }
  if (header_size > file_size - 8) {
    bad_file(path, "header size ", header_size, " exceeds the ", file_size - 8,
             " bytes after the size field (file size ", file_size, "; truncated file?)");
  }
  std::string text(header_size, '\0');
  file.read_at(text.data(), header_size, 8, "header");
  if (text.empty() || text[0] != '{') {
    bad_file(path, "header must be a JSON object starting with '{', got '",
             printable(std::string_view(text).substr(0, 16)), "'");
  }
  const Json root = parse_header(path, text);
  if (!root.is_object()) bad_file(path, "header must be a JSON object, got ", root.type_name());

  const uint64_t data_start = 8 + header_size;
  const uint64_t data_bytes = file_size - data_start;
  std::map<std::string, std::string> metadata;
  std::vector<Entry> entries;
  for (const auto& item : root.items()) {
    const std::string& key = item.key();
    const Json& v = item.value();
    if (key == "__metadata__") {
      if (v.is_null()) continue;
      if (!v.is_object()) {
        bad_file(path, "__metadata__ must be an object of strings, got ", json_kind(v), " ",
                 clip(v.dump()));
      }
      for (const auto& m : v.items()) {
        if (!m.value().is_string()) {
          bad_file(path, "__metadata__ value of key '", clip(m.key()), "' must be a string, got ",
                   json_kind(m.value()), " ", clip(m.value().dump()));
        }
        metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(path, key, v, data_bytes));
  }

  // The data must be tiled exactly: sorted by offsets, each tensor starts where the previous
  // one ended (zero-size tensors included), and the last one ends at the end of the file.
  std::vector<size_t> order(entries.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::tie(entries[a].begin, entries[a].end, a) <
           std::tie(entries[b].begin, entries[b].end, b);
  });
  uint64_t cursor = 0;
  const Entry* prev = nullptr;
  for (size_t i : order) {
    const Entry& e = entries[i];
    if (e.begin < cursor) {
      bad_file(path, "tensor '", clip(e.name), "' data_offsets [", e.begin, ", ", e.end,
               "] overlap tensor '", clip(prev->name), "' at [", prev->begin, ", ", prev->end, "]");
    }
    if (e.begin > cursor) {
      bad_file(path, "gap in the data: tensor '", clip(e.name), "' begins at ", e.begin,
               " but the data before it ends at ", cursor);
    }
    cursor = e.end;
    prev = &e;
  }
  if (cursor != data_bytes) {
    bad_file(path, "the tensors' data_offsets cover ", cursor, " bytes, but the file has ",
             data_bytes, " bytes of data after the header (file size ", file_size, ", header size ",
             header_size, ")");
  }

  // Everything is checked; allocate (at most file_size bytes in all) and read in file order.
  std::vector<std::pair<std::string, Tensor>> tensors;
  tensors.reserve(entries.size());
  for (const Entry& e : entries) tensors.emplace_back(e.name, empty(e.shape, e.dtype));
  for (size_t i : order) {
    const Entry& e = entries[i];
    if (e.end == e.begin) continue;
    Tensor& t = tensors[i].second;
    file.read_at(t.data_ptr(), e.end - e.begin, data_start + e.begin, "tensor data");
    if (e.dtype == kBool) {
      // A bool byte other than 0 or 1 is undefined behaviour in C++; read it as true.
      auto* p = static_cast<unsigned char*>(t.data_ptr());
      for (uint64_t k = 0; k < e.end - e.begin; ++k) p[k] = p[k] != 0;
    }
  }
  return SafetensorsFile(std::move(tensors), std::move(metadata));
}

}  // namespace ember::nn
