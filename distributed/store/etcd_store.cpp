// EtcdStore: the Store API on etcd v3's key-value, lease and auth requests, sent as JSON
// through one connection per store (detail/etcd_store_http.h: HTTP or HTTPS, every step
// bounded by the call's deadline).
#include <ember/distributed/store/etcd_store.h>

#include <openssl/evp.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

#include <nlohmann/json.hpp>

#include <ember/distributed/store/detail/etcd_store_http.h>
#include <ember/distributed/store/detail/store_util.h>
#include <ember/tensor/observe/log.h>

namespace ember::dist {

using detail::HostPort;
using detail::HttpConnection;
using detail::IoError;
using detail::parse_endpoint;
using detail::TimePoint;
using detail::Tls;
using dist::detail::quote_key;
using dist::detail::quote_keys;
using dist::detail::StoreClock;
using dist::detail::str_cat;
using json = nlohmann::json;

namespace {

// A poll of get/wait that starts just before the call's deadline still gets this long to be
// answered (as TCPStore's client waits a little beyond the server's own timeout).
constexpr Duration kPollGrace = std::chrono::seconds(2);
constexpr Duration kFirstPoll = std::chrono::milliseconds(1);
constexpr Duration kLastPoll = std::chrono::milliseconds(100);
// etcd refuses transactions of more operations than --max-txn-ops (128 by default).
constexpr size_t kMaxTxnOps = 128;
constexpr int kGrpcUnavailable = 14;
constexpr int kGrpcUnauthenticated = 16;

std::string base64(const std::string& s) {
  std::string out(4 * ((s.size() + 2) / 3), '\0');
  const int n = ::EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                  reinterpret_cast<const unsigned char*>(s.data()),
                                  static_cast<int>(s.size()));
  out.resize(static_cast<size_t>(n));
  return out;
}

std::string base64(const Bytes& b) { return base64(std::string(b.begin(), b.end())); }

// Throws IoError{kProtocol} (reported as a bad reply) unless `text` is base64.
Bytes unbase64(const std::string& text) {
  if (text.size() % 4 != 0) throw IoError{IoError::kProtocol, "a value is not base64"};
  Bytes out(text.size() / 4 * 3);
  const int n = ::EVP_DecodeBlock(out.data(), reinterpret_cast<const unsigned char*>(text.data()),
                                  static_cast<int>(text.size()));
  if (n < 0) throw IoError{IoError::kProtocol, "a value is not base64"};
  // EVP_DecodeBlock counts the padding's zero bytes too.
  size_t pad = 0;
  for (size_t i = text.size(); i > 0 && text[i - 1] == '=' && pad < 2; --i) ++pad;
  out.resize(static_cast<size_t>(n) - pad);
  return out;
}

// etcd's gateway writes int64 fields as JSON strings and leaves out zero values.
int64_t i64_field(const json& j, const char* name) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) return 0;
  if (it->is_number_integer()) return it->get<int64_t>();
  const std::string s = it->get<std::string>();
  try {
    size_t used = 0;
    const int64_t v = std::stoll(s, &used);
    if (used == s.size()) return v;
  } catch (const std::exception&) {
  }
  throw IoError{IoError::kProtocol, str_cat("field ", name, " is not an integer: ", s)};
}

bool bool_field(const json& j, const char* name) {
  auto it = j.find(name);
  return it != j.end() && it->is_boolean() && it->get<bool>();
}

const char* grpc_code_name(int64_t code) {
  static const char* kNames[] = {"OK",
                                 "CANCELLED",
                                 "UNKNOWN",
                                 "INVALID_ARGUMENT",
                                 "DEADLINE_EXCEEDED",
                                 "NOT_FOUND",
                                 "ALREADY_EXISTS",
                                 "PERMISSION_DENIED",
                                 "RESOURCE_EXHAUSTED",
                                 "FAILED_PRECONDITION",
                                 "ABORTED",
                                 "OUT_OF_RANGE",
                                 "UNIMPLEMENTED",
                                 "INTERNAL",
                                 "UNAVAILABLE",
                                 "DATA_LOSS",
                                 "UNAUTHENTICATED"};
  return code >= 0 && code <= 16 ? kNames[code] : "?";
}

// What one request is for, for retries and messages.
struct Call {
  const std::string& op;
  std::vector<std::string> keys;  // full keys, named in messages
  TimePoint deadline;
  Duration timeout;  // the caller's timeout, named in messages
  bool idempotent;
};

std::string about_keys(const std::vector<std::string>& keys) {
  if (keys.empty()) return "";
  return keys.size() == 1 ? str_cat(" for key ", quote_key(keys[0]))
                          : str_cat(" for keys ", quote_keys(keys));
}

// etcd's user/password authentication: the token /v3/auth/authenticate gives, sent as the
// Authorization header of every request. Shared by a store's connections; thread-safe.
class Auth {
 public:
  Auth(std::string user, std::string password)
      : user_(std::move(user)), password_(std::move(password)) {}
  const std::string& user() const { return user_; }
  json credentials() const { return {{"name", user_}, {"password", password_}}; }
  std::string token() const {
    std::lock_guard<std::mutex> lock(mu_);
    return token_;
  }
  void set_token(std::string token) {
    std::lock_guard<std::mutex> lock(mu_);
    token_ = std::move(token);
  }

 private:
  const std::string user_, password_;
  mutable std::mutex mu_;
  std::string token_;  // "" until authenticated, and after etcd called it invalid
};

json request(HttpConnection& conn, const std::string& where, const std::string& path,
             const json& body, const Call& c, Auth* auth);

// Gets a token for `auth` (the request's deadline bounds it).
void authenticate(HttpConnection& conn, const std::string& where, Auth& auth, const Call& c) {
  const std::string op = str_cat(c.op, " (authenticating as '", auth.user(), "')");
  const json r = request(conn, where, "/v3/auth/authenticate", auth.credentials(),
                         Call{op, {}, c.deadline, c.timeout, true}, nullptr);
  auto it = r.find("token");
  if (it == r.end() || !it->is_string() || it->get<std::string>().empty()) {
    throw DistStoreError(str_cat("[", op, "] ", where, " answered no token: ", r.dump()));
  }
  auth.set_token(it->get<std::string>());
}

// Sends one request and returns etcd's JSON reply, or throws the DistError that says what
// failed. While etcd answers UNAVAILABLE (no leader yet, leader changing) an idempotent request
// is retried with backoff until the deadline. With `auth`, the request carries its token,
// fetched first if there is none; when etcd calls the token invalid (a simple token unused for
// --auth-token-ttl, authentication re-enabled) the request, which etcd did not run, is sent
// once more with a new one.
json request(HttpConnection& conn, const std::string& where, const std::string& path,
             const json& body, const Call& c, Auth* auth) {
  auto backoff = std::chrono::milliseconds(10);
  const std::string text = body.dump();
  bool new_token = false;
  for (;;) {
    std::pair<unsigned, std::string> reply;
    try {
      if (auth && auth->token().empty()) authenticate(conn, where, *auth, c);
      reply = conn.post(path, text, auth ? auth->token() : std::string(), c.deadline,
                        c.idempotent);
    } catch (const IoError& e) {
      const std::string about = about_keys(c.keys);
      switch (e.kind) {
        case IoError::kUnreachable:
          throw DistNetworkError(str_cat("[", c.op, "] could not reach ", where, " within ",
                                         c.timeout.count(), " ms", about, " (last error: ", e.what,
                                         ")"));
        case IoError::kTimeout:
          throw DistTimeoutError(str_cat("[", c.op, "] timed out after ", c.timeout.count(), " ms ",
                                         e.what, ": no reply from ", where, about,
                                         "; the connection was closed"));
        case IoError::kClosed:
          throw DistNetworkError(
              str_cat("[", c.op, "] lost the connection to ", where, about, ": ", e.what));
        case IoError::kProtocol:
          throw DistStoreError(str_cat("[", c.op, "] bad reply from ", where, about, ": ", e.what));
        case IoError::kTls:
          throw DistStoreError(str_cat("[", c.op, "] ", where, about, ": ", e.what));
      }
      throw;
    }
    json j = json::parse(reply.second, nullptr, false);
    if (reply.first == 200 && j.is_object()) return j;
    int64_t code = -1;
    std::string message = reply.second.substr(0, 300);
    if (j.is_object()) {
      if (j.contains("code") && j["code"].is_number_integer()) code = j["code"].get<int64_t>();
      if (j.contains("message") && j["message"].is_string()) message = j["message"];
    }
    if (c.idempotent && code == kGrpcUnavailable && dist::detail::ms_until(c.deadline) > 0) {
      dist::detail::backoff_sleep(&backoff, c.deadline, std::chrono::seconds(1));
      continue;
    }
    if (auth && code == kGrpcUnauthenticated && !new_token) {
      auth->set_token("");
      new_token = true;
      continue;
    }
    // etcd's words for a request without credentials while authentication is on.
    const bool needs_user = !auth && message.find("user name is empty") != std::string::npos;
    throw DistStoreError(str_cat("[", c.op, "] ", where, " refused the request", about_keys(c.keys),
                                 ": HTTP ", reply.first, ", gRPC code ", code, " (",
                                 grpc_code_name(code), "): ", message,
                                 needs_user ? " (etcd has authentication enabled: give a user "
                                              "name and password)"
                                            : ""));
  }
}

struct Kv {
  Bytes value;
  int64_t mod_revision = 0;
};

// The first key of a RangeResponse, if any.
std::optional<Kv> first_kv(const json& range) {
  auto it = range.find("kvs");
  if (it == range.end() || it->empty()) return std::nullopt;
  const json& kv = it->at(0);
  Kv out;
  out.value = kv.contains("value") ? unbase64(kv["value"].get<std::string>()) : Bytes{};
  out.mod_revision = i64_field(kv, "mod_revision");
  return out;
}

}  // namespace

class EtcdStore::Impl {
 public:
  Impl(const std::string& endpoint, const EtcdStoreOptions& o)
      : hp_(parse_endpoint(endpoint)),
        where_(str_cat("etcd at ", hp_.https || o.https ? "https://" : "", hp_.host, ":",
                       hp_.port)),
        prefix_(o.prefix),
        tls_(make_tls(endpoint, hp_, o)),
        auth_(o.username.empty() ? nullptr : std::make_unique<Auth>(o.username, o.password)),
        conn_(hp_, tls_) {
    EMBER_CHECK(!o.username.empty() || o.password.empty(),
                "[EtcdStore] a password was given without a user name");
  }

  ~Impl() { stop_keepalive(); }

  const HostPort& host_port() const { return hp_; }
  const std::string& prefix() const { return prefix_; }
  const std::string& where() const { return where_; }
  int64_t lease_id() const { return lease_id_; }

  std::string full_key(const std::string& key) const {
    return prefix_.empty() ? key : prefix_ + "/" + key;
  }

  // Sends one request over the store's connection.
  json call(const std::string& path, const json& body, const Call& c) {
    std::lock_guard<std::mutex> lock(mu_);
    try {
      return request(conn_, where_, path, body, c, auth_.get());
    } catch (const json::exception& e) {
      throw DistStoreError(str_cat("[", c.op, "] bad reply from ", where_, ": ", e.what()));
    }
  }

  // Runs f (which reads etcd's replies), turning a malformed reply into DistStoreError.
  template <class F>
  auto reading(const std::string& op, F&& f) -> decltype(f()) {
    try {
      return f();
    } catch (const json::exception& e) {
      throw DistStoreError(str_cat("[", op, "] unexpected reply from ", where_, ": ", e.what()));
    } catch (const IoError& e) {
      throw DistStoreError(str_cat("[", op, "] unexpected reply from ", where_, ": ", e.what));
    }
  }

  json put_request(const std::string& full, const Bytes& value) const {
    json put = {{"key", base64(full)}, {"value", base64(value)}};
    if (lease_id_ != 0) put["lease"] = std::to_string(lease_id_);
    return put;
  }

  std::optional<Kv> range(const std::string& full, const Call& c) {
    const json r = call("/v3/kv/range", {{"key", base64(full)}}, c);
    return reading(c.op, [&] { return first_kv(r); });
  }

  // Whether each key exists, in transactions of at most kMaxTxnOps ranges.
  std::vector<bool> exist(const std::vector<std::string>& full, const Call& c) {
    std::vector<bool> out;
    out.reserve(full.size());
    for (size_t i = 0; i < full.size(); i += kMaxTxnOps) {
      const size_t n = std::min(kMaxTxnOps, full.size() - i);
      json ops = json::array();
      for (size_t k = i; k < i + n; ++k) {
        ops.push_back({{"request_range", {{"key", base64(full[k])}, {"keys_only", true}}}});
      }
      const json r = call("/v3/kv/txn", {{"success", ops}}, c);
      reading(c.op, [&] {
        const json& rs = r.at("responses");
        if (rs.size() != n) throw IoError{IoError::kProtocol, "wrong number of responses"};
        for (const json& one : rs) out.push_back(i64_field(one.at("response_range"), "count") > 0);
      });
    }
    return out;
  }

  // The number of keys under "<prefix>/": the range ["<prefix>/", "<prefix>0"), '0' following
  // '/'. Without a prefix, "\0" to "\0" is etcd's "every key".
  int64_t num_keys(const Call& c) {
    const std::string start = prefix_.empty() ? std::string(1, '\0') : prefix_ + "/";
    const std::string end = prefix_.empty() ? std::string(1, '\0') : prefix_ + "0";
    const json r =
        call("/v3/kv/range",
             {{"key", base64(start)}, {"range_end", base64(end)}, {"count_only", true}}, c);
    return reading(c.op, [&] { return i64_field(r, "count"); });
  }

  // Optimistic read-modify-write: next(current value or null) says what to write (nullopt:
  // nothing); the write happens only if the key is still as read (same mod_revision, or still
  // missing), else it is retried with the value etcd answered instead.
  void read_modify_write(const std::string& full,
                         const std::function<std::optional<Bytes>(const Bytes*)>& next,
                         const Call& c) {
    std::optional<Kv> cur = range(full, c);
    for (int64_t conflicts = 0;; ++conflicts) {
      const std::optional<Bytes> value = next(cur ? &cur->value : nullptr);
      if (!value) return;
      const json cmp =
          cur ? json{{"target", "MOD"},
                     {"key", base64(full)},
                     {"mod_revision", std::to_string(cur->mod_revision)}}
              : json{{"target", "CREATE"}, {"key", base64(full)}, {"create_revision", "0"}};
      const json txn = {{"compare", json::array({cmp})},
                        {"success", json::array({{{"request_put", put_request(full, *value)}}})},
                        {"failure", json::array({{{"request_range", {{"key", base64(full)}}}}})}};
      const json r = call("/v3/kv/txn", txn, c);
      const bool done = reading(c.op, [&] {
        if (bool_field(r, "succeeded")) return true;
        cur = first_kv(r.at("responses").at(0).at("response_range"));
        return false;
      });
      if (done) return;
      if (dist::detail::ms_until(c.deadline) == 0) {
        throw DistTimeoutError(str_cat("[", c.op, "] gave up after ", c.timeout.count(),
                                       " ms: key ", quote_key(full), " on ", where_,
                                       " changed under each of ", conflicts + 1, " attempts"));
      }
    }
  }

  // Calls ready(call), one poll that returns whether the wait is over, with backoff (kFirstPoll
  // doubling to kLastPoll) until it returns true or `timeout` has passed; then throws
  // DistTimeoutError naming keys and `missing` (which ready may update). Each poll may take
  // until the deadline, and at least kPollGrace, to be answered.
  void poll_until(const std::string& op, Duration timeout, const std::vector<std::string>& keys,
                  const std::vector<std::string>& missing,
                  const std::function<bool(const Call&)>& ready) {
    dist::detail::check_store_timeout(op, timeout);
    const TimePoint deadline = dist::detail::store_deadline(timeout);
    auto backoff = kFirstPoll;
    for (;;) {
      const TimePoint poll_deadline = std::max(deadline, StoreClock::now() + kPollGrace);
      if (ready(Call{op, missing, poll_deadline, timeout, true})) return;
      const int64_t left = dist::detail::ms_until(deadline);
      if (left == 0)
        dist::detail::throw_store_timeout(op, timeout, keys, missing, " on " + where_);
      dist::detail::backoff_sleep(&backoff, deadline, kLastPoll);
    }
  }

  void grant_lease(int64_t ttl_s, Duration timeout) {
    const std::string op = "EtcdStore lease grant";
    const Call c{op, {}, dist::detail::store_deadline(timeout), timeout, true};
    const json r = call("/v3/lease/grant", {{"TTL", ttl_s}}, c);
    lease_id_ = reading(op, [&] { return i64_field(r, "ID"); });
    if (lease_id_ == 0) {
      throw DistStoreError(str_cat("[", op, "] ", where_, " granted no lease: ", r.dump()));
    }
    keepalive_ = std::thread([this, ttl_s, timeout] { keepalive_loop(ttl_s, timeout); });
  }

 private:
  void stop_keepalive() {
    {
      std::lock_guard<std::mutex> lock(ka_mu_);
      stopping_ = true;
    }
    ka_cv_.notify_all();
    if (keepalive_.joinable()) keepalive_.join();
  }

  // Renews the lease every TTL/3 on a connection of its own, so that a long request of the
  // store's users cannot delay it. Failures are logged and retried at the next tick; a lease
  // etcd no longer knows (it expired: etcd was unreachable for a whole TTL) ends the loop, and
  // later writes fail with etcd's "requested lease not found".
  void keepalive_loop(int64_t ttl_s, Duration timeout) {
    const std::string op = "EtcdStore lease keepalive";
    const Duration interval = std::max<Duration>(Duration(ttl_s * 1000 / 3), Duration(100));
    const Duration limit = std::min(timeout, std::max<Duration>(interval, std::chrono::seconds(1)));
    HttpConnection conn(hp_, tls_);
    bool failing = false;
    std::unique_lock<std::mutex> lock(ka_mu_);
    while (!ka_cv_.wait_for(lock, interval, [this] { return stopping_; })) {
      lock.unlock();
      try {
        const Call c{op, {}, dist::detail::store_deadline(limit), limit, true};
        const json r =
            request(conn, where_, "/v3/lease/keepalive", {{"ID", std::to_string(lease_id_)}}, c,
                    auth_.get());
        const int64_t ttl = reading(op, [&] {
          if (!r.contains("result")) throw IoError{IoError::kProtocol, r.dump()};
          return i64_field(r.at("result"), "TTL");
        });
        if (ttl <= 0) {
          logging::error("[", op, "] lease ", lease_id_, " on ", where_,
                         " has expired: etcd has deleted the keys this store wrote");
          return;
        }
        if (failing) logging::info("[", op, "] lease ", lease_id_, " renewed again on ", where_);
        failing = false;
      } catch (const std::exception& e) {
        if (!failing) {
          logging::warn("[", op, "] could not renew lease ", lease_id_, " (TTL ", ttl_s,
                        " s): ", e.what(), "; retrying");
        }
        failing = true;
      }
      lock.lock();
    }
  }

  // The TLS settings when the endpoint or the options ask for https, else null.
  static std::shared_ptr<Tls> make_tls(const std::string& endpoint, const HostPort& hp,
                                       const EtcdStoreOptions& o) {
    if (!hp.https && !o.https) {
      EMBER_CHECK(o.ca_file.empty() && o.cert_file.empty() && o.key_file.empty(),
                  "[EtcdStore] endpoint '", endpoint,
                  "': ca_file, cert_file and key_file are for https; set https or give an "
                  "https:// endpoint");
      return nullptr;
    }
    EMBER_CHECK(o.key_file.empty() || !o.cert_file.empty(), "[EtcdStore] key_file '", o.key_file,
                "' given without cert_file (the client certificate it is the key of)");
    return detail::make_tls({o.ca_file, o.cert_file, o.key_file});
  }

  HostPort hp_;
  std::string where_;
  std::string prefix_;
  int64_t lease_id_ = 0;
  std::shared_ptr<Tls> tls_;  // shared by conn_ and the keepalive thread's connection
  std::unique_ptr<Auth> auth_;  // the same; null without a user name
  std::mutex mu_;             // one request at a time on conn_
  HttpConnection conn_;
  std::thread keepalive_;
  std::mutex ka_mu_;
  std::condition_variable ka_cv_;
  bool stopping_ = false;
};

EtcdStore::EtcdStore(std::string endpoint, EtcdStoreOptions options)
    : Store(options.timeout), impl_(std::make_unique<Impl>(endpoint, options)) {
  dist::detail::check_store_timeout("EtcdStore", options.timeout);
  EMBER_CHECK(options.lease_ttl_s >= 0, "[EtcdStore] lease_ttl_s must be >= 0 (0: no lease), got ",
              options.lease_ttl_s);
  // One request that needs etcd's leader (a linearizable range): the store is usable once it
  // answers, so agents may start before etcd has elected itself.
  const std::string op = "EtcdStore";
  impl_->num_keys(Call{op, {}, dist::detail::store_deadline(timeout_), timeout_, true});
  if (options.lease_ttl_s > 0) impl_->grant_lease(options.lease_ttl_s, options.timeout);
}

EtcdStore::~EtcdStore() = default;

std::string EtcdStore::endpoint() const {
  const auto& hp = impl_->host_port();
  return hp.host.find(':') == std::string::npos ? hp.host + ":" + hp.port
                                                : "[" + hp.host + "]:" + hp.port;
}

const std::string& EtcdStore::prefix() const { return impl_->prefix(); }

int64_t EtcdStore::lease_id() const { return impl_->lease_id(); }

void EtcdStore::set(const std::string& key, const Bytes& value) {
  const std::string op = "EtcdStore set", full = impl_->full_key(key);
  const Call c{op, {full}, dist::detail::store_deadline(timeout_), timeout_, true};
  impl_->call("/v3/kv/put", impl_->put_request(full, value), c);
}

Bytes EtcdStore::get(const std::string& key, Duration timeout) {
  const std::string op = "EtcdStore get", full = impl_->full_key(key);
  const std::vector<std::string> keys{full};
  Bytes value;
  impl_->poll_until(op, timeout, keys, keys, [&](const Call& c) {
    std::optional<Kv> kv = impl_->range(full, c);
    if (kv) value = std::move(kv->value);
    return kv.has_value();
  });
  return value;
}

int64_t EtcdStore::add(const std::string& key, int64_t delta) {
  const std::string op = "EtcdStore add", full = impl_->full_key(key);
  const Call c{op, {full}, dist::detail::store_deadline(timeout_), timeout_, false};
  int64_t result = 0;
  impl_->read_modify_write(
      full,
      [&](const Bytes* cur) -> std::optional<Bytes> {
        const int64_t now = cur ? dist::detail::parse_store_counter(op, full, *cur) : 0;
        result = dist::detail::add_store_counter(op, full, now, delta);
        // Reading a counter (delta 0) does not rewrite it, so it keeps its writer's lease.
        if (cur && delta == 0) return std::nullopt;
        return dist::detail::format_store_counter(result);
      },
      c);
  return result;
}

Bytes EtcdStore::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  const std::string op = "EtcdStore compare_set", full = impl_->full_key(key);
  // Running the transaction twice leaves the same value, so it may be retried.
  const Call c{op, {full}, dist::detail::store_deadline(timeout_), timeout_, true};
  Bytes result;
  impl_->read_modify_write(
      full,
      [&](const Bytes* cur) -> std::optional<Bytes> {
        // torch's semantics: a missing key is created only when expected is empty; otherwise
        // the call answers `expected` although the key stays missing.
        const bool write = cur ? *cur == expected : expected.empty();
        result = write ? desired : cur ? *cur : expected;
        return write ? std::optional<Bytes>(desired) : std::nullopt;
      },
      c);
  return result;
}

Bytes EtcdStore::create_with(const std::string& key, const Bytes& value,
                             const std::vector<std::pair<std::string, Bytes>>& also) {
  const std::string op = "EtcdStore create_with", full = impl_->full_key(key);
  EMBER_CHECK(also.size() < kMaxTxnOps, "[", op, "] at most ", kMaxTxnOps - 1,
              " keys beside ", quote_key(full), " (etcd's --max-txn-ops), got ", also.size());
  json puts = json::array({{{"request_put", impl_->put_request(full, value)}}});
  std::vector<std::string> keys{full};
  for (const auto& [k, v] : also) {
    keys.push_back(impl_->full_key(k));
    puts.push_back({{"request_put", impl_->put_request(keys.back(), v)}});
  }
  // Running it twice leaves the same keys (the second finds `key` there), so it may be retried.
  const Call c{op, keys, dist::detail::store_deadline(timeout_), timeout_, true};
  const json txn = {
      {"compare",
       json::array({{{"target", "CREATE"}, {"key", base64(full)}, {"create_revision", "0"}}})},
      {"success", puts},
      {"failure", json::array({{{"request_range", {{"key", base64(full)}}}}})}};
  const json r = impl_->call("/v3/kv/txn", txn, c);
  return impl_->reading(op, [&] {
    if (bool_field(r, "succeeded")) return value;
    std::optional<Kv> cur = first_kv(r.at("responses").at(0).at("response_range"));
    if (!cur) throw IoError{IoError::kProtocol, "the key that failed the comparison is missing"};
    return cur->value;
  });
}

bool EtcdStore::check(const std::vector<std::string>& keys) {
  const std::string op = "EtcdStore check";
  std::vector<std::string> full;
  for (const auto& k : keys) full.push_back(impl_->full_key(k));
  const Call c{op, full, dist::detail::store_deadline(timeout_), timeout_, true};
  const std::vector<bool> have = impl_->exist(full, c);
  return std::all_of(have.begin(), have.end(), [](bool b) { return b; });
}

void EtcdStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  const std::string op = "EtcdStore wait";
  std::vector<std::string> full;
  for (const auto& k : keys) full.push_back(impl_->full_key(k));
  // A key counts once it has been seen set, even if it is deleted before the others arrive
  // (as TCPStore's server counts).
  std::vector<std::string> missing = dist::detail::unique_keys(full);
  impl_->poll_until(op, timeout, full, missing, [&](const Call& c) {
    const std::vector<bool> have = impl_->exist(missing, c);
    std::vector<std::string> still;
    for (size_t i = 0; i < missing.size(); ++i) {
      if (!have[i]) still.push_back(missing[i]);
    }
    missing = std::move(still);
    return missing.empty();
  });
}

bool EtcdStore::delete_key(const std::string& key) {
  const std::string op = "EtcdStore delete_key", full = impl_->full_key(key);
  const Call c{op, {full}, dist::detail::store_deadline(timeout_), timeout_, true};
  const json r = impl_->call("/v3/kv/deleterange", {{"key", base64(full)}}, c);
  return impl_->reading(op, [&] { return i64_field(r, "deleted") > 0; });
}

int64_t EtcdStore::num_keys() {
  const std::string op = "EtcdStore num_keys";
  return impl_->num_keys(Call{op, {}, dist::detail::store_deadline(timeout_), timeout_, true});
}

}  // namespace ember::dist
