// In-process tests of emberrun's option helpers and failure summary (launcher/config.h,
// launcher/agent.h). The end-to-end behaviour is in emberrun_test.cpp.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "launcher/agent.h"
#include "launcher/config.h"

namespace ember::launcher {
namespace {

TEST(Config, StdSpecAllRanksAndPerRank) {
  auto all = parse_std_spec("--redirects", "3", 2);
  ASSERT_EQ(all.size(), 2u);
  EXPECT_TRUE(all[1].out && all[1].err);
  auto per = parse_std_spec("--tee", "0:1,2:2", 3);
  EXPECT_TRUE(per[0].out);
  EXPECT_FALSE(per[0].err);
  EXPECT_FALSE(per[1].out || per[1].err);
  EXPECT_TRUE(per[2].err && !per[2].out);
}

TEST(Config, StdSpecErrorsNameTheOption) {
  for (const char* bad : {"4", "-1", "x", "0:1,1", "1:9", "3:1"}) {
    try {
      parse_std_spec("--tee", bad, 2);
      ADD_FAILURE() << "'" << bad << "' was accepted";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("--tee"), std::string::npos) << e.what();
    }
  }
}

TEST(Config, DefaultsAndProgramArgs) {
  unsetenv("EMBER_NPROC_PER_NODE");
  unsetenv("EMBER_MASTER_PORT");
  LaunchConfig c = parse_args({"prog", "--nproc-per-node", "7", "x"});
  EXPECT_EQ(c.nproc_per_node, 1);
  EXPECT_EQ(c.master_port, 29500);
  EXPECT_EQ(c.master_addr, "127.0.0.1");
  EXPECT_EQ(c.program, "prog");
  EXPECT_EQ(c.args, (std::vector<std::string>{"--nproc-per-node", "7", "x"}));
  c = parse_args({"--nproc_per_node=4", "--", "-dash-prog"});
  EXPECT_EQ(c.nproc_per_node, 4);
  EXPECT_EQ(c.program, "-dash-prog");
  c = parse_args({"--nnodes", "1:1", "prog"});
  EXPECT_EQ(c.world_size(), 1);
}

TEST(Config, EnvironmentIsTheFallback) {
  setenv("EMBER_NPROC_PER_NODE", "3", 1);
  setenv("EMBER_MASTER_PORT", "1234", 1);
  LaunchConfig c = parse_args({"--master-port", "4321", "prog"});
  EXPECT_EQ(c.nproc_per_node, 3);
  EXPECT_EQ(c.master_port, 4321);
  unsetenv("EMBER_NPROC_PER_NODE");
  unsetenv("EMBER_MASTER_PORT");
}

TEST(Config, MultiNodeOptions) {
  unsetenv("EMBER_RDZV_TIMEOUT");
  LaunchConfig c = parse_args({"--nnodes", "2", "--rdzv-endpoint", "node0", "prog"});
  EXPECT_TRUE(c.multi_node());
  EXPECT_FALSE(c.node_rank_given);
  EXPECT_EQ(c.rdzv_host_port(), (std::pair<std::string, int>{"node0", 29400}));
  EXPECT_EQ(c.rdzv_timeout_s, 900.0);
  c = parse_args({"--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.2.3",
                  "--master-port", "1234", "--join-timeout", "5", "prog"});
  EXPECT_TRUE(c.node_rank_given);
  EXPECT_EQ(c.node_rank, 1);
  EXPECT_EQ(c.rdzv_timeout_s, 5.0);
  EXPECT_EQ(c.rdzv_host_port(), (std::pair<std::string, int>{"10.1.2.3", 1234}));
  c = parse_args({"--nnodes", "2:4", "--rdzv-endpoint", "[::1]:7", "prog"});
  EXPECT_EQ(c.min_nodes, 2);
  EXPECT_EQ(c.max_nodes, 4);
  EXPECT_EQ(c.rdzv_host_port(), (std::pair<std::string, int>{"::1", 7}));
  setenv("EMBER_RDZV_TIMEOUT", "7.5", 1);
  EXPECT_EQ(parse_args({"--nnodes", "2", "prog"}).rdzv_timeout_s, 7.5);
  unsetenv("EMBER_RDZV_TIMEOUT");
  // One node: nothing of the rendezvous is used; --node-rank 0 stays the single-node default.
  c = parse_args({"--node-rank", "0", "prog"});
  EXPECT_FALSE(c.multi_node());
}

TEST(Config, SplitHostPort) {
  EXPECT_EQ(split_host_port("--x", "h", 1), (std::pair<std::string, int>{"h", 1}));
  EXPECT_EQ(split_host_port("--x", "h:80", 1), (std::pair<std::string, int>{"h", 80}));
  EXPECT_EQ(split_host_port("--x", "[fe80::1]", 1), (std::pair<std::string, int>{"fe80::1", 1}));
  EXPECT_EQ(split_host_port("--x", "fe80::1", 1), (std::pair<std::string, int>{"fe80::1", 1}));
  for (const char* bad : {"", ":80", "h:0", "h:x", "[::1", "[::1]x"}) {
    try {
      split_host_port("--x", bad, 1);
      ADD_FAILURE() << "'" << bad << "' was accepted";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("--x"), std::string::npos) << e.what();
    }
  }
}

TEST(Config, HelpListsTheOptions) {
  try {
    parse_args({"--help"});
    ADD_FAILURE() << "--help did not throw HelpRequested";
  } catch (const HelpRequested& h) {
    std::string text = h.what();
    for (const char* opt : {"--nproc-per-node", "--max-restarts", "--log-dir", "--standalone",
                            "--rdzv-endpoint", "--rdzv-timeout", "--join-timeout"})
      EXPECT_NE(text.find(opt), std::string::npos) << opt << " missing from:\n" << text;
  }
}

TEST(ErrorFile, ReadsEmberAndTorchLayouts) {
  std::string dir = (std::filesystem::temp_directory_path() / "emberrun_cfg_XXXXXX").string();
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  std::string m, w;
  EXPECT_FALSE(read_error_file(dir + "/missing.json", &m, &w));
  std::ofstream(dir + "/ember.json") << R"({"message": "boom", "where": "a.cpp:3"})";
  ASSERT_TRUE(read_error_file(dir + "/ember.json", &m, &w));
  EXPECT_EQ(m, "boom");
  EXPECT_EQ(w, "a.cpp:3");
  std::ofstream(dir + "/torch.json")
      << R"({"message": {"message": "RuntimeError: x", "extraInfo": {"py_callstack": "tb", "timestamp": "1"}}})";
  m.clear();
  w.clear();
  ASSERT_TRUE(read_error_file(dir + "/torch.json", &m, &w));
  EXPECT_EQ(m, "RuntimeError: x");
  EXPECT_EQ(w, "tb");
  std::ofstream(dir + "/bad.json") << "{not json";
  EXPECT_FALSE(read_error_file(dir + "/bad.json", &m, &w));
  std::filesystem::remove_all(dir);
}

TEST(ErrorFile, SummaryNamesRankCodeSignalAndTail) {
  WorkerFailure a;
  a.rank = 3;
  a.local_rank = 1;
  a.pid = 42;
  a.signal = 9;
  a.log_tail = {"last words"};
  WorkerFailure b;
  b.rank = 0;
  b.local_rank = 0;
  b.exit_code = 2;
  b.error_message = "oops";
  std::string s = format_failure_summary("prog", {a, b});
  for (const char* want : {"prog FAILED", "rank       : 3 (local_rank: 1)", "SIGKILL",
                           "    last words", "Other failures", "exitcode   : 2", "error      : oops"})
    EXPECT_NE(s.find(want), std::string::npos) << want << " missing from:\n" << s;
}

}  // namespace
}  // namespace ember::launcher
