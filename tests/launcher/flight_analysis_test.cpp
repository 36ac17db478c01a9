// The flight recorder's analysis (launcher/flight_analysis.h) and its program,
// ember_flight_analyze, on dumps written here by hand: each kind of divergence is named with its
// rank, collective and sequence number; agreeing ranks (also with rings that wrapped at
// different points) give none; bad dumps are refused naming the file. The dumps the recorder
// itself writes are analysed in tests/distributed/flight_recorder_test.cpp.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <ember/launcher/flight_analysis.h>
#include "cmake/build_paths.h"
#include "tests/examples/example_test_util.h"
#include "tests/temp_dir.h"

namespace ember::launcher {
namespace {

using nlohmann::json;
using Kind = FlightFinding::Kind;

json entry(uint64_t seq, const std::string& op, int64_t n, const std::string& state = "completed") {
  return {{"seq", seq},         {"op", op},   {"sizes", {{n}}}, {"dtypes", {"float32"}},
          {"state", state}, {"enqueued_us", 1}, {"completed_us", state == "completed" ? 2 : 0}};
}

json dump(int rank, const std::vector<int>& ranks, const json& entries) {
  return {{"format", "ember-flight-recorder"},
          {"version", 1},
          {"rank", rank},
          {"pid", 1},
          {"reason", "test"},
          {"dumped_us", 3},
          {"groups",
           {{{"name", "ranks " + json(ranks).dump() + " #0"},
             {"backend", "gloo"},
             {"rank", rank},
             {"size", static_cast<int>(ranks.size())},
             {"global_ranks", ranks},
             {"entries", entries}}}}};
}

void write(const test::TempDir& dir, int rank, const std::string& text) {
  std::ofstream(dir.file("flight_rank" + std::to_string(rank) + ".json")) << text;
}
void write(const test::TempDir& dir, int rank, const json& doc) { write(dir, rank, doc.dump()); }

// A DDP-like pattern: a bucket all-reduce (10 floats), then the loss (1 float), per step.
json steps(uint64_t from, uint64_t to) {
  json e = json::array();
  for (uint64_t s = from; s < to; ++s) e.push_back(entry(s, "allreduce", s % 2 == 0 ? 10 : 1));
  return e;
}

struct ProgramRun {
  int rc;
  std::string out;
};

// ember_flight_analyze as a user runs it; stdout and stderr together.
ProgramRun analyze_program(const std::string& dir) {
  const test::CommandResult r = test::run_command(
      EMBER_BINARY_DIR + "/launcher/ember_flight_analyze '" + dir + "'", 60);
  return {r.status, r.output};
}

TEST(FlightAnalysis, AgreeingRanksGiveNoFindingEvenWhenTheirRingsWrappedApart) {
  test::TempDir dir("flight_analysis");
  write(dir, 0, dump(0, {0, 1}, steps(5, 12)));  // its ring lost #0..#4
  write(dir, 1, dump(1, {0, 1}, steps(2, 12)));
  const FlightReport r = analyze_flight_dumps(dir.path());
  EXPECT_EQ(r.files.size(), 2u);
  EXPECT_TRUE(r.findings.empty()) << r.findings[0].message;
  const ProgramRun run = analyze_program(dir.path());
  EXPECT_EQ(run.rc, 0) << run.out;
  EXPECT_NE(run.out.find("no divergence"), std::string::npos) << run.out;
}

// Sends and receives (marked p2p, numbered apart from the collectives) are not compared across
// ranks: rank 0 sent twice and rank 1 received once, both between the same collectives.
TEST(FlightAnalysis, SendsAndReceivesAreNotComparedAcrossRanks) {
  test::TempDir dir("flight_analysis");
  auto p2p = [](uint64_t seq, const std::string& op) {
    json e = entry(seq, op, 4);
    e["p2p"] = true;
    return e;
  };
  json sender = steps(0, 4), receiver = steps(0, 4);
  sender.push_back(p2p(0, "send"));
  sender.push_back(p2p(1, "send"));
  receiver.push_back(p2p(0, "recv"));
  for (json* e : {&sender, &receiver}) {
    for (const json& x : steps(4, 6)) e->push_back(x);
  }
  write(dir, 0, dump(0, {0, 1}, sender));
  write(dir, 1, dump(1, {0, 1}, receiver));
  FlightReport r = analyze_flight_dumps(dir.path());
  EXPECT_TRUE(r.findings.empty()) << r.findings[0].message;
  // A ring that holds only sends and receives (they pushed the collectives out) says nothing of
  // where its rank stands in the collectives: it is not taken for a rank that never called them.
  json only_p2p = json::array();
  for (uint64_t i = 0; i < 6; ++i) only_p2p.push_back(p2p(i, i % 2 == 0 ? "send" : "recv"));
  write(dir, 1, dump(1, {0, 1}, only_p2p));
  r = analyze_flight_dumps(dir.path());
  EXPECT_TRUE(r.findings.empty()) << r.findings[0].message;
  // A p2p that is not true or false is a broken file.
  json bad = steps(0, 2);
  bad.push_back(entry(2, "allreduce", 1));
  bad.back()["p2p"] = "yes";
  write(dir, 1, dump(1, {0, 1}, bad));
  EXPECT_THROW(analyze_flight_dumps(dir.path()), FlightDumpError);
}

TEST(FlightAnalysis, NamesTheRankThatNeverCalledWhatTheOthersWaitIn) {
  test::TempDir dir("flight_analysis");
  json waiting = steps(0, 7);
  waiting.push_back(entry(7, "allreduce", 1, "enqueued"));
  write(dir, 0, dump(0, {0, 1, 2}, waiting));
  write(dir, 1, dump(1, {0, 1, 2}, steps(0, 7)));
  write(dir, 2, dump(2, {0, 1, 2}, waiting));
  const FlightReport r = analyze_flight_dumps(dir.path());
  ASSERT_EQ(r.findings.size(), 1u);
  const FlightFinding& f = r.findings[0];
  EXPECT_EQ(f.kind, Kind::Missing);
  EXPECT_EQ(f.seq, 7u);
  EXPECT_EQ(f.op, "allreduce");
  EXPECT_EQ(f.ranks, std::vector<int>{1});
  EXPECT_NE(f.message.find("rank 1 never called allreduce #7, allreduce(float32 [1]); ranks 0 "
                           "and 2 wait in it (enqueued)"),
            std::string::npos)
      << f.message;
  const ProgramRun run = analyze_program(dir.path());
  EXPECT_EQ(run.rc, 1) << run.out;
  EXPECT_NE(run.out.find(f.message), std::string::npos) << run.out;
}

TEST(FlightAnalysis, NamesARankThatSkippedOneAndWentOn) {
  test::TempDir dir("flight_analysis");
  write(dir, 0, dump(0, {0, 1, 2}, steps(0, 6)));
  write(dir, 2, dump(2, {0, 1, 2}, steps(0, 6)));
  json behind = steps(0, 3);  // skipped #3 (the loss): its #3 is the next bucket, and so on
  for (uint64_t s = 3; s < 5; ++s) behind.push_back(entry(s, "allreduce", s % 2 == 0 ? 1 : 10));
  write(dir, 1, dump(1, {0, 1, 2}, behind));
  const FlightReport r = analyze_flight_dumps(dir.path());
  ASSERT_EQ(r.findings.size(), 1u);
  const FlightFinding& f = r.findings[0];
  EXPECT_EQ(f.kind, Kind::Skipped);
  EXPECT_EQ(f.seq, 3u);
  EXPECT_EQ(f.ranks, std::vector<int>{1});
  EXPECT_NE(f.message.find("rank 1 skipped allreduce #3, allreduce(float32 [1]), which ranks 0 "
                           "and 2 called"),
            std::string::npos)
      << f.message;
}

TEST(FlightAnalysis, NamesASizeMismatch) {
  test::TempDir dir("flight_analysis");
  json other = steps(0, 2);
  other.push_back(entry(2, "allreduce", 12, "enqueued"));
  json same = steps(0, 2);
  same.push_back(entry(2, "allreduce", 10, "enqueued"));
  write(dir, 0, dump(0, {0, 1, 2}, same));
  write(dir, 1, dump(1, {0, 1, 2}, other));
  write(dir, 2, dump(2, {0, 1, 2}, same));
  const FlightReport r = analyze_flight_dumps(dir.path());
  ASSERT_EQ(r.findings.size(), 1u);
  const FlightFinding& f = r.findings[0];
  EXPECT_EQ(f.kind, Kind::Mismatch);
  EXPECT_EQ(f.seq, 2u);
  EXPECT_EQ(f.ranks, std::vector<int>{1});
  EXPECT_NE(f.message.find("allreduce #2 differs across ranks: ranks 0 and 2 called "
                           "allreduce(float32 [10]); rank 1 called allreduce(float32 [12])"),
            std::string::npos)
      << f.message;
  EXPECT_EQ(f.message.find("likely skipped"), std::string::npos) << f.message;
}

// The others failed at the mismatch (gloo and threads check every collective), so nothing
// after it shows the skip; rank 1's call is the loop's next collective, which they made before.
TEST(FlightAnalysis, SaysARankLikelySkippedWhenItsCallIsOneTheOthersMadeBefore) {
  test::TempDir dir("flight_analysis");
  json failed = steps(0, 3);  // #2 a bucket, then the loss at #3
  failed.push_back(entry(3, "allreduce", 1, "failed"));
  json ahead = steps(0, 3);
  ahead.push_back(entry(3, "allreduce", 10, "failed"));  // the next step's bucket
  write(dir, 0, dump(0, {0, 1, 2}, failed));
  write(dir, 1, dump(1, {0, 1, 2}, ahead));
  write(dir, 2, dump(2, {0, 1, 2}, failed));
  const FlightReport r = analyze_flight_dumps(dir.path());
  ASSERT_EQ(r.findings.size(), 1u);
  EXPECT_EQ(r.findings[0].kind, Kind::Mismatch);
  EXPECT_EQ(r.findings[0].seq, 3u);
  EXPECT_NE(r.findings[0].message.find(
                "allreduce #3 differs across ranks: ranks 0 and 2 called allreduce(float32 [1]); "
                "rank 1 called allreduce(float32 [10]) (what ranks 0 and 2 called at #2: in a "
                "loop, rank 1 likely skipped allreduce #3)"),
            std::string::npos)
      << r.findings[0].message;
}

TEST(FlightAnalysis, NamesRanksStuckInACollectiveTheOthersCompleted) {
  test::TempDir dir("flight_analysis");
  json stuck = steps(0, 3);
  stuck.push_back(entry(3, "broadcast", 4, "started"));
  json done = steps(0, 3);
  done.push_back(entry(3, "broadcast", 4));
  write(dir, 0, dump(0, {0, 1}, done));
  write(dir, 1, dump(1, {0, 1}, stuck));
  const FlightReport r = analyze_flight_dumps(dir.path());
  ASSERT_EQ(r.findings.size(), 1u);
  EXPECT_EQ(r.findings[0].kind, Kind::Stuck);
  EXPECT_EQ(r.findings[0].seq, 3u);
  EXPECT_EQ(r.findings[0].ranks, std::vector<int>{1});
  EXPECT_NE(r.findings[0].message.find("rank 1 is stuck in broadcast #3"), std::string::npos)
      << r.findings[0].message;
}

// The ranks that dumped all wait in a collective and one rank left no dump: it is not "every
// rank" that is stuck, and the one without a dump is the likely culprit.
TEST(FlightAnalysis, StuckRanksBesideARankWithoutADumpNameThatRank) {
  test::TempDir dir("flight_analysis");
  json waiting = steps(0, 5);
  waiting.push_back(entry(5, "allreduce", 1, "started"));
  write(dir, 0, dump(0, {0, 1, 2}, waiting));
  write(dir, 2, dump(2, {0, 1, 2}, waiting));
  const FlightReport r = analyze_flight_dumps(dir.path());
  ASSERT_EQ(r.findings.size(), 2u);
  EXPECT_EQ(r.findings[0].kind, Kind::Stuck);
  EXPECT_EQ(r.findings[0].message.find("every rank"), std::string::npos) << r.findings[0].message;
  EXPECT_NE(r.findings[0].message.find("rank 1 left no dump"), std::string::npos)
      << r.findings[0].message;
  EXPECT_EQ(r.findings[1].kind, Kind::NoDump);
  // With every rank's dump, "on every rank" it is.
  write(dir, 1, dump(1, {0, 1, 2}, waiting));
  const FlightReport all = analyze_flight_dumps(dir.path());
  ASSERT_EQ(all.findings.size(), 1u);
  EXPECT_NE(all.findings[0].message.find("on every rank"), std::string::npos)
      << all.findings[0].message;
}

TEST(FlightAnalysis, NamesAFailedCollectiveAndAMemberWithoutADump) {
  test::TempDir dir("flight_analysis");
  json failed = steps(0, 2);
  json e = entry(2, "allreduce", 10, "failed");
  e["error"] = "[gloo] allreduce #2 on rank 0 of 3: connection reset by rank 2";
  failed.push_back(e);
  write(dir, 0, dump(0, {0, 1, 2}, failed));
  write(dir, 1, dump(1, {0, 1, 2}, failed));
  const FlightReport r = analyze_flight_dumps(dir.path());
  ASSERT_EQ(r.findings.size(), 2u);
  EXPECT_EQ(r.findings[0].kind, Kind::Failed);
  EXPECT_NE(r.findings[0].message.find("connection reset by rank 2"), std::string::npos);
  EXPECT_EQ(r.findings[1].kind, Kind::NoDump);
  EXPECT_EQ(r.findings[1].ranks, std::vector<int>{2});
}

// Each bad input is refused by the analysis naming the file (or folder), and by the program
// with exit status 2.
TEST(FlightAnalysis, RefusesBadDumpsByName) {
  struct Case {
    const char* what;
    std::string text;
    const char* expect;
  };
  json no_entries = dump(1, {0, 1}, steps(0, 2));
  no_entries["groups"][0].erase("entries");
  json bad_state = dump(1, {0, 1}, json::array({entry(0, "allreduce", 1, "lost")}));
  const std::vector<Case> cases = {
      {"not JSON", "{\"format\": ", "flight_rank1.json: is not JSON"},
      {"another file", "{\"traceEvents\": []}", "flight_rank1.json: is not a flight recorder dump"},
      {"no entries", no_entries.dump(), "flight_rank1.json: group \"ranks [0,1] #0\" has no "
                                        "\"entries\""},
      {"another rank", dump(0, {0, 1}, steps(0, 2)).dump(),
       "flight_rank1.json: holds rank 0, not the rank its name says"},
      {"bad state", bad_state.dump(), "has an unknown state \"lost\""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    test::TempDir dir("flight_analysis");
    write(dir, 0, dump(0, {0, 1}, steps(0, 2)));
    write(dir, 1, c.text);
    try {
      analyze_flight_dumps(dir.path());
      ADD_FAILURE() << "accepted";
    } catch (const FlightDumpError& e) {
      EXPECT_NE(std::string(e.what()).find(c.expect), std::string::npos) << e.what();
    }
    const ProgramRun run = analyze_program(dir.path());
    EXPECT_EQ(run.rc, 2) << run.out;
    EXPECT_NE(run.out.find(c.expect), std::string::npos) << run.out;
  }
  test::TempDir empty("flight_analysis");
  EXPECT_THROW(analyze_flight_dumps(empty.path()), FlightDumpError);
  ProgramRun run = analyze_program(empty.path());
  EXPECT_EQ(run.rc, 2);
  EXPECT_NE(run.out.find("no flight_rank<R>.json dumps"), std::string::npos) << run.out;
  run = analyze_program(empty.file("missing"));
  EXPECT_EQ(run.rc, 2);
  EXPECT_NE(run.out.find("missing: not a folder"), std::string::npos) << run.out;
}

// emberrun --log-dir D gives its workers EMBER_FLIGHT_RECORDER_DIR=D/<run
// id>_XXXXXX/attempt_<k>/flight: a job whose rank 1 issues a barrier where rank 0 all-reduces
// fails, the ranks dump there, and the program names rank 1's barrier against rank 0's all-reduce.
// A rank dumps only if its own failure comes before emberrun, seeing the other's, stops it
// (SIGTERM); a lone dump then names the other rank's position from its own rank's error.
TEST(FlightAnalysis, EmberrunKeepsTheDumpsWithTheLogs) {
  const std::string worker = EMBER_BINARY_DIR + "/launcher/test_workers/dist_worker";
  if (!std::filesystem::exists(worker)) {
    GTEST_SKIP() << worker << " not built (no ember_distributed)";
  }
  test::TempDir dir("flight_emberrun");
  const std::string cmd = "env -u EMBER_FLIGHT_RECORDER_DIR DIST_WORKER_BARRIER_ON_RANK=1 "
                          "EMBER_PG_TIMEOUT=30 '" + EMBER_BINARY_DIR +
                          "/launcher/emberrun' --standalone --nproc-per-node 2 --log-dir '" +
                          dir.path() + "/logs' '" + worker + "' '" + dir.path() + "' > '" +
                          dir.path() + "/emberrun.out' 2>&1";
  const int status = std::system(cmd.c_str());
  std::ifstream log(dir.file("emberrun.out"));
  const std::string out((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_NE(WEXITSTATUS(status), 0) << "the job must fail:\n" << out;
  // The one run folder, logs/none_XXXXXX (docs/launcher.md, Output).
  std::string run_folder;
  for (const auto& e : std::filesystem::directory_iterator(dir.file("logs"))) {
    ASSERT_TRUE(run_folder.empty()) << "two run folders under logs/:\n" << out;
    run_folder = e.path().string();
  }
  ASSERT_EQ(std::filesystem::path(run_folder).filename().string().rfind("none_", 0), 0u) << out;
  const std::string flight = run_folder + "/attempt_0/flight";
  const bool dumped0 = std::filesystem::exists(flight + "/flight_rank0.json");
  const bool dumped1 = std::filesystem::exists(flight + "/flight_rank1.json");
  ASSERT_TRUE(dumped0 || dumped1) << out;
  const ProgramRun run = analyze_program(flight);
  EXPECT_EQ(run.rc, 1) << run.out << "\nemberrun:\n" << out;
  if (dumped0 && dumped1) {
    EXPECT_NE(run.out.find("allreduce #0 differs across ranks: rank 0 called allreduce(float32 "
                           "[1]); rank 1 called barrier()"),
              std::string::npos)
        << run.out << "\nemberrun:\n" << out;
  } else {
    EXPECT_NE(run.out.find(dumped0 ? "rank 1 left no dump" : "rank 0 left no dump"),
              std::string::npos)
        << run.out;
    // The lone rank's error names the other's collective: from the other's position record, or
    // (over shared memory) from what the other rank passed into the segment.
    const bool named =
        dumped0 ? run.out.find("rank 1 was at barrier #0 when it failed") != std::string::npos ||
                      run.out.find("but rank 1 passed barrier") != std::string::npos
                : run.out.find("rank 0 was at allreduce #0 when it failed") != std::string::npos ||
                      run.out.find("but rank 0 passed allreduce") != std::string::npos;
    EXPECT_TRUE(named) << run.out << "\nemberrun:\n" << out;
  }
}

}  // namespace
}  // namespace ember::launcher
