// Datasets, samplers and the DataLoader. Shuffled orders are compared with index lists that
// PyTorch 1.13 produced (see the comment above each table).
#include <ember/nn/data/data.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tests/tensor/test_util.h"

namespace ember::nn::data {
namespace {

using ember::test::expect_error;

std::string join(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(v[i]);
  }
  return s;
}

// The hash used by the Python script that produced the literals: h = h * 1000003 + v mod 2^64.
uint64_t poly_hash(const std::vector<int64_t>& v) {
  uint64_t h = 0;
  for (int64_t x : v) h = h * 1000003ull + static_cast<uint64_t>(x);
  return h;
}

// ---- torch_randperm -------------------------------------------------------------------------

// Produced by /usr/bin/python3 (PyTorch 1.13):
//   g = torch.Generator(); g.manual_seed(s); torch.randperm(n, generator=g).tolist()
TEST(TorchRandperm, MatchesPyTorchSmall) {
  EXPECT_EQ(join(torch_randperm(10, 42)), "2,6,1,8,4,5,0,9,3,7");
  EXPECT_TRUE(torch_randperm(0, 1).empty());
  EXPECT_EQ(join(torch_randperm(1, 3)), "0");
}

TEST(TorchRandperm, MatchesPyTorch100) {
  // torch.randperm(100, generator=manual_seed(42))[:20]
  const std::vector<int64_t> want = {42, 96, 62, 98, 46, 95, 60, 24, 78, 16,
                                     68, 70, 11, 13, 97, 52, 99, 19, 71, 10};
  const std::vector<int64_t> got = torch_randperm(100, 42);
  ASSERT_EQ(got.size(), 100u);
  EXPECT_EQ(join({got.begin(), got.begin() + 20}), join(want));
}

TEST(TorchRandperm, MatchesPyTorch60000) {
  // torch.randperm(60000, generator=manual_seed(19)): first 8 values and poly_hash of all.
  const std::vector<int64_t> got = torch_randperm(60000, 19);
  EXPECT_EQ(join({got.begin(), got.begin() + 8}), "43645,37773,11635,46051,41216,6464,50426,45372");
  EXPECT_EQ(poly_hash(got), 12712123443642837002ull);
  // A permutation: every index once.
  std::vector<int64_t> sorted = got;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 60000; ++i) ASSERT_EQ(sorted[i], i) << "index " << i;
}

TEST(TorchRandperm, SeedUsesLow32Bits) {
  // PyTorch seeds mt19937 with seed & 0xffffffff: 2^32 + 5 and 5 give the same order.
  EXPECT_EQ(torch_randperm(50, (1ull << 32) + 5), torch_randperm(50, 5));
  expect_error([] { torch_randperm(-1, 0); }, {"[torch_randperm]", "-1"});
}

// ---- samplers -------------------------------------------------------------------------------

TEST(Samplers, Sequential) {
  SequentialSampler s(5);
  EXPECT_EQ(s.size(), 5);
  EXPECT_EQ(join(s.indices()), "0,1,2,3,4");
  EXPECT_TRUE(SequentialSampler(0).indices().empty());
  expect_error([] { SequentialSampler(-2); }, {"[SequentialSampler]", "-2"});
}

TEST(Samplers, RandomAdvancesEpochEachPass) {
  RandomSampler s(60000, 17);
  EXPECT_EQ(s.size(), 60000);
  EXPECT_EQ(s.indices(), torch_randperm(60000, 17));
  EXPECT_EQ(s.epoch(), 1);
  EXPECT_EQ(s.indices(), torch_randperm(60000, 18));
  s.set_epoch(2);
  const std::vector<int64_t> e2 = s.indices();
  // Same literal as MatchesPyTorch60000: seed 17 + epoch 2 = 19.
  EXPECT_EQ(poly_hash(e2), 12712123443642837002ull);
  EXPECT_EQ(s.epoch(), 3);
  expect_error([] { RandomSampler(-1); }, {"[RandomSampler]", "-1"});
}

struct DistCase {
  int64_t n, world, rank;
  bool shuffle;
  uint64_t seed;
  int64_t epoch;
  bool drop_last;
  std::vector<int64_t> want;
};

// Produced by /usr/bin/python3 (PyTorch 1.13) with a dataset of length n:
//   s = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
//                          drop_last=drop_last); s.set_epoch(epoch); list(s)
const std::vector<DistCase> kDistCases = {
    {10, 3, 0, true, 0ull, 0, false, {4, 5, 0, 2}},
    {10, 3, 1, true, 0ull, 0, false, {1, 3, 8, 4}},
    {10, 3, 2, true, 0ull, 0, false, {7, 9, 6, 1}},
    {10, 3, 0, true, 0ull, 0, true, {4, 5, 0}},
    {10, 3, 1, true, 0ull, 0, true, {1, 3, 8}},
    {10, 3, 2, true, 0ull, 0, true, {7, 9, 6}},
    {10, 4, 0, false, 0ull, 0, false, {0, 4, 8}},
    {10, 4, 1, false, 0ull, 0, false, {1, 5, 9}},
    {10, 4, 2, false, 0ull, 0, false, {2, 6, 0}},
    {10, 4, 3, false, 0ull, 0, false, {3, 7, 1}},
    {10, 4, 0, false, 0ull, 0, true, {0, 4}},
    {10, 4, 1, false, 0ull, 0, true, {1, 5}},
    {10, 4, 2, false, 0ull, 0, true, {2, 6}},
    {10, 4, 3, false, 0ull, 0, true, {3, 7}},
    {7, 3, 0, true, 42ull, 3, false, {5, 2, 0}},
    {7, 3, 1, true, 42ull, 3, false, {3, 4, 5}},
    {7, 3, 2, true, 42ull, 3, false, {1, 6, 3}},
    {2, 5, 0, true, 7ull, 1, false, {1}},
    {2, 5, 1, true, 7ull, 1, false, {0}},
    {2, 5, 2, true, 7ull, 1, false, {1}},
    {2, 5, 3, true, 7ull, 1, false, {0}},
    {2, 5, 4, true, 7ull, 1, false, {1}},
    {0, 2, 0, true, 0ull, 0, false, {}},
    {0, 2, 1, true, 0ull, 0, false, {}},
    {1, 2, 0, true, 0ull, 0, true, {}},
    {1, 2, 1, true, 0ull, 0, true, {}},
    {13, 4, 0, true, 4294967301ull, 2, false, {6, 8, 11, 2}},
    {13, 4, 1, true, 4294967301ull, 2, false, {5, 4, 10, 6}},
    {13, 4, 2, true, 4294967301ull, 2, false, {3, 12, 1, 5}},
    {13, 4, 3, true, 4294967301ull, 2, false, {9, 0, 7, 3}},
};

TEST(Samplers, DistributedMatchesPyTorch) {
  for (const DistCase& c : kDistCases) {
    DistributedSampler s(c.n, c.world, c.rank, c.shuffle, c.seed, c.drop_last);
    s.set_epoch(c.epoch);
    const std::string what =
        "n=" + std::to_string(c.n) + " world=" + std::to_string(c.world) +
        " rank=" + std::to_string(c.rank) + " shuffle=" + std::to_string(c.shuffle) +
        " seed=" + std::to_string(c.seed) + " epoch=" + std::to_string(c.epoch) +
        " drop_last=" + std::to_string(c.drop_last);
    EXPECT_EQ(join(s.indices()), join(c.want)) << what;
    EXPECT_EQ(s.size(), static_cast<int64_t>(c.want.size())) << what;
  }
}

TEST(Samplers, DistributedMatchesPyTorch60000) {
  // Same script as kDistCases with n = 60000: len, first 8, sum and poly_hash of the list.
  struct Big {
    int64_t world, rank;
    uint64_t seed;
    int64_t epoch;
    bool drop_last;
    size_t len;
    const char* first8;
    int64_t sum;
    uint64_t hash;
  };
  const Big cases[] = {
      {4, 1, 1234, 5, false, 15000, "36576,21776,16232,13970,53281,40420,17769,25565", 446924813,
       16797278095748529659ull},
      {7, 6, 0, 0, false, 8572, "9481,58338,46986,47621,2619,22009,11534,38750", 259047087,
       13689850346752581563ull},
      {7, 3, 0, 9, true, 8571, "55790,38838,38688,53806,7270,34717,26428,39377", 255900464,
       5877782206035946050ull},
  };
  for (const Big& c : cases) {
    DistributedSampler s(60000, c.world, c.rank, true, c.seed, c.drop_last);
    s.set_epoch(c.epoch);
    const std::vector<int64_t> got = s.indices();
    const std::string what = "world=" + std::to_string(c.world) +
                             " rank=" + std::to_string(c.rank) +
                             " epoch=" + std::to_string(c.epoch);
    ASSERT_EQ(got.size(), c.len) << what;
    EXPECT_EQ(join({got.begin(), got.begin() + 8}), c.first8) << what;
    EXPECT_EQ(std::accumulate(got.begin(), got.end(), int64_t{0}), c.sum) << what;
    EXPECT_EQ(poly_hash(got), c.hash) << what;
  }
}

TEST(Samplers, DistributedRanksPartitionAndEpochsReshuffle) {
  // Without drop_last, ranks together cover every index, padding repeating the first ones.
  const int64_t n = 103, world = 4;
  std::vector<int> seen(n, 0);
  for (int64_t r = 0; r < world; ++r) {
    DistributedSampler s(n, world, r, true, 9);
    s.set_epoch(3);
    for (int64_t i : s.indices()) seen[i]++;
  }
  int extra = 0;
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_GE(seen[i], 1) << "index " << i << " not covered";
    extra += seen[i] - 1;
  }
  EXPECT_EQ(extra, 1);  // 104 - 103
  // The order stays until set_epoch, then changes.
  DistributedSampler s(n, world, 0, true, 9);
  const std::vector<int64_t> a = s.indices();
  EXPECT_EQ(s.indices(), a);
  s.set_epoch(1);
  EXPECT_NE(s.indices(), a);
  EXPECT_EQ(s.total_size(), 104);
}

TEST(Samplers, DistributedValidates) {
  expect_error([] { DistributedSampler(10, 3, 3); },
               {"[DistributedSampler]", "invalid rank 3", "[0, 2]"});
  expect_error([] { DistributedSampler(10, 3, -1); }, {"[DistributedSampler]", "invalid rank -1"});
  expect_error([] { DistributedSampler(10, 0, 0); }, {"[DistributedSampler]", "num_replicas", "0"});
  expect_error([] { DistributedSampler(-5, 2, 0); }, {"[DistributedSampler]", "-5"});
}

// ---- datasets -------------------------------------------------------------------------------

// data[i] = [i, 10 i, 100 i] (float32), target[i] = i % 3 (int64).
std::shared_ptr<TensorDataset> make_tensor_dataset(int64_t n) {
  std::vector<float> data;
  std::vector<int64_t> target;
  for (int64_t i = 0; i < n; ++i) {
    data.insert(data.end(), {float(i), float(10 * i), float(100 * i)});
    target.push_back(i % 3);
  }
  return std::make_shared<TensorDataset>(from_vector(data, {n, 3}), from_vector(target, {n}));
}

TEST(Datasets, TensorDatasetGetAndBatch) {
  auto ds = make_tensor_dataset(6);
  EXPECT_EQ(ds->size(), 6);
  Example e = ds->get(4);
  EXPECT_EQ(join(e.data.to_vector<int64_t>()), "4,40,400");
  EXPECT_EQ(e.target.item<int64_t>(), 1);
  Example b = ds->get_batch({5, 0, 5});
  EXPECT_EQ(b.data.shape(), Shape({3, 3}));
  EXPECT_EQ(join(b.data.to_vector<int64_t>()), "5,50,500,0,0,0,5,50,500");
  EXPECT_EQ(join(b.target.to_vector<int64_t>()), "2,0,2");
  EXPECT_EQ(b.target.dtype(), kInt64);

  expect_error<IndexError>([&] { ds->get(6); }, {"[TensorDataset]", "index 6", "6 examples"});
  expect_error<IndexError>([&] { ds->get(-1); }, {"[TensorDataset]", "index -1"});
  expect_error<IndexError>([&] { ds->get_batch({1, 9}); }, {"[TensorDataset]", "index 9"});
  expect_error(
      [] {
        TensorDataset(zeros({4, 2}), zeros({5}));
      },
      {"[TensorDataset]", "first dim 4", "[5]"});
  expect_error([] { TensorDataset(scalar_tensor(1.0), Tensor()); }, {"[TensorDataset]", "0-d"});
  expect_error([] { TensorDataset(Tensor(), Tensor()); }, {"[TensorDataset]", "defined"});

  TensorDataset unlabeled(arange(4), Tensor());
  EXPECT_FALSE(unlabeled.get(1).target.defined());
  EXPECT_FALSE(unlabeled.get_batch({1, 2}).target.defined());
}

// A dataset using the default get_batch: example i is [i, i] and target i * 2.
class PairDataset : public Dataset {
 public:
  explicit PairDataset(int64_t n, int64_t unlabeled_from = -1)
      : n_(n), unlabeled_from_(unlabeled_from) {}
  int64_t size() const override { return n_; }
  Example get(int64_t i) const override {
    EMBER_CHECK_TYPE(IndexError, i >= 0 && i < n_, "[PairDataset] bad index ", i);
    Tensor target =
        unlabeled_from_ >= 0 && i >= unlabeled_from_ ? Tensor() : scalar_tensor(i * 2, kInt64);
    return {full({2}, double(i)), target};
  }

 private:
  int64_t n_;
  int64_t unlabeled_from_;
};

TEST(Datasets, DefaultGetBatchStacks) {
  PairDataset ds(5);
  Example b = ds.get_batch({3, 1});
  EXPECT_EQ(b.data.shape(), Shape({2, 2}));
  EXPECT_EQ(join(b.data.to_vector<int64_t>()), "3,3,1,1");
  EXPECT_EQ(join(b.target.to_vector<int64_t>()), "6,2");
  expect_error([&] { ds.get_batch({}); }, {"[Dataset::get_batch]", "at least one index"});
  PairDataset mixed(5, 3);
  expect_error([&] { mixed.get_batch({1, 4}); }, {"[Dataset::get_batch]", "example 4"});
  EXPECT_FALSE(mixed.get_batch({3, 4}).target.defined());
}

// ---- DataLoader -----------------------------------------------------------------------------

// Concatenated first columns of every batch of one pass (the dataset indices, in order).
std::vector<int64_t> pass_indices(DataLoader& loader, std::vector<int64_t>* sizes = nullptr) {
  std::vector<int64_t> out;
  for (const Batch& b : loader) {
    const std::vector<int64_t> col = b.data.select(1, 0).to_vector<int64_t>();
    const std::vector<int64_t> tgt = b.target.to_vector<int64_t>();
    for (size_t i = 0; i < col.size(); ++i) {
      EXPECT_EQ(tgt[i], col[i] % 3) << "target of example " << col[i];
    }
    out.insert(out.end(), col.begin(), col.end());
    if (sizes) sizes->push_back(b.data.size(0));
  }
  return out;
}

TEST(DataLoader, SequentialBatches) {
  auto ds = make_tensor_dataset(10);
  DataLoader loader(ds, {.batch_size = 4});
  EXPECT_EQ(loader.size(), 3);
  std::vector<int64_t> sizes;
  EXPECT_EQ(join(pass_indices(loader, &sizes)), "0,1,2,3,4,5,6,7,8,9");
  EXPECT_EQ(join(sizes), "4,4,2");
  const Batch& first = *loader.begin();
  EXPECT_EQ(first.data.shape(), Shape({4, 3}));
  EXPECT_EQ(first.data.dtype(), kFloat32);

  DataLoader dropping(ds, {.batch_size = 4, .drop_last = true});
  EXPECT_EQ(dropping.size(), 2);
  sizes.clear();
  EXPECT_EQ(join(pass_indices(dropping, &sizes)), "0,1,2,3,4,5,6,7");
  EXPECT_EQ(join(sizes), "4,4");
}

TEST(DataLoader, ShuffleIsSeededAndChangesEachEpoch) {
  auto ds = make_tensor_dataset(50);
  DataLoader loader(ds, {.batch_size = 8, .shuffle = true, .seed = 5});
  EXPECT_EQ(pass_indices(loader), torch_randperm(50, 5));
  EXPECT_EQ(pass_indices(loader), torch_randperm(50, 6));  // next pass: next epoch
  loader.set_epoch(20);
  EXPECT_EQ(pass_indices(loader), torch_randperm(50, 25));
  DataLoader again(ds, {.batch_size = 8, .shuffle = true, .seed = 5});
  EXPECT_EQ(pass_indices(again), torch_randperm(50, 5));
}

TEST(DataLoader, OrderDoesNotDependOnWorkers) {
  auto ds = make_tensor_dataset(1000);
  DataLoader reference(ds, {.batch_size = 7, .shuffle = true, .seed = 3});
  const std::vector<int64_t> want = pass_indices(reference);
  for (int64_t workers : {1, 2, 4, 8}) {
    for (int64_t prefetch : {1, 3}) {
      DataLoader loader(ds, {.batch_size = 7,
                             .shuffle = true,
                             .seed = 3,
                             .num_workers = workers,
                             .prefetch_factor = prefetch});
      EXPECT_EQ(pass_indices(loader), want)
          << "num_workers=" << workers << " prefetch_factor=" << prefetch;
      // The second pass is epoch 1 for every worker count.
      EXPECT_EQ(pass_indices(loader), torch_randperm(1000, 4)) << "num_workers=" << workers;
    }
  }
}

// A random transform in get(), examples made at uneven speeds: with a fixed seed the numbers
// are the same run after run and with 0, 1 or 4 workers (Note [DataLoader random numbers]);
// they used to come from the one shared generator in whatever order the workers reached it.
class RandomAugment : public Dataset {
 public:
  int64_t size() const override { return 64; }
  Example get(int64_t i) const override {
    std::this_thread::sleep_for(std::chrono::microseconds((i * 7) % 5 * 200));  // uneven work
    return {rand({1}), full({}, static_cast<double>(i), kInt64)};
  }
};

TEST(DataLoader, RandomTransformsAreReproducibleWhateverTheWorkers) {
  auto ds = std::make_shared<RandomAugment>();
  auto run = [&](int64_t workers) {
    manual_seed(1234);
    DataLoader loader(ds, {.batch_size = 4, .num_workers = workers});
    std::vector<float> v;
    for (const Batch& b : loader) {
      for (float x : b.data.to_vector<float>()) v.push_back(x);
    }
    return v;
  };
  const std::vector<float> want = run(0);
  ASSERT_EQ(want.size(), 64u);
  EXPECT_EQ(run(0), want);
  EXPECT_EQ(run(4), want);
  EXPECT_EQ(run(4), want);
  EXPECT_EQ(run(1), want);
  // Another seed, other numbers.
  manual_seed(99);
  DataLoader other(ds, {.batch_size = 4});
  EXPECT_NE((*other.begin()).data.to_vector<float>()[0], want[0]);
}

TEST(DataLoader, DistributedSamplerAndSetEpoch) {
  auto ds = make_tensor_dataset(10);
  auto sampler = std::make_shared<DistributedSampler>(10, 3, 1, true, 0);
  DataLoader loader(ds, {.batch_size = 3, .num_workers = 2, .sampler = sampler});
  EXPECT_EQ(loader.size(), 2);                       // 4 indices per rank
  EXPECT_EQ(join(pass_indices(loader)), "1,3,8,4");  // kDistCases: n=10 world=3 rank=1
  EXPECT_EQ(join(pass_indices(loader)), "1,3,8,4");  // unchanged until set_epoch, as PyTorch
  loader.set_epoch(7);
  EXPECT_EQ(sampler->epoch(), 7);
  sampler->set_epoch(7);
  DistributedSampler same(10, 3, 1, true, 0);
  same.set_epoch(7);
  EXPECT_EQ(pass_indices(loader), same.indices());
}

TEST(DataLoader, ValidatesOptions) {
  auto ds = make_tensor_dataset(4);
  expect_error([&] { DataLoader(ds, {.batch_size = 0}); }, {"[DataLoader]", "batch_size", "0"});
  expect_error([&] { DataLoader(ds, {.num_workers = -1}); }, {"[DataLoader]", "num_workers"});
  expect_error([&] { DataLoader(ds, {.prefetch_factor = 0}); }, {"[DataLoader]", "prefetch"});
  expect_error([&] { DataLoader(nullptr); }, {"[DataLoader]", "null"});
  expect_error(
      [&] { DataLoader(ds, {.shuffle = true, .sampler = std::make_shared<SequentialSampler>(4)}); },
      {"[DataLoader]", "mutually exclusive"});
  DataLoader bad(ds, {.sampler = std::make_shared<SequentialSampler>(6)});
  expect_error<IndexError>([&] { bad.begin(); }, {"[DataLoader]", "index 4", "4 examples"});
}

TEST(DataLoader, EmptyDatasetAndIterators) {
  auto ds = std::make_shared<TensorDataset>(zeros({0, 3}), zeros({0}, kInt64));
  DataLoader loader(ds, {.batch_size = 4, .num_workers = 2});
  EXPECT_EQ(loader.size(), 0);
  EXPECT_TRUE(loader.begin() == loader.end());

  DataLoader small(make_tensor_dataset(5), {.batch_size = 2});
  auto it = small.begin();
  EXPECT_TRUE(it != small.end());
  EXPECT_EQ(it->data.size(0), 2);
  ++it;
  ++it;
  EXPECT_EQ(it->data.size(0), 1);
  ++it;
  EXPECT_TRUE(it == small.end());
  expect_error([&] { *it; }, {"[DataLoader]", "end"});
  expect_error([&] { ++it; }, {"[DataLoader]", "past the end"});
}

TEST(DataLoader, NewPassCancelsRunningOne) {
  auto ds = make_tensor_dataset(100);
  DataLoader loader(ds, {.batch_size = 10, .num_workers = 3});
  auto old = loader.begin();
  ++old;
  EXPECT_EQ(old->data.select(1, 0).to_vector<int64_t>().front(), 10);
  // Starting a new pass cancels the old one: its iterator is now at the end.
  EXPECT_EQ(join(pass_indices(loader)).substr(0, 9), "0,1,2,3,4");
  EXPECT_TRUE(old == loader.end());
}

// Targets i % 3 for examples 0..n-1 (as make_tensor_dataset, which pass_indices checks).
Tensor mod3_targets(int64_t n) {
  std::vector<int64_t> t(n);
  for (int64_t i = 0; i < n; ++i) t[i] = i % 3;
  return from_vector(t, {n});
}

// Counts get_batch calls; batch k of `fail_batch` throws `kind`.
class CountingDataset : public TensorDataset {
 public:
  enum Kind { kNone, kIndex, kStd };
  CountingDataset(int64_t n, int64_t fail_index, Kind kind)
      : TensorDataset(arange(n).unsqueeze(1), mod3_targets(n)),
        fail_index_(fail_index),
        kind_(kind) {}
  Example get_batch(const std::vector<int64_t>& indices) const override {
    calls.fetch_add(1);
    for (int64_t i : indices) {
      if (i == fail_index_ && kind_ == kIndex) {
        throw IndexError(ember::detail::str_cat("[CountingDataset] poisoned index ", i));
      }
      if (i == fail_index_ && kind_ == kStd) throw std::runtime_error("disk on fire");
    }
    return TensorDataset::get_batch(indices);
  }
  mutable std::atomic<int64_t> calls{0};

 private:
  int64_t fail_index_;
  Kind kind_;
};

TEST(DataLoader, WorkerErrorsAreRethrownNamingTheBatch) {
  for (int64_t workers : {0, 1, 3}) {
    auto ds = std::make_shared<CountingDataset>(40, 13, CountingDataset::kIndex);
    DataLoader loader(ds, {.batch_size = 4, .num_workers = workers});
    std::vector<int64_t> got;
    expect_error<IndexError>(
        [&] {
          for (const Batch& b : loader) {
            for (int64_t v : b.data.select(1, 0).to_vector<int64_t>()) got.push_back(v);
          }
        },
        {"[DataLoader] batch 3 of 10", "12, 13, 14, 15", "poisoned index 13"});
    // Batches before the failing one arrived, in order.
    EXPECT_EQ(join(got), "0,1,2,3,4,5,6,7,8,9,10,11") << "num_workers=" << workers;
  }
  auto ds = std::make_shared<CountingDataset>(8, 0, CountingDataset::kStd);
  DataLoader loader(ds, {.batch_size = 4, .num_workers = 2});
  expect_error<Error>([&] { loader.begin(); },
                      {"[DataLoader] batch 0", "in worker", "disk on fire"});
  // The loader is usable again: a new pass starts from the top (and fails the same way).
  expect_error<Error>([&] { loader.begin(); }, {"disk on fire"});
}

TEST(DataLoader, PrefetchIsBounded) {
  const int64_t workers = 2, prefetch = 2, capacity = workers * prefetch;
  auto ds = std::make_shared<CountingDataset>(1000, -1, CountingDataset::kNone);
  DataLoader loader(ds, {.batch_size = 1, .num_workers = workers, .prefetch_factor = prefetch});
  int64_t consumed = 0;
  for (const Batch& b : loader) {
    ++consumed;
    // Workers may claim batch k only while k < consumed + capacity.
    ASSERT_LE(ds->calls.load(), consumed + capacity) << "after " << consumed << " batches";
    ASSERT_EQ(b.data.size(0), 1);
  }
  EXPECT_EQ(consumed, 1000);
  EXPECT_EQ(ds->calls.load(), 1000);
}

TEST(DataLoader, DestroyedMidPassShutsDownCleanly) {
  auto ds = std::make_shared<CountingDataset>(10000, -1, CountingDataset::kNone);
  for (int rep = 0; rep < 20; ++rep) {
    auto loader = std::make_unique<DataLoader>(
        ds, DataLoaderOptions{.batch_size = 2, .num_workers = 4, .prefetch_factor = 1});
    auto it = loader->begin();
    ++it;
    loader.reset();  // workers are blocked on queue space: they must wake and be joined
    EXPECT_TRUE(it == DataLoader::Iterator());
  }
  // At most first pass's in-flight batches were ever made: no worker kept running.
  const int64_t calls = ds->calls.load();
  EXPECT_LE(calls, 20 * (2 + 4));
}

// get_batch of a batch holding index `gate_index` blocks until open() is called.
class GatedDataset : public TensorDataset {
 public:
  explicit GatedDataset(int64_t n, int64_t gate_index)
      : TensorDataset(arange(n).unsqueeze(1), mod3_targets(n)), gate_(gate_index) {}
  Example get_batch(const std::vector<int64_t>& indices) const override {
    for (int64_t i : indices) {
      if (i == gate_) {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return open_; });
      }
    }
    return TensorDataset::get_batch(indices);
  }
  void open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }

 private:
  int64_t gate_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool open_ = false;
};

TEST(DataLoader, TimeoutWhenAWorkerIsStuck) {
  auto ds = std::make_shared<GatedDataset>(20, 9);
  {
    DataLoader loader(
        // Generous: batches 0 and 1 must arrive within it even on a loaded machine.
        ds, {.batch_size = 4, .num_workers = 2, .timeout = std::chrono::milliseconds(3000)});
    std::vector<int64_t> sizes;
    expect_error<Error>([&] { pass_indices(loader, &sizes); },
                        {"[DataLoader] batch 2 of 5", "timed out after 3000 ms"});
    EXPECT_EQ(join(sizes), "4,4");
  }            // the stuck worker was detached: destroying the loader does not wait for it
  ds->open();  // lets the detached worker finish; it holds the dataset until then
}

}  // namespace
}  // namespace ember::nn::data
