#include <ember/nn/data/sampler.h>

#include <numeric>
#include <random>
#include <utility>

#include <ember/tensor/error.h>

namespace ember::nn::data {

// Note [torch_randperm]: PyTorch 1.13's randperm_cpu (aten/src/ATen/native/TensorFactories.cpp)
// fills 0..n-1 and then, for i in [0, n-1), swaps r[i] with r[i + generator->random() % (n-i)],
// where random() is one 32-bit mt19937 draw. manual_seed(s) seeds at::mt19937 with
// init_genrand(s & 0xffffffff), which is exactly std::mt19937's seeding, so std::mt19937 yields
// the same stream. 1.13 has one path for every n (later versions switch to random64() for huge
// n). Checked against torch.randperm for n up to 5,000,000 and seeds above 2^32.
std::vector<int64_t> torch_randperm(int64_t n, uint64_t seed) {
  EMBER_CHECK(n >= 0, "[torch_randperm] expected n >= 0, got ", n);
  std::vector<int64_t> r(static_cast<size_t>(n));
  std::iota(r.begin(), r.end(), int64_t{0});
  std::mt19937 gen(static_cast<uint32_t>(seed & 0xffffffffu));
  for (int64_t i = 0; i + 1 < n; ++i) {
    const int64_t z = static_cast<int64_t>(static_cast<uint32_t>(gen())) % (n - i);
    std::swap(r[i], r[i + z]);
  }
  return r;
}

namespace {
void check_size(const char* op, int64_t n) {
  EMBER_CHECK(n >= 0, "[", op, "] expected a dataset size >= 0, got ", n);
}
}  // namespace

SequentialSampler::SequentialSampler(int64_t n) : n_(n) { check_size("SequentialSampler", n); }

std::vector<int64_t> SequentialSampler::indices() {
  std::vector<int64_t> r(static_cast<size_t>(n_));
  std::iota(r.begin(), r.end(), int64_t{0});
  return r;
}

RandomSampler::RandomSampler(int64_t n, uint64_t seed) : n_(n), seed_(seed) {
  check_size("RandomSampler", n);
}

std::vector<int64_t> RandomSampler::indices() {
  // seed + epoch wraps modulo 2^64 as PyTorch's manual_seed does for out-of-range Python ints.
  std::vector<int64_t> r = torch_randperm(n_, seed_ + static_cast<uint64_t>(epoch_));
  ++epoch_;
  return r;
}

DistributedSampler::DistributedSampler(int64_t dataset_size, int64_t num_replicas, int64_t rank,
                                       bool shuffle, uint64_t seed, bool drop_last)
    : dataset_size_(dataset_size),
      num_replicas_(num_replicas),
      rank_(rank),
      shuffle_(shuffle),
      seed_(seed),
      drop_last_(drop_last) {
  check_size("DistributedSampler", dataset_size);
  EMBER_CHECK(num_replicas >= 1, "[DistributedSampler] expected num_replicas >= 1, got ",
              num_replicas);
  EMBER_CHECK(rank >= 0 && rank < num_replicas, "[DistributedSampler] invalid rank ", rank,
              ", rank should be in the interval [0, ", num_replicas - 1, "] for num_replicas ",
              num_replicas);
  // PyTorch: drop_last and n % world != 0 -> ceil((n - world) / world), which is floor(n / world)
  // (0 when n < world); otherwise ceil(n / world).
  num_samples_ =
      drop_last ? dataset_size / num_replicas : (dataset_size + num_replicas - 1) / num_replicas;
}

std::vector<int64_t> DistributedSampler::indices() {
  std::vector<int64_t> all;
  if (shuffle_) {
    all = torch_randperm(dataset_size_, seed_ + static_cast<uint64_t>(epoch_));
  } else {
    all.resize(static_cast<size_t>(dataset_size_));
    std::iota(all.begin(), all.end(), int64_t{0});
  }
  // Position p of the padded (or cut) global list is all[p % n]: padding repeats the list from
  // its start, cyclically when the padding is longer than the list, exactly as PyTorch's
  // `indices += (indices * ceil(padding / n))[:padding]`.
  const int64_t total = total_size();
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(num_samples_));
  for (int64_t p = rank_; p < total; p += num_replicas_) mine.push_back(all[p % dataset_size_]);
  return mine;
}

}  // namespace ember::nn::data
