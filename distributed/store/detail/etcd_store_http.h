// The transport under EtcdStore (distributed/store/etcd_store.cpp): one HTTP/1.1 connection to
// etcd's v3 JSON gateway, over TLS when asked, with every step bounded by a deadline. Internal:
// only the store includes it.
#pragma once

#include <memory>
#include <string>
#include <utility>

#include <ember/distributed/store/detail/store_util.h>

namespace ember::dist::detail {

using TimePoint = dist::detail::StoreClock::time_point;

// A failure below the Store API; EtcdStore turns it into the right DistError with context.
struct IoError {
  enum Kind { kUnreachable, kTimeout, kClosed, kProtocol, kTls } kind;
  std::string what;
};

// An endpoint as parse_endpoint reads it.
struct HostPort {
  std::string host;
  std::string port;
  bool https = false;  // the endpoint said "https://"
};

/// "host:port", "http://host:port", "https://host:port", "[ipv6]:port" or "host" (port 2379);
/// throws ValueError naming what is wrong.
HostPort parse_endpoint(const std::string& endpoint);

/// The PEM files of a store's TLS settings (EtcdStoreOptions' ca_file, cert_file, key_file).
struct TlsFiles {
  std::string ca_file;    ///< "" = the system's trust store
  std::string cert_file;  ///< "" = no client certificate
  std::string key_file;   ///< "" = in cert_file
};
/// A store's TLS settings (a client context shared by its connections). Throws ValueError for
/// files OpenSSL cannot use, naming the file.
class Tls;
std::shared_ptr<Tls> make_tls(const TlsFiles& files);

/// One HTTP/1.1 connection to etcd (over TLS when `tls` is given), opened on first use and kept
/// alive. Used by one thread at a time. Failures are thrown as IoError.
class HttpConnection {
 public:
  HttpConnection(HostPort hp, std::shared_ptr<Tls> tls);
  ~HttpConnection();
  HttpConnection(const HttpConnection&) = delete;
  HttpConnection& operator=(const HttpConnection&) = delete;

  /// POSTs `body` to `target` and returns the reply's status and body. With retry_stale, a
  /// request that fails because a kept-alive connection was closed under it is sent once more
  /// on a new connection (only for requests that may safely run twice).
  std::pair<unsigned, std::string> post(const std::string& target, const std::string& body,
                                        const std::string& authorization, TimePoint deadline,
                                        bool retry_stale);

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ember::dist::detail
