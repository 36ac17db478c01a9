// The byte-level token stream: the token file (built atomically, memory-mapped), the split, and
// the windows each rank draws per step (seed + epoch, disjoint across ranks).
#include <ember/nn/data/token_stream.h>

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <chrono>
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
