#include <ember/distributed/store/prefix_store.h>

namespace ember::dist {

namespace {
const std::shared_ptr<Store>& checked(const std::shared_ptr<Store>& store,
                                      const std::string& prefix) {
  EMBER_CHECK(store != nullptr, "[PrefixStore] prefix '", prefix,
              "': expected an underlying store, got null");
  return store;
}
}  // namespace

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> store)
    : Store(checked(store, prefix)->timeout()),
      prefix_(std::move(prefix)),
      store_(std::move(store)) {}

std::string PrefixStore::join(const std::string& key) const { return prefix_ + "/" + key; }

std::vector<std::string> PrefixStore::join(const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.push_back(join(k));
  return out;
}

void PrefixStore::set(const std::string& key, const Bytes& value) { store_->set(join(key), value); }

void PrefixStore::set_within(const std::string& key, const Bytes& value, Duration timeout) {
  store_->set_within(join(key), value, timeout);
}

Bytes PrefixStore::get(const std::string& key, Duration timeout) {
  return store_->get(join(key), timeout);
}

int64_t PrefixStore::add(const std::string& key, int64_t delta) {
  return store_->add(join(key), delta);
}

Bytes PrefixStore::compare_set(const std::string& key, const Bytes& expected,
                               const Bytes& desired) {
  return store_->compare_set(join(key), expected, desired);
}

bool PrefixStore::check(const std::vector<std::string>& keys) { return store_->check(join(keys)); }

void PrefixStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  store_->wait(join(keys), timeout);
}

bool PrefixStore::delete_key(const std::string& key) { return store_->delete_key(join(key)); }

int64_t PrefixStore::num_keys() { return store_->num_keys(); }

}  // namespace ember::dist
