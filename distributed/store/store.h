// Store: the small key-value service ranks and launcher agents use to find each other
// (torch.distributed's Store). Every blocking call ends by its timeout with DistTimeoutError.
//
// Implementations: TCPStore (distributed/store/tcp_store.h; a Boost.Asio server in one process,
// clients everywhere), FileStore (a file on a shared file system), HashStore (in process, for
// tests and world size 1), PrefixStore (namespaces keys of another store).
//
// Threads: every method may be called from several threads at once.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ember/distributed/errors.h>

namespace ember::dist {

using Bytes = std::vector<uint8_t>;
using Duration = std::chrono::milliseconds;

class Store {
 public:
  /// torch.distributed's default store timeout.
  static constexpr Duration kDefaultTimeout = std::chrono::seconds(300);

  explicit Store(Duration timeout = kDefaultTimeout) : timeout_(timeout) {}
  virtual ~Store() = default;
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  /// Sets key to value (overwriting).
  virtual void set(const std::string& key, const Bytes& value) = 0;
  /// set(), giving up after `timeout` rather than the store's own timeout: for a write that must
  /// not wait long for a store that may be gone with the process that hosted it (a group's
  /// destruction at a job's end, Note [where a rank stands] in detail/gloo_agreement.h). A store
  /// that reaches a server overrides it (TCPStore; PrefixStore passes it on); the default is
  /// set(), bounded by the store's own timeout (HashStore never waits; FileStore and EtcdStore
  /// bound each write by theirs).
  virtual void set_within(const std::string& key, const Bytes& value, Duration timeout) {
    (void)timeout;
    set(key, value);
  }
  /// The value of key, waiting up to the timeout for it to be set.
  virtual Bytes get(const std::string& key, Duration timeout) = 0;
  Bytes get(const std::string& key) { return get(key, timeout()); }
  /// Atomically adds delta to the integer stored at key (0 if missing) and returns the result.
  /// The value is stored as its decimal text, as torch does.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  /// Atomically: if key holds `expected` (or is missing and expected is empty), sets it to
  /// `desired`. Returns the value the key holds afterwards.
  virtual Bytes compare_set(const std::string& key, const Bytes& expected,
                            const Bytes& desired) = 0;
  /// True if every key is set (does not wait).
  virtual bool check(const std::vector<std::string>& keys) = 0;
  /// Waits until every key is set, or throws DistTimeoutError naming the missing keys.
  virtual void wait(const std::vector<std::string>& keys, Duration timeout) = 0;
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout()); }
  /// Removes key; returns whether it existed.
  virtual bool delete_key(const std::string& key) = 0;
  /// Number of keys set.
  virtual int64_t num_keys() = 0;

  /// The default timeout of the calls that take none. Virtual: a wrapper (PrefixStore) shares
  /// its store's.
  virtual Duration timeout() const { return timeout_; }
  virtual void set_timeout(Duration t) { timeout_ = t; }

  // String conveniences.
  void set(const std::string& key, const std::string& value) {
    set(key, Bytes(value.begin(), value.end()));
  }
  std::string get_string(const std::string& key) { return get_string(key, timeout()); }
  std::string get_string(const std::string& key, Duration timeout) {
    const Bytes b = get(key, timeout);
    return std::string(b.begin(), b.end());
  }

 protected:
  Duration timeout_;
};

}  // namespace ember::dist
