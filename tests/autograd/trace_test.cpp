// The backward engine on the timeline (tensor/observe/trace.h): one "backward" span per pass, and
// at EMBER_TRACE_LEVEL=ops one span per node inside it.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include <ember/autograd/autograd.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops.h>
#include <ember/tensor/observe/trace.h>

namespace {

namespace fs = std::filesystem;
using namespace ember;

nlohmann::json traced_backward(trace::Level level) {
  std::string dir = (fs::temp_directory_path() / "ember_autograd_trace_XXXXXX").string();
  EXPECT_NE(mkdtemp(dir.data()), nullptr);
  Tensor x = ones({4}).requires_grad_();
  trace::start(dir, level, 0);
  Tensor y = (x * x).sum();
  y.backward();
  std::ifstream f(trace::stop());
  nlohmann::json doc = nlohmann::json::parse(f);
  fs::remove_all(dir);
  return doc;
}

TEST(AutogradTrace, BackwardIsOneSpanAndNodesNestInsideItAtTheOpsLevel) {
  nlohmann::json doc = traced_backward(trace::Level::Ops);
  int64_t b0 = -1, b1 = -1, backward_spans = 0, node_spans = 0;
  for (const auto& e : doc["traceEvents"]) {
    if (e["name"] == "backward") {
      ++backward_spans;
      b0 = e["ts"];
      b1 = b0 + e["dur"].get<int64_t>();
    }
  }
  ASSERT_EQ(backward_spans, 1);
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] != "X" || e["cat"] != "autograd" || e["name"] == "backward") continue;
    ++node_spans;
    EXPECT_GE(e["ts"].get<int64_t>(), b0) << e.dump();
    EXPECT_LE(e["ts"].get<int64_t>() + e["dur"].get<int64_t>(), b1) << e.dump();
  }
  EXPECT_GE(node_spans, 3);  // sum, mul, the accumulator

  doc = traced_backward(trace::Level::Steps);
  node_spans = 0;
  for (const auto& e : doc["traceEvents"])
    if (e["ph"] == "X" && e["cat"] == "autograd" && e["name"] != "backward") ++node_spans;
  EXPECT_EQ(node_spans, 0);
}

}  // namespace
