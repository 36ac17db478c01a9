#include <ember/distributed/store/hash_store.h>

#include <ember/distributed/store/detail/store_util.h>

namespace ember::dist {

HashStore::HashStore(Duration timeout) : Store(timeout) {}

void HashStore::set(const std::string& key, const Bytes& value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    map_[key] = value;
  }
  cv_.notify_all();
}

Bytes HashStore::get(const std::string& key, Duration timeout) {
  dist::detail::check_store_timeout("HashStore get", timeout);
  const auto deadline = dist::detail::store_deadline(timeout);
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    auto it = map_.find(key);
    if (it != map_.end()) return it->second;
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && !map_.count(key)) {
      dist::detail::throw_store_timeout("HashStore get", timeout, {key}, {key}, "");
    }
  }
}

int64_t HashStore::add(const std::string& key, int64_t delta) {
  int64_t result = 0;
  bool created = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(key);
    const int64_t current =
        it == map_.end() ? 0 : dist::detail::parse_store_counter("HashStore add", key, it->second);
    result = dist::detail::add_store_counter("HashStore add", key, current, delta);
    created = it == map_.end();
    map_[key] = dist::detail::format_store_counter(result);
  }
  if (created) cv_.notify_all();
  return result;
}

Bytes HashStore::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = map_.find(key);
  if (it == map_.end()) {
    // torch's semantics: a missing key is created only when expected is empty; otherwise the
    // call answers `expected` although the key stays missing.
    if (!expected.empty()) return expected;
    map_.emplace(key, desired);
    lock.unlock();
    cv_.notify_all();
    return desired;
  }
  if (it->second == expected) it->second = desired;
  return it->second;
}

bool HashStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& k : keys) {
    if (!map_.count(k)) return false;
  }
  return true;
}

void HashStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  dist::detail::check_store_timeout("HashStore wait", timeout);
  const auto deadline = dist::detail::store_deadline(timeout);
  // A key counts once it has been seen set, even if it is deleted again before the others
  // arrive (as TCPStore's server counts).
  std::vector<std::string> missing = dist::detail::unique_keys(keys);
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    std::erase_if(missing, [&](const std::string& k) { return map_.count(k) != 0; });
    if (missing.empty()) return;
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout) {
      std::erase_if(missing, [&](const std::string& k) { return map_.count(k) != 0; });
      if (missing.empty()) return;
      dist::detail::throw_store_timeout("HashStore wait", timeout, keys, missing, "");
    }
  }
}

bool HashStore::delete_key(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  return map_.erase(key) != 0;
}

int64_t HashStore::num_keys() {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(map_.size());
}

}  // namespace ember::dist
