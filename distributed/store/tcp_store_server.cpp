// TCPStoreServer: listening, accepting, the idle sweep, stop and the workers' joins
// (detail/tcp_store_server_impl.h has the whole server's layout).
#include <fcntl.h>
#include <sys/resource.h>

#include <ember/distributed/store/detail/tcp_store_server_impl.h>

#include <algorithm>
#include <future>

#include <ember/tensor/observe/log.h>

namespace ember::dist {

namespace store_server {

void set_cloexec(int fd) {
  const int flags = ::fcntl(fd, F_GETFD);
  if (flags >= 0) ::fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
}

std::chrono::milliseconds clamp_ms(uint64_t ms) {
  return std::chrono::milliseconds(
      std::min<uint64_t>(ms, static_cast<uint64_t>(dist::detail::kMaxStoreTimeout.count())));
}

}  // namespace store_server

size_t default_max_connections(uint64_t nofile) {
  constexpr size_t kMost = 16384;
  if (nofile == RLIM_INFINITY || nofile > uint64_t{1} << 40) return kMost;
  const uint64_t reserve = std::max<uint64_t>(256, nofile / 4);
  return nofile > reserve ? static_cast<size_t>(std::min<uint64_t>(kMost, nofile - reserve)) : 1;
}

TCPStoreServer::Impl::Impl(TCPStoreServerOptions options)
    : work_(asio::make_work_guard(io_)),
      acceptor_(io_),
      accept_retry_(io_),
      idle_sweep_(io_),
      opts_(std::move(options)),
      secret_(store_secret(opts_.secret)) {
  if (opts_.max_connections == 0) {
    rlimit nofile{};
    opts_.max_connections = default_max_connections(
        ::getrlimit(RLIMIT_NOFILE, &nofile) == 0 ? nofile.rlim_cur : RLIM_INFINITY);
  }
  const std::string where = str_cat(opts_.host.empty() ? "*" : opts_.host, ":", opts_.port);
  std::vector<tcp::endpoint> endpoints;
  if (opts_.host.empty()) {
    // Dual-stack IPv6 takes IPv4 clients too; fall back to IPv4 where IPv6 is off.
    endpoints = {tcp::endpoint(tcp::v6(), opts_.port), tcp::endpoint(tcp::v4(), opts_.port)};
  } else {
    boost::system::error_code ec;
    tcp::resolver resolver(io_);
    const auto results = resolver.resolve(opts_.host, std::to_string(opts_.port), ec);
    if (ec) {
      throw DistNetworkError(str_cat("[TCPStoreServer] cannot listen on ", where,
                                     ": cannot resolve '", opts_.host, "': ", ec.message()));
    }
    for (const auto& r : results) endpoints.push_back(r.endpoint());
  }
  std::string error = "no address to listen on";
  bool listening = false;
  for (const auto& ep : endpoints) {
    if ((listening = try_listen(ep, &error))) break;
  }
  if (!listening) {
    throw DistNetworkError(str_cat("[TCPStoreServer] cannot listen on ", where, ": ", error));
  }
  port_ = acceptor_.local_endpoint().port();
  do_accept();
  if (opts_.idle_timeout > Duration::zero()) sweep_idle();
  thread_ = std::thread([this] { run(); });
}

bool TCPStoreServer::Impl::try_listen(const tcp::endpoint& ep, std::string* error) {
  boost::system::error_code ec;
  acceptor_.open(ep.protocol(), ec);
  if (!ec) set_cloexec(acceptor_.native_handle());
  if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec && ep.address().is_v6() && opts_.host.empty()) {
    acceptor_.set_option(asio::ip::v6_only(false), ec);
  }
  if (!ec) acceptor_.bind(ep, ec);
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    *error = str_cat(ec.message(), " (", ep, ")");
    boost::system::error_code ignored;
    acceptor_.close(ignored);
    return false;
  }
  return true;
}

void TCPStoreServer::Impl::run() {
  for (;;) {
    try {
      io_.run();
      return;
    } catch (const std::exception& e) {
      // Handlers catch their own errors; this is a last line so one bug cannot end the store.
      logging::error("[TCPStoreServer] error in the serving thread (continuing): ", e.what());
    }
  }
}

void TCPStoreServer::Impl::do_accept() {
  acceptor_.async_accept([this](const boost::system::error_code& ec, tcp::socket socket) {
    if (stopping_ || ec == asio::error::operation_aborted) return;
    if (ec) {
      // Out of file descriptors and the like: try again shortly rather than spin.
      accept_retry_.expires_after(std::chrono::milliseconds(50));
      accept_retry_.async_wait([this](const boost::system::error_code& e) {
        if (!e && !stopping_) do_accept();
      });
      return;
    }
    ++accepted_;
    if (sessions_.size() >= opts_.max_connections) {
      boost::system::error_code ec;
      const auto peer = socket.remote_endpoint(ec);
      log_peer(ec ? std::string("an unknown peer") : str_cat(peer),
               str_cat("refused: ", opts_.max_connections, " connections open (max_connections)"));
      socket.close(ec);
    } else {
      std::make_shared<Session>(*this, std::move(socket))->start();
    }
    do_accept();
  });
}

void TCPStoreServer::Impl::sweep_idle() {
  const Duration limit = std::min(opts_.idle_timeout, dist::detail::kMaxStoreTimeout);
  const auto cutoff = std::chrono::steady_clock::now() - limit;
  std::vector<std::shared_ptr<Session>> idle;
  for (const auto& s : sessions_) {
    if (s->idle_since(cutoff)) idle.push_back(s);
  }
  for (const auto& s : idle) {  // close() erases from sessions_
    ++idle_closes_;
    // Routine (a client's pooled connection left unused): not a warning. Its client reconnects.
    logging::debug("[TCPStoreServer] port ", port_, ": closed ", s->peer(), ", idle for ",
                   limit.count(), " ms (idle_timeout)");
    s->close();
  }
  // A session goes idle at most a quarter period before the sweep that closes it.
  idle_sweep_.expires_after(std::clamp<Duration>(limit / 4, Duration(10), Duration(30'000)));
  idle_sweep_.async_wait([this](const boost::system::error_code& e) {
    if (!e && !stopping_) sweep_idle();
  });
}

TCPStoreServer::Stats TCPStoreServer::Impl::stats() {
  // Holding stop_mu_: a stop cannot end the serving thread between the post and its handler.
  std::lock_guard<std::mutex> guard(stop_mu_);
  if (!thread_.joinable() || std::this_thread::get_id() == thread_.get_id()) return snapshot();
  auto taken = std::make_shared<std::promise<Stats>>();  // outlives a wait that gave up
  auto result = taken->get_future();
  asio::post(io_, [this, taken] { taken->set_value(snapshot()); });
  // Handlers never block, so this wait is short; the bound is for a serving thread gone wrong.
  constexpr auto kBound = std::chrono::seconds(60);
  if (result.wait_for(kBound) != std::future_status::ready) {
    throw DistError(str_cat("[TCPStoreServer stats] port ", port_,
                            ": the serving thread did not answer within ", kBound.count(), " s"));
  }
  return result.get();
}

void TCPStoreServer::Impl::stop() {
  std::lock_guard<std::mutex> guard(stop_mu_);
  if (thread_.joinable()) {
    asio::post(io_, [this] {
      stopping_ = true;
      boost::system::error_code ignored;
      acceptor_.close(ignored);
      accept_retry_.cancel();
      idle_sweep_.cancel();
      const auto sessions = sessions_;  // close() erases from sessions_
      for (const auto& s : sessions) s->close();
      waiters_.clear();
      waiting_on_.clear();
      waiting_ = 0;
      work_.reset();
      io_.stop();
    });
    thread_.join();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
  }
  cv_.notify_all();
}

void TCPStoreServer::Impl::wait_for_workers(int64_t n, Duration timeout) {
  dist::detail::check_store_timeout("TCPStoreServer wait_for_workers", timeout);
  const auto deadline = dist::detail::store_deadline(timeout);
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_until(lock, deadline, [&] { return workers_ >= n || stopped_; })) {
    throw DistTimeoutError(str_cat(
        "[TCPStoreServer wait_for_workers] timed out after ", timeout.count(), " ms waiting for ",
        n, " workers to join the store on port ", port_, "; ", workers_, " joined"));
  }
  if (workers_ < n) {
    throw DistStoreError(str_cat("[TCPStoreServer wait_for_workers] the store on port ", port_,
                                 " was stopped while waiting for ", n, " workers (", workers_,
                                 " joined)"));
  }
}

wire::Bytes TCPStoreServer::Impl::new_nonce() {
  wire::Bytes nonce(wire::kNonceSize);
  for (size_t i = 0; i < nonce.size(); i += 4) {
    const uint32_t r = random_();
    for (size_t j = 0; j < 4 && i + j < nonce.size(); ++j) nonce[i + j] = uint8_t(r >> (8 * j));
  }
  return nonce;
}

void TCPStoreServer::Impl::log_peer(const std::string& peer, const std::string& why) {
  int64_t suppressed = 0;
  if (!log_limiter_.allow(&suppressed)) return;
  const std::string more =
      suppressed ? str_cat(" (", suppressed, " similar lines suppressed before this one)") : "";
  logging::warn("[TCPStoreServer] port ", port_, ": dropped ", peer, ": ", why, more);
}

// ---- public API ----

TCPStoreServer::TCPStoreServer(TCPStoreServerOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}
TCPStoreServer::~TCPStoreServer() = default;
uint16_t TCPStoreServer::port() const { return impl_->port(); }
void TCPStoreServer::stop() { impl_->stop(); }
int64_t TCPStoreServer::num_workers() const { return impl_->num_workers(); }
void TCPStoreServer::wait_for_workers(int64_t n, Duration timeout) {
  impl_->wait_for_workers(n, timeout);
}
TCPStoreServer::Stats TCPStoreServer::stats() const { return impl_->stats(); }

}  // namespace ember::dist
