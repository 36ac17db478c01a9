// SummaryWriter: TensorBoard event files (see summary_writer.h and docs/observability.md).
#include <ember/nn/io/summary_writer.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/crc.hpp>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <vector>

#include "nn/tensorboard.pb.h"
#include <ember/tensor/error.h>
#include <ember/tensor/observe/log.h>

namespace ember {

namespace detail {

// CRC32C through Boost.CRC: Debian packages no C++ CRC32C library (crc32c and the Abseil or
// Folly ones are not in it), and Boost's header-only, table-driven template is already a
// dependency. Castagnoli's polynomial, reflected in and out, initial value and final xor all
// ones: the parameters of RFC 3720's CRC32C, which TFRecord uses.
uint32_t tfrecord_masked_crc32c(std::string_view data) {
  boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true> crc;
  crc.process_bytes(data.data(), data.size());
  const uint32_t c = crc.checksum();
  // TFRecord masks the CRC so that a CRC computed over data that itself holds CRCs stays
  // well-distributed.
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

namespace {
void append_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
}  // namespace

std::string tfrecord(std::string_view data) {
  std::string out;
  out.reserve(data.size() + 16);
  append_le(out, data.size(), 8);
  append_le(out, tfrecord_masked_crc32c(std::string_view(out.data(), 8)), 4);
  out.append(data);
  append_le(out, tfrecord_masked_crc32c(data), 4);
  return out;
}

}  // namespace detail

namespace nn {

namespace {

namespace fs = std::filesystem;
namespace pb = ember::tensorboard;

constexpr const char* kFileVersion = "brain.Event:2";
// Buffered bytes that trigger a write before flush_secs have passed, so that a writer logging
// many histograms between flushes does not hold them all in memory.
constexpr size_t kMaxBufferedBytes = size_t{1} << 20;

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string system_error(int err) { return std::strerror(err); }

// TensorBoard's name (tensorboard/summary/writer/event_file_writer.py): the time, host and pid
// keep files of different processes apart; the per-process counter those of one process.
std::string event_file_name(const std::string& suffix) {
  static std::atomic<int> next_uid{0};
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "localhost");
  char time_part[32];
  std::snprintf(time_part, sizeof(time_part), "%010lld",
                static_cast<long long>(std::floor(now_seconds())));
  return detail::str_cat("events.out.tfevents.", time_part, ".", host, ".", ::getpid(), ".",
                         next_uid++, suffix);
}

void create_folder(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir)) {
    throw Error(detail::str_cat("[SummaryWriter] cannot create the log folder '", dir,
                                "': ", ec ? ec.message() : "a file of that name is in the way"));
  }
}

// One event file: records are framed into a buffer and written to the file with write(2) on
// flush, when flush_secs have passed since the last write, or when the buffer is large.
class EventFile {
 public:
  EventFile(const std::string& dir, const std::string& suffix, double flush_secs)
      : path_((fs::path(dir) / event_file_name(suffix)).string()), flush_secs_(flush_secs) {
    create_folder(dir);
    // O_EXCL: never append to, or truncate, a file another writer owns.
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd_ < 0) {
      throw Error(detail::str_cat("[SummaryWriter] cannot create the event file '", path_,
                                  "': ", system_error(errno)));
    }
    try {
      pb::Event e;
      e.set_wall_time(now_seconds());
      e.set_file_version(kFileVersion);
      append(e);
      flush();  // the file is a valid, if empty, event file from the start
    } catch (...) {
      // The destructor does not run for a constructor that throws: close the descriptor here,
      // and remove the file, which this writer made (O_EXCL) and which holds no valid record.
      ::close(fd_);
      ::unlink(path_.c_str());
      throw;
    }
  }
  ~EventFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  EventFile(const EventFile&) = delete;
  EventFile& operator=(const EventFile&) = delete;

  const std::string& path() const { return path_; }

  void append(const pb::Event& e) {
    buffer_ += detail::tfrecord(e.SerializeAsString());
    if (buffer_.size() >= kMaxBufferedBytes ||
        std::chrono::duration<double>(Clock::now() - last_flush_).count() >= flush_secs_) {
      flush();
    }
  }

  // What was written leaves the buffer, so after an error a later flush writes only the rest.
  void flush() {
    size_t done = 0;
    while (done < buffer_.size()) {
      const ssize_t n = ::write(fd_, buffer_.data() + done, buffer_.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int err = n < 0 ? errno : EIO;
        buffer_.erase(0, done);
        throw Error(detail::str_cat("[SummaryWriter] cannot write the event file '", path_,
                                    "': ", system_error(err), " (", buffer_.size(),
                                    " bytes of events not written)"));
      }
      done += static_cast<size_t>(n);
    }
    buffer_.clear();
    last_flush_ = Clock::now();
  }

  void close() {
    if (fd_ < 0) return;
    flush();
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0 && errno != EINTR) {
      throw Error(detail::str_cat("[SummaryWriter] cannot close the event file '", path_,
                                  "': ", system_error(errno)));
    }
  }

 private:
  using Clock = std::chrono::steady_clock;
  const std::string path_;
  const double flush_secs_;
  int fd_ = -1;
  std::string buffer_;
  Clock::time_point last_flush_ = Clock::now();
};

pb::Event summary_event(int64_t step, std::optional<double> walltime) {
  pb::Event e;
  e.set_wall_time(walltime.value_or(now_seconds()));
  e.set_step(step);
  return e;
}

// TensorFlow's default bucket edges (torch's bins="tensorflow"): -1e20 .. -1e-12, 0,
// 1e-12 .. 1e20, each 1.1 times the one before; multiplied step by step as torch does, so the
// edges are the same doubles.
const std::vector<double>& tensorflow_edges() {
  static const std::vector<double> edges = [] {
    std::vector<double> pos;
    for (double v = 1e-12; v < 1e20; v *= 1.1) pos.push_back(v);
    std::vector<double> all;
    all.reserve(2 * pos.size() + 1);
    for (auto it = pos.rbegin(); it != pos.rend(); ++it) all.push_back(-*it);
    all.push_back(0);
    all.insert(all.end(), pos.begin(), pos.end());
    return all;
  }();
  return edges;
}

// numpy.histogram(values, bins=n)'s edges: n equal bins from min to max, widened by 0.5 each
// side when all values are equal; computed as numpy.linspace does (i * step + lo, the last edge
// exactly hi), so the edges are the same doubles.
std::vector<double> uniform_edges(double lo, double hi, int bins) {
  if (lo == hi) {
    lo -= 0.5;
    hi += 0.5;
  }
  const double step = (hi - lo) / bins;
  std::vector<double> edges(static_cast<size_t>(bins) + 1);
  for (int i = 0; i <= bins; ++i) edges[i] = i * step + lo;
  edges.back() = hi;
  return edges;
}

// make_histogram of torch/utils/tensorboard/summary.py: counts as numpy.histogram (bins
// [e_i, e_i+1), the last one closed; values outside all bins are not counted), then only the
// buckets from the first to the last non-empty one, each stored with its right edge, plus the
// empty bucket before them so that the first one's left edge is there too.
pb::HistogramProto make_histogram(const std::string& tag, std::span<const double> values,
                                  int bins) {
  const std::string where = "[SummaryWriter.add_histogram] tag '" + tag + "': ";
  EMBER_CHECK(!values.empty(), where, "no values");
  EMBER_CHECK(bins >= 0, where, "bins must be >= 0 (0: TensorFlow's buckets), got ", bins);
  pb::HistogramProto h;
  double lo = values[0], hi = values[0], sum = 0, sum_sq = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    const double v = values[i];
    EMBER_CHECK(std::isfinite(v), where, "value ", i, " is ", v, "; histograms need finite values");
    lo = std::min(lo, v);
    hi = std::max(hi, v);
    sum += v;
    sum_sq += v * v;
  }
  const std::vector<double> edges = bins == 0 ? tensorflow_edges() : uniform_edges(lo, hi, bins);
  std::vector<double> counts(edges.size() - 1, 0.0);
  for (const double v : values) {
    if (v < edges.front() || v > edges.back()) continue;
    const auto up = std::upper_bound(edges.begin(), edges.end(), v);
    const size_t bin = std::min<size_t>(up - edges.begin() - 1, counts.size() - 1);
    counts[bin] += 1;
  }
  const auto nonzero = [](double c) { return c > 0; };
  const auto first = std::find_if(counts.begin(), counts.end(), nonzero);
  EMBER_CHECK(first != counts.end(), where, "no value lies within the buckets [", edges.front(),
              ", ", edges.back(), "] (values from ", lo, " to ", hi, ")");
  const size_t start = first - counts.begin();
  const size_t end = counts.rend() - std::find_if(counts.rbegin(), counts.rend(), nonzero);
  h.add_bucket(start > 0 ? counts[start - 1] : 0.0);
  for (size_t i = start; i < end; ++i) h.add_bucket(counts[i]);
  for (size_t i = start; i <= end; ++i) h.add_bucket_limit(edges[i]);
  h.set_min(lo);
  h.set_max(hi);
  h.set_num(static_cast<double>(values.size()));
  h.set_sum(sum);
  h.set_sum_squares(sum_sq);
  return h;
}

}  // namespace

int rank_from_environment() {
  for (const char* name : {"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"}) {
    const char* v = std::getenv(name);
    if (v == nullptr) continue;
    char* end = nullptr;
    errno = 0;
    const long r = std::strtol(v, &end, 10);
    EMBER_CHECK(*v != '\0' && *end == '\0' && errno == 0 && r >= 0 && r <= (1 << 30),
                "[rank_from_environment] ", name, "='", v, "' is not a rank (an integer >= 0)");
    return static_cast<int>(r);
  }
  return 0;
}

struct SummaryWriter::Impl {
  std::mutex mu;
  std::string dir;
  Options options;
  std::unique_ptr<EventFile> main;
  std::map<std::string, std::unique_ptr<EventFile>> by_key;  // add_scalars' files, by folder
  bool closed = false;

  void check_open(const char* op) const {
    EMBER_CHECK(!closed, "[SummaryWriter.", op, "] the writer of '", dir, "' is closed");
  }
  EventFile& sub_file(const std::string& folder) {
    auto it = by_key.find(folder);
    if (it == by_key.end()) {
      // Made before it is entered: a file that cannot be made leaves no empty entry behind.
      auto f = std::make_unique<EventFile>((fs::path(dir) / folder).string(),
                                           options.filename_suffix, options.flush_secs);
      it = by_key.emplace(folder, std::move(f)).first;
    }
    return *it->second;
  }
  template <typename Fn>
  void for_each_file(Fn fn) {
    fn(*main);
    for (auto& [folder, f] : by_key) fn(*f);
  }
};

SummaryWriter::SummaryWriter(std::string log_dir, Options options) {
  EMBER_CHECK(!log_dir.empty(), "[SummaryWriter] log_dir is empty");
  const int rank = options.rank >= 0 ? options.rank : rank_from_environment();
  if (rank != 0 && !options.all_ranks) return;
  auto impl = std::make_unique<Impl>();
  impl->dir =
      options.all_ranks ? (fs::path(log_dir) / ("rank" + std::to_string(rank))).string() : log_dir;
  impl->options = std::move(options);
  impl->main = std::make_unique<EventFile>(impl->dir, impl->options.filename_suffix,
                                           impl->options.flush_secs);
  impl_ = std::move(impl);
}

// Closes what the writer holds, logging rather than throwing (from a destructor or a move).
void SummaryWriter::close_quietly() noexcept {
  if (impl_ == nullptr) return;
  try {
    close();
  } catch (const std::exception& e) {
    logging::error(e.what());
  }
}

SummaryWriter::~SummaryWriter() { close_quietly(); }

SummaryWriter::SummaryWriter(SummaryWriter&&) noexcept = default;

// The writer replaced is closed first: its buffered events are written, not dropped.
SummaryWriter& SummaryWriter::operator=(SummaryWriter&& other) noexcept {
  if (this != &other) {
    close_quietly();
    impl_ = std::move(other.impl_);
  }
  return *this;
}

std::string SummaryWriter::log_dir() const { return impl_ ? impl_->dir : ""; }
std::string SummaryWriter::file_path() const { return impl_ ? impl_->main->path() : ""; }

void SummaryWriter::add_scalar(const std::string& tag, double value, int64_t global_step,
                               std::optional<double> walltime) {
  if (impl_ == nullptr) return;
  pb::Event e = summary_event(global_step, walltime);
  auto* v = e.mutable_summary()->add_value();
  v->set_tag(tag);
  v->set_simple_value(static_cast<float>(value));
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->check_open("add_scalar");
  impl_->main->append(e);
}

void SummaryWriter::add_scalars(const std::string& main_tag,
                                const std::map<std::string, double>& values, int64_t global_step,
                                std::optional<double> walltime) {
  if (impl_ == nullptr) return;
  std::string prefix = main_tag;
  std::replace(prefix.begin(), prefix.end(), '/', '_');
  // One wall time for all keys, as torch: the points belong to one moment.
  const double when = walltime.value_or(now_seconds());
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->check_open("add_scalars");
  for (const auto& [key, value] : values) {
    pb::Event e = summary_event(global_step, when);
    auto* v = e.mutable_summary()->add_value();
    v->set_tag(main_tag);
    v->set_simple_value(static_cast<float>(value));
    impl_->sub_file(prefix + "_" + key).append(e);
  }
}

void SummaryWriter::add_histogram(const std::string& tag, const Tensor& values, int64_t global_step,
                                  int bins, std::optional<double> walltime) {
  if (impl_ == nullptr) return;
  EMBER_CHECK(values.defined(), "[SummaryWriter.add_histogram] tag '", tag,
              "': the tensor is undefined");
  const std::vector<double> v = values.to_vector<double>();
  add_histogram(tag, std::span<const double>(v), global_step, bins, walltime);
}

void SummaryWriter::add_histogram(const std::string& tag, std::span<const double> values,
                                  int64_t global_step, int bins, std::optional<double> walltime) {
  if (impl_ == nullptr) return;
  pb::Event e = summary_event(global_step, walltime);
  auto* v = e.mutable_summary()->add_value();
  v->set_tag(tag);
  *v->mutable_histo() = make_histogram(tag, values, bins);
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->check_open("add_histogram");
  impl_->main->append(e);
}

void SummaryWriter::add_text(const std::string& tag, const std::string& text, int64_t global_step,
                             std::optional<double> walltime) {
  if (impl_ == nullptr) return;
  pb::Event e = summary_event(global_step, walltime);
  auto* v = e.mutable_summary()->add_value();
  v->set_tag(tag + "/text_summary");
  auto* plugin = v->mutable_metadata()->mutable_plugin_data();
  plugin->set_plugin_name("text");
  plugin->set_content(pb::TextPluginData().SerializeAsString());  // version 0
  auto* t = v->mutable_tensor();
  t->set_dtype(pb::DT_STRING);
  t->mutable_tensor_shape()->add_dim()->set_size(1);
  t->add_string_val(text);
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->check_open("add_text");
  impl_->main->append(e);
}

void SummaryWriter::flush() {
  if (impl_ == nullptr) return;
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->closed) return;
  impl_->for_each_file([](EventFile& f) { f.flush(); });
}

void SummaryWriter::close() {
  if (impl_ == nullptr) return;
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->closed) return;
  impl_->closed = true;
  // Close every file even if one fails; report the first failure.
  std::exception_ptr first;
  impl_->for_each_file([&](EventFile& f) {
    try {
      f.close();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  });
  if (first) std::rethrow_exception(first);
}

}  // namespace nn
}  // namespace ember
