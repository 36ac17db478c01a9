// The timeline recorder (tensor/observe/trace.h): spans nest and the file is valid Chrome
// trace-event JSON; off records nothing and writes no file; the file appears whole or not at all.
#include <ember/tensor/observe/trace.h>

#include <dlfcn.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include <ember/tensor/error.h>
#include "tests/temp_dir.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
namespace trace = ember::trace;
using ember::test::TempDir;

json read_json(const std::string& path) {
  std::ifstream f(path);
  return json::parse(f);  // throws on invalid JSON
}

std::vector<json> named(const json& doc, const std::string& name) {
  std::vector<json> out;
  for (const auto& e : doc["traceEvents"])
    if (e["name"] == name) out.push_back(e);
  return out;
}

TEST(Trace, SpansNestAndTheFileIsChromeTraceJson) {
  TempDir dir;
  trace::start(dir.path(), trace::Level::Steps, 3);
  ASSERT_TRUE(trace::enabled());
  {
    trace::Span outer("outer", "test", {{"k", 7}});
    {
      trace::Span inner("inner \"quoted\"", "test");
      inner.arg("bytes", 1024);
    }
    trace::instant("mark", "test", {{"i", 1}});
    trace::counter("queue depth", 2.5);
  }
  const std::string path = trace::stop();
  EXPECT_FALSE(trace::enabled());
  ASSERT_EQ(path, dir.file("trace_rank3.json"));
  const json doc = read_json(path);
  EXPECT_EQ(doc["otherData"]["rank"], 3);
  const auto outer = named(doc, "outer"), inner = named(doc, "inner \"quoted\"");
  ASSERT_EQ(outer.size(), 1u);
  ASSERT_EQ(inner.size(), 1u);
  EXPECT_EQ(outer[0]["ph"], "X");
  EXPECT_EQ(outer[0]["pid"], 3);
  EXPECT_EQ(outer[0]["cat"], "test");
  EXPECT_EQ(outer[0]["args"]["k"], 7);
  EXPECT_EQ(inner[0]["args"]["bytes"], 1024);
  EXPECT_EQ(inner[0]["tid"], outer[0]["tid"]);
  const int64_t o0 = outer[0]["ts"], o1 = o0 + outer[0]["dur"].get<int64_t>();
  const int64_t i0 = inner[0]["ts"], i1 = i0 + inner[0]["dur"].get<int64_t>();
  EXPECT_LE(o0, i0);
  EXPECT_LE(i1, o1);
  ASSERT_EQ(named(doc, "mark").size(), 1u);
  EXPECT_EQ(named(doc, "mark")[0]["ph"], "i");
  ASSERT_EQ(named(doc, "queue depth").size(), 1u);
  EXPECT_EQ(named(doc, "queue depth")[0]["args"]["value"], 2.5);
  const auto process = named(doc, "process_name");
  ASSERT_EQ(process.size(), 1u);
  EXPECT_EQ(process[0]["args"]["name"], "rank 3");
}

// Counter values keep their precision, and NaN or infinity leave the file valid JSON (the whole
// file failed to parse, and 1e-7 was written 0.000000).
TEST(Trace, CountersAreExactAndNonFiniteOnesAreNull) {
  TempDir dir;
  trace::start(dir.path(), trace::Level::Steps, 0);
  trace::counter("lr", 1e-7);
  trace::counter("big", 123456789.125);
  trace::counter("loss", std::nan(""));
  trace::counter("scale", -INFINITY);
  const json doc = read_json(trace::stop());
  EXPECT_EQ(named(doc, "lr").at(0)["args"]["value"].get<double>(), 1e-7);
  EXPECT_EQ(named(doc, "big").at(0)["args"]["value"].get<double>(), 123456789.125);
  EXPECT_TRUE(named(doc, "loss").at(0)["args"]["value"].is_null());
  EXPECT_TRUE(named(doc, "scale").at(0)["args"]["value"].is_null());
}

TEST(Trace, OffRecordsNothingAndWritesNoFile) {
  TempDir dir;
  ASSERT_FALSE(trace::enabled());
  { trace::Span s("while off", "test"); }
  trace::instant("while off", "test");
  EXPECT_EQ(trace::stop(), "");
  EXPECT_TRUE(fs::is_empty(dir.path()));
  // Recorded neither before start nor after stop.
  trace::start(dir.path(), trace::Level::Steps, 0);
  { trace::Span s("while on", "test"); }
  const std::string path = trace::stop();
  { trace::Span s("after stop", "test"); }
  const json doc = read_json(path);
  EXPECT_EQ(named(doc, "while off").size(), 0u);
  EXPECT_EQ(named(doc, "while on").size(), 1u);
  EXPECT_EQ(named(doc, "after stop").size(), 0u);
}

TEST(Trace, OpsLevelSpansOnlyAtTheOpsLevel) {
  TempDir dir;
  trace::start(dir.path(), trace::Level::Steps, 0);
  EXPECT_FALSE(trace::enabled(trace::Level::Ops));
  { trace::Span s("node", "autograd", {}, trace::Level::Ops); }
  json doc = read_json(trace::stop());
  EXPECT_EQ(named(doc, "node").size(), 0u);
  trace::start(dir.path(), trace::Level::Ops, 0);
  { trace::Span s("node", "autograd", {}, trace::Level::Ops); }
  doc = read_json(trace::stop());
  EXPECT_EQ(named(doc, "node").size(), 1u);
  EXPECT_EQ(doc["otherData"]["level"], "ops");
  EXPECT_THROW(trace::parse_level("verbose"), ember::ValueError);
}

TEST(Trace, ThreadsGetRowsOfTheirOwnAndNamedRows) {
  TempDir dir;
  trace::start(dir.path(), trace::Level::Steps, 1);
  { trace::Span s("main thread", "test"); }
  std::thread t([] { trace::Span s("other thread", "test"); });
  t.join();
  trace::complete_on_row(1005, "ddp bucket 5", "bucket allreduce", "ddp", trace::now_us(), 3,
                         {{"bytes", 64}});
  const json doc = read_json(trace::stop());
  ASSERT_EQ(named(doc, "main thread").size(), 1u);
  ASSERT_EQ(named(doc, "other thread").size(), 1u);
  EXPECT_NE(named(doc, "main thread")[0]["tid"], named(doc, "other thread")[0]["tid"]);
  ASSERT_EQ(named(doc, "bucket allreduce").size(), 1u);
  EXPECT_EQ(named(doc, "bucket allreduce")[0]["tid"], 1005);
  bool row_named = false;
  for (const auto& m : named(doc, "thread_name"))
    row_named = row_named || (m["tid"] == 1005 && m["args"]["name"] == "ddp bucket 5");
  EXPECT_TRUE(row_named);
}

// Rows of threads: the process's main thread is named without asking, others when they ask.
TEST(Trace, ThreadNamesAreWritten) {
  TempDir dir;
  trace::start(dir.path(), trace::Level::Steps, 0);
  { trace::Span s("on main", "test"); }
  std::thread t([] {
    trace::set_thread_name("test worker");
    trace::Span s("on worker", "test");
  });
  t.join();
  const json doc = read_json(trace::stop());
  std::map<std::string, json> names;
  for (const auto& m : named(doc, "thread_name")) names[m["args"]["name"]] = m["tid"];
  ASSERT_TRUE(names.count("main thread"));
  ASSERT_TRUE(names.count("test worker"));
  EXPECT_EQ(names["main thread"], named(doc, "on main")[0]["tid"]);
  EXPECT_EQ(names["test worker"], named(doc, "on worker")[0]["tid"]);
}

// A stop hook runs before the file is written, while recording is on; registered once.
int g_hook_runs = 0;
void hook() {
  ++g_hook_runs;
  trace::complete_on_row(trace::unique_row(), "late row", "late span", "test", trace::now_us(), 1,
                         {}, "\"extra\":\"yes\"");
}

TEST(Trace, StopHooksRecordBeforeTheFileIsWritten) {
  TempDir dir;
  trace::add_stop_hook(hook);
  trace::add_stop_hook(hook);
  trace::start(dir.path(), trace::Level::Steps, 0);
  const int runs = g_hook_runs;  // other tests' stop() runs it too, once registered
  const json doc = read_json(trace::stop());
  EXPECT_EQ(g_hook_runs, runs + 1);
  ASSERT_EQ(named(doc, "late span").size(), 1u);
  EXPECT_EQ(named(doc, "late span")[0]["args"]["extra"], "yes");
  EXPECT_EQ(trace::stop(), "") << "nothing recording: no file";
  EXPECT_EQ(g_hook_runs, runs + 1) << "and no hook run";
}

TEST(Trace, CollectiveSpansParseTheLabel) {
  TempDir dir;
  trace::start(dir.path(), trace::Level::Steps, 0);
  const int64_t queued = trace::now_us();
  trace::collective("[gloo] allreduce #12 on rank 0 of 2", queued, queued + 5, 4096);
  const json doc = read_json(trace::stop());
  const auto c = named(doc, "allreduce");
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0]["cat"], "collective");
  EXPECT_EQ(c[0]["args"]["seq"], 12);
  EXPECT_EQ(c[0]["args"]["bytes"], 4096);
  EXPECT_EQ(c[0]["args"]["queued_us"], 5);
  EXPECT_EQ(c[0]["args"]["backend"], "gloo");
}

TEST(Trace, TimestampsAreShiftedToRankZerosClock) {
  TempDir dir;
  trace::start(dir.path(), trace::Level::Steps, 2);
  trace::set_clock_offset(2, 1000, 7);
  trace::complete("shifted", "test", 5000, 10);
  const json doc = read_json(trace::stop());
  EXPECT_EQ(doc["otherData"]["clock_offset_us"], 1000);
  EXPECT_EQ(doc["otherData"]["clock_error_us"], 7);
  ASSERT_EQ(named(doc, "shifted").size(), 1u);
  EXPECT_EQ(named(doc, "shifted")[0]["ts"], 4000);
  trace::set_clock_offset(0, 0, -1);
}

TEST(Trace, TheFileIsReplacedWholeOrNotAtAll) {
  TempDir dir;
  const std::string target = dir.file("trace_rank0.json");
  // A previous file is replaced by a complete new one.
  { std::ofstream(target) << "old"; }
  trace::start(dir.path(), trace::Level::Steps, 0);
  { trace::Span s("new", "test"); }
  EXPECT_EQ(named(read_json(trace::stop()), "new").size(), 1u);
  // A target that cannot be replaced (a non-empty folder) fails the stop, naming the file, and
  // leaves no temporary file behind.
  fs::remove(target);
  fs::create_directories(target + "/keep");
  trace::start(dir.path(), trace::Level::Steps, 0);
  try {
    trace::stop();
    ADD_FAILURE() << "stop() wrote over a folder";
  } catch (const ember::Error& e) {
    EXPECT_NE(std::string(e.what()).find("trace_rank0.json"), std::string::npos) << e.what();
  }
  for (const auto& e : fs::directory_iterator(dir.path()))
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
  EXPECT_FALSE(trace::enabled());
}

// One recorder per process: its state and functions are defined in ember_log alone, which the
// store and launcher link without tensors. A second copy in ember_tensor would be a second
// recorder (and g_level) in every process that loads both, which of the two a call reached then
// depending on the libraries' load order; ASan reports the duplicate globals (odr-violation).
TEST(Trace, TheRecorderIsDefinedOnlyInEmberLog) {
  auto library_of = [](const void* addr) {
    Dl_info info{};
    EXPECT_NE(dladdr(addr, &info), 0);
    return fs::path(info.dli_fname != nullptr ? info.dli_fname : "").filename().string();
  };
  // Functions, not g_level: a PIE test binary holds its own copy of a library variable it reads
  // (a copy relocation), so a variable's address names this binary.
  EXPECT_EQ(library_of(reinterpret_cast<const void*>(&trace::start)), "libember_log.so");
  EXPECT_EQ(library_of(reinterpret_cast<const void*>(&trace::stop)), "libember_log.so");
}

}  // namespace
