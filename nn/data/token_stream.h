// A token stream for language models: prose decoded once into a flat file of uint8 tokens (one
// per byte), or a file of uint16 tokens in llm.c's format (a tokenizer's output, such as
// llm.c's GPT-2 shards of FineWeb or TinyStories), memory-mapped, split into a training and a
// validation part, and cut into random context windows per rank with DistributedSampler's
// seed-per-epoch discipline.
//
// llm.c's format: a header of 256 little-endian int32 (header[0] = 20240520, the magic;
// header[1] = 1, the version; header[2] = n, the number of tokens), then n little-endian
// uint16 tokens. A file is taken as llm.c's when its first 4 bytes are the magic's (48 d5 34
// 01), else as byte tokens: a byte file is mistaken for llm.c's only if it begins with exactly
// those bytes, which no text does (0xd5 0x34 is no UTF-8 and 0x01 no printable character).
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
#include <functional>
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

/// llm.c's token file format (see the file comment).
inline constexpr int32_t kLlmcMagic = 20240520;
inline constexpr int32_t kLlmcVersion = 1;
/// The header's size: 256 int32.
inline constexpr int64_t kLlmcHeaderBytes = 256 * 4;

/// Whether the file at `path` begins with llm.c's magic (false for a missing, unreadable or
/// shorter file). Reads 4 bytes; says nothing about the rest (TokenFile checks it).
bool is_llmc_token_file(const std::string& path);

/// Writes `count` tokens in llm.c's format to `path`, atomically (nn/io/atomic_file.h): the
/// header, then token(0), ..., token(count - 1), streamed (nothing of the size of the file is
/// held in memory). Throws ValueError for count < 1, count > INT32_MAX (the header's field)
/// or a token outside [0, 65535], ember::Error when the file cannot be written.
void write_llmc_token_file(const std::string& path, int64_t count,
                           const std::function<int64_t(int64_t i)>& token);
/// write_llmc_token_file for tokens held in memory.
void write_llmc_token_file(const std::string& path, const std::vector<uint16_t>& tokens);

/// An llm.c-format file of `count` tokens drawn uniformly from [0, vocab) by a generator
/// seeded with `seed` (std::mt19937_64, the same tokens on every machine), in `cache_dir` (created
/// if need be) as "synthetic-v<vocab>-n<count>-s<seed>.bin"; returns its path. Made once,
/// atomically (ranks that make it at once each write the same bytes), and reused when a file
/// of that name and size is there. For speed runs: the tokens carry nothing to learn.
/// Throws ValueError for vocab outside [1, 65536] or count < 1, ember::Error when the cache
/// directory cannot be created or written.
std::string prepare_synthetic_token_file(const std::string& cache_dir, int64_t vocab, int64_t count,
                                         uint64_t seed);

/// The token file of `source` in `cache_dir` (created if need be), built from read_prose(source)
/// unless the one there was built from this very file as it is now (its absolute path, size and
/// modification time, recorded in "<token file>.source": another folder's file of the same name
/// or an edited one is rebuilt, never reused); returns its path, "<cache_dir>/<source file
/// name>.tokens". The file holds one uint8 token per byte, nothing else. It is written
/// atomically (nn/io/atomic_file.h), so ranks that build it at once each write the same bytes and
/// no reader ever sees half a file. Throws ValueError as read_prose does, or ember::Error when
/// the cache directory cannot be created or written. A source in llm.c's format is already a
/// token file: its own path is returned and nothing is written to the cache.
std::string prepare_token_file(const std::string& source, const std::string& cache_dir);

/// A token file mapped read-only into memory (the pages are shared with every other process
/// mapping it): byte tokens (one per byte) or llm.c's format (uint16 tokens after a header),
/// told apart by llm.c's magic. Move-only; the mapping lives as long as the object.
class TokenFile {
 public:
  /// Throws ValueError naming the path when it is missing, unreadable or empty; for llm.c's
  /// format also when the header is cut short, its version is not 1, it holds no tokens, or
  /// its token count disagrees with the file's size (the message gives both sizes).
  explicit TokenFile(const std::string& path);
  ~TokenFile();
  TokenFile(TokenFile&& other) noexcept;
  TokenFile& operator=(TokenFile&& other) noexcept;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  /// The tokens' bytes (after llm.c's header): size() tokens of token_bytes() bytes each,
  /// little-endian.
  const uint8_t* data() const { return data_; }
  /// The number of tokens.
  int64_t size() const { return size_; }
  /// Bytes per token: 1 for a byte file, 2 for llm.c's format.
  int token_bytes() const { return token_bytes_; }
  /// Token i, for i in [0, size()); not bounds-checked.
  int64_t token(int64_t i) const {
    return token_bytes_ == 1 ? data_[i] : data_[2 * i] | (int64_t{data_[2 * i + 1]} << 8);
  }
  /// The largest token; reads the whole file (once per call).
  int64_t max_token() const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* map_ = nullptr;  // the whole file, as mapped
  int64_t map_bytes_ = 0;
  const uint8_t* data_ = nullptr;  // the first token, in the mapping
  int64_t size_ = 0;
  int token_bytes_ = 1;
};

struct TokenStreamOptions {
  int64_t context = 128;            ///< T: tokens per window
  int64_t batch_size = 16;          ///< B: windows per rank per step
  int64_t world_size = 1;
  int64_t rank = 0;
  uint64_t seed = 0;                ///< the sampler's seed; epoch e shuffles with seed + e
  double validation_fraction = 0.1; ///< the last part of the tokens held out, in [0, 1)
  /// The model's vocabulary: every token must be below it (checked once, over the whole file).
  /// 0: not checked.
  int64_t vocab = 0;
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
  /// With options.vocab > 0, also for a token >= vocab: the message names the file, its largest
  /// token and the vocabulary.
  TokenStream(std::shared_ptr<const TokenFile> tokens, const TokenStreamOptions& options);

  int64_t train_tokens() const { return train_tokens_; }
  int64_t validation_tokens() const { return tokens_->size() - train_tokens_; }
  /// Steps in one pass of the sampler over the training windows.
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  const TokenStreamOptions& options() const { return options_; }
  const TokenFile& tokens() const { return *tokens_; }

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
