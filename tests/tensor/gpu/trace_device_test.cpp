// Device-side spans (tensor/gpu/trace_device.h): off, a DeviceSpan touches no CUDA API (runs
// anywhere); on a GPU, a span of work on a stream lands on its row, on the trace clock, inside
// the host's window around it, with queued_us, also when trace::stop() comes before the device
// finished. The GPU cases (TraceDeviceCuda, which scripts/gpu_check.sh runs) skip, saying why,
// without a device.
#include <ember/tensor/gpu/trace_device.h>

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/examples/example_test_util.h"

namespace {

using nlohmann::json;
namespace trace = ember::trace;
namespace cuda = ember::cuda;

#define REQUIRE_CUDA_DEVICE() \
  if (!cuda::is_available()) GTEST_SKIP() << cuda::unavailable_reason()

std::vector<json> named(const json& doc, const std::string& name) {
  std::vector<json> out;
  for (const auto& e : doc["traceEvents"])
    if (e["name"] == name) out.push_back(e);
  return out;
}

json read_json(const std::string& path) {
  std::ifstream f(path);
  return json::parse(f);
}

TEST(TraceDevice, OffRecordsNothingAndCallsNoCuda) {
  ASSERT_FALSE(trace::enabled());
  // A stream handle that is no stream: any CUDA call on it would fail (or throw without CUDA).
  const cuda::Stream bogus(reinterpret_cast<void*>(0x1), 12345);
  trace::DeviceSpan span(bogus);
  EXPECT_FALSE(span.active());
  span.finish(bogus, trace::DeviceSpanInfo{"never", "cuda", "", trace::unique_row(), "row", 0});
  EXPECT_EQ(trace::pending_device_spans(), 0u);
}

TEST(TraceDevice, RowsAreUnique) {
  const int a = trace::unique_row();
  const int b = trace::unique_row();
  EXPECT_NE(a, b);
  EXPECT_GE(a, 2000) << "clear of DDP's bucket rows (1000 + bucket)";
}

TEST(TraceDeviceCuda, SpanOfStreamWorkIsOnTheTraceClock) {
  REQUIRE_CUDA_DEVICE();
  ember::test::TempDir dir("trace_device_test");
  const cuda::Stream s = cuda::Stream::create(0);
  trace::start(dir.path(), trace::Level::Steps, 0);
  const int row = trace::unique_row();
  const int64_t before = trace::now_us();
  trace::DeviceSpan span(s);
  ASSERT_TRUE(span.active());
  cuda::spin(20'000'000, s);  // milliseconds of device time
  span.finish(s, trace::DeviceSpanInfo{"spin", "cuda", "\"k\":3", row, "test stream", before});
  s.synchronize();
  const int64_t after = trace::now_us();
  trace::resolve_device_spans();
  EXPECT_EQ(trace::pending_device_spans(), 0u) << "the device has passed its end event";
  const json doc = read_json(trace::stop());
  const auto spins = named(doc, "spin");
  ASSERT_EQ(spins.size(), 1u);
  const json& e = spins[0];
  EXPECT_EQ(e["cat"], "cuda");
  EXPECT_EQ(e["tid"], row);
  EXPECT_EQ(e["args"]["k"], 3);
  EXPECT_GE(e["args"]["queued_us"].get<int64_t>(), 0);
  EXPECT_GT(e["dur"].get<int64_t>(), 0) << "the spin ran on the device";
  // Within the host's window around the work, give or take the anchor's bound (generous).
  const int64_t slack = 2000;
  EXPECT_GE(e["ts"].get<int64_t>(), before - slack);
  EXPECT_LE(e["ts"].get<int64_t>() + e["dur"].get<int64_t>(), after + slack);
  bool row_named = false;
  for (const auto& m : named(doc, "thread_name"))
    row_named = row_named || (m["tid"] == row && m["args"]["name"] == "test stream");
  EXPECT_TRUE(row_named);
}

TEST(TraceDeviceCuda, StopWaitsForSpansStillRunning) {
  REQUIRE_CUDA_DEVICE();
  ember::test::TempDir dir("trace_device_test");
  const cuda::Stream s = cuda::Stream::create(0);
  trace::start(dir.path(), trace::Level::Steps, 0);
  trace::DeviceSpan span(s);
  cuda::spin(50'000'000, s);
  span.finish(s, trace::DeviceSpanInfo{"late", "cuda", "", trace::unique_row(), "late row", 0});
  const json doc = read_json(trace::stop());  // no synchronize: stop() waits for the span
  EXPECT_EQ(named(doc, "late").size(), 1u);
  EXPECT_EQ(trace::pending_device_spans(), 0u);
}

}  // namespace
