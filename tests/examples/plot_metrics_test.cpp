// Tests of examples/plot_metrics as a user runs it: write a metrics file, run the tool, then
// decode the PNG here (with Cairo's PNG reader, over libpng) and look at where the curve colours
// land: the data lines are 2 px wide, so antialiasing leaves their cores in the exact colour.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <cairo.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "cmake/build_paths.h"
#include "tests/examples/example_test_util.h"

namespace {

namespace fs = std::filesystem;

std::string tool() { return std::string(EMBER_BINARY_DIR) + "/examples/plot_metrics"; }

using ember::test::TempDir;
using Result = ember::test::CommandResult;

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// Runs plot_metrics with `args` (already quoted) under a time limit.
Result run(const std::string& args) { return ember::test::run_command(quote(tool()) + " " + args, 60); }

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string step(long gs, double loss) {
  std::ostringstream os;
  os.precision(17);
  os << R"({"kind":"step","epoch":1,"step":)" << gs << R"(,"global_step":)" << gs << R"(,"loss":)"
     << loss << R"(,"images_per_s":3100.5,"lr":0.05,"time_s":12.3})"
     << "\n";
  return os.str();
}

std::string epoch(int e, long gs, double train_loss, double accuracy) {
  std::ostringstream os;
  os.precision(17);
  os << R"({"kind":"epoch","epoch":)" << e << R"(,"global_step":)" << gs << R"(,"train_loss":)"
     << train_loss << R"(,"test_loss":0.4,"test_accuracy":)" << accuracy
     << R"(,"time_s":20.1,"images_per_s":3000.2,"complete":true})"
     << "\n";
  return os.str();
}

// ---- the PNG read back ----------------------------------------------------------------

struct Rgb {
  uint8_t r, g, b;
  bool operator==(const Rgb& o) const { return r == o.r && g == o.g && b == o.b; }
};
constexpr Rgb kLoss{31, 119, 180};
constexpr Rgb kEpochLoss{255, 127, 14};
constexpr Rgb kAccuracy{44, 160, 44};

struct Png {
  std::string error;  // empty when the file decoded
  uint32_t width = 0, height = 0;
  std::vector<uint8_t> rgb;
  Rgb at(int x, int y) const {
    const uint8_t* p = &rgb[(static_cast<size_t>(y) * width + x) * 3];
    return {p[0], p[1], p[2]};
  }
};

Png decode_png(const std::string& path) {
  Png png;
  const std::string s = read_file(path);
  if (s.size() < 8 || s.compare(0, 8, std::string("\x89PNG\r\n\x1a\n", 8)) != 0) {
    png.error = "bad signature";
    return png;
  }
  cairo_surface_t* img = cairo_image_surface_create_from_png(path.c_str());
  if (cairo_surface_status(img) != CAIRO_STATUS_SUCCESS) {
    png.error = cairo_status_to_string(cairo_surface_status(img));
    cairo_surface_destroy(img);
    return png;
  }
  const cairo_format_t format = cairo_image_surface_get_format(img);
  if (format != CAIRO_FORMAT_RGB24 && format != CAIRO_FORMAT_ARGB32) {
    cairo_surface_destroy(img);
    return png.error = "not an RGB image", png;
  }
  png.width = cairo_image_surface_get_width(img);
  png.height = cairo_image_surface_get_height(img);
  const int stride = cairo_image_surface_get_stride(img);
  const unsigned char* data = cairo_image_surface_get_data(img);
  png.rgb.resize(size_t{png.width} * png.height * 3);
  for (uint32_t y = 0; y < png.height; ++y) {
    for (uint32_t x = 0; x < png.width; ++x) {
      uint32_t px;  // native-endian 0xAARRGGBB
      std::memcpy(&px, data + size_t{y} * stride + x * 4, 4);
      uint8_t* out = &png.rgb[(size_t{y} * png.width + x) * 3];
      out[0] = uint8_t(px >> 16);
      out[1] = uint8_t(px >> 8);
      out[2] = uint8_t(px);
    }
  }
  cairo_surface_destroy(img);
  return png;
}

// Pixels of colour `c` in columns [x0, x1) and rows from y0 down.
struct Pixels {
  std::vector<std::pair<int, int>> xy;
  size_t count() const { return xy.size(); }
  int min_x() const {
    int m = INT32_MAX;
    for (auto [x, y] : xy) m = std::min(m, x);
    return m;
  }
  int max_x() const {
    int m = -1;
    for (auto [x, y] : xy) m = std::max(m, x);
    return m;
  }
  int min_y() const {
    int m = INT32_MAX;
    for (auto [x, y] : xy) m = std::min(m, y);
    return m;
  }
  int max_y() const {
    int m = -1;
    for (auto [x, y] : xy) m = std::max(m, y);
    return m;
  }
  // Mean row of the pixels in columns [x0, x1].
  double mean_y(int x0, int x1) const {
    double sum = 0;
    int n = 0;
    for (auto [x, y] : xy)
      if (x >= x0 && x <= x1) sum += y, ++n;
    return n ? sum / n : NAN;
  }
};

Pixels find(const Png& png, Rgb c, int x0, int x1, int y0 = 0) {
  Pixels p;
  for (int y = y0; y < static_cast<int>(png.height); ++y)
    for (int x = x0; x < x1; ++x)
      if (png.at(x, y) == c) p.xy.emplace_back(x, y);
  return p;
}

// Three epochs of 100 steps, loss logged every 10 steps and falling, accuracy rising.
std::string three_epochs() {
  std::string m;
  for (int e = 1; e <= 3; ++e) {
    for (long gs = (e - 1) * 100 + 10; gs <= e * 100; gs += 10)
      m += step(gs, 0.2 + 2 * std::exp(-gs / 80.0));
    m += epoch(e, e * 100, 0.3 + 1.0 / e, 0.6 + 0.1 * e);
  }
  return m;
}

TEST(PlotMetrics, DrawsLossOnTheLeftAndAccuracyOnTheRight) {
  TempDir dir;
  write_file(dir.file("m.jsonl"), three_epochs());
  const Result r = run(quote(dir.file("m.jsonl")) + " " + quote(dir.file("out.png")) +
                       " --width 800 --height 360 --title 'run 1: cnn'");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("out.png"), std::string::npos) << r.output;
  const Png png = decode_png(dir.file("out.png"));
  ASSERT_EQ(png.error, "");
  EXPECT_EQ(png.width, 800u);
  EXPECT_EQ(png.height, 360u);

  const int mid = 400;
  const Pixels loss_left = find(png, kLoss, 0, mid), loss_right = find(png, kLoss, mid, 800);
  const Pixels dots_left = find(png, kEpochLoss, 0, mid),
               dots_right = find(png, kEpochLoss, mid, 800);
  const Pixels acc_left = find(png, kAccuracy, 0, mid), acc_right = find(png, kAccuracy, mid, 800);
  EXPECT_GT(loss_left.count(), 100u);
  EXPECT_EQ(loss_right.count(), 0u);
  EXPECT_GE(dots_left.count(), 3u * 20);  // three dots of radius 4
  EXPECT_EQ(dots_right.count(), 0u);
  EXPECT_GT(acc_right.count(), 50u);
  EXPECT_EQ(acc_left.count(), 0u);

  // Image rows grow downwards: a falling loss starts high (small y) and ends low (large y).
  const int w = loss_left.max_x() - loss_left.min_x();
  ASSERT_GT(w, 200) << "the step-loss line should span most of the left panel";
  const double loss_start = loss_left.mean_y(loss_left.min_x(), loss_left.min_x() + w / 10);
  const double loss_end = loss_left.mean_y(loss_left.max_x() - w / 10, loss_left.max_x());
  EXPECT_LT(loss_start + 100, loss_end) << "a falling loss must be drawn from high to low";
  // The first dot (train loss 1.3) sits above the last (0.63).
  const int dw = dots_left.max_x() - dots_left.min_x();
  EXPECT_LT(dots_left.mean_y(dots_left.min_x(), dots_left.min_x() + 6),
            dots_left.mean_y(dots_left.max_x() - 6, dots_left.max_x()) - 20)
      << dw;
  // Rising accuracy ends higher than it starts.
  const int aw = acc_right.max_x() - acc_right.min_x();
  ASSERT_GT(aw, 200);
  EXPECT_GT(acc_right.mean_y(acc_right.min_x(), acc_right.min_x() + 6),
            acc_right.mean_y(acc_right.max_x() - 6, acc_right.max_x()) + 50);
}

TEST(PlotMetrics, DefaultSizeAndNoEpochsYet) {
  TempDir dir;
  write_file(dir.file("m.jsonl"), step(1, 2.3) + step(2, 2.1));  // a run still in its first epoch
  const Result r = run(quote(dir.file("m.jsonl")) + " " + quote(dir.file("out.png")));
  ASSERT_EQ(r.status, 0) << r.output;
  const Png png = decode_png(dir.file("out.png"));
  ASSERT_EQ(png.error, "");
  EXPECT_EQ(png.width, 1000u);
  EXPECT_EQ(png.height, 420u);
  EXPECT_GT(find(png, kLoss, 0, 500).count(), 10u);
  EXPECT_EQ(find(png, kAccuracy, 0, 1000).count(), 0u);
  EXPECT_EQ(find(png, kEpochLoss, 0, 1000).count(), 0u);
}

// A resumed run appends to the same file and repeats steps 110..150 and epoch 1: the lines
// written after the resume replace the stale ones, so constant data draws flat lines.
TEST(PlotMetrics, ResumedRunKeepsTheLastLineOfEachStepAndEpoch) {
  TempDir dir;
  std::string m;
  for (long gs = 10; gs <= 150; gs += 10) m += step(gs, gs <= 100 ? 1.0 : 3.0);  // diverged
  m += epoch(1, 150, 1.0, 0.5);                                 // partial epoch 1 of the first run
  for (long gs = 110; gs <= 300; gs += 10) m += step(gs, 1.0);  // resumed from step 100
  m += epoch(1, 200, 1.0, 0.9);
  m += epoch(2, 300, 1.0, 0.9);
  write_file(dir.file("m.jsonl"), m);
  const Result r = run(quote(dir.file("m.jsonl")) + " " + quote(dir.file("out.png")));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("30 steps, 2 epochs"), std::string::npos) << r.output;
  const Png png = decode_png(dir.file("out.png"));
  ASSERT_EQ(png.error, "");
  // Below the legends (drawn above the plots in the same colours).
  const int plot_top = 48;
  const Pixels loss = find(png, kLoss, 0, 500, plot_top);
  ASSERT_GT(loss.count(), 100u);
  EXPECT_LE(loss.max_y() - loss.min_y(), 1) << "constant loss 1.0 must draw one horizontal line";
  const Pixels acc = find(png, kAccuracy, 500, 1000, plot_top);
  ASSERT_GT(acc.count(), 50u);
  EXPECT_LE(acc.max_y() - acc.min_y(), 8) << "constant accuracy: a flat line with dots of radius 4";
}

TEST(PlotMetrics, IgnoresOtherKindsAndKeysAndAnUnfinishedLastLine) {
  TempDir dir;
  write_file(dir.file("m.jsonl"),
             "\n"
             R"({"kind":"note","text":"started"})"
             "\n"
             R"({"no_kind":1})"
             "\n" +
                 step(5, 1.5) + "   \n" + step(10, 1.2) +
                 R"({"kind":"step","epoch":1,"step":15,"glo)");
  const Result r = run(quote(dir.file("m.jsonl")) + " " + quote(dir.file("out.png")));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("m.jsonl:7"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("unfinished last line"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("2 steps"), std::string::npos) << r.output;
  EXPECT_EQ(decode_png(dir.file("out.png")).error, "");
}

TEST(PlotMetrics, BadLineIsReportedWithItsNumberAndLeavesTheOldPng) {
  TempDir dir;
  write_file(dir.file("out.png"), "previous plot");
  const std::string bad = R"({"kind":"step","global_step":30,"loss":})";
  write_file(dir.file("m.jsonl"), step(10, 1.0) + step(20, 0.9) + bad + "\n" + step(40, 0.8));
  const Result r = run(quote(dir.file("m.jsonl")) + " " + quote(dir.file("out.png")));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("m.jsonl:3: not valid JSON"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(bad), std::string::npos) << r.output;
  EXPECT_EQ(read_file(dir.file("out.png")), "previous plot");
  EXPECT_EQ(dir.list(), (std::vector<std::string>{"m.jsonl", "out.png"})) << "no temporary left";
}

TEST(PlotMetrics, StepLineWithoutANumericLossOrStepIsAnError) {
  TempDir dir;
  write_file(dir.file("a.jsonl"), step(10, 1.0) + R"({"kind":"step","global_step":20})"
                                              "\n");
  Result r = run(quote(dir.file("a.jsonl")) + " " + quote(dir.file("out.png")));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("a.jsonl:2:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("\"loss\""), std::string::npos) << r.output;

  write_file(dir.file("b.jsonl"), R"({"kind":"step","global_step":"ten","loss":1.0})"
                              "\n");
  r = run(quote(dir.file("b.jsonl")) + " " + quote(dir.file("out.png")));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("b.jsonl:1:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("global_step"), std::string::npos) << r.output;

  write_file(dir.file("c.jsonl"), "[1, 2]\n");
  r = run(quote(dir.file("c.jsonl")) + " " + quote(dir.file("out.png")));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("c.jsonl:1: expected a JSON object"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir.file("out.png")));
}

TEST(PlotMetrics, NoStepLinesIsAnError) {
  TempDir dir;
  write_file(dir.file("epochs.jsonl"), epoch(1, 100, 0.5, 0.8));
  write_file(dir.file("empty.jsonl"), "");
  for (const char* name : {"epochs.jsonl", "empty.jsonl"}) {
    const Result r = run(quote(dir.file(name)) + " " + quote(dir.file("out.png")));
    EXPECT_EQ(r.status, 1) << name << ": " << r.output;
    EXPECT_NE(r.output.find("no step lines"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(name), std::string::npos) << r.output;
  }
  EXPECT_FALSE(fs::exists(dir.file("out.png")));
}

TEST(PlotMetrics, MissingInputOrOutputDirectoryIsAnError) {
  TempDir dir;
  Result r = run(quote(dir.file("nope.jsonl")) + " " + quote(dir.file("out.png")));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("cannot open metrics file"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(dir.file("nope.jsonl")), std::string::npos) << r.output;

  write_file(dir.file("m.jsonl"), step(1, 1.0));
  r = run(quote(dir.file("m.jsonl")) + " " + quote(dir.file("no/such/dir/out.png")));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("no/such/dir/out.png"), std::string::npos) << r.output;
  EXPECT_EQ(dir.list(), std::vector<std::string>{"m.jsonl"});
}

TEST(PlotMetrics, BadUsageExits2WithUsage) {
  TempDir dir;
  write_file(dir.file("m.jsonl"), step(1, 1.0));
  const std::string in = quote(dir.file("m.jsonl")), out = quote(dir.file("out.png"));
  for (const std::string& args :
       {std::string(), in, in + " " + out + " extra", in + " " + out + " --width abc",
        in + " " + out + " --width 10", in + " " + out + " --height=99999",
        in + " " + out + " --width 12x", in + " " + out + " --height",
        in + " " + out + " --dpi 3"}) {
    const Result r = run(args);
    EXPECT_EQ(r.status, 2) << "args: " << args << "\n" << r.output;
    EXPECT_NE(r.output.find("usage: plot_metrics"), std::string::npos) << r.output;
  }
  EXPECT_FALSE(fs::exists(dir.file("out.png")));
  const Result help = run("--help");
  EXPECT_EQ(help.status, 0) << help.output;
  EXPECT_NE(help.output.find("usage: plot_metrics"), std::string::npos);
  // --opt=value works as well as --opt value.
  const Result ok = run(in + " " + out + " --width=640 --height 240");
  ASSERT_EQ(ok.status, 0) << ok.output;
  const Png png = decode_png(dir.file("out.png"));
  ASSERT_EQ(png.error, "");
  EXPECT_EQ(png.width, 640u);
  EXPECT_EQ(png.height, 240u);
}

}  // namespace
