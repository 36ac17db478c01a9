// HashStore: a Store held in this process's memory (torch.distributed.HashStore), for threads
// of one process, tests, and world size 1.
#pragma once

#include <condition_variable>
#include <mutex>
#include <string>
#include <unordered_map>

#include <ember/distributed/store/store.h>

namespace ember::dist {

/// A thread-safe in-memory Store. Waits block on a condition variable (no polling) and end
/// with DistTimeoutError at their timeout. Not shared across processes.
class HashStore : public Store {
 public:
  /// An empty store whose default timeout (get(key), wait(keys)) is `timeout`.
  explicit HashStore(Duration timeout = kDefaultTimeout);

  using Store::get;
  using Store::set;
  using Store::wait;
  void set(const std::string& key, const Bytes& value) override;
  /// Throws DistTimeoutError if key is not set within timeout; ValueError if timeout <= 0.
  Bytes get(const std::string& key, Duration timeout) override;
  /// Throws DistStoreError if the key holds something other than an int64's decimal text, or
  /// the sum overflows.
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  bool check(const std::vector<std::string>& keys) override;
  /// Throws DistTimeoutError naming the keys still missing at the timeout.
  void wait(const std::vector<std::string>& keys, Duration timeout) override;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;

 private:
  std::mutex mu_;
  std::condition_variable cv_;  // notified whenever a key is created
  std::unordered_map<std::string, Bytes> map_;
};

}  // namespace ember::dist
