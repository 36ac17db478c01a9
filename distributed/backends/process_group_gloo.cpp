// ProcessGroupGloo over Gloo's TCP transport: the rendezvous, the threads that run queued
// operations, and what a failure does to the group. The collectives and send/recv themselves are
// in process_group_gloo_collectives.cpp. Built only when gloo is found
// (distributed/CMakeLists.txt); no_gloo.cpp stands in otherwise.
#include <ember/distributed/backends/process_group_gloo.h>
#include <ember/distributed/backends/shareable.h>

#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <netdb.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <deque>
#include <thread>
#include <vector>

#include <ember/distributed/backends/detail/gloo_agreement.h>
#include <ember/distributed/backends/detail/process_group_gloo_impl.h>
#include <ember/distributed/backends/detail/shm_allreduce.h>
#include <ember/distributed/debug/collective_trace.h>
#include <ember/distributed/debug/debug.h>
#include <ember/tensor/observe/log.h>

namespace ember::dist {

bool gloo_available() { return true; }

namespace {

using Clock = std::chrono::steady_clock;

/// Gloo's rendezvous store over an Ember store: Gloo publishes and reads the ranks' addresses.
class GlooStoreAdapter : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(std::shared_ptr<dist::Store> store, Duration timeout)
      : store_(std::move(store)), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(key, Bytes(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    const Bytes b = store_->get(key, timeout_);
    return std::vector<char>(b.begin(), b.end());
  }
  void wait(const std::vector<std::string>& keys) override { store_->wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& t) override {
    store_->wait(keys, t);
  }

 private:
  std::shared_ptr<dist::Store> store_;
  Duration timeout_;
};

// Note [inline collectives]: handing a collective to a worker thread and waking the caller when
// it is done costs two thread wake-ups, many times what a small collective over shared memory
// takes by itself. So when the group has shared memory, a collective of at most kInlineBytes
// per rank that is issued while none of this rank's collectives is queued or running runs on
// the calling thread (through the same execute() as on a worker), and the call returns its Work
// already completed. The call then blocks until every rank has joined the collective, as a
// blocking one would; the Work is the same: errors, timeouts and a broken group reach the
// caller through it rather than as exceptions from the call, and then() callbacks run at once
// on the calling thread. The order is kept: the shared-memory tickets are taken in issue order,
// and with nothing in flight no earlier collective can still be waiting to start. Larger
// collectives stay on the workers, so that the caller overlaps them with its own work (DDP's
// backward pass) and two of them move data at once on the two channels.
constexpr size_t kInlineBytes = 64 * 1024;

/// A Work whose default wait outlasts the worker's own deadline a little, so that the
/// worker's error (which says what Gloo saw) reaches the caller rather than a bare timeout.
class GlooWork : public Work {
 public:
  using Work::Work;
  bool wait(std::optional<Duration> timeout = {}) override {
    if (timeout) return Work::wait(timeout);
    try {
      future_->wait(timeout_ + std::chrono::seconds(2));
    } catch (const DistTimeoutError&) {
      if (future_->completed()) throw;
      throw DistTimeoutError(detail::str_cat(what_, " timed out after ", timeout_.count(), " ms"));
    }
    return true;
  }
};

std::string hostname_of_machine() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return {};
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(buf, nullptr, &hints, &res) != 0) return {};
  ::freeaddrinfo(res);
  return buf;
}

// Gloo writes to sockets with writev(), which raises SIGPIPE when a peer died; its default
// action would kill this process instead of letting the collective report the dead peer.
// Ignored here only if nobody installed a handler (as Python does for every torch program).
void ignore_sigpipe() {
  struct sigaction old {};
  if (::sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) {
    ::signal(SIGPIPE, SIG_IGN);
  }
}

}  // namespace

// ---- Impl ---------------------------------------------------------------------------------------

ProcessGroupGloo::Impl::Impl(const ProcessGroupGloo& pg, std::shared_ptr<Store> store,
                             const GlooOptions& opts)
    : rank_(pg.rank()), size_(pg.size()), receives_first_bytes_(opts.receives_first_bytes) {
  if (size_ == 1) return;  // world size 1: no network, everything completes inline
  ignore_sigpipe();
  gloo::transport::tcp::attr attr;
  bool guessed = false;
  if (!opts.hostname.empty()) {
    attr.hostname = opts.hostname;
  } else if (const char* h = std::getenv("EMBER_GLOO_HOSTNAME"); h && *h) {
    attr.hostname = h;
  } else if (const char* i = std::getenv("GLOO_SOCKET_IFNAME"); i && *i) {
    attr.iface = i;
  } else {
    attr.hostname = hostname_of_machine();
    guessed = true;
    if (attr.hostname.empty()) attr.hostname = "127.0.0.1";
  }
  try {
    device_ = gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    if (!guessed) {
      throw DistBackendError(
          detail::str_cat("[gloo] rank ", rank_, " of ", size_, ": cannot listen on '",
                          attr.iface.empty() ? attr.hostname : attr.iface, "': ", e.what()));
    }
    attr.hostname = "127.0.0.1";
    try {
      device_ = gloo::transport::tcp::CreateDevice(attr);
    } catch (const std::exception& e2) {
      throw DistBackendError(detail::str_cat("[gloo] rank ", rank_, " of ", size_,
                                             ": cannot listen on this machine's host name (",
                                             e.what(), ") nor on 127.0.0.1: ", e2.what()));
    }
  }
  // A record an earlier group with this prefix left (Note [abort through the store]).
  store->delete_key(dist::detail::abort_key());
  store->delete_key(dist::detail::watch_key(rank_));
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank_, size_);
  ctx->setTimeout(opts.timeout);
  GlooStoreAdapter adapter(store, opts.timeout);
  try {
    ctx->connectFullMesh(adapter, device_);
  } catch (const DistTimeoutError& e) {
    throw DistTimeoutError(detail::str_cat("[gloo] rank ", rank_, " of ", size_,
                                           ": not every peer joined within ",
                                           opts.timeout.count(), " ms: ", e.what()));
  } catch (const DistError&) {
    throw;
  } catch (const std::exception& e) {
    throw DistBackendError(detail::str_cat("[gloo] rank ", rank_, " of ", size_,
                                           " could not connect to its peers (timeout ",
                                           opts.timeout.count(), " ms): ", e.what()));
  }
  peer_addresses_ = dist::detail::peer_addresses(*store, *ctx, opts.timeout);
  position_wait_ = dist::detail::position_wait(opts.timeout);
  store_ = store;
  try {
    record_each_ = debug_level() == DebugLevel::Detail;
  } catch (const ValueError&) {
    // A bad EMBER_DISTRIBUTED_DEBUG is reported by what asks for a debug mode (DDP).
  }
  context_ = ctx;
  if (opts.shared_memory) {
    shm_ = dist::detail::ShmAllreduce::create(*store, rank_, size_, opts.threads, opts.timeout);
  }
  for (int i = 0; i < opts.threads; ++i) {
    workers_.emplace_back([this] { loop(queue_, cv_, true); });
  }
  // Note [send and receive threads]: a send's job waits until its receiver has called recv
  // (Note [send/recv sizes] in gloo_agreement.h), and a receive's job completes its Work. On
  // one thread, a send waiting for a peer that first waits for one of this rank's receives
  // would wait behind that very receive (two ranks sending a header and then the data to each
  // other, send_with_shape, blocked both), and a send would wait behind an earlier send whose
  // receiver calls recv only later (a pipeline's forward to the next stage, received after the
  // gradient it sends back): so receives have a thread of their own, and sends as many threads
  // as are waiting at once (up to kMaxSenders, more than a pipeline step keeps in flight).
  // Sends to one peer on one tag still go in order (previous_send), as MPI's do.
  p2p_[1] = std::thread([this] { loop(p2p_queue_[1], p2p_cv_[1], false); });
  watcher_ = std::thread([this] { watch(); });
}

ProcessGroupGloo::Impl::~Impl() {
  std::deque<Job> dropped;
  bool parked = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    parked = watching_;
    for (auto* q : {&queue_, &p2p_queue_[0], &p2p_queue_[1]}) {
      for (auto& j : *q) dropped.push_back(std::move(j));
      q->clear();
    }
  }
  watch_cv_.notify_all();
  if (parked) {  // wake this rank's own watcher from its parked get
    const std::string closing = "closing";
    try {
      store_->set_within(dist::detail::watch_key(rank_), Bytes(closing.begin(), closing.end()),
                         dist::detail::kLeavingStoreWait);
    } catch (const std::exception&) {
      // No store: the parked get fails or ends at its interval.
    }
  }
  if (watcher_.joinable()) watcher_.join();
  cv_.notify_all();
  for (auto& cv : p2p_cv_) cv.notify_all();
  for (auto& j : dropped) {
    j.work->finish_with_error(std::make_exception_ptr(DistBackendError(
        detail::str_cat(j.work->describe(), " failed: the process group was destroyed"))));
  }
  for (auto& w : workers_) {
    if (w.joinable()) w.join();
  }
  for (auto& t : p2p_) {
    if (t.joinable()) t.join();
  }
  for (auto& t : senders_) {
    if (t.joinable()) t.join();
  }
  // A group that failed, or is destroyed with operations still queued, resets its connections
  // so that peers blocked on it wake at once. A healthy one closes them gently when the context
  // goes: a reset would discard what this rank's last collective left in its socket buffers,
  // which a slower peer may still be reading (its last allreduce would then never complete).
  bool healthy = dropped.empty();
  {
    std::lock_guard<std::mutex> lock(mu_);
    healthy = healthy && broken_.empty();
  }
  if (context_ && !healthy) {
      context_->closeConnections();
  }
  waits_.release_retired();
}

ProcessGroupGloo::Impl::Route ProcessGroupGloo::Impl::route_for(size_t bytes) const {
  return shm_ && bytes <= kInlineBytes ? Route::InlineIfIdle : Route::Worker;
}

WorkPtr ProcessGroupGloo::Impl::submit(
    const std::string& what, Duration timeout,
    std::function<std::vector<Tensor>(std::chrono::milliseconds)> run, Route route) {
  auto work = std::make_shared<GlooWork>(what, timeout);
  Job job{work, Clock::now() + timeout, std::move(run), tracing::stamp()};
  if (!context_) {
    execute(job);
    return work;
  }
  // Bounded by the operation's own timeout: a store gone with its host must not hold up the
  // operation longer than the operation itself may take.
  if (record_each_ && !dist::detail::publish_latest(*store_, rank_,  // before it can fail
                                                     dist::detail::short_label(what), timeout)) {
    record_each_ = false;
  }
  const bool p2p = route == Route::Send || route == Route::Recv;
  const int side = route == Route::Recv ? 1 : 0;
  {
    std::unique_lock<std::mutex> lock(mu_);
    EMBER_CHECK(!stop_, what, ": the process group is being destroyed");
    last_issued_ = what;
    if (route == Route::InlineIfIdle && in_flight_ == 0) {
      lock.unlock();
      execute(job);
      return work;
    }
    if (!p2p) {
      std::erase_if(issued_, [](const std::weak_ptr<Work>& w) {
        auto p = w.lock();
        return !p || p->is_completed();
      });
      issued_.push_back(work);
      ++in_flight_;
    }
    (p2p ? p2p_queue_[side] : queue_).push_back(std::move(job));
    constexpr size_t kMaxSenders = 64;
    if (route == Route::Send && idle_senders_ == 0 && senders_.size() < kMaxSenders) {
      senders_.emplace_back([this] { send_loop(); });
    }
  }
  (p2p ? p2p_cv_[side] : cv_).notify_one();  // wake only the thread that serves this queue
  return work;
}

std::string ProcessGroupGloo::Impl::name_peers(const std::string& msg) const {
  return dist::detail::name_peers_by_rank(peer_addresses_, msg, nullptr);
}

std::vector<WorkPtr> ProcessGroupGloo::Impl::unfinished_collectives() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<WorkPtr> out;
  for (const auto& w : issued_) {
    if (auto p = w.lock(); p && !p->is_completed()) out.push_back(std::move(p));
  }
  return out;
}

void ProcessGroupGloo::Impl::loop(std::deque<Job>& queue, std::condition_variable& cv,
                                  bool collectives) {
  trace::set_thread_name(collectives ? "gloo worker" : "gloo send/recv");
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv.wait(lock, [&] { return stop_ || !queue.empty(); });
      if (queue.empty()) return;  // stopping
      job = std::move(queue.front());
      queue.pop_front();
    }
    execute(job, collectives);
    if (collectives) {
      std::lock_guard<std::mutex> lock(mu_);
      --in_flight_;
    }
  }
}

void ProcessGroupGloo::Impl::send_loop() {
  trace::set_thread_name("gloo send");
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      ++idle_senders_;
      p2p_cv_[0].wait(lock, [&] { return stop_ || !p2p_queue_[0].empty(); });
      --idle_senders_;
      if (p2p_queue_[0].empty()) return;  // stopping
      job = std::move(p2p_queue_[0].front());
      p2p_queue_[0].pop_front();
    }
    execute(job, false);
  }
}

std::shared_future<void> ProcessGroupGloo::Impl::previous_send(int peer, int tag,
                                                                std::shared_future<void> done) {
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_future<void>& last = last_send_[{peer, tag}];
  std::shared_future<void> before = last;
  last = std::move(done);
  return before;
}

// Note [p2p failures end the group]: a failed collective leaves the ranks out of step, so it
// always breaks the group (fail()). A send or recv is called with mark_broken false because its
// own failures (sizes that disagree, a send still waiting behind an earlier one on its tag)
// leave every connection as it was. But when Gloo fails it, the group is over anyway: a wait
// of Gloo's that times out closes every connection of the context ("Application timeout caused
// pair closure", under each connection's lock, before the wait throws), and a connection the
// peer closed, or a peer's abort, is the end of that peer. Such a send or recv breaks the group
// like a collective: the next operation fails at once naming it (not with Gloo's "timed out"
// after no wait at all), and, as the first failure, it tells the peers through the store, so a
// late send on the other side names "rank 1 aborted the group at its recv #0: ... timed out"
// instead of a closed connection.
void ProcessGroupGloo::Impl::execute(Job& job, bool mark_broken) {
  const std::string& what = job.work->describe();
  const auto timeout = job.work->timeout();
  std::string broken;
  {
    std::lock_guard<std::mutex> lock(mu_);
    broken = broken_;
    if (running_++ == 0) watch_cv_.notify_one();
  }
  struct Done {  // every return below
    Impl* impl;
    ~Done() {
      std::lock_guard<std::mutex> lock(impl->mu_);
      --impl->running_;
    }
  } done{this};
  if (!broken.empty()) {
    job.work->finish_with_error(std::make_exception_ptr(
        DistBackendError(detail::str_cat(what, " (timeout ", timeout.count(),
                                         " ms) failed: the group is unusable after an "
                                         "earlier failure: ",
                                         broken))));
    return;
  }
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(job.deadline - Clock::now());
  if (left.count() <= 0) {
    fail(job,
         DistTimeoutError(detail::str_cat(what, " timed out after ", timeout.count(),
                                          " ms (waiting behind earlier operations)")),
         mark_broken);
    return;
  }
  std::vector<Tensor> out;
  const int64_t started_us = tracing::stamp();
  struct Waits {  // this group's, while its operation runs here (an inline one may nest)
    dist::detail::AbortableWaits* before = dist::detail::current_waits();
    explicit Waits(dist::detail::AbortableWaits* w) { dist::detail::current_waits() = w; }
    ~Waits() { dist::detail::current_waits() = before; }
  } waits{&waits_};
  try {
    out = job.run(left);
    tracing::record_collective(what, job.queued_us, started_us, out);
  } catch (const ValueError&) {
    job.work->finish_with_error(std::current_exception());
    return;
  } catch (const std::exception& e) {
    std::vector<int> peers;  // the ranks whose addresses Gloo's message names
    const std::string msg =
        dist::detail::name_peers_by_rank(peer_addresses_, e.what(), &peers);
    const bool timed_out =
        msg.find("imed out") != std::string::npos || msg.find("imeout") != std::string::npos;
    const bool peer_gone = msg.find("losed") != std::string::npos ||
                           msg.find("reset") != std::string::npos ||
                           msg.find("Broken pipe") != std::string::npos;
    const std::string aborted = abort_behind(peer_gone);
    // Note [p2p failures end the group]: what Gloo failed breaks the group, p2p or not.
    const bool breaks = mark_broken || timed_out || peer_gone || !aborted.empty();
    if (!aborted.empty()) {
      fail(job,
           DistBackendError(
               detail::str_cat(what, " (timeout ", timeout.count(), " ms) failed: ", aborted)),
           breaks, /*from_abort=*/true);
    } else if (timed_out) {
      fail(job,
           DistTimeoutError(
               detail::str_cat(what, " timed out after ", timeout.count(), " ms: ", msg)),
           breaks);
    } else {
      fail(job,
           DistBackendError(detail::str_cat(what, " (timeout ", timeout.count(), " ms) failed: ",
                                            peer_gone ? dist::detail::closed_by(peers) : "", msg)),
           breaks);
    }
    return;
  }
  job.work->finish(std::move(out));
}

// Fails job with err; a failed collective leaves the ranks out of step, so the group is
// marked broken and its connections closed, which wakes peers blocked on this rank. The first
// failure also says where this rank stands and names where the others do (Note [where a rank
// stands]).
template <typename E>
void ProcessGroupGloo::Impl::fail(Job& job, const E& err, bool mark_broken, bool from_abort) {
  if (!mark_broken || !context_) {
    job.work->finish_with_error(std::make_exception_ptr(err));
    return;
  }
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    first = broken_.empty();
    if (first) broken_ = err.what();
  }
  const bool store_answers =
      first && dist::detail::publish_position(
                   *store_, rank_,
                   detail::str_cat("was at ", dist::detail::short_label(job.work->describe()),
                                   " when it failed"),
                   position_wait_);
  if (store_answers && !from_abort) {  // before the connections close: a woken peer reads it
    write_abort(detail::str_cat("rank ", rank_, " aborted the group at its ",
                                dist::detail::short_label(job.work->describe()), ": ", err.what()),
                position_wait_);
  }
  context_->closeConnections();
  waits_.release_retired();  // Note [buffers of a failed operation]
  if (shm_) shm_->abort(detail::str_cat("rank ", rank_, ": ", err.what()));
  if (!first) {
    job.work->finish_with_error(std::make_exception_ptr(err));
    return;
  }
  const std::string msg = err.what();
  job.work->finish_with_error(std::make_exception_ptr(
      E(msg + (store_answers
                   ? dist::detail::peer_positions(*store_, rank_, size_, msg, position_wait_)
                   : std::string("; the group's store did not answer, so where the other ranks "
                                 "stand is unknown")))));
}

void ProcessGroupGloo::Impl::write_abort(const std::string& text,
                                         std::chrono::milliseconds bound) {
  // Ranks that detect a disagreement together would each write every peer's key: the first
  // record stands, and the ranks after it write nothing (a race leaves a few writes too many).
  if (!peer_abort(std::chrono::milliseconds(1)).empty()) return;
  const std::string record = dist::detail::abort_record(rank_, text);
  const std::string wake = "abort";
  try {
    store_->set_within(dist::detail::abort_key(), Bytes(record.begin(), record.end()), bound);
    for (int r = 0; r < size_; ++r) {
      if (r != rank_) {
        store_->set_within(dist::detail::watch_key(r), Bytes(wake.begin(), wake.end()), bound);
      }
    }
  } catch (const std::exception& e) {
    // The closed connections still wake the peers blocked on this rank.
    logging::debug("[gloo] rank ", rank_, " of ", size_,
                   ": could not write its abort record into the group's store: ", e.what());
  }
}

std::string ProcessGroupGloo::Impl::peer_abort(std::chrono::milliseconds bound) {
  try {
    const auto [rank, text] =
        dist::detail::parse_abort_record(store_->get(dist::detail::abort_key(), bound));
    return rank >= 0 && rank != rank_ ? text : std::string();
  } catch (const std::exception&) {
    return {};  // none within the bound, or no store
  }
}

std::string ProcessGroupGloo::Impl::abort_behind(bool ask_store) {
  // A peer that aborted the group wrote why before it closed its connections (Note [abort
  // through the store]); this rank's watcher may have seen it first.
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_by_.empty()) return aborted_by_;
  }
  if (!ask_store || !store_) return {};
  return peer_abort(std::min(position_wait_, std::chrono::milliseconds(100)));
}

std::string ProcessGroupGloo::Impl::p2p_post_failed(const std::string& what,
                                                    const std::string& gloo_msg) {
  const std::string aborted = abort_behind(/*ask_store=*/true);
  const std::string text =
      detail::str_cat(what, " failed: ", aborted.empty() ? name_peers(gloo_msg) : aborted);
  abort(text);  // Note [p2p failures end the group]
  return text;
}

void ProcessGroupGloo::Impl::abort(const std::string& reason) {
  if (!context_) return;  // world size 1: no peer waits on this rank
  const std::string text = detail::str_cat("rank ", rank_, " aborted the group: ", reason);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.empty()) return;  // the first failure stands, and told the peers
    broken_ = text;
  }
  if (dist::detail::publish_position(*store_, rank_, "aborted the group", position_wait_)) {
    write_abort(text, position_wait_);
  }
  waits_.abort(text);
  context_->closeConnections();
  waits_.release_retired();
  if (shm_) shm_->abort(text);
}

void ProcessGroupGloo::Impl::observe_abort(const std::string& text) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.empty()) return;  // this rank failed already and closed its connections
    broken_ = text;
    aborted_by_ = text;
  }
  waits_.abort(text);  // closing a pair does not wake this rank's own waits on it
  context_->closeConnections();
  waits_.release_retired();
  if (shm_) shm_->abort(detail::str_cat("rank ", rank_, " saw that ", text));
}

void ProcessGroupGloo::Impl::watch() {
  trace::set_thread_name("gloo abort watcher");
  const std::string key = dist::detail::watch_key(rank_);
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      watching_ = false;
      watch_cv_.wait(lock, [&] { return stop_ || (running_ > 0 && broken_.empty()); });
      if (stop_) return;
      watching_ = true;
    }
    try {
      const Bytes b = store_->get(key, dist::detail::kAbortWatchInterval);
      if (std::string(b.begin(), b.end()) != "abort") return;  // "closing": being destroyed
      const std::string text = peer_abort(position_wait_);
      observe_abort(text.empty() ? std::string("a peer aborted the group (its record could not be "
                                               "read from the group's store)")
                                 : text);
      std::lock_guard<std::mutex> lock(mu_);
      watching_ = false;
      return;
    } catch (const DistTimeoutError&) {
      // Nothing within the interval: park again while the group is busy.
    } catch (const std::exception& e) {
      // The store failed (its host exited?): the operations' own timeouts still bound them.
      logging::debug("[gloo] rank ", rank_, " of ", size_,
                     ": the abort watcher could not ask the group's store: ", e.what());
      std::unique_lock<std::mutex> lock(mu_);
      watching_ = false;
      watch_cv_.wait_for(lock, dist::detail::kAbortWatchInterval, [&] { return stop_; });
    }
  }
}

void ProcessGroupGloo::Impl::leave(uint64_t issued) {
  if (!context_) return;
  std::string last;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.empty()) return;  // the failure said where this rank stands
    last = last_issued_;
  }
  // At a job's end the rank that hosts the store may have exited already: not a failure, so
  // only a debug line says so (Note [where a rank stands]).
  const auto bound = std::min(position_wait_, dist::detail::kLeavingStoreWait);
  std::string why;
  if (!dist::detail::publish_position(
          *store_, rank_,
          last.empty()
              ? std::string("left the group before issuing any operation")
              : detail::str_cat("left the group after issuing ", issued,
                                " operations (the last: ", dist::detail::short_label(last), ")"),
          bound, &why)) {
    logging::debug("[gloo] rank ", rank_, " of ", size_,
                   ": the group's store did not take where this rank stands within ",
                   bound.count(), " ms of the group's destruction (has the rank that hosts it "
                   "exited?): ", why);
  }
}

// ---- ProcessGroupGloo ---------------------------------------------------------------------------

ProcessGroupGloo::ShmTicket ProcessGroupGloo::take_ticket(const char* collective) {
  ShmTicket t;
  t.label = next_op_label(collective);
  t.shm = impl_->shm();
  if (t.shm) t.ticket = t.shm->next_ticket();  // in issue order, as on every rank
  return t;
}

ProcessGroupGloo::ProcessGroupGloo(std::shared_ptr<Store> store, int rank, int size,
                                   GlooOptions options)
    : ProcessGroup(rank, size, Options{options.timeout}) {
  EMBER_CHECK(store != nullptr || size == 1, "[gloo] ProcessGroupGloo needs a store for ", size,
              " ranks");
  EMBER_CHECK(options.timeout.count() > 0, "[gloo] timeout must be positive, got ",
              options.timeout.count(), " ms");
  EMBER_CHECK(options.threads >= 1, "[gloo] GlooOptions::threads must be at least 1, got ",
              options.threads);
  impl_ = std::make_unique<Impl>(*this, std::move(store), options);
}

ProcessGroupGloo::~ProcessGroupGloo() {
  if (impl_) impl_->leave(seq_ + p2p_seq_);
}

bool ProcessGroupGloo::abort(const std::string& reason) {
  impl_->abort(reason);
  return true;
}

bool ProcessGroupGloo::uses_shared_memory() const { return impl_->shm() != nullptr; }

Tensor ProcessGroupGloo::zeros_for_collectives(IntList shape, TensorOptions opts) const {
  if (!uses_shared_memory() || !opts.device_.is_cpu() || opts.pinned_) {
    return ProcessGroup::zeros_for_collectives(shape, opts);
  }
  return empty_shareable(shape, opts);  // zero-filled
}

ProcessGroupGloo::SharedMemoryStats ProcessGroupGloo::shared_memory_stats() const {
  const dist::detail::ShmAllreduce* shm = impl_->shm();
  if (!shm) return {};
  return {shm->single_copies(), shm->mapped_reductions()};
}

}  // namespace ember::dist
