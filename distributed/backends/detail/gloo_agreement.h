// ProcessGroupGloo's checks that the ranks agree on a collective before Gloo moves its data,
// and the naming of peers by rank in Gloo's errors. Internal to process_group_gloo*.cpp: not
// installed, not part of the public API.
//
// Note [ranks that disagree over TCP]: Gloo's TCP pair reads a peer's message on Gloo's own
// event-loop thread, and a message longer than the receive this rank posted fails an
// enforcement there; an exception on that thread reaches std::terminate, so ranks that disagree
// on a collective's size (an fp16 hook on one rank, float32 on another) would abort the process
// instead of failing the collective. Ember cannot catch it, so it never lets that happen: before
// Gloo's transfers, every rank sends each peer a fixed-size description of the collective
// (kind, dtype, element count, reduce op, root) and receives each peer's into a buffer large
// enough for any of them, then compares. A mismatch fails the collective on every rank, naming
// the peer and what each issued. The small allreduce sends its data in the same message (the
// receive buffer holds the largest small allreduce), so it costs no extra round trip; the other
// collectives pay one small exchange.
#pragma once

#include <dirent.h>
#include <gloo/allreduce.h>
#include <gloo/context.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>
#include <sys/socket.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ember/distributed/errors.h>
#include <ember/distributed/op_type.h>
#include <ember/distributed/process_group.h>
#include <ember/distributed/store/store.h>
#include <ember/tensor/dtype.h>

namespace ember::dist::detail {

// c10d's slot prefix for send/recv is 0x09; the collectives use 0x01..0x08 (gloo/types.h).
constexpr uint8_t kAgreementSlotPrefix = 0x0a;

/// What one rank issued, as sent to its peers (fixed size: the receive never overflows).
struct GlooOpDesc {
  uint8_t kind = 0;
  uint8_t dtype = 0;
  uint8_t op = 0;  // ReduceOp, for the reductions
  uint8_t pad = 0;
  int32_t root = -1;  // for the rooted collectives
  uint64_t numel = 0;
  bool operator==(const GlooOpDesc&) const = default;
};
static_assert(sizeof(GlooOpDesc) == 16, "GlooOpDesc goes over the wire as is");

inline GlooOpDesc make_desc(dist::OpType kind, Dtype dtype, int64_t numel, int root = -1,
                            dist::ReduceOp op = dist::ReduceOp::Sum) {
  GlooOpDesc d;
  d.kind = static_cast<uint8_t>(kind);
  d.dtype = static_cast<uint8_t>(dtype);
  d.op = dist::reduces(kind) ? static_cast<uint8_t>(op) : 0;
  d.root = root;
  d.numel = static_cast<uint64_t>(numel);
  return d;
}

inline std::string describe(const GlooOpDesc& d) {
  const auto kind = static_cast<dist::OpType>(d.kind);
  std::string s = str_cat(dist::to_string(kind));
  if (kind == dist::OpType::Barrier) return s;
  if (dist::reduces(kind)) {
    s += str_cat(" (", dist::to_string(static_cast<dist::ReduceOp>(d.op)), ")");
  }
  s += str_cat(" of ", d.numel, " elements of ", static_cast<Dtype>(d.dtype));
  if (d.root >= 0) s += str_cat(" with root ", d.root);
  return s;
}

// Note [buffers of a failed operation]: an operation whose wait failed (a peer died, the
// group was aborted, a timeout) may still have receives and sends posted on other pairs, and
// Gloo's event-loop thread may be completing one of them at that moment: it holds only a
// non-owning reference, so freeing the buffer as the exception unwinds would let that thread
// write into, and lock a mutex inside, freed memory. A failed collective marks the group
// broken and closes its connections; closing a pair takes the pair's lock and waits for the
// loop to leave its handler, after which no completion can reach the buffer. So the buffers
// of a failed operation are retired to the group and freed only after its connections close.
// A send or recv whose failure is Ember's own (sizes that disagree) leaves the connections as
// they were and frees its buffers; one that Gloo failed found its connections already closed
// (Gloo closes them all before a timed-out wait throws) and frees them too, and only then breaks
// the group (Note [p2p failures end the group]). Its buffers are retired only when the group was
// broken before it failed: then the closing thread may be signalling the failure into them
// while the operation's thread unwinds.

/// The waits of one group's operations on peers that may not have joined them (the agreement's
/// exchange, send/recv), which the group's abort watcher can end (Note [abort through the
/// store]): closing a pair wakes the peer's waits on it, not this rank's own. Thread-safe.
class AbortableWaits {
 public:
  /// Keeps `buf`, whose operation failed, until release_retired (Note [buffers of a failed
  /// operation]).
  void retire(std::shared_ptr<void> buf) {
    std::lock_guard<std::mutex> lock(mu_);
    retired_.push_back(std::move(buf));
  }

  /// Frees the retired buffers; call only after the group's connections are closed.
  void release_retired() {
    std::vector<std::shared_ptr<void>> retired;
    {
      std::lock_guard<std::mutex> lock(mu_);
      retired.swap(retired_);
    }
  }

  /// Ends every wait registered now or later: it throws DistBackendError(`why`).
  void abort(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_) return;
    aborted_ = true;
    why_ = why;
    for (const auto& [buf, recv] : waiting_) recv ? buf->abortWaitRecv() : buf->abortWaitSend();
  }

  /// buf->waitRecv (recv) or buf->waitSend, unless abort() ends it first.
  void wait(gloo::transport::UnboundBuffer& buf, bool recv, std::chrono::milliseconds timeout) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_) throw dist::DistBackendError(why_);
      waiting_.emplace_back(&buf, recv);
    }
    struct Leave {
      AbortableWaits* w;
      gloo::transport::UnboundBuffer* b;
      ~Leave() {
        std::lock_guard<std::mutex> lock(w->mu_);
        std::erase_if(w->waiting_, [&](const auto& e) { return e.first == b; });
      }
    } leave{this, &buf};
    if (!(recv ? buf.waitRecv(timeout) : buf.waitSend(timeout))) {
      std::lock_guard<std::mutex> lock(mu_);
      throw dist::DistBackendError(why_);
    }
  }

 private:
  std::mutex mu_;
  bool aborted_ = false;
  std::string why_;
  std::vector<std::pair<gloo::transport::UnboundBuffer*, bool>> waiting_;
  std::vector<std::shared_ptr<void>> retired_;
};

/// The group whose operation this thread runs (set by ProcessGroupGloo's execute), or null.
inline AbortableWaits*& current_waits() {
  thread_local AbortableWaits* w = nullptr;
  return w;
}

/// `buf`'s receive (recv) or send, ended early if the running operation's group is aborted.
inline void wait_for(gloo::transport::UnboundBuffer& buf, bool recv,
                     std::chrono::milliseconds timeout) {
  if (AbortableWaits* w = current_waits()) {
    w->wait(buf, recv, timeout);
  } else if (recv) {
    buf.waitRecv(timeout);
  } else {
    buf.waitSend(timeout);
  }
}

/// An operation's buffer with receives or sends posted: freed when it goes out of scope, except
/// while an exception unwinds inside a group's operation, when it is retired to the group
/// (Note [buffers of a failed operation]), with `memory` (what owns the bytes it points into,
/// when the operation does not: a tensor) if given.
class PostedBuffer {
 public:
  explicit PostedBuffer(std::unique_ptr<gloo::transport::UnboundBuffer> buf,
                        std::shared_ptr<const void> memory = nullptr)
      : buf_(std::move(buf)), memory_(std::move(memory)) {}
  PostedBuffer(const PostedBuffer&) = delete;
  PostedBuffer& operator=(const PostedBuffer&) = delete;
  ~PostedBuffer() {
    if (std::uncaught_exceptions() > unwinding_) {
      if (AbortableWaits* w = current_waits()) {
        w->retire(std::move(buf_));
        if (memory_) w->retire(std::const_pointer_cast<void>(std::move(memory_)));
      }
    }
  }
  gloo::transport::UnboundBuffer* operator->() const { return buf_.get(); }
  gloo::transport::UnboundBuffer& operator*() const { return *buf_; }

 private:
  std::unique_ptr<gloo::transport::UnboundBuffer> buf_;
  std::shared_ptr<const void> memory_;
  int unwinding_ = std::uncaught_exceptions();
};

/// Byte offset of peer r's message in the receive buffer of exchange_and_check.
inline size_t agreement_stride(size_t capacity) { return sizeof(GlooOpDesc) + capacity; }

/// Note [ranks that disagree over TCP]: sends `mine` followed by `payload_bytes` of `payload`
/// (at most `capacity`) to every peer, receives each peer's message into `in` (peer r's at
/// r * agreement_stride(capacity), its payload after the description), and throws
/// DistBackendError naming the first peer whose description differs from `mine`.
/// `capacity` must be the same for every collective of the group, not just this one: a peer
/// that issued another collective with the same tag (a small allreduce where this rank issued
/// a broadcast, or DETAIL's check) sends its payload too, and a receive smaller than its message
/// would abort this process.
inline void exchange_and_check(const std::shared_ptr<gloo::Context>& ctx, uint32_t tag,
                               const GlooOpDesc& mine, const void* payload, size_t payload_bytes,
                               size_t capacity, std::vector<char>& in, std::vector<char>& out,
                               std::chrono::milliseconds timeout) {
  const int n = ctx->size, me = ctx->rank;
  const size_t stride = agreement_stride(capacity);
  if (in.size() < stride * static_cast<size_t>(n)) in.resize(stride * static_cast<size_t>(n));
  if (out.size() < sizeof(mine) + payload_bytes) out.resize(sizeof(mine) + payload_bytes);
  std::memcpy(out.data(), &mine, sizeof(mine));
  if (payload_bytes > 0) std::memcpy(out.data() + sizeof(mine), payload, payload_bytes);
  const uint64_t slot = gloo::Slot::build(kAgreementSlotPrefix, tag);
  PostedBuffer rx(ctx->createUnboundBuffer(in.data(), stride * static_cast<size_t>(n)));
  PostedBuffer tx(ctx->createUnboundBuffer(out.data(), sizeof(mine) + payload_bytes));
  for (int r = 0; r < n; ++r) {
    if (r != me) rx->recv(r, slot, static_cast<size_t>(r) * stride, stride);
  }
  for (int r = 0; r < n; ++r) {
    if (r != me) tx->send(r, slot);
  }
  for (int k = 0; k < n - 1; ++k) wait_for(*rx, true, timeout);
  for (int k = 0; k < n - 1; ++k) wait_for(*tx, false, timeout);
  for (int r = 0; r < n; ++r) {
    if (r == me) continue;
    GlooOpDesc theirs;
    std::memcpy(&theirs, in.data() + static_cast<size_t>(r) * stride, sizeof(theirs));
    if (!(theirs == mine)) {
      throw dist::DistBackendError(
          str_cat("ranks disagree: rank ", r, " issued ", describe(theirs), " as its collective #",
                  tag, " but rank ", me, " issued ", describe(mine), " as its collective #", tag,
                  " (every rank must issue the same collectives in the same order, "
                  "with tensors of the same size and dtype)"));
    }
  }
}

/// The exchange's buffers, kept per worker thread (one set whatever the dtype: a small
/// allreduce's receive is up to 512 KiB per peer).
struct AgreementBuffers {
  std::vector<char> in, out;
};
inline AgreementBuffers& agreement_buffers() {
  thread_local AgreementBuffers b;
  return b;
}

/// Note [ranks that disagree over TCP] for the collectives other than allreduce; `capacity` as
/// for exchange_and_check (the group's largest small allreduce).
inline void agree(const std::shared_ptr<gloo::Context>& ctx, uint32_t tag, const GlooOpDesc& mine,
                  size_t capacity, std::chrono::milliseconds timeout) {
  auto& [in, out] = agreement_buffers();
  exchange_and_check(ctx, tag, mine, nullptr, 0, capacity, in, out, timeout);
}

// Note [send/recv sizes]: a send longer than the recv posted for it would abort the receiver
// on Gloo's event-loop thread (Note [ranks that disagree over TCP]), and a send or recv has no
// collective agreement to catch it first. So each side, when called, sends the other a header
// (bytes, elements, dtype) on a slot of its own, and the operation's job compares the two before
// any data moves. The recv's data buffer is still posted at the call (a sender waits only for
// the receiver's call, never its send/recv thread, so two ranks may exchange without deadlock);
// the send's data goes once the receiver's header is in. When the sizes differ, both sides fail
// naming both, and a message cut to the recv's size (one byte when the sender has none) still
// crosses, so the posted recv is used up and later messages on the tag stay matched. A
// sender's header and a receiver's go on different slots: two ranks exchanging on one tag each
// send and receive, and a send's header must pair with the peer's recv, not its send.
constexpr uint8_t kSenderHeaderSlotPrefix = 0x0b;
constexpr uint8_t kReceiverHeaderSlotPrefix = 0x0c;

struct P2pHeader {
  uint64_t nbytes = 0;
  uint64_t numel = 0;
  uint64_t dtype = 0;
};

/// One send or recv of `nbytes` at `data` between this rank and `peer` with the data slot
/// `data_slot` (Note [send/recv sizes]). Construct it on the calling thread; run() in the job.
class P2pTransfer {
 public:
  P2pTransfer(const std::shared_ptr<gloo::Context>& ctx, bool is_send, int peer, uint32_t tag,
              uint64_t data_slot, void* data, Dtype dtype, int64_t numel, size_t nbytes)
      : ctx_(ctx), is_send_(is_send), peer_(peer), data_slot_(data_slot) {
    mine_ = {nbytes, static_cast<uint64_t>(numel), static_cast<uint64_t>(dtype)};
    const uint64_t senders = gloo::Slot::build(kSenderHeaderSlotPrefix, tag);
    const uint64_t receivers = gloo::Slot::build(kReceiverHeaderSlotPrefix, tag);
    header_in_ = ctx->createUnboundBuffer(&theirs_, sizeof(theirs_));
    header_out_ = ctx->createUnboundBuffer(&mine_, sizeof(mine_));
    header_in_->recv(peer, is_send ? receivers : senders);
    header_out_->send(peer, is_send ? senders : receivers);
    if (nbytes > 0) data_ = ctx->createUnboundBuffer(data, nbytes);
    if (!is_send && data_) data_->recv(peer, data_slot);
  }

  /// Waits for the headers, moves the data, and throws DistBackendError naming both sides'
  /// sizes when they differ; Gloo's own errors (a timeout, a closed connection) pass through.
  void run(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    auto left = [&] {
      return std::max(std::chrono::milliseconds(0),
                      std::chrono::duration_cast<std::chrono::milliseconds>(
                          deadline - std::chrono::steady_clock::now()));
    };
    wait_for(*header_in_, true, left());
    wait_for(*header_out_, false, left());
    if (is_send_ && theirs_.nbytes > 0) {
      const size_t n = static_cast<size_t>(std::min(mine_.nbytes, theirs_.nbytes));
      auto out = data_;
      if (n == 0) out = ctx_->createUnboundBuffer(&filler_, 1);
      out->send(peer_, data_slot_, 0, std::max<size_t>(n, 1));
      wait_for(*out, false, left());
    } else if (!is_send_ && data_) {
      wait_for(*data_, true, left());
    }
    if (theirs_.nbytes != mine_.nbytes) {
      throw dist::DistBackendError(
          str_cat("sizes disagree: rank ", peer_, is_send_ ? " receives " : " sends ",
                  text(theirs_), is_send_ ? ", but this send has " : ", but this recv takes ",
                  text(mine_), " (a send and its recv must have the same number of bytes)"));
    }
  }

 private:
  static std::string text(const P2pHeader& h) {
    return str_cat(h.numel, " elements of ", static_cast<Dtype>(h.dtype), " (", h.nbytes,
                   " bytes)");
  }

  std::shared_ptr<gloo::Context> ctx_;
  bool is_send_;
  int peer_;
  uint64_t data_slot_;
  P2pHeader mine_, theirs_;
  char filler_ = 0;
  std::unique_ptr<gloo::transport::UnboundBuffer> header_in_, header_out_;
  std::shared_ptr<gloo::transport::UnboundBuffer> data_;
};

/// Allreduce over TCP of `count` elements at `data`, reduced pairwise by `fn`: the ranks'
/// descriptions are exchanged first (Note [ranks that disagree over TCP]), and when the data
/// is at most `small_bytes` it goes in the same messages (Note [small allreduce] in
/// process_group_gloo_collectives.cpp); a larger one then runs Gloo's ring. The receive holds
/// the largest small allreduce, so that a peer's message always fits.
template <typename T>
void tcp_allreduce(const std::shared_ptr<gloo::Context>& ctx, Dtype dtype, T* data, size_t count,
                   dist::ReduceOp op, void (*fn)(void*, const void*, const void*, size_t),
                   size_t small_bytes, uint32_t tag, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const int n = ctx->size, me = ctx->rank;
  const size_t bytes = count * sizeof(T);
  const bool small = bytes <= small_bytes;
  auto& [in, out] = agreement_buffers();
  exchange_and_check(ctx, tag,
                     make_desc(dist::OpType::Allreduce, dtype, static_cast<int64_t>(count), -1, op),
                     data, small ? bytes : 0, small_bytes, in, out, timeout);
  if (count == 0) return;
  if (!small) {
    gloo::AllreduceOptions o(ctx);
    o.setOutput<T>(data, count);
    o.setReduceFunction(fn);
    o.setTag(tag);
    o.setTimeout(std::max(std::chrono::milliseconds(1),
                          std::chrono::duration_cast<std::chrono::milliseconds>(
                              deadline - std::chrono::steady_clock::now())));
    gloo::allreduce(o);
    return;
  }
  // Every rank reduces the same buffers in rank order 0..n-1 (this rank's own is the copy in
  // `out`), so every rank gets bitwise the same result.
  const size_t stride = agreement_stride(small_bytes);
  auto part = [&](int r) {
    const char* p = r == me ? out.data() : in.data() + static_cast<size_t>(r) * stride;
    return reinterpret_cast<const T*>(p + sizeof(GlooOpDesc));
  };
  std::memcpy(data, part(0), bytes);
  for (int r = 1; r < n; ++r) fn(data, data, part(r), count);
}

/// The store key under which `rank` publishes its sockets' addresses (Note [naming peers by
/// rank]); also what Note [where a rank stands] reads to learn whether the store still answers.
inline std::string socket_addresses_key(int rank) {
  return str_cat("ember_socket_addresses_", rank);
}

/// Note [naming peers by rank]: Gloo names a peer in its errors only by its socket's address,
/// and on the side that accepted a connection that is the peer's ephemeral port, which Gloo
/// does not expose. So once connected, every rank publishes the local address of each of its
/// TCP sockets (read from /proc/self/fd, written as Gloo writes addresses) and of its pairs,
/// and a rank's error
/// finds its peers among them. Returns, for each rank, its addresses (none for this rank).
inline std::vector<std::vector<std::string>> peer_addresses(dist::Store& store, gloo::Context& ctx,
                                                            dist::Duration timeout) {
  const int rank = ctx.rank, size = ctx.size;
  std::string mine;
  if (DIR* dir = ::opendir("/proc/self/fd")) {
    while (const dirent* e = ::readdir(dir)) {
      const int fd = std::atoi(e->d_name);
      sockaddr_storage ss{};
      socklen_t len = sizeof(ss);
      int type = 0;
      socklen_t type_len = sizeof(type);
      if (e->d_name[0] == '.' || ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0 ||
          (ss.ss_family != AF_INET && ss.ss_family != AF_INET6) ||
          ::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &type_len) != 0 || type != SOCK_STREAM) {
        continue;
      }
      mine += gloo::transport::tcp::Address(ss).str() + '\n';
    }
    ::closedir(dir);
  }
  for (int r = 0; r < size; ++r) {  // what some Gloo versions call this rank's end of a pair
    if (r != rank) mine += ctx.getPair(r)->address().str() + '\n';
  }
  store.set(socket_addresses_key(rank), dist::Bytes(mine.begin(), mine.end()));
  std::vector<std::vector<std::string>> out(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    // Some Gloo versions name the peer by the address it listened on in the rendezvous (Gloo's
    // key "<r>": r's pairs' addresses, for each rank but r in order), closed on the side that
    // connected. Skipped if this Gloo stores something else there.
    const std::vector<char> one = ctx.getPair(r)->address().bytes();
    const std::string key = str_cat(r);
    if (store.check({key})) {
      const dist::Bytes all = store.get(key, timeout);
      const size_t at = static_cast<size_t>(rank < r ? rank : rank - 1) * one.size();
      if (all.size() == static_cast<size_t>(size - 1) * one.size()) {
        const std::vector<char> bytes(all.begin() + at, all.begin() + at + one.size());
        out[static_cast<size_t>(r)].push_back(gloo::transport::tcp::Address(bytes).str());
      }
    }
    const dist::Bytes b = store.get(socket_addresses_key(r), timeout);
    std::string line;
    for (const uint8_t c : b) {
      if (c != '\n') {
        line += static_cast<char>(c);
      } else if (!line.empty()) {
        out[static_cast<size_t>(r)].push_back(std::move(line));
        line.clear();
      }
    }
  }
  return out;
}

/// `msg` (a Gloo error) with every peer's address written as "rank r (address)"; `named` gets
/// the ranks found (Note [naming peers by rank]).
inline std::string name_peers_by_rank(const std::vector<std::vector<std::string>>& addresses,
                                      std::string msg, std::vector<int>* named) {
  std::vector<std::string> done;  // an address two ranks published is named once
  for (size_t r = 0; r < addresses.size(); ++r) {
    bool found = false;
    for (const std::string& addr : addresses[r]) {
      if (std::find(done.begin(), done.end(), addr) != done.end()) continue;
      done.push_back(addr);
      const std::string with_rank = str_cat("rank ", r, " (", addr, ")");
      for (size_t at = msg.find(addr); at != std::string::npos;) {
        const size_t end = at + addr.size();
        if (end < msg.size() && std::isdigit(static_cast<unsigned char>(msg[end]))) {
          at = msg.find(addr, end);  // another address that only starts like this one
          continue;
        }
        msg.replace(at, addr.size(), with_rank);
        found = true;
        at = msg.find(addr, at + with_rank.size());
      }
    }
    if (found && named) named->push_back(static_cast<int>(r));
  }
  return msg;
}

// Note [where a rank stands]: ranks that issue different numbers of collectives (uneven steps:
// one rank trains longer than another, or skips an evaluation) find nothing on the transport
// that says where the other is: a rank that left is a closed connection or an exited pid, one
// that is busy elsewhere only a timeout. So a rank writes where it stands into the group's store
// when its first collective fails ("was at allreduce #3 when it failed") and when its group is
// destroyed ("left the group after issuing 3 operations (the last: allreduce #2)"), before it
// closes its connections; a rank whose collective fails reads the others' and names them in its
// error. The read waits a little (position_wait) for peers that fail at the same moment (woken
// by this rank's closed connections), but not for one the error already names as gone; a peer
// that wrote nothing is in no collective of this group (busy elsewhere, stalled or dead);
// under EMBER_DISTRIBUTED_DEBUG=DETAIL each rank also writes every operation as it issues it,
// so that even such a peer is named by its latest operation ("last issued allreduce #5"). The
// store may be gone with the process that hosted it, so a write at a failure or at destruction
// is bounded by position_wait (Store::set_within; DETAIL's record by the operation's timeout),
// never by the store's own timeout (the group's, which may be long): a TCPStore client whose
// server went away retries the refused connection until its bound, and the host can exit
// between any two requests, so a probe that the store answered says nothing about the write
// after it. The probe (a read of a key this rank wrote at connection, with the same bound) stays
// for stores that bound a write only by their own timeout. At destruction the bound is shorter
// (kLeavingStoreWait): at a job's normal end the rank that hosts the store may already have
// exited, and every other rank would pay it.

/// How long a failing rank waits for its peers' positions, and the bound on the store's answer.
inline std::chrono::milliseconds position_wait(dist::Duration group_timeout) {
  return std::clamp(std::chrono::duration_cast<std::chrono::milliseconds>(group_timeout) / 4,
                    std::chrono::milliseconds(1), std::chrono::milliseconds(1000));
}

/// The bound on the store's answer when a group is destroyed (Note [where a rank stands]).
constexpr std::chrono::milliseconds kLeavingStoreWait{250};

inline std::string position_key(int rank) { return str_cat("ember_position_", rank); }

/// "allreduce #3" from an operation's label ("[gloo] allreduce #3 on rank 1 of 2").
inline std::string short_label(const std::string& label) {
  const size_t end = label.find(" on rank ");
  const size_t close = label.rfind("] ", end);
  const size_t begin =
      !label.empty() && label[0] == '[' && close != std::string::npos ? close + 2 : 0;
  return label.substr(begin, end == std::string::npos ? end : end - begin);
}

/// Writes `text` ("left the group ...") as where `rank` stands (Note [where a rank stands]);
/// returns false when the store does not answer, each request within `bound`, with `*why` (if
/// given) set to the store's error.
inline bool publish_position(dist::Store& store, int rank, const std::string& text,
                             std::chrono::milliseconds bound, std::string* why = nullptr) {
  try {
    (void)store.get(socket_addresses_key(rank), bound);  // is the store there?
    store.set_within(position_key(rank), dist::Bytes(text.begin(), text.end()), bound);
    return true;
  } catch (const std::exception& e) {
    if (why) *why = e.what();
    return false;  // no store, no positions: the error still names the collective and rank
  }
}

/// Under EMBER_DISTRIBUTED_DEBUG=DETAIL, each operation as it is issued (`label`: "allreduce
/// #5"), so that a peer that times out names where a rank that is in no collective stopped.
/// Costs a store round trip per operation: for debugging only. Returns false if the store
/// failed or did not answer within `bound` (the caller then stops recording: the operations
/// themselves do not need the store).
inline bool publish_latest(dist::Store& store, int rank, const std::string& label,
                           std::chrono::milliseconds bound) {
  const std::string text = str_cat("last issued ", label, " (EMBER_DISTRIBUTED_DEBUG=DETAIL)");
  try {
    store.set_within(position_key(rank), dist::Bytes(text.begin(), text.end()), bound);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

/// "; rank 0 left the group after ..." for each peer of `rank` (Note [where a rank stands]),
/// waiting up to `bound` in all for those that `error` (this rank's) does not name as exited.
inline std::string peer_positions(dist::Store& store, int rank, int size, const std::string& error,
                                  std::chrono::milliseconds bound) {
  const auto deadline = std::chrono::steady_clock::now() + bound;
  std::string out, silent;
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    const bool wait =
        error.find(str_cat("rank ", r, " (pid ")) == std::string::npos &&
        error.find(str_cat("rank ", r, " closed the connection")) == std::string::npos;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    try {
      const dist::Bytes b = store.get(
          position_key(r),
          std::max(wait ? left : std::chrono::milliseconds(0), std::chrono::milliseconds(1)));
      out += str_cat("; rank ", r, " ", std::string(b.begin(), b.end()));
    } catch (const std::exception&) {
      silent += str_cat(silent.empty() ? "" : ", ", r);
    }
  }
  if (!silent.empty()) {
    out += str_cat("; rank(s) ", silent, " wrote no position within ", bound.count(),
                   " ms (a rank busy outside this group's collectives, stalled or dead writes "
                   "none)");
  }
  return out;
}

// Note [abort through the store]: a rank whose collective fails closes its connections, which
// wakes the peers blocked on it, but not a peer blocked on a third rank that is busy elsewhere
// (a pipeline stage's recv from a stage still computing), and a woken peer could only say "rank 0
// closed the connection (did it exit or die?)" while rank 0 lives on with the real reason. So the
// rank writes an abort record into the group's store first (abort_key: its rank, the operation
// and its error), and wakes each peer's watcher (watch_key(r)); every rank's watcher thread then
// breaks its group as the rank's own failure would (closes the connections, aborts the shared
// memory) and every blocked or later operation fails naming the rank that aborted, its operation
// and why (as ThreadWorld::abort() does for a group of threads). A rank woken by a closed
// connection reads the record too, so that it names the reason rather than a death.
// ProcessGroupGloo::abort() writes the same record for a failure outside the group.
//
// Why a watcher thread parked on its own key rather than the group's wait loops asking the store:
// Gloo's waits (waitRecv, the ring) block inside Gloo with no hook to poll anything, and a store
// round trip inside each collective would add latency to the hot path; the watcher costs nothing
// per collective but a counter under the mutex execute() takes anyway. It parks on the server (a
// TCPStore get, no polling; renewed every kAbortWatchInterval) only while an operation of the
// group runs, so an idle group holds no store connection and a job whose store host has exited
// is not asked. One key per rank, not one for all: a group's destruction wakes its own parked
// watcher by writing its key, where a shared key would wake every rank. The cost is an abort's
// writes (one per peer, each bounded like the position), paid only on the failure path. Stale
// records of an earlier group with the same prefix are deleted before the rendezvous, which no
// rank can leave before every rank has entered it, so no rank of this group can have written
// one yet.

/// How long the watcher's parked get lasts before it renews it (and sees whether the group is
/// still busy): bounds only how long a group destroyed mid-operation waits for the watcher when
/// its store does not answer.
constexpr std::chrono::milliseconds kAbortWatchInterval{5000};

/// The group's abort record (Note [abort through the store]): "<rank>\n<text>".
inline const std::string& abort_key() {
  static const std::string k = "ember_abort";
  return k;
}
/// The key `rank`'s watcher parks on: an abort writes "abort" there, the rank's own group
/// destruction "closing".
inline std::string watch_key(int rank) { return str_cat("ember_abort_watch_", rank); }

/// The record `rank` writes with `text` ("rank 0 aborted the group at its allreduce #3: ...").
inline std::string abort_record(int rank, const std::string& text) {
  return str_cat(rank, "\n", text);
}
/// The rank and text of a record; rank -1 if it is not one.
inline std::pair<int, std::string> parse_abort_record(const dist::Bytes& b) {
  const std::string s(b.begin(), b.end());
  const size_t nl = s.find('\n');
  if (nl == std::string::npos || nl == 0 || nl > 9) return {-1, s};
  int rank = 0;
  for (size_t i = 0; i < nl; ++i) {
    if (!std::isdigit(static_cast<unsigned char>(s[i]))) return {-1, s};
    rank = rank * 10 + (s[i] - '0');
  }
  return {rank, s.substr(nl + 1)};
}

/// "rank 1 closed the connection (...): " for the peers a lost connection's error names.
inline std::string closed_by(const std::vector<int>& peers) {
  if (peers.empty()) return "a peer closed its connection (did a rank exit or die?): ";
  std::string who = str_cat("rank ", peers[0]);
  for (size_t i = 1; i < peers.size(); ++i) who += str_cat(", rank ", peers[i]);
  return str_cat(who, " closed the connection (did it exit or die?): ");
}

}  // namespace ember::dist::detail
