// plot_metrics: turns the metrics file that examples/fashion_mnist writes (--metrics FILE.jsonl)
// into a PNG with two panels: training loss against the global step, and test accuracy per
// epoch. No plotting library: a small rasteriser, a built-in 5x7 bitmap font and a PNG encoder
// over zlib are all in this file.
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
// (255,127,14), test accuracy line and dots (44,160,44), on white.
//
// Exit status: 0 written; 1 bad or empty input, or the PNG could not be written; 2 bad usage.
#include <zlib.h>

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

#include "nn/atomic_file.h"
#include "tensor/error.h"

namespace {

// ---- errors ------------------------------------------------------------------------------

// Bad input or an I/O failure: main prints "plot_metrics: <what>" and exits 1.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ---- canvas and rasteriser ---------------------------------------------------------------

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

struct Rect {
  int x0, y0, x1, y1;  // inclusive
  bool contains(int x, int y) const { return x >= x0 && x <= x1 && y >= y0 && y <= y1; }
};

// An 8-bit RGB image, row-major, top row first. Every drawing call clips to the image and to
// an optional clip rectangle, so callers never index out of range.
class Canvas {
 public:
  Canvas(int w, int h) : w_(w), h_(h), px_(static_cast<size_t>(w) * h * 3, 255) {}
  int width() const { return w_; }
  int height() const { return h_; }
  const std::vector<uint8_t>& pixels() const { return px_; }
  void set_clip(Rect r) { clip_ = r; }
  void clear_clip() { clip_ = Rect{0, 0, w_ - 1, h_ - 1}; }

  void set(int x, int y, Rgb c) {
    if (x < 0 || y < 0 || x >= w_ || y >= h_ || !clip_.contains(x, y)) return;
    uint8_t* p = &px_[(static_cast<size_t>(y) * w_ + x) * 3];
    p[0] = c.r;
    p[1] = c.g;
    p[2] = c.b;
  }
  void fill(Rect r, Rgb c) {
    for (int y = r.y0; y <= r.y1; ++y)
      for (int x = r.x0; x <= r.x1; ++x) set(x, y, c);
  }
  void hline(int x0, int x1, int y, Rgb c) { fill({std::min(x0, x1), y, std::max(x0, x1), y}, c); }
  void vline(int x, int y0, int y1, Rgb c) { fill({x, std::min(y0, y1), x, std::max(y0, y1)}, c); }
  void frame(Rect r, Rgb c) {
    hline(r.x0, r.x1, r.y0, c);
    hline(r.x0, r.x1, r.y1, c);
    vline(r.x0, r.y0, r.y1, c);
    vline(r.x1, r.y0, r.y1, c);
  }
  // Bresenham; `thickness` 2 stamps a 2x2 brush at every step.
  void line(int x0, int y0, int x1, int y1, Rgb c, int thickness) {
    const int dx = std::abs(x1 - x0), sx = x0 < x1 ? 1 : -1;
    const int dy = -std::abs(y1 - y0), sy = y0 < y1 ? 1 : -1;
    int err = dx + dy;
    for (;;) {
      for (int by = 0; by < thickness; ++by)
        for (int bx = 0; bx < thickness; ++bx) set(x0 + bx, y0 + by, c);
      if (x0 == x1 && y0 == y1) break;
      const int e2 = 2 * err;
      if (e2 >= dy) {
        err += dy;
        x0 += sx;
      }
      if (e2 <= dx) {
        err += dx;
        y0 += sy;
      }
    }
  }
  void dot(int cx, int cy, int radius, Rgb c) {
    for (int y = -radius; y <= radius; ++y)
      for (int x = -radius; x <= radius; ++x)
        if (x * x + y * y <= radius * radius + radius) set(cx + x, cy + y, c);
  }

 private:
  int w_, h_;
  std::vector<uint8_t> px_;
  Rect clip_{0, 0, w_ - 1, h_ - 1};
};

// ---- bitmap font ---------------------------------------------------------------------------

// 5x7 glyphs in the style of the HD44780 character ROM, plus an eighth row for descenders
// (g j p q y ,). Rows are drawn top to bottom; '#' is ink. Missing rows are blank.
struct Glyph {
  char c;
  std::array<const char*, 8> rows;
};

// clang-format off
const Glyph kGlyphs[] = {
  {' ', {}},
  {'0', {" ### ", "#   #", "#  ##", "# # #", "##  #", "#   #", " ### "}},
  {'1', {"  #  ", " ##  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "}},
  {'2', {" ### ", "#   #", "    #", "   # ", "  #  ", " #   ", "#####"}},
  {'3', {"#####", "   # ", "  #  ", "   # ", "    #", "#   #", " ### "}},
  {'4', {"   # ", "  ## ", " # # ", "#  # ", "#####", "   # ", "   # "}},
  {'5', {"#####", "#    ", "#### ", "    #", "    #", "#   #", " ### "}},
  {'6', {"  ## ", " #   ", "#    ", "#### ", "#   #", "#   #", " ### "}},
  {'7', {"#####", "    #", "   # ", "  #  ", " #   ", " #   ", " #   "}},
  {'8', {" ### ", "#   #", "#   #", " ### ", "#   #", "#   #", " ### "}},
  {'9', {" ### ", "#   #", "#   #", " ####", "    #", "   # ", " ##  "}},
  {'A', {" ### ", "#   #", "#   #", "#####", "#   #", "#   #", "#   #"}},
  {'B', {"#### ", "#   #", "#   #", "#### ", "#   #", "#   #", "#### "}},
  {'C', {" ### ", "#   #", "#    ", "#    ", "#    ", "#   #", " ### "}},
  {'D', {"###  ", "#  # ", "#   #", "#   #", "#   #", "#  # ", "###  "}},
  {'E', {"#####", "#    ", "#    ", "#### ", "#    ", "#    ", "#####"}},
  {'F', {"#####", "#    ", "#    ", "#### ", "#    ", "#    ", "#    "}},
  {'G', {" ### ", "#   #", "#    ", "# ###", "#   #", "#   #", " ####"}},
  {'H', {"#   #", "#   #", "#   #", "#####", "#   #", "#   #", "#   #"}},
  {'I', {" ### ", "  #  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "}},
  {'J', {"  ###", "   # ", "   # ", "   # ", "   # ", "#  # ", " ##  "}},
  {'K', {"#   #", "#  # ", "# #  ", "##   ", "# #  ", "#  # ", "#   #"}},
  {'L', {"#    ", "#    ", "#    ", "#    ", "#    ", "#    ", "#####"}},
  {'M', {"#   #", "## ##", "# # #", "# # #", "#   #", "#   #", "#   #"}},
  {'N', {"#   #", "#   #", "##  #", "# # #", "#  ##", "#   #", "#   #"}},
  {'O', {" ### ", "#   #", "#   #", "#   #", "#   #", "#   #", " ### "}},
  {'P', {"#### ", "#   #", "#   #", "#### ", "#    ", "#    ", "#    "}},
  {'Q', {" ### ", "#   #", "#   #", "#   #", "# # #", "#  # ", " ## #"}},
  {'R', {"#### ", "#   #", "#   #", "#### ", "# #  ", "#  # ", "#   #"}},
  {'S', {" ####", "#    ", "#    ", " ### ", "    #", "    #", "#### "}},
  {'T', {"#####", "  #  ", "  #  ", "  #  ", "  #  ", "  #  ", "  #  "}},
  {'U', {"#   #", "#   #", "#   #", "#   #", "#   #", "#   #", " ### "}},
  {'V', {"#   #", "#   #", "#   #", "#   #", "#   #", " # # ", "  #  "}},
  {'W', {"#   #", "#   #", "#   #", "# # #", "# # #", "# # #", " # # "}},
  {'X', {"#   #", "#   #", " # # ", "  #  ", " # # ", "#   #", "#   #"}},
  {'Y', {"#   #", "#   #", " # # ", "  #  ", "  #  ", "  #  ", "  #  "}},
  {'Z', {"#####", "    #", "   # ", "  #  ", " #   ", "#    ", "#####"}},
  {'a', {"     ", "     ", " ### ", "    #", " ####", "#   #", " ####"}},
  {'b', {"#    ", "#    ", "# ## ", "##  #", "#   #", "#   #", "#### "}},
  {'c', {"     ", "     ", " ### ", "#    ", "#    ", "#   #", " ### "}},
  {'d', {"    #", "    #", " ## #", "#  ##", "#   #", "#   #", " ####"}},
  {'e', {"     ", "     ", " ### ", "#   #", "#####", "#    ", " ### "}},
  {'f', {"  ## ", " #  #", " #   ", "###  ", " #   ", " #   ", " #   "}},
  {'g', {"     ", "     ", " ####", "#   #", "#   #", " ####", "    #", " ### "}},
  {'h', {"#    ", "#    ", "# ## ", "##  #", "#   #", "#   #", "#   #"}},
  {'i', {"  #  ", "     ", " ##  ", "  #  ", "  #  ", "  #  ", " ### "}},
  {'j', {"   # ", "     ", "  ## ", "   # ", "   # ", "   # ", "#  # ", " ##  "}},
  {'k', {"#    ", "#    ", "#  # ", "# #  ", "##   ", "# #  ", "#  # "}},
  {'l', {" ##  ", "  #  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "}},
  {'m', {"     ", "     ", "## # ", "# # #", "# # #", "#   #", "#   #"}},
  {'n', {"     ", "     ", "# ## ", "##  #", "#   #", "#   #", "#   #"}},
  {'o', {"     ", "     ", " ### ", "#   #", "#   #", "#   #", " ### "}},
  {'p', {"     ", "     ", "#### ", "#   #", "#   #", "#### ", "#    ", "#    "}},
  {'q', {"     ", "     ", " ####", "#   #", "#   #", " ####", "    #", "    #"}},
  {'r', {"     ", "     ", "# ## ", "##  #", "#    ", "#    ", "#    "}},
  {'s', {"     ", "     ", " ####", "#    ", " ### ", "    #", "#### "}},
  {'t', {" #   ", " #   ", "###  ", " #   ", " #   ", " #  #", "  ## "}},
  {'u', {"     ", "     ", "#   #", "#   #", "#   #", "#  ##", " ## #"}},
  {'v', {"     ", "     ", "#   #", "#   #", "#   #", " # # ", "  #  "}},
  {'w', {"     ", "     ", "#   #", "#   #", "# # #", "# # #", " # # "}},
  {'x', {"     ", "     ", "#   #", " # # ", "  #  ", " # # ", "#   #"}},
  {'y', {"     ", "     ", "#   #", "#   #", "#   #", " ####", "    #", " ### "}},
  {'z', {"     ", "     ", "#####", "   # ", "  #  ", " #   ", "#####"}},
  {'.', {"     ", "     ", "     ", "     ", "     ", " ##  ", " ##  "}},
  {',', {"     ", "     ", "     ", "     ", "     ", " ##  ", "  #  ", " #   "}},
  {'-', {"     ", "     ", "     ", "#####", "     ", "     ", "     "}},
  {'+', {"     ", "  #  ", "  #  ", "#####", "  #  ", "  #  ", "     "}},
  {'=', {"     ", "     ", "#####", "     ", "#####", "     ", "     "}},
  {'%', {"##   ", "##  #", "   # ", "  #  ", " #   ", "#  ##", "   ##"}},
  {':', {"     ", " ##  ", " ##  ", "     ", " ##  ", " ##  ", "     "}},
  {';', {"     ", " ##  ", " ##  ", "     ", " ##  ", "  #  ", " #   "}},
  {'/', {"     ", "    #", "   # ", "  #  ", " #   ", "#    ", "     "}},
  {'(', {"   # ", "  #  ", " #   ", " #   ", " #   ", "  #  ", "   # "}},
  {')', {" #   ", "  #  ", "   # ", "   # ", "   # ", "  #  ", " #   "}},
  {'[', {" ### ", " #   ", " #   ", " #   ", " #   ", " #   ", " ### "}},
  {']', {" ### ", "   # ", "   # ", "   # ", "   # ", "   # ", " ### "}},
  {'_', {"     ", "     ", "     ", "     ", "     ", "     ", "#####"}},
  {'#', {" # # ", " # # ", "#####", " # # ", "#####", " # # ", " # # "}},
  {'!', {"  #  ", "  #  ", "  #  ", "  #  ", "  #  ", "     ", "  #  "}},
  {'?', {" ### ", "#   #", "    #", "   # ", "  #  ", "     ", "  #  "}},
  {'\'', {"  #  ", "  #  ", " #   "}},
  {'"', {" # # ", " # # "}},
  {'<', {"   # ", "  #  ", " #   ", "#    ", " #   ", "  #  ", "   # "}},
  {'>', {" #   ", "  #  ", "   # ", "    #", "   # ", "  #  ", " #   "}},
  {'*', {"     ", "  #  ", "# # #", " ### ", "# # #", "  #  ", "     "}},
};
// clang-format on

constexpr int kCellW = 6;   // 5 columns of ink and one of space
constexpr int kCellH = 10;  // 7 rows, a descender row and two of space

const Glyph& glyph(char c) {
  static const std::array<const Glyph*, 128> table = [] {
    std::array<const Glyph*, 128> t{};
    for (const Glyph& g : kGlyphs) t[static_cast<unsigned char>(g.c)] = &g;
    return t;
  }();
  const auto u = static_cast<unsigned char>(c);
  if (u < 128 && table[u]) return *table[u];
  if (c >= 'a' && c <= 'z') return *table['A' + (c - 'a')];
  return *table['?'];
}

int text_width(const std::string& s, int scale) {
  return s.empty() ? 0 : (static_cast<int>(s.size()) * kCellW - 1) * scale;
}

// Draws `s` with its top-left corner at (x, y), each font pixel a scale x scale square.
void draw_text(Canvas& cv, int x, int y, const std::string& s, Rgb c, int scale = 1) {
  for (char ch : s) {
    const Glyph& g = glyph(ch);
    for (int row = 0; row < 8; ++row) {
      const char* bits = g.rows[row];
      if (!bits) continue;
      for (int col = 0; col < 5 && bits[col]; ++col)
        if (bits[col] == '#')
          cv.fill({x + col * scale, y + row * scale, x + (col + 1) * scale - 1,
                   y + (row + 1) * scale - 1},
                  c);
    }
    x += kCellW * scale;
  }
}

// ---- PNG encoder ---------------------------------------------------------------------------

void put_u32(std::string& out, uint32_t v) {
  out.push_back(static_cast<char>(v >> 24));
  out.push_back(static_cast<char>(v >> 16));
  out.push_back(static_cast<char>(v >> 8));
  out.push_back(static_cast<char>(v));
}

// A chunk is length, type, data, and the CRC-32 of type and data.
void put_chunk(std::string& out, const char type[4], const uint8_t* data, size_t n) {
  put_u32(out, static_cast<uint32_t>(n));
  const size_t type_at = out.size();
  out.append(type, 4);
  out.append(reinterpret_cast<const char*>(data), n);
  const uLong crc =
      crc32(0L, reinterpret_cast<const Bytef*>(out.data() + type_at), static_cast<uInt>(n + 4));
  put_u32(out, static_cast<uint32_t>(crc));
}

// Encodes the canvas as an 8-bit RGB PNG: filter type 0 on every row, zlib level 9, IDAT split
// into 32 KiB chunks as most encoders do.
std::string encode_png(const Canvas& cv) {
  const int w = cv.width(), h = cv.height();
  const size_t stride = static_cast<size_t>(w) * 3;
  std::vector<uint8_t> raw;
  raw.reserve((stride + 1) * h);
  for (int y = 0; y < h; ++y) {
    raw.push_back(0);
    const uint8_t* row = cv.pixels().data() + y * stride;
    raw.insert(raw.end(), row, row + stride);
  }
  uLongf zlen = compressBound(static_cast<uLong>(raw.size()));
  std::vector<uint8_t> z(zlen);
  const int rc = compress2(z.data(), &zlen, raw.data(), static_cast<uLong>(raw.size()), 9);
  if (rc != Z_OK) throw InputError("zlib compress2 failed with code " + std::to_string(rc));

  std::string out("\x89PNG\r\n\x1a\n", 8);
  std::string ihdr;
  put_u32(ihdr, static_cast<uint32_t>(w));
  put_u32(ihdr, static_cast<uint32_t>(h));
  ihdr += std::string("\x08\x02\x00\x00\x00", 5);  // depth 8, RGB, deflate, filter 0, no interlace
  put_chunk(out, "IHDR", reinterpret_cast<const uint8_t*>(ihdr.data()), ihdr.size());
  constexpr size_t kIdatChunk = 32768;
  for (size_t at = 0; at < zlen; at += kIdatChunk)
    put_chunk(out, "IDAT", z.data() + at, std::min(kIdatChunk, static_cast<size_t>(zlen) - at));
  put_chunk(out, "IEND", nullptr, 0);
  return out;
}

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

// Maps data to pixels inside `plot`, keeping kPad pixels clear so dots on the edge stay whole.
struct Transform {
  Rect plot;
  Axis x, y;
  static constexpr int kPad = 5;
  int px(double v) const {
    return plot.x0 + kPad +
           static_cast<int>(
               std::lround((v - x.lo) / (x.hi - x.lo) * (plot.x1 - plot.x0 - 2 * kPad)));
  }
  int py(double v) const {
    return plot.y1 - kPad -
           static_cast<int>(
               std::lround((v - y.lo) / (y.hi - y.lo) * (plot.y1 - plot.y0 - 2 * kPad)));
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
void draw_axes(Canvas& cv, const Transform& t, const std::string& x_label) {
  const Rect& p = t.plot;
  for (double v : ticks(t.y)) cv.hline(p.x0 + 1, p.x1 - 1, t.py(v), kGrid);
  for (double v : ticks(t.x)) cv.vline(t.px(v), p.y0 + 1, p.y1 - 1, kGrid);
  cv.frame(p, kFrame);
  for (double v : ticks(t.y)) {
    const int y = t.py(v);
    cv.hline(p.x0 - 4, p.x0 - 1, y, kFrame);
    const std::string s = format_tick(v, t.y.tick, t.y.percent);
    draw_text(cv, p.x0 - 7 - text_width(s, 1), y - 3, s, kText);
  }
  int last_label_end = -1000000;
  for (double v : ticks(t.x)) {
    const int x = t.px(v);
    cv.vline(x, p.y1 + 1, p.y1 + 4, kFrame);
    const std::string s = format_tick(v, t.x.tick, false);
    const int w = text_width(s, 1);
    if (x - w / 2 < last_label_end + 6) continue;  // labels never overlap
    draw_text(cv, x - w / 2, p.y1 + 8, s, kText);
    last_label_end = x - w / 2 + w;
  }
  draw_text(cv, (p.x0 + p.x1 - text_width(x_label, 1)) / 2, p.y1 + 22, x_label, kMuted);
}

// The plot rectangle of a panel: room above for the titles, left for the y labels, below for
// the x labels and axis name.
Rect plot_rect(Rect panel, const Axis& y) {
  int label_w = 0;
  for (double v : ticks(y))
    label_w = std::max(label_w, text_width(format_tick(v, y.tick, y.percent), 1));
  return Rect{panel.x0 + 12 + label_w + 8, panel.y0 + 46, panel.x1 - 18, panel.y1 - 36};
}

void draw_titles(Canvas& cv, Rect panel, int plot_x0, const std::string& title,
                 const std::string& subtitle) {
  cv.set_clip(panel);
  draw_text(cv, plot_x0, panel.y0 + 8, title, kText, 2);
  draw_text(cv, plot_x0, panel.y0 + 30, subtitle, kMuted);
  cv.clear_clip();
}

std::string fixed(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

void draw_loss_panel(Canvas& cv, Rect panel, const Metrics& m) {
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
  const Transform t{plot_rect(panel, y), integer_axis(x_lo, x_hi), y};
  draw_titles(
      cv, panel, t.plot.x0, "train loss",
      "line: logged steps, dots: epoch means; last " + fixed(m.step_loss.rbegin()->second, 4));
  draw_axes(cv, t, "global step");

  cv.set_clip(t.plot);
  int px = 0, py = 0;
  bool first = true;
  for (auto [gs, loss] : m.step_loss) {
    const int x = t.px(static_cast<double>(gs)), yv = t.py(loss);
    if (first)
      cv.set(x, yv, kLossColor);
    else
      cv.line(px, py, x, yv, kLossColor, 1);
    px = x;
    py = yv;
    first = false;
  }
  for (auto [gs, loss] : dots) cv.dot(t.px(gs), t.py(loss), 3, kEpochLossColor);
  cv.clear_clip();
}

void draw_accuracy_panel(Canvas& cv, Rect panel, const Metrics& m) {
  std::vector<std::pair<double, double>> pts;
  for (const auto& [epoch, e] : m.epochs)
    if (std::isfinite(e.test_accuracy))
      pts.emplace_back(static_cast<double>(epoch), e.test_accuracy);

  if (pts.empty()) {
    Axis y{0, 1, 0.2, true};
    const Transform t{plot_rect(panel, y), integer_axis(1, 1), y};
    draw_titles(cv, panel, t.plot.x0, "test accuracy", "no epoch lines with test_accuracy yet");
    draw_axes(cv, t, "epoch");
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
  const Transform t{plot_rect(panel, y), integer_axis(pts.front().first, pts.back().first), y};
  const int d = y.percent ? 2 : 4;
  const double k = y.percent ? 100 : 1;
  const std::string pct = y.percent ? "%" : "";
  draw_titles(cv, panel, t.plot.x0, "test accuracy",
              "last " + fixed(k * pts.back().second, d) + pct + ", best " +
                  fixed(k * pts[best].second, d) + pct + " (epoch " +
                  std::to_string(static_cast<int64_t>(pts[best].first)) + ")");
  draw_axes(cv, t, "epoch");

  cv.set_clip(t.plot);
  for (size_t i = 1; i < pts.size(); ++i)
    cv.line(t.px(pts[i - 1].first), t.py(pts[i - 1].second), t.px(pts[i].first),
            t.py(pts[i].second), kAccuracyColor, 2);
  for (auto [epoch, acc] : pts) cv.dot(t.px(epoch), t.py(acc), 3, kAccuracyColor);
  cv.clear_clip();
}

Canvas render(const Metrics& m, int w, int h, const std::string& title) {
  Canvas cv(w, h);
  int top = 0;
  if (!title.empty()) {
    draw_text(cv, std::max(4, (w - text_width(title, 2)) / 2), 10, title, kText, 2);
    top = 34;
  }
  const int mid = w / 2;
  draw_loss_panel(cv, Rect{0, top, mid - 1, h - 1}, m);
  draw_accuracy_panel(cv, Rect{mid, top, w - 1, h - 1}, m);
  return cv;
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
  app.parse(argc, argv);
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  try {
    a = parse_args(argc, argv);
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
    ember::nn::write_file_atomic(a.out, encode_png(render(m, a.width, a.height, a.title)));
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
