// Device-side spans on the timeline (tensor/observe/trace.h): work on a CUDA stream measured by two
// timing events, recorded once the device has passed them, so that the span is the time the
// device ran it rather than the time the host took to queue it (a collective on the NCCL
// stream, a DDP bucket's reduction).
//
// Note [device span clock]: event times are relative to other events. To put them on the
// trace clock, each device has an anchor: an event recorded on an idle stream of its own and
// waited for, read against the host's steady clock before the record and after the wait; the
// anchor's host time is the middle of that window, off by at most half of it (a few
// microseconds). A span's start is then the anchor's host time plus the device time from the
// anchor to its start event. The anchor is renewed when older than kAnchorMaxAge, so the
// float milliseconds cudaEventElapsedTime returns stay finer than a microsecond. Renewing waits
// for the anchor's own stream only, never for the caller's work.
//
// Resolution is off the caller's path: DeviceSpan::finish only queues the span;
// resolve_device_spans() (the NCCL watchdog calls it between its polls) records those whose end
// event has passed without waiting, and trace::stop() waits for the rest (bounded) before it
// writes the file. Off, a DeviceSpan costs one predictable branch and touches no CUDA API.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/observe/trace.h>

namespace ember::trace {

/// What a device span shows on the timeline once its events are resolved.
struct DeviceSpanInfo {
  std::string name;
  const char* cat = "cuda";
  std::string args;  // a JSON object body ("\"k\":v,...") or ""
  int row = 0;       // complete_on_row's row: trace::unique_row(), one per stream
  std::string row_name;
  /// Trace clock when the host queued the work (0: none): adds arg queued_us, the time from
  /// then until the device started it (behind earlier work on the stream).
  int64_t queued_since_us = 0;
};

namespace detail {
struct DeviceAnchor;
}  // namespace detail

/// A span of the work queued on a CUDA stream between its construction and finish().
///   trace::DeviceSpan span(stream);            // a timing event on `stream`, when tracing
///   ...queue work on stream...
///   if (span.active()) span.finish(stream, {"allreduce", "collective", args, row, "nccl"});
class DeviceSpan {
 public:
  DeviceSpan() = default;
  DeviceSpan(DeviceSpan&&) = default;
  DeviceSpan& operator=(DeviceSpan&&) = default;
  DeviceSpan(const DeviceSpan&) = delete;  // one span, recorded once
  DeviceSpan& operator=(const DeviceSpan&) = delete;
  /// Records the start event on `s` when tracing is on; otherwise does nothing.
  explicit DeviceSpan(const cuda::Stream& s) {
    if (enabled()) begin(s);
  }
  /// Whether it recorded a start event (tracing was on): only then is finish() worth its info.
  bool active() const { return start_ != nullptr; }
  /// Records the end event on `s` (the stream it started on) and queues the span for
  /// resolution; it reaches the trace once the device has passed the end event.
  void finish(const cuda::Stream& s, DeviceSpanInfo info) {
    if (start_) end(s, std::move(info));
  }

 private:
  void begin(const cuda::Stream& s);
  void end(const cuda::Stream& s, DeviceSpanInfo info);
  std::shared_ptr<cuda::Event> start_;
  std::shared_ptr<const detail::DeviceAnchor> anchor_;
};

/// How long an anchor serves before it is renewed (Note [device span clock]).
constexpr std::chrono::seconds kAnchorMaxAge{10};

/// Records the queued device spans whose end event the device has passed; never waits.
void resolve_device_spans();
/// Waits up to `limit` for the queued device spans and records them; those still running then
/// are dropped (a warning says how many). trace::stop() runs it.
void flush_device_spans(std::chrono::milliseconds limit = std::chrono::seconds(10));
/// The device spans queued and not yet resolved (for tests).
size_t pending_device_spans();

}  // namespace ember::trace
