// The byte-level token stream: the token file (built atomically, memory-mapped), the split, and
// the windows each rank draws per step (seed + epoch, disjoint across ranks).
#include <ember/nn/data/token_stream.h>
#include <ember/nn/io/atomic_file.h>

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "tests/temp_dir.h"
#include "tests/tensor/test_util.h"

namespace ember::nn::data {
namespace {

namespace fs = std::filesystem;
using ember::test::expect_error;
using ember::test::TempDir;

// Writes `bytes` to `name` in `dir` and returns the file's path.
std::string write_file(const TempDir& dir, const std::string& name, const std::string& bytes) {
  const std::string p = dir.file(name);
  std::ofstream(p, std::ios::binary) << bytes;
  return p;
}

// Bytes whose value says where they are (position mod 251, a prime), so a window's content
// names its offset.
std::string counting_text(int64_t n) {
  std::string s(static_cast<size_t>(n), '\0');
  for (int64_t i = 0; i < n; ++i) s[static_cast<size_t>(i)] = static_cast<char>(i % 251);
  return s;
}

std::shared_ptr<const TokenFile> tokens_of(const TempDir& dir, int64_t n) {
  const std::string src = write_file(dir, "text.txt", counting_text(n));
  return std::make_shared<const TokenFile>(prepare_token_file(src, dir.file("cache")));
}

TEST(TokenStream, PrepareWritesTheBytesOnceAndMapsThem) {
  TempDir dir;
  const std::string text = "In the beginning was the byte.\n";
  const std::string src = write_file(dir, "prose.txt", text);
  const std::string path = prepare_token_file(src, dir.file("cache/sub"));
  EXPECT_EQ(path, dir.file("cache/sub/prose.txt.tokens"));
  const auto built = fs::last_write_time(path);
  EXPECT_EQ(prepare_token_file(src, dir.file("cache/sub")), path);
  EXPECT_EQ(fs::last_write_time(path), built) << "an up-to-date token file is not rebuilt";
  const TokenFile f(path);
  ASSERT_EQ(f.size(), static_cast<int64_t>(text.size()));
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(f.data()), text.size()), text);
  // Nothing but the token file and what it was built from is left in the cache (no temp file
  // of the atomic writes).
  std::set<std::string> entries;
  for (const auto& e : fs::directory_iterator(dir.file("cache/sub"))) {
    entries.insert(e.path().filename().string());
  }
  EXPECT_EQ(entries, (std::set<std::string>{"prose.txt.tokens", "prose.txt.tokens.source"}));
}

// Two files of one name in two folders (the second one older), through one cache: each run
// trains on its own file's tokens, never the other's; an edited file is rebuilt too.
TEST(TokenStream, AnotherFileOfTheSameNameIsNeverTakenFromTheCache) {
  TempDir dir;
  fs::create_directories(dir.file("a"));
  fs::create_directories(dir.file("b"));
  const std::string a = write_file(dir, "a/train.txt", "the tokens of a\n");
  const std::string b = write_file(dir, "b/train.txt", "b's, an older file\n");
  fs::last_write_time(b, fs::last_write_time(a) - std::chrono::hours(1));
  auto tokens_of = [&](const std::string& src) {
    const TokenFile f(prepare_token_file(src, dir.file("cache")));
    return std::string(reinterpret_cast<const char*>(f.data()), static_cast<size_t>(f.size()));
  };
  EXPECT_EQ(tokens_of(a), "the tokens of a\n");
  EXPECT_EQ(tokens_of(b), "b's, an older file\n");
  EXPECT_EQ(tokens_of(a), "the tokens of a\n");
  std::ofstream(a, std::ios::app) << "and more\n";
  EXPECT_EQ(tokens_of(a), "the tokens of a\nand more\n");
}

// A cache entry rebuilt for another source whose key could not be written (the process dying
// between the two writes, here the key's write failing) is not taken for the old source's: the
// old key is gone before the new tokens land.
TEST(TokenStream, TokensWithoutTheirKeyAreRebuiltNotReused) {
  TempDir dir;
  fs::create_directories(dir.file("a"));
  fs::create_directories(dir.file("b"));
  const std::string a = write_file(dir, "a/train.txt", "the tokens of a\n");
  const std::string b = write_file(dir, "b/train.txt", "the tokens of b\n");
  auto tokens_of = [&](const std::string& src) {
    const TokenFile f(prepare_token_file(src, dir.file("cache")));
    return std::string(reinterpret_cast<const char*>(f.data()), static_cast<size_t>(f.size()));
  };
  EXPECT_EQ(tokens_of(a), "the tokens of a\n");
  ember::detail::inject_atomic_write_fault(ember::detail::AtomicWriteStep::kCreate, ENOSPC, 0,
                                           /*skip=*/1);
  EXPECT_THROW(tokens_of(b), Error);  // b's tokens written, its key not
  EXPECT_EQ(tokens_of(a), "the tokens of a\n");
  EXPECT_EQ(tokens_of(b), "the tokens of b\n");
}

TEST(TokenStream, WindowsAreShiftedByOneToken) {
  TempDir dir;
  TokenStream s(tokens_of(dir, 5000), {.context = 16, .batch_size = 4, .seed = 3});
  const std::vector<int64_t> off = s.train_offsets(0);
  const Batch b = s.train_batch(0);
  ASSERT_EQ(b.data.shape(), (Shape{4, 16}));
  ASSERT_EQ(b.target.shape(), (Shape{4, 16}));
  EXPECT_EQ(b.data.dtype(), kInt64);
  const std::vector<int64_t> x = b.data.to_vector<int64_t>(), y = b.target.to_vector<int64_t>();
  for (int64_t i = 0; i < 4; ++i) {
    for (int64_t t = 0; t < 16; ++t) {
      EXPECT_EQ(x[i * 16 + t], (off[i] + t) % 251) << "window " << i << " token " << t;
      EXPECT_EQ(y[i * 16 + t], (off[i] + t + 1) % 251) << "window " << i << " token " << t;
    }
  }
}

TEST(TokenStream, OffsetsAreTorchsDistributedSamplerOrder) {
  TempDir dir;
  auto tokens = tokens_of(dir, 2000);
  TokenStream s(tokens, {.context = 10, .batch_size = 3, .seed = 7});
  // 2000 tokens, 200 held out: 1800 training tokens, 1790 window starts.
  EXPECT_EQ(s.train_tokens(), 1800);
  EXPECT_EQ(s.validation_tokens(), 200);
  EXPECT_EQ(s.steps_per_epoch(), 1790 / 3);
  const std::vector<int64_t> perm = torch_randperm(1790, 7);
  EXPECT_EQ(s.train_offsets(0), std::vector<int64_t>(perm.begin(), perm.begin() + 3));
  EXPECT_EQ(s.train_offsets(2), std::vector<int64_t>(perm.begin() + 6, perm.begin() + 9));
  // The next epoch shuffles with seed + 1.
  const std::vector<int64_t> perm1 = torch_randperm(1790, 8);
  EXPECT_EQ(s.train_offsets(s.steps_per_epoch()),
            std::vector<int64_t>(perm1.begin(), perm1.begin() + 3));
}

TEST(TokenStream, DeterministicPerSeedAndEpoch) {
  TempDir dir;
  auto tokens = tokens_of(dir, 3000);
  TokenStream a(tokens, {.context = 8, .batch_size = 4, .seed = 1});
  TokenStream b(tokens, {.context = 8, .batch_size = 4, .seed = 1});
  TokenStream c(tokens, {.context = 8, .batch_size = 4, .seed = 2});
  const int64_t spe = a.steps_per_epoch();
  // b visits the steps out of order (a resumed run jumps to its step): the same windows.
  EXPECT_EQ(a.train_offsets(5), b.train_offsets(5));
  EXPECT_EQ(a.train_offsets(spe + 1), b.train_offsets(spe + 1));
  EXPECT_EQ(b.train_offsets(0), a.train_offsets(0));
  EXPECT_NE(a.train_offsets(0), c.train_offsets(0));
  EXPECT_NE(a.train_offsets(0), a.train_offsets(spe));
}

TEST(TokenStream, RanksDrawDisjointWindowsEachEpoch) {
  TempDir dir;
  auto tokens = tokens_of(dir, 1000);
  TokenStream r0(tokens, {.context = 8, .batch_size = 5, .world_size = 2, .rank = 0, .seed = 4});
  TokenStream r1(tokens, {.context = 8, .batch_size = 5, .world_size = 2, .rank = 1, .seed = 4});
  ASSERT_EQ(r0.steps_per_epoch(), r1.steps_per_epoch());
  std::set<int64_t> seen;
  int64_t drawn = 0;
  for (int64_t step = 0; step < r0.steps_per_epoch(); ++step) {
    for (TokenStream* s : {&r0, &r1}) {
      for (int64_t o : s->train_offsets(step)) {
        EXPECT_TRUE(seen.insert(o).second) << "window " << o << " drawn twice at step " << step;
        EXPECT_GE(o, 0);
        EXPECT_LE(o + 8 + 1, r0.train_tokens()) << "a training window reaches the validation split";
        ++drawn;
      }
    }
  }
  EXPECT_EQ(drawn, (900 - 8) / 10 * 10);
}

TEST(TokenStream, ValidationWindowsLieInTheSplitAndDifferPerRank) {
  TempDir dir;
  auto tokens = tokens_of(dir, 4000);
  TokenStream r0(tokens, {.context = 16, .batch_size = 2, .world_size = 2, .rank = 0});
  TokenStream r1(tokens, {.context = 16, .batch_size = 2, .world_size = 2, .rank = 1});
  std::set<int64_t> seen;
  for (int64_t b = 0; b < 3; ++b) {
    EXPECT_EQ(r0.validation_offsets(b, 3), r0.validation_offsets(b, 3));
    for (TokenStream* s : {&r0, &r1}) {
      for (int64_t o : s->validation_offsets(b, 3)) {
        EXPECT_GE(o, s->train_tokens());
        EXPECT_LE(o + 16 + 1, 4000);
        EXPECT_TRUE(seen.insert(o).second) << "validation window " << o << " twice";
      }
    }
  }
  // Spread from the split's first start to its last: 12 windows over 400 - 16 starts.
  EXPECT_EQ(*seen.begin(), 3600);
  EXPECT_EQ(*seen.rbegin(), 4000 - 16 - 1);
  const Batch v = r1.validation_batch(0, 3);
  EXPECT_EQ(v.data.shape(), (Shape{2, 16}));
}

TEST(TokenStream, Errors) {
  TempDir dir;
  expect_error([&] { prepare_token_file(dir.file("missing.txt"), dir.path()); },
               {"[TokenStream]", "no text file", "missing.txt"});
  expect_error([&] { TokenFile f(dir.file("missing.tokens")); },
               {"[TokenStream]", "cannot open", "missing.tokens"});
  // A FIFO or a directory where the tokens should be: refused at once, naming it.
  const std::string fifo = dir.file("fifo.tokens");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_FALSE(is_llmc_token_file(fifo));
  expect_error([&] { TokenFile f(fifo); }, {"fifo.tokens", "is not a regular file"});
  expect_error([&] { TokenFile f(dir.path()); }, {"is not a regular file"});
  const std::string empty = write_file(dir, "empty.txt", "");
  expect_error([&] { prepare_token_file(empty, dir.file("cache")); }, {"empty.txt", "is empty"});
  expect_error([&] { TokenFile f(empty); }, {"empty.txt", "empty"});
  const std::string small =
      prepare_token_file(write_file(dir, "small.txt", counting_text(100)), dir.path());
  auto tokens = std::make_shared<const TokenFile>(small);
  // 90 training tokens: a step of 2 ranks x 8 windows of 80 needs 96.
  expect_error([&] { TokenStream s(tokens, {.context = 80, .batch_size = 8, .world_size = 2}); },
               {"too short", "training split holds 90 tokens", "needs at least 96"});
  // 10 validation tokens cannot hold a window of 32 + 1.
  expect_error([&] { TokenStream s(tokens, {.context = 32, .batch_size = 1}); },
               {"too short", "validation split holds 10 tokens", "needs 33"});
  expect_error([&] { TokenStream s(tokens, {.context = 0}); }, {"context >= 1, got 0"});
  expect_error([&] { TokenStream s(tokens, {.context = 4, .world_size = 2, .rank = 2}); },
               {"rank in [0, 2)", "got rank 2"});
  TokenStream s(tokens, {.context = 4, .batch_size = 2});
  expect_error([&] { s.validation_offsets(3, 3); }, {"validation batch in [0, 3), got 3"});
}

// ---- llm.c's token files ----

// llm.c's header: magic, version, count, then zeros to 256 int32, little-endian.
std::string llmc_header(int32_t magic, int32_t version, int32_t count) {
  std::string h(kLlmcHeaderBytes, '\0');
  const int32_t fields[3] = {magic, version, count};
  for (int f = 0; f < 3; ++f) {
    for (int b = 0; b < 4; ++b) {
      h[static_cast<size_t>(4 * f + b)] =
          static_cast<char>(static_cast<uint32_t>(fields[f]) >> (8 * b));
    }
  }
  return h;
}

// Tokens above 255 (both bytes of each matter): token i is (i * 257 + 3) mod 65536.
std::vector<uint16_t> wide_tokens(int64_t n) {
  std::vector<uint16_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = static_cast<uint16_t>(i * 257 + 3);
  return t;
}

TEST(TokenStream, LlmcFilesReadBackTheirUint16Tokens) {
  TempDir dir;
  const std::vector<uint16_t> want = wide_tokens(3000);
  const std::string path = dir.file("shard.bin");
  write_llmc_token_file(path, want);
  EXPECT_EQ(fs::file_size(path), static_cast<uintmax_t>(kLlmcHeaderBytes + 2 * 3000));
  {  // the header is llm.c's, byte for byte
    std::ifstream in(path, std::ios::binary);
    std::string head(kLlmcHeaderBytes, '\0');
    in.read(head.data(), kLlmcHeaderBytes);
    EXPECT_EQ(head, llmc_header(20240520, 1, 3000));
  }
  EXPECT_TRUE(is_llmc_token_file(path));
  const TokenFile f(path);
  EXPECT_EQ(f.size(), 3000);
  EXPECT_EQ(f.token_bytes(), 2);
  for (int64_t i = 0; i < f.size(); ++i) {
    ASSERT_EQ(f.token(i), want[static_cast<size_t>(i)]) << "token " << i;
  }
  EXPECT_EQ(f.max_token(), *std::max_element(want.begin(), want.end()));
  // The stream's windows hold the wide tokens, shifted by one.
  TokenStream s(std::make_shared<const TokenFile>(path), {.context = 8, .batch_size = 3});
  const std::vector<int64_t> off = s.train_offsets(1);
  const Batch b = s.train_batch(1);
  const std::vector<int64_t> x = b.data.to_vector<int64_t>(), y = b.target.to_vector<int64_t>();
  for (int64_t i = 0; i < 3; ++i) {
    for (int64_t t = 0; t < 8; ++t) {
      EXPECT_EQ(x[i * 8 + t], want[off[i] + t]) << "window " << i << " token " << t;
      EXPECT_EQ(y[i * 8 + t], want[off[i] + t + 1]) << "window " << i << " token " << t;
    }
  }
  // Already tokens: prepare_token_file hands the file back as it is and writes no cache.
  EXPECT_EQ(prepare_token_file(path, dir.file("cache")), path);
  EXPECT_FALSE(fs::exists(dir.file("cache")));
  // A byte file is one byte per token, as before.
  const TokenFile bytes(prepare_token_file(write_file(dir, "t.txt", "abc\n"), dir.file("c2")));
  EXPECT_FALSE(is_llmc_token_file(dir.file("t.txt")));
  EXPECT_EQ(bytes.token_bytes(), 1);
  EXPECT_EQ(bytes.size(), 4);
  EXPECT_EQ(bytes.token(0), 'a');
  EXPECT_EQ(bytes.max_token(), 'c');
}

TEST(TokenStream, LlmcHeaderErrorsNameTheFileAndBothValues) {
  TempDir dir;
  const std::string two_tokens = std::string("\x01\x02\x03\x04", 4);
  const std::string version = write_file(dir, "v2.bin", llmc_header(20240520, 2, 2) + two_tokens);
  expect_error([&] { TokenFile f(version); },
               {"v2.bin", "llm.c's magic", "its version is 2: expected 1"});
  const std::string count = write_file(dir, "count.bin", llmc_header(20240520, 1, 5) + two_tokens);
  expect_error([&] { TokenFile f(count); },
               {"count.bin", "count of 5 tokens disagrees with its size",
                "expected 1024 + 2 x 5 = 1034 bytes", "got 1028", "(2 tokens after the header)"});
  const std::string odd =
      write_file(dir, "odd.bin", llmc_header(20240520, 1, 2) + two_tokens + "x");
  expect_error([&] { TokenFile f(odd); },
               {"odd.bin", "expected 1024 + 2 x 2 = 1028 bytes, got 1029"});
  const std::string header_only = write_file(dir, "header.bin", llmc_header(20240520, 1, 0));
  expect_error([&] { TokenFile f(header_only); },
               {"header.bin", "holds no tokens", "got the header alone (its count is 0)"});
  const std::string cut = write_file(dir, "cut.bin", llmc_header(20240520, 1, 2).substr(0, 100));
  expect_error([&] { TokenFile f(cut); },
               {"cut.bin", "is 100 bytes long: expected a header of 1024 bytes"});
  // Writing: tokens must fit in uint16, and a failed write leaves no file behind.
  expect_error(
      [&] { write_llmc_token_file(dir.file("big.bin"), 3, [](int64_t i) { return i * 40000; }); },
      {"big.bin", "token 2", "is 80000: expected a uint16"});
  EXPECT_FALSE(fs::exists(dir.file("big.bin")));
  expect_error([&] { write_llmc_token_file(dir.file("none.bin"), std::vector<uint16_t>{}); },
               {"none.bin", "got 0"});
}

TEST(TokenStream, TokensAtOrAboveTheVocabularyAreRefusedOnce) {
  TempDir dir;
  const std::string path = dir.file("shard.bin");
  std::vector<uint16_t> tokens(600, 7);
  tokens[321] = 50303;
  write_llmc_token_file(path, tokens);
  auto f = std::make_shared<const TokenFile>(path);
  const TokenStreamOptions o{.context = 8, .batch_size = 2};
  TokenStreamOptions small = o, fits = o, unchecked = o;
  small.vocab = 50303;
  fits.vocab = 50304;
  expect_error(
      [&] { TokenStream s(f, small); },
      {"shard.bin", "holds token 50303", "vocabulary of 50303", "expected every token < 50303"});
  EXPECT_NO_THROW(TokenStream(f, fits));
  EXPECT_NO_THROW(TokenStream(f, unchecked));  // vocab 0: not checked
  // Bytes against a smaller vocabulary too.
  auto bytes = tokens_of(dir, 1000);  // 0 to 250
  TokenStreamOptions b = o;
  b.vocab = 200;
  expect_error([&] { TokenStream s(bytes, b); }, {"text.txt.tokens", "holds token 250"});
  b.vocab = 251;
  EXPECT_NO_THROW(TokenStream(bytes, b));
}

// Synthetic tokens: made once under a name that says what they are, the same for a seed, in
// [0, vocab) and spread over all of it.
TEST(TokenStream, SyntheticTokensAreMadeOnceAndCoverTheVocabulary) {
  TempDir dir;
  const std::string path = prepare_synthetic_token_file(dir.file("cache"), 1000, 50000, 3);
  EXPECT_EQ(path, dir.file("cache/synthetic-v1000-n50000-s3.bin"));
  const auto made = fs::last_write_time(path);
  EXPECT_EQ(prepare_synthetic_token_file(dir.file("cache"), 1000, 50000, 3), path);
  EXPECT_EQ(fs::last_write_time(path), made) << "an existing synthetic file is reused";
  const TokenFile f(path);
  ASSERT_EQ(f.size(), 50000);
  std::vector<int64_t> counts(1000, 0);
  double sum = 0;
  for (int64_t i = 0; i < f.size(); ++i) {
    const int64_t t = f.token(i);
    ASSERT_TRUE(t >= 0 && t < 1000) << "token " << i << " is " << t;
    ++counts[static_cast<size_t>(t)];
    sum += static_cast<double>(t);
  }
  // 50 draws per value on average: every value turns up, and the mean is (1000 - 1) / 2 to
  // within 5 standard errors (288.7 / sqrt(50000) = 1.29 each).
  EXPECT_EQ(std::count(counts.begin(), counts.end(), 0), 0);
  EXPECT_NEAR(sum / 50000, 499.5, 6.5);
  // Another seed, another file and other tokens.
  const TokenFile g(prepare_synthetic_token_file(dir.file("cache"), 1000, 50000, 4));
  EXPECT_EQ(g.path(), dir.file("cache/synthetic-v1000-n50000-s4.bin"));
  int64_t same = 0;
  for (int64_t i = 0; i < 1000; ++i) same += f.token(i) == g.token(i);
  EXPECT_LT(same, 20);
  expect_error([&] { prepare_synthetic_token_file(dir.path(), 65537, 10, 0); },
               {"vocabulary of 1 to 65536, got 65537"});
}

// The real data: the KJV as Debian's bible-kjv-text ships it, decoded by bible(1).
TEST(TokenStream, DecodesTheKingJamesBible) {
  if (!fs::exists(kKjvBible) || std::system("command -v bible >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "no " << kKjvBible << " or no bible(1) (install bible-kjv-text and bible-kjv)";
  }
  const std::string text = read_prose(kKjvBible);
  EXPECT_EQ(text.rfind("\nGenesis 1\n\nIn the beginning God created the heaven and the earth.\n",
                       0),
            0u)
      << text.substr(0, 200);
  EXPECT_NE(text.find("\nAnd God said, Let there be light: and there was light.\n"),
            std::string::npos);
  EXPECT_GT(text.size(), 4'000'000u);
  EXPECT_NE(text.find("The grace of our Lord Jesus Christ be with you all. Amen.\n"),
            std::string::npos);
}

}  // namespace
}  // namespace ember::nn::data
