// emberrun's merge of the ranks' timelines (launcher/trace_merge.h) on files written here in the
// recorder's layout: the merged file holds every rank's events, names the recorder does not
// write are left out instead of read as another rank's or thrown on, and no temp file stays.
#include <ember/launcher/trace_merge.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/temp_dir.h"

namespace ember::launcher {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// One rank's file as tensor/observe/trace.cpp writes it: a header line, one event per line.
void write_rank(const test::TempDir& dir, const std::string& file, int rank) {
  std::ofstream(dir.file(file)) << "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"rank\":" << rank
                                << "},\"traceEvents\":[\n"
                                << "{\"ph\":\"X\",\"pid\":" << rank
                                << ",\"tid\":1,\"ts\":5,\"dur\":2,\"name\":\"step\","
                                << "\"cat\":\"user\",\"args\":{}}\n]}\n";
}

TEST(TraceMerge, MergesTheRanksAndSkipsNamesTheRecorderDoesNotWrite) {
  test::TempDir dir("trace_merge");
  write_rank(dir, "trace_rank0.json", 0);
  write_rank(dir, "trace_rank1.json", 1);
  // Not the recorder's: a leading zero (read as rank 7, whose file is absent, it failed the
  // merge), and a number past int's range (std::stoi threw out of emberrun).
  write_rank(dir, "trace_rank07.json", 7);
  write_rank(dir, "trace_rank99999999999.json", 9);
  const auto listed = list_rank_traces(dir.path());
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed.begin()->first, 0);
  EXPECT_EQ(listed.rbegin()->first, 1);
  EXPECT_EQ(merge_rank_traces(dir.path()), 2);
  std::ifstream in(dir.file("trace.json"));
  const json doc = json::parse(in);
  EXPECT_EQ(doc["otherData"]["ranks"].size(), 2u);
  EXPECT_EQ(doc["traceEvents"].size(), 2u);
  for (const auto& e : fs::directory_iterator(dir.path())) {
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos)
        << "a temp file stayed: " << e.path();
  }
  EXPECT_EQ(fs::status(dir.file("trace.json")).permissions() & fs::perms::others_read,
            fs::perms::others_read);
}

TEST(TraceMerge, ABadRankFileIsNamedAndLeavesNoTempFile) {
  test::TempDir dir("trace_merge");
  write_rank(dir, "trace_rank0.json", 0);
  std::ofstream(dir.file("trace_rank1.json")) << "{\"otherData\":{},\"traceEvents\":[\n";
  try {
    merge_rank_traces(dir.path());
    ADD_FAILURE() << "a file without its closing ]} must be refused";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("trace_rank1.json"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir.file("trace.json")));
  for (const auto& e : fs::directory_iterator(dir.path())) {
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
  }
}

}  // namespace
}  // namespace ember::launcher
