// TCPStoreServer's connections: the handshake, framing, buffers and timers of one client
// (detail/tcp_store_server_impl.h).
#include <ember/distributed/store/detail/tcp_store_server_impl.h>

#include <algorithm>

namespace ember::dist {

TCPStoreServer::Impl::Session::Session(Impl& server, tcp::socket socket)
    : srv_(server),
      sock_(std::move(socket)),
      handshake_timer_(server.io_),
      frame_timer_(server.io_) {
  boost::system::error_code ec;
  const auto peer = sock_.remote_endpoint(ec);
  peer_ = ec ? std::string("an unknown peer") : str_cat(peer);
}

void TCPStoreServer::Impl::Session::start() {
  srv_.sessions_.insert(shared_from_this());
  last_active_ = Clock::now();
  ++srv_.active_;
  set_cloexec(sock_.native_handle());
  boost::system::error_code ec;
  sock_.set_option(tcp::no_delay(true), ec);
  nonce_ = srv_.new_nonce();
  send(wire::FrameWriter(wire::Type::kChallenge)
           .blob(nonce_)
           .u64(srv_.secret_.empty() ? 0 : 1)
           .finish());
  const auto limit = std::min(srv_.opts_.handshake_timeout, dist::detail::kMaxStoreTimeout);
  handshake_timer_.expires_after(limit);
  handshake_timer_.async_wait(
      [self = shared_from_this(), limit](const boost::system::error_code& e) {
        if (e || self->authenticated_ || self->closed_) return;
        self->srv_.log_peer(
            self->peer_, str_cat("bad handshake: none completed within ", limit.count(), " ms"));
        self->close();
      });
  read_more();
}

void TCPStoreServer::Impl::Session::send(wire::Bytes frame) {
  if (closed_) return;
  srv_.queued_ += static_cast<int64_t>(frame.size());
  out_.push_back(std::move(frame));
  if (out_.size() == 1) do_write();
}

void TCPStoreServer::Impl::Session::close() {
  if (closed_) return;
  closed_ = true;
  const auto self = shared_from_this();  // sessions_ may hold the last reference
  // Bookkeeping first, so that stats() is current by the time the peer sees the close.
  if (waiter_) srv_.cancel_waiter(std::exchange(waiter_, 0));
  srv_.buffered_ -= static_cast<int64_t>(std::exchange(accounted_, 0));
  for (const wire::Bytes& f : out_) srv_.queued_ -= static_cast<int64_t>(f.size());
  --srv_.active_;
  srv_.sessions_.erase(self);
  handshake_timer_.cancel();
  frame_timer_.cancel();
  boost::system::error_code ec;
  sock_.shutdown(tcp::socket::shutdown_both, ec);
  sock_.close(ec);  // cancels a pending read, so its buffer may go now
  payload_ = wire::Bytes();
}

void TCPStoreServer::Impl::Session::drop(const std::string& why) {
  srv_.log_peer(peer_, why);
  ++srv_.protocol_errors_;
  close();
}

void TCPStoreServer::Impl::Session::account() {
  if (closed_) return;  // close() has taken the buffer off the total
  const size_t cap = payload_.capacity();
  srv_.buffered_ += static_cast<int64_t>(cap) - static_cast<int64_t>(accounted_);
  accounted_ = cap;
}

void TCPStoreServer::Impl::Session::read_more() {
  if (in_payload_ && got_ == payload_.size() && !grow()) return;
  const auto buf = in_payload_
                       ? asio::buffer(payload_.data() + got_, payload_.size() - got_)
                       : asio::buffer(header_.data() + header_got_, header_.size() - header_got_);
  sock_.async_read_some(
      buf, [self = shared_from_this()](const boost::system::error_code& ec, size_t n) {
        if (self->closed_) return;
        if (ec) return self->close();  // EOF or reset: the client went away
        self->on_read(n);
      });
}

bool TCPStoreServer::Impl::Session::grow() {
  const size_t want = std::min<size_t>(length_, std::max(got_ + kFirstChunk, 2 * got_));
  if (want > payload_.capacity()) {
    const size_t share = srv_.opts_.max_connection_buffered_bytes;
    if (share != 0 && want > share) {
      ++srv_.buffer_refusals_;
      drop(str_cat("connection's buffer share: a frame of ", length_, " bytes needs a ", want,
                   "-byte buffer, past max_connection_buffered_bytes ", share));
      return false;
    }
    const size_t extra = want - payload_.capacity();
    const int64_t total = srv_.buffered_.load();
    if (static_cast<size_t>(total) + extra > srv_.opts_.max_buffered_bytes) {
      ++srv_.buffer_refusals_;
      drop(str_cat("server buffer full: a frame of ", length_, " bytes needs ", extra,
                   " more while all connections hold ", total, " of max_buffered_bytes ",
                   srv_.opts_.max_buffered_bytes));
      return false;
    }
    try {
      payload_.reserve(want);
    } catch (const std::bad_alloc&) {
      drop(str_cat("out of memory for a frame of ", length_, " bytes"));
      return false;
    }
    account();
  }
  payload_.resize(want);
  return true;
}

void TCPStoreServer::Impl::Session::on_read(size_t n) {
  last_progress_ = last_active_ = Clock::now();
  if (!in_payload_) {
    if (header_got_ == 0 && n > 0) begin_frame();
    header_got_ += n;
    if (header_got_ < header_.size()) return read_more();
    header_got_ = 0;
    return on_header();
  }
  got_ += n;
  if (got_ < length_) return read_more();
  end_frame();
  on_payload();
}

void TCPStoreServer::Impl::Session::begin_frame() {
  frame_active_ = true;
  frame_started_ = Clock::now();
  if (!frame_timer_armed_) arm_frame_timer();
}

void TCPStoreServer::Impl::Session::end_frame() {
  frame_active_ = false;
  in_payload_ = false;
}

Duration TCPStoreServer::Impl::Session::frame_limit() const {
  return std::min(srv_.opts_.partial_frame_timeout, dist::detail::kMaxStoreTimeout);
}

Duration TCPStoreServer::Impl::Session::whole_frame_limit() const {
  return std::min(srv_.opts_.max_frame_time, dist::detail::kMaxStoreTimeout);
}

void TCPStoreServer::Impl::Session::arm_frame_timer() {
  frame_timer_armed_ = true;
  frame_timer_.expires_at(
      std::min(last_progress_ + frame_limit(), frame_started_ + whole_frame_limit()));
  frame_timer_.async_wait([self = shared_from_this()](const boost::system::error_code& e) {
    self->frame_timer_armed_ = false;
    if (e || self->closed_ || !self->frame_active_) return;
    const auto limit = self->frame_limit();
    const auto now = Clock::now();
    if (now - self->frame_started_ >= self->whole_frame_limit()) {
      ++self->srv_.frame_timeouts_;
      return self->drop(str_cat(
          "frame too slow: ",
          self->in_payload_ ? self->got_ + wire::kHeaderSize : self->header_got_, " of ",
          self->in_payload_ ? str_cat(self->length_ + wire::kHeaderSize) : std::string("?"),
          " bytes arrived in ", self->whole_frame_limit().count(), " ms (max_frame_time)"));
    }
    if (now - self->last_progress_ < limit) return self->arm_frame_timer();
    ++self->srv_.frame_timeouts_;
    self->drop(str_cat(
        "partial frame timed out: ",
        self->in_payload_ ? self->got_ + wire::kHeaderSize : self->header_got_, " of ",
        self->in_payload_ ? str_cat(self->length_ + wire::kHeaderSize) : std::string("?"),
        " bytes arrived, then nothing for ", limit.count(), " ms (partial_frame_timeout)"));
  });
}

void TCPStoreServer::Impl::Session::on_header() {
  std::string why;
  const auto h = wire::parse_header(header_.data(), &why);
  if (!h) return drop(authenticated_ ? why : str_cat("bad handshake: ", why));
  type_ = h->type;
  const bool ok_type =
      authenticated_ ? wire::is_request(type_) : type_ == static_cast<uint8_t>(wire::Type::kAuth);
  if (!ok_type) {
    return drop(
        str_cat(authenticated_ ? "" : "bad handshake: ", "unexpected frame type ", int(type_)));
  }
  const size_t limit = authenticated_ ? wire::kMaxPayload : wire::kMaxHandshakePayload;
  if (h->length > limit) {
    return drop(str_cat("oversized frame: payload of ", h->length, " bytes, at most ", limit,
                        authenticated_ ? "" : " before authenticating"));
  }
  length_ = h->length;
  got_ = 0;
  payload_.clear();
  if (length_ == 0) {
    end_frame();
    return on_payload();
  }
  in_payload_ = true;
  read_more();
}

void TCPStoreServer::Impl::Session::on_payload() {
  if (!authenticated_) return on_auth();
  // Clients send one request at a time; a second one while the first is parked is a bug
  // or an attack.
  if (waiter_) return drop("request while another is pending");
  try {
    srv_.handle(shared_from_this(), type_, payload_);
  } catch (const ProtocolError& e) {
    return drop(e.why);
  } catch (const std::exception& e) {  // bad_alloc and the like: this connection only
    return drop(e.what());
  }
  if (closed_) return;
  // An idle connection keeps at most a small buffer, so idle clients cost little of the
  // server's max_buffered_bytes.
  if (payload_.capacity() > kFirstChunk) {
    payload_ = wire::Bytes();
    account();
  }
  // Clients send one request and read its reply before the next. One that sends on without
  // reading (gets of a large value, pipelined) would otherwise make the server queue a copy of
  // the reply per request: the next request is read only once the replies are written, so TCP
  // holds the client back and a connection queues one reply at most.
  if (!out_.empty()) {
    read_deferred_ = true;
    return;
  }
  read_more();
}

void TCPStoreServer::Impl::Session::on_auth() {
  wire::PayloadReader r(payload_.data(), payload_.size());
  wire::Bytes proof;
  if (!r.blob(64, &proof) || !r.done()) return drop("bad handshake: malformed auth frame");
  if (!srv_.secret_.empty() &&
      !wire::constant_time_equal(proof, wire::auth_proof(srv_.secret_, nonce_))) {
    ++srv_.auth_failures_;
    srv_.log_peer(peer_, "bad handshake: wrong or missing secret");
    close_after_write_ = true;
    send(wire::FrameWriter(wire::Type::kAuthFailed).finish());
    return;  // no further reads: the connection closes once the refusal is written
  }
  authenticated_ = true;
  ++srv_.authenticated_;
  handshake_timer_.cancel();
  send(wire::FrameWriter(wire::Type::kOk).finish());
  read_more();
}

void TCPStoreServer::Impl::Session::do_write() {
  asio::async_write(sock_, asio::buffer(out_.front()),
                    [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                      if (self->closed_) return;
                      if (ec) return self->close();
                      self->last_active_ = Clock::now();
                      self->srv_.queued_ -= static_cast<int64_t>(self->out_.front().size());
                      self->out_.pop_front();
                      if (!self->out_.empty()) {
                        self->do_write();
                      } else if (self->close_after_write_) {
                        self->close();
                      } else if (std::exchange(self->read_deferred_, false)) {
                        self->read_more();
                      }
                    });
}

}  // namespace ember::dist
