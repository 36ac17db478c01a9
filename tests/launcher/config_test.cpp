// In-process tests of emberrun's option helpers, the rendezvous registry they check
// --rdzv-backend against, and the failure summary (launcher/config.h, rendezvous_backend.h,
// worker_failure.h). The end-to-end behaviour is in emberrun_test.cpp.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <ember/launcher/config.h>
#include <ember/launcher/rendezvous_backend.h>
#include <ember/launcher/worker_failure.h>

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
                            "--rdzv-endpoint", "--rdzv-timeout", "--join-timeout", "--rdzv-conf",
                            "--role", "--no-python", "--start-method", "PET_"})
      EXPECT_NE(text.find(opt), std::string::npos) << opt << " missing from:\n" << text;
  }
}

// The message of the UsageError that parse_args(args) throws ("" when it accepts them).
std::string usage_error(const std::vector<std::string>& args) {
  try {
    parse_args(args);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

// --rdzv-backend takes the names the rendezvous registry holds (launcher/rendezvous_backend.cpp):
// an unknown one is refused naming them all, --help describes them, and --rdzv-endpoint's port
// defaults to the backend's.
TEST(Config, RendezvousBackendsComeFromTheRegistry) {
  unsetenv("EMBER_RDZV_BACKEND");
  unsetenv("EMBER_RDZV_ENDPOINT");
  EXPECT_EQ(rendezvous_backend_names(), "static, c10d or etcd");
  ASSERT_NE(find_rendezvous_backend("c10d"), nullptr);
  EXPECT_EQ(find_rendezvous_backend("static"), find_rendezvous_backend("c10d"));
  EXPECT_EQ(find_rendezvous_backend("zookeeper"), nullptr);
  EXPECT_EQ(usage_error({"--nnodes", "2", "--rdzv-backend", "zookeeper", "prog"}),
            "--rdzv-backend: expected static, c10d or etcd, got 'zookeeper'");
  const std::pair<const char*, int> ports[] = {{"static", 29400}, {"c10d", 29400}, {"etcd", 2379}};
  for (const auto& [name, port] : ports) {
    const LaunchConfig c = parse_args(
        {"--nnodes", "2", "--rdzv-backend", name, "--rdzv-endpoint", "node0", "prog"});
    EXPECT_EQ(c.rdzv_host_port(), (std::pair<std::string, int>{"node0", port})) << name;
  }
  try {
    parse_args({"--help"});
    ADD_FAILURE() << "--help did not throw HelpRequested";
  } catch (const HelpRequested& h) {
    EXPECT_NE(std::string(h.what()).find("Rendezvous backend: static or c10d (node 0's agent hosts "
                                         "the store), or etcd (an etcd server at --rdzv-endpoint"),
              std::string::npos)
        << h.what();
  }
}

TEST(Config, RdzvConfMapsOntoTheRendezvousOptions) {
  unsetenv("EMBER_RDZV_TIMEOUT");
  unsetenv("EMBER_RDZV_CONF");
  LaunchConfig c =
      parse_args({"--rdzv-conf", "join_timeout=12,last_call_timeout=3,read_timeout=4.5", "prog"});
  EXPECT_EQ(c.rdzv_timeout_s, 12.0);
  EXPECT_EQ(c.last_call_s, 3.0);
  EXPECT_EQ(c.rdzv_read_timeout_s, 4.5);
  c = parse_args({"--rdzv_conf=timeout=8", "prog"});
  EXPECT_EQ(c.rdzv_timeout_s, 8.0);
  EXPECT_EQ(c.last_call_s, 30.0);
  EXPECT_EQ(c.rdzv_read_timeout_s, 10.0);
  // The same value twice is no conflict; the command line beats EMBER_RDZV_TIMEOUT.
  EXPECT_EQ(parse_args({"--rdzv-timeout", "5", "--rdzv-conf", "timeout=5", "prog"}).rdzv_timeout_s,
            5.0);
  setenv("EMBER_RDZV_TIMEOUT", "7", 1);
  EXPECT_EQ(parse_args({"--rdzv-conf", "join_timeout=2", "prog"}).rdzv_timeout_s, 2.0);
  unsetenv("EMBER_RDZV_TIMEOUT");
  // An option on the command line beats a key from the environment.
  setenv("PET_RDZV_CONF", "join_timeout=2", 1);
  EXPECT_EQ(parse_args({"--rdzv-timeout", "9", "prog"}).rdzv_timeout_s, 9.0);
  EXPECT_EQ(parse_args({"prog"}).rdzv_timeout_s, 2.0);
  unsetenv("PET_RDZV_CONF");
}

TEST(Config, RdzvConfErrorsQuoteTheKeyOrPair) {
  EXPECT_EQ(usage_error({"--rdzv-conf", "join_timeout=1,foo=2", "prog"}),
            "--rdzv-conf: unknown key 'foo' (known: join_timeout, last_call_timeout, timeout, "
            "read_timeout, protocol, cacert, cert, key, user, password_file)");
  for (const char* bad : {"join_timeout", "=3", "timeout=", "a=1=2,b"}) {
    std::string e = usage_error({"--rdzv-conf", bad, "prog"});
    EXPECT_NE(e.find("--rdzv-conf"), std::string::npos) << bad << ": " << e;
  }
  EXPECT_NE(
      usage_error({"--rdzv-conf", "join_timeout", "prog"}).find("malformed pair 'join_timeout'"),
      std::string::npos);
  EXPECT_NE(usage_error({"--rdzv-conf", "read_timeout=soon", "prog"}).find("'soon'"),
            std::string::npos);
  EXPECT_NE(usage_error({"--rdzv-conf", "timeout=0", "prog"}).find("timeout"), std::string::npos);
  EXPECT_NE(usage_error({"--rdzv-timeout", "5", "--rdzv-conf", "join_timeout=7", "prog"})
                .find("join_timeout=7 contradicts --rdzv-timeout 5"),
            std::string::npos);
  EXPECT_NE(usage_error({"--rdzv-conf", "timeout=1,join_timeout=2", "prog"})
                .find("both set the join timeout"),
            std::string::npos);
}

TEST(Config, HeartbeatOptions) {
  unsetenv("EMBER_HEARTBEAT_TIMEOUT");
  unsetenv("EMBER_HEARTBEAT_INTERVAL");
  LaunchConfig c = parse_args({"--nnodes", "2", "prog"});
  EXPECT_EQ(c.heartbeat_timeout_s, 25.0);
  EXPECT_EQ(c.heartbeat_interval_s, 5.0);
  // A short timeout alone brings the interval down with it: three beats per timeout.
  c = parse_args({"--heartbeat-timeout", "3", "prog"});
  EXPECT_EQ(c.heartbeat_timeout_s, 3.0);
  EXPECT_EQ(c.heartbeat_interval_s, 1.0);
  c = parse_args({"--heartbeat_timeout=60", "--heartbeat-interval", "10", "prog"});
  EXPECT_EQ(c.heartbeat_timeout_s, 60.0);
  EXPECT_EQ(c.heartbeat_interval_s, 10.0);
  setenv("EMBER_HEARTBEAT_TIMEOUT", "4", 1);
  EXPECT_EQ(parse_args({"prog"}).heartbeat_timeout_s, 4.0);
  unsetenv("EMBER_HEARTBEAT_TIMEOUT");
  EXPECT_EQ(usage_error({"--heartbeat-timeout", "0", "prog"}),
            "--heartbeat-timeout: expected seconds in (0, 1e6], got 0");
  EXPECT_EQ(usage_error({"--heartbeat-timeout", "3", "--heartbeat-interval", "3", "prog"}),
            "--heartbeat-interval: expected seconds in (0, --heartbeat-timeout 3), got 3");
  EXPECT_NE(usage_error({"--heartbeat-interval", "-1", "prog"}).find("--heartbeat-interval"),
            std::string::npos);
}

// Out-of-range numbers are named with the option, the range and the value as given, in a short
// line: no 309-digit DBL_MAX, no bare "Could not convert" for an integer past int.
TEST(Config, OutOfRangeNumbersAreShortAndNamed) {
  EXPECT_EQ(usage_error({"--grace-period", "1e308", "prog"}),
            "--grace-period: expected seconds in [0, 3600], got 1e+308");
  EXPECT_EQ(usage_error({"--monitor-interval", "1e300", "prog"}),
            "--monitor-interval: expected seconds in (0, 3600], got 1e+300");
  EXPECT_EQ(usage_error({"--rdzv-timeout", "1e308", "prog"}),
            "--rdzv-timeout: expected seconds in (0, 1e6], got 1e+308");
  EXPECT_EQ(usage_error({"--rdzv-last-call", "-1e308", "prog"}),
            "--rdzv-last-call: expected seconds in [0, 1e6], got -1e+308");
  EXPECT_EQ(usage_error({"--max-restarts", "99999999999", "prog"}),
            "--max-restarts: expected an integer in [0, 1000000], got '99999999999'");
  EXPECT_EQ(usage_error({"--max-restarts", "-1", "prog"}),
            "--max-restarts: expected an integer in [0, 1000000], got '-1'");
  EXPECT_EQ(parse_args({"--max-restarts", "3", "prog"}).max_restarts, 3);
  for (const auto& [option, value] : {std::pair{"--grace-period", "1e308"},
                                      std::pair{"--max-restarts", "99999999999"}}) {
    EXPECT_LT(usage_error({option, value, "prog"}).size(), 100u) << option;
  }
}

// The store's limits (docs/launcher.md): given values are kept as the variables emberrun
// exports; EMBER_STORE_* set them too; bad values are short usage errors naming the option.
TEST(Config, StoreLimitsAreCheckedAndKeptAsTheirVariables) {
  LaunchConfig c = parse_args({"--store-max-stored-bytes", "4096", "--store-max-frame-time", "2.5",
                               "--store-max-connections", "300", "--store-max-buffered-bytes",
                               "1048576", "--store-max-connection-buffered-bytes", "262144",
                               "--store-idle-timeout", "90", "prog"});
  using Pairs = std::vector<std::pair<std::string, std::string>>;
  EXPECT_EQ(c.store_limits, (Pairs{{"EMBER_STORE_MAX_STORED_BYTES", "4096"},
                                   {"EMBER_STORE_MAX_BUFFERED_BYTES", "1048576"},
                                   {"EMBER_STORE_MAX_CONNECTION_BUFFERED_BYTES", "262144"},
                                   {"EMBER_STORE_MAX_CONNECTIONS", "300"},
                                   {"EMBER_STORE_MAX_FRAME_TIME", "2.5"},
                                   {"EMBER_STORE_IDLE_TIMEOUT", "90"}}));
  EXPECT_TRUE(parse_args({"prog"}).store_limits.empty());  // the store's own defaults
  setenv("EMBER_STORE_MAX_STORED_BYTES", "8192", 1);
  EXPECT_EQ(parse_args({"prog"}).store_limits,
            (Pairs{{"EMBER_STORE_MAX_STORED_BYTES", "8192"}}));
  EXPECT_EQ(parse_args({"--store-max-stored-bytes", "100", "prog"}).store_limits,
            (Pairs{{"EMBER_STORE_MAX_STORED_BYTES", "100"}}));  // the command line wins
  setenv("EMBER_STORE_MAX_STORED_BYTES", "lots", 1);
  EXPECT_EQ(usage_error({"prog"}),
            "--store-max-stored-bytes: expected an integer in [1, 1125899906842624], got 'lots'");
  unsetenv("EMBER_STORE_MAX_STORED_BYTES");
  EXPECT_EQ(usage_error({"--store-max-stored-bytes", "0", "prog"}),
            "--store-max-stored-bytes: expected an integer in [1, 1125899906842624], got '0'");
  EXPECT_EQ(usage_error({"--store-max-stored-bytes", "-5", "prog"}),
            "--store-max-stored-bytes: expected an integer in [1, 1125899906842624], got '-5'");
  EXPECT_EQ(usage_error({"--store-max-connections", "99999999999", "prog"}),
            "--store-max-connections: expected an integer in [1, 1048576], got '99999999999'");
  EXPECT_EQ(usage_error({"--store-max-buffered-bytes", "1.5", "prog"}),
            "--store-max-buffered-bytes: expected an integer in [1, 1125899906842624], got '1.5'");
  EXPECT_EQ(usage_error({"--store-max-frame-time", "0", "prog"}),
            "--store-max-frame-time: expected seconds in (0, 1e6], got '0'");
  EXPECT_EQ(usage_error({"--store-max-frame-time", "1e308", "prog"}),
            "--store-max-frame-time: expected seconds in (0, 1e6], got '1e308'");
  EXPECT_EQ(usage_error({"--store-max-frame-time", "nan", "prog"}),
            "--store-max-frame-time: expected seconds in (0, 1e6], got 'nan'");
}

TEST(Config, TorchrunPythonOptions) {
  LaunchConfig c = parse_args({"--role", "trainer", "--no-python", "--start_method", "fork", "p"});
  EXPECT_EQ(c.role, "trainer");
  ASSERT_EQ(c.notices.size(), 2u);
  EXPECT_EQ(c.notices[0], "--no-python has no effect: workers are always run as programs");
  EXPECT_NE(c.notices[1].find("--start-method has no effect"), std::string::npos);
  c = parse_args({"prog"});
  EXPECT_EQ(c.role, "default");
  EXPECT_TRUE(c.notices.empty());
  EXPECT_NE(usage_error({"--start-method", "thread", "p"}).find("'thread'"), std::string::npos);
  std::string e = usage_error({"-m", "train"});
  EXPECT_NE(e.find("-m/--module is not supported"), std::string::npos) << e;
  EXPECT_NE(e.find("emberrun [OPTIONS] python3 -m MODULE"), std::string::npos) << e;
  e = usage_error({"--run_path", "train.py"});
  EXPECT_NE(e.find("--run-path is not supported"), std::string::npos) << e;
  EXPECT_NE(e.find("python3 script.py"), std::string::npos) << e;
}

TEST(Config, TorchrunVariablesComeAfterEmberOnes) {
  unsetenv("EMBER_NPROC_PER_NODE");
  unsetenv("EMBER_MASTER_ADDR");
  setenv("PET_NPROC_PER_NODE", "2", 1);
  setenv("PET_MASTER_ADDR", "10.0.0.9", 1);
  setenv("PET_STANDALONE", "1", 1);
  setenv("PET_ROLE", "reader", 1);
  setenv("PET_RDZV_TIMEOUT", "3", 1);   // not a torchrun option: ignored
  setenv("EMBER_NPROC_PER_NODE", "", 1);  // empty: as if unset
  LaunchConfig c = parse_args({"prog"});
  EXPECT_EQ(c.nproc_per_node, 2);
  EXPECT_EQ(c.master_addr, "10.0.0.9");
  EXPECT_TRUE(c.standalone);
  EXPECT_EQ(c.role, "reader");
  EXPECT_EQ(c.rdzv_timeout_s, 900.0);
  setenv("EMBER_NPROC_PER_NODE", "3", 1);
  EXPECT_EQ(parse_args({"prog"}).nproc_per_node, 3);
  c = parse_args({"--nproc-per-node", "4", "--master_addr", "h", "prog"});
  EXPECT_EQ(c.nproc_per_node, 4);
  EXPECT_EQ(c.master_addr, "h");
  setenv("PET_STANDALONE", "0", 1);
  EXPECT_FALSE(parse_args({"prog"}).standalone);
  for (const char* v : {"EMBER_NPROC_PER_NODE", "PET_NPROC_PER_NODE", "PET_MASTER_ADDR",
                        "PET_STANDALONE", "PET_ROLE", "PET_RDZV_TIMEOUT"})
    unsetenv(v);
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
