#include <ember/distributed/store/file_store.h>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>
#include <thread>

#include <ember/distributed/store/detail/store_util.h>

namespace ember::dist {

using dist::detail::StoreClock;
using dist::detail::str_cat;

namespace {

constexpr char kMagic[8] = {'E', 'M', 'B', 'E', 'R', 'F', 'S', '1'};
// A record: u8 kind | u32 key length | u32 value length | key | value (little-endian).
constexpr size_t kRecordHeader = 9;
enum Kind : uint8_t { kSetUser = 1, kDeleteUser = 2, kSetInternal = 3 };
// Internal counters (torch's FileStore clean-up rule), kept apart from the user's keys.
const std::string kRefCountKey = "refcount";
const std::string kFinishedKey = "finished";

std::string errno_text(int err) { return std::system_category().message(err); }

uint32_t get_u32(const uint8_t* p) {
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
}
void put_u32(uint8_t* p, size_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

// Moves all n bytes at offset with pread or pwrite (`io`), resuming after short transfers and
// EINTR; false with errno set on failure (EIO for an early end of file).
template <typename Io, typename Byte>
bool transfer_at(Io io, int fd, Byte* p, size_t n, uint64_t offset) {
  while (n) {
    const ssize_t k = io(fd, p, n, static_cast<off_t>(offset));
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      if (k == 0) errno = EIO;
      return false;
    }
    p += k;
    n -= static_cast<size_t>(k);
    offset += static_cast<uint64_t>(k);
  }
  return true;
}

bool write_at(int fd, const void* data, size_t n, uint64_t offset) {
  return transfer_at(::pwrite, fd, static_cast<const uint8_t*>(data), n, offset);
}

bool read_at(int fd, void* data, size_t n, uint64_t offset) {
  return transfer_at(::pread, fd, static_cast<uint8_t*>(data), n, offset);
}

}  // namespace

// flock() held for one operation. Taken with LOCK_NB in a loop so that the caller's timeout
// holds even if another process keeps the lock (a stopped process, a lost NFS client).
class FileStore::Lock {
 public:
  Lock(int fd, bool exclusive, StoreClock::time_point deadline, Duration timeout,
       const std::string& op, const std::string& path)
      : fd_(fd) {
    auto nap = std::chrono::microseconds(20);
    for (;;) {
      if (::flock(fd, (exclusive ? LOCK_EX : LOCK_SH) | LOCK_NB) == 0) return;
      if (errno == EINTR) continue;
      if (errno != EWOULDBLOCK) {
        throw DistStoreError(str_cat("[", op, "] cannot lock '", path, "': ", errno_text(errno)));
      }
      const int64_t left = dist::detail::ms_until(deadline);
      if (left == 0) {
        throw DistTimeoutError(str_cat("[", op, "] could not lock '", path, "' within ",
                                       timeout.count(), " ms (another process holds it)"));
      }
      std::this_thread::sleep_for(std::min<std::chrono::microseconds>(nap, Duration(left)));
      nap = std::min<std::chrono::microseconds>(nap * 2, std::chrono::milliseconds(2));
    }
  }
  ~Lock() { ::flock(fd_, LOCK_UN); }
  Lock(const Lock&) = delete;
  Lock& operator=(const Lock&) = delete;

 private:
  int fd_;
};

FileStore::FileStore(std::string path, int64_t world_size, Duration timeout)
    : Store(timeout), path_(std::move(path)), world_size_(world_size) {
  dist::detail::check_store_timeout("FileStore", timeout);
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    throw DistStoreError(str_cat("[FileStore] cannot open '", path_, "': ", errno_text(errno)));
  }
  try {
    std::lock_guard<std::mutex> guard(mu_);
    Lock lock(fd_, true, dist::detail::store_deadline(timeout_), timeout_, "FileStore", path_);
    refresh("FileStore", true);
    add_locked(Space::kInternal, "FileStore", kRefCountKey, 1);
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

FileStore::~FileStore() {
  try {
    std::lock_guard<std::mutex> guard(mu_);
    Lock lock(fd_, true, dist::detail::store_deadline(timeout_), timeout_, "~FileStore", path_);
    // Only if the path still names our file: it may have been cleaned up and re-created.
    struct stat on_disk {
    }, ours{};
    if (::stat(path_.c_str(), &on_disk) == 0 && ::fstat(fd_, &ours) == 0 &&
        on_disk.st_dev == ours.st_dev && on_disk.st_ino == ours.st_ino) {
      refresh("~FileStore", true);
      const int64_t finished = add_locked(Space::kInternal, "~FileStore", kFinishedKey, 1);
      const int64_t refs = add_locked(Space::kInternal, "~FileStore", kRefCountKey, -1);
      if (refs == 0 && world_size_ >= 0 && finished >= world_size_) ::unlink(path_.c_str());
    }
  } catch (...) {
    // A destructor must not throw; the file is then left behind.
  }
  ::close(fd_);
}

void FileStore::refresh(const std::string& op, bool exclusive) {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    throw DistStoreError(str_cat("[", op, "] cannot stat '", path_, "': ", errno_text(errno)));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (pos_ == 0) {
    if (size < sizeof(kMagic)) {
      if (!exclusive) return;  // nobody has written yet
      // A new file, or a magic torn by a crash: (re)write it.
      if (::ftruncate(fd_, 0) != 0 || !write_at(fd_, kMagic, sizeof(kMagic), 0)) {
        throw DistStoreError(str_cat("[", op, "] cannot write '", path_, "': ", errno_text(errno)));
      }
      pos_ = sizeof(kMagic);
      return;
    }
    char magic[sizeof(kMagic)];
    if (!read_at(fd_, magic, sizeof(magic), 0)) {
      throw DistStoreError(str_cat("[", op, "] cannot read '", path_, "': ", errno_text(errno)));
    }
    if (std::memcmp(magic, kMagic, sizeof(kMagic)) != 0) {
      throw DistStoreError(str_cat("[", op, "] '", path_,
                                   "' is not a FileStore file (it holds other data); "
                                   "give the store a new path"));
    }
    pos_ = sizeof(kMagic);
  }
  if (size < pos_) {
    throw DistStoreError(str_cat("[", op, "] '", path_, "' shrank from ", pos_, " to ", size,
                                 " bytes: something other than a FileStore changed it"));
  }
  if (size == pos_) return;
  Bytes buf(size - pos_);
  if (!read_at(fd_, buf.data(), buf.size(), pos_)) {
    throw DistStoreError(str_cat("[", op, "] cannot read '", path_, "': ", errno_text(errno)));
  }
  size_t off = 0;
  while (buf.size() - off >= kRecordHeader) {
    const uint8_t kind = buf[off];
    if (kind != kSetUser && kind != kDeleteUser && kind != kSetInternal) {
      throw DistStoreError(str_cat("[", op, "] '", path_, "' is corrupt: unknown record kind ",
                                   int(kind), " at offset ", pos_ + off));
    }
    const uint64_t klen = get_u32(&buf[off + 1]);
    const uint64_t vlen = get_u32(&buf[off + 5]);
    if (buf.size() - off - kRecordHeader < klen + vlen) break;  // torn tail
    const auto* k = reinterpret_cast<const char*>(&buf[off + kRecordHeader]);
    std::string key(k, klen);
    const auto* v = &buf[off + kRecordHeader + klen];
    if (kind == kSetUser) {
      user_[std::move(key)] = Bytes(v, v + vlen);
    } else if (kind == kDeleteUser) {
      user_.erase(key);
    } else {
      internal_[std::move(key)] = Bytes(v, v + vlen);
    }
    off += kRecordHeader + klen + vlen;
  }
  pos_ += off;
  // Writers hold the exclusive lock while appending, so a partial record seen under it was
  // left by a writer that died mid-write: cut it off so the log stays parseable.
  if (off < buf.size() && exclusive && ::ftruncate(fd_, static_cast<off_t>(pos_)) != 0) {
    throw DistStoreError(str_cat("[", op, "] cannot truncate '", path_, "': ", errno_text(errno)));
  }
}

void FileStore::append(const std::string& op, uint8_t kind, const std::string& key,
                       const Bytes& value) {
  EMBER_CHECK(key.size() <= UINT32_MAX && value.size() <= UINT32_MAX, "[", op,
              "] FileStore keys and values are limited to 4 GiB, got ", key.size(), " and ",
              value.size(), " bytes");
  Bytes rec(kRecordHeader + key.size() + value.size());
  rec[0] = kind;
  put_u32(&rec[1], key.size());
  put_u32(&rec[5], value.size());
  std::memcpy(rec.data() + kRecordHeader, key.data(), key.size());
  if (!value.empty())
    std::memcpy(rec.data() + kRecordHeader + key.size(), value.data(), value.size());
  if (!write_at(fd_, rec.data(), rec.size(), pos_)) {
    const int err = errno;
    [[maybe_unused]] const int rc = ::ftruncate(fd_, static_cast<off_t>(pos_));
    throw DistStoreError(str_cat("[", op, "] cannot write '", path_, "': ", errno_text(err)));
  }
  pos_ += rec.size();
  if (kind == kSetUser) {
    user_[key] = value;
  } else if (kind == kDeleteUser) {
    user_.erase(key);
  } else {
    internal_[key] = value;
  }
}

int64_t FileStore::add_locked(Space space, const std::string& op, const std::string& key,
                              int64_t delta) {
  auto& map = space == Space::kUser ? user_ : internal_;
  const auto it = map.find(key);
  const int64_t current =
      it == map.end() ? 0 : dist::detail::parse_store_counter(op, key, it->second);
  const int64_t result = dist::detail::add_store_counter(op, key, current, delta);
  append(op, space == Space::kUser ? kSetUser : kSetInternal, key,
         dist::detail::format_store_counter(result));
  return result;
}

void FileStore::set(const std::string& key, const Bytes& value) {
  const std::string op = "FileStore set";
  std::lock_guard<std::mutex> guard(mu_);
  Lock lock(fd_, true, dist::detail::store_deadline(timeout_), timeout_, op, path_);
  refresh(op, true);
  append(op, kSetUser, key, value);
}

void FileStore::poll_until(const std::string& op, Duration timeout,
                           const std::vector<std::string>& keys, const std::function<bool()>& ready,
                           const std::vector<std::string>* missing) {
  dist::detail::check_store_timeout(op, timeout);
  const auto deadline = dist::detail::store_deadline(timeout);
  auto nap = std::chrono::milliseconds(1);
  for (;;) {
    {
      std::lock_guard<std::mutex> guard(mu_);
      Lock lock(fd_, false, deadline, timeout, op, path_);
      refresh(op, false);
      if (ready()) return;
    }
    const int64_t left = dist::detail::ms_until(deadline);
    if (left == 0) {
      dist::detail::throw_store_timeout(op, timeout, keys, *missing, str_cat(" in '", path_, "'"));
    }
    std::this_thread::sleep_for(std::min<Duration>(nap, Duration(left)));
    nap = std::min<Duration>(nap * 2, std::chrono::milliseconds(10));
  }
}

Bytes FileStore::get(const std::string& key, Duration timeout) {
  Bytes out;
  const std::vector<std::string> keys{key};
  poll_until(
      "FileStore get", timeout, keys,
      [&] {
        const auto it = user_.find(key);
        if (it == user_.end()) return false;
        out = it->second;
        return true;
      },
      &keys);
  return out;
}

void FileStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  // A key counts once it has been seen set (as TCPStore and HashStore count).
  std::vector<std::string> missing = dist::detail::unique_keys(keys);
  poll_until(
      "FileStore wait", timeout, keys,
      [&] {
        std::erase_if(missing, [&](const std::string& k) { return user_.count(k) != 0; });
        return missing.empty();
      },
      &missing);
}

int64_t FileStore::add(const std::string& key, int64_t delta) {
  const std::string op = "FileStore add";
  std::lock_guard<std::mutex> guard(mu_);
  Lock lock(fd_, true, dist::detail::store_deadline(timeout_), timeout_, op, path_);
  refresh(op, true);
  return add_locked(Space::kUser, op, key, delta);
}

Bytes FileStore::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  const std::string op = "FileStore compare_set";
  std::lock_guard<std::mutex> guard(mu_);
  Lock lock(fd_, true, dist::detail::store_deadline(timeout_), timeout_, op, path_);
  refresh(op, true);
  const auto it = user_.find(key);
  if (it == user_.end()) {
    // torch: create the key only if expected is empty; else answer `expected`.
    if (!expected.empty()) return expected;
    append(op, kSetUser, key, desired);
    return desired;
  }
  if (it->second != expected) return it->second;
  append(op, kSetUser, key, desired);
  return desired;
}

bool FileStore::check(const std::vector<std::string>& keys) {
  const std::string op = "FileStore check";
  std::lock_guard<std::mutex> guard(mu_);
  Lock lock(fd_, false, dist::detail::store_deadline(timeout_), timeout_, op, path_);
  refresh(op, false);
  for (const auto& k : keys) {
    if (!user_.count(k)) return false;
  }
  return true;
}

bool FileStore::delete_key(const std::string& key) {
  const std::string op = "FileStore delete_key";
  std::lock_guard<std::mutex> guard(mu_);
  Lock lock(fd_, true, dist::detail::store_deadline(timeout_), timeout_, op, path_);
  refresh(op, true);
  if (!user_.count(key)) return false;
  append(op, kDeleteUser, key, {});
  return true;
}

int64_t FileStore::num_keys() {
  const std::string op = "FileStore num_keys";
  std::lock_guard<std::mutex> guard(mu_);
  Lock lock(fd_, false, dist::detail::store_deadline(timeout_), timeout_, op, path_);
  refresh(op, false);
  return static_cast<int64_t>(user_.size());
}

}  // namespace ember::dist
