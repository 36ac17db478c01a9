// EtcdStore's transport (detail/etcd_store_http.h): etcd v3's JSON gateway over HTTP/1.1 or
// HTTPS (Boost.Beast, OpenSSL).
//
// Every blocking step is an asynchronous Beast operation on the connection's own io_context,
// run to completion by the calling thread, with the stream's expiry set to the call's
// deadline: Beast's synchronous calls have no timeouts, its asynchronous ones do (a timed-out
// operation closes the socket and completes with error::timeout).
#include <ember/distributed/store/detail/etcd_store_http.h>

#include <poll.h>

#include <openssl/ssl.h>
#include <openssl/x509.h>

#include <algorithm>
#include <optional>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/address.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>

#include <ember/tensor/error.h>

namespace ember::dist::detail {

namespace beast = boost::beast;
namespace http = boost::beast::http;
namespace net = boost::asio;
namespace ssl = boost::asio::ssl;
using dist::detail::str_cat;
using tcp = net::ip::tcp;

namespace {

// Replies hold at most one value (base64, in JSON); etcd's own request limit is far lower.
constexpr uint64_t kMaxReplyBytes = uint64_t{256} << 20;

}  // namespace

HostPort parse_endpoint(const std::string& endpoint) {
  std::string rest = endpoint;
  HostPort hp;
  if (rest.rfind("https://", 0) == 0) {
    hp.https = true;
    rest = rest.substr(8);
  } else if (rest.rfind("http://", 0) == 0) {
    rest = rest.substr(7);
  }
  while (!rest.empty() && rest.back() == '/') rest.pop_back();
  std::string port = "2379";
  if (!rest.empty() && rest[0] == '[') {
    const size_t close = rest.find(']');
    EMBER_CHECK(close != std::string::npos, "[EtcdStore] endpoint '", endpoint,
                "': unterminated '[' in an IPv6 address");
    hp.host = rest.substr(1, close - 1);
    if (close + 1 < rest.size()) {
      EMBER_CHECK(rest[close + 1] == ':', "[EtcdStore] endpoint '", endpoint,
                  "': expected ':port' after ']'");
      port = rest.substr(close + 2);
    }
  } else {
    const size_t colon = rest.rfind(':');
    hp.host = rest.substr(0, colon);
    if (colon != std::string::npos) port = rest.substr(colon + 1);
  }
  const bool digits =
      !port.empty() && port.size() <= 5 &&
      std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; });
  const bool bracketed = !rest.empty() && rest[0] == '[';
  EMBER_CHECK(!hp.host.empty() && (bracketed || hp.host.find_first_of("/:") == std::string::npos),
              "[EtcdStore] endpoint '", endpoint, "' is not host:port");
  EMBER_CHECK(digits && std::stoi(port) >= 1 && std::stoi(port) <= 65535, "[EtcdStore] endpoint '",
              endpoint, "': port must be 1..65535, got '", port, "'");
  hp.port = port;
  return hp;
}

// How a store speaks TLS to etcd: one client context (trust anchors, client certificate) shared
// by the store's connections, and the files it came from, named in errors.
class Tls {
 public:
  explicit Tls(const TlsFiles& o)
      : ca_file_(o.ca_file), cert_file_(o.cert_file), ctx_(ssl::context::tls_client) {
    const std::string op = "[EtcdStore]";
    ctx_.set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 |
                     ssl::context::no_sslv3 | ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1);
    ctx_.set_verify_mode(ssl::verify_peer);
    boost::system::error_code ec;
    if (o.ca_file.empty()) {
      ctx_.set_default_verify_paths(ec);
      EMBER_CHECK(!ec, op, " cannot load the system's trusted CA certificates: ", ec.message());
    } else {
      ctx_.load_verify_file(o.ca_file, ec);
      EMBER_CHECK(!ec, op, " ca_file '", o.ca_file,
                  "': expected readable PEM CA certificates: ", ec.message());
    }
    if (!o.cert_file.empty()) {
      ctx_.use_certificate_chain_file(o.cert_file, ec);
      EMBER_CHECK(!ec, op, " cert_file '", o.cert_file,
                  "': expected a readable PEM certificate (chain): ", ec.message());
      const std::string key = o.key_file.empty() ? o.cert_file : o.key_file;
      ctx_.use_private_key_file(key, ssl::context::pem, ec);
      EMBER_CHECK(!ec, op, " key_file '", key,
                  "': expected a readable PEM private key of the certificate in cert_file '",
                  o.cert_file, "'", o.key_file.empty() ? " (no key_file given: looked there)" : "",
                  ": ", ec.message());
      EMBER_CHECK(::SSL_CTX_check_private_key(ctx_.native_handle()) == 1, op, " key_file '", key,
                  "' does not match the certificate in cert_file '", o.cert_file, "'");
    }
  }

  ssl::context& context() { return ctx_; }

  // What to check when the TLS session with etcd fails: etcd's certificate (server), this
  // client's (client), or either.
  std::string server_hint() const {
    return str_cat("etcd's certificate must be signed by a CA in ",
                   ca_file_.empty() ? "the system's trust store (give ca_file)"
                                    : "'" + ca_file_ + "'",
                   " and name the endpoint's host");
  }
  std::string client_hint() const {
    return str_cat("an etcd started with --client-cert-auth needs a client certificate signed by "
                   "its --trusted-ca-file",
                   cert_file_.empty() ? " (none given: cert_file, key_file)"
                                      : " ('" + cert_file_ + "' given)");
  }

 private:
  std::string ca_file_, cert_file_;
  ssl::context ctx_;
};

std::shared_ptr<Tls> make_tls(const TlsFiles& files) {
  return std::make_shared<Tls>(files);
}

class HttpConnection::Impl {
 public:
  Impl(HostPort hp, std::shared_ptr<Tls> tls) : hp_(std::move(hp)), tls_(std::move(tls)) {}
  ~Impl() { close(); }

  std::pair<unsigned, std::string> post(const std::string& target, const std::string& body,
                                        const std::string& authorization, TimePoint deadline,
                                        bool retry_stale) {
    if (is_open() && !idle_ok()) close();
    for (int attempt = 0;; ++attempt) {
      const bool reused = is_open();
      if (!reused) connect(deadline);
      try {
        return exchange(target, body, authorization, deadline);
      } catch (const IoError& e) {
        close();
        if (!(reused && retry_stale && attempt == 0 && e.kind == IoError::kClosed)) throw;
      }
    }
  }

  // No TLS close_notify: etcd does not need one, and waiting for its answer could block.
  void close() {
    if (is_open()) {
      beast::error_code ignored;
      tcp().socket().shutdown(tcp::socket::shutdown_both, ignored);
      tcp().socket().close(ignored);
    }
    secure_.reset();
    plain_.reset();
    buffer_.clear();
  }

 private:
  bool is_open() const { return plain_.has_value() || secure_.has_value(); }
  beast::tcp_stream& tcp() { return secure_ ? beast::get_lowest_layer(*secure_) : *plain_; }

  // Runs one Beast operation on whichever stream is open.
  template <class Op>
  beast::error_code on_stream(Op&& op) {
    return secure_ ? run([&](auto h) { op(*secure_, std::move(h)); })
                   : run([&](auto h) { op(*plain_, std::move(h)); });
  }

  // Starts one asynchronous operation and runs the io_context until it completes (by itself,
  // or by the stream's expiry).
  template <class Start>
  beast::error_code run(Start&& start) {
    beast::error_code result = net::error::would_block;
    start([&result](beast::error_code ec, auto&&...) { result = ec; });
    ioc_.restart();
    ioc_.run();
    return result;
  }

  // Connects, retrying (refused, unreachable, unresolvable) with backoff until the deadline:
  // an agent may start before etcd does.
  void connect(TimePoint deadline) {
    auto backoff = std::chrono::milliseconds(10);
    std::string last_error;
    for (;;) {
      beast::error_code ec;
      tcp::resolver resolver(ioc_);
      const auto endpoints = resolver.resolve(hp_.host, hp_.port, ec);
      if (ec) {
        last_error = str_cat("cannot resolve '", hp_.host, "': ", ec.message());
      } else {
        plain_.emplace(ioc_);
        plain_->expires_at(deadline);
        ec = run([&](auto handler) { plain_->async_connect(endpoints, std::move(handler)); });
        if (!ec) {
          plain_->socket().set_option(tcp::no_delay(true), ec);
          if (!tls_) return;
          ec = handshake(deadline);
          if (!ec) return;
        }
        last_error = ec == beast::error::timeout ? "connect timed out" : ec.message();
        close();
      }
      const int64_t left = dist::detail::ms_until(deadline);
      if (left == 0) throw IoError{IoError::kUnreachable, last_error};
      dist::detail::backoff_sleep(&backoff, deadline, std::chrono::seconds(1));
    }
  }

  // Turns the connected plain_ into secure_ and runs the TLS handshake: etcd's certificate must
  // chain to the trusted CAs and name the endpoint's host (or IP address). A failure other than
  // the deadline is thrown as kTls: retrying cannot fix a certificate.
  beast::error_code handshake(TimePoint deadline) {
    secure_.emplace(std::move(*plain_), tls_->context());
    plain_.reset();
    beast::error_code not_ip;
    net::ip::make_address(hp_.host, not_ip);
    if (not_ip) ::SSL_set_tlsext_host_name(secure_->native_handle(), hp_.host.c_str());  // SNI
    secure_->set_verify_callback(ssl::host_name_verification(hp_.host));
    tcp().expires_at(deadline);
    const beast::error_code ec =
        run([&](auto h) { secure_->async_handshake(ssl::stream_base::client, std::move(h)); });
    if (!ec || ec == beast::error::timeout) return ec;
    std::string what = str_cat("the TLS handshake failed: ", ec.message());
    const long verify = ::SSL_get_verify_result(secure_->native_handle());
    if (verify != X509_V_OK) {
      what += str_cat(" (", ::X509_verify_cert_error_string(verify), "); ", tls_->server_hint());
    } else {
      what += str_cat("; ", tls_->server_hint(), "; ", tls_->client_hint());
    }
    close();
    throw IoError{IoError::kTls, what};
  }

  std::pair<unsigned, std::string> exchange(const std::string& target, const std::string& body,
                                            const std::string& authorization, TimePoint deadline) {
    http::request<http::string_body> req{http::verb::post, target, 11};
    req.set(http::field::host, hp_.host + ":" + hp_.port);
    req.set(http::field::content_type, "application/json");
    if (!authorization.empty()) req.set(http::field::authorization, authorization);
    req.keep_alive(true);
    req.body() = body;
    req.prepare_payload();
    tcp().expires_at(deadline);
    beast::error_code ec =
        on_stream([&](auto& stream, auto h) { http::async_write(stream, req, std::move(h)); });
    if (ec) throw io_error(ec, "sending the request");
    http::response_parser<http::string_body> parser;
    parser.body_limit(kMaxReplyBytes);
    ec = on_stream(
        [&](auto& stream, auto h) { http::async_read(stream, buffer_, parser, std::move(h)); });
    if (ec) throw io_error(ec, "reading the reply");
    auto res = parser.release();
    if (!res.keep_alive()) close();
    return {res.result_int(), std::move(res.body())};
  }

  IoError io_error(const beast::error_code& ec, const char* doing) const {
    if (ec == beast::error::timeout) return {IoError::kTimeout, doing};
    // With TLS 1.3 etcd refuses a missing or untrusted client certificate only after the
    // handshake, with an alert the client reads in place of the reply.
    if (tls_ && ec.category() == net::error::get_ssl_category()) {
      return {IoError::kTls, str_cat("TLS failed ", doing, ": ", ec.message(),
                                     " (etcd refused this client?); ", tls_->client_hint())};
    }
    const bool http_error =
        ec.category() == http::make_error_code(http::error::end_of_stream).category();
    if (http_error && ec != http::error::end_of_stream && ec != http::error::partial_message) {
      return {IoError::kProtocol, str_cat(doing, ": ", ec.message())};
    }
    return {IoError::kClosed, str_cat(doing, ": ", ec.message())};
  }

  // A kept-alive connection has nothing to read between requests; if it has (EOF: etcd closed
  // it or restarted), it must not be used.
  bool idle_ok() {
    pollfd p{tcp().socket().native_handle(), POLLIN, 0};
    return ::poll(&p, 1, 0) == 0;
  }

  HostPort hp_;
  std::shared_ptr<Tls> tls_;  // null: plain HTTP
  net::io_context ioc_{1};
  std::optional<beast::tcp_stream> plain_;                    // HTTP, or TCP before the handshake
  std::optional<beast::ssl_stream<beast::tcp_stream>> secure_;  // HTTPS
  beast::flat_buffer buffer_;
};

HttpConnection::HttpConnection(HostPort hp, std::shared_ptr<Tls> tls)
    : impl_(std::make_unique<Impl>(std::move(hp), std::move(tls))) {}

HttpConnection::~HttpConnection() = default;

std::pair<unsigned, std::string> HttpConnection::post(const std::string& target,
                                                      const std::string& body,
                                                      const std::string& authorization,
                                                      TimePoint deadline, bool retry_stale) {
  return impl_->post(target, body, authorization, deadline, retry_stale);
}

}  // namespace ember::dist::detail
