// TCPStoreServer's requests: keys, counters, compare-set, and the gets and waits parked until
// their keys are set (detail/tcp_store_server_impl.h).
#include <ember/distributed/store/detail/tcp_store_server_impl.h>

namespace ember::dist {

namespace {
std::vector<std::string> read_keys(wire::PayloadReader& r) {
  uint64_t count = 0;
  if (!r.u64(&count) || count > wire::kMaxKeysPerRequest) {
    throw ProtocolError{"bad key count"};
  }
  std::vector<std::string> keys(count);
  for (auto& k : keys) {
    if (!r.blob(wire::kMaxKeySize, &k)) throw ProtocolError{"bad key"};
  }
  return keys;
}

void expect(bool ok, wire::PayloadReader& r, const char* what) {
  if (!ok || !r.done()) throw ProtocolError{str_cat("malformed ", what, " request")};
}
}  // namespace

void TCPStoreServer::Impl::handle(const std::shared_ptr<Session>& s, uint8_t type,
                                  const wire::Bytes& payload) {
  using wire::FrameWriter;
  using wire::Type;
  wire::PayloadReader r(payload.data(), payload.size());
  std::string key;
  switch (static_cast<Type>(type)) {
    case Type::kSet: {
      wire::Bytes value;
      expect(r.blob(wire::kMaxKeySize, &key) && r.blob(wire::kMaxValueSize, &value), r, "set");
      if (!within_quota(s, key, value.size())) return;
      set_key(key, std::move(value));
      s->send(FrameWriter(Type::kOk).finish());
      return;
    }
    case Type::kGet: {
      uint64_t timeout_ms = 0;
      expect(r.blob(wire::kMaxKeySize, &key) && r.u64(&timeout_ms), r, "get");
      const auto it = data_.find(key);
      if (it != data_.end()) {
        s->send(FrameWriter(Type::kOk).blob(it->second).finish());
      } else {
        park(s, {key}, /*is_get=*/true, timeout_ms);
      }
      return;
    }
    case Type::kAdd: {
      uint64_t delta = 0;
      expect(r.blob(wire::kMaxKeySize, &key) && r.u64(&delta), r, "add");
      int64_t result = 0;
      try {
        const auto it = data_.find(key);
        const int64_t current =
            it == data_.end() ? 0
                              : dist::detail::parse_store_counter("TCPStore add", key, it->second);
        result = dist::detail::add_store_counter("TCPStore add", key, current,
                                                  static_cast<int64_t>(delta));
      } catch (const DistStoreError& e) {
        s->send(FrameWriter(Type::kError).blob(std::string(e.what())).finish());
        return;
      }
      wire::Bytes counter = dist::detail::format_store_counter(result);
      if (!within_quota(s, key, counter.size())) return;
      set_key(key, std::move(counter));
      s->send(FrameWriter(Type::kOk).u64(static_cast<uint64_t>(result)).finish());
      return;
    }
    case Type::kCompareSet: {
      wire::Bytes expected, desired;
      expect(r.blob(wire::kMaxKeySize, &key) && r.blob(wire::kMaxValueSize, &expected) &&
                 r.blob(wire::kMaxValueSize, &desired),
             r, "compare_set");
      const auto it = data_.find(key);
      if (it == data_.end()) {
        // torch: create the key only if expected is empty; else answer `expected`.
        if (expected.empty()) {
          if (!within_quota(s, key, desired.size())) return;
          set_key(key, desired);
          s->send(FrameWriter(Type::kOk).blob(desired).finish());
        } else {
          s->send(FrameWriter(Type::kOk).blob(expected).finish());
        }
      } else {
        if (it->second == expected) {
          if (!within_quota(s, key, desired.size())) return;
          stored_ += static_cast<int64_t>(desired.size()) - static_cast<int64_t>(it->second.size());
          it->second = std::move(desired);
        }
        s->send(FrameWriter(Type::kOk).blob(it->second).finish());
      }
      return;
    }
    case Type::kCheck: {
      const auto keys = read_keys(r);
      expect(true, r, "check");
      bool all = true;
      for (const auto& k : keys) all = all && data_.count(k);
      s->send(FrameWriter(Type::kOk).u64(all ? 1 : 0).finish());
      return;
    }
    case Type::kWait: {
      uint64_t timeout_ms = 0;
      if (!r.u64(&timeout_ms)) throw ProtocolError{"malformed wait request"};
      auto keys = dist::detail::unique_keys(read_keys(r));
      expect(true, r, "wait");
      bool all = true;
      for (const auto& k : keys) all = all && data_.count(k);
      if (all) {
        s->send(FrameWriter(Type::kOk).finish());
      } else {
        park(s, std::move(keys), /*is_get=*/false, timeout_ms);
      }
      return;
    }
    case Type::kDeleteKey: {
      expect(r.blob(wire::kMaxKeySize, &key), r, "delete_key");
      const auto it = data_.find(key);
      const bool existed = it != data_.end();
      if (existed) {
        stored_ -= static_cast<int64_t>(key.size() + it->second.size());
        data_.erase(it);
      }
      s->send(FrameWriter(Type::kOk).u64(existed ? 1 : 0).finish());
      return;
    }
    case Type::kNumKeys: {
      expect(true, r, "num_keys");
      s->send(FrameWriter(Type::kOk).u64(data_.size()).finish());
      return;
    }
    case Type::kJoin: {
      expect(true, r, "join");
      int64_t n = 0;
      {
        std::lock_guard<std::mutex> lock(mu_);
        n = ++workers_;
      }
      cv_.notify_all();
      s->send(FrameWriter(Type::kOk).u64(static_cast<uint64_t>(n)).finish());
      return;
    }
    default:
      throw ProtocolError{str_cat("unknown request type ", int(type))};
  }
}

bool TCPStoreServer::Impl::within_quota(const std::shared_ptr<Session>& s, const std::string& key,
                                        size_t bytes) {
  const auto it = data_.find(key);
  const int64_t now = stored_.load();
  const int64_t after = now + static_cast<int64_t>(bytes) -
                        (it == data_.end() ? -static_cast<int64_t>(key.size())
                                           : static_cast<int64_t>(it->second.size()));
  if (after <= now || static_cast<size_t>(after) <= opts_.max_stored_bytes) return true;
  ++quota_refusals_;
  s->send(wire::FrameWriter(wire::Type::kError)
              .blob(str_cat("the store is full: setting '", key.substr(0, 200), "' to ", bytes,
                            " bytes would make its keys and values ", after,
                            " bytes, past max_stored_bytes ", opts_.max_stored_bytes))
              .finish());
  return false;
}

void TCPStoreServer::Impl::set_key(const std::string& key, wire::Bytes value) {
  const auto old = data_.find(key);
  stored_ += static_cast<int64_t>(value.size()) -
             (old == data_.end() ? -static_cast<int64_t>(key.size())
                                 : static_cast<int64_t>(old->second.size()));
  data_[key] = std::move(value);
  // Waiters are registered only on keys missing when they parked, and a key's list is taken
  // whole the first time it is set, so each waiter counts each of its keys once.
  const auto it = waiting_on_.find(key);
  if (it == waiting_on_.end()) return;
  const std::vector<uint64_t> ids = std::move(it->second);
  waiting_on_.erase(it);
  for (const uint64_t id : ids) {
    const auto w = waiters_.find(id);
    if (w != waiters_.end() && --w->second.missing == 0) complete(id);
  }
}

void TCPStoreServer::Impl::park(const std::shared_ptr<Session>& s, std::vector<std::string> keys,
                                bool is_get, uint64_t timeout_ms) {
  const uint64_t id = next_waiter_++;
  Waiter w;
  w.session = s;
  w.is_get = is_get;
  w.keys = std::move(keys);
  for (const auto& k : w.keys) {
    if (!data_.count(k)) {
      waiting_on_[k].push_back(id);
      ++w.missing;
    }
  }
  w.timer = std::make_unique<asio::steady_timer>(io_, clamp_ms(timeout_ms));
  w.timer->async_wait([this, id](const boost::system::error_code& ec) {
    if (!ec) expire(id);
  });
  s->waiter_ = id;
  waiters_.emplace(id, std::move(w));
  waiting_ = waiters_.size();
}

void TCPStoreServer::Impl::complete(uint64_t id) {
  auto node = waiters_.extract(id);
  waiting_ = waiters_.size();
  Waiter& w = node.mapped();
  w.session->waiter_ = 0;
  if (w.is_get) {
    w.session->send(wire::FrameWriter(wire::Type::kOk).blob(data_.at(w.keys[0])).finish());
  } else {
    w.session->send(wire::FrameWriter(wire::Type::kOk).finish());
  }
}

void TCPStoreServer::Impl::expire(uint64_t id) {
  const auto it = waiters_.find(id);
  if (it == waiters_.end()) return;  // completed or cancelled after the timer fired
  auto node = waiters_.extract(it);
  waiting_ = waiters_.size();
  Waiter& w = node.mapped();
  unregister(id, w);
  std::vector<std::string> missing;
  for (const auto& k : w.keys) {
    if (!data_.count(k)) missing.push_back(k);
  }
  wire::FrameWriter f(wire::Type::kTimeout);
  f.u64(missing.size());
  for (const auto& k : missing) f.blob(k);
  w.session->waiter_ = 0;
  w.session->send(std::move(f).finish());
}

void TCPStoreServer::Impl::unregister(uint64_t id, const Waiter& w) {
  for (const auto& k : w.keys) {
    const auto it = waiting_on_.find(k);
    if (it == waiting_on_.end()) continue;
    std::erase(it->second, id);
    if (it->second.empty()) waiting_on_.erase(it);
  }
}

void TCPStoreServer::Impl::cancel_waiter(uint64_t id) {
  const auto it = waiters_.find(id);
  if (it == waiters_.end()) return;
  unregister(id, it->second);
  waiters_.erase(it);
  waiting_ = waiters_.size();
}

}  // namespace ember::dist
