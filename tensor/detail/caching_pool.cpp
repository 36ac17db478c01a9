// Note [CUDA caching pool]
// cudaMalloc and cudaFree synchronise the device, so the CUDA allocator keeps freed memory and
// hands it out again. Keeping whole blocks only and reusing a block for any request that fits
// wastes the difference and, over a long run of mixed sizes, fragments memory until a request
// finds nothing and the device runs out with most of it cached. So, as PyTorch's
// CUDACachingAllocator does, memory is got in segments and carved into blocks: a request takes
// the smallest free block that fits (best fit keeps large blocks whole for large requests),
// splits off the rest, and a freed block merges with its free neighbours, so a segment whose
// blocks are all free is one block again and can serve any request up to its size or be given
// back. Small requests share 2 MiB segments so that many tiny tensors cost one cudaMalloc;
// requests between 1 and 10 MiB share 20 MiB segments; larger ones get a segment of their own
// size rounded to 2 MiB, which a later request may split. The split thresholds keep slivers
// out of the pools: a large-pool remainder of 1 MiB or less stays with the block instead.
//
// Blocks and segments belong to one stream: work queued on a stream runs in order, so a block
// freed there can be reused there at once. A block also used on another stream (record_stream)
// goes back to the pool only after an event recorded on that stream at free time completes.
//
// Note [Graph pools]
// A captured CUDA graph replays its kernels at the addresses they had during the capture, the
// temporaries' included, long after those tensors were freed. So what a capture allocates comes
// from a private pool that only captures into it use: a block freed during the capture may be
// reused later in the same capture (the graph runs in the order it was captured), but its memory
// is not handed to anything else until the graphs that use the pool are gone. Graphs may share a
// pool (graph_pool_handle) when they are replayed in the order they were captured, as PyTorch's
// do. A capture also forbids what could synchronise or query captured work: while one is
// underway the pool records and queries no events (a block used on other streams and freed then
// waits for its events until the capture ends), never waits for the device, and returns no
// segments; out of memory is then an error at once.
#include <ember/tensor/detail/caching_pool.h>

#include <cstdio>
#include <functional>
#include <utility>

#include <ember/tensor/error.h>

namespace ember::detail {

struct CachingPool::Block {
  char* ptr = nullptr;
  size_t size = 0;
  size_t requested = 0;
  void* stream = nullptr;
  CachingPool::Private* owner = nullptr;  // the private pool of its segment, if any
  bool small = false;
  bool allocated = false;
  int event_count = 0;    // events still to complete before the block returns to its pool
  Block* prev = nullptr;  // neighbours in the segment, by address
  Block* next = nullptr;
  std::set<void*> stream_uses;

  bool is_free() const { return !allocated && event_count == 0; }
};

bool CachingPool::BlockLess::operator()(const Block* a, const Block* b) const {
  if (a->stream != b->stream) return std::less<void*>()(a->stream, b->stream);
  if (a->size != b->size) return a->size < b->size;
  return std::less<char*>()(a->ptr, b->ptr);
}

namespace {

// Requests this large cannot be rounded without overflow and no device has them.
constexpr size_t kMaxRequest = size_t{1} << 60;

size_t round_up(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

size_t round_size(size_t nbytes) {
  return nbytes < CachingPool::kMinBlockSize ? CachingPool::kMinBlockSize
                                             : round_up(nbytes, CachingPool::kMinBlockSize);
}

size_t segment_size(size_t size) {
  if (size <= CachingPool::kSmallSize) return CachingPool::kSmallBuffer;
  if (size < CachingPool::kMinLargeAlloc) return CachingPool::kLargeBuffer;
  return round_up(size, CachingPool::kRoundLarge);
}

std::string format_size(size_t bytes) {
  char buf[64];
  if (bytes < 1024) {
    std::snprintf(buf, sizeof(buf), "%zu bytes", bytes);
  } else if (bytes < (size_t{1} << 20)) {
    std::snprintf(buf, sizeof(buf), "%.2f KiB", static_cast<double>(bytes) / 1024.0);
  } else if (bytes < (size_t{1} << 30)) {
    std::snprintf(buf, sizeof(buf), "%.2f MiB", static_cast<double>(bytes) / 1048576.0);
  } else {
    std::snprintf(buf, sizeof(buf), "%.2f GiB", static_cast<double>(bytes) / 1073741824.0);
  }
  return buf;
}

void raise_peak(int64_t value, int64_t& peak) {
  if (value > peak) peak = value;
}

}  // namespace

CachingPool::CachingPool(std::unique_ptr<PoolBackend> backend) : backend_(std::move(backend)) {}

CachingPool::~CachingPool() {
  // Only the bookkeeping is torn down here: memory of segments with blocks still handed out or
  // waiting on events stays with the device, since its users may still run.
  std::set<Block*> heads;
  auto add_head = [&heads](Block* b) {
    while (b->prev) b = b->prev;
    heads.insert(b);
  };
  for (auto& [ptr, b] : live_) add_head(b);
  for (auto& [stream, events] : pending_) {
    for (auto& [event, b] : events) {
      add_head(b);
      try {
        backend_->destroy_event(event);
      } catch (...) {  // a destructor must not throw; the event is lost either way
      }
    }
  }
  std::vector<FreeSet*> sets{&small_, &large_};
  for (auto& [id, priv] : privates_) {
    sets.push_back(&priv->small);
    sets.push_back(&priv->large);
  }
  for (Block* b : deferred_) add_head(b);
  for (FreeSet* pool : sets) {
    for (Block* b : *pool) {
      if (!b->prev && !b->next) {
        try {
          backend_->raw_free(b->ptr);
        } catch (...) {  // as above: leaking the segment is all that is left to do
        }
        delete b;
      } else {
        add_head(b);
      }
    }
  }
  for (Block* b : heads) {
    while (b) delete std::exchange(b, b->next);
  }
}

void* CachingPool::allocate(size_t nbytes, void* stream) {
  if (nbytes == 0) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  if (nbytes > kMaxRequest) throw_oom(nbytes);
  const size_t size = round_size(nbytes);
  Private* owner = route_of(stream);
  FreeSet& pool =
      size <= kSmallSize ? (owner ? owner->small : small_) : (owner ? owner->large : large_);
  if (!capturing()) process_events();
  Block* b = find_free(pool, size, stream);
  if (!b) b = new_segment(pool, size, stream, owner);
  if (!b) b = alloc_after_oom(pool, size, nbytes, stream, owner);
  b = split(pool, b, size);
  b->allocated = true;
  b->requested = nbytes;
  live_.emplace(b->ptr, b);
  stats_.allocated += static_cast<int64_t>(b->size);
  stats_.requested += static_cast<int64_t>(nbytes);
  raise_peak(stats_.allocated, stats_.max_allocated);
  return b->ptr;
}

void CachingPool::free(void* ptr) {
  if (!ptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  EMBER_INTERNAL_ASSERT(it != live_.end(), "[cuda_allocator] freeing a block of ", backend_->name(),
                        " that its caching allocator did not hand out");
  Block* b = it->second;
  live_.erase(it);
  b->allocated = false;
  stats_.allocated -= static_cast<int64_t>(b->size);
  stats_.requested -= static_cast<int64_t>(b->requested);
  b->requested = 0;
  if (b->stream_uses.empty()) {
    free_block(b);
  } else if (capturing()) {
    ++b->event_count;  // not free until its events are recorded and complete
    deferred_.push_back(b);
  } else {
    record_free_events(b);
  }
}

void CachingPool::record_free_events(Block* b) {
  // free() runs from tensor destructors, which must not throw. When an event cannot be recorded
  // (a sticky CUDA error: the context is lost) nothing can say when the other streams are done
  // with the block, so it is never handed out again: held by an event that never completes,
  // and its segment stays reserved. The error itself surfaces at the next CUDA call.
  std::vector<std::pair<void*, void*>> recorded;  // (stream, event)
  try {
    for (void* s : b->stream_uses) recorded.emplace_back(s, backend_->record_event(s));
  } catch (...) {
    for (auto& [s, e] : recorded) {
      try {
        backend_->destroy_event(e);
      } catch (...) {  // lost with the context
      }
    }
    b->stream_uses.clear();
    b->event_count = 1;
    ++stats_.lost_blocks;
    return;
  }
  for (auto& [s, e] : recorded) {
    pending_[s].emplace_back(e, b);
    ++b->event_count;
  }
  b->stream_uses.clear();
}

CachingPool::Private* CachingPool::route_of(void* stream) {
  if (!capturing()) return nullptr;
  auto it = routes_.find(backend_->capture_id(stream));
  return it == routes_.end() ? nullptr : it->second;
}

void CachingPool::begin_private(PoolId id, uint64_t capture) {
  std::lock_guard<std::mutex> lock(mu_);
  EMBER_CHECK(id != 0, "[CachingPool::begin_private] pool id 0 names no private pool");
  EMBER_CHECK(capture != 0, "[CachingPool::begin_private] capture id 0 names no capture");
  EMBER_CHECK(!routes_.count(capture), "[CachingPool::begin_private] capture ", capture,
              " already allocates from a private pool of ", backend_->name());
  std::unique_ptr<Private>& priv = privates_[id];
  if (!priv) {
    priv = std::make_unique<Private>();
    priv->id = id;
  }
  ++priv->users;
  routes_[capture] = priv.get();
}

void CachingPool::end_private(uint64_t capture) {
  std::lock_guard<std::mutex> lock(mu_);
  EMBER_CHECK(routes_.erase(capture) == 1, "[CachingPool::end_private] capture ", capture,
              " does not allocate from a private pool of ", backend_->name());
  if (capturing()) return;
  for (Block* b : std::exchange(deferred_, {})) {
    --b->event_count;
    record_free_events(b);
  }
  release_unused_privates();  // pools given up during the capture
}

void CachingPool::release_private(PoolId id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = privates_.find(id);
  EMBER_CHECK(it != privates_.end() && it->second->users > 0, "[CachingPool::release_private] ",
              backend_->name(), " has no private pool ", id, " in use");
  if (--it->second->users > 0 || capturing()) return;
  release_free_segments(it->second->small);
  release_free_segments(it->second->large);
  if (it->second->segments == 0) privates_.erase(it);
}

PoolId CachingPool::private_pool_of(void* ptr) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  return it != live_.end() && it->second->owner ? it->second->owner->id : 0;
}

void CachingPool::record_stream(void* ptr, void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  EMBER_CHECK(it != live_.end(),
              "[record_stream] the pointer was not allocated by the caching "
              "allocator of ",
              backend_->name(), " (or was already freed)");
  if (stream != it->second->stream) it->second->stream_uses.insert(stream);
}

void CachingPool::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  EMBER_CHECK(!capturing(), "[empty_cache] not allowed while a CUDA graph capture is underway on ",
              backend_->name());
  if (!pending_.empty()) backend_->synchronize();
  process_events();
  release_free_segments();
}

PoolStats CachingPool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void CachingPool::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.max_allocated = stats_.allocated;
  stats_.max_reserved = stats_.reserved;
}

std::vector<int64_t> CachingPool::segment_layout(void* ptr) const {
  std::lock_guard<std::mutex> lock(mu_);
  const char* p = static_cast<const char*>(ptr);
  const Block* found = nullptr;
  auto look = [&](const Block* b) {
    if (!found && b->ptr <= p && p < b->ptr + b->size) found = b;
  };
  for (const auto& [q, b] : live_) look(b);
  for (const Block* b : small_) look(b);
  for (const Block* b : large_) look(b);
  for (const auto& [id, priv] : privates_) {
    for (const Block* b : priv->small) look(b);
    for (const Block* b : priv->large) look(b);
  }
  for (const Block* b : deferred_) look(b);
  for (const auto& [stream, events] : pending_) {
    for (const auto& [event, b] : events) look(b);
  }
  std::vector<int64_t> layout;
  if (!found) return layout;
  while (found->prev) found = found->prev;
  for (; found; found = found->next) {
    const auto size = static_cast<int64_t>(found->size);
    layout.push_back(found->is_free() ? -size : size);
  }
  return layout;
}

CachingPool::Block* CachingPool::find_free(FreeSet& pool, size_t size, void* stream) {
  Block key;
  key.stream = stream;
  key.size = size;
  auto it = pool.lower_bound(&key);
  if (it == pool.end() || (*it)->stream != stream) return nullptr;
  Block* b = *it;
  pool.erase(it);
  return b;
}

CachingPool::Block* CachingPool::new_segment(FreeSet& pool, size_t size, void* stream,
                                             Private* owner) {
  const size_t bytes = segment_size(size);
  void* p = backend_->raw_alloc(bytes);
  if (!p) return nullptr;
  auto* b = new Block();
  b->ptr = static_cast<char*>(p);
  b->size = bytes;
  b->stream = stream;
  b->owner = owner;
  b->small = size <= kSmallSize;
  if (owner) ++owner->segments;
  stats_.reserved += static_cast<int64_t>(bytes);
  ++stats_.num_segments;
  raise_peak(stats_.reserved, stats_.max_reserved);
  return b;
}

// The device is out of memory: what the pool caches may be what is missing. Blocks waiting on
// events may have become free (and merged into a block that fits), and wholly free segments of
// any stream or size can go back to the device so that one segment of the right size fits.
CachingPool::Block* CachingPool::alloc_after_oom(FreeSet& pool, size_t size, size_t nbytes,
                                                 void* stream, Private* owner) {
  if (capturing()) throw_oom(nbytes);  // nothing may be waited for or given back now
  ++stats_.num_alloc_retries;
  backend_->synchronize();
  process_events();
  if (Block* b = find_free(pool, size, stream)) return b;
  release_free_segments();
  if (Block* b = new_segment(pool, size, stream, owner)) return b;
  throw_oom(nbytes);
}

CachingPool::Block* CachingPool::split(FreeSet& pool, Block* b, size_t size) {
  const size_t rest = b->size - size;
  const bool worth_keeping = b->small ? rest >= kMinBlockSize : rest > kSmallSize;
  if (!worth_keeping) return b;
  auto* r = new Block();
  r->ptr = b->ptr + size;
  r->size = rest;
  r->stream = b->stream;
  r->owner = b->owner;
  r->small = b->small;
  r->prev = b;
  r->next = b->next;
  if (b->next) b->next->prev = r;
  b->next = r;
  b->size = size;
  pool.insert(r);
  return b;
}

// Returns b to its pool, merged with the free blocks beside it.
void CachingPool::free_block(Block* b) {
  FreeSet& pool = pool_of(b);
  for (Block* n : {b->prev, b->next}) {
    if (!n || !n->is_free()) continue;
    pool.erase(n);
    if (n == b->prev) {
      b->ptr = n->ptr;
      b->prev = n->prev;
      if (b->prev) b->prev->next = b;
    } else {
      b->next = n->next;
      if (b->next) b->next->prev = b;
    }
    b->size += n->size;
    delete n;
  }
  pool.insert(b);
  // A pool no graph uses any more gives its segments back as they become wholly free.
  if (b->owner && b->owner->users == 0 && !b->prev && !b->next && !capturing()) {
    pool.erase(b);
    Private* owner = b->owner;
    release_segment(b);
    if (owner->segments == 0) privates_.erase(owner->id);
  }
}

void CachingPool::process_events() {
  for (auto it = pending_.begin(); it != pending_.end();) {
    auto& events = it->second;
    while (!events.empty() && backend_->event_done(events.front().first)) {
      auto [event, b] = events.front();
      events.pop_front();
      backend_->destroy_event(event);
      if (--b->event_count == 0) free_block(b);
    }
    it = events.empty() ? pending_.erase(it) : std::next(it);
  }
}

void CachingPool::release_free_segments() {
  release_free_segments(small_);
  release_free_segments(large_);
  release_unused_privates();
}

void CachingPool::release_unused_privates() {
  for (auto it = privates_.begin(); it != privates_.end();) {
    Private& priv = *it->second;
    if (priv.users == 0) {
      release_free_segments(priv.small);
      release_free_segments(priv.large);
    }
    it = priv.users == 0 && priv.segments == 0 ? privates_.erase(it) : std::next(it);
  }
}

void CachingPool::release_free_segments(FreeSet& pool) {
  for (auto it = pool.begin(); it != pool.end();) {
    Block* b = *it;
    if (b->prev || b->next) {
      ++it;
      continue;
    }
    it = pool.erase(it);
    release_segment(b);
  }
}

// Gives the segment b (wholly free, out of its free set) back to the backend.
void CachingPool::release_segment(Block* b) {
  backend_->raw_free(b->ptr);
  stats_.reserved -= static_cast<int64_t>(b->size);
  --stats_.num_segments;
  if (b->owner) --b->owner->segments;
  delete b;
}

void CachingPool::throw_oom(size_t nbytes) {
  ++stats_.num_ooms;
  size_t free = 0, total = 0;
  backend_->mem_info(&free, &total);
  const auto allocated = static_cast<size_t>(stats_.allocated);
  const auto reserved = static_cast<size_t>(stats_.reserved);
  throw OutOfMemoryError(
      str_cat("CUDA out of memory. Tried to allocate ", format_size(nbytes), ". ", backend_->name(),
              " has a total capacity of ", format_size(total), " of which ", format_size(free),
              " is free. Of the allocated memory ", format_size(allocated),
              " is allocated by Ember, and ", format_size(reserved - allocated),
              " is reserved by Ember but unallocated.\n  (Bytes: requested ", nbytes, ", allocated ",
              allocated, ", reserved ", reserved, ", free ", free, ", total ", total, ".)"));
}

CachingPool::FreeSet& CachingPool::pool_of(const Block* b) {
  if (b->owner) return b->small ? b->owner->small : b->owner->large;
  return b->small ? small_ : large_;
}

}  // namespace ember::detail
