#include <ember/nn/data/mnist.h>

#include <zlib.h>

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

namespace ember::nn::data {

namespace {

bool ends_with(const std::string& s, const char* suffix) {
  const size_t n = std::strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

// The bytes of one data file, read in order: gunzipped when the name ends in ".gz". Only a
// regular file is read (a directory, a FIFO or a symlink to /dev/zero is refused by name), so
// reading ends; how much is read is the caller's choice (read_idx reads what the header
// declares).
class ByteReader {
 public:
  explicit ByteReader(std::string path) : path_(std::move(path)) {
    namespace fs = std::filesystem;
    std::error_code ec;
    const fs::file_status st = fs::status(path_, ec);  // follows symlinks
    EMBER_CHECK(!ec, "[MNIST] cannot open ", path_, ": ", ec.message());
    EMBER_CHECK(!fs::is_directory(st), "[MNIST] ", path_, " is a directory, expected a file");
    EMBER_CHECK(fs::is_regular_file(st), "[MNIST] ", path_,
                " is not a regular file (a device, FIFO or socket cannot be a data set)");
    size_ = fs::file_size(path_, ec);
    errno = 0;
    if (ends_with(path_, ".gz")) {
      gz_ = gzopen(path_.c_str(), "rb");
      EMBER_CHECK(gz_ != nullptr, "[MNIST] cannot open ", path_, ": ",
                  errno ? std::strerror(errno) : "out of memory");
      gzbuffer(gz_, 1 << 20);
    } else {
      plain_ = std::fopen(path_.c_str(), "rb");
      EMBER_CHECK(plain_ != nullptr, "[MNIST] cannot open ", path_, ": ", std::strerror(errno));
    }
  }
  ~ByteReader() {
    if (gz_ != nullptr) gzclose(gz_);
    if (plain_ != nullptr) std::fclose(plain_);
  }
  ByteReader(const ByteReader&) = delete;
  ByteReader& operator=(const ByteReader&) = delete;

  // Reads up to n bytes into dst; fewer only at the end of the data. Throws ValueError naming
  // the file when it is not gzip (under a .gz name), or its stream is corrupt or truncated.
  size_t read(char* dst, size_t n) {
    size_t done = 0;
    while (done < n) {
      const size_t want = std::min<size_t>(n - done, 1u << 30);
      size_t got = 0;
      if (gz_ != nullptr) {
        const int r = gzread(gz_, dst + done, static_cast<unsigned>(want));
        if (r < 0) {
          int code = 0;
          throw ValueError(detail::str_cat("[MNIST] corrupt or truncated gzip file ", path_, ": ",
                                           gzerror(gz_, &code)));
        }
        // zlib reads a file without a gzip header "transparently", as plain bytes: refuse
        // that, so a wrong file is reported rather than parsed.
        EMBER_CHECK(gzdirect(gz_) == 0, "[MNIST] ", path_, " is not a gzip file (no gzip header)");
        got = static_cast<size_t>(r);
      } else {
        got = std::fread(dst + done, 1, want, plain_);
        EMBER_CHECK(!std::ferror(plain_), "[MNIST] error reading ", path_, ": ",
                    std::strerror(errno));
      }
      if (got == 0) break;
      done += got;
    }
    return done;
  }

  // Reads on, keeping nothing, up to `limit` bytes; returns how many there were (limit + 1: more
  // than limit).
  uint64_t skip(uint64_t limit) {
    std::array<char, 1 << 12> scratch;
    uint64_t n = 0;
    while (n <= limit) {
      const size_t got = read(scratch.data(), scratch.size());
      if (got == 0) break;
      n += got;
    }
    return std::min(n, limit + 1);
  }

  // The most bytes the file can yield: its size, or for gzip the size times deflate's largest
  // expansion (1032:1, zlib's technical notes), so an impossible header is caught unread.
  uint64_t most_bytes() const { return gz_ != nullptr ? size_ * 1032 + 1024 : size_; }

  // Ends a gzip stream: its trailer (CRC, length) is checked here.
  void close() {
    if (gz_ == nullptr) return;
    const int closed = gzclose(gz_);
    gz_ = nullptr;
    EMBER_CHECK(closed == Z_OK, "[MNIST] corrupt or truncated gzip file ", path_,
                ": the gzip stream ends early (zlib error ", closed, ")");
  }

 private:
  std::string path_;
  uint64_t size_ = 0;
  gzFile gz_ = nullptr;
  std::FILE* plain_ = nullptr;
};

constexpr uint32_t kSide = 28;

uint32_t be32(const std::string& b, size_t at) {
  const auto* p = reinterpret_cast<const unsigned char*>(b.data() + at);
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

// root/name.gz, else root/name uncompressed, else an error naming both.
std::string find_file(const std::string& root, const std::string& name) {
  namespace fs = std::filesystem;
  const fs::path gz = fs::path(root) / (name + ".gz");
  const fs::path raw = fs::path(root) / name;
  std::error_code ec;
  if (fs::exists(gz, ec)) return gz.string();
  if (fs::exists(raw, ec)) return raw.string();
  EMBER_CHECK(false, "[MNIST] cannot open ", gz.string(), ": no such file (nor an uncompressed ",
              raw.string(), ")");
  return {};
}

// One IDX file of unsigned bytes: its item count and its bytes, the header included.
struct Idx {
  std::string bytes;
  int64_t count = 0;
  size_t header = 0;  // where the payload starts
};

std::string dims_text(const std::vector<uint32_t>& dims) {
  std::string out;
  for (uint32_t d : dims) {
    if (!out.empty()) out += 'x';
    out += std::to_string(d);
  }
  return out;
}

// Reads an IDX file of unsigned-byte `items`, each of the sizes `item_dims` (28x28 images;
// labels have none). The header (magic, count, sizes) is checked before the payload, and then
// only what the header declares is read (and the length of anything after it, up to a bound):
// a header that claims more than the file holds cannot make the reader allocate more than the
// bytes really there.
Idx read_idx(const std::string& path, const std::vector<uint32_t>& item_dims, const char* items) {
  const size_t header = 8 + 4 * item_dims.size();
  const uint32_t magic = 0x800 | static_cast<uint32_t>(1 + item_dims.size());
  uint64_t item_bytes = 1;
  for (uint32_t d : item_dims) item_bytes *= d;

  ByteReader in(path);
  std::string b(header, '\0');
  b.resize(in.read(b.data(), header));
  if (b.size() < header) in.close();  // a broken gzip stream says so before "truncated"
  EMBER_CHECK(b.size() >= header, "[MNIST] ", path, " is truncated: it holds ", b.size(),
              " bytes, less than the ", header, "-byte IDX header");
  const uint32_t got = be32(b, 0);
  EMBER_CHECK(got == magic, "[MNIST] ", path, " has magic number ", hex32(got), ", expected ",
              hex32(magic), " (IDX unsigned bytes, ", magic & 0xff, " dims)");
  std::vector<uint32_t> dims;
  for (size_t k = 0; k < item_dims.size(); ++k) dims.push_back(be32(b, 8 + 4 * k));
  EMBER_CHECK(dims == item_dims, "[MNIST] ", path, " holds ", items, " of ", dims_text(dims),
              ", expected ", dims_text(item_dims));
  const uint64_t n = be32(b, 4);
  const uint64_t want = header + n * item_bytes;
  EMBER_CHECK(want <= in.most_bytes(), "[MNIST] ", path, " is truncated: its header declares ", n,
              " ", items, " (", want, " bytes) but the file can hold at most ", in.most_bytes(),
              " bytes");
  // Grow with the data actually read, never to the declared size up front.
  constexpr size_t kChunk = size_t{4} << 20;
  while (b.size() < want) {
    const size_t old = b.size();
    const size_t step = static_cast<size_t>(std::min<uint64_t>(kChunk, want - old));
    b.resize(old + step);
    const size_t read = in.read(b.data() + old, step);
    b.resize(old + read);
    if (read < step) break;
  }
  // Past the declared payload, count a little (for the message), never decompress a bomb.
  constexpr uint64_t kTrailingShown = 1 << 16;
  const uint64_t trailing = b.size() == want ? in.skip(kTrailingShown) : 0;
  if (trailing <= kTrailingShown) in.close();  // else the stream's end was never reached
  EMBER_CHECK(b.size() == want, "[MNIST] ", path, " is truncated: its header declares ", n, " ",
              items, " (", want, " bytes) but it holds ", b.size(), " bytes");
  EMBER_CHECK(trailing == 0, "[MNIST] ", path, " has ",
              trailing > kTrailingShown ? detail::str_cat("more than ", kTrailingShown)
                                        : std::to_string(trailing),
              " unexpected trailing bytes after its ", n, " ", items);
  return {std::move(b), static_cast<int64_t>(n), header};
}

}  // namespace

MNIST::MNIST(const std::string& root, bool train, std::optional<Normalization> normalize)
    : train_(train) {
  if (normalize) {
    EMBER_CHECK(normalize->std != 0.0, "[MNIST] expected a non-zero normalisation std, got ",
                normalize->std);
  }
  const std::string prefix = train ? "train" : "t10k";
  const std::string images_path = find_file(root, prefix + "-images-idx3-ubyte");
  const std::string labels_path = find_file(root, prefix + "-labels-idx1-ubyte");

  const Idx images = read_idx(images_path, {kSide, kSide}, "images");
  const Idx labels = read_idx(labels_path, {}, "labels");
  const int64_t n = images.count;
  EMBER_CHECK(n == labels.count, "[MNIST] image/label count mismatch: ", images_path, " holds ", n,
              " images but ", labels_path, " holds ", labels.count, " labels");

  // ToTensor computes float(pixel) / 255 in float32, and Normalize then (x - mean) / std with
  // float32 mean and std; a 256-entry table gives the same bits for every pixel.
  std::array<float, 256> table{};
  for (int v = 0; v < 256; ++v) {
    float x = static_cast<float>(v) / 255.0f;
    if (normalize) {
      x = (x - static_cast<float>(normalize->mean)) / static_cast<float>(normalize->std);
    }
    table[v] = x;
  }
  Tensor data = empty({n, 1, int64_t{kSide}, int64_t{kSide}}, kFloat32);
  float* out = data.data<float>();
  const auto* px = reinterpret_cast<const unsigned char*>(images.bytes.data() + images.header);
  const int64_t numel = data.numel();
  for (int64_t i = 0; i < numel; ++i) out[i] = table[px[i]];

  Tensor targets = empty({n}, kInt64);
  int64_t* t = targets.data<int64_t>();
  const auto* lb = reinterpret_cast<const unsigned char*>(labels.bytes.data() + labels.header);
  for (int64_t i = 0; i < n; ++i) t[i] = lb[i];
  set_tensors("MNIST", std::move(data), std::move(targets));
}

}  // namespace ember::nn::data
