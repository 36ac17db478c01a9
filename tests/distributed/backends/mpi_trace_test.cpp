// MPI collectives on the timeline (tensor/observe/trace.h): a real two-rank job under mpirun
// records, on each rank, one span per collective named by its op (category "collective") with the
// group's sequence number, the bytes of its result, the time it was queued and backend "mpi",
// as gloo's are; send and receive span until MPI reports them complete. The group's own
// housekeeping (releasing its communicator) is not on the timeline.
//
// The outer case (run by ctest) starts `mpirun -np 2` on this binary with the MpiTraceRanks.*
// cases, which trace into the folder it names in EMBER_TEST_TRACE_DIR (mpirun passes its
// environment to the ranks it starts on this machine), then reads the two files.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include <ember/distributed/backends/process_group_mpi.h>
#include <ember/tensor/ops.h>
#include <ember/tensor/observe/trace.h>
#include "tests/distributed/backends/mpi_job.h"
#include "tests/examples/example_test_util.h"

namespace ember::dist {
namespace {

using namespace std::chrono_literals;
using nlohmann::json;

constexpr const char* kDirVariable = "EMBER_TEST_TRACE_DIR";

// ---- run by every rank under mpirun -----------------------------------------------------------

TEST(MpiTraceRanks, CollectivesAreTraced) {
  SKIP_UNLESS_UNDER_MPIRUN();
  const char* dir = std::getenv(kDirVariable);
  ASSERT_NE(dir, nullptr) << kDirVariable << " did not reach the rank through mpirun";
  auto g = ProcessGroupMpi::create();
  ASSERT_EQ(g->size(), 2);
  trace::start(dir, trace::Level::Steps, g->rank());
  Tensor a = full({1000}, 1.0, kFloat32);
  ASSERT_TRUE(g->allreduce(a)->wait(60s));
  Tensor b = full({10}, g->rank() == 0 ? 7.0 : 0.0, kInt64);
  ASSERT_TRUE(g->broadcast(b)->wait(60s));
  Tensor p = full({6}, 3.0, kFloat64);
  ASSERT_TRUE((g->rank() == 0 ? g->send(p, 1) : g->recv(p, 0))->wait(60s));
  ASSERT_TRUE(g->barrier()->wait(60s));
  g.reset();  // releases the communicator: not a collective, not traced
  const std::string file = trace::stop();
  EXPECT_EQ(a.to_vector<float>()[0], 2.0f);
  EXPECT_EQ(b.to_vector<int64_t>()[0], 7);
  EXPECT_NE(file, "");
}

// ---- run by ctest -------------------------------------------------------------------------------

/// The collective spans of a rank's file, by name.
std::map<std::string, std::vector<json>> collective_spans(const std::string& path) {
  std::ifstream f(path);
  EXPECT_TRUE(f) << "no trace file " << path;
  std::map<std::string, std::vector<json>> out;
  if (!f) return out;
  const json doc = json::parse(f);
  for (const json& e : doc["traceEvents"])
    if (e.value("cat", "") == "collective") out[e["name"]].push_back(e);
  return out;
}

void expect_span(const std::map<std::string, std::vector<json>>& spans, const std::string& op,
                 int64_t bytes, int rank) {
  auto it = spans.find(op);
  ASSERT_NE(it, spans.end()) << "rank " << rank << ": no '" << op << "' span";
  ASSERT_EQ(it->second.size(), 1u) << "rank " << rank << ": " << op;
  const json& e = it->second[0];
  EXPECT_EQ(e["ph"], "X") << op;
  EXPECT_EQ(e["pid"], rank) << op;
  EXPECT_GE(e["dur"].get<int64_t>(), 0) << op;
  EXPECT_EQ(e["args"]["backend"], "mpi") << op;
  EXPECT_EQ(e["args"]["bytes"], bytes) << op;
  EXPECT_GE(e["args"]["queued_us"].get<int64_t>(), 0) << op;
  EXPECT_GE(e["args"]["seq"].get<int64_t>(), 0) << op;
}

TEST(MpiTrace, TwoRankJobRecordsEveryCollective) {
  if (!ProcessGroupMpi::is_available()) GTEST_SKIP() << "built without MPI (EMBER_WITH_MPI=OFF)";
  ember::test::TempDir dir("mpi_trace_test");
  ::setenv(kDirVariable, dir.path().c_str(), 1);
  test::expect_mpi_job_passes(2, "MpiTraceRanks.*", std::chrono::seconds(120), true);
  ::unsetenv(kDirVariable);
  if (HasFatalFailure() || IsSkipped()) return;
  std::vector<int64_t> seqs[2];
  for (int rank : {0, 1}) {
    const auto spans =
        collective_spans(dir.path() + "/trace_rank" + std::to_string(rank) + ".json");
    expect_span(spans, "allreduce", 1000 * 4, rank);
    expect_span(spans, "broadcast", 10 * 8, rank);
    expect_span(spans, rank == 0 ? "send" : "recv", 6 * 8, rank);
    expect_span(spans, "barrier", 0, rank);
    EXPECT_EQ(spans.size(), 4u) << "rank " << rank << ": only the four operations are traced";
    for (const char* op : {"allreduce", "broadcast", "barrier"})
      if (spans.count(op)) seqs[rank].push_back(spans.at(op)[0]["args"]["seq"]);
  }
  EXPECT_EQ(seqs[0], seqs[1]) << "both ranks number their collectives alike";
  ASSERT_EQ(seqs[0].size(), 3u);
  EXPECT_LT(seqs[0][0], seqs[0][1]);
  EXPECT_LT(seqs[0][1], seqs[0][2]);
}

}  // namespace
}  // namespace ember::dist
