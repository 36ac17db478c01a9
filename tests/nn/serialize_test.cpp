// Checkpoints: atomic file replacement and the safetensors format (round trips, the exact
// layout, rejection of malformed files, fuzzed inputs, and interop with an independent Python
// reader/writer, tests/nn/safetensors_reader.py, run under Debian's /usr/bin/python3 + torch).
#include <ember/nn/io/serialize.h>

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <ember/nn/io/atomic_file.h>
#include <ember/tensor/gpu/cuda.h>
#include "cmake/build_paths.h"
#include "tests/temp_dir.h"
#include "tests/tensor/test_util.h"

namespace ember::nn {
namespace {

namespace fs = std::filesystem;
using detail::AtomicWriteStep;
using test::expect_error;
using test::TempDir;
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// ---- helpers
// -------------------------------------------------------------------------------------

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.good()) << "cannot open " << path;
  std::ostringstream os;
  os << f.rdbuf();
  return os.str();
}

/// Plain (non-atomic, non-fsynced) write, for crafted and fuzzed files. The old file is
/// unlinked first: ext4 flushes a file truncated and rewritten in place when it is closed
/// (auto_da_alloc), which made the fuzz tests 20x slower.
void write_bytes(const std::string& path, const std::string& bytes) {
  ::unlink(path.c_str());
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << "cannot write " << path;
}

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int k = 0; k < 8; ++k) s[k] = static_cast<char>(v >> (8 * k));
  return s;
}

/// A safetensors file from a header text (used as is, unpadded) and the data bytes.
std::string craft(const std::string& header, const std::string& data = "") {
  return le64(header.size()) + header + data;
}

/// The raw bytes of a tensor's elements in row-major order.
std::string tensor_bytes(const Tensor& t) {
  Tensor c = t.contiguous().cpu();
  return std::string(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.nbytes()));
}

std::string hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

/// A tensor whose bytes are exactly `raw` (e.g. NaN payloads, subnormals, -0).
template <typename Raw>
Tensor from_raw(const std::vector<Raw>& raw, Dtype dtype) {
  EXPECT_EQ(sizeof(Raw), static_cast<size_t>(itemsize(dtype)));
  Tensor t = empty({static_cast<int64_t>(raw.size())}, dtype);
  if (!raw.empty()) std::memcpy(t.data_ptr(), raw.data(), raw.size() * sizeof(Raw));
  return t;
}

/// Deterministic values of any dtype (ints spread over a useful range, bools mixed).
Tensor values(IntList shape, Dtype dtype, uint64_t seed) {
  Tensor v = test::rand_t(shape, kFloat64, seed);  // [-1, 1)
  switch (dtype) {
    case kBool:
      return gt(v, 0.0);
    case kUInt8:
      return ((v + 1.0) * 127.0).to(kUInt8);
    case kInt32:
      return (v * 2.0e9).to(kInt32);
    case kInt64:
      return (v * 9.0e18).to(kInt64);
    default:
      return v.to(dtype);
  }
}

const Dtype kAllDtypes[] = {kBool, kUInt8, kInt32, kInt64, kFloat16, kBFloat16, kFloat32, kFloat64};

/// The safetensors name of an Ember dtype, from the format's documentation (not Ember's table).
std::string st_name(Dtype d) {
  switch (d) {
    case kBool:
      return "BOOL";
    case kUInt8:
      return "U8";
    case kInt32:
      return "I32";
    case kInt64:
      return "I64";
    case kFloat16:
      return "F16";
    case kBFloat16:
      return "BF16";
    case kFloat32:
      return "F32";
    case kFloat64:
      return "F64";
  }
  return "?";
}

void expect_bit_equal(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  EXPECT_EQ(got.dtype(), want.dtype()) << what;
  EXPECT_EQ(got.shape(), want.shape())
      << what << ": got " << got.shape() << " want " << want.shape();
  EXPECT_TRUE(got.is_cpu() && got.is_contiguous()) << what;
  const std::string g = tensor_bytes(got), w = tensor_bytes(want);
  ASSERT_EQ(g.size(), w.size()) << what;
  for (size_t i = 0; i < g.size(); ++i) {
    ASSERT_EQ(g[i], w[i]) << what << ": byte " << i << " differs (got 0x" << hex(g.substr(i, 1))
                          << " want 0x" << hex(w.substr(i, 1)) << ")";
  }
}

/// Runs `f` and returns "" if it threw ember::Error (or nothing), else a description of the
/// foreign exception. Used by the fuzz tests: anything but success or ember::Error is a bug.
template <typename F>
std::string run_expecting_ember_error(F&& f, bool* threw) {
  *threw = false;
  try {
    f();
  } catch (const Error&) {
    *threw = true;
  } catch (const std::exception& e) {
    *threw = true;
    return std::string("non-ember exception: ") + e.what();
  } catch (...) {
    *threw = true;
    return "unknown exception";
  }
  return "";
}

/// A small valid checkpoint with every dtype, a 0-dim and a 0-size tensor and metadata.
NamedTensors sample_tensors() {
  NamedTensors ts;
  uint64_t seed = 1;
  for (Dtype d : kAllDtypes) {
    ts.emplace_back(std::string("t_") + std::string(dtype_name(d)), values({2, 3}, d, seed++));
  }
  ts.emplace_back("scalar", values({}, kFloat32, 99));
  ts.emplace_back("empty", values({0, 4}, kInt64, 98));
  return ts;
}

// ---- write_file_atomic
// ---------------------------------------------------------------------------

TEST(AtomicFile, WritesAndReplacesLeavingNoTempFiles) {
  TempDir dir;
  const std::string path = dir.file("a.bin");
  write_file_atomic(path, std::string_view("hello"));
  EXPECT_EQ(read_bytes(path), "hello");
  write_file_atomic(path, std::string_view("longer contents\0with a nul", 26));
  EXPECT_EQ(read_bytes(path), std::string("longer contents\0with a nul", 26));
  write_file_atomic(path, std::string_view(""));
  EXPECT_EQ(read_bytes(path), "");
  EXPECT_EQ(dir.list(), std::vector<std::string>{"a.bin"});
  // A 250-byte name: the temp file's longer name must still fit NAME_MAX (255).
  const std::string long_name(250, 'n');
  write_file_atomic(dir.file(long_name), std::string_view("x"));
  EXPECT_EQ(read_bytes(dir.file(long_name)), "x");
}

TEST(AtomicFile, StreamsPiecesAndUsesTheUmask) {
  TempDir dir;
  const std::string path = dir.file("s.bin");
  write_file_atomic(path, [](const ByteSink& sink) {
    for (int i = 0; i < 1000; ++i) sink(&i, sizeof(i));
  });
  const std::string got = read_bytes(path);
  ASSERT_EQ(got.size(), 1000 * sizeof(int));
  for (int i = 0; i < 1000; ++i) {
    int v;
    std::memcpy(&v, got.data() + i * sizeof(int), sizeof(int));
    ASSERT_EQ(v, i) << "element " << i;
  }
  // Created with 0666 minus the umask, like any other new file (not mkstemp's 0600).
  const mode_t mask = ::umask(0);
  ::umask(mask);
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0666 & ~mask);
}

TEST(AtomicFile, ProducerThrowingHalfwayKeepsTheOldFile) {
  TempDir dir;
  const std::string path = dir.file("keep.bin");
  write_file_atomic(path, std::string_view("good old contents"));
  const std::string half(1 << 20, 'x');
  EXPECT_THROW(write_file_atomic(path,
                                 [&](const ByteSink& sink) {
                                   sink(half.data(), half.size());
                                   throw std::runtime_error("producer failed");
                                 }),
               std::runtime_error);
  EXPECT_EQ(read_bytes(path), "good old contents");
  EXPECT_EQ(dir.list(), std::vector<std::string>{"keep.bin"});
}

TEST(AtomicFile, DiskFullHalfwayKeepsTheOldFile) {
  TempDir dir;
  const std::string path = dir.file("keep.bin");
  write_file_atomic(path, std::string_view("good old contents"));
  const std::string big(100000, 'y');
  detail::inject_atomic_write_fault(AtomicWriteStep::kWrite, ENOSPC, /*after_bytes=*/50000);
  expect_error([&] { write_file_atomic(path, big); },
               {"[write_file_atomic]", path, "write to temp file", "after 50000 bytes",
                "No space left on device"});
  EXPECT_EQ(read_bytes(path), "good old contents");
  EXPECT_EQ(dir.list(), std::vector<std::string>{"keep.bin"});
  // The fault fired once: the next write works.
  write_file_atomic(path, big);
  EXPECT_EQ(read_bytes(path), big);
}

TEST(AtomicFile, EveryFailingStepKeepsTheOldFileAndCleansUp) {
  const struct {
    AtomicWriteStep step;
    int err;
    const char* says;
  } cases[] = {
      {AtomicWriteStep::kCreate, EACCES, "cannot create temp file"},
      {AtomicWriteStep::kWrite, EIO, "write to temp file"},
      {AtomicWriteStep::kFsync, EIO, "fsync of temp file"},
      {AtomicWriteStep::kRename, EXDEV, "rename of temp file"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.says);
    TempDir dir;
    const std::string path = dir.file("ckpt.bin");
    write_file_atomic(path, std::string_view("v1"));
    detail::inject_atomic_write_fault(c.step, c.err);
    expect_error([&] { write_file_atomic(path, std::string_view("v2 much longer")); },
                 {path, c.says, std::system_category().message(c.err)});
    detail::inject_atomic_write_fault(AtomicWriteStep::kNone, 0);
    EXPECT_EQ(read_bytes(path), "v1");
    EXPECT_EQ(dir.list(), std::vector<std::string>{"ckpt.bin"});
  }
}

TEST(AtomicFile, DirectoryFsyncFailureIsReportedAfterTheReplace) {
  TempDir dir;
  const std::string path = dir.file("ckpt.bin");
  write_file_atomic(path, std::string_view("v1"));
  detail::inject_atomic_write_fault(AtomicWriteStep::kFsyncDir, EIO);
  expect_error([&] { write_file_atomic(path, std::string_view("v2")); },
               {path, "fsync of its directory", dir.path(), "Input/output error"});
  EXPECT_EQ(read_bytes(path), "v2");  // the rename had happened: the new file is complete
  EXPECT_EQ(dir.list(), std::vector<std::string>{"ckpt.bin"});
}

TEST(AtomicFile, BadPathsNameThePathAndTheReason) {
  TempDir dir;
  const std::string missing = dir.file("no/such/dir/f.bin");
  expect_error([&] { write_file_atomic(missing, std::string_view("x")); },
               {"[write_file_atomic]", missing, "No such file or directory"});
  fs::create_directory(dir.file("sub"));
  expect_error([&] { write_file_atomic(dir.file("sub"), std::string_view("x")); },
               {"[write_file_atomic]", dir.file("sub"), "rename", "Is a directory"});
  expect_error<ValueError>([&] { write_file_atomic("", std::string_view("x")); },
                           {"[write_file_atomic]", "empty"});
  expect_error<ValueError>([&] { write_file_atomic(dir.path() + "/", std::string_view("x")); },
                           {"[write_file_atomic]", "names a directory"});
  EXPECT_EQ(dir.list(), std::vector<std::string>{"sub"});
}

// A process killed mid-write (simulated with _exit in a forked child) leaves the old file
// whole; only a stray temp file remains, which never has the target's name.
TEST(AtomicFile, CrashMidWriteLeavesTheOldFileIntact) {
  TempDir dir;
  const std::string path = dir.file("ckpt.bin");
  write_file_atomic(path, std::string_view("good old contents"));
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0) << std::strerror(errno);
  if (pid == 0) {
    const std::string half(1 << 16, 'z');
    write_file_atomic(path, [&](const ByteSink& sink) {
      sink(half.data(), half.size());
      ::_exit(0);  // "crash" with the temp file half written
    });
    ::_exit(1);
  }
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  pid_t done = 0;
  while ((done = ::waitpid(pid, &status, WNOHANG)) == 0 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // polling, not synchronisation
  }
  if (done == 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    FAIL() << "child did not exit within 60 s";
  }
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  EXPECT_EQ(read_bytes(path), "good old contents");
  const auto names = dir.list();
  ASSERT_EQ(names.size(), 2u);
  EXPECT_EQ(names[0].rfind(".ckpt.bin.tmp-" + std::to_string(pid) + "-", 0), 0u)
      << "stray temp file is named " << names[0];
  EXPECT_EQ(names[1], "ckpt.bin");
}

// ---- safetensors: round trips
// ----------------------------------------------------------------------

TEST(Safetensors, RoundTripEveryDtypeAndShapeBitExact) {
  TempDir dir;
  const std::string path = dir.file("all.safetensors");
  const std::vector<std::vector<int64_t>> shapes = {{}, {0}, {2, 0, 3}, {7}, {3, 4}, {2, 3, 5}};
  NamedTensors ts;
  uint64_t seed = 10;
  for (Dtype d : kAllDtypes) {
    for (const auto& s : shapes) {
      const std::string name =
          std::string(dtype_name(d)) + "/" + (s.empty() ? "scalar" : std::to_string(seed));
      ts.emplace_back(name, values(s, d, seed++));
    }
  }
  // Bit patterns that a value-based comparison would miss: NaN payloads, -0, subnormals, inf.
  ts.emplace_back("f16_bits",
                  from_raw<uint16_t>({0x7e01, 0xfc00, 0x8000, 0x0001, 0x7bff, 0x7c00}, kFloat16));
  ts.emplace_back("bf16_bits",
                  from_raw<uint16_t>({0x7fc1, 0xff80, 0x8000, 0x0001, 0x7f7f}, kBFloat16));
  ts.emplace_back("f32_bits", from_raw<uint32_t>(
                                  {0x7fc00001u, 0x80000000u, 0x00000001u, 0xff800000u}, kFloat32));
  ts.emplace_back("f64_bits", from_raw<uint64_t>({0x7ff8000000000001ull, 0x8000000000000000ull,
                                                  0x0000000000000001ull},
                                                 kFloat64));
  ts.emplace_back("i64_limits", from_raw<int64_t>({INT64_MIN, INT64_MAX, 0, -1}, kInt64));
  ts.emplace_back("i32_limits", from_raw<int32_t>({INT32_MIN, INT32_MAX}, kInt32));
  ts.emplace_back("größe ünïcode", values({2}, kFloat32, 7));
  ts.emplace_back("", values({1}, kInt32, 8));  // the format allows any string, even ""
  const std::map<std::string, std::string> meta = {
      {"format", "pt"}, {"step", "1200"}, {"empty", ""}, {"ünï", "cödé \"quoted\"\n"}};
  save_safetensors(path, ts, meta);
  const SafetensorsFile f = load_safetensors(path);
  EXPECT_EQ(f.metadata(), meta);
  ASSERT_EQ(f.size(), ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    EXPECT_EQ(f.tensors()[i].first, ts[i].first) << "file order differs at " << i;
    expect_bit_equal(f.tensors()[i].second, ts[i].second, "tensor '" + ts[i].first + "'");
    ASSERT_TRUE(f.contains(ts[i].first));
    EXPECT_TRUE(f.at(ts[i].first).is_same(f.tensors()[i].second));
  }
  EXPECT_EQ(f.at("float64/scalar").dim(), 0);
}

TEST(Safetensors, SavesViewsAsTheirValues) {
  TempDir dir;
  const std::string path = dir.file("views.safetensors");
  Tensor base = values({4, 6}, kFloat32, 3);
  Tensor t = base.t();                                       // transposed
  Tensor s = base.slice(1, 1, 6, 2);                         // strided, with a storage offset
  Tensor e = values({3}, kInt64, 4).expand({5, 3});          // stride 0
  Tensor n = base.narrow(0, 2, 2);                           // contiguous view at an offset
  Tensor r = values({3, 2}, kBFloat16, 5).requires_grad_();  // autograd state is ignored
  save_safetensors(path, {{"t", t}, {"s", s}, {"e", e}, {"n", n}, {"r", r}});
  const SafetensorsFile f = load_safetensors(path);
  expect_bit_equal(f.at("t"), t.contiguous(), "t");
  expect_bit_equal(f.at("s"), s.contiguous(), "s");
  expect_bit_equal(f.at("e"), e.contiguous(), "e");
  expect_bit_equal(f.at("n"), n.contiguous(), "n");
  expect_bit_equal(f.at("r"), r.detach(), "r");
  EXPECT_FALSE(f.at("r").requires_grad());
}

TEST(Safetensors, SavesCudaTensorsAndLoadsToTheCpu) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device (or built with EMBER_WITH_CUDA=OFF)";
  TempDir dir;
  const std::string path = dir.file("cuda.safetensors");
  const Tensor a = values({5, 3}, kFloat32, 1), b = values({4, 2}, kBFloat16, 2);
  save_safetensors(path,
                   {{"a", a.cuda()}, {"bt", b.cuda().t()}, {"e", values({0}, kInt64, 3).cuda()}});
  const SafetensorsFile f = load_safetensors(path);
  expect_bit_equal(f.at("a"), a, "a");
  expect_bit_equal(f.at("bt"), b.t().contiguous(), "bt");
  EXPECT_EQ(f.at("e").numel(), 0);
}

TEST(Safetensors, LayoutFollowsTheSpec) {
  TempDir dir;
  const std::string path = dir.file("layout.safetensors");
  // Mixed element sizes in an order that would misalign the 8-byte ones if kept.
  NamedTensors ts = {{"u8", values({3}, kUInt8, 1)},    {"f64", values({2}, kFloat64, 2)},
                     {"f16", values({3}, kFloat16, 3)}, {"b", values({1}, kBool, 4)},
                     {"i32", values({5}, kInt32, 5)},   {"i64", values({1}, kInt64, 6)},
                     {"z", values({0}, kFloat64, 7)}};
  save_safetensors(path, ts, {{"k", "v"}});
  const std::string bytes = read_bytes(path);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int k = 7; k >= 0; --k) n = (n << 8) | static_cast<unsigned char>(bytes[k]);
  EXPECT_EQ(n % 8, 0u) << "header size " << n << " is not padded to a multiple of 8";
  ASSERT_LE(8 + n, bytes.size());
  const std::string header = bytes.substr(8, n);
  EXPECT_EQ(header.front(), '{');
  const size_t close = header.find_last_not_of(' ');
  EXPECT_EQ(header[close], '}');
  EXPECT_LT(header.size() - close - 1, 8u) << "padding is more than 7 spaces";
  const auto j = nlohmann::ordered_json::parse(header);
  std::vector<std::string> keys;
  for (const auto& item : j.items()) keys.push_back(item.key());
  EXPECT_EQ(keys,
            (std::vector<std::string>{"__metadata__", "u8", "f64", "f16", "b", "i32", "i64", "z"}));
  EXPECT_EQ(j["__metadata__"], (nlohmann::ordered_json{{"k", "v"}}));
  const uint64_t data_bytes = bytes.size() - 8 - n;
  uint64_t total = 0;
  for (const auto& [name, t] : ts) {
    const auto& e = j[name];
    EXPECT_EQ(e["dtype"], st_name(t.dtype())) << name;
    EXPECT_EQ(e["shape"].get<std::vector<int64_t>>(), t.shape().vec()) << name;
    const uint64_t b = e["data_offsets"][0], end = e["data_offsets"][1];
    EXPECT_EQ(end - b, static_cast<uint64_t>(t.nbytes())) << name;
    EXPECT_EQ(b % t.element_size(), 0u) << name << " starts at " << b << ", misaligned";
    EXPECT_EQ(bytes.substr(8 + n + b, end - b), tensor_bytes(t)) << name;
    total += end - b;
  }
  EXPECT_EQ(total, data_bytes);
  // Order of the data: by element size, stable.
  EXPECT_EQ(j["f64"]["data_offsets"][0], 0);
  EXPECT_EQ(j["z"]["data_offsets"][0], 24);  // after f64 (16) and i64 (8)
}

TEST(Safetensors, EmptyCheckpointAndNullMetadata) {
  TempDir dir;
  const std::string path = dir.file("empty.safetensors");
  save_safetensors(path, {});
  EXPECT_EQ(read_bytes(path), le64(8) + "{}      ");
  SafetensorsFile f = load_safetensors(path);
  EXPECT_EQ(f.size(), 0u);
  EXPECT_TRUE(f.metadata().empty());
  save_safetensors(path, {}, {{"only", "metadata"}});
  f = load_safetensors(path);
  EXPECT_EQ(f.size(), 0u);
  EXPECT_EQ(f.metadata().at("only"), "metadata");
  write_bytes(path, craft(R"({"__metadata__":null})"));
  EXPECT_TRUE(load_safetensors(path).metadata().empty());
}

TEST(Safetensors, ZeroSizeTensorsAnywhereAndOfHugeExtent) {
  TempDir dir;
  const std::string path = dir.file("z.safetensors");
  // Zero-size entries at the start, between, and at the end of the data; one with 2^62 rows.
  write_bytes(path, craft(R"({"z0":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},)"
                          R"("a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                          R"("z1":{"dtype":"F64","shape":[4611686018427387904,0],)"
                          R"("data_offsets":[2,2]},)"
                          R"("b":{"dtype":"U8","shape":[1],"data_offsets":[2,3]},)"
                          R"("z2":{"dtype":"BOOL","shape":[0,5],"data_offsets":[3,3]}})",
                          "\x01\x02\x03"));
  const SafetensorsFile f = load_safetensors(path);
  ASSERT_EQ(f.size(), 5u);
  EXPECT_EQ(f.tensors()[2].first, "z1");
  EXPECT_EQ(f.at("z1").numel(), 0);
  EXPECT_EQ(f.at("z1").shape(), Shape({int64_t{1} << 62, 0}));
  EXPECT_EQ(f.at("a").to_vector<uint8_t>(), (std::vector<uint8_t>{1, 2}));
  EXPECT_EQ(f.at("b").to_vector<uint8_t>(), (std::vector<uint8_t>{3}));
  EXPECT_EQ(f.at("z2").shape(), Shape({0, 5}));
}

TEST(Safetensors, BoolBytesOtherThanZeroOrOneReadAsTrue) {
  TempDir dir;
  const std::string path = dir.file("bool.safetensors");
  write_bytes(path, craft(R"({"b":{"dtype":"BOOL","shape":[4],"data_offsets":[0,4]}})",
                          std::string("\x00\x01\x02\xff", 4)));
  const Tensor b = load_safetensors(path).at("b");
  EXPECT_EQ(tensor_bytes(b), std::string("\x00\x01\x01\x01", 4));
  EXPECT_EQ(b.to_vector<bool>(), (std::vector<bool>{false, true, true, true}));
}

TEST(Safetensors, LookupOfAMissingNameIsAnIndexError) {
  TempDir dir;
  const std::string path = dir.file("l.safetensors");
  save_safetensors(path, {{"w", values({2}, kFloat32, 1)}});
  const SafetensorsFile f = load_safetensors(path);
  EXPECT_EQ(f.find("nope"), nullptr);
  EXPECT_FALSE(f.contains("nope"));
  expect_error<IndexError>([&] { (void)f.at("nope"); }, {"[SafetensorsFile]", "'nope'"});
  expect_error<ValueError>(
      [&] {
        SafetensorsFile({{"a", Tensor()}, {"a", Tensor()}}, {});
      },
      {"[SafetensorsFile]", "'a' twice"});
}

// ---- safetensors: save errors -------------------------------------------------------------------

TEST(Safetensors, SaveRejectsBadInputNamingThePath) {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  const Tensor x = values({2}, kFloat32, 1);
  expect_error<ValueError>(
      [&] {
        save_safetensors(path, {{"x", x}, {"y", Tensor()}});
      },
      {"[save_safetensors]", path, "'y'", "undefined"});
  expect_error<ValueError>(
      [&] {
        save_safetensors(path, {{"x", x}, {"x", x}});
      },
      {"[save_safetensors]", path, "'x' twice"});
  expect_error<ValueError>(
      [&] {
        save_safetensors(path, {{"__metadata__", x}});
      },
      {"[save_safetensors]", path, "'__metadata__' is reserved"});
  expect_error<ValueError>(
      [&] {
        save_safetensors(path, {{"bad\xff", x}});
      },
      {"[save_safetensors]", path, "tensor name", "bad\\xff", "not valid UTF-8"});
  expect_error<ValueError>(
      [&] {
        save_safetensors(path, {{"x", x}}, {{"k", "\xc3"}});
      },
      {"[save_safetensors]", path, "metadata value", "not valid UTF-8"});
  EXPECT_TRUE(dir.list().empty()) << "a rejected save created a file";
  const std::string missing = dir.file("missing/dir/x.safetensors");
  expect_error(
      [&] {
        save_safetensors(missing, {{"x", x}});
      },
      {missing, "No such file or directory"});
}

TEST(Safetensors, FailedSaveKeepsThePreviousCheckpoint) {
  TempDir dir;
  const std::string path = dir.file("ckpt.safetensors");
  const NamedTensors v1 = {{"w", values({64, 64}, kFloat32, 1)}};
  const NamedTensors v2 = {{"w", values({64, 64}, kFloat32, 2)}, {"b", values({64}, kInt64, 3)}};
  save_safetensors(path, v1, {{"step", "1"}});
  detail::inject_atomic_write_fault(AtomicWriteStep::kWrite, ENOSPC, /*after_bytes=*/9000);
  expect_error(
      [&] {
        save_safetensors(path, v2, {{"step", "2"}});
      },
      {path, "No space left on device"});
  detail::inject_atomic_write_fault(AtomicWriteStep::kNone, 0);
  EXPECT_EQ(dir.list(), std::vector<std::string>{"ckpt.safetensors"});
  const SafetensorsFile f = load_safetensors(path);
  EXPECT_EQ(f.metadata().at("step"), "1");
  ASSERT_EQ(f.size(), 1u);
  expect_bit_equal(f.at("w"), v1[0].second, "w");
}

// ---- safetensors: load errors -------------------------------------------------------------------

std::string repeat(const std::string& s, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out += s;
  return out;
}

TEST(Safetensors, LoadRejectsMalformedHeadersNamingTheProblem) {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  const std::string f32x2 = R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string d8(8, '\0'), d12(12, '\0');
  const struct {
    std::string header, data;
    std::vector<std::string> says;
  } cases[] = {
      {R"({"a":)", d8, {"not valid JSON"}},
      {R"({} x)", "", {"not valid JSON"}},
      {"[1]", "", {"starting with '{'", "[1]"}},
      {" {}", "", {"starting with '{'"}},
      {"", "", {"starting with '{'"}},
      {R"({"a":3})", "", {"tensor 'a'", "expected an object", "3"}},
      {R"({"a":{"shape":[2],"data_offsets":[0,8]}})", d8, {"tensor 'a'", "missing field 'dtype'"}},
      {R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", d8, {"missing field 'shape'"}},
      {R"({"a":{"dtype":"F32","shape":[2]}})", d8, {"missing field 'data_offsets'"}},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})",
       d8,
       {"unexpected field 'x'"}},
      {R"({"a":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", d8, {"dtype must be a string"}},
      {R"({"a":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})",
       d8,
       {"unknown dtype 'F33'", "supported: BOOL, U8, I32, I64, F16, BF16, F32, F64"}},
      {R"({"a":{"dtype":"I8","shape":[8],"data_offsets":[0,8]}})",
       d8,
       {"tensor 'a'", "safetensors dtype 'I8' has no Ember equivalent"}},
      {R"({"a":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}})", d8, {"unknown dtype 'f32'"}},
      {R"({"a":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", d8, {"shape must be an array"}},
      {R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})",
       d8,
       {"shape must hold non-negative integers", "-2", "negative integer"}},
      {R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})",
       d8,
       {"shape must hold non-negative integers", "2.0"}},
      {R"({"a":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}})",
       d8,
       {"non-negative integers", "string"}},
      {R"({"a":{"dtype":"F32","shape":[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,2],"data_offsets":[0,8]}})",
       d8,
       {"has 17 dims", "at most 16"}},
      {R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})",
       d8,
       {"too many elements"}},
      {R"({"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]}})",
       d8,
       {"too many bytes"}},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})",
       d8,
       {"data_offsets must be an array [begin, end]", "[0]"}},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":{"b":0}}})",
       d8,
       {"data_offsets must be an array"}},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", d8, {"[8, 0]", "begin <= end"}},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", d8, {"[0, 16]", "<= 8"}},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551615]}})",
       d8,
       {"<= 8"}},
      {R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})",
       d8,
       {"span 8 bytes", "F32", "[3]", "need 12"}},
      {R"({"a":)" + f32x2 + R"(,"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       d12,
       {"tensor 'b'", "overlap tensor 'a'", "[0, 8]"}},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
       R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
       d12,
       {"gap in the data", "tensor 'b' begins at 8", "ends at 4"}},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
       d8,
       {"gap in the data", "begins at 4"}},
      {R"({"a":)" + f32x2 + "}", d12, {"cover 8 bytes", "12 bytes of data after the header"}},
      {R"({"a":)" + f32x2 + R"(,"a":)" + f32x2 + "}", d8, {"key 'a' twice", "two tensors"}},
      {R"({"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
       d8,
       {"key 'dtype' twice"}},
      {R"({"__metadata__":{"k":1}})", "", {"__metadata__ value of key 'k' must be a string"}},
      {R"({"__metadata__":[1]})", "", {"__metadata__ must be an object of strings"}},
      {R"({"__metadata__":{"k":"v"},"__metadata__":{}})", "", {"key '__metadata__' twice"}},
      {R"({"__metadata__":{"k":[[[[[[[[[[[[1]]]]]]]]]]]]}})", "", {"nests deeper than 8"}},
      {"{\"\xff\":1}", "", {"not valid JSON", "\\xff"}},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "", {"<= 0"}},
      // Text after a NUL byte would go unread (the JSON parser stops there).
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})" + std::string(1, '\0') +
           R"( not json {"a":)",
       d8,
       {"header holds a NUL byte at 54 of its 70 bytes"}},
      // A long array is refused while parsing, before its tree costs 8 times its text.
      {R"({"a":{"dtype":"F32","shape":[0)" + repeat(",0", 99) + R"(],"data_offsets":[0,0]}})",
       "",
       {"an array of more than 64 elements", "at most 16 dims"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE("header: " + c.header);
    write_bytes(path, craft(c.header, c.data));
    std::vector<std::string_view> parts = {"[load_safetensors]", path};
    for (const auto& s : c.says) parts.push_back(s);
    try {
      (void)load_safetensors(path);
      ADD_FAILURE() << "loaded without an error";
    } catch (const ValueError& e) {
      for (std::string_view p : parts) {
        EXPECT_NE(std::string(e.what()).find(p), std::string::npos)
            << "message lacks '" << p << "': " << e.what();
      }
    }
  }
}

TEST(Safetensors, LoadRejectsBadSizesAndFiles) {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  write_bytes(path, "");
  expect_error<ValueError>([&] { load_safetensors(path); },
                           {"[load_safetensors]", path, "0 bytes", "8-byte header size"});
  write_bytes(path, "abc");
  expect_error<ValueError>([&] { load_safetensors(path); }, {path, "3 bytes"});
  write_bytes(path, le64(100) + "{}");
  expect_error<ValueError>([&] { load_safetensors(path); },
                           {path, "header size 100 exceeds the 2 bytes", "file size 10"});
  write_bytes(path, le64(200'000'000) + "{}");
  expect_error<ValueError>([&] { load_safetensors(path); },
                           {path, "header size 200000000 exceeds the limit of 100000000"});
  write_bytes(path, le64(UINT64_MAX) + "{}");
  expect_error<ValueError>([&] { load_safetensors(path); },
                           {path, "header size 18446744073709551615 exceeds the limit"});

  const std::string missing = dir.file("missing.safetensors");
  expect_error([&] { load_safetensors(missing); },
               {"[load_safetensors]", missing, "No such file or directory"});
  expect_error([&] { load_safetensors(dir.path()); }, {dir.path(), "not a regular file"});
  // A FIFO with no writer: opening it must not block.
  const std::string fifo = dir.file("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  expect_error([&] { load_safetensors(fifo); }, {fifo, "not a regular file"});
}

// ---- safetensors: fuzzing
// ------------------------------------------------------------------------

// Every strict prefix of a valid file is invalid (the data no longer covers what the header
// promises, or the header itself is cut): each must be an ember::Error, never a crash.
TEST(SafetensorsFuzz, EveryTruncationIsAnEmberError) {
  TempDir dir;
  const std::string good = dir.file("good.safetensors"), cut = dir.file("cut.safetensors");
  save_safetensors(good, sample_tensors(), {{"format", "pt"}, {"note", "fuzz"}});
  const std::string bytes = read_bytes(good);
  ASSERT_GT(bytes.size(), 200u);
  for (size_t len = 0; len < bytes.size(); ++len) {
    write_bytes(cut, bytes.substr(0, len));
    bool threw = false;
    const std::string bad = run_expecting_ember_error([&] { load_safetensors(cut); }, &threw);
    ASSERT_TRUE(bad.empty()) << "length " << len << ": " << bad;
    ASSERT_TRUE(threw) << "a file truncated to " << len << " of " << bytes.size()
                       << " bytes loaded without an error";
  }
  // Appending bytes is as wrong as removing them.
  write_bytes(cut, bytes + "x");
  expect_error<ValueError>([&] { load_safetensors(cut); }, {"bytes of data after the header"});
}

// Corrupt every byte of the size field and the header in many ways: the load either succeeds
// (e.g. a changed letter in a name) with tensors consistent with the file, or throws
// ember::Error. Anything else (a crash, a foreign exception, a hang) fails the test.
TEST(SafetensorsFuzz, CorruptHeaderBytesNeverCrash) {
  TempDir dir;
  const std::string good = dir.file("good.safetensors"), bad = dir.file("bad.safetensors");
  save_safetensors(good, sample_tensors(), {{"format", "pt"}});
  const std::string bytes = read_bytes(good);
  uint64_t n = 0;
  for (int k = 7; k >= 0; --k) n = (n << 8) | static_cast<unsigned char>(bytes[k]);
  const size_t header_end = 8 + n;
  std::vector<std::function<char(char)>> edits;
  for (int bit = 0; bit < 8; ++bit) edits.push_back([bit](char c) { return c ^ (1 << bit); });
  static const char kReplacements[] = "{}[]\",:-.0139e \\\x00\xff\x80";
  for (char r : std::string(kReplacements, sizeof(kReplacements) - 1)) {
    edits.push_back([r](char) { return r; });
  }
  int loaded = 0, rejected = 0;
  for (size_t pos = 0; pos < header_end; ++pos) {
    for (size_t k = 0; k < edits.size(); ++k) {
      std::string b = bytes;
      b[pos] = edits[k](b[pos]);
      if (b == bytes) continue;
      write_bytes(bad, b);
      bool threw = false;
      const std::string what = run_expecting_ember_error(
          [&] {
            const SafetensorsFile f = load_safetensors(bad);
            int64_t total = 0;
            for (const auto& [name, t] : f.tensors()) total += t.nbytes();
            EXPECT_EQ(static_cast<uint64_t>(total), bytes.size() - header_end)
                << "byte " << pos << " edit " << k << " loaded tensors not covering the data";
          },
          &threw);
      ASSERT_TRUE(what.empty()) << "byte " << pos << " edit " << k << ": " << what;
      (threw ? rejected : loaded)++;
    }
  }
  EXPECT_GT(rejected, 0);
  std::cout << "[ fuzz     ] " << rejected << " corrupt headers rejected, " << loaded
            << " still valid\n";
}

// Random multi-byte corruption anywhere in the file, with a fixed seed.
TEST(SafetensorsFuzz, RandomCorruptionNeverCrashes) {
  TempDir dir;
  const std::string good = dir.file("good.safetensors"), bad = dir.file("bad.safetensors");
  save_safetensors(good, sample_tensors(), {{"format", "pt"}});
  const std::string bytes = read_bytes(good);
  uint64_t s = 12345;
  auto next = [&] {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return s >> 33;
  };
  for (int iter = 0; iter < 3000; ++iter) {
    std::string b = bytes;
    const int edits = 1 + static_cast<int>(next() % 4);
    for (int e = 0; e < edits; ++e) {
      // Bias towards the header, where the structure is.
      const size_t limit = next() % 4 ? std::min<size_t>(b.size(), 8 + 64 * 8) : b.size();
      b[next() % limit] = static_cast<char>(next());
    }
    if (next() % 5 == 0) b.resize(next() % (b.size() + 1));
    write_bytes(bad, b);
    bool threw = false;
    const std::string what = run_expecting_ember_error([&] { load_safetensors(bad); }, &threw);
    ASSERT_TRUE(what.empty()) << "iteration " << iter << ": " << what;
  }
}

// ---- interop with an independent Python reader/writer -------------------------------------------

/// tests/nn/safetensors_reader.py in the source tree (EMBER_SOURCE_DIR is set by
/// tests/CMakeLists.txt), or the path in EMBER_SAFETENSORS_READER.
std::string reader_script() {
  if (const char* env = std::getenv("EMBER_SAFETENSORS_READER")) return env;
  const fs::path p = fs::path(EMBER_SOURCE_DIR) / "tests/nn/safetensors_reader.py";
  return fs::exists(p) ? p.string() : "";
}

/// Whether /usr/bin/python3 exists and imports torch and numpy (checked once: ~2 s).
bool python_torch_available() {
  static const bool ok =
      ::access("/usr/bin/python3", X_OK) == 0 &&
      std::system("/usr/bin/python3 -c 'import torch, numpy' >/dev/null 2>&1") == 0;
  return ok;
}

/// Skips the test unless /usr/bin/python3 can import torch; defines `script`, the reader's path.
#define REQUIRE_PYTHON_TORCH(script)                                                 \
  if (!python_torch_available())                                                     \
    GTEST_SKIP() << "/usr/bin/python3 with torch and numpy is not available";        \
  const std::string script = reader_script();                                        \
  ASSERT_FALSE(script.empty()) << "cannot find tests/nn/safetensors_reader.py (set " \
                                  "EMBER_SAFETENSORS_READER to its path)"

/// Runs the script, returning its stdout parsed as JSON; fails the test with its stderr.
nlohmann::json run_script(const std::string& script, const std::string& args, const TempDir& dir) {
  const std::string err = dir.file("stderr.txt");
  const std::string cmd = "/usr/bin/python3 '" + script + "' " + args + " 2>'" + err + "'";
  FILE* p = ::popen(cmd.c_str(), "r");
  EXPECT_NE(p, nullptr) << cmd;
  if (!p) return {};
  std::string out;
  char buf[4096];
  for (size_t r; (r = std::fread(buf, 1, sizeof(buf), p)) > 0;) out.append(buf, r);
  const int status = ::pclose(p);
  EXPECT_EQ(status, 0) << cmd << " failed:\n" << read_bytes(err);
  if (status != 0) return {};
  try {
    return nlohmann::json::parse(out);
  } catch (const nlohmann::json::exception& e) {
    ADD_FAILURE() << "script output is not JSON (" << e.what() << "): " << out;
    return {};
  }
}

/// Expects the script's description `d` of tensor `t` (dtype, shape, bytes, torch's values).
void expect_described(const nlohmann::json& d, const Tensor& t, const std::string& name) {
  SCOPED_TRACE("tensor '" + name + "'");
  ASSERT_TRUE(d.is_object());
  EXPECT_EQ(d["dtype"], st_name(t.dtype()));
  EXPECT_EQ(d["shape"].get<std::vector<int64_t>>(), t.shape().vec());
  EXPECT_EQ(d["hex"], hex(tensor_bytes(t)));
  const auto& vals = d["values"];
  ASSERT_EQ(vals.size(), static_cast<size_t>(t.numel()));
  if (t.dtype() == kBool) {
    const auto want = t.to_vector<bool>();
    for (size_t i = 0; i < vals.size(); ++i) EXPECT_EQ(vals[i], want[i]) << "index " << i;
  } else if (!t.is_floating_point()) {
    const auto want = t.to_vector<int64_t>();
    for (size_t i = 0; i < vals.size(); ++i) EXPECT_EQ(vals[i], want[i]) << "index " << i;
  } else {
    const auto want = t.to_vector<double>();
    for (size_t i = 0; i < vals.size(); ++i) {
      if (vals[i].is_string()) {
        const std::string s = vals[i];
        if (s == "nan") {
          EXPECT_TRUE(std::isnan(want[i])) << "index " << i << ": torch nan, ember " << want[i];
        } else {
          EXPECT_EQ(want[i], s == "inf" ? INFINITY : -INFINITY) << "index " << i;
        }
      } else {
        EXPECT_EQ(vals[i].get<double>(), want[i]) << "index " << i;
      }
    }
  }
}

TEST(SafetensorsInterop, PythonReadsWhatEmberWrites) {
  REQUIRE_PYTHON_TORCH(script);
  TempDir dir;
  const std::string path = dir.file("ember.safetensors");
  NamedTensors ts = sample_tensors();
  ts.emplace_back("special_f16",
                  from_raw<uint16_t>({0x7e00, 0xfc00, 0x8000, 0x0001, 0x7bff}, kFloat16));
  ts.emplace_back("special_bf16", from_raw<uint16_t>({0x7fc0, 0x7f80, 0x8000, 0x0001}, kBFloat16));
  ts.emplace_back("i64_limits", from_raw<int64_t>({INT64_MIN, INT64_MAX}, kInt64));
  ts.emplace_back("transposed", values({3, 4}, kFloat64, 77).t());
  ts.emplace_back("layer.0/größe", values({2, 2, 2}, kFloat32, 78));
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"ünï", "cödé"}};
  save_safetensors(path, ts, meta);

  const nlohmann::json d = run_script(script, "dump '" + path + "'", dir);
  ASSERT_TRUE(d.is_object());
  EXPECT_EQ(d["header_padded"], true) << "header size " << d["header_size"];
  EXPECT_EQ(d["header_size"].get<uint64_t>() % 8, 0u);
  EXPECT_EQ(d["metadata"], nlohmann::json(meta));
  std::vector<std::string> names;
  for (const auto& [name, t] : ts) names.push_back(name);
  EXPECT_EQ(d["order"].get<std::vector<std::string>>(), names);
  for (const auto& [name, t] : ts) expect_described(d["tensors"][name], t, name);
}

TEST(SafetensorsInterop, EmberReadsWhatPythonWrites) {
  REQUIRE_PYTHON_TORCH(script);
  for (const char* flag : {"", " --no-pad"}) {
    SCOPED_TRACE(std::string("python writer flags: '") + flag + "'");
    TempDir dir;
    const std::string path = dir.file("python.safetensors");
    const nlohmann::json d = run_script(script, "write '" + path + "'" + flag, dir);
    ASSERT_TRUE(d.is_object());
    EXPECT_EQ(d["header_padded"], std::string(flag).empty());
    const SafetensorsFile f = load_safetensors(path);
    const auto order = d["order"].get<std::vector<std::string>>();
    ASSERT_EQ(f.size(), order.size());
    for (size_t i = 0; i < order.size(); ++i) {
      EXPECT_EQ(f.tensors()[i].first, order[i]) << "position " << i;
    }
    EXPECT_EQ(nlohmann::json(f.metadata()), d["metadata"]);
    for (const auto& [name, t] : f.tensors()) expect_described(d["tensors"][name], t, name);
    // Values PyTorch made, checked independently of the script's description (printed with
    // torch 1.13: torch.tensor([1.0, 65504.0, 6e-8, -0.5, inf], dtype=torch.float16)).
    EXPECT_EQ(f.at("f16").to_vector<double>(),
              (std::vector<double>{1.0, 65504.0, 5.9604644775390625e-08, -0.5, INFINITY}));
    EXPECT_EQ(f.at("i64").to_vector<int64_t>(),
              (std::vector<int64_t>{INT64_MIN, INT64_MAX, 0, 42}));
    EXPECT_EQ(f.at("scalar").dim(), 0);
    EXPECT_EQ(f.at("empty").shape(), Shape({0, 3}));
    EXPECT_EQ(f.metadata().at("format"), "pt");
  }
}

TEST(SafetensorsInterop, PythonRejectsNothingEmberWritesAndEmberRoundTripsIt) {
  // Write with Ember, read with Python, write the same tensors with Python and load that in
  // Ember: both files must describe identical tensors.
  REQUIRE_PYTHON_TORCH(script);
  TempDir dir;
  const std::string py = dir.file("py.safetensors");
  const nlohmann::json d = run_script(script, "write '" + py + "'", dir);
  ASSERT_TRUE(d.is_object());
  const SafetensorsFile a = load_safetensors(py);
  const std::string em = dir.file("em.safetensors");
  save_safetensors(em, a.tensors(), a.metadata());
  const nlohmann::json e = run_script(script, "dump '" + em + "'", dir);
  ASSERT_TRUE(e.is_object());
  EXPECT_EQ(e["order"], d["order"]);
  EXPECT_EQ(e["metadata"], d["metadata"]);
  for (const auto& [name, t] : a.tensors()) {
    EXPECT_EQ(e["tensors"][name]["hex"], d["tensors"][name]["hex"]) << name;
    EXPECT_EQ(e["tensors"][name]["shape"], d["tensors"][name]["shape"]) << name;
    EXPECT_EQ(e["tensors"][name]["dtype"], d["tensors"][name]["dtype"]) << name;
  }
}

}  // namespace
}  // namespace ember::nn
