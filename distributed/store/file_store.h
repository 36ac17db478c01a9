// FileStore: a Store kept in one file (torch.distributed.FileStore), for processes on one
// machine or on machines sharing a file system.
//
// The file is an append-only log of records (set, delete) after an 8-byte magic. Every
// operation takes flock() on the file (shared to read, exclusive to append), reads the records
// appended since its last visit, and for writes appends one record; a record torn by a crashed
// writer is cut off by the next writer. get/wait poll the file (starting at 1 ms, backing off
// to 10 ms) until their timeout: there is no cross-machine notification for files.
// Locks are taken by polling too, so that a dead NFS client cannot block a caller beyond its
// timeout. The log only grows; a store is meant for one job's bootstrap, not as a database.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <unordered_map>

#include <ember/distributed/store/store.h>

namespace ember::dist {

/// A Store in the file at `path`, shared by every FileStore opened on it (any process).
/// Thread-safe. Unlike torch's, delete_key is supported.
class FileStore : public Store {
 public:
  /// Opens the file, creating it if missing (its directory must exist). world_size is the
  /// number of FileStore objects that will use the file (negative: not fixed); when fixed, the
  /// last of them to be destroyed removes the file (torch's clean-up rule).
  /// Throws DistStoreError naming path if the file cannot be opened or is not a FileStore file.
  explicit FileStore(std::string path, int64_t world_size = -1, Duration timeout = kDefaultTimeout);
  ~FileStore() override;

  using Store::get;
  using Store::set;
  using Store::wait;
  void set(const std::string& key, const Bytes& value) override;
  /// Polls until key is set; DistTimeoutError after timeout.
  Bytes get(const std::string& key, Duration timeout) override;
  /// DistStoreError if the key holds a non-integer or the sum overflows.
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  bool check(const std::vector<std::string>& keys) override;
  /// Polls until every key is set; DistTimeoutError naming the missing keys after timeout.
  void wait(const std::vector<std::string>& keys, Duration timeout) override;
  bool delete_key(const std::string& key) override;
  /// The number of keys (the file's internal reference counters are not counted).
  int64_t num_keys() override;

  /// The store's file.
  const std::string& path() const { return path_; }

 private:
  class Lock;
  enum class Space : uint8_t { kUser, kInternal };
  void refresh(const std::string& op, bool exclusive);
  void append(const std::string& op, uint8_t kind, const std::string& key, const Bytes& value);
  int64_t add_locked(Space space, const std::string& op, const std::string& key, int64_t delta);
  // Re-reads the file until ready() (called under the locks) returns true; on timeout throws
  // DistTimeoutError naming keys and *missing.
  void poll_until(const std::string& op, Duration timeout, const std::vector<std::string>& keys,
                  const std::function<bool()>& ready, const std::vector<std::string>* missing);

  std::string path_;
  int64_t world_size_;
  int fd_ = -1;
  std::mutex mu_;     // flock does not exclude threads sharing fd_; this does
  uint64_t pos_ = 0;  // bytes of the file applied to the maps (0: magic not yet checked)
  std::unordered_map<std::string, Bytes> user_;
  std::unordered_map<std::string, Bytes> internal_;
};

}  // namespace ember::dist
