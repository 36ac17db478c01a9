// A byte-level token stream for language models: prose decoded once into a flat file of uint8
// tokens (one per byte), memory-mapped, split into a training and a validation part, and cut
// into random context windows per rank with DistributedSampler's seed-per-epoch discipline.
//
// The window scheme is plain enough to reimplement elsewhere (benchmarks/vs_pytorch/gpt_torch.py
// does, so that PyTorch sees the same batches):
//  - n tokens; the last floor(n * validation_fraction) are the validation split, the rest
//    (n_train) the training split.
//  - A training window starts at i in [0, n_train - T - 1]: x = tokens[i, i+T), y = tokens[i+1,
//    i+T+1). The n_train - T starts are a dataset for DistributedSampler(n_train - T, world,
//    rank, shuffle = true, seed, drop_last = true) (torch.utils.data.DistributedSampler's exact
//    order, see sampler.h). Global step s lies in epoch e = s / steps_per_epoch, at position
//    k = s % steps_per_epoch; the rank's batch is its sampler indices [k*B, (k+1)*B) of epoch e.
//  - Validation: W = batches * B * world windows spread evenly over the split; window j starts
//    at n_train + j * (m - 1) / max(W - 1, 1) (integer division), m = n_val - T the number of
//    starts; rank r's batch b holds windows j = (b * B + i) * world + r for i in [0, B).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ember/nn/data/dataset.h>
#include <ember/nn/data/sampler.h>

namespace ember::nn::data {

/// Where Debian's bible-kjv-text package puts the King James Bible (in its compressed format).
inline constexpr const char* kKjvBible = "/usr/lib/bible.data";

/// The prose held in `path`, as bytes. A file in bible-kjv-text's compressed format (it begins
/// with "EC02") is decoded by that package's own reader, bible(1), into one line per verse
/// (verse numbers dropped) under a line per chapter ("Genesis 1"); any other file is taken as
/// it is. Throws ValueError naming the path when it is missing, unreadable or empty, or when
/// bible(1) is not installed or fails.
std::string read_prose(const std::string& path);

/// The token file of `source` in `cache_dir` (created if need be), built from read_prose(source)
/// unless the one there was built from this very file as it is now (its absolute path, size and
/// modification time, recorded in "<token file>.source": another folder's file of the same name
/// or an edited one is rebuilt, never reused); returns its path, "<cache_dir>/<source file
/// name>.tokens". The file holds one uint8 token per byte, nothing else. It is written
/// atomically (nn/atomic_file.h), so ranks that build it at once each write the same bytes and
/// no reader ever sees half a file. Throws ValueError as read_prose does, or ember::Error when
/// the cache directory cannot be created or written.
std::string prepare_token_file(const std::string& source, const std::string& cache_dir);

/// A token file mapped read-only into memory (the pages are shared with every other process
/// mapping it). Move-only; the mapping lives as long as the object.
class TokenFile {
 public:
  /// Throws ValueError naming the path when it is missing, unreadable or empty.
  explicit TokenFile(const std::string& path);
  ~TokenFile();
  TokenFile(TokenFile&& other) noexcept;
  TokenFile& operator=(TokenFile&& other) noexcept;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  const uint8_t* data() const { return data_; }
  int64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  int64_t size_ = 0;
};

struct TokenStreamOptions {
  int64_t context = 128;            ///< T: tokens per window
  int64_t batch_size = 16;          ///< B: windows per rank per step
  int64_t world_size = 1;
  int64_t rank = 0;
  uint64_t seed = 0;                ///< the sampler's seed; epoch e shuffles with seed + e
  double validation_fraction = 0.1; ///< the last part of the tokens held out, in [0, 1)
};

/// Training and validation batches of context windows over a TokenFile (see the file comment for
/// the exact scheme). Batches are int64 tensors on the CPU: data x [B, T] and target y [B, T],
/// y being x shifted by one token. A batch is a pure function of the step, so a resumed run
/// continues with the batches an uninterrupted one would have drawn.
/// Threads: one thread at a time (train_batch caches the current epoch's order).
class TokenStream {
 public:
  /// Throws ValueError for a context or batch size < 1, a rank outside [0, world_size), a
  /// validation fraction outside [0, 1), or a text too short to hold one training step for every
  /// rank or (with a validation split) one validation window; the message gives both lengths.
  TokenStream(std::shared_ptr<const TokenFile> tokens, const TokenStreamOptions& options);

  int64_t train_tokens() const { return train_tokens_; }
  int64_t validation_tokens() const { return tokens_->size() - train_tokens_; }
  /// Steps in one pass of the sampler over the training windows.
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  const TokenStreamOptions& options() const { return options_; }

  /// This rank's window starts (offsets into the token file) for global step `step` >= 0.
  std::vector<int64_t> train_offsets(int64_t step);
  Batch train_batch(int64_t step) { return batch_at(train_offsets(step)); }

  /// This rank's window starts for validation batch `batch` of `batches` (both ranks must pass
  /// the same `batches`). Throws ValueError when the split is empty or batch is out of range.
  std::vector<int64_t> validation_offsets(int64_t batch, int64_t batches) const;
  Batch validation_batch(int64_t batch, int64_t batches) const {
    return batch_at(validation_offsets(batch, batches));
  }

  /// The windows starting at `offsets` (each must leave room for T + 1 tokens).
  Batch batch_at(const std::vector<int64_t>& offsets) const;

 private:
  std::shared_ptr<const TokenFile> tokens_;
  TokenStreamOptions options_;
  int64_t train_tokens_;
  DistributedSampler sampler_;
  int64_t steps_per_epoch_;
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> epoch_order_;  // this rank's sampler indices for cached_epoch_
};

}  // namespace ember::nn::data
