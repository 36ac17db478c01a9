// EtcdStore: a Store kept in an etcd cluster (etcd v3), so that the rendezvous outlives any one
// node of the job (torchrun's `--rdzv-backend etcd`). It speaks etcd's v3 JSON gateway
// (POST /v3/kv/range, /v3/kv/put, /v3/kv/txn, /v3/kv/deleterange, /v3/lease/grant,
// /v3/lease/keepalive; keys and values base64) over HTTP/1.1, one keep-alive connection per
// store. Tested against Debian's etcd-server 3.4.
//
// Keys: every key k is stored in etcd as "<prefix>/k", so that jobs sharing a cluster do not
// collide and num_keys() counts only this store's keys. Several EtcdStore objects (in any
// process) with the same endpoint and prefix see the same keys.
//
// Leases: with lease_ttl_s > 0 the store grants an etcd lease of that TTL, attaches every key it
// writes to it, and renews it from a background thread every TTL/3. When the process dies (or
// the store is destroyed: the lease is not revoked, renewals just stop) etcd deletes those keys
// once the TTL has passed, which is how a dead agent's keys vanish. Keys written by other
// stores keep their own leases (or none).
//
// Atomicity: add and compare_set read the key, then write it in a transaction that compares the
// key's mod_revision (or that it is still missing), retrying with the current value when another
// client got in first; so concurrent adds from any number of clients sum exactly.
// get and wait poll etcd (1 ms, doubling to 100 ms): there is no server-side park as in TCPStore.
//
// TLS: with https (EtcdStoreOptions::https or an "https://" endpoint) every connection is
// HTTPS through Boost.Beast's ssl_stream and OpenSSL: etcd's certificate is verified against
// ca_file (or the system's trust store) and the endpoint's host, and a client certificate is
// presented when given. A TLS failure is not retried: DistStoreError naming the endpoint,
// OpenSSL's reason and what to check.
//
// Authentication: with a user name, every request carries the token etcd gave for the user and
// password; a token etcd calls invalid (expired) is replaced once per request.
//
// Limits: values are bounded by etcd's --max-request-bytes (1.5 MiB by default) less the base64
// and JSON overhead; a larger one fails with etcd's "request is too large".
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ember/distributed/store/store.h>

namespace ember::dist {

/// Options of EtcdStore.
struct EtcdStoreOptions {
  /// Namespace of this store's keys in etcd ("<prefix>/<key>"); "" stores keys as given (and
  /// num_keys() then counts every key in the cluster).
  std::string prefix = "ember";
  /// TTL in seconds of the lease attached to every key this store writes; 0 = no lease (keys
  /// stay until deleted). etcd raises TTLs below its minimum (about 2 s by default).
  int64_t lease_ttl_s = 0;
  /// Default timeout of get/wait, and the limit on connecting and on every other request.
  Duration timeout = Store::kDefaultTimeout;
  /// Speak HTTPS (TLS 1.2 or later, OpenSSL) to etcd; an "https://" endpoint sets it too. etcd's
  /// certificate must chain to a trusted CA and name the endpoint's host or IP address.
  bool https = false;
  /// PEM file of the CA certificate(s) that etcd's certificate must chain to; "" = the system's
  /// trust store (OpenSSL's default paths). torchrun's --rdzv-conf cacert.
  std::string ca_file;
  /// PEM client certificate (chain) presented to an etcd that asks for one (--client-cert-auth),
  /// and its private key ("" = in cert_file). torchrun's --rdzv-conf cert and key.
  std::string cert_file;
  std::string key_file;
  /// etcd's user/password authentication (etcd with auth enabled): the store gets a token
  /// (/v3/auth/authenticate) on its first request and again when etcd says it is invalid.
  /// "" = none. The password travels in the request: use it with https.
  std::string username;
  std::string password;
};

/// A client of the etcd server at `endpoint`. Thread-safe: requests from several threads are
/// serialised over the store's one connection (get/wait hold it only for each poll).
///
/// Errors name the operation, the endpoint, the key(s) and etcd's answer: DistNetworkError when
/// etcd cannot be reached or the connection is lost mid-request (connecting retries refused
/// connections with backoff until the call's timeout), DistTimeoutError when a reply does not
/// come within the timeout or get/wait time out, DistStoreError when etcd refuses a request
/// (with its HTTP status, gRPC code and message) or answers something unreadable. A request that
/// can be repeated safely (all but add's write) is retried once on a fresh connection when a
/// kept-alive connection turns out to be closed, and while etcd answers "unavailable" (no
/// leader yet) until the timeout.
class EtcdStore : public Store {
 public:
  /// `endpoint` is "host:port", "http://host:port", "https://host:port", "[ipv6]:port" or "host"
  /// (port 2379). Connects and, with a lease TTL, grants the lease and starts renewing it.
  /// Throws ValueError for a malformed endpoint, a negative TTL, a non-positive timeout, TLS
  /// files without https or that OpenSSL cannot use (naming the file), a password without a
  /// user name; DistNetworkError if etcd does not answer within options.timeout; DistStoreError
  /// if the TLS session fails (an untrusted server certificate, a client certificate missing or
  /// refused) or etcd refuses the credentials (or asks for some).
  explicit EtcdStore(std::string endpoint, EtcdStoreOptions options = {});
  /// Stops renewing the lease (the keys expire after its TTL) and closes the connection.
  ~EtcdStore() override;

  using Store::get;
  using Store::set;
  using Store::wait;
  void set(const std::string& key, const Bytes& value) override;
  /// Polls until key is set; DistTimeoutError after timeout.
  Bytes get(const std::string& key, Duration timeout) override;
  /// DistStoreError if the key holds a non-integer or the sum overflows. add(key, 0) on an
  /// existing key only reads it (the key keeps the lease of the store that wrote it).
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  bool check(const std::vector<std::string>& keys) override;
  /// Polls until every key has been seen set; DistTimeoutError naming the missing keys.
  void wait(const std::vector<std::string>& keys, Duration timeout) override;
  bool delete_key(const std::string& key) override;
  /// The number of keys under this store's prefix.
  int64_t num_keys() override;

  /// Creates `key` holding `value` unless it exists and, in the same etcd transaction, sets
  /// every key of `also` (whatever they held): readers that find `key` find `also` too, and a
  /// writer that dies leaves all of them or none. Returns what `key` holds afterwards: `value`
  /// when this call created it (the request may be retried, so a lost reply still answers
  /// `value`). The keys carry this store's lease, if any. Throws ValueError for more than 127
  /// keys in `also` (etcd's --max-txn-ops); otherwise the errors of set.
  Bytes create_with(const std::string& key, const Bytes& value,
                    const std::vector<std::pair<std::string, Bytes>>& also);

  /// The endpoint as "host:port".
  std::string endpoint() const;
  /// The key prefix, without the "/" separator.
  const std::string& prefix() const;
  /// The etcd lease this store's keys are attached to, or 0 without a lease.
  int64_t lease_id() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ember::dist
