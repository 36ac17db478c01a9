#include <ember/tensor/gpu/trace_device.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include <ember/tensor/observe/log.h>

namespace ember::trace {

namespace detail {
// Note [device span clock].
struct DeviceAnchor {
  cuda::Event event{/*enable_timing=*/true};
  int64_t host_us = 0;   // trace clock at which the device passed `event`
  int64_t error_us = 0;  // bound on host_us's error
};
}  // namespace detail

namespace {

using detail::DeviceAnchor;

// How many spans may wait before finish() resolves them itself, so that a program nobody
// resolves for (no NCCL watchdog) holds a bounded number of events.
constexpr size_t kResolveAt = 256;

struct PendingSpan {
  std::shared_ptr<cuda::Event> start;
  std::shared_ptr<cuda::Event> end;
  std::shared_ptr<const DeviceAnchor> anchor;
  DeviceSpanInfo info;
};

struct DeviceSpans {
  std::mutex mu;
  std::vector<PendingSpan> pending;
  std::map<int, std::shared_ptr<const DeviceAnchor>> anchors;  // by device
  std::map<int, cuda::Stream> anchor_streams;                  // by device, made once
  bool hooks_registered = false;
};

// Leaked on purpose: the exit handlers use it after static destruction may have begun.
DeviceSpans& spans() {
  static DeviceSpans* s = new DeviceSpans();
  return *s;
}

void flush_at_exit() {
  try {
    flush_device_spans();
  } catch (const std::exception& e) {
    logging::warn("[trace] device spans dropped at exit: ", e.what());
  }
}
void flush_at_stop() { flush_device_spans(); }

// A fresh anchor for `device` (Note [device span clock]): of three tries, the narrowest
// window. The caller holds spans().mu.
std::shared_ptr<const DeviceAnchor> make_anchor(DeviceSpans& d, int device) {
  auto it = d.anchor_streams.find(device);
  if (it == d.anchor_streams.end())
    it = d.anchor_streams.emplace(device, cuda::Stream::create(device)).first;
  std::shared_ptr<DeviceAnchor> best;
  for (int k = 0; k < 3; ++k) {
    auto a = std::make_shared<DeviceAnchor>();
    const int64_t before = now_us();
    a->event.record(it->second);
    a->event.synchronize();
    const int64_t after = now_us();
    a->host_us = before + (after - before) / 2;
    a->error_us = (after - before + 1) / 2;
    if (!best || a->error_us < best->error_us) best = std::move(a);
  }
  return best;
}

// The anchor of `device`, renewed when older than kAnchorMaxAge.
std::shared_ptr<const DeviceAnchor> anchor_for(int device) {
  DeviceSpans& d = spans();
  std::lock_guard<std::mutex> lock(d.mu);
  if (!d.hooks_registered) {
    // After CUDA is initialised, so that at exit this runs before CUDA's own teardown (exit
    // handlers run in reverse order of registration) and the events can still be read.
    std::atexit(flush_at_exit);
    add_stop_hook(flush_at_stop);
    d.hooks_registered = true;
  }
  auto& a = d.anchors[device];
  const int64_t max_age_us =
      std::chrono::duration_cast<std::chrono::microseconds>(kAnchorMaxAge).count();
  if (!a || now_us() - a->host_us > max_age_us) a = make_anchor(d, device);
  return a;
}

// Writes one resolved span; both its events have passed.
void record(const PendingSpan& p) {
  const double from_anchor_ms = p.anchor->event.elapsed_ms(*p.start);
  const double dur_ms = p.start->elapsed_ms(*p.end);
  const int64_t start_us = p.anchor->host_us + std::llround(from_anchor_ms * 1000.0);
  const int64_t dur_us = std::llround(dur_ms * 1000.0);
  std::string args = p.info.args;
  if (p.info.queued_since_us != 0) {
    if (!args.empty()) args += ',';
    args += "\"queued_us\":" + std::to_string(std::max<int64_t>(0, start_us - p.info.queued_since_us));
  }
  complete_on_row(p.info.row, p.info.row_name, p.info.name, p.info.cat, start_us, dur_us, {},
                  args);
}

// Takes the pending spans whose end event has passed (all of them when `all`); a span whose
// event reports a device error is dropped (the work's owner reports that error).
std::vector<PendingSpan> take_done(bool all) {
  DeviceSpans& d = spans();
  std::vector<PendingSpan> done;
  std::lock_guard<std::mutex> lock(d.mu);
  std::vector<PendingSpan> still;
  for (PendingSpan& p : d.pending) {
    bool passed = all;
    bool failed = false;
    if (!all) {
      try {
        passed = p.end->query();
      } catch (const std::exception&) {
        failed = true;
      }
    }
    if (failed) continue;
    (passed ? done : still).push_back(std::move(p));
  }
  d.pending = std::move(still);
  return done;
}

void record_all(const std::vector<PendingSpan>& done) {
  for (const PendingSpan& p : done) {
    try {
      record(p);
    } catch (const std::exception& e) {
      logging::warn("[trace] device span '", p.info.name, "' dropped: ", e.what());
    }
  }
}

}  // namespace

void DeviceSpan::begin(const cuda::Stream& s) {
  anchor_ = anchor_for(s.device());
  start_ = std::make_shared<cuda::Event>(/*enable_timing=*/true);
  start_->record(s);
}

void DeviceSpan::end(const cuda::Stream& s, DeviceSpanInfo info) {
  auto end_event = std::make_shared<cuda::Event>(/*enable_timing=*/true);
  end_event->record(s);
  bool crowded = false;
  {
    DeviceSpans& d = spans();
    std::lock_guard<std::mutex> lock(d.mu);
    d.pending.push_back(
        PendingSpan{std::move(start_), std::move(end_event), std::move(anchor_), std::move(info)});
    crowded = d.pending.size() >= kResolveAt;
  }
  start_ = nullptr;
  anchor_ = nullptr;
  if (crowded) resolve_device_spans();
}

void resolve_device_spans() { record_all(take_done(/*all=*/false)); }

void flush_device_spans(std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (int spins = 0;; ++spins) {
    resolve_device_spans();
    if (pending_device_spans() == 0) return;
    if (std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::microseconds(spins < 100 ? 50 : 1000));
  }
  const size_t dropped = take_done(/*all=*/true).size();
  logging::warn("[trace] ", dropped, " device span(s) still running on the device after ",
                limit.count(), " ms were left out of the trace");
}

size_t pending_device_spans() {
  DeviceSpans& d = spans();
  std::lock_guard<std::mutex> lock(d.mu);
  return d.pending.size();
}

}  // namespace ember::trace
