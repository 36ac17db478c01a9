// Sharded checkpoints: 4 ranks (threads of this process, and gloo processes) save uneven pieces
// of tensors of several dtypes; the set is read back as 4, 2 and 1 readers over ranges that do
// not line up with the savers' pieces, consolidated into one safetensors file, overwritten,
// interrupted mid-save, and refused with every rank failing alike when the pieces do not tile.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <set>

#include <ember/distributed/backends/process_group_gloo.h>
#include <ember/distributed/checkpoint/sharded_checkpoint.h>
#include <ember/nn/io/atomic_file.h>
#include <ember/nn/io/serialize.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops.h>
#include "tests/distributed/ddp/ddp_test_util.h"
#include "tests/distributed/store/store_test_util.h"
#include "tests/distributed/backends/threads_test_util.h"

namespace ember::dist {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

// One logical tensor and how the saving ranks split it: {rank, offset, numel} per piece.
struct Spec {
  std::string name;
  std::vector<int64_t> shape;
  Dtype dtype;
  std::vector<std::array<int64_t, 3>> pieces;
};

// Uneven splits over 4 ranks: empty pieces, ranks that hold nothing of a tensor, pieces given
// out of rank order, a replicated scalar on rank 0, a zero-element tensor.
std::vector<Spec> four_rank_specs() {
  return {
      {"w", {5, 7}, kFloat32, {{0, 0, 10}, {1, 10, 0}, {2, 10, 13}, {3, 23, 12}}},
      {"b", {9}, kBFloat16, {{1, 0, 4}, {3, 4, 5}}},
      {"step", {}, kInt64, {{0, 0, 1}}},
      {"d", {3, 2}, kFloat64, {{3, 0, 6}}},
      {"h", {4}, kFloat16, {{2, 0, 1}, {0, 1, 3}}},
      {"mask", {6}, kBool, {{0, 0, 3}, {1, 3, 3}}},
      {"ids", {2, 5}, kInt64, {{3, 0, 2}, {2, 2, 7}, {0, 9, 1}}},
      {"empty", {0, 3}, kFloat32, {{0, 0, 0}}},
  };
}

// The same tensors split over 2 ranks.
std::vector<Spec> two_rank_specs() {
  std::vector<Spec> out;
  for (Spec s : four_rank_specs()) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    s.pieces = {{0, 0, n / 2}, {1, n / 2, n - n / 2}};
    out.push_back(s);
  }
  return out;
}

int64_t numel_of(const Spec& s) {
  int64_t n = 1;
  for (int64_t d : s.shape) n *= d;
  return n;
}

// Distinct values per tensor and per `seed`, exact in every dtype.
std::map<std::string, Tensor> make_values(const std::vector<Spec>& specs, int seed) {
  std::map<std::string, Tensor> out;
  for (size_t i = 0; i < specs.size(); ++i) {
    const Spec& s = specs[i];
    std::vector<double> v(static_cast<size_t>(numel_of(s)));
    for (size_t k = 0; k < v.size(); ++k) {
      v[k] = s.dtype == kBool ? static_cast<double>((k + seed) % 3)
                              : 0.5 * static_cast<double>(k) + seed * 100 + static_cast<double>(i);
    }
    Tensor t = from_vector(v);
    t = s.dtype == kBool    ? eq(t, 0.0)
        : s.dtype == kInt64 ? (t * 2).to(kInt64) * 3 - 7
                            : t.to(s.dtype);
    out[s.name] = t.reshape(s.shape).contiguous();
  }
  return out;
}

std::vector<ShardPiece> pieces_of(int rank, const std::vector<Spec>& specs,
                                  const std::map<std::string, Tensor>& values) {
  std::vector<ShardPiece> out;
  for (const Spec& s : specs) {
    for (const auto& [r, offset, n] : s.pieces) {
      if (r != rank) continue;
      const Tensor flat = values.at(s.name).reshape({-1});
      // A piece past the tensor's end (for the validation test) gets made-up data.
      out.push_back({s.name, s.shape, offset,
                     offset + n <= flat.numel() ? flat.narrow(0, offset, n) : zeros({n}, s.dtype)});
    }
  }
  return out;
}

// Throws naming the first differing byte unless got and want have the same dtype, shape and
// bytes.
void require_same(const std::string& what, const Tensor& got, const Tensor& want) {
  test::require(got.dtype() == want.dtype(),
                what + ": dtype " + std::string(dtype_name(got.dtype())));
  test::require(got.shape() == want.shape(), what + ": shape differs");
  const Tensor g = got.contiguous(), w = want.contiguous();
  const auto* a = static_cast<const unsigned char*>(g.data_ptr());
  const auto* b = static_cast<const unsigned char*>(w.data_ptr());
  for (int64_t i = 0; i < w.nbytes(); ++i) {
    test::require(a[i] == b[i], what + ": byte " + std::to_string(i) + " got " +
                                    std::to_string(a[i]) + " want " + std::to_string(b[i]));
  }
}

std::map<int, std::string> save_messages(
    const std::string& dir, int n, const std::function<std::vector<ShardPiece>(int)>& pieces);

test::ThreadsSetup ranks(int n) {
  test::ThreadsSetup s;
  s.n = n;
  s.timeout = std::chrono::seconds(30);
  return s;
}

void save_on_threads(const std::string& dir, const std::vector<Spec>& specs,
                     const std::map<std::string, Tensor>& values, int n,
                     const std::map<std::string, std::string>& metadata = {}) {
  test::run_threads(ranks(n), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    save_sharded(dir, pieces_of(rank, specs, values), *pg, metadata);
  });
}

// Reads every tensor back as `readers` processes would (each its range of every tensor, the
// ranges split evenly, so not where the savers' pieces end) and checks them against `values`.
void check_read_back(const std::string& dir, const std::vector<Spec>& specs,
                     const std::map<std::string, Tensor>& values, int readers) {
  for (const Spec& s : specs) {
    const int64_t n = numel_of(s);
    std::vector<Tensor> parts;
    for (int r = 0; r < readers; ++r) {
      const ShardedCheckpoint ckpt(dir);  // each reader opens the checkpoint itself
      const int64_t lo = n * r / readers, hi = n * (r + 1) / readers;
      Tensor part = ckpt.read(s.name, lo, hi - lo);
      EXPECT_EQ(part.dim(), 1);
      require_same(s.name + " range [" + std::to_string(lo) + ", " + std::to_string(hi) + ")", part,
                   values.at(s.name).reshape({-1}).narrow(0, lo, hi - lo));
      parts.push_back(part);
    }
    require_same(s.name + " from " + std::to_string(readers) + " readers",
                 cat(parts, 0).reshape(s.shape), values.at(s.name));
  }
}

std::set<std::string> files_in(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& f : fs::directory_iterator(dir)) out.insert(f.path().filename().string());
  return out;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(ShardedCheckpoint, FourRanksSaveReadBackAsFourTwoAndOne) {
  TempDir dir;
  const auto specs = four_rank_specs();
  const auto values = make_values(specs, 1);
  save_on_threads(dir.path(), specs, values, 4, {{"step", "20"}, {"model", "gpt"}});
  const ShardedCheckpoint ckpt(dir.path());
  EXPECT_EQ(ckpt.world_size(), 4);
  EXPECT_EQ(ckpt.metadata(),
            (std::map<std::string, std::string>{{"step", "20"}, {"model", "gpt"}}));
  // First appearance, rank by rank: rank 0 gives w, step, h, mask, ids, empty; then b, d.
  EXPECT_EQ(ckpt.names(),
            (std::vector<std::string>{"w", "step", "h", "mask", "ids", "empty", "b", "d"}));
  for (const Spec& s : specs) {
    EXPECT_TRUE(ckpt.contains(s.name));
    EXPECT_EQ(ckpt.shape(s.name), s.shape) << s.name;
    EXPECT_EQ(ckpt.dtype(s.name), s.dtype) << s.name;
    require_same(s.name + " read_full", ckpt.read_full(s.name), values.at(s.name));
  }
  EXPECT_FALSE(ckpt.contains("nope"));
  Tensor buf = empty({20}, kFloat32);
  ckpt.read_into("w", 7, buf);  // across ranks 0 and 2 (rank 1's piece is empty)
  require_same("read_into", buf, values.at("w").reshape({-1}).narrow(0, 7, 20));
  Tensor wrong = empty({2}, kFloat64);
  EXPECT_THROW(ckpt.read_into("w", 0, wrong), ValueError);
  for (int readers : {4, 2, 1}) check_read_back(dir.path(), specs, values, readers);
  // Only ranks holding a non-empty piece write a file.
  EXPECT_EQ(files_in(dir.path()).size(), 5u);
}

TEST(ShardedCheckpoint, OneRankAndTwoRanks) {
  for (int n : {1, 2}) {
    TempDir dir;
    auto specs = two_rank_specs();
    if (n == 1) {
      for (Spec& s : specs) s.pieces = {{0, 0, numel_of(s)}};
    }
    const auto values = make_values(specs, 2);
    save_on_threads(dir.path(), specs, values, n);
    EXPECT_EQ(ShardedCheckpoint(dir.path()).world_size(), n);
    check_read_back(dir.path(), specs, values, 3);
  }
}

// Boxes and replicated pieces, as tensor parallelism lays tensors out on a (dp 2, tp 2) mesh of
// 4 ranks (rank = 2 dp + tp):
//   cols  [6, 8]  Shard(1) over tp, replicated over dp: each tp block given by both dp ranks;
//   fused [12, 4] viewed as [3, 4, 4], Shard(1) over tp (a fused projection's blocks), its
//                 block split flat over dp (FSDP over tensor parallelism);
//   norm  [5]     replicated over tp, flat halves over dp (an FSDP-sharded LayerNorm weight);
//   step  []      on every rank.
// Each copy is written once, spread over the ranks, and every read (whole, flat ranges, other
// boxes, a flat range of another box, another view) gives the tensor's own elements.
TEST(ShardedCheckpoint, BoxesAndReplicatedPieces) {
  TempDir dir;
  const Tensor cols = arange(48).to(kFloat32).reshape({6, 8});
  const Tensor fused = (arange(48).to(kFloat32) + 100).reshape({12, 4});
  const Tensor norm = (arange(5).to(kFloat32) + 200);
  const Tensor step = full({}, 7.0, TensorOptions(kInt64));
  test::run_threads(ranks(4), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    const int64_t tp = rank % 2, dp = rank / 2;
    const Tensor block = cols.narrow(1, 4 * tp, 4).contiguous().reshape({-1});
    const Tensor fblock = fused.reshape({3, 4, 4}).narrow(1, 2 * tp, 2).contiguous().reshape({-1});
    std::vector<ShardPiece> mine = {
        {"cols", {6, 8}, 0, block, Box{{}, {0, 4 * tp}, {6, 4}}, true},
        {"fused", {12, 4}, 12 * dp, fblock.narrow(0, 12 * dp, 12),
         Box{{3, 4, 4}, {0, 2 * tp, 0}, {3, 2, 4}}, true},
        {"norm", {5}, 3 * dp, norm.narrow(0, 3 * dp, dp == 0 ? 3 : 2), {}, true},
        {"step", {}, 0, step.reshape({-1}), {}, true},
    };
    save_sharded(dir.path(), mine, *pg);
  });
  const ShardedCheckpoint ck(dir.path());
  // One writer per copy: cols's 2 blocks, fused's 4 pieces, norm's 2 halves, one step.
  EXPECT_EQ(ck.entry("cols").pieces.size(), 2u);
  EXPECT_EQ(ck.entry("fused").pieces.size(), 4u);
  EXPECT_EQ(ck.entry("norm").pieces.size(), 2u);
  EXPECT_EQ(ck.entry("step").pieces.size(), 1u);
  // The copies spread: every rank writes something.
  std::set<int> writers;
  for (const std::string& n : ck.names()) {
    for (const auto& p : ck.entry(n).pieces) writers.insert(p.rank);
  }
  EXPECT_EQ(writers, (std::set<int>{0, 1, 2, 3}));
  require_same("cols", ck.read_full("cols"), cols);
  require_same("fused", ck.read_full("fused"), fused);
  require_same("norm", ck.read_full("norm"), norm);
  require_same("step", ck.read_full("step"), step);
  // Rows (Shard(0)) at another tp size, an arbitrary block, a flat range crossing blocks.
  for (int64_t r = 0; r < 3; ++r) {
    require_same("cols rows", ck.read_box("cols", {{}, {2 * r, 0}, {2, 8}}),
                 cols.narrow(0, 2 * r, 2));
  }
  require_same("cols block", ck.read_box("cols", {{}, {1, 3}, {4, 5}}),
               cols.narrow(0, 1, 4).narrow(1, 3, 5));
  require_same("cols range", ck.read("cols", 5, 20), cols.reshape({-1}).narrow(0, 5, 20));
  // fused at tp 4 as blocks of its view, and FSDP's flat range of one.
  const Tensor fv = fused.reshape({3, 4, 4});
  for (int64_t t = 0; t < 4; ++t) {
    require_same("fused at tp 4", ck.read_box("fused", {{3, 4, 4}, {0, t, 0}, {3, 1, 4}}),
                 fv.narrow(1, t, 1));
  }
  require_same("fused, part of a block",
               ck.read("fused", 5, 6, {{3, 4, 4}, {0, 1, 0}, {3, 2, 4}}),
               fv.narrow(1, 1, 2).contiguous().reshape({-1}).narrow(0, 5, 6));
  // Another view of the same elements: [3, 16]'s columns 4..12.
  require_same("fused viewed as [3, 16]", ck.read_box("fused", {{3, 16}, {0, 4}, {3, 8}}),
               fused.reshape({3, 16}).narrow(1, 4, 8));
  // Boxes that do not fit are refused, naming the tensor.
  for (const Box& bad : {Box{{}, {0, 5}, {6, 4}}, Box{{}, {0}, {6}}, Box{{7, 7}, {0, 0}, {1, 1}}}) {
    const std::string e = test::message_of([&] { ck.read_box("cols", bad); });
    EXPECT_NE(e.find("read_box('cols')"), std::string::npos) << e;
    EXPECT_THROW(ck.read_box("cols", bad), IndexError);
  }
  EXPECT_NE(test::message_of([&] { ck.read("cols", 10, 20, {{}, {0, 0}, {6, 4}}); })
                .find("outside the box's 24 elements"),
            std::string::npos);
  // Consolidated, the tensors are whole as ever.
  ck.consolidate(dir.file("full.safetensors"));
  require_same("consolidated fused", nn::load_safetensors(dir.file("full.safetensors")).at("fused"),
               fused);
}

TEST(ShardedCheckpoint, BoxesThatOverlapOrDoNotFitFailOnEveryRank) {
  struct Case {
    const char* what;
    std::function<std::vector<ShardPiece>(int)> pieces;
    std::string expect;
  };
  const Tensor four = zeros({4}), eight = zeros({8});
  const std::vector<Case> cases = {
      {"blocks that overlap",
       [&](int r) {
         return std::vector<ShardPiece>{{"w", {4, 4}, 0, eight, Box{{}, {0, r}, {4, 2}}}};
       },
       "overlaps"},
      {"replicated but not the same piece",
       [&](int r) {
         return std::vector<ShardPiece>{{"w", {4, 4}, 0, eight, Box{{}, {r, 0}, {2, 4}}, true}};
       },
       "overlaps"},
      {"a box outside the tensor",
       [&](int r) {
         return std::vector<ShardPiece>{{"w", {4, 4}, 0, eight, Box{{}, {0, 3 * r}, {4, 2}}}};
       },
       "rank 1: piece 0 ('w') of shape [4,4]: a box at [0,3] of shape [4,2] is outside [4,4]"},
      {"a view of another size",
       [&](int) {
         return std::vector<ShardPiece>{{"w", {4, 4}, 0, four, Box{{2, 4}, {0, 0}, {2, 2}}}};
       },
       "a box's view [2,4] does not have the tensor's 16 elements"},
      {"more data than the box holds",
       [&](int r) {
         return std::vector<ShardPiece>{{"w", {4, 4}, 4, eight, Box{{}, {0, 2 * r}, {4, 2}}}};
       },
       "covers elements [4, 12), outside the 8 of its box of shape [4,2]"},
  };
  for (const Case& c : cases) {
    TempDir dir;
    const auto errors = save_messages(dir.path(), 2, c.pieces);
    for (int r = 0; r < 2; ++r) {
      EXPECT_NE(errors.at(r).find(c.expect), std::string::npos)
          << c.what << ": rank " << r << " got '" << errors.at(r) << "'";
    }
    EXPECT_TRUE(files_in(dir.path()).empty()) << c.what;
  }
}

// Pieces on the GPU (as FSDP's shards are): 2 rank threads, each on its own stream; the files
// and what the reader returns are the same as from CPU pieces.
TEST(ShardedCheckpointCuda, PiecesOnTheGpu) {
  EMBER_REQUIRE_CUDA();
  TempDir dir;
  const auto specs = two_rank_specs();
  const auto values = make_values(specs, 13);
  test::ThreadsSetup s = ranks(2);
  s.device = cuda_device(0);
  test::run_threads(s, [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    std::vector<ShardPiece> mine = pieces_of(rank, specs, values);
    for (ShardPiece& p : mine) p.data = p.data.to(s.device);
    save_sharded(dir.path(), mine, *pg);
  });
  check_read_back(dir.path(), specs, values, 3);
}

TEST(ShardedCheckpoint, ConsolidateGivesAnOrdinarySafetensorsFile) {
  TempDir dir;
  const auto specs = four_rank_specs();
  const auto values = make_values(specs, 3);
  save_on_threads(dir.path(), specs, values, 4, {{"format", "pt"}, {"step", "7"}});
  const ShardedCheckpoint ckpt(dir.path());
  const std::string out = dir.file("full.safetensors");
  ckpt.consolidate(out);
  const nn::SafetensorsFile f = nn::load_safetensors(out);
  EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"step", "7"}}));
  ASSERT_EQ(f.size(), specs.size());
  for (size_t i = 0; i < f.size(); ++i) EXPECT_EQ(f.tensors()[i].first, ckpt.names()[i]);
  for (const Spec& s : specs)
    require_same(s.name + " consolidated", f.at(s.name), values.at(s.name));
}

TEST(ShardedCheckpoint, ASecondSaveReplacesTheFirstAndRemovesItsFiles) {
  TempDir dir;
  const auto first = make_values(four_rank_specs(), 4);
  save_on_threads(dir.path(), four_rank_specs(), first, 4);
  const std::string first_id = ShardedCheckpoint(dir.path()).save_id();
  // What a save killed during its atomic writes leaves (a rank file's, the index's); an
  // unrelated file stays.
  const std::string stray = "." + first_id + ".rank1.safetensors.tmp-123-0";
  std::ofstream(dir.file(stray)) << "partial";
  std::ofstream(dir.file(".index.json.tmp-456-0")) << "{\"partial";
  std::ofstream(dir.file("notes.txt")) << "mine";
  const auto second = make_values(two_rank_specs(), 5);
  save_on_threads(dir.path(), two_rank_specs(), second, 2);
  const ShardedCheckpoint ckpt(dir.path());
  EXPECT_NE(ckpt.save_id(), first_id);
  EXPECT_EQ(ckpt.world_size(), 2);
  EXPECT_EQ(files_in(dir.path()),
            (std::set<std::string>{"index.json", "notes.txt", ckpt.save_id() + ".rank0.safetensors",
                                   ckpt.save_id() + ".rank1.safetensors"}));
  check_read_back(dir.path(), two_rank_specs(), second, 4);
}

// Runs save_sharded on n rank threads, each with pieces(rank); returns what each rank threw
// ("" if it returned).
std::map<int, std::string> save_messages(
    const std::string& dir, int n, const std::function<std::vector<ShardPiece>(int)>& pieces) {
  std::mutex mu;
  std::map<int, std::string> errors;
  test::run_threads(ranks(n), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    const std::string e = test::message_of([&] { save_sharded(dir, pieces(rank), *pg); });
    std::lock_guard<std::mutex> lock(mu);
    errors[rank] = e;
  });
  return errors;
}

// A save that fails after some rank files are written (the hook throws on rank 2 once its file
// is durable, as a crash there would stop it) fails on every rank and leaves the previous set
// current, byte for byte.
TEST(ShardedCheckpoint, AFailureMidSaveKeepsThePreviousSet) {
  TempDir dir;
  const auto specs = four_rank_specs();
  const auto before = make_values(specs, 6);
  save_on_threads(dir.path(), specs, before, 4);
  const std::string index = slurp(dir.file("index.json"));
  const std::set<std::string> files = files_in(dir.path());
  detail::set_sharded_save_hook([](int rank) {
    if (rank == 2) throw std::runtime_error("simulated crash after the rank file");
  });
  const auto after = make_values(specs, 7);
  auto errors =
      save_messages(dir.path(), 4, [&](int rank) { return pieces_of(rank, specs, after); });
  detail::set_sharded_save_hook(nullptr);
  for (int r = 0; r < 4; ++r) {
    EXPECT_NE(errors[r].find("rank 2: simulated crash after the rank file"), std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
  EXPECT_EQ(slurp(dir.file("index.json")), index);
  EXPECT_EQ(files_in(dir.path()), files);
  check_read_back(dir.path(), specs, before, 2);
  // The next save succeeds and is the current one.
  save_on_threads(dir.path(), specs, after, 4);
  check_read_back(dir.path(), specs, after, 1);
}

// Rank 0's index replaced the old one, but the directory's fsync then failed: every rank
// throws, naming it, and no file is removed, so the directory still holds a whole checkpoint
// (the new one, which the index names) and the old files, until a save is known durable.
TEST(ShardedCheckpoint, AnIndexInPlaceWhoseDirectorySyncFailedKeepsEveryFile) {
  TempDir dir;
  const auto specs = four_rank_specs();
  save_on_threads(dir.path(), specs, make_values(specs, 6), 4);
  const std::set<std::string> old_files = files_in(dir.path());
  // The hook runs on rank 0's thread after its rank file is durable, so the next atomic write
  // there is the index's.
  detail::set_sharded_save_hook([](int rank) {
    if (rank == 0)
      ember::detail::inject_atomic_write_fault(ember::detail::AtomicWriteStep::kFsyncDir, EIO);
  });
  const auto after = make_values(specs, 7);
  auto errors =
      save_messages(dir.path(), 4, [&](int rank) { return pieces_of(rank, specs, after); });
  detail::set_sharded_save_hook(nullptr);
  for (int r = 0; r < 4; ++r) {
    EXPECT_NE(errors[r].find("writing the index failed; rank 0:"), std::string::npos)
        << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("fsync of its directory"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("the new checkpoint is in place"), std::string::npos) << errors[r];
  }
  const ShardedCheckpoint ckpt(dir.path());  // the new index, and its files are all there
  check_read_back(dir.path(), specs, after, 2);
  const std::set<std::string> now = files_in(dir.path());
  for (const std::string& f : old_files) EXPECT_TRUE(now.count(f)) << f << " was removed";
  // The next save succeeds and clears the old files.
  save_on_threads(dir.path(), specs, make_values(specs, 8), 4);
  EXPECT_EQ(files_in(dir.path()).size(), 5u);
}

// A save to a directory that a save of this process is still writing is refused on every rank
// before anything is written: its end would delete the other's files as stale.
TEST(ShardedCheckpoint, ASaveToADirectoryWithOneInFlightIsRefused) {
  TempDir dir;
  const auto specs = two_rank_specs();
  const auto values = make_values(specs, 3);
  std::mutex mu;
  std::map<int, std::string> errors;
  test::run_threads(ranks(2), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    // Rank 1 holds a prepared save (as an async save does until it has committed) while both
    // start another.
    std::shared_ptr<detail::PreparedSave> held =
        detail::prepare_sharded_save(dir.path(), pieces_of(rank, specs, values), *pg, {}, {});
    if (rank == 0) held.reset();  // rank 0's first save is over
    const std::string e =
        test::message_of([&] { save_sharded(dir.path(), pieces_of(rank, specs, values), *pg); });
    {
      std::lock_guard<std::mutex> lock(mu);
      errors[rank] = e;
    }
    held.reset();  // dropped uncommitted: nothing is in flight any more
    save_sharded(dir.path(), pieces_of(rank, specs, values), *pg);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("the save cannot start; rank 1: a save to"), std::string::npos)
        << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("is still in flight on this rank"), std::string::npos) << errors[r];
  }
  check_read_back(dir.path(), specs, values, 2);
}

// A rank whose part of a prepared save failed before commit (an async save's staging threw)
// still commits, sending the reason: every rank's commit throws it at once, none waits for the
// missing file, and the previous checkpoint stays current.
TEST(ShardedCheckpoint, ARankThatFailedBeforeCommitFailsEveryRank) {
  TempDir dir;
  const auto specs = two_rank_specs();
  const auto before = make_values(specs, 1);
  save_on_threads(dir.path(), specs, before, 2);
  const std::set<std::string> files = files_in(dir.path());
  const auto after = make_values(specs, 2);
  std::mutex mu;
  std::map<int, std::string> errors;
  test::run_threads(ranks(2), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto save =
        detail::prepare_sharded_save(dir.path(), pieces_of(rank, specs, after), *pg, {}, {});
    if (rank == 1) detail::fail_sharded_save(*save, "staging failed: out of host memory");
    const std::string e = test::message_of([&] { detail::commit_sharded_save(*save, *pg); });
    std::lock_guard<std::mutex> lock(mu);
    errors[rank] = e;
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("writing the rank files failed; rank 1: staging failed: out of host "
                             "memory"),
              std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
  EXPECT_EQ(files_in(dir.path()), files);
  check_read_back(dir.path(), specs, before, 1);
}

TEST(ShardedCheckpoint, PiecesThatDoNotTileFailOnEveryRank) {
  struct Case {
    const char* what;
    Spec spec;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {"gap",
       {"w", {4, 5}, kFloat32, {{0, 0, 6}, {1, 8, 6}, {2, 14, 6}}},
       {"tensor 'w'", "elements [6, 8) are in no rank's piece", "rank 0", "rank 1"}},
      {"gap at the end",
       {"w", {4, 5}, kFloat32, {{0, 0, 6}, {3, 6, 10}}},
       {"elements [16, 20) are in no rank's piece", "after rank 3"}},
      {"gap at the start",
       {"w", {4, 5}, kFloat32, {{2, 3, 17}}},
       {"elements [0, 3)", "before rank 2"}},
      {"overlap",
       {"w", {4, 5}, kFloat32, {{0, 0, 10}, {3, 8, 12}}},
       {"rank 3's piece [8, 20) overlaps rank 0's piece ending at 10 on [8, 10)"}},
      {"replicated on two ranks", {"w", {3}, kFloat32, {{0, 0, 3}, {1, 0, 3}}}, {"overlaps"}},
      {"a name that is not UTF-8",
       {"w\xff", {3}, kFloat32, {{1, 0, 3}}},
       {"rank 1: piece 0 ('w", "has a name that is not valid UTF-8"}},
      {"outside the tensor",
       {"w", {3}, kFloat32, {{1, 2, 4}}},
       {"rank 1: piece 0 ('w') covers elements [2, 6)"}},
  };
  for (const Case& c : cases) {
    TempDir dir;
    const auto values = make_values({c.spec}, 8);
    const auto errors =
        save_messages(dir.path(), 4, [&](int rank) { return pieces_of(rank, {c.spec}, values); });
    for (int r = 0; r < 4; ++r) {
      for (const std::string& want : c.expect) {
        EXPECT_NE(errors.at(r).find(want), std::string::npos)
            << c.what << ": rank " << r << " got '" << errors.at(r) << "', expected '" << want
            << "'";
      }
    }
    EXPECT_TRUE(files_in(dir.path()).empty()) << c.what << ": nothing is written";
  }
}

TEST(ShardedCheckpoint, DisagreementsAndBadShapesFailOnEveryRank) {
  TempDir dir;
  // Rank 1 and rank 2 disagree on w's shape; the values are made from the first spec.
  const auto values = make_values({{"w", {4, 3}, kFloat32, {}}}, 9);
  auto errors = save_messages(dir.path(), 3, [&](int rank) {
    std::vector<ShardPiece> mine;
    const Tensor flat = values.at("w").reshape({-1});
    if (rank == 1) mine.push_back({"w", {4, 3}, 0, flat.narrow(0, 0, 6)});
    if (rank == 2) mine.push_back({"w", {3, 4}, 6, flat.narrow(0, 6, 6)});
    if (rank == 0) mine.push_back({"v", {2}, 0, zeros({2}, kFloat32)});
    return mine;
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(errors[r].find("tensor 'w': rank 2 gives shape [3,4] but rank 1 gives [4,3]"),
              std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
  errors = save_messages(dir.path(), 2, [&](int rank) {
    return std::vector<ShardPiece>{
        {"v", {4}, 2 * rank, zeros({2}, rank == 0 ? kFloat32 : kBFloat16)}};
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("tensor 'v': rank 1 gives dtype bfloat16 but rank 0 gives float32"),
              std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
  errors = save_messages(dir.path(), 2, [&](int rank) {
    if (rank == 0) return std::vector<ShardPiece>{};
    return std::vector<ShardPiece>{{"v", {int64_t{1} << 62, 8}, 0, zeros({2})}};
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("rank 1: piece 0 ('v') has an invalid shape [4611686018427387904,8]"),
              std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
  EXPECT_TRUE(files_in(dir.path()).empty());
}

TEST(ShardedCheckpoint, ReaderErrorsNameTheFileAndTensor) {
  TempDir dir;
  EXPECT_NE(test::message_of([&] { ShardedCheckpoint c(dir.path()); }).find(dir.file("index.json")),
            std::string::npos);
  const auto specs = four_rank_specs();
  save_on_threads(dir.path(), specs, make_values(specs, 10), 4);
  const ShardedCheckpoint ckpt(dir.path());
  EXPECT_THROW(ckpt.read("nope", 0, 1), IndexError);
  EXPECT_NE(test::message_of([&] { ckpt.shape("nope"); }).find("no tensor 'nope'"),
            std::string::npos);
  EXPECT_NE(
      test::message_of([&] { ckpt.read("w", 30, 6); }).find("outside the tensor's 35 elements"),
      std::string::npos);
  EXPECT_THROW(ckpt.read("w", -1, 2), IndexError);
  EXPECT_NO_THROW(ckpt.read("w", 35, 0));

  // A truncated rank file: refused on opening, and by a reader that opened it before.
  const std::string rank3 = ckpt.rank_file(3);
  const auto size = fs::file_size(rank3);
  fs::resize_file(rank3, size - 4);
  std::string e = test::message_of([&] { ShardedCheckpoint c(dir.path()); });
  EXPECT_NE(e.find(rank3), std::string::npos) << e;
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;
  // Rank 3's file ends with b's bf16 bytes (save_safetensors lays data out by decreasing
  // element size): any read from that piece fails (its checksum cannot be checked), what lies
  // before the cut still reads.
  for (const auto& [offset, numel] : {std::pair{0, 9}, std::pair{0, 6}}) {
    e = test::message_of([&] { ckpt.read("b", offset, numel); });
    EXPECT_NE(e.find("tensor 'b'"), std::string::npos) << e;
    EXPECT_NE(e.find(rank3), std::string::npos) << e;
    EXPECT_NE(e.find("truncated"), std::string::npos) << e;
  }
  const auto values = make_values(specs, 10);
  require_same("d before the cut", ckpt.read_full("d"), values.at("d"));
  require_same("b's piece on rank 1", ckpt.read("b", 0, 4), values.at("b").narrow(0, 0, 4));

  // A missing rank file.
  fs::remove(rank3);
  e = test::message_of([&] { ShardedCheckpoint c(dir.path()); });
  EXPECT_NE(e.find(rank3 + " is missing"), std::string::npos) << e;
  e = test::message_of([&] { ckpt.read("d", 0, 1); });
  EXPECT_NE(e.find("cannot open " + rank3), std::string::npos) << e;

  // A broken index: each refused with a message naming the file and what is wrong.
  const std::string head = R"({"format": "ember.sharded_checkpoint", "version": 1, "save_id": "x",
                               "world_size": 1, "metadata": {}, "tensors": )";
  const std::vector<std::pair<std::string, std::string>> broken = {
      {R"({"format": )", "is not valid JSON"},
      {"[]", "has no 'format'"},
      {R"({"format": "ember.sharded_checkpoint", "version": 99})", "format version 99"},
      {head + R"([{"name": "t", "shape": [4611686018427387904, 4], "dtype": "float32",
                  "pieces": []}]})",
       "tensor 't' has a bad shape"},
      {head + R"([{"name": "t", "shape": [4], "dtype": "float32", "pieces": [{"rank": 0,
                  "offset": 0, "numel": 3, "file_offset": 0}]}]})",
       "pieces cover 3 of the 4"},
      {head + R"([{"name": "t", "shape": [4], "dtype": "float32", "pieces": [{"rank": 1,
                  "offset": 0, "numel": 4, "file_offset": 0}]}]})",
       "tensor 't' has a bad piece"},
      {head + R"([{"name": "t", "shape": [4], "dtype": "complex", "pieces": []}]})", "complex"},
      {head + R"([{"name": "t", "shape": "4"}]})", "'shape' has the wrong type"},
      // Numbers where integers belong: refused, not cast (a float outside int's range was
      // undefined behaviour, found by fuzz_checkpoint_index).
      {R"({"format": "ember.sharded_checkpoint", "version": 444444444444444444444444444444})",
       "'version' must be an integer in [-2147483648, 2147483647], got 4.444444444444444e+29"},
      {R"({"format": "ember.sharded_checkpoint", "version": 1.5})",
       "'version' must be an integer"},
      {head + R"([{"name": "t", "shape": [4, 1e30], "dtype": "float32", "pieces": []}]})",
       "'shape' must hold integers"},
      {head + R"([{"name": "t", "shape": [4], "dtype": "float32", "pieces": [{"rank": 3e9,
                  "offset": 0, "numel": 4, "file_offset": 0}]}]})",
       "'rank' must be an integer"},
  };
  for (const auto& [bad, want] : broken) {
    std::ofstream(dir.file("index.json"), std::ios::trunc) << bad;
    e = test::message_of([&] { ShardedCheckpoint c(dir.path()); });
    EXPECT_NE(e.find(dir.file("index.json")), std::string::npos) << e;
    EXPECT_NE(e.find(want), std::string::npos) << "expected '" << want << "' in: " << e;
  }
}

// Every piece carries its checksum: a flipped byte in one piece, or another save's file in a
// rank file's place, is an error naming the tensor and the file (the other pieces still read);
// verify() checks every piece.
// An index that is a FIFO, a link to /dev/zero or a directory is refused by its file type,
// without blocking or reading; one larger than any index is refused unread.
TEST(ShardedCheckpoint, AnIndexThatIsNotAnOrdinaryFileIsRefusedUnread) {
  TempDir dir;
  const std::string index = dir.file("index.json");
  ASSERT_EQ(::mkfifo(index.c_str(), 0600), 0) << std::strerror(errno);
  std::string e = test::message_of([&] { ShardedCheckpoint c(dir.path()); });
  EXPECT_NE(e.find("not a regular file"), std::string::npos) << e;
  fs::remove(index);
  fs::create_symlink("/dev/zero", index);
  e = test::message_of([&] { ShardedCheckpoint c(dir.path()); });
  EXPECT_NE(e.find("not a regular file"), std::string::npos) << e;
  fs::remove(index);
  {
    std::ofstream big(index);
    big.seekp((std::streamoff{1} << 30) + 1);  // sparse: takes no disk
    big.put(' ');
  }
  e = test::message_of([&] { ShardedCheckpoint c(dir.path()); });
  EXPECT_NE(e.find("more than the 1073741824 such a file may have: refused unread"),
            std::string::npos) << e;
}

TEST(ShardedCheckpoint, CorruptedOrForeignPiecesAreNamed) {
  TempDir dir, other;
  const auto specs = four_rank_specs();
  save_on_threads(dir.path(), specs, make_values(specs, 10), 4);
  save_on_threads(other.path(), specs, make_values(specs, 20), 4);
  {
    const ShardedCheckpoint ckpt(dir.path());
    EXPECT_NO_THROW(ckpt.verify());
    // w's piece on rank 2 (elements [10, 23)): flip one byte of its element 12.
    const ShardedCheckpoint::Entry& w = ckpt.entry("w");
    const auto piece = std::find_if(w.pieces.begin(), w.pieces.end(),
                                    [](const auto& p) { return p.rank == 2; });
    ASSERT_NE(piece, w.pieces.end());
    ASSERT_TRUE(piece->checksum.has_value());
    {
      std::fstream f(ckpt.rank_file(2), std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(piece->file_offset + 2 * 4 + 1);
      char c = 0;
      f.read(&c, 1);
      c = static_cast<char>(c ^ 0x40);
      f.seekp(piece->file_offset + 2 * 4 + 1);
      f.write(&c, 1);
    }
    const ShardedCheckpoint fresh(dir.path());  // the index still opens: only the bytes changed
    for (const auto& read : std::vector<std::function<void()>>{
             [&] { fresh.read_full("w"); }, [&] { fresh.read("w", 20, 1); }, [&] { fresh.verify(); }}) {
      const std::string e = test::message_of(read);
      EXPECT_NE(e.find("tensor 'w'"), std::string::npos) << e;
      EXPECT_NE(e.find(ckpt.rank_file(2)), std::string::npos) << e;
      EXPECT_NE(e.find("fails its checksum"), std::string::npos) << e;
    }
    const auto values = make_values(specs, 10);
    require_same("w's other pieces", fresh.read("w", 0, 10), values.at("w").reshape({-1}).narrow(0, 0, 10));
    require_same("h on rank 2", fresh.read_full("h"), values.at("h"));
  }
  // Another save's rank file (same layout, other values) in rank 1's place.
  const ShardedCheckpoint a(other.path());
  fs::copy_file(a.rank_file(1), ShardedCheckpoint(dir.path()).rank_file(1),
                fs::copy_options::overwrite_existing);
  const std::string e = test::message_of([&] { ShardedCheckpoint(dir.path()).read_full("b"); });
  EXPECT_NE(e.find("tensor 'b'"), std::string::npos) << e;
  EXPECT_NE(e.find("belongs to another save"), std::string::npos) << e;
}

// The same between processes over gloo (TCP): 2 ranks save, this process reads; then rank 1
// dies (_exit) after writing its file of a second save: rank 0 fails, and the first set stays.
TEST(ShardedCheckpointGloo, TwoProcessesSaveAndACrashKeepsThePreviousSet) {
  if (!gloo_available()) GTEST_SKIP() << "built without gloo (EMBER_WITH_GLOO=OFF)";
  TempDir dir;
  const auto specs = two_rank_specs();
  const auto run = [&](int seed, bool crash) {
    test::Children kids(2, [&](int rank, const std::string& port) {
      using namespace std::chrono_literals;
      auto store =
          std::make_shared<TCPStore>("127.0.0.1", static_cast<uint16_t>(std::stoi(port)), [] {
            TCPStoreOptions so;
            so.timeout = 30s;
            return so;
          }());
      ProcessGroupGloo::GlooOptions go{30s, "127.0.0.1"};
      go.shared_memory = false;
      ProcessGroupGloo pg(std::make_shared<PrefixStore>("pg", store), rank, 2, go);
      if (crash) {
        detail::set_sharded_save_hook([](int r) {
          if (r == 1) ::_exit(0);
        });
      }
      const auto pieces = pieces_of(rank, specs, make_values(specs, seed));
      if (!crash) return save_sharded(dir.path(), pieces, pg);
      const std::string e = test::message_of([&] { save_sharded(dir.path(), pieces, pg); });
      test::require(!e.empty(), "rank 0 must fail when rank 1 dies mid-save");
    });
    TCPStoreServerOptions o;
    o.host = "127.0.0.1";
    TCPStoreServer server(o);
    kids.go(std::to_string(server.port()));
    return kids.join(120000);
  };
  test::expect_children_ok(run(11, false));
  check_read_back(dir.path(), specs, make_values(specs, 11), 3);
  const std::string index = slurp(dir.file("index.json"));
  const auto errors = run(12, true);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_NE(errors[0].find("child 1: died without a report"), std::string::npos) << errors[0];
  EXPECT_EQ(slurp(dir.file("index.json")), index);
  check_read_back(dir.path(), specs, make_values(specs, 11), 2);
}

}  // namespace
}  // namespace ember::dist
