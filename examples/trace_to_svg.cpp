// trace_to_svg: draws a timeline that EMBER_TRACE wrote (a rank's trace_rank<R>.json or
// emberrun's merged trace.json, Chrome trace-event JSON) as an SVG picture with Cairo: one lane
// per rank and row (a thread, a DDP bucket, a CUDA stream), its spans as boxes coloured by
// category (nested spans one level lower), a time axis in milliseconds with ticks and labels,
// and a legend. An output name ending in .png gives a PNG instead (for a quick look).
//
//   build/examples/trace_to_svg traces/run1/trace.json timeline.svg
//   build/examples/trace_to_svg trace.json steps.svg --from 3 --to 4 --width 1600
//
// --from/--to draw only the steps from..to: from the first rank's start of the examples'
// "train step" span of step `from` to the last rank's end of step `to`. Spans named "wait for
// communication" get a colour of their own ("wait"), so that exposed communication stands out
// from the other DDP spans. On stdout, one line per lane: "lane <label>: <n> spans".
//
// Exit status: 0 written; 1 bad input (not a trace, no spans, a step not found) or the SVG
// could not be written; 2 bad usage.
#include <cairo-svg.h>
#include <cairo.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <ember/version.h>

namespace {

using nlohmann::json;

struct BadInput : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ---- the trace ------------------------------------------------------------------------------

struct Span {
  std::string name;
  std::string key;  // the colour: its category, or "wait"
  int64_t ts = 0;
  int64_t dur = 0;
  int64_t step = -1;  // args.step of a "train step" span
  int depth = 0;      // nesting level within its lane
};

struct Lane {
  int pid = 0;
  int tid = 0;
  std::string label;
  std::vector<Span> spans;
  int depths = 1;
};

std::string colour_key(const json& e) {
  const std::string name = e.value("name", "");
  if (name == "wait for communication") return "wait";
  return e.value("cat", "other");
}

/// Lanes by (pid, tid), named from the trace's process_name and thread_name records.
std::vector<Lane> read_lanes(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw BadInput("cannot open " + path);
  json doc;
  try {
    doc = json::parse(in);
  } catch (const json::exception& e) {
    throw BadInput(path + " is not JSON: " + e.what());
  }
  if (!doc.is_object() || !doc.contains("traceEvents") || !doc["traceEvents"].is_array())
    throw BadInput(path + " has no traceEvents array: not a Chrome trace-event file");
  std::map<std::pair<int, int>, Lane> lanes;
  std::map<int, std::string> process_names;
  std::map<std::pair<int, int>, std::string> thread_names;
  for (const json& e : doc["traceEvents"]) {
    const std::string ph = e.value("ph", "");
    const int pid = e.value("pid", 0);
    const int tid = e.value("tid", 0);
    if (ph == "M" && e.value("name", "") == "process_name") {
      process_names[pid] = e["args"].value("name", "");
    } else if (ph == "M" && e.value("name", "") == "thread_name") {
      thread_names[{pid, tid}] = e["args"].value("name", "");
    } else if (ph == "X") {
      Span s{e.value("name", ""), colour_key(e), e.value("ts", int64_t{0}),
             e.value("dur", int64_t{0})};
      if (s.name == "train step" && e.contains("args") && e["args"].contains("step") &&
          e["args"]["step"].is_number())
        s.step = e["args"]["step"];
      Lane& lane = lanes[{pid, tid}];
      lane.pid = pid;
      lane.tid = tid;
      lane.spans.push_back(std::move(s));
    }
  }
  std::vector<Lane> out;
  for (auto& [key, lane] : lanes) {
    const auto pn = process_names.find(lane.pid);
    const auto tn = thread_names.find(key);
    lane.label = (pn != process_names.end() ? pn->second : "pid " + std::to_string(lane.pid)) +
                 " · " +
                 (tn != thread_names.end() ? tn->second : "thread " + std::to_string(lane.tid));
    out.push_back(std::move(lane));
  }
  // The main thread first in each rank; rows of the same name (a pool's threads) numbered.
  std::stable_sort(out.begin(), out.end(), [](const Lane& a, const Lane& b) {
    const bool a_main = a.label.ends_with(" · main thread");
    const bool b_main = b.label.ends_with(" · main thread");
    return a.pid != b.pid ? a.pid < b.pid : a_main > b_main;
  });
  std::map<std::string, int> seen, count;
  for (const Lane& lane : out) ++count[lane.label];
  for (Lane& lane : out)
    if (count[lane.label] > 1) lane.label += " " + std::to_string(++seen[lane.label]);
  return out;
}

/// The [start, end) of steps from..to of the "train step" spans, over every lane.
std::pair<int64_t, int64_t> step_window(const std::vector<Lane>& lanes, int64_t from, int64_t to) {
  std::optional<int64_t> t0, t1;
  for (const Lane& lane : lanes) {
    for (const Span& s : lane.spans) {
      if (s.step == from) t0 = std::min(t0.value_or(s.ts), s.ts);
      if (s.step == to) t1 = std::max(t1.value_or(s.ts + s.dur), s.ts + s.dur);
    }
  }
  if (!t0 || !t1)
    throw BadInput("no \"train step\" span of step " + std::to_string(t0 ? to : from) +
                   " in the trace (see docs/observability.md)");
  if (*t1 <= *t0) throw BadInput("--to must not be before --from");
  return {*t0, *t1};
}

/// Keeps the spans that overlap [t0, t1) and gives each its nesting depth: a span that starts
/// inside a longer one on its lane sits one level below it.
void clip_and_nest(std::vector<Lane>& lanes, int64_t t0, int64_t t1) {
  for (Lane& lane : lanes) {
    std::erase_if(lane.spans, [&](const Span& s) { return s.ts >= t1 || s.ts + s.dur <= t0; });
    std::sort(lane.spans.begin(), lane.spans.end(), [](const Span& a, const Span& b) {
      return a.ts != b.ts ? a.ts < b.ts : a.dur > b.dur;
    });
    std::vector<int64_t> open_ends;  // ends of the spans enclosing the current one
    for (Span& s : lane.spans) {
      while (!open_ends.empty() && open_ends.back() <= s.ts) open_ends.pop_back();
      s.depth = static_cast<int>(open_ends.size());
      lane.depths = std::max(lane.depths, s.depth + 1);
      open_ends.push_back(s.ts + s.dur);
    }
  }
  std::erase_if(lanes, [](const Lane& l) { return l.spans.empty(); });
}

// ---- drawing --------------------------------------------------------------------------------

struct Colour {
  double r, g, b;
};

/// Fixed colours for the categories Ember records; others get a grey.
Colour colour_of(const std::string& key) {
  static const std::map<std::string, Colour> kColours = {
      {"step", {0.85, 0.85, 0.85}},       {"model", {0.27, 0.51, 0.71}},
      {"autograd", {0.99, 0.55, 0.24}},   {"ddp", {0.30, 0.69, 0.29}},
      {"wait", {0.89, 0.10, 0.11}},       {"collective", {0.60, 0.31, 0.64}},
      {"data", {0.65, 0.34, 0.16}},       {"optim", {0.10, 0.62, 0.62}},
      {"checkpoint", {0.97, 0.51, 0.75}}, {"cuda", {0.74, 0.74, 0.13}}};
  const auto it = kColours.find(key);
  return it != kColours.end() ? it->second : Colour{0.6, 0.6, 0.6};
}

constexpr double kMargin = 12;
constexpr double kLabelWidth = 230;  // the lane labels' column
constexpr double kRowHeight = 15;    // one nesting level
constexpr double kLaneGap = 5;
constexpr double kAxisHeight = 34;
constexpr double kLegendHeight = 30;
constexpr double kFont = 11;

/// A "nice" tick spacing (1, 2 or 5 times a power of ten) giving about `target` ticks.
double tick_step(double span, int target) {
  const double raw = span / target;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0})
    if (m * p >= raw) return m * p;
  return 10 * p;
}

std::string format_ms(double ms, double step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, step < 1 ? "%.1f" : "%.0f", ms);
  return buf;
}

class Picture {
 public:
  Picture(const std::string& path, double width, double height)
      : png_(path.ends_with(".png")),
        surface_(png_ ? cairo_image_surface_create(CAIRO_FORMAT_RGB24, static_cast<int>(width),
                                                   static_cast<int>(std::ceil(height)))
                      : cairo_svg_surface_create(path.c_str(), width, height)),
        cr_(cairo_create(surface_)) {
    if (cairo_surface_status(surface_) != CAIRO_STATUS_SUCCESS)
      throw BadInput("cannot write " + path + ": " +
                     cairo_status_to_string(cairo_surface_status(surface_)));
    cairo_select_font_face(cr_, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
    cairo_set_font_size(cr_, kFont);
    fill({0, 0, width, height}, {1, 1, 1});
  }
  ~Picture() {
    cairo_destroy(cr_);
    cairo_surface_destroy(surface_);
  }
  Picture(const Picture&) = delete;
  Picture& operator=(const Picture&) = delete;

  void fill(std::array<double, 4> r, Colour c) {
    cairo_set_source_rgb(cr_, c.r, c.g, c.b);
    cairo_rectangle(cr_, r[0], r[1], r[2], r[3]);
    cairo_fill(cr_);
  }
  void line(double x0, double y0, double x1, double y1, Colour c) {
    cairo_set_source_rgb(cr_, c.r, c.g, c.b);
    cairo_set_line_width(cr_, 1);
    cairo_move_to(cr_, x0, y0);
    cairo_line_to(cr_, x1, y1);
    cairo_stroke(cr_);
  }
  double text_width(const std::string& s) {
    cairo_text_extents_t e;
    cairo_text_extents(cr_, s.c_str(), &e);
    return e.x_advance;
  }
  /// Text with its baseline at y.
  void text(const std::string& s, double x, double y, Colour c) {
    cairo_set_source_rgb(cr_, c.r, c.g, c.b);
    cairo_move_to(cr_, x, y);
    cairo_show_text(cr_, s.c_str());
  }
  /// The same, cut at `max_width`; left out when not even a few letters fit.
  void text_within(const std::string& s, double x, double y, Colour c, double max_width) {
    if (text_width(s) <= max_width) return text(s, x, y, c);
    if (max_width < 3 * kFont) return;
    cairo_save(cr_);
    cairo_rectangle(cr_, x, y - kFont, max_width, 2 * kFont);
    cairo_clip(cr_);
    text(s, x, y, c);
    cairo_restore(cr_);
  }
  /// Flushes the SVG; throws if Cairo failed.
  void finish(const std::string& path) {
    cairo_surface_flush(surface_);
    const cairo_status_t written = png_ ? cairo_surface_write_to_png(surface_, path.c_str())
                                        : CAIRO_STATUS_SUCCESS;
    cairo_surface_finish(surface_);
    if (written != CAIRO_STATUS_SUCCESS)
      throw BadInput("cannot write " + path + ": " + cairo_status_to_string(written));
    if (cairo_surface_status(surface_) != CAIRO_STATUS_SUCCESS)
      throw BadInput("cannot write " + path + ": " +
                     cairo_status_to_string(cairo_surface_status(surface_)));
  }

 private:
  bool png_;
  cairo_surface_t* surface_;
  cairo_t* cr_;
};

struct Layout {
  double width, height, plot_x0, plot_x1, top;
  int64_t t0, t1;
  double x(int64_t t) const {
    return plot_x0 + (plot_x1 - plot_x0) * static_cast<double>(t - t0) / static_cast<double>(t1 - t0);
  }
};

void draw_axis(Picture& p, const Layout& l, double bottom) {
  const Colour ink{0.2, 0.2, 0.2}, grid{0.9, 0.9, 0.9};
  const double span_ms = (l.t1 - l.t0) / 1000.0;
  const double step = tick_step(span_ms, 10);
  for (double ms = 0; ms <= span_ms + 1e-9; ms += step) {
    const double x = l.x(l.t0 + static_cast<int64_t>(std::llround(ms * 1000)));
    p.line(x, l.top, x, bottom, grid);
    p.line(x, bottom, x, bottom + 4, ink);
    const std::string label = format_ms(ms, step);
    p.text(label, x - p.text_width(label) / 2, bottom + 15, ink);
  }
  p.line(l.plot_x0, bottom, l.plot_x1, bottom, ink);
  const std::string unit = "time (ms)";
  p.text(unit, (l.plot_x0 + l.plot_x1 - p.text_width(unit)) / 2, bottom + 29, ink);
}

void draw_legend(Picture& p, const std::vector<std::string>& keys, double x, double y) {
  for (const std::string& key : keys) {
    p.fill({x, y - 9, 12, 10}, colour_of(key));
    p.text(key, x + 16, y, {0.2, 0.2, 0.2});
    x += 16 + p.text_width(key) + 18;
  }
}

void draw_lane(Picture& p, const Layout& l, const Lane& lane, double y) {
  const double h = lane.depths * kRowHeight;
  p.fill({l.plot_x0, y, l.plot_x1 - l.plot_x0, h}, {0.97, 0.97, 0.97});
  p.text_within(lane.label, kMargin, y + kRowHeight - 4, {0.1, 0.1, 0.1}, kLabelWidth - 2 * kMargin);
  for (const Span& s : lane.spans) {
    const double x0 = l.x(std::max(s.ts, l.t0));
    const double x1 = std::max(x0 + 1, l.x(std::min(s.ts + s.dur, l.t1)));
    const double top = y + s.depth * kRowHeight + 1;
    p.fill({x0, top, x1 - x0, kRowHeight - 2}, colour_of(s.key));
    p.text_within(s.name, x0 + 2, top + kRowHeight - 5, {0, 0, 0}, x1 - x0 - 4);
  }
}

/// Draws `lanes` (already clipped to [t0, t1)) into `path`.
void draw(const std::vector<Lane>& lanes, int64_t t0, int64_t t1, const std::string& path,
          double width, const std::string& title) {
  double lanes_height = 0;
  std::vector<std::string> keys;
  for (const Lane& lane : lanes) {
    lanes_height += lane.depths * kRowHeight + kLaneGap;
    for (const Span& s : lane.spans)
      if (std::find(keys.begin(), keys.end(), s.key) == keys.end()) keys.push_back(s.key);
  }
  std::sort(keys.begin(), keys.end());
  const double top = kMargin + (title.empty() ? 0 : 22);
  const double height = top + lanes_height + kAxisHeight + kLegendHeight + kMargin;
  Layout l{width, height, kLabelWidth, width - kMargin - 10, top, t0, t1};
  Picture p(path, width, height);
  if (!title.empty()) p.text(title, kMargin, kMargin + 12, {0, 0, 0});
  double y = top;
  for (const Lane& lane : lanes) y += lane.depths * kRowHeight + kLaneGap;
  draw_axis(p, l, y);
  y = top;
  for (const Lane& lane : lanes) {
    draw_lane(p, l, lane, y);
    y += lane.depths * kRowHeight + kLaneGap;
  }
  draw_legend(p, keys, kLabelWidth, y + kAxisHeight + 18);
  p.finish(path);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Draws an EMBER_TRACE timeline (trace.json) as an SVG picture (docs/observability.md)."};
  std::string input, output, title;
  std::optional<int64_t> from, to;
  double width = 1400;
  app.add_option("trace", input, "trace.json or trace_rank<R>.json")->required();
  app.add_option("svg", output, "the SVG file to write")->required();
  app.add_option("--from", from, "first step drawn (the \"train step\" spans' step)");
  app.add_option("--to", to, "last step drawn");
  app.add_option("--width", width, "picture width in px")->check(CLI::Range(400.0, 20000.0));
  app.add_option("--title", title, "a title above the lanes");
  app.set_version_flag("--version", "trace_to_svg (Ember) " EMBER_VERSION);
  CLI11_PARSE(app, argc, argv);
  try {
    std::vector<Lane> lanes = read_lanes(input);
    int64_t t0 = INT64_MAX, t1 = INT64_MIN;
    for (const Lane& lane : lanes) {
      for (const Span& s : lane.spans) {
        t0 = std::min(t0, s.ts);
        t1 = std::max(t1, s.ts + s.dur);
      }
    }
    if (t0 > t1) throw BadInput(input + " holds no spans");
    if (from || to) std::tie(t0, t1) = step_window(lanes, from.value_or(*to), to.value_or(*from));
    if (t1 == t0) ++t1;
    clip_and_nest(lanes, t0, t1);
    draw(lanes, t0, t1, output, width, title);
    for (const Lane& lane : lanes)
      std::printf("lane %s: %zu spans\n", lane.label.c_str(), lane.spans.size());
  } catch (const BadInput& e) {
    std::fprintf(stderr, "trace_to_svg: %s\n", e.what());
    return 1;
  }
  return 0;
}
