// Ember's timeline recorder: spans of chosen steps (backward, DDP buckets, collectives, data
// loading, the optimizer step, checkpoint writes) written per rank as Chrome trace-event JSON,
// which Perfetto (ui.perfetto.dev) and chrome://tracing open. EMBER_TRACE=DIR starts it when the
// library loads and EMBER_TRACE_LEVEL=ops adds a span per autograd node; start/stop do the same
// around chosen steps. It lives in ember_log, under the autograd, nn and distributed libraries,
// so that all of them can record into one buffer.
//
// Off, a Span costs one predictable branch on a global atomic: no clock read, no allocation.
// On, each thread appends to its own buffer (registered once with the recorder; only stop()
// takes the buffers' locks), with steady-clock microseconds. stop() and process exit write
// DIR/trace_rank<R>.json atomically (a temp file renamed over the target), with timestamps
// already shifted to rank 0's clock (set_clock_offset, measured by init_process_group), one
// event per line, so emberrun can merge the ranks' files by concatenating lines.
#pragma once

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>

namespace ember::trace {

enum class Level : int { Off = 0, Steps = 1, Ops = 2 };

namespace detail {
extern std::atomic<int> g_level;
}  // namespace detail

/// True while recording at `l` or finer. One relaxed atomic load: the off path.
inline bool enabled(Level l = Level::Steps) {
  return detail::g_level.load(std::memory_order_relaxed) >= static_cast<int>(l);
}

/// Starts recording into `dir` (created with its parents) at `level`; the file is
/// `dir/trace_rank<rank>.json`, rank from `rank` if >= 0, else the RANK environment variable, else
/// 0. Events recorded before are dropped. Throws ember::Error if the folder cannot be made.
void start(const std::string& dir, Level level = Level::Steps, int rank = -1);
/// Stops recording and writes the file; returns its path ("" when nothing was recording).
/// Throws ember::Error naming the file if it cannot be written. Also runs at process exit.
std::string stop();
/// Stops recording and drops the events without writing a file: for a process that loads the
/// library but is no rank (emberrun, whose workers inherit EMBER_TRACE).
void discard();
/// Parses EMBER_TRACE_LEVEL's values "steps" (default) and "ops"; throws ValueError otherwise.
Level parse_level(std::string_view name);

/// The recorder's clock: steady-clock microseconds.
int64_t now_us();
/// This rank's clock minus rank 0's (so rank 0's time = now_us() - offset), and the bound on
/// its error; written into the file, and subtracted from every timestamp when it is written.
void set_clock_offset(int rank, int64_t offset_us, int64_t error_us);
int rank();

/// Arguments of an event, as (key, integer) pairs: bytes, sequence numbers, bucket indices.
using Args = std::initializer_list<std::pair<const char*, int64_t>>;

/// Records a complete ("X") event; `extra_args` is a JSON object body ("\"k\":v,...") or "".
void complete(std::string_view name, const char* cat, int64_t start_us, int64_t dur_us,
              Args args = {}, std::string_view extra_args = {});
/// The same on a named row of its own (`row` >= 1000, so that it is no thread's), for spans
/// that overlap on the thread that records them (DDP buckets in flight together) or that no
/// thread ran (a CUDA stream's work).
void complete_on_row(int row, std::string_view row_name, std::string_view name, const char* cat,
                     int64_t start_us, int64_t dur_us, Args args = {},
                     std::string_view extra_args = {});
/// A row number for complete_on_row that no other caller of this function gets (from 2000, so
/// that DDP's bucket rows, 1000 + bucket index, never collide with it).
int unique_row();

/// What a collective's span shows, from its label "[backend] op #seq on rank r of n": the name
/// (the op) and the args seq, bytes and backend as a JSON object body (queued_us is the caller's).
struct CollectiveFields {
  std::string name;
  std::string args;
};
CollectiveFields collective_fields(std::string_view label, int64_t bytes);
/// A collective's span from `started_us` to now on this thread, from its label (see
/// collective_fields), with args seq, bytes, backend and queued_us (the time between
/// `queued_us`, when it was submitted, and `started_us`; 0 when not queued).
void collective(std::string_view label, int64_t queued_us, int64_t started_us, int64_t bytes);

/// Registers `flush`, which stop() runs before it writes the file (while recording is still
/// on): for recorders whose spans are only known later (CUDA events resolved once the device
/// has passed them, tensor/gpu/trace_device.h). Registered once per function; kept for the process.
void add_stop_hook(void (*flush)());
/// Names this thread's row in the file ("gloo worker"); the process's main thread is named
/// "main thread" without asking. Only remembered until the thread first records (off, a
/// thread that names itself registers nothing with the recorder).
void set_thread_name(std::string_view name);
/// An instant ("i") event now, on this thread.
void instant(std::string_view name, const char* cat, Args args = {});
/// A counter ("C") event now: Perfetto draws `name` as a track of `value`.
void counter(std::string_view name, double value);

/// Records [construction, destruction) as a complete event when tracing is on at `level` at
/// construction. Span s("allreduce", "ddp", {{"bytes", n}});  s.arg("seq", k) adds one later.
class Span {
 public:
  Span(std::string_view name, const char* cat, Args args = {}, Level level = Level::Steps) {
    if (enabled(level)) begin(name, cat, args);
  }
  // A name that is a C string is measured only when the span records (an autograd node's name).
  Span(const char* name, const char* cat, Args args = {}, Level level = Level::Steps) {
    if (enabled(level)) begin(name, cat, args);
  }
  ~Span() {
    if (active_) end();
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;
  void arg(const char* key, int64_t value) {
    if (active_) add_arg(key, value);
  }
  /// Ends the span now rather than at destruction.
  void finish() {
    if (active_) end();
  }

 private:
  void begin(std::string_view name, const char* cat, Args args);
  void add_arg(const char* key, int64_t value);
  void end();
  bool active_ = false;
  const char* cat_ = nullptr;
  int64_t start_us_ = 0;
  std::string name_;
  std::string args_;
};

}  // namespace ember::trace
