// DataLoader: batches of a Dataset in sampler order, optionally assembled ahead of time by
// background threads (torch.utils.data.DataLoader with thread workers).
//
//   auto train = std::make_shared<FashionMNIST>();
//   DataLoader loader(train, {.batch_size = 64, .shuffle = true, .seed = 0, .num_workers = 2});
//   for (int64_t epoch = 0; epoch < 10; ++epoch) {
//     loader.set_epoch(epoch);
//     for (const Batch& b : loader) { ... b.data [64, 1, 28, 28], b.target [64] ... }
//   }
//
// Order: batch k of a pass holds sampler positions [k * batch_size, (k + 1) * batch_size), and
// batches are yielded in k order whatever num_workers is, so results do not depend on it.
// Random numbers: batch k is made with the thread's default generator one seeded from the pass
// and k (the pass's seed drawn from the iterating thread's generator when it starts), so a
// random transform in get/get_batch draws the same numbers with 0 workers or 8 and under any
// scheduling, and again after the same manual_seed.
//
// Workers: with num_workers > 0, each pass starts that many threads; they call
// Dataset::get_batch for the next unclaimed batch, at most num_workers * prefetch_factor batches
// ahead of the consumer (a bounded prefetch queue). With 0, batches are made on the caller's
// thread when the iterator advances. An exception from get_batch is re-thrown on the caller's
// thread, with its original ember type (ValueError, IndexError, ...) and a message naming the
// batch number and its first indices; the pass then ends.
//
// Lifetime and threads: one pass runs at a time; begin() (a new range-for) cancels a pass still
// running. Destroying the loader, or starting a new pass, stops the workers and joins them:
// workers waiting for queue space wake at once; one inside get_batch finishes that call first.
// A DataLoader is used by one thread at a time (its workers are internal). Iterators stay safe
// to compare and destroy after their pass was cancelled; they then equal end().
#pragma once

#include <chrono>
#include <cstdint>
#include <iterator>
#include <memory>

#include <ember/nn/data/dataset.h>
#include <ember/nn/data/sampler.h>

namespace ember::nn::data {

/// Options of a DataLoader (designated initialisers read well: {.batch_size = 64}).
struct DataLoaderOptions {
  /// Examples per batch (>= 1).
  int64_t batch_size = 1;
  /// Visit the dataset in a new random order each pass (a RandomSampler seeded with `seed`).
  /// Cannot be combined with `sampler`.
  bool shuffle = false;
  /// Seed of the shuffle: pass e uses torch_randperm(n, seed + e).
  uint64_t seed = 0;
  /// Drop the last batch when it would be smaller than batch_size.
  bool drop_last = false;
  /// Background threads assembling batches; 0 makes them on the caller's thread.
  int64_t num_workers = 0;
  /// Batches each worker may have ready or in progress ahead of the consumer (>= 1).
  int64_t prefetch_factor = 2;
  /// How long the caller waits for one batch from the workers before throwing ember::Error
  /// saying so; zero waits for as long as it takes (PyTorch's timeout=0). On a timeout the
  /// pass ends and its workers are detached rather than joined (one may be stuck inside
  /// get_batch; it keeps the dataset alive until it returns).
  std::chrono::milliseconds timeout{0};
  /// Where the indices come from (e.g. a DistributedSampler); default: sequential, or random
  /// when shuffle. Its indices must lie in [0, dataset size).
  std::shared_ptr<Sampler> sampler = nullptr;
};

class DataLoader {
 public:
  struct Pass;  // one pass over the data (defined in dataloader.cpp)

  /// Input iterator over the batches of one pass. Dereferencing gives the current batch, valid
  /// until the iterator advances.
  class Iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    using pointer = const Batch*;
    using reference = const Batch&;

    Iterator() = default;
    const Batch& operator*() const;
    const Batch* operator->() const { return &**this; }
    /// Moves to the next batch (waiting for a worker when needed); rethrows a worker's error.
    Iterator& operator++();
    /// Iterators compare equal when both are at the end (past the last batch, or of a
    /// cancelled pass) or both belong to the same running pass.
    bool operator==(const Iterator& o) const;
    bool operator!=(const Iterator& o) const { return !(*this == o); }

   private:
    friend class DataLoader;
    explicit Iterator(std::shared_ptr<Pass> pass) : pass_(std::move(pass)) {}
    bool at_end() const;
    std::shared_ptr<Pass> pass_;
  };

  /// Throws ValueError for a null dataset, batch_size < 1, num_workers < 0,
  /// prefetch_factor < 1, a negative timeout, or shuffle together with a sampler.
  DataLoader(std::shared_ptr<const Dataset> dataset, DataLoaderOptions options = {});
  /// Stops and joins the workers of a running pass.
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  /// Starts a pass: draws the sampler's indices (advancing a RandomSampler's epoch), starts the
  /// workers, and returns an iterator at the first batch (waiting for it). Cancels a running
  /// pass. Throws like operator++ when the first batch fails, and ValueError for sampler
  /// indices out of range.
  Iterator begin();
  Iterator end() { return Iterator(); }
  /// Batches per pass (len(loader)).
  int64_t size() const;
  /// Forwards to the sampler (the internal RandomSampler when shuffle): the next pass uses
  /// this epoch's order.
  void set_epoch(int64_t epoch);
  const Dataset& dataset() const { return *dataset_; }
  const DataLoaderOptions& options() const { return options_; }
  /// The sampler in use (the one given, or the internal one).
  Sampler& sampler() const { return *sampler_; }

 private:
  std::shared_ptr<const Dataset> dataset_;
  DataLoaderOptions options_;
  std::shared_ptr<Sampler> sampler_;
  std::shared_ptr<Pass> pass_;  // the running pass, if any
};

}  // namespace ember::nn::data
