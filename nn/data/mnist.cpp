#include "nn/data/mnist.h"

#include <zlib.h>

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

namespace ember::nn::data {

namespace {

bool ends_with(const std::string& s, const char* suffix) {
  const size_t n = std::strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

std::string read_plain(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EMBER_CHECK(in, "[MNIST] cannot open ", path, ": ", std::strerror(errno));
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EMBER_CHECK(!in.bad(), "[MNIST] error reading ", path, ": ", std::strerror(errno));
  return bytes;
}

// The uncompressed size a gzip file declares in its trailer (ISIZE, modulo 2^32): only a hint
// for reserving memory, 0 when unknown.
size_t gzip_size_hint(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in || in.tellg() < 18) return 0;
  in.seekg(-4, std::ios::end);
  std::array<unsigned char, 4> b{};
  if (!in.read(reinterpret_cast<char*>(b.data()), 4)) return 0;
  const size_t isize = b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<size_t>(b[3]) << 24);
  return std::min<size_t>(isize, size_t{1} << 30);
}

// The bytes of `path`, gunzipped when it ends in ".gz" (throws ValueError naming the file when
// it cannot be opened, is not gzip, or its gzip stream is truncated or corrupt).
std::string read_maybe_gzip(const std::string& path) {
  if (!ends_with(path, ".gz")) return read_plain(path);
  errno = 0;
  gzFile f = gzopen(path.c_str(), "rb");
  EMBER_CHECK(f != nullptr, "[MNIST] cannot open ", path, ": ",
              errno ? std::strerror(errno) : "out of memory");
  std::string out;
  out.reserve(gzip_size_hint(path));
  gzbuffer(f, 1 << 20);
  constexpr unsigned kChunk = 1u << 22;
  std::string error;
  for (;;) {
    const size_t old = out.size();
    out.resize(old + kChunk);
    const int got = gzread(f, out.data() + old, kChunk);
    if (got < 0) {
      int code = 0;
      error = gzerror(f, &code);
      out.resize(old);
      break;
    }
    out.resize(old + static_cast<size_t>(got));
    if (got == 0) break;
  }
  // zlib reads a file without a gzip header "transparently", as plain bytes: refuse that, so a
  // wrong file is reported rather than parsed.
  const bool direct = gzdirect(f) == 1;
  const int closed = gzclose(f);
  EMBER_CHECK(error.empty(), "[MNIST] corrupt or truncated gzip file ", path, ": ", error);
  EMBER_CHECK(!direct, "[MNIST] ", path, " is not a gzip file (no gzip header)");
  EMBER_CHECK(closed == Z_OK, "[MNIST] corrupt or truncated gzip file ", path,
              ": the gzip stream ends early (zlib error ", closed, ")");
  return out;
}

constexpr uint32_t kImagesMagic = 0x00000803;  // IDX: unsigned bytes, 3 dims
constexpr uint32_t kLabelsMagic = 0x00000801;  // IDX: unsigned bytes, 1 dim
constexpr int64_t kSide = 28;

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

// Checks the header and length of an IDX file holding `count` items of `item_bytes` each.
// `header` is the header length; returns the item count.
int64_t check_idx(const std::string& b, const std::string& path, uint32_t magic, size_t header,
                  uint64_t item_bytes, const char* items) {
  EMBER_CHECK(b.size() >= header, "[MNIST] ", path, " is truncated: it holds ", b.size(),
              " bytes, less than the ", header, "-byte IDX header");
  const uint32_t got = be32(b, 0);
  EMBER_CHECK(got == magic, "[MNIST] ", path, " has magic number ", hex32(got), ", expected ",
              hex32(magic), " (IDX unsigned bytes, ", magic & 0xff, " dims)");
  const uint64_t count = be32(b, 4);
  const uint64_t want = header + count * item_bytes;
  EMBER_CHECK(b.size() >= want, "[MNIST] ", path, " is truncated: its header declares ", count, " ",
              items, " (", want, " bytes) but it holds ", b.size(), " bytes");
  EMBER_CHECK(b.size() == want, "[MNIST] ", path, " has ", b.size() - want,
              " unexpected trailing bytes after its ", count, " ", items);
  return static_cast<int64_t>(count);
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

  const std::string images = read_maybe_gzip(images_path);
  if (images.size() >= 16 && be32(images, 0) == kImagesMagic) {
    const uint32_t rows = be32(images, 8);
    const uint32_t cols = be32(images, 12);
    EMBER_CHECK(rows == kSide && cols == kSide, "[MNIST] ", images_path, " holds images of ", rows,
                "x", cols, ", expected 28x28");
  }
  const int64_t n = check_idx(images, images_path, kImagesMagic, 16, kSide * kSide, "images");
  const std::string labels = read_maybe_gzip(labels_path);
  const int64_t n_labels = check_idx(labels, labels_path, kLabelsMagic, 8, 1, "labels");
  EMBER_CHECK(n == n_labels, "[MNIST] image/label count mismatch: ", images_path, " holds ", n,
              " images but ", labels_path, " holds ", n_labels, " labels");

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
  Tensor data = empty({n, 1, kSide, kSide}, kFloat32);
  float* out = data.data<float>();
  const auto* px = reinterpret_cast<const unsigned char*>(images.data() + 16);
  const int64_t numel = data.numel();
  for (int64_t i = 0; i < numel; ++i) out[i] = table[px[i]];

  Tensor targets = empty({n}, kInt64);
  int64_t* t = targets.data<int64_t>();
  const auto* lb = reinterpret_cast<const unsigned char*>(labels.data() + 8);
  for (int64_t i = 0; i < n; ++i) t[i] = lb[i];
  set_tensors("MNIST", std::move(data), std::move(targets));
}

}  // namespace ember::nn::data
