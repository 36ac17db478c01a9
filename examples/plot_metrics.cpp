// plot_metrics: turns the metrics file that examples/fashion_mnist writes (--metrics FILE.jsonl)
// into a PNG with two panels: training loss against the global step, and test accuracy per
// epoch, drawn with Cairo (antialiased lines, the system's sans-serif font, Cairo's PNG writer).
//
//   build/examples/plot_metrics metrics.jsonl curves.png
//   build/examples/plot_metrics metrics.jsonl curves.png --width 1200 --height 500 --title "cnn"
//
// Input: one JSON object per line. Lines with "kind":"step" need "global_step" and "loss";
// lines with "kind":"epoch" need "epoch" and may carry "train_loss", "test_accuracy" and
// "global_step" (else the last step line before them gives it). Other kinds and keys are
// ignored. A resumed run appends to the same file and repeats some global steps (or epochs):
// the last line for a global step (or epoch) wins. An unterminated last line that does not
// parse is the line a running or killed job was writing: it is skipped with a warning; any other
// bad line is an error.
//
// Colours (tests look for them): step loss line (31,119,180), epoch train-loss dots
// (255,127,14), test accuracy line and dots (44,160,44), on white; data lines are 2 px wide so
// that their cores keep the exact colour under antialiasing.
//
// Exit status: 0 written; 1 bad or empty input, or the PNG could not be written; 2 bad usage.
#include <cairo.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <ember/nn/io/atomic_file.h>
#include <ember/tensor/error.h>
#include <ember/tensor/version.h>

namespace {

// ---- errors ------------------------------------------------------------------------------

// Bad input or an I/O failure: main prints "plot_metrics: <what>" and exits 1.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ---- drawing ----------------------------------------------------------------------------

struct Rgb {
  uint8_t r, g, b;
};

constexpr Rgb kWhite{255, 255, 255};
constexpr Rgb kText{30, 30, 30};
constexpr Rgb kMuted{110, 110, 110};
constexpr Rgb kGrid{228, 228, 228};
constexpr Rgb kFrame{70, 70, 70};
constexpr Rgb kLossColor{31, 119, 180};
constexpr Rgb kEpochLossColor{255, 127, 14};
constexpr Rgb kAccuracyColor{44, 160, 44};

constexpr double kSmallText = 11;  // tick labels, subtitles, axis names (px)
constexpr double kLargeText = 16;  // titles

struct Rect {
  double x0, y0, x1, y1;
};

// An RGB image surface and its Cairo context. Coordinates are pixels, y growing downwards;
// a 1-px line at integer coordinates is drawn on the pixel centres (x + 0.5) so it stays sharp.
class Painter {
 public:
  Painter(int w, int h)
      : surface_(cairo_image_surface_create(CAIRO_FORMAT_RGB24, w, h)),
        cr_(cairo_create(surface_)) {
    if (cairo_surface_status(surface_) != CAIRO_STATUS_SUCCESS || cairo_status(cr_) != CAIRO_STATUS_SUCCESS)
      throw InputError("cairo cannot make a " + std::to_string(w) + "x" + std::to_string(h) +
                       " image: " + cairo_status_to_string(cairo_status(cr_)));
    cairo_select_font_face(cr_, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
    fill({0, 0, double(w), double(h)}, kWhite);
  }
  ~Painter() {
    cairo_destroy(cr_);
    cairo_surface_destroy(surface_);
  }
  Painter(const Painter&) = delete;
  Painter& operator=(const Painter&) = delete;

  void color(Rgb c) { cairo_set_source_rgb(cr_, c.r / 255.0, c.g / 255.0, c.b / 255.0); }
  void fill(Rect r, Rgb c) {
    color(c);
    cairo_rectangle(cr_, r.x0, r.y0, r.x1 - r.x0, r.y1 - r.y0);
    cairo_fill(cr_);
  }
  // A sharp 1-px horizontal or vertical line between pixel centres.
  void hline(double x0, double x1, double y, Rgb c) { segment(x0, y + 0.5, x1 + 1, y + 0.5, c, 1); }
  void vline(double x, double y0, double y1, Rgb c) { segment(x + 0.5, y0, x + 0.5, y1 + 1, c, 1); }
  void frame(Rect r, Rgb c) {
    color(c);
    cairo_set_line_width(cr_, 1);
    cairo_rectangle(cr_, r.x0 + 0.5, r.y0 + 0.5, r.x1 - r.x0, r.y1 - r.y0);
    cairo_stroke(cr_);
  }
  void segment(double x0, double y0, double x1, double y1, Rgb c, double width) {
    color(c);
    cairo_set_line_width(cr_, width);
    cairo_move_to(cr_, x0, y0);
    cairo_line_to(cr_, x1, y1);
    cairo_stroke(cr_);
  }
  // A polyline through `pts`, joined smoothly.
  void polyline(const std::vector<std::pair<double, double>>& pts, Rgb c, double width) {
    if (pts.empty()) return;
    color(c);
    cairo_set_line_width(cr_, width);
    cairo_set_line_join(cr_, CAIRO_LINE_JOIN_ROUND);
    cairo_set_line_cap(cr_, CAIRO_LINE_CAP_ROUND);
    cairo_move_to(cr_, pts[0].first, pts[0].second);
    for (size_t i = 1; i < pts.size(); ++i) cairo_line_to(cr_, pts[i].first, pts[i].second);
    if (pts.size() == 1) cairo_line_to(cr_, pts[0].first, pts[0].second);  // a round dot
    cairo_stroke(cr_);
  }
  void dot(double cx, double cy, double radius, Rgb c) {
    color(c);
    cairo_arc(cr_, cx, cy, radius, 0, 2 * M_PI);
    cairo_fill(cr_);
  }
  double text_width(const std::string& s, double size) {
    cairo_set_font_size(cr_, size);
    cairo_text_extents_t e;
    cairo_text_extents(cr_, s.c_str(), &e);
    return e.x_advance;
  }
  // `s` with its top-left corner at (x, y): the baseline is one ascent below y.
  void text(double x, double y, const std::string& s, Rgb c, double size = kSmallText) {
    cairo_set_font_size(cr_, size);
    cairo_font_extents_t fe;
    cairo_font_extents(cr_, &fe);
    color(c);
    cairo_move_to(cr_, x, y + fe.ascent);
    cairo_show_text(cr_, s.c_str());
  }
  void clip(Rect r) {
    cairo_save(cr_);
    cairo_rectangle(cr_, r.x0, r.y0, r.x1 - r.x0 + 1, r.y1 - r.y0 + 1);
    cairo_clip(cr_);
  }
  void unclip() { cairo_restore(cr_); }

  // The image as PNG bytes (Cairo's writer, over libpng).
  std::string png() {
    cairo_surface_flush(surface_);
    std::string out;
    const cairo_status_t st = cairo_surface_write_to_png_stream(
        surface_,
        [](void* closure, const unsigned char* data, unsigned int n) {
          static_cast<std::string*>(closure)->append(reinterpret_cast<const char*>(data), n);
          return CAIRO_STATUS_SUCCESS;
        },
        &out);
    if (st != CAIRO_STATUS_SUCCESS)
      throw InputError(std::string("cairo cannot encode the PNG: ") + cairo_status_to_string(st));
    return out;
  }

 private:
  cairo_surface_t* surface_;
  cairo_t* cr_;
};

// ---- metrics file --------------------------------------------------------------------------

struct EpochPoint {
  double global_step = NAN;  // where the epoch ended; NaN when unknown
  double train_loss = NAN;
  double test_accuracy = NAN;
};

struct Metrics {
  std::map<int64_t, double> step_loss;   // global_step -> loss, last line wins
  std::map<int64_t, EpochPoint> epochs;  // epoch -> values, last line wins
  int skipped_non_finite = 0;
};

std::string shorten(const std::string& s) { return s.size() <= 200 ? s : s.substr(0, 200) + "..."; }

// A finite number from `j[key]`; nullopt when absent or null (nlohmann writes NaN/inf as null).
std::optional<double> number(const nlohmann::json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_number())
    throw InputError(where + ": \"" + key + "\" must be a number, got " + shorten(it->dump()));
  return it->get<double>();
}

int64_t integer(const nlohmann::json& j, const char* key, const std::string& where) {
  auto v = number(j, key, where);
  if (!v || !std::isfinite(*v) || *v != std::floor(*v) || std::fabs(*v) > 9e15)
    throw InputError(where + ": a \"" + std::string(j.value("kind", "")) +
                     "\" line needs an integer \"" + key + "\", got " +
                     (j.contains(key) ? shorten(j.at(key).dump()) : std::string("none")));
  return static_cast<int64_t>(*v);
}

Metrics read_metrics(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError("cannot open metrics file '" + path + "': " + std::strerror(errno));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw InputError("cannot read metrics file '" + path + "'");

  Metrics m;
  int64_t last_step = -1;
  bool seen_step = false;
  size_t pos = 0;
  for (int64_t line_no = 1; pos < text.size(); ++line_no) {
    const size_t nl = text.find('\n', pos);
    const bool terminated = nl != std::string::npos;
    std::string line = text.substr(pos, terminated ? nl - pos : std::string::npos);
    pos = terminated ? nl + 1 : text.size();
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;

    const std::string where = path + ":" + std::to_string(line_no);
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) {
      if (!terminated) {
        std::fprintf(stderr,
                     "plot_metrics: warning: %s: skipping the unfinished last line (no newline, "
                     "not valid JSON): %s\n",
                     where.c_str(), shorten(line).c_str());
        break;
      }
      throw InputError(where + ": not valid JSON: " + shorten(line));
    }
    if (!j.is_object()) throw InputError(where + ": expected a JSON object, got: " + shorten(line));
    auto kind = j.find("kind");
    if (kind == j.end() || !kind->is_string()) continue;
    if (*kind == "step") {
      const int64_t gs = integer(j, "global_step", where);
      auto loss = number(j, "loss", where);
      if (!j.contains("loss"))
        throw InputError(where +
                         ": a \"step\" line needs a number \"loss\", got: " + shorten(line));
      last_step = gs;
      seen_step = true;
      if (!loss || !std::isfinite(*loss)) {
        ++m.skipped_non_finite;
        m.step_loss.erase(gs);
        continue;
      }
      m.step_loss[gs] = *loss;
    } else if (*kind == "epoch") {
      const int64_t epoch = integer(j, "epoch", where);
      EpochPoint e;
      if (auto gs = number(j, "global_step", where))
        e.global_step = *gs;
      else if (seen_step)
        e.global_step = static_cast<double>(last_step);
      if (auto v = number(j, "train_loss", where)) e.train_loss = *v;
      if (auto v = number(j, "test_accuracy", where)) e.test_accuracy = *v;
      m.epochs[epoch] = e;
    }
  }
  if (m.step_loss.empty())
    throw InputError("no step lines (\"kind\":\"step\" with a finite \"loss\") in '" + path +
                     "': nothing to plot");
  return m;
}

// ---- axes ----------------------------------------------------------------------------------

// 1, 2 or 5 times a power of ten, giving about `target` intervals over `range`.
double nice_step(double range, int target) {
  const double raw = range / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double norm = raw / mag;
  return (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag;
}

std::string format_tick(double v, double step, bool percent) {
  if (percent) {
    v *= 100;
    step *= 100;
  }
  if (std::fabs(v) < step * 1e-6) v = 0;  // no "-0.0"
  const int decimals = step >= 1 ? 0 : static_cast<int>(std::ceil(-std::log10(step) - 1e-9));
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f%s", decimals, v, percent ? "%" : "");
  return buf;
}

struct Axis {
  double lo, hi;  // data range mapped onto the plot
  double tick;    // tick spacing
  bool percent = false;
};

// Maps data to pixels inside `plot` (whole pixels, so gridlines stay sharp), keeping kPad
// pixels clear so dots on the edge stay whole.
struct Transform {
  Rect plot;
  Axis x, y;
  static constexpr double kPad = 6;
  double px(double v) const {
    return std::round(plot.x0 + kPad + (v - x.lo) / (x.hi - x.lo) * (plot.x1 - plot.x0 - 2 * kPad));
  }
  double py(double v) const {
    return std::round(plot.y1 - kPad - (v - y.lo) / (y.hi - y.lo) * (plot.y1 - plot.y0 - 2 * kPad));
  }
};

std::vector<double> ticks(const Axis& a) {
  std::vector<double> t;
  const double eps = a.tick * 1e-9;
  for (double k = std::ceil((a.lo - eps) / a.tick); k * a.tick <= a.hi + eps; ++k)
    t.push_back(k * a.tick);
  return t;
}

// A y axis spanning [lo, hi] padded outwards to whole ticks; a flat series gets some room.
Axis value_axis(double lo, double hi) {
  if (hi - lo < 1e-12 * std::max(1.0, std::fabs(hi))) {
    const double d = std::max(0.5 * std::fabs(hi), 1e-3);
    lo -= d;
    hi += d;
  }
  Axis a{lo, hi, nice_step(hi - lo, 5)};
  a.lo = std::floor(lo / a.tick + 1e-9) * a.tick;
  a.hi = std::ceil(hi / a.tick - 1e-9) * a.tick;
  return a;
}

// An x axis over integer data (global steps, epochs): exactly the data range, ticks on whole
// numbers; a single point gets one unit either side.
Axis integer_axis(double lo, double hi) {
  if (hi <= lo) {
    lo -= 1;
    hi += 1;
  }
  return Axis{lo, hi, std::max(1.0, nice_step(hi - lo, 6))};
}

// Gridlines, frame, ticks and tick labels of one panel.
void draw_axes(Painter& pt, const Transform& t, const std::string& x_label) {
  const Rect& p = t.plot;
  for (double v : ticks(t.y)) pt.hline(p.x0 + 1, p.x1 - 1, t.py(v), kGrid);
  for (double v : ticks(t.x)) pt.vline(t.px(v), p.y0 + 1, p.y1 - 1, kGrid);
  pt.frame(p, kFrame);
  for (double v : ticks(t.y)) {
    const double y = t.py(v);
    pt.hline(p.x0 - 4, p.x0 - 1, y, kFrame);
    const std::string s = format_tick(v, t.y.tick, t.y.percent);
    pt.text(p.x0 - 7 - pt.text_width(s, kSmallText), y - kSmallText / 2 - 1, s, kText);
  }
  double last_label_end = -1e9;
  for (double v : ticks(t.x)) {
    const double x = t.px(v);
    pt.vline(x, p.y1 + 1, p.y1 + 4, kFrame);
    const std::string s = format_tick(v, t.x.tick, false);
    const double w = pt.text_width(s, kSmallText);
    if (x - w / 2 < last_label_end + 6) continue;  // labels never overlap
    pt.text(x - w / 2, p.y1 + 7, s, kText);
    last_label_end = x + w / 2;
  }
  pt.text((p.x0 + p.x1 - pt.text_width(x_label, kSmallText)) / 2, p.y1 + 22, x_label, kMuted);
}

// The plot rectangle of a panel: room above for the titles, left for the y labels, below for
// the x labels and axis name.
Rect plot_rect(Painter& pt, Rect panel, const Axis& y) {
  double label_w = 0;
  for (double v : ticks(y))
    label_w = std::max(label_w, pt.text_width(format_tick(v, y.tick, y.percent), kSmallText));
  return Rect{std::round(panel.x0 + 12 + label_w + 8), panel.y0 + 50, panel.x1 - 18,
              panel.y1 - 40};
}

void draw_titles(Painter& pt, Rect panel, double plot_x0, const std::string& title,
                 const std::string& subtitle) {
  pt.clip(panel);
  pt.text(plot_x0, panel.y0 + 8, title, kText, kLargeText);
  pt.text(plot_x0, panel.y0 + 31, subtitle, kMuted);
  pt.unclip();
}

// A legend entry per series, right-aligned above the plot: a short sample of its mark, then
// its name.
struct LegendEntry {
  std::string name;
  Rgb color;
  bool line, dot;
};

void draw_legend(Painter& pt, const Rect& plot, const std::vector<LegendEntry>& entries) {
  double x = plot.x1;
  const double y = plot.y0 - 14;
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
    x -= pt.text_width(it->name, kSmallText);
    pt.text(x, y - kSmallText / 2 - 1, it->name, kMuted);
    x -= 22;
    if (it->line) pt.segment(x, y, x + 16, y, it->color, 2);
    if (it->dot) pt.dot(x + 8, y, 3, it->color);
    x -= 14;
  }
}

std::string fixed(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

void draw_loss_panel(Painter& pt, Rect panel, const Metrics& m) {
  double lo = INFINITY, hi = -INFINITY;
  for (auto [gs, loss] : m.step_loss) {
    lo = std::min(lo, loss);
    hi = std::max(hi, loss);
  }
  double x_lo = static_cast<double>(m.step_loss.begin()->first);
  double x_hi = static_cast<double>(m.step_loss.rbegin()->first);
  std::vector<std::pair<double, double>> dots;
  for (const auto& [epoch, e] : m.epochs) {
    if (!std::isfinite(e.global_step) || !std::isfinite(e.train_loss)) continue;
    dots.emplace_back(e.global_step, e.train_loss);
    lo = std::min(lo, e.train_loss);
    hi = std::max(hi, e.train_loss);
    x_lo = std::min(x_lo, e.global_step);
    x_hi = std::max(x_hi, e.global_step);
  }
  const Axis y = value_axis(lo, hi);
  const Transform t{plot_rect(pt, panel, y), integer_axis(x_lo, x_hi), y};
  draw_titles(pt, panel, t.plot.x0, "train loss",
              "last " + fixed(m.step_loss.rbegin()->second, 4));
  draw_axes(pt, t, "global step");
  std::vector<LegendEntry> legend{{"logged steps", kLossColor, true, false}};
  if (!dots.empty()) legend.push_back({"epoch mean", kEpochLossColor, false, true});
  draw_legend(pt, t.plot, legend);

  pt.clip(t.plot);
  std::vector<std::pair<double, double>> line;
  for (auto [gs, loss] : m.step_loss) line.emplace_back(t.px(static_cast<double>(gs)), t.py(loss));
  pt.polyline(line, kLossColor, 2);
  for (auto [gs, loss] : dots) pt.dot(t.px(gs), t.py(loss), 4, kEpochLossColor);
  pt.unclip();
}

void draw_accuracy_panel(Painter& pt, Rect panel, const Metrics& m) {
  std::vector<std::pair<double, double>> pts;
  for (const auto& [epoch, e] : m.epochs)
    if (std::isfinite(e.test_accuracy))
      pts.emplace_back(static_cast<double>(epoch), e.test_accuracy);

  if (pts.empty()) {
    Axis y{0, 1, 0.2, true};
    const Transform t{plot_rect(pt, panel, y), integer_axis(1, 1), y};
    draw_titles(pt, panel, t.plot.x0, "test accuracy", "no epoch lines with test_accuracy yet");
    draw_axes(pt, t, "epoch");
    return;
  }
  double lo = INFINITY, hi = -INFINITY;
  size_t best = 0;
  for (size_t i = 0; i < pts.size(); ++i) {
    lo = std::min(lo, pts[i].second);
    hi = std::max(hi, pts[i].second);
    if (pts[i].second > pts[best].second) best = i;
  }
  // Accuracy is a fraction: show from a round 0.05 below the worst epoch up to 1.0.
  Axis y;
  if (lo >= 0 && hi <= 1) {
    y.lo = std::max(0.0, std::floor((lo - 0.05) / 0.05 + 1e-9) * 0.05);
    y.hi = 1.0;
    y.tick = nice_step(y.hi - y.lo, 5);
    y.percent = true;
  } else {
    y = value_axis(lo, hi);
  }
  const Transform t{plot_rect(pt, panel, y), integer_axis(pts.front().first, pts.back().first), y};
  const int d = y.percent ? 2 : 4;
  const double k = y.percent ? 100 : 1;
  const std::string pct = y.percent ? "%" : "";
  draw_titles(pt, panel, t.plot.x0, "test accuracy",
              "last " + fixed(k * pts.back().second, d) + pct + ", best " +
                  fixed(k * pts[best].second, d) + pct + " (epoch " +
                  std::to_string(static_cast<int64_t>(pts[best].first)) + ")");
  draw_axes(pt, t, "epoch");
  draw_legend(pt, t.plot, {{"per epoch", kAccuracyColor, true, true}});

  pt.clip(t.plot);
  std::vector<std::pair<double, double>> line;
  for (auto [epoch, acc] : pts) line.emplace_back(t.px(epoch), t.py(acc));
  pt.polyline(line, kAccuracyColor, 2);
  for (auto [x, yv] : line) pt.dot(x, yv, 4, kAccuracyColor);
  pt.unclip();
}

// The PNG of both panels side by side, under an optional title.
std::string render_png(const Metrics& m, int w, int h, const std::string& title) {
  Painter pt(w, h);
  double top = 0;
  if (!title.empty()) {
    pt.text(std::max(4.0, (w - pt.text_width(title, kLargeText)) / 2), 8, title, kText, kLargeText);
    top = 34;
  }
  const double mid = std::floor(w / 2.0);
  draw_loss_panel(pt, Rect{0, top, mid - 1, double(h - 1)}, m);
  draw_accuracy_panel(pt, Rect{mid, top, double(w - 1), double(h - 1)}, m);
  return pt.png();
}

// ---- command line --------------------------------------------------------------------------

constexpr const char* kUsage =
    "usage: plot_metrics METRICS.jsonl OUT.png [--width N] [--height N] [--title TEXT]\n"
    "  Draws training loss (per logged step, and per epoch) and test accuracy (per epoch)\n"
    "  from the --metrics file of examples/fashion_mnist into an RGB PNG.\n"
    "  --width N    image width in pixels, 320..8192 (default 1000)\n"
    "  --height N   image height in pixels, 200..8192 (default 420)\n"
    "  --title TEXT a title above both panels (default: none)\n";

struct Args {
  std::string metrics, out, title;
  int width = 1000, height = 420;
};

// Throws CLI::ParseError (CLI::CallForHelp for -h/--help) on a bad command line.
Args parse_args(int argc, char** argv) {
  Args a;
  CLI::App app{"plot_metrics"};
  app.add_option("METRICS.jsonl", a.metrics, "the --metrics file of fashion_mnist")->required();
  app.add_option("OUT.png", a.out, "the PNG to write")->required();
  app.add_option("--width", a.width, "image width in pixels")->check(CLI::Range(320, 8192));
  app.add_option("--height", a.height, "image height in pixels")->check(CLI::Range(200, 8192));
  app.add_option("--title", a.title, "a title above both panels");
  app.set_version_flag("--version", std::string("plot_metrics (Ember) ") + ember::version());
  app.parse(argc, argv);
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  try {
    a = parse_args(argc, argv);
  } catch (const CLI::CallForVersion& v) {
    std::printf("%s\n", v.what());
    return 0;
  } catch (const CLI::CallForHelp&) {
    std::fputs(kUsage, stdout);
    return 0;
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "plot_metrics: %s\n%s", e.what(), kUsage);
    return 2;
  }
  try {
    const Metrics m = read_metrics(a.metrics);
    if (m.skipped_non_finite > 0)
      std::fprintf(stderr,
                   "plot_metrics: warning: skipped %d step line(s) with a non-finite loss\n",
                   m.skipped_non_finite);
    // Readers (an image viewer refreshing while training runs) see the old PNG or the new one.
    ember::nn::write_file_atomic(a.out, render_png(m, a.width, a.height, a.title));
    std::printf("plot_metrics: wrote %s (%dx%d; %zu steps, %zu epochs)\n", a.out.c_str(), a.width,
                a.height, m.step_loss.size(), m.epochs.size());
  } catch (const InputError& e) {
    std::fprintf(stderr, "plot_metrics: %s\n", e.what());
    return 1;
  } catch (const ember::Error& e) {  // the PNG could not be written
    std::fprintf(stderr, "plot_metrics: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "plot_metrics: unexpected error: %s\n", e.what());
    return 1;
  }
  return 0;
}
