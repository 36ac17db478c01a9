// nn::SummaryWriter: what it writes is read back by an independent reader
// (tests/nn/tfevents_reader.py: its own framing and CRC32C checks, Google's protobuf runtime with
// descriptors built from TensorFlow's field numbers), plus ranks, folders and errors.
#include <ember/nn/io/summary_writer.h>

#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include <ember/tensor/ops/creation.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/error.h>
#include "tests/examples/example_test_util.h"
#include "tests/nn/tfevents_test_util.h"

namespace ember::nn {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::read_tfevents;
using test::TempDir;

std::vector<std::string> event_files(const std::string& dir) {
  std::vector<std::string> out;
  if (!fs::is_directory(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) {
      out.push_back(e.path().string());
    }
  }
  return out;
}

// The events of the one file the reader found for `path`.
json events_of(const std::string& path) {
  const json all = read_tfevents({path});
  EXPECT_EQ(all.size(), 1u) << all.dump();
  return all.contains(path) ? all[path] : json::array();
}

// Restores an environment variable (or its absence) at the end of a test.
struct EnvGuard {
  std::string name;
  std::optional<std::string> old;
  EnvGuard(std::string n, const char* value) : name(std::move(n)) {
    if (const char* v = std::getenv(name.c_str())) old = v;
    if (value) {
      ::setenv(name.c_str(), value, 1);
    } else {
      ::unsetenv(name.c_str());
    }
  }
  ~EnvGuard() {
    if (old) {
      ::setenv(name.c_str(), old->c_str(), 1);
    } else {
      ::unsetenv(name.c_str());
    }
  }
};

// Unsets every rank variable, so that a test sees only what it sets.
struct NoRankEnv {
  EnvGuard a{"RANK", nullptr}, b{"OMPI_COMM_WORLD_RANK", nullptr}, c{"PMI_RANK", nullptr},
      d{"SLURM_PROCID", nullptr};
};

// A writer in `dir` that logs one scalar and is destroyed without flush(); returns its file.
std::string write_one_scalar(const std::string& dir, const std::string& tag, double value,
                             int64_t step) {
  SummaryWriter w(dir, {.rank = 0});
  w.add_scalar(tag, value, step);
  return w.file_path();
}

std::string expect_throws_message(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an ember::Error";
  return "";
}

// ---- framing ------------------------------------------------------------------------------------

TEST(SummaryWriterFraming, Crc32cOfTheStandardCheckString) {
  // RFC 3720's CRC32C of "123456789" is 0xE3069283; masked as TFRecord does.
  const uint32_t crc = 0xE3069283u;
  const uint32_t masked = ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
  EXPECT_EQ(detail::tfrecord_masked_crc32c("123456789"), masked);
}

TEST(SummaryWriterFraming, RecordLayout) {
  const std::string r = detail::tfrecord("abc");
  ASSERT_EQ(r.size(), 8u + 4 + 3 + 4);
  EXPECT_EQ(r.substr(0, 8), std::string("\x03\0\0\0\0\0\0\0", 8));
  EXPECT_EQ(r.substr(12, 3), "abc");
  auto u32 = [&](size_t at) {
    uint32_t v = 0;
    for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(r[at + i]);
    return v;
  };
  EXPECT_EQ(u32(8), detail::tfrecord_masked_crc32c(r.substr(0, 8)));
  EXPECT_EQ(u32(15), detail::tfrecord_masked_crc32c("abc"));
}

// ---- what is written, read back -----------------------------------------------------------------

TEST(SummaryWriter, FileNameAndVersionEvent) {
  EMBER_REQUIRE_TFEVENTS_READER();
  TempDir tmp("summary_writer_test");
  std::string path;
  {
    SummaryWriter w(tmp.file("run"), {.rank = 0});
    ASSERT_TRUE(w.enabled());
    EXPECT_EQ(w.log_dir(), tmp.file("run"));
    path = w.file_path();
  }
  const std::string name = fs::path(path).filename().string();
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const std::regex re("events\\.out\\.tfevents\\.[0-9]{10}\\." + std::string(host) + "\\." +
                      std::to_string(::getpid()) + "\\.[0-9]+");
  EXPECT_TRUE(std::regex_match(name, re)) << name;
  const json ev = events_of(path);
  ASSERT_EQ(ev.size(), 1u) << ev.dump();
  EXPECT_EQ(ev[0]["file_version"], "brain.Event:2");
  EXPECT_GT(ev[0]["wall_time"].get<double>(), 1.5e9);
}

TEST(SummaryWriter, ScalarsHistogramsAndTextReadBack) {
  EMBER_REQUIRE_TFEVENTS_READER();
  TempDir tmp("summary_writer_test");
  std::string path;
  const std::vector<double> hv = {1, 2, 2, 3, 3, 3, 4};
  {
    SummaryWriter w(tmp.path(), {.rank = 0});
    path = w.file_path();
    for (int s = 0; s < 3; ++s) w.add_scalar("train/loss", 1.0 / (s + 1), s, 1000.0 + s);
    w.add_histogram("h4", std::span<const double>(hv), 7, /*bins=*/4, 2000.0);
    w.add_histogram("ht", from_vector(std::vector<float>{1, 2, 2, 3}, {2, 2}), 8, 4);
    w.add_text("notes", "lr **0.05**, ünïcode", 9);
  }
  const json ev = events_of(path);
  ASSERT_EQ(ev.size(), 1u + 3 + 2 + 1) << ev.dump();
  EXPECT_EQ(ev[0]["file_version"], "brain.Event:2");
  for (int s = 0; s < 3; ++s) {
    const json& e = ev[1 + s];
    EXPECT_EQ(e["step"], s);
    EXPECT_EQ(e["wall_time"], 1000.0 + s);
    ASSERT_EQ(e["values"].size(), 1u);
    EXPECT_EQ(e["values"][0]["tag"], "train/loss");
    // Stored as float (simple_value), like torch.
    EXPECT_EQ(e["values"][0]["simple_value"].get<double>(), static_cast<float>(1.0 / (s + 1)));
    EXPECT_FALSE(e["values"][0].contains("plugin_name"));
  }
  // 4 equal bins over [1, 4]: edges 1, 1.75, 2.5, 3.25, 4 hold 1, 2, 3, 1 values; the stored
  // buckets start with the empty one left of 1.
  const json& h = ev[4]["values"][0];
  EXPECT_EQ(ev[4]["step"], 7);
  EXPECT_EQ(ev[4]["wall_time"], 2000.0);
  EXPECT_EQ(h["tag"], "h4");
  EXPECT_EQ(h["histo"]["min"], 1.0);
  EXPECT_EQ(h["histo"]["max"], 4.0);
  EXPECT_EQ(h["histo"]["num"], 7.0);
  EXPECT_EQ(h["histo"]["sum"], 18.0);
  EXPECT_EQ(h["histo"]["sum_squares"], 52.0);
  EXPECT_EQ(h["histo"]["bucket_limit"], json({1.0, 1.75, 2.5, 3.25, 4.0}));
  EXPECT_EQ(h["histo"]["bucket"], json({0.0, 1.0, 2.0, 3.0, 1.0}));
  // A tensor's histogram: its elements, any shape and dtype.
  const json& ht = ev[5]["values"][0];
  EXPECT_EQ(ht["tag"], "ht");
  EXPECT_EQ(ht["histo"]["num"], 4.0);
  EXPECT_EQ(ht["histo"]["sum"], 8.0);
  EXPECT_EQ(ht["histo"]["bucket"], json({0.0, 1.0, 0.0, 2.0, 1.0}));
  // Text as torch writes it.
  const json& t = ev[6]["values"][0];
  EXPECT_EQ(ev[6]["step"], 9);
  EXPECT_EQ(t["tag"], "notes/text_summary");
  EXPECT_EQ(t["plugin_name"], "text");
  EXPECT_EQ(t["plugin_content"], "");  // TextPluginData{version: 0} serializes to nothing
  EXPECT_EQ(t["tensor"]["dtype"], 7);  // DT_STRING
  EXPECT_EQ(t["tensor"]["shape"], json({1}));
  EXPECT_EQ(t["tensor"]["string_val"], json({"lr **0.05**, ünïcode"}));
}

// TensorFlow's buckets: every value falls in [limit[i-1], limit[i]) of a bucket that counts it,
// the edges grow by 1.1, and the first bucket is the empty one left of the data.
TEST(SummaryWriter, HistogramWithTensorFlowBuckets) {
  EMBER_REQUIRE_TFEVENTS_READER();
  TempDir tmp("summary_writer_test");
  const std::vector<double> values = {-3.0, -0.001, 0.0, 1e-6, 0.5, 0.5, 2.0, 1e5};
  std::string path;
  {
    SummaryWriter w(tmp.path(), {.rank = 0});
    path = w.file_path();
    w.add_histogram("tf", std::span<const double>(values), 1);
  }
  const json ev = events_of(path);
  ASSERT_EQ(ev.size(), 2u);
  const json& h = ev[1]["values"][0]["histo"];
  const auto limits = h["bucket_limit"].get<std::vector<double>>();
  const auto counts = h["bucket"].get<std::vector<double>>();
  ASSERT_EQ(limits.size(), counts.size());
  EXPECT_EQ(counts.front(), 0.0);
  EXPECT_LE(limits.front(), -3.0);
  EXPECT_GT(limits.back(), 1e5);
  double total = 0;
  for (size_t i = 0; i < counts.size(); ++i) total += counts[i];
  EXPECT_EQ(total, static_cast<double>(values.size()));
  for (size_t i = 1; i < limits.size(); ++i) {
    ASSERT_LT(limits[i - 1], limits[i]) << "index " << i;
    if (limits[i - 1] > 0) {
      EXPECT_NEAR(limits[i] / limits[i - 1], 1.1, 1e-9) << "index " << i;
    }
  }
  std::vector<double> want(counts.size(), 0.0);
  for (const double v : values) {
    size_t i = 1;
    while (i < limits.size() && !(limits[i - 1] <= v && v < limits[i])) ++i;
    ASSERT_LT(i, limits.size()) << "value " << v << " is in no bucket";
    want[i] += 1;
  }
  EXPECT_EQ(counts, want);
  EXPECT_EQ(h["min"], -3.0);
  EXPECT_EQ(h["max"], 1e5);
}

// A CUDA tensor (here a transposed, non-contiguous view) is copied to the CPU first: its
// histogram is the CPU tensor's.
TEST(SummaryWriter, HistogramOfACudaTensor) {
  if (!cuda::is_available()) GTEST_SKIP() << cuda::unavailable_reason();
  EMBER_REQUIRE_TFEVENTS_READER();
  TempDir tmp("summary_writer_test");
  const Tensor cpu = from_vector(std::vector<float>{-1, 0.5f, 2, 2, 3, 7}, {2, 3});
  std::string path;
  {
    SummaryWriter w(tmp.path(), {.rank = 0});
    path = w.file_path();
    w.add_histogram("cpu", cpu.t(), 1, 5);
    w.add_histogram("cuda", cpu.cuda().t(), 1, 5);
  }
  const json ev = events_of(path);
  ASSERT_EQ(ev.size(), 3u);
  EXPECT_EQ(ev[1]["values"][0]["histo"], ev[2]["values"][0]["histo"]);
  EXPECT_EQ(ev[2]["values"][0]["histo"]["sum"], 13.5);
}

TEST(SummaryWriter, HistogramOfEqualValuesAndBadInput) {
  TempDir tmp("summary_writer_test");
  SummaryWriter w(tmp.path(), {.rank = 0});
  const std::vector<double> same = {2.0, 2.0};
  EXPECT_NO_THROW(w.add_histogram("same", std::span<const double>(same), 0, 3));
  const std::vector<double> none;
  EXPECT_THROW(w.add_histogram("none", std::span<const double>(none)), ValueError);
  const std::vector<double> nan = {1.0, std::nan("")};
  const std::string msg =
      expect_throws_message([&] { w.add_histogram("nan", std::span<const double>(nan)); });
  EXPECT_NE(msg.find("'nan'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("value 1"), std::string::npos) << msg;
  EXPECT_THROW(w.add_histogram("bins", std::span<const double>(same), 0, -1), ValueError);
  const std::vector<double> huge = {1e30};
  EXPECT_THROW(w.add_histogram("huge", std::span<const double>(huge)), ValueError);
}

TEST(SummaryWriter, CorruptedBytesAreDetectedByTheReader) {
  EMBER_REQUIRE_TFEVENTS_READER();
  TempDir tmp("summary_writer_test");
  const std::string path = write_one_scalar(tmp.path(), "x", 1.5, 3);
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  ASSERT_EQ(test::run_tfevents_reader({path}).status, 0);
  const size_t first_len = 8 + 4 + static_cast<uint8_t>(bytes[0]) + 4;  // the version record
  ASSERT_LT(first_len + 20, bytes.size());
  auto corrupt_at = [&](size_t at) {
    std::string bad = bytes;
    bad[at] = static_cast<char>(bad[at] ^ 0x01);
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bad;
    return test::run_tfevents_reader({path});
  };
  test::TfeventsResult r = corrupt_at(first_len + 14);  // in the scalar event's data
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.error_output.find("record 1"), std::string::npos) << r.error_output;
  EXPECT_NE(r.error_output.find("data CRC mismatch"), std::string::npos) << r.error_output;
  r = corrupt_at(first_len + 1);  // its length
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.error_output.find("length CRC mismatch"), std::string::npos) << r.error_output;
  r = corrupt_at(bytes.size() - 1);  // its data CRC
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.error_output.find("data CRC mismatch"), std::string::npos) << r.error_output;
}

// ---- ranks, folders -----------------------------------------------------------------------------

TEST(SummaryWriter, OnlyRankZeroWritesByDefault) {
  TempDir tmp("summary_writer_test");
  NoRankEnv clean;
  {
    EnvGuard rank("RANK", "1");
    SummaryWriter w(tmp.file("r1"));
    EXPECT_FALSE(w.enabled());
    EXPECT_EQ(w.file_path(), "");
    w.add_scalar("x", 1);  // ignored
    w.add_text("t", "ignored");
    w.flush();
    w.close();
  }
  EXPECT_FALSE(fs::exists(tmp.file("r1")));
  {
    EnvGuard rank("SLURM_PROCID", "2");
    EXPECT_FALSE(SummaryWriter(tmp.file("r2")).enabled());
  }
  {
    SummaryWriter w(tmp.file("r0"));  // no rank variable: rank 0
    EXPECT_TRUE(w.enabled());
  }
  EXPECT_EQ(event_files(tmp.file("r0")).size(), 1u);
  EXPECT_FALSE(SummaryWriter(tmp.file("opt"), {.rank = 3}).enabled());
}

TEST(SummaryWriter, AllRanksWriteIntoFoldersOfTheirOwn) {
  TempDir tmp("summary_writer_test");
  NoRankEnv clean;
  EnvGuard rank("RANK", "1");
  {
    SummaryWriter w(tmp.path(), {.all_ranks = true});
    ASSERT_TRUE(w.enabled());
    EXPECT_EQ(w.log_dir(), tmp.file("rank1"));
    w.add_scalar("x", 2);
  }
  {
    SummaryWriter w(tmp.path(), {.all_ranks = true, .rank = 0});
    EXPECT_EQ(w.log_dir(), tmp.file("rank0"));
  }
  EXPECT_EQ(event_files(tmp.file("rank1")).size(), 1u);
  EXPECT_EQ(event_files(tmp.file("rank0")).size(), 1u);
  EXPECT_TRUE(event_files(tmp.path()).empty());
}

TEST(SummaryWriter, RankFromEnvironment) {
  NoRankEnv clean;
  EXPECT_EQ(rank_from_environment(), 0);
  {
    EnvGuard pmi("PMI_RANK", "5");
    EXPECT_EQ(rank_from_environment(), 5);
    EnvGuard ompi("OMPI_COMM_WORLD_RANK", "4");
    EXPECT_EQ(rank_from_environment(), 4);  // Open MPI's before PMI's
    EnvGuard rank("RANK", "3");
    EXPECT_EQ(rank_from_environment(), 3);  // the launcher's first
  }
  for (const char* bad : {"abc", "", "-1", "2x"}) {
    EnvGuard rank("RANK", bad);
    const std::string msg = expect_throws_message([] { rank_from_environment(); });
    EXPECT_NE(msg.find("RANK='" + std::string(bad) + "'"), std::string::npos) << msg;
  }
}

TEST(SummaryWriter, AddScalarsMakesOneRunPerKey) {
  EMBER_REQUIRE_TFEVENTS_READER();
  TempDir tmp("summary_writer_test");
  {
    SummaryWriter w(tmp.path(), {.rank = 0});
    w.add_scalars("loss/split", {{"train", 0.5}, {"test", 0.75}}, 4, 3000.0);
    w.add_scalars("loss/split", {{"train", 0.25}}, 5, 3001.0);
  }
  EXPECT_EQ(tmp.list().size(), 3u);  // the main file and two folders
  const json all = read_tfevents({tmp.path()});
  std::map<std::string, json> by_folder;
  for (const auto& [rel, ev] : all.items()) by_folder[fs::path(rel).parent_path().string()] = ev;
  ASSERT_EQ(by_folder.size(), 3u) << all.dump();
  ASSERT_TRUE(by_folder.count("loss_split_train")) << all.dump();
  ASSERT_TRUE(by_folder.count("loss_split_test")) << all.dump();
  EXPECT_EQ(by_folder[""].size(), 1u);  // only the version event
  const json& train = by_folder["loss_split_train"];
  ASSERT_EQ(train.size(), 3u);
  EXPECT_EQ(train[0]["file_version"], "brain.Event:2");
  EXPECT_EQ(train[1]["values"][0]["tag"], "loss/split");
  EXPECT_EQ(train[1]["values"][0]["simple_value"], 0.5);
  EXPECT_EQ(train[1]["step"], 4);
  EXPECT_EQ(train[2]["values"][0]["simple_value"], 0.25);
  EXPECT_EQ(train[2]["step"], 5);
  const json& tst = by_folder["loss_split_test"];
  ASSERT_EQ(tst.size(), 2u);
  EXPECT_EQ(tst[1]["values"][0]["simple_value"], 0.75);
  EXPECT_EQ(tst[1]["wall_time"], 3000.0);
}

TEST(SummaryWriter, TwoWritersInOneFolderGetTwoFiles) {
  TempDir tmp("summary_writer_test");
  SummaryWriter a(tmp.path(), {.rank = 0}), b(tmp.path(), {.rank = 0, .filename_suffix = ".x"});
  EXPECT_NE(a.file_path(), b.file_path());
  EXPECT_EQ(b.file_path().substr(b.file_path().size() - 2), ".x");
  EXPECT_EQ(event_files(tmp.path()).size(), 2u);
}

// ---- buffering ----------------------------------------------------------------------------------

TEST(SummaryWriter, EventsWaitForFlushUnlessFlushSecsIsZero) {
  TempDir tmp("summary_writer_test");
  SummaryWriter buffered(tmp.file("b"), {.rank = 0});
  const auto size0 = fs::file_size(buffered.file_path());
  EXPECT_GT(size0, 0u);  // the version event is written at once
  buffered.add_scalar("x", 1);
  EXPECT_EQ(fs::file_size(buffered.file_path()), size0);
  buffered.flush();
  EXPECT_GT(fs::file_size(buffered.file_path()), size0);

  SummaryWriter eager(tmp.file("e"), {.flush_secs = 0, .rank = 0});
  const auto e0 = fs::file_size(eager.file_path());
  eager.add_scalar("x", 1);
  EXPECT_GT(fs::file_size(eager.file_path()), e0);
}

TEST(SummaryWriter, DestructorFlushesAndCloseIsFinal) {
  EMBER_REQUIRE_TFEVENTS_READER();
  TempDir tmp("summary_writer_test");
  const std::string path = write_one_scalar(tmp.path(), "kept", 3, 1);  // the destructor writes it
  EXPECT_EQ(events_of(path).size(), 2u);

  SummaryWriter w(tmp.file("c"), {.rank = 0});
  w.close();
  w.close();
  w.flush();
  EXPECT_THROW(w.add_scalar("x", 1), ValueError);
  EXPECT_THROW(w.add_text("x", "y"), ValueError);
}

// A writer replaced by move-assignment writes its buffered events first (they were dropped).
TEST(SummaryWriter, AWriterReplacedByAssignmentKeepsItsEvents) {
  TempDir tmp("summary_writer_test");
  SummaryWriter w(tmp.file("a"), {.rank = 0});
  const std::string first = w.file_path();
  const auto size0 = fs::file_size(first);
  w.add_scalar("x", 1, 0);
  EXPECT_EQ(fs::file_size(first), size0);  // buffered
  w = SummaryWriter(tmp.file("b"), {.rank = 0});
  EXPECT_GT(fs::file_size(first), size0);
  EXPECT_NE(w.file_path(), first);
  w.add_scalar("y", 2, 0);
  SummaryWriter& same = w;
  w = std::move(same);  // itself: nothing closes
  w.add_scalar("z", 3, 1);
}

// ---- errors -------------------------------------------------------------------------------------

TEST(SummaryWriter, UnwritableLogDirNamesThePath) {
  TempDir tmp("summary_writer_test");
  std::ofstream(tmp.file("file")) << "not a folder";
  const std::string bad = tmp.file("file/run");
  const std::string msg = expect_throws_message([&] { SummaryWriter w(bad, {.rank = 0}); });
  EXPECT_NE(msg.find("cannot create the log folder '" + bad + "'"), std::string::npos) << msg;
  const std::string msg2 =
      expect_throws_message([&] { SummaryWriter w(tmp.file("file"), {.rank = 0}); });
  EXPECT_NE(msg2.find(tmp.file("file")), std::string::npos) << msg2;
  EXPECT_THROW(SummaryWriter("", {.rank = 0}), ValueError);
  // A rank that does not write does not look at the folder.
  EXPECT_NO_THROW(SummaryWriter(bad, {.rank = 1}));
}

// A write the system refuses (here: the file-size limit, as a full disk would) is an error
// naming the file; the events stay buffered, and a later flush writes them whole.
TEST(SummaryWriter, WriteErrorNamesTheFileAndKeepsTheEvents) {
  EMBER_REQUIRE_TFEVENTS_READER();
  TempDir tmp("summary_writer_test");
  SummaryWriter w(tmp.path(), {.rank = 0});
  const std::string text(4000, 'z');
  w.add_text("big", text, 1);
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  rlimit small = old;
  small.rlim_cur = fs::file_size(w.file_path()) + 1000;  // part of the text event fits
  auto* old_handler = ::signal(SIGXFSZ, SIG_IGN);        // EFBIG instead of the signal
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string msg = expect_throws_message([&] { w.flush(); });
  ::setrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, old_handler);
  EXPECT_NE(msg.find("cannot write the event file '" + w.file_path() + "'"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find(std::strerror(EFBIG)), std::string::npos) << msg;
  w.close();
  const json ev = events_of(w.file_path());
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[1]["values"][0]["tensor"]["string_val"][0], text);
}

// add_scalars into a folder that cannot be made (a file of its name is in the way) throws naming
// it, and the writer goes on: flush, the other runs and close still work (a failed folder left
// an empty entry that every flush then dereferenced).
TEST(SummaryWriter, AddScalarsFolderThatCannotBeMadeLeavesTheWriterUsable) {
  EMBER_REQUIRE_TFEVENTS_READER();
  TempDir tmp("summary_writer_test");
  SummaryWriter w(tmp.path(), {.flush_secs = 0, .rank = 0});
  { std::ofstream(tmp.path() + "/loss_train") << "in the way"; }
  const std::string msg = expect_throws_message([&] { w.add_scalars("loss", {{"train", 1}}, 0); });
  EXPECT_NE(msg.find("loss_train"), std::string::npos) << msg;
  w.add_scalars("acc", {{"val", 0.5}}, 0);
  w.flush();
  w.close();
  EXPECT_EQ(events_of(w.file_path()).size(), 1u);
}

// An event file whose first record cannot be written closes its descriptor and removes the file
// it made: a writer that failed to start leaves no descriptor and no empty file behind.
TEST(SummaryWriter, AWriterThatCannotWriteItsFirstRecordLeavesNothingBehind) {
  TempDir tmp("summary_writer_test");
  const auto open_fds = [] {
    return std::distance(fs::directory_iterator("/proc/self/fd"), fs::directory_iterator{});
  };
  const auto before = open_fds();
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  rlimit none = old;
  none.rlim_cur = 0;
  auto* old_handler = ::signal(SIGXFSZ, SIG_IGN);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &none), 0);
  std::string msg;
  for (int i = 0; i < 3; ++i) {
    msg = expect_throws_message([&] { SummaryWriter w(tmp.path(), {.rank = 0}); });
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, old_handler);
  EXPECT_NE(msg.find(std::strerror(EFBIG)), std::string::npos) << msg;
  EXPECT_EQ(open_fds(), before);
  EXPECT_TRUE(fs::is_empty(tmp.path()));
}

}  // namespace
}  // namespace ember::nn
