#include <ember/launcher/rendezvous_store.h>

#include <unistd.h>

#include <algorithm>

namespace ember::launcher {
namespace {

using namespace detail;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

std::string this_host(const LaunchConfig& c) {
  if (!c.local_addr.empty()) return c.local_addr;
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "?";
  return buf;
}

}  // namespace

RendezvousStore::RendezvousStore(const LaunchConfig& config, std::function<bool()> interrupted)
    : config_(config),
      interrupted_(std::move(interrupted)),
      self_(this_host(config) + " pid " + std::to_string(getpid())) {}

void RendezvousStore::attach(dist::Store& records, dist::Store& leased) {
  store_ = &records;
  leased_ = &leased;
}

std::string RendezvousStore::endpoint() const {
  const std::string& h = host();
  return (h.find(':') != std::string::npos ? "[" + h + "]" : h) + ":" + std::to_string(port());
}

std::string RendezvousStore::describe_self() const {
  return "node " + (node_rank_ < 0 ? std::string("?") : std::to_string(node_rank_)) + " (" + self_ +
         ")";
}

milliseconds RendezvousStore::request_timeout() const { return to_ms(config_.rdzv_read_timeout_s); }

std::string RendezvousStore::key(const std::string& k) const {
  std::string out = "emberrun/";
  out.append(config_.rdzv_id).append("/").append(k);
  return out;
}

std::string RendezvousStore::round_key(int round, const std::string& k) const {
  // Appended piecewise: GCC 12 warns (-Wrestrict, falsely) on "r" + to_string(...) + "/".
  std::string out = "r";
  out.append(std::to_string(round)).append("/").append(k);
  return key(out);
}

std::string RendezvousStore::node_key(int round, int node) const {
  return round_key(round, "node/" + std::to_string(node));
}

std::string RendezvousStore::node_record() const {
  return std::to_string(config_.nproc_per_node) + " " + self_;
}

void RendezvousStore::throw_if_closed() {
  const std::string k = key("closed");
  if (store_->check({k})) {
    throw RendezvousError("the run was closed by another node: " +
                          to_s(store_->get(k, request_timeout())));
  }
}

void RendezvousStore::close(const std::string& reason) {
  try {
    store_->compare_set(key("closed"), {}, to_b(reason));
  } catch (const dist::DistError&) {
  }
}

bool RendezvousStore::wait_keys(const std::vector<std::string>& keys, Clock::time_point deadline,
                                bool watch_closed) {
  for (;;) {
    auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return store_->check(keys);
    try {
      store_->wait(keys, std::clamp(left, milliseconds(1), kPollChunk));
      return true;
    } catch (const dist::DistTimeoutError&) {
    }
    if (interrupted()) throw RendezvousInterrupted("interrupted during the rendezvous");
    if (watch_closed) throw_if_closed();
  }
}

int RendezvousStore::round_restarts(int round) {
  const int prev = round - 1;
  int restarts = std::stoi(to_s(store_->get(round_key(prev, "restarts"), request_timeout())));
  const std::string failed = round_key(prev, "failed");
  if (store_->check({failed}) &&
      !parse_failure(to_s(store_->get(failed, request_timeout()))).new_nodes())
    ++restarts;
  return restarts;
}

int RendezvousStore::expected_nodes(int round, const std::function<bool(int, int)>& alive) {
  if (round == 0) return config_.max_nodes;
  const int prev = round - 1;  // Note [Elastic membership]
  const int n = std::stoi(to_s(store_->get(round_key(prev, "nnodes"), request_timeout())));
  int count = 0;
  for (int i = 0; i < n; ++i) {
    const std::string node = std::to_string(i);
    if (!store_->check({round_key(prev, "lost/" + node)}) &&
        !store_->check({round_key(prev, "exit/" + node)}) && (!alive || alive(prev, i)))
      ++count;
  }
  return count + static_cast<int>(store_->add(round_key(prev, "waiting"), 0));
}

int RendezvousStore::close_round(int round, int expected, milliseconds recheck,
                                 const std::function<int(int)>& recount) {
  std::vector<std::string> required;
  for (int i = 0; i < config_.min_nodes; ++i) required.push_back(node_key(round, i));
  if (!wait_keys(required, Clock::now() + to_ms(config_.rdzv_timeout_s), false)) {
    const std::string msg = round_timeout_message(round);
    close(msg);
    throw RendezvousError(msg);
  }
  int n = config_.min_nodes;
  // MIN:MAX: more nodes may still come during the last call, unless every node expected did.
  const auto last_call = Clock::now() + to_ms(config_.last_call_s);
  while (n < config_.max_nodes && n < expected) {
    const auto until = recount ? std::min(last_call, Clock::now() + recheck) : last_call;
    if (wait_keys({node_key(round, n)}, until, false)) {
      ++n;
      continue;
    }
    if (!recount || Clock::now() >= last_call) break;
    expected = recount(expected);
  }
  while (n < config_.max_nodes && store_->check({node_key(round, n)})) ++n;  // already there
  // First writer wins: a leader that lost its lease (etcd) may still get here beside the one
  // that replaced it.
  return std::stoi(
      to_s(store_->compare_set(round_key(round, "nnodes"), {}, to_b(std::to_string(n)))));
}

std::string RendezvousStore::round_timeout_message(int round) {
  std::string missing, joined;
  for (int i = 0; i < config_.min_nodes; ++i) {
    const std::string ki = node_key(round, i);
    if (store_->check({ki})) {
      std::string v = to_s(store_->get(ki, request_timeout()));
      joined +=
          (joined.empty() ? "" : ", ") + std::to_string(i) + " (" + v.substr(v.find(' ') + 1) + ")";
    } else {
      missing += (missing.empty() ? "" : ", ") + std::to_string(i);
    }
  }
  return "rendezvous round " + std::to_string(round) + " at " + endpoint() + " timed out after " +
         seconds_str(config_.rdzv_timeout_s) +
         " (--rdzv-timeout or --rdzv-conf join_timeout): nodes " + missing +
         " never arrived (expected " + std::to_string(config_.min_nodes) + "; joined: " + joined +
         ")" + (config_.node_rank_given ? "" : "; node ranks are given out by arrival");
}

int RendezvousStore::round_size(int round, int k) {
  const int n = std::stoi(to_s(store_->get(round_key(round, "nnodes"), request_timeout())));
  if (k >= n && !config_.elastic()) {
    throw RendezvousError(describe_self() + " arrived after rendezvous round " +
                          std::to_string(round) + " closed with " + std::to_string(n) +
                          " nodes (--nnodes " + std::to_string(config_.min_nodes) + ":" +
                          std::to_string(config_.max_nodes) + ", --rdzv-last-call)");
  }
  return n;
}

}  // namespace ember::launcher
