// TensorBoard event files from C++: the counterpart of torch.utils.tensorboard.SummaryWriter.
//
//   nn::SummaryWriter tb("runs/exp1");            // rank 0 writes; other ranks do nothing
//   tb.add_scalar("train/loss", loss, step);
//   tb.add_histogram("fc1/weight", fc1->weight, step);
//   tb.add_text("config", "lr 0.05, batch 64");
//   // tensorboard --logdir runs
//
// A writer owns one event file, log_dir/events.out.tfevents.<unix time>.<host>.<pid>.<n>
// (TensorBoard's name; n counts the files this process opened), plus one more per key of
// add_scalars, in log_dir/<main_tag>_<key>/. Each file is a sequence of TFRecords (a
// little-endian uint64 length, the masked CRC32C of those 8 bytes, the bytes of one Event
// protocol buffer, the masked CRC32C of those bytes); the first Event is the file version,
// "brain.Event:2". See docs/observability.md.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include <ember/tensor/tensor.h>

namespace ember::nn {

/// Options of a SummaryWriter (designated initialisers read well: {.flush_secs = 10}).
struct SummaryWriterOptions {
  /// Events are buffered in memory and written when this many seconds have passed since the
  /// last write (checked on each add_*; there is no background thread), on flush(), close()
  /// and destruction, and whenever a megabyte has piled up. torch's default, 120; <= 0 writes
  /// every event at once.
  double flush_secs = 120;
  /// Every rank writes, rank r into `log_dir/rank<r>`. By default only rank 0 writes and a writer
  /// on any other rank creates nothing and ignores every call, so a training script can make
  /// one on every rank, as torch scripts do.
  bool all_ranks = false;
  /// This process's rank; -1 takes it from the environment (rank_from_environment()).
  int rank = -1;
  /// Appended to each event file's name (torch's filename_suffix).
  std::string filename_suffix{};
};

/// The rank a launcher gave this process: the first of RANK (emberrun, torchrun),
/// OMPI_COMM_WORLD_RANK (Open MPI), PMI_RANK (MPICH, Intel MPI) and SLURM_PROCID (srun) that is
/// set, in the order init_process_group looks for them; 0 when none is. Throws ValueError naming
/// the variable when its value is not a non-negative integer.
int rank_from_environment();

/// Writes scalars, histograms and text for TensorBoard (see the file comment).
/// Calls are thread-safe (one mutex per writer). Not copyable; movable.
class SummaryWriter {
 public:
  using Options = SummaryWriterOptions;

  /// Creates `log_dir` (and its parents) and the event file, and writes the file-version event
  /// to it at once, so an unwritable place fails here. On a rank that does not write (see
  /// Options::all_ranks) it touches nothing. Throws ValueError for an empty log_dir and
  /// ember::Error naming the path and the system's reason when the folder or the file cannot
  /// be created or written.
  explicit SummaryWriter(std::string log_dir, Options options = {});
  /// Flushes and closes; an error is reported on stderr (a destructor cannot throw).
  ~SummaryWriter();
  SummaryWriter(SummaryWriter&&) noexcept;
  SummaryWriter& operator=(SummaryWriter&&) noexcept;
  SummaryWriter(const SummaryWriter&) = delete;
  SummaryWriter& operator=(const SummaryWriter&) = delete;

  /// Whether this process writes (false on ranks other than 0 unless Options::all_ranks).
  bool enabled() const { return impl_ != nullptr; }
  /// The folder this writer's files go into (log_dir, or `log_dir/rank<r>` with all_ranks);
  /// empty when not enabled.
  std::string log_dir() const;
  /// The path of the main event file; empty when not enabled.
  std::string file_path() const;

  /// One point of the scalar series `tag` at `global_step`. `walltime` is seconds since the
  /// Unix epoch (default: now). Stored as a 32-bit float (Summary.Value.simple_value), as
  /// torch's add_scalar does by default.
  void add_scalar(const std::string& tag, double value, int64_t global_step = 0,
                  std::optional<double> walltime = std::nullopt);
  /// Several series drawn in one chart, as torch: each key k's value goes to a writer of its
  /// own in log_dir/<main_tag with '/' replaced by '_'>_<k>, under the tag `main_tag`, so
  /// TensorBoard shows one run per key.
  void add_scalars(const std::string& main_tag, const std::map<std::string, double>& values,
                   int64_t global_step = 0, std::optional<double> walltime = std::nullopt);
  /// A histogram of `values` (any shape, dtype and device; copied to the CPU as double).
  /// `bins` == 0 uses TensorFlow's bucket edges, as torch's default bins="tensorflow": 0 and
  /// +-1e-12 * 1.1^k up to 1e20, exponentially finer near zero; `bins` > 0 uses that many
  /// equal-width bins from the smallest to the largest value (numpy.histogram's). As torch,
  /// only the buckets from the first to the last non-empty one are stored, with one empty
  /// bucket before them so that TensorBoard sees where the first one starts. min, max, num,
  /// sum and sum_squares cover every value. Throws ValueError for no values, a value that is
  /// not finite, bins < 0, or (TensorFlow's edges) no value within +-1e20.
  void add_histogram(const std::string& tag, const Tensor& values, int64_t global_step = 0,
                     int bins = 0, std::optional<double> walltime = std::nullopt);
  void add_histogram(const std::string& tag, std::span<const double> values,
                     int64_t global_step = 0, int bins = 0,
                     std::optional<double> walltime = std::nullopt);
  /// Text (Markdown) for TensorBoard's text plugin, as torch writes it: the tag
  /// "<tag>/text_summary", metadata naming the "text" plugin, and a string tensor of shape [1].
  void add_text(const std::string& tag, const std::string& text, int64_t global_step = 0,
                std::optional<double> walltime = std::nullopt);

  /// Writes every buffered event of this writer's files. Throws ember::Error naming the file
  /// when the system refuses (disk full, file too large); the unwritten events stay buffered.
  void flush();
  /// Flushes and closes the files; later add_* calls throw ValueError. Idempotent.
  void close();

 private:
  struct Impl;
  void close_quietly() noexcept;
  std::unique_ptr<Impl> impl_;  // null on a rank that does not write
};

}  // namespace ember::nn

// In ember::detail, not ember::nn::detail (see nn/io/atomic_file.h): the record framing, exposed
// for tests.
namespace ember::detail {
/// CRC32C (Castagnoli) of `data`, masked as TFRecord does: ((crc >> 15) | (crc << 17)) +
/// 0xa282ead8.
uint32_t tfrecord_masked_crc32c(std::string_view data);
/// One TFRecord: uint64 length (little-endian), masked CRC32C of those 8 bytes, `data`,
/// masked CRC32C of `data`.
std::string tfrecord(std::string_view data);
}  // namespace ember::detail
