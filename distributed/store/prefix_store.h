// PrefixStore: a view of another Store whose keys all start with "<prefix>/"
// (torch.distributed.PrefixStore), so that several users (process groups, agents) can share
// one store without their keys colliding.
#pragma once

#include <memory>
#include <string>

#include <ember/distributed/store/store.h>

namespace ember::dist {

/// Forwards every call to `store` with each key k replaced by prefix + "/" + k. Errors come
/// from the underlying store and name the full (prefixed) keys. Thread-safe if the underlying
/// store is. Its default timeout starts as the underlying store's.
class PrefixStore : public Store {
 public:
  /// Throws ValueError if store is null.
  PrefixStore(std::string prefix, std::shared_ptr<Store> store);

  using Store::get;
  using Store::set;
  using Store::wait;
  /// The underlying store's, both ways (c10d's PrefixStore): one timeout for every call that
  /// reaches the store through this prefix.
  Duration timeout() const override { return store_->timeout(); }
  void set_timeout(Duration t) override { store_->set_timeout(t); }
  void set(const std::string& key, const Bytes& value) override;
  void set_within(const std::string& key, const Bytes& value, Duration timeout) override;
  Bytes get(const std::string& key, Duration timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, Duration timeout) override;
  bool delete_key(const std::string& key) override;
  /// The underlying store's num_keys(): all its keys, not only this prefix's (as torch).
  int64_t num_keys() override;

  /// The prefix, without the "/" separator.
  const std::string& prefix() const { return prefix_; }
  /// The wrapped store.
  const std::shared_ptr<Store>& underlying_store() const { return store_; }

 private:
  std::string join(const std::string& key) const;
  std::vector<std::string> join(const std::vector<std::string>& keys) const;

  std::string prefix_;
  std::shared_ptr<Store> store_;
};

}  // namespace ember::dist
