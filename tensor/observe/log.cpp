#include <ember/tensor/observe/log.h>

#include <spdlog/logger.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <mutex>

namespace ember::logging {

namespace {

struct State {
  std::atomic<int> level{static_cast<int>(Level::Info)};
  std::once_flag env_once;
  std::mutex mu;  // guards the pattern change in set_rank
  spdlog::logger logger{"ember", std::make_shared<spdlog::sinks::stderr_color_sink_mt>()};
  State() {
    logger.set_level(spdlog::level::trace);  // Ember filters; spdlog passes what it is given
    logger.flush_on(spdlog::level::trace);   // a line is out before an abort or a crash
    set_pattern(-1);
  }
  void set_pattern(int rank) {
    logger.set_pattern(rank < 0 ? "[%H:%M:%S.%e] [%^%l%$] %v"
                                : "[%H:%M:%S.%e] [%^%l%$] [rank " + std::to_string(rank) + "] %v");
  }
};

// Leaked on purpose: the MPI atexit handler and threads still running at exit log after static
// destructors would have run.
State& state() {
  static State* s = new State();
  return *s;
}

// A value it cannot read is said once and the level stays info: throwing would make every log
// call throw, from destructors and noexcept failure paths too.
void read_env_once() {
  State& s = state();
  std::string bad;
  std::call_once(s.env_once, [&] {
    const char* v = std::getenv("EMBER_LOG_LEVEL");
    if (v == nullptr || *v == '\0') return;
    try {
      s.level.store(static_cast<int>(parse_level(v)));
    } catch (const ValueError& e) {
      bad = e.what();
    }
  });
  if (!bad.empty()) s.logger.log(spdlog::level::warn, bad + "; logging at info");
}

}  // namespace

Level parse_level(std::string_view name) {
  std::string n(name);
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return std::tolower(c); });
  if (n == "trace") return Level::Trace;
  if (n == "debug") return Level::Debug;
  if (n == "info") return Level::Info;
  if (n == "warn" || n == "warning") return Level::Warn;
  if (n == "error") return Level::Error;
  if (n == "off") return Level::Off;
  throw ValueError(detail::str_cat("[EMBER_LOG_LEVEL] expected trace, debug, info, warn, error or ",
                                   "off, got '", name, "'"));
}

Level level() {
  read_env_once();
  return static_cast<Level>(state().level.load(std::memory_order_relaxed));
}

void set_level(Level l) {
  read_env_once();  // so that a later first use does not overwrite the choice
  state().level.store(static_cast<int>(l));
}

void set_rank(int rank) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.set_pattern(rank);
}

void write(Level l, std::string_view message) {
  if (!enabled(l)) return;
  static constexpr spdlog::level::level_enum kMap[] = {
      spdlog::level::trace, spdlog::level::debug, spdlog::level::info,
      spdlog::level::warn,  spdlog::level::err,   spdlog::level::off};
  state().logger.log(kMap[static_cast<int>(l)], message);
}

}  // namespace ember::logging
