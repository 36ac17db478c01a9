#include <ember/nn/io/atomic_file.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <filesystem>
#include <random>
#include <system_error>

#include <ember/tensor/error.h>

namespace ember::nn {

namespace {

struct Fault {
  detail::AtomicWriteStep step = detail::AtomicWriteStep::kNone;
  int err = 0;
  size_t after_bytes = 0;
  int skip = 0;  // writes that pass `step` unharmed before the fault fires
};
// Thread-local so a test's injected fault cannot hit a write made by another thread.
thread_local Fault t_fault;

// True (with errno set) if the injected fault is for `step`; the fault is then consumed.
bool fault_fires(detail::AtomicWriteStep step) {
  if (t_fault.step != step) return false;
  if (t_fault.skip > 0) {
    --t_fault.skip;
    return false;
  }
  errno = t_fault.err;
  t_fault = Fault{};
  return true;
}

std::string errno_text(int err) { return std::system_category().message(err); }

[[noreturn]] void throw_os_error(const std::string& path, const std::string& what, int err) {
  throw Error(::ember::detail::str_cat("[write_file_atomic] cannot write '", path, "': ", what,
                                       ": ", errno_text(err), " (errno ", err, ")"));
}

// Owns the temp file until commit(): the destructor closes and removes it on any failure path.
class TempFile {
 public:
  TempFile(const std::string& target, const std::filesystem::path& dir)
      : target_(target), dir_(dir) {
    // Clipped so the temp name stays under NAME_MAX (255) even for a long target name.
    const std::string base = std::filesystem::path(target).filename().string().substr(0, 200);
    static std::atomic<uint64_t> counter{0};
    std::random_device rd;
    for (int attempt = 0; attempt < 100; ++attempt) {
      const uint64_t salt = (static_cast<uint64_t>(rd()) << 32) ^ rd();
      path_ = (dir_ / ("." + base + ".tmp-" + std::to_string(::getpid()) + "-" +
                       std::to_string(counter.fetch_add(1)) + "-" + std::to_string(salt % 1000000)))
                  .string();
      if (fault_fires(detail::AtomicWriteStep::kCreate)) break;
      // O_EXCL: never reuse or follow someone else's file; mode 0666 lets the umask decide.
      fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
      if (fd_ >= 0 || errno != EEXIST) break;
    }
    if (fd_ < 0) {
      const int err = errno;
      throw_os_error(target_, "cannot create temp file '" + path_ + "'", err);
    }
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(path_.c_str());
  }

  void write(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      // Linux writes at most ~2 GiB per call; larger requests just come back short.
      size_t chunk = std::min<size_t>(n, size_t{1} << 30);
      ssize_t w;
      const bool faulty = t_fault.step == detail::AtomicWriteStep::kWrite && t_fault.skip == 0;
      if (faulty && written_ == t_fault.after_bytes) {
        w = -1;
        fault_fires(detail::AtomicWriteStep::kWrite);
      } else {
        if (faulty) chunk = std::min(chunk, t_fault.after_bytes - written_);
        w = ::write(fd_, p, chunk);
      }
      if (w < 0) {
        if (errno == EINTR) continue;
        const int err = errno;
        throw_os_error(target_,
                       "write to temp file '" + path_ + "' failed after " +
                           std::to_string(written_) + " bytes",
                       err);
      }
      p += w;
      n -= static_cast<size_t>(w);
      written_ += static_cast<size_t>(w);
    }
  }

  // fsync, close, rename over the target, fsync the directory.
  void commit() {
    if (fault_fires(detail::AtomicWriteStep::kFsync) || ::fsync(fd_) != 0) {
      const int err = errno;
      throw_os_error(target_, "fsync of temp file '" + path_ + "' failed", err);
    }
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) {
      const int err = errno;
      throw_os_error(target_, "close of temp file '" + path_ + "' failed", err);
    }
    if (fault_fires(detail::AtomicWriteStep::kRename) ||
        ::rename(path_.c_str(), target_.c_str()) != 0) {
      const int err = errno;
      throw_os_error(target_, "rename of temp file '" + path_ + "' over it failed", err);
    }
    committed_ = true;
    // The new contents are in place; this only makes the rename durable across a power cut.
    const int dfd = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    const bool injected = fault_fires(detail::AtomicWriteStep::kFsyncDir);
    if (injected || dfd < 0 || ::fsync(dfd) != 0) {
      const int err = errno;
      if (dfd >= 0) ::close(dfd);
      throw_os_error(target_,
                     "the file was replaced, but fsync of its directory '" + dir_.string() +
                         "' failed, so the rename may not survive a power cut",
                     err);
    }
    ::close(dfd);
  }

 private:
  std::string target_;
  std::filesystem::path dir_;
  std::string path_;
  int fd_ = -1;
  size_t written_ = 0;
  bool committed_ = false;
};

}  // namespace

void write_file_atomic(const std::string& path,
                       const std::function<void(const ByteSink& sink)>& produce) {
  EMBER_CHECK(!path.empty(), "[write_file_atomic] expected a file path, got an empty string");
  const std::filesystem::path p(path);
  EMBER_CHECK(p.has_filename(), "[write_file_atomic] expected a file path, got '", path,
              "' (names a directory)");
  const std::filesystem::path dir = p.has_parent_path() ? p.parent_path() : ".";
  TempFile tmp(path, dir);
  produce([&](const void* data, size_t n) { tmp.write(data, n); });
  tmp.commit();
}

void write_file_atomic(const std::string& path, std::string_view bytes) {
  write_file_atomic(path, [&](const ByteSink& sink) { sink(bytes.data(), bytes.size()); });
}

}  // namespace ember::nn

namespace ember::detail {
void inject_atomic_write_fault(AtomicWriteStep step, int err, size_t after_bytes, int skip) {
  nn::t_fault = nn::Fault{step, err, after_bytes, skip};
}
}  // namespace ember::detail
