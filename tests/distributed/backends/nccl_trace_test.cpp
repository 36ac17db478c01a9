// NCCL collectives on the timeline: measured on the group's stream (tensor/gpu/trace_device.h), on
// a row of their own, with the same name, category and args as gloo's and MPI's (seq, bytes,
// queued_us, backend "nccl"). Skips, saying why, without NCCL or a CUDA device.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include <ember/distributed/backends/process_group_nccl.h>
#include <ember/distributed/store/hash_store.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/ops.h>
#include <ember/tensor/observe/trace.h>

namespace ember::dist {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

TEST(NcclTrace, CollectivesAreDeviceSpansOnTheStreamsRow) {
  if (!nccl_available()) GTEST_SKIP() << "built without nccl (EMBER_WITH_NCCL=OFF)";
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  std::string dir = (fs::temp_directory_path() / "ember_nccl_trace_test_XXXXXX").string();
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  ProcessGroupNccl::NcclOptions o;
  o.device = 0;
  auto pg = std::make_shared<ProcessGroupNccl>(std::make_shared<HashStore>(), 0, 1, o);
  trace::start(dir, trace::Level::Steps, 0);
  const TensorOptions on_gpu = TensorOptions(kFloat32).device(cuda_device(0));
  Tensor a = full({1000}, 1.0, on_gpu);
  pg->allreduce(a)->wait();
  Tensor b = full({10}, 2.0, on_gpu);
  pg->broadcast(b)->wait();
  pg->barrier()->wait();
  std::ifstream f(trace::stop());
  ASSERT_TRUE(f) << "no trace file";
  const json doc = json::parse(f);
  std::map<std::string, json> spans;
  int stream_row = -1;
  for (const json& e : doc["traceEvents"]) {
    if (e.value("cat", "") == "collective") spans[e["name"]] = e;
    if (e["name"] == "thread_name" &&
        e["args"]["name"].get<std::string>().rfind("nccl stream, cuda:0", 0) == 0) {
      stream_row = e["tid"];
    }
  }
  EXPECT_GE(stream_row, 2000) << "the group's stream has a named row";
  const std::map<std::string, int64_t> bytes = {{"allreduce", 4000}, {"broadcast", 40},
                                                {"barrier", 0}};
  int64_t last_seq = -1;
  for (const auto& [op, n] : bytes) {
    ASSERT_TRUE(spans.count(op)) << "no '" << op << "' span";
    const json& e = spans[op];
    EXPECT_EQ(e["tid"], stream_row) << op;
    EXPECT_EQ(e["args"]["backend"], "nccl") << op;
    EXPECT_EQ(e["args"]["bytes"], n) << op;
    EXPECT_GE(e["args"]["queued_us"].get<int64_t>(), 0) << op;
    EXPECT_GE(e["dur"].get<int64_t>(), 0) << op;
    EXPECT_NE(e["args"]["seq"].get<int64_t>(), last_seq) << op;
    last_seq = e["args"]["seq"];
  }
  pg.reset();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace ember::dist
