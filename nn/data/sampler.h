// Samplers: the order in which a DataLoader visits a dataset's indices, as
// torch.utils.data.{SequentialSampler, RandomSampler, DistributedSampler}.
//
// Shuffles use PyTorch's own CPU algorithm (torch_randperm below), so a shuffled order equals
// the one PyTorch 1.13 gives for the same seed and epoch, index for index.
//
// Threads: a sampler is used by one thread at a time (DataLoader draws the indices of a pass on
// the thread that starts it).
#pragma once

#include <cstdint>
#include <vector>

namespace ember::nn::data {

/// The permutation `torch.randperm(n, generator=torch.Generator().manual_seed(seed))` gives on
/// the CPU in PyTorch 1.13: mt19937 seeded with the low 32 bits of `seed` (as PyTorch seeds its
/// CPU generator), then for i in [0, n-1) swap element i with element i + (draw % (n - i)).
/// Throws ValueError for n < 0.
std::vector<int64_t> torch_randperm(int64_t n, uint64_t seed);

/// Abstract sampler: yields the dataset indices of one pass (an epoch).
class Sampler {
 public:
  virtual ~Sampler() = default;
  /// Number of indices one pass yields.
  virtual int64_t size() const = 0;
  /// The indices of the next pass, in order. DataLoader calls it once at the start of each
  /// pass. Non-const: a sampler may advance its own state (RandomSampler does).
  virtual std::vector<int64_t> indices() = 0;
  /// Selects the epoch the next pass draws its order from (a no-op for orderless samplers).
  virtual void set_epoch(int64_t epoch) {}
};

/// 0, 1, ..., n-1.
class SequentialSampler : public Sampler {
 public:
  /// Throws ValueError for n < 0.
  explicit SequentialSampler(int64_t n);
  int64_t size() const override { return n_; }
  std::vector<int64_t> indices() override;

 private:
  int64_t n_;
};

/// A fresh permutation of 0..n-1 each pass: pass e is torch_randperm(n, seed + e). The epoch
/// starts at 0 and advances by one after every pass, so successive passes differ as in
/// PyTorch; set_epoch(e) makes the next pass use e (and the one after e + 1).
class RandomSampler : public Sampler {
 public:
  /// Throws ValueError for n < 0.
  explicit RandomSampler(int64_t n, uint64_t seed = 0);
  int64_t size() const override { return n_; }
  std::vector<int64_t> indices() override;
  void set_epoch(int64_t epoch) override { epoch_ = epoch; }
  /// The epoch the next pass will use.
  int64_t epoch() const { return epoch_; }

 private:
  int64_t n_;
  uint64_t seed_;
  int64_t epoch_ = 0;
};

/// One rank's share of a dataset, with torch.utils.data.DistributedSampler's exact semantics:
///  - order: torch_randperm(n, seed + epoch) when shuffle, else 0..n-1; the same on every rank,
///    so ranks must call set_epoch with the same value (the order does NOT change between passes
///    until set_epoch is called, as in PyTorch);
///  - !drop_last: the list is padded to a multiple of num_replicas by repeating it from the
///    start (cyclically when it is shorter than the padding), so each rank gets ceil(n / world);
///  - drop_last: the tail is cut so each rank gets floor(n / world);
///  - rank r takes positions r, r + world, r + 2*world, ...
class DistributedSampler : public Sampler {
 public:
  /// `dataset_size` examples split over `num_replicas` ranks; this is rank `rank`. Throws
  /// ValueError for num_replicas < 1, a rank outside [0, num_replicas - 1] or a negative size.
  DistributedSampler(int64_t dataset_size, int64_t num_replicas, int64_t rank, bool shuffle = true,
                     uint64_t seed = 0, bool drop_last = false);
  /// Indices this rank yields per pass (PyTorch's num_samples).
  int64_t size() const override { return num_samples_; }
  std::vector<int64_t> indices() override;
  void set_epoch(int64_t epoch) override { epoch_ = epoch; }
  int64_t epoch() const { return epoch_; }
  /// num_samples * num_replicas: the padded (or cut) length of the global list.
  int64_t total_size() const { return num_samples_ * num_replicas_; }
  int64_t num_replicas() const { return num_replicas_; }
  int64_t rank() const { return rank_; }

 private:
  int64_t dataset_size_;
  int64_t num_replicas_;
  int64_t rank_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  int64_t num_samples_;
  int64_t epoch_ = 0;
};

}  // namespace ember::nn::data
