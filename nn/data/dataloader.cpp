#include <ember/nn/data/dataloader.h>

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <sstream>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <ember/tensor/observe/trace.h>
#include <ember/nn/detail/thread_generator.h>
#include <ember/tensor/ops/random.h>

namespace ember::nn::data {

namespace {

// "[3, 17, 4, ...] (64 indices)": enough to find the batch without flooding the message.
std::string preview(const std::vector<int64_t>& idx) {
  std::ostringstream os;
  os << "[";
  const size_t shown = std::min<size_t>(idx.size(), 8);
  for (size_t i = 0; i < shown; ++i) os << (i ? ", " : "") << idx[i];
  if (shown < idx.size()) os << ", ...";
  os << "] (" << idx.size() << (idx.size() == 1 ? " index)" : " indices)");
  return os.str();
}

// Rethrows `e` with `context` prepended, keeping its ember type so callers can still catch
// IndexError etc.; anything else becomes ember::Error.
[[noreturn]] void rethrow_with_context(const std::exception_ptr& e, const std::string& context) {
  try {
    std::rethrow_exception(e);
  } catch (const IndexError& x) {
    throw IndexError(context + x.what());
  } catch (const TypeError& x) {
    throw TypeError(context + x.what());
  } catch (const ValueError& x) {
    throw ValueError(context + x.what());
  } catch (const NotImplementedError& x) {
    throw NotImplementedError(context + x.what());
  } catch (const OutOfMemoryError& x) {
    throw OutOfMemoryError(context + x.what());
  } catch (const CudaError& x) {
    throw CudaError(context + x.what());
  } catch (const std::exception& x) {
    throw Error(context + x.what());
  } catch (...) {
    throw Error(context + "unknown exception");
  }
}

}  // namespace

// Note [DataLoader pass]: the batches of a pass are fixed when it starts. Workers claim batch
// numbers in increasing order (next_claim) and park results in slots[k]; the consumer takes
// slot k in order, so the order never depends on which worker finished first. A worker may
// claim k only while k < consumed + capacity, which bounds batches ready or in progress (the
// prefetch queue). Both waits end on `stop`, so shutdown() never hangs on a waiting thread.
// Workers hold a shared_ptr to the pass: a pass whose workers were detached after a timeout
// stays alive until the last of them returns.
struct DataLoader::Pass : std::enable_shared_from_this<DataLoader::Pass> {
  struct Slot {
    bool ready = false;
    Batch batch;
    std::exception_ptr error;
    int64_t worker = -1;
  };

  std::shared_ptr<const Dataset> dataset;
  std::vector<std::vector<int64_t>> batches;
  // Note [DataLoader random numbers]: batch k is made with the thread's default generator one
  // seeded from (base_seed, k), on whichever thread makes it, so a random transform draws the
  // same numbers whatever num_workers is and however the workers are scheduled; base_seed is
  // drawn from the iterating thread's generator when the pass starts (PyTorch seeds each
  // worker base_seed + worker_id; a seed per batch also removes the dependence on which worker
  // claims which batch).
  uint64_t base_seed = 0;
  int64_t capacity = 0;
  bool threaded = false;  // batches come from worker threads
  std::chrono::milliseconds timeout{0};

  // Consumer state: touched only by the thread iterating.
  int64_t position = -1;  // the batch in `current`
  Batch current;
  bool finished = false;

  // Shared with the workers, under mu.
  std::mutex mu;
  std::condition_variable space_cv;  // workers wait for queue space (or stop)
  std::condition_variable ready_cv;  // the consumer waits for its batch (or stop)
  bool stop = false;
  int64_t next_claim = 0;
  int64_t consumed = 0;
  std::vector<Slot> slots;
  std::vector<std::thread> workers;

  ~Pass() { shutdown(/*join=*/true); }

  int64_t num_batches() const { return static_cast<int64_t>(batches.size()); }

  void start(int64_t num_workers) {
    threaded = true;
    slots.resize(batches.size());
    // More threads than batches would only wait and exit.
    const int64_t n = std::min<int64_t>(num_workers, num_batches());
    try {
      for (int64_t w = 0; w < n; ++w) {
        workers.emplace_back([self = shared_from_this(), w] { self->work(w); });
      }
    } catch (const std::system_error& e) {
      shutdown(/*join=*/true);
      throw Error(detail::str_cat("[DataLoader] could not start worker thread ", workers.size(),
                                  " of ", n, ": ", e.what()));
    }
  }

  void work(int64_t worker) {
    for (;;) {
      int64_t k;
      {
        std::unique_lock<std::mutex> lock(mu);
        space_cv.wait(lock, [&] {
          return stop || next_claim >= num_batches() || next_claim < consumed + capacity;
        });
        if (stop || next_claim >= num_batches()) return;
        k = next_claim++;
      }
      Slot s;
      s.worker = worker;
      try {
        s.batch = make(k);
      } catch (...) {
        s.error = std::current_exception();
      }
      s.ready = true;
      {
        std::lock_guard<std::mutex> lock(mu);
        if (stop) return;
        slots[k] = std::move(s);
      }
      ready_cv.notify_all();
    }
  }

  // Batch k under its own generator (Note [DataLoader random numbers]).
  Batch make(int64_t k) const {
    uint64_t z = base_seed + 0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(k + 1);  // splitmix64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    Generator gen(z ^ (z >> 31));
    detail::ThreadGeneratorScope scope(gen);
    return dataset->get_batch(batches[k]);
  }

  std::string describe(int64_t k) const {
    return detail::str_cat("[DataLoader] batch ", k, " of ", num_batches(), " (dataset indices ",
                           preview(batches[k]), ")");
  }

  // Loads batch position + 1 into `current`, or marks the pass finished.
  void advance() {
    EMBER_CHECK(!finished, "[DataLoader] cannot advance an iterator past the end of the pass");
    const int64_t k = position + 1;
    if (k >= num_batches()) {
      finish();
      return;
    }
    Slot s;
    if (!threaded) {  // num_workers == 0: make the batch here
      try {
        s.batch = make(k);
      } catch (...) {
        s.error = std::current_exception();
      }
    } else {
      s = take(k);
    }
    if (s.error) {
      finish();
      rethrow_with_context(
          s.error, describe(k) + " failed" +
                       (s.worker >= 0 ? detail::str_cat(" in worker ", s.worker) : "") + ": ");
    }
    position = k;
    current = std::move(s.batch);
  }

  // Waits for a worker to deliver batch k.
  Slot take(int64_t k) {
    std::unique_lock<std::mutex> lock(mu);
    const auto ready = [&] { return stop || slots[k].ready; };
    if (timeout.count() > 0) {
      if (!ready_cv.wait_for(lock, timeout, ready)) {
        lock.unlock();
        shutdown(/*join=*/false);  // a worker may be stuck in get_batch: do not wait for it
        finished = true;
        current = Batch();
        throw Error(detail::str_cat(describe(k), ": timed out after ", timeout.count(),
                                    " ms waiting for the workers"));
      }
    } else {
      ready_cv.wait(lock, ready);
    }
    if (!slots[k].ready) {
      lock.unlock();
      finished = true;
      current = Batch();
      throw Error(describe(k) + ": the pass was cancelled while waiting for this batch");
    }
    Slot s = std::move(slots[k]);
    slots[k] = Slot();
    consumed = k + 1;
    lock.unlock();
    space_cv.notify_all();
    return s;
  }

  // Ends the pass: iterators of it now equal end().
  void finish() {
    finished = true;
    current = Batch();
    shutdown(/*join=*/true);
  }

  // Idempotent. Wakes every waiter; joins the workers (or detaches them after a timeout).
  void shutdown(bool join) {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    space_cv.notify_all();
    ready_cv.notify_all();
    for (std::thread& t : workers) {
      if (!t.joinable()) continue;
      if (join && t.get_id() != std::this_thread::get_id()) {
        t.join();
      } else {
        t.detach();
      }
    }
    workers.clear();
  }
};

const Batch& DataLoader::Iterator::operator*() const {
  EMBER_CHECK(!at_end(), "[DataLoader] cannot dereference an iterator at the end of the pass");
  return pass_->current;
}

DataLoader::Iterator& DataLoader::Iterator::operator++() {
  EMBER_CHECK(pass_ != nullptr, "[DataLoader] cannot advance the end iterator");
  trace::Span span("next batch", "data");
  pass_->advance();
  return *this;
}

bool DataLoader::Iterator::at_end() const { return !pass_ || pass_->finished; }

bool DataLoader::Iterator::operator==(const Iterator& o) const {
  const bool a = at_end();
  const bool b = o.at_end();
  return (a && b) || (!a && !b && pass_ == o.pass_);
}

DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset, DataLoaderOptions options)
    : dataset_(std::move(dataset)), options_(std::move(options)) {
  EMBER_CHECK(dataset_ != nullptr, "[DataLoader] expected a dataset, got a null pointer");
  EMBER_CHECK(options_.batch_size >= 1, "[DataLoader] expected batch_size >= 1, got ",
              options_.batch_size);
  EMBER_CHECK(options_.num_workers >= 0, "[DataLoader] expected num_workers >= 0, got ",
              options_.num_workers);
  EMBER_CHECK(options_.prefetch_factor >= 1, "[DataLoader] expected prefetch_factor >= 1, got ",
              options_.prefetch_factor);
  EMBER_CHECK(options_.timeout.count() >= 0, "[DataLoader] expected a timeout >= 0, got ",
              options_.timeout.count(), " ms");
  EMBER_CHECK(!(options_.shuffle && options_.sampler),
              "[DataLoader] the sampler option is mutually exclusive with shuffle (shuffle in the "
              "sampler instead)");
  if (options_.sampler) {
    sampler_ = options_.sampler;
  } else if (options_.shuffle) {
    sampler_ = std::make_shared<RandomSampler>(dataset_->size(), options_.seed);
  } else {
    sampler_ = std::make_shared<SequentialSampler>(dataset_->size());
  }
}

DataLoader::~DataLoader() {
  if (pass_) pass_->finish();
}

int64_t DataLoader::size() const {
  const int64_t n = sampler_->size();
  const int64_t bs = options_.batch_size;
  return options_.drop_last ? n / bs : (n + bs - 1) / bs;
}

void DataLoader::set_epoch(int64_t epoch) { sampler_->set_epoch(epoch); }

DataLoader::Iterator DataLoader::begin() {
  if (pass_) {
    pass_->finish();
    pass_.reset();
  }
  std::vector<int64_t> order = sampler_->indices();
  const int64_t n = dataset_->size();
  for (size_t i = 0; i < order.size(); ++i) {
    EMBER_CHECK_TYPE(IndexError, order[i] >= 0 && order[i] < n,
                     "[DataLoader] the sampler gave index ", order[i], " at position ", i,
                     ", out of range for a dataset of ", n, " examples");
  }
  auto pass = std::make_shared<Pass>();
  pass->dataset = dataset_;
  {
    const Generator::Draw d = default_generator().reserve(1);  // the iterating thread's
    pass->base_seed = d.seed ^ (d.offset * 0xD1B54A32D192ED03ULL);
  }
  pass->timeout = options_.timeout;
  pass->capacity = options_.num_workers * options_.prefetch_factor;
  const int64_t bs = options_.batch_size;
  const int64_t total = static_cast<int64_t>(order.size());
  const int64_t count = options_.drop_last ? total / bs : (total + bs - 1) / bs;
  pass->batches.reserve(count);
  for (int64_t k = 0; k < count; ++k) {
    const auto first = order.begin() + k * bs;
    pass->batches.emplace_back(first, first + std::min(bs, total - k * bs));
  }
  if (options_.num_workers > 0) pass->start(options_.num_workers);
  pass_ = pass;
  trace::Span span("next batch", "data");
  pass->advance();
  return Iterator(std::move(pass));
}

}  // namespace ember::nn::data
