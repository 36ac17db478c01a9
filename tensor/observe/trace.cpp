#include <ember/tensor/observe/trace.h>

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include <ember/tensor/error.h>

namespace ember::trace {

namespace detail {
std::atomic<int> g_level{0};
}  // namespace detail

namespace {

struct Event {
  char ph;  // 'X' complete, 'i' instant, 'C' counter
  std::string name;
  const char* cat;
  int64_t ts;
  int64_t dur;
  std::string args;  // a JSON object body, without braces
  int row = -1;      // >= 0: drawn on this row instead of the recording thread's
};

// One per thread that ever recorded. Its lock is uncontended except while stop() drains it.
struct Buffer {
  std::mutex mu;
  std::vector<Event> events;
  int tid = 0;
  std::string name;  // the row's name in the file ("" : none)
};

struct Recorder {
  std::mutex mu;  // guards everything below, and start/stop against each other
  std::vector<std::shared_ptr<Buffer>> buffers;
  int next_tid = 0;
  std::string dir;
  int rank = 0;
  int64_t offset_us = 0;
  int64_t error_us = -1;  // -1: not measured (a single process, or before init_process_group)
  Level level = Level::Off;
  bool atexit_registered = false;
  std::map<int, std::string> row_names;  // complete_on_row's rows
  std::vector<void (*)()> stop_hooks;     // add_stop_hook's
};

// Leaked on purpose: threads still running at exit may record after static destructors ran.
Recorder& recorder() {
  static Recorder* r = new Recorder();
  return *r;
}

// This thread's name (set_thread_name), kept here until the thread first records, so that a
// thread that never records registers no buffer.
thread_local std::string t_thread_name;
thread_local Buffer* t_buffer = nullptr;

Buffer& this_thread_buffer() {
  thread_local std::shared_ptr<Buffer> buffer = [] {
    auto b = std::make_shared<Buffer>();
    b->name = !t_thread_name.empty()        ? t_thread_name
              : ::gettid() == ::getpid() ? std::string("main thread")
                                         : std::string();
    t_buffer = b.get();
    Recorder& r = recorder();
    std::lock_guard<std::mutex> lock(r.mu);
    b->tid = r.next_tid++;
    r.buffers.push_back(b);
    return b;
  }();
  return *buffer;
}

void push(Event&& e) {
  Buffer& b = this_thread_buffer();
  std::lock_guard<std::mutex> lock(b.mu);
  b.events.push_back(std::move(e));
}

void append_escaped(std::string& out, std::string_view s) {
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\u%04x", static_cast<unsigned>(c));
      out += hex;
    } else {
      out += c;
    }
  }
}

void append_args(std::string& out, Args args) {
  for (const auto& [key, value] : args) {
    if (!out.empty()) out += ',';
    out += '"';
    out += key;
    out += "\":";
    out += std::to_string(value);
  }
}

std::string event_json(const Event& e, int pid, int tid, int64_t offset_us) {
  std::string s = "{\"ph\":\"";
  s += e.ph;
  s += "\",\"pid\":" + std::to_string(pid) + ",\"tid\":" + std::to_string(tid) +
       ",\"ts\":" + std::to_string(e.ts - offset_us);
  if (e.ph == 'X') s += ",\"dur\":" + std::to_string(e.dur);
  if (e.ph == 'i') s += ",\"s\":\"t\"";
  s += ",\"name\":\"";
  append_escaped(s, e.name);
  s += "\",\"cat\":\"";
  s += e.cat;
  s += "\",\"args\":{" + e.args + "}}";
  return s;
}

// Takes every thread's events out of its buffer (the recorder's lock is held by the caller).
std::vector<std::pair<int, std::vector<Event>>> drain(Recorder& r) {
  std::vector<std::pair<int, std::vector<Event>>> out;
  for (auto& b : r.buffers) {
    std::lock_guard<std::mutex> lock(b->mu);
    out.emplace_back(b->tid, std::move(b->events));
    b->events.clear();
  }
  return out;
}

// The names of the rows: complete_on_row's, and those of the threads that have one (the caller
// holds the recorder's lock).
std::map<int, std::string> row_names(Recorder& r) {
  std::map<int, std::string> names = r.row_names;
  for (auto& b : r.buffers) {
    std::lock_guard<std::mutex> lock(b->mu);
    if (!b->name.empty()) names.emplace(b->tid, b->name);
  }
  return names;
}

std::string write_file(Recorder& r, Level level) {
  namespace fs = std::filesystem;
  const fs::path path = fs::path(r.dir) / ("trace_rank" + std::to_string(r.rank) + ".json");
  const fs::path tmp = path.string() + ".tmp." + std::to_string(::getpid());
  auto threads = drain(r);
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    // The first line holds what is not an event; every later line but the last is one event
    // ending in ','; the last is "]}". emberrun's merge relies on this layout.
    f << "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"rank\":" << r.rank
      << ",\"clock_offset_us\":" << r.offset_us << ",\"clock_error_us\":" << r.error_us
      << ",\"level\":\"" << (level == Level::Ops ? "ops" : "steps") << "\"},\"traceEvents\":[\n";
    f << "{\"ph\":\"M\",\"pid\":" << r.rank << ",\"tid\":0,\"name\":\"process_name\",\"args\":"
      << "{\"name\":\"rank " << r.rank << "\"}}";
    f << ",\n{\"ph\":\"M\",\"pid\":" << r.rank << ",\"tid\":0,\"name\":\"process_sort_index\","
      << "\"args\":{\"sort_index\":" << r.rank << "}}";
    for (const auto& [row, name] : row_names(r)) {
      std::string escaped;
      append_escaped(escaped, name);
      f << ",\n{\"ph\":\"M\",\"pid\":" << r.rank << ",\"tid\":" << row
        << ",\"name\":\"thread_name\",\"args\":{\"name\":\"" << escaped << "\"}}";
    }
    for (const auto& [tid, events] : threads)
      for (const Event& e : events)
        f << ",\n" << event_json(e, r.rank, e.row >= 0 ? e.row : tid, r.offset_us);
    f << "\n]}\n";
    f.flush();
    if (!f)
      throw Error(::ember::detail::str_cat("[trace] rank ", r.rank, ": cannot write ",
                                           tmp.string()));
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    fs::remove(tmp, ec);
    throw Error(::ember::detail::str_cat("[trace] rank ", r.rank, ": cannot rename ",
                                         tmp.string(), " to ", path.string(), ": ", ec.message()));
  }
  return path.string();
}

void stop_at_exit() {
  try {
    stop();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ember trace: %s\n", e.what());
  }
}

int rank_from_env() {
  for (const char* name : {"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"}) {
    const char* v = std::getenv(name);
    if (v != nullptr && *v != '\0') return std::atoi(v);
  }
  return 0;
}

// EMBER_TRACE=DIR starts recording when ember_log loads, before main, so that a program needs
// no code of its own to be traced.
[[maybe_unused]] const bool g_started_from_env = [] {
  const char* dir = std::getenv("EMBER_TRACE");
  if (dir == nullptr || *dir == '\0') return false;
  const char* lvl = std::getenv("EMBER_TRACE_LEVEL");
  try {
    start(dir, lvl != nullptr && *lvl != '\0' ? parse_level(lvl) : Level::Steps);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ember trace: EMBER_TRACE=%s: %s\n", dir, e.what());
    return false;
  }
  return true;
}();

}  // namespace

Level parse_level(std::string_view name) {
  if (name == "steps") return Level::Steps;
  if (name == "ops") return Level::Ops;
  throw ValueError(::ember::detail::str_cat("[EMBER_TRACE_LEVEL] expected steps or ops, got '",
                                            name, "'"));
}

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void start(const std::string& dir, Level level, int rank) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    throw Error(::ember::detail::str_cat("[trace] cannot create the folder ", dir, ": ",
                                         ec.message()));
  drain(r);  // events recorded before this start belong to no file
  r.dir = dir;
  r.rank = rank >= 0 ? rank : rank_from_env();
  r.level = level == Level::Off ? Level::Steps : level;
  if (!r.atexit_registered) {
    std::atexit(stop_at_exit);
    r.atexit_registered = true;
  }
  detail::g_level.store(static_cast<int>(r.level), std::memory_order_relaxed);
}

// Runs the stop hooks without holding the recorder's lock: they record events.
static void run_stop_hooks() {
  std::vector<void (*)()> hooks;
  {
    Recorder& r = recorder();
    std::lock_guard<std::mutex> lock(r.mu);
    if (r.level == Level::Off) return;
    hooks = r.stop_hooks;
  }
  for (auto hook : hooks) {
    try {
      hook();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "ember trace: %s\n", e.what());
    }
  }
}

std::string stop() {
  run_stop_hooks();
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.level == Level::Off) return "";
  detail::g_level.store(0, std::memory_order_relaxed);
  const Level level = r.level;
  r.level = Level::Off;  // a failed write is not retried at exit
  return write_file(r, level);
}

void discard() {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  detail::g_level.store(0, std::memory_order_relaxed);
  r.level = Level::Off;
  drain(r);
}

void set_clock_offset(int rank_, int64_t offset_us, int64_t error_us) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  r.rank = rank_;
  r.offset_us = offset_us;
  r.error_us = error_us;
}

int rank() {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.rank;
}

void complete(std::string_view name, const char* cat, int64_t start_us, int64_t dur_us,
              Args args, std::string_view extra_args) {
  if (!enabled()) return;
  std::string a;
  append_args(a, args);
  if (!extra_args.empty()) {
    if (!a.empty()) a += ',';
    a += extra_args;
  }
  push(Event{'X', std::string(name), cat, start_us, dur_us, std::move(a)});
}

void complete_on_row(int row, std::string_view row_name, std::string_view name, const char* cat,
                     int64_t start_us, int64_t dur_us, Args args, std::string_view extra_args) {
  if (!enabled()) return;
  {
    Recorder& r = recorder();
    std::lock_guard<std::mutex> lock(r.mu);
    if (!r.row_names.count(row)) r.row_names.emplace(row, row_name);
  }
  std::string a;
  append_args(a, args);
  if (!extra_args.empty()) {
    if (!a.empty()) a += ',';
    a += extra_args;
  }
  push(Event{'X', std::string(name), cat, start_us, dur_us, std::move(a), row});
}

int unique_row() {
  static std::atomic<int> next{2000};
  return next.fetch_add(1, std::memory_order_relaxed);
}

CollectiveFields collective_fields(std::string_view label, int64_t bytes) {
  const size_t close = label.find("] ");
  const std::string_view backend =
      label.size() > 1 && label[0] == '[' && close != std::string_view::npos
          ? label.substr(1, close - 1)
          : std::string_view{};
  const size_t op = close == std::string_view::npos ? 0 : close + 2;
  const size_t hash = label.find(" #", op);
  const int64_t seq =
      hash == std::string_view::npos ? -1 : std::atoll(std::string(label.substr(hash + 2)).c_str());
  CollectiveFields f;
  f.name = label.substr(op, hash == std::string_view::npos ? std::string_view::npos : hash - op);
  append_args(f.args, {{"seq", seq}, {"bytes", bytes}});
  f.args += ",\"backend\":\"";
  append_escaped(f.args, backend);
  f.args += '"';
  return f;
}

void collective(std::string_view label, int64_t queued_us, int64_t started_us, int64_t bytes) {
  if (!enabled()) return;
  const CollectiveFields f = collective_fields(label, bytes);
  complete(f.name, "collective", started_us, now_us() - started_us,
           {{"queued_us", queued_us == 0 ? 0 : started_us - queued_us}}, f.args);
}

void add_stop_hook(void (*flush)()) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  if (std::find(r.stop_hooks.begin(), r.stop_hooks.end(), flush) == r.stop_hooks.end())
    r.stop_hooks.push_back(flush);
}

void set_thread_name(std::string_view name) {
  t_thread_name.assign(name);
  if (t_buffer == nullptr) return;  // named when it first records
  std::lock_guard<std::mutex> lock(t_buffer->mu);
  t_buffer->name.assign(name);
}

void instant(std::string_view name, const char* cat, Args args) {
  if (!enabled()) return;
  std::string a;
  append_args(a, args);
  push(Event{'i', std::string(name), cat, now_us(), 0, std::move(a)});
}

// The shortest text that reads back as the same double (to_string's %f wrote 1e-7 as 0.000000);
// JSON has no NaN or infinity, so those are null (a gap in the track) rather than a file no
// reader can parse.
void counter(std::string_view name, double value) {
  if (!enabled()) return;
  std::string a = "\"value\":";
  if (std::isfinite(value)) {
    char buf[32];
    a.append(buf, std::to_chars(buf, buf + sizeof buf, value).ptr);
  } else {
    a += "null";
  }
  push(Event{'C', std::string(name), "counter", now_us(), 0, std::move(a)});
}

void Span::begin(std::string_view name, const char* cat, Args args) {
  active_ = true;
  cat_ = cat;
  name_.assign(name);
  append_args(args_, args);
  start_us_ = now_us();
}

void Span::add_arg(const char* key, int64_t value) { append_args(args_, {{key, value}}); }

void Span::end() {
  active_ = false;
  const int64_t end_us = now_us();
  // Recorded even if tracing stopped meanwhile: stop() already wrote the file, and the next
  // start() drops what is left over.
  push(Event{'X', std::move(name_), cat_, start_us_, end_us - start_us_, std::move(args_)});
}

}  // namespace ember::trace
