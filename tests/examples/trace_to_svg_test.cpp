// examples/trace_to_svg on a small two-rank trace written here: the SVG is well-formed XML
// (parsed by python3's xml module) of the asked width, with a box for every span in the step
// window in its category's colour (the wait in its own), one lane per rank and row, and clear
// errors for a step that is not in the trace and for a file that is no trace.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "cmake/build_paths.h"
#include "tests/examples/example_test_util.h"

namespace {

const std::string kTool = std::string(EMBER_BINARY_DIR) + "/examples/trace_to_svg";

// Rank r's step s runs [s*1000 + r*10, +900): forward, backward, and inside backward a wait;
// bucket 0's reduction on a row of its own; a gloo collective on a worker.
std::string small_trace() {
  std::string t = R"({"traceEvents":[
{"ph":"M","pid":0,"tid":0,"name":"process_name","args":{"name":"rank 0"}},
{"ph":"M","pid":1,"tid":0,"name":"process_name","args":{"name":"rank 1"}},
{"ph":"M","pid":0,"tid":0,"name":"thread_name","args":{"name":"main thread"}},
{"ph":"M","pid":1,"tid":0,"name":"thread_name","args":{"name":"main thread"}},
{"ph":"M","pid":0,"tid":1000,"name":"thread_name","args":{"name":"ddp bucket 0"}},
{"ph":"M","pid":1,"tid":1000,"name":"thread_name","args":{"name":"ddp bucket 0"}})";
  for (int r : {0, 1}) {
    for (int s : {1, 2, 3}) {
      const auto ev = [&](const char* name, const char* cat, int tid, int at, int dur) {
        t += ",\n{\"ph\":\"X\",\"pid\":" + std::to_string(r) + ",\"tid\":" +
             std::to_string(tid) + ",\"ts\":" + std::to_string(s * 1000 + r * 10 + at) +
             ",\"dur\":" + std::to_string(dur) + ",\"name\":\"" + name + "\",\"cat\":\"" + cat +
             "\",\"args\":{\"step\":" + std::to_string(s) + "}}";
      };
      ev("train step", "step", 0, 0, 900);
      ev("forward", "model", 0, 0, 300);
      ev("backward", "autograd", 0, 300, 500);
      ev("wait for communication", "ddp", 0, 700, 100);
      ev("bucket allreduce", "ddp", 1000, 500, 300);
      ev("allreduce_coalesced", "collective", 5, 600, 200);
    }
  }
  return t + "\n]}\n";
}

int count(const std::string& s, const std::string& what) {
  int n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

TEST(TraceToSvg, DrawsAWellFormedPictureOfTheStepWindow) {
  ember::test::TempDir tmp("trace_to_svg_test");
  const std::string in = tmp.file("trace.json"), out = tmp.file("steps.svg");
  std::ofstream(in) << small_trace();
  const auto r =
      ember::test::run_command(kTool + " " + in + " " + out + " --from 2 --to 2 --width 1000", 60);
  ASSERT_EQ(r.status, 0) << r.output;
  // One lane per rank and row, the main thread first; step 2's spans only.
  for (const char* lane :
       {"lane rank 0 · main thread: 4 spans", "lane rank 0 · ddp bucket 0: 1 spans",
        "lane rank 0 · thread 5: 1 spans", "lane rank 1 · main thread: 4 spans",
        "lane rank 1 · ddp bucket 0: 1 spans", "lane rank 1 · thread 5: 1 spans"}) {
    EXPECT_NE(r.output.find(lane), std::string::npos) << lane << " in\n" << r.output;
  }
  EXPECT_LT(r.output.find("lane rank 0 · main thread"), r.output.find("lane rank 0 · ddp"));

  const auto xml = ember::test::run_command(
      "python3 -c \"import sys, xml.etree.ElementTree as E; root = E.parse(sys.argv[1]).getroot(); "
      "print(root.tag, root.get('width'))\" " + out, 60);
  ASSERT_EQ(xml.status, 0) << "not well-formed XML:\n" << xml.output;
  EXPECT_EQ(xml.output, "{http://www.w3.org/2000/svg}svg 1000pt\n");

  std::ifstream f(out);
  const std::string svg((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  // Each category's boxes in its colour (Cairo writes rgb() in percent): two of each per window.
  EXPECT_EQ(count(svg, "fill:rgb(89%,10%,11%)"), 2 + 1) << "the waits, and the legend's swatch";
  EXPECT_EQ(count(svg, "fill:rgb(99%,55%,24%)"), 2 + 1) << "backward (autograd)";
  EXPECT_EQ(count(svg, "fill:rgb(30%,69%,29%)"), 2 + 1) << "the bucket all-reduces (ddp)";
  EXPECT_EQ(count(svg, "fill:rgb(60%,31%,64%)"), 2 + 1) << "the collectives";
}

TEST(TraceToSvg, WholeTraceWithoutAWindow) {
  ember::test::TempDir tmp("trace_to_svg_test");
  const std::string in = tmp.file("trace.json"), out = tmp.file("all.svg");
  std::ofstream(in) << small_trace();
  const auto r = ember::test::run_command(kTool + " " + in + " " + out, 60);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("lane rank 1 · main thread: 12 spans"), std::string::npos) << r.output;
}

TEST(TraceToSvg, ErrorsSayWhatIsWrong) {
  ember::test::TempDir tmp("trace_to_svg_test");
  const std::string in = tmp.file("trace.json"), other = tmp.file("other.json");
  std::ofstream(in) << small_trace();
  std::ofstream(other) << "{\"loss\": 1}\n";
  auto r = ember::test::run_command(kTool + " " + in + " " + tmp.file("x.svg") + " --from 7", 60);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("no \"train step\" span of step 7"), std::string::npos) << r.output;
  r = ember::test::run_command(kTool + " " + other + " " + tmp.file("x.svg"), 60);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("not a Chrome trace-event file"), std::string::npos) << r.output;
}

}  // namespace
