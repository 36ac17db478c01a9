// Seedable random numbers. A Generator is a Philox4x32-10 counter-based stream: the same seed
// gives the same numbers every run, and CPU and CUDA draw the same values for the same seed
// and shape (each element's numbers depend only on (seed, offset, element index)).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>

#include <ember/tensor/tensor.h>

namespace ember {

class Generator {
 public:
  explicit Generator(uint64_t seed = 67280421310721ULL) : seed_(seed) {}
  void manual_seed(uint64_t seed);
  uint64_t seed() const;
  /// Reserves `n` counter values and returns the first: each op draws from its own range,
  /// so results do not depend on how the work is split across threads or GPU blocks.
  uint64_t advance(uint64_t n);
  /// The seed and the first of `n` reserved counter values, read together under the lock so a
  /// concurrent manual_seed() cannot pair a new seed with an old offset.
  struct Draw {
    uint64_t seed;
    uint64_t offset;
  };
  Draw reserve(uint64_t n);
  /// Counter position (for checkpointing a generator).
  uint64_t offset() const;
  void set_offset(uint64_t offset);

 private:
  mutable std::mutex mu_;
  uint64_t seed_;
  uint64_t offset_ = 0;
};

/// The generator used when none is given: the calling thread's if it set one
/// (set_thread_default_generator), else the process-wide one.
Generator& default_generator();
/// Makes `gen` the calling thread's default generator (null: the process-wide one again); the
/// caller keeps it alive while it is set. Rank threads (dist::run_rank_threads gives each rank
/// one) then draw as separate processes would: the same seeds give the same numbers whatever
/// the other ranks draw.
void set_thread_default_generator(Generator* gen);
/// Seeds the default generator (torch.manual_seed).
void manual_seed(uint64_t seed);

/// Uniform on [0, 1).
Tensor rand(IntList shape, TensorOptions opts = {}, Generator* gen = nullptr);
/// Standard normal.
Tensor randn(IntList shape, TensorOptions opts = {}, Generator* gen = nullptr);
/// Integers uniform on [low, high); int64 unless opts says otherwise.
Tensor randint(int64_t low, int64_t high, IntList shape, TensorOptions opts = kInt64,
               Generator* gen = nullptr);
/// A random permutation of 0..n-1 (int64).
Tensor randperm(int64_t n, TensorOptions opts = kInt64, Generator* gen = nullptr);
/// In place: uniform on [from, to) / normal(mean, std).
Tensor& uniform_(Tensor& t, double from = 0.0, double to = 1.0, Generator* gen = nullptr);
Tensor& normal_(Tensor& t, double mean = 0.0, double std = 1.0, Generator* gen = nullptr);
/// In place: 1 with probability p, else 0.
Tensor& bernoulli_(Tensor& t, double p, Generator* gen = nullptr);

}  // namespace ember
