// The flight recorder's rings, their registry and the dump (flight_recorder.h).
#include <ember/distributed/flight_recorder.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <tuple>
#include <utility>

#include <nlohmann/json.hpp>

#include <ember/distributed/detail/environment.h>
#include <ember/distributed/detail/flight_ring.h>
#include <ember/nn/io/atomic_file.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/observe/log.h>

namespace ember::dist {

namespace detail {

namespace {

int64_t wall_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Every registered ring, and a count of records across them: a failure dump is skipped when
// nothing was recorded since the last one (a DDP step whose buckets all fail would otherwise
// write the same files once per bucket).
struct Registry {
  std::mutex mu;
  std::vector<std::weak_ptr<FlightRing>> rings;
  std::atomic<uint64_t> changes{0};
  uint64_t dumped_at = ~uint64_t{0};  // `changes` at the last failure dump
  // The next ordinal of each (group's global ranks, this rank's global rank): never reused, so
  // a group made after another over the same ranks has ended gets a name of its own.
  std::map<std::pair<std::vector<int>, int>, int> next_ordinal;
  bool hinted = false;                // the "set EMBER_FLIGHT_RECORDER_DIR" hint was logged
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: groups may die in static destructors
  return *r;
}

// The rings alive now; the caller holds r.mu.
std::vector<std::shared_ptr<FlightRing>> live_rings_locked(Registry& r) {
  std::vector<std::shared_ptr<FlightRing>> out;
  for (const auto& w : r.rings) {
    if (auto ring = w.lock()) out.push_back(std::move(ring));
  }
  return out;
}

std::vector<std::shared_ptr<FlightRing>> live_rings() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return live_rings_locked(r);
}

std::vector<std::string> dump_rings(const std::vector<std::shared_ptr<FlightRing>>& rings,
                                    const std::string& dir, const std::string& reason);

}  // namespace

const char* to_string(FlightState s) {
  switch (s) {
    case FlightState::Enqueued:
      return "enqueued";
    case FlightState::Started:
      return "started";
    case FlightState::Completed:
      return "completed";
    case FlightState::Failed:
      return "failed";
  }
  return "?";
}

FlightRing::FlightRing(size_t capacity) : capacity_(capacity) {
  EMBER_INTERNAL_ASSERT(capacity > 0, "a flight recorder ring needs room for one entry");
}

uint64_t FlightRing::enqueue(const ProcessGroup& pg, const char* op, uint64_t seq, bool p2p) {
  const int64_t now = wall_us();
  bool first = false;
  uint64_t id = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (slots_.empty()) slots_.resize(capacity_);
    id = ++records_;
    FlightEntry& e = slots_[(id - 1) % slots_.size()];
    e = FlightEntry{};
    e.id = id;
    e.seq = seq;
    e.p2p = p2p;
    e.op = op;
    e.enqueued_us = now;
    first = !registered_;
    registered_ = true;
  }
  Registry& r = registry();
  r.changes.fetch_add(1, std::memory_order_relaxed);
  if (first) {
    // The ordinal tells apart this rank's groups over the same ranks (the default group and a
    // new_group of every rank); ranks make their groups, and use them first, in one order. It
    // counts every such group this rank used, the ended ones too: counting the live ones only
    // gave a group the name of a live one made after an earlier one ended.
    FlightGroupInfo info{pg.backend_name(), pg.rank(), pg.size(), pg.global_ranks(), 0};
    const int me = info.global_ranks[info.rank];
    std::lock_guard<std::mutex> lock(r.mu);
    r.rings.erase(
        std::remove_if(r.rings.begin(), r.rings.end(), [](const auto& w) { return w.expired(); }),
        r.rings.end());
    info.ordinal = r.next_ordinal[{info.global_ranks, me}]++;
    {
      std::lock_guard<std::mutex> ring_lock(mu_);
      info_ = std::move(info);
    }
    r.rings.push_back(weak_from_this());
  }
  return id;
}

FlightEntry* FlightRing::find(uint64_t id) {
  if (id == 0 || slots_.empty()) return nullptr;
  FlightEntry& e = slots_[(id - 1) % slots_.size()];
  return e.id == id ? &e : nullptr;
}

void FlightRing::attach(uint64_t id, const WorkPtr& work, const std::vector<Tensor>& tensors) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    FlightEntry* e = find(id);
    if (e == nullptr) return;
    for (const Tensor& t : tensors) {
      if (!t.defined()) continue;
      e->sizes.push_back(t.shape().vec());
      e->dtypes.emplace_back(dtype_name(t.dtype()));
    }
    e->work = work;
    e->pending = work->future();
  }
  // Outside the lock: a finished future runs the callback at once, and it takes the lock.
  std::weak_ptr<FlightRing> self = weak_from_this();
  work->future()->add_done_callback([self, id](Future& f) {
    if (auto ring = self.lock()) ring->complete(id, f);
  });
}

namespace {
// The state a completed future leaves its entry in, and the error's text.
std::pair<FlightState, std::string> outcome(const Future& f) {
  if (const std::exception_ptr error = f.exception()) {
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      return {FlightState::Failed, e.what()};
    } catch (...) {
      return {FlightState::Failed, "an exception that is not a std::exception"};
    }
  }
  // A future with device events completes when the collective is queued on its stream (NCCL):
  // it has started; snapshot() asks its Work whether it has finished.
  return {f.ready_events().empty() ? FlightState::Completed : FlightState::Started, ""};
}
}  // namespace

namespace {
// Whether the device has passed every event (false if it cannot say).
bool passed(const std::vector<std::shared_ptr<cuda::Event>>& events) {
  try {
    return std::all_of(events.begin(), events.end(), [](const auto& ev) { return ev->query(); });
  } catch (const std::exception&) {
    return false;  // failed on the device: the Work says how
  }
}
}  // namespace

void FlightRing::complete(uint64_t id, const Future& f) {
  auto [state, why] = outcome(f);
  const int64_t now = wall_us();
  {
    std::lock_guard<std::mutex> lock(mu_);
    FlightEntry* e = find(id);
    if (e == nullptr) return;
    e->state = state;
    if (state != FlightState::Started) e->completed_us = now;
    if (state == FlightState::Started) e->device_done = f.ready_events();
    e->error = std::move(why);
    e->pending.reset();
  }
  registry().changes.fetch_add(1, std::memory_order_relaxed);
}

FlightGroupInfo FlightRing::info() const {
  std::lock_guard<std::mutex> lock(mu_);
  return info_;
}

std::vector<FlightEntry> FlightRing::snapshot() const {
  std::vector<FlightEntry> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t n = std::min<uint64_t>(records_, slots_.size());
    for (uint64_t id = records_ - n + 1; id <= records_; ++id) {
      out.push_back(slots_[(id - 1) % slots_.size()]);
    }
  }
  // Outside the lock: a Work's is_completed() may query the device.
  for (FlightEntry& e : out) {
    // Waiters wake before a future's callbacks run, so a rank that dumps right after its wait
    // may find complete() not yet called.
    if (e.state == FlightState::Enqueued && e.pending && e.pending->completed()) {
      std::tie(e.state, e.error) = outcome(*e.pending);
    }
    e.pending.reset();
    if (e.state != FlightState::Started && e.state != FlightState::Enqueued) continue;
    // The device's word first: a group that failed since reports every held Work as failed,
    // the collectives the device finished before the failure included.
    if (e.state == FlightState::Started && !e.device_done.empty() && passed(e.device_done)) {
      e.state = FlightState::Completed;
      continue;
    }
    const WorkPtr w = e.work.lock();
    if (w && w->is_completed()) {
      e.state = w->exception() ? FlightState::Failed : FlightState::Completed;
    }
  }
  // A started collective whose Work is gone (DDP drops its Works once the stream waits for
  // them) is done if a later one of the group is: a group's device work runs in issue order
  // on its stream.
  bool later_done = false;
  for (auto it = out.rbegin(); it != out.rend(); ++it) {
    if (it->state == FlightState::Completed) later_done = true;
    if (it->state == FlightState::Started && later_done) it->state = FlightState::Completed;
  }
  return out;
}

void flight_recorder_on_failure(const std::string& what) noexcept {
  try {
    Registry& r = registry();
    const std::string dir = flight_recorder_dir();
    // The rings are taken with the mark that lets later failures skip their dump, and held until
    // written: a group that ends meanwhile (its rank's failure skipped, as this dump covers it)
    // is still in this dump.
    std::vector<std::shared_ptr<FlightRing>> rings;
    {
      std::lock_guard<std::mutex> lock(r.mu);
      const uint64_t changes = r.changes.load(std::memory_order_relaxed);
      if (r.rings.empty() || changes == r.dumped_at) return;
      if (dir.empty()) {
        if (!r.hinted) {
          logging::info(
              "flight recorder: set EMBER_FLIGHT_RECORDER_DIR to dump the last "
              "collectives of every group when one fails");
        }
        r.hinted = true;
        return;
      }
      r.dumped_at = changes;
      rings = live_rings_locked(r);
    }
    const std::vector<std::string> files = dump_rings(rings, dir, what);
    if (!files.empty()) {
      logging::warn("flight recorder: the last collectives of ", files.size(),
                    files.size() == 1 ? " rank" : " ranks", " are in ", dir,
                    " (ember_flight_analyze ", dir, " compares them)");
    }
  } catch (const std::exception& e) {
    logging::error("flight recorder: the dump after a failed collective failed: ", e.what());
  } catch (...) {
    logging::error("flight recorder: the dump after a failed collective failed");
  }
}

}  // namespace detail

int flight_recorder_size() {
  constexpr int kMax = 1000000;
  const char* meaning = "entries per process group; 0 turns the flight recorder off";
  for (const char* name :
       {"EMBER_FLIGHT_RECORDER_SIZE", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}) {
    if (auto n = detail::int_from_env(name, 0, kMax, meaning)) return *n;
  }
  return kDefaultFlightRecorderSize;
}

std::string flight_recorder_dir() {
  const char* d = std::getenv("EMBER_FLIGHT_RECORDER_DIR");
  return d == nullptr ? std::string() : std::string(d);
}

std::vector<std::string> dump_flight_recorder(const std::string& dir, const std::string& reason) {
  return detail::dump_rings(detail::live_rings(), dir, reason);
}

namespace detail {
namespace {

std::vector<std::string> dump_rings(const std::vector<std::shared_ptr<FlightRing>>& rings,
                                    const std::string& dir, const std::string& reason) {
  using nlohmann::json;
  EMBER_CHECK(!dir.empty(), "[dump_flight_recorder] expected a folder, got an empty path");
  // One document per global rank: the threads backend's ranks share this process.
  std::map<int, json> by_rank;
  for (const auto& ring : rings) {
    const detail::FlightGroupInfo info = ring->info();
    const int me = info.global_ranks[info.rank];
    json entries = json::array();
    for (const detail::FlightEntry& e : ring->snapshot()) {
      json j = {{"seq", e.seq},
                {"op", e.op},
                {"sizes", e.sizes},
                {"dtypes", e.dtypes},
                {"state", detail::to_string(e.state)},
                {"enqueued_us", e.enqueued_us},
                {"completed_us", e.completed_us}};
      if (e.p2p) j["p2p"] = true;
      if (!e.error.empty()) j["error"] = e.error;
      entries.push_back(std::move(j));
    }
    json& doc = by_rank[me];
    if (doc.is_null()) {
      doc = {{"format", "ember-flight-recorder"},
             {"version", 1},
             {"rank", me},
             {"pid", static_cast<int64_t>(::getpid())},
             {"reason", reason},
             {"dumped_us", detail::wall_us()},
             {"groups", json::array()}};
    }
    doc["groups"].push_back(
        {{"name", detail::str_cat("ranks ", json(info.global_ranks).dump(), " #", info.ordinal)},
         {"backend", info.backend},
         {"rank", info.rank},
         {"size", info.size},
         {"global_ranks", info.global_ranks},
         {"entries", std::move(entries)}});
  }
  if (by_rank.empty()) return {};
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  EMBER_CHECK(!ec, "[dump_flight_recorder] cannot create the folder ", dir, ": ", ec.message());
  std::vector<std::string> files;
  for (const auto& [rank, doc] : by_rank) {
    const std::string path =
        (std::filesystem::path(dir) / ("flight_rank" + std::to_string(rank) + ".json")).string();
    nn::write_file_atomic(path, doc.dump(1));
    files.push_back(path);
  }
  return files;
}

}  // namespace
}  // namespace detail

}  // namespace ember::dist
