// The block bookkeeping of the CUDA caching allocator (Note [CUDA caching pool]), written
// against an interface for raw memory and stream events so that it runs and is tested without a
// GPU. tensor/cuda/runtime/allocator.cpp plugs in cudaMalloc, cudaFree and CUDA events; the CPU tests
// plug in a fake device with a memory budget.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

namespace ember::detail {

/// The raw memory and events of one device, as the pool sees them. Streams and events are
/// opaque handles (cudaStream_t, cudaEvent_t on CUDA). Called with the pool's lock held, so an
/// implementation needs no locking of its own for the pool's sake.
class PoolBackend {
 public:
  virtual ~PoolBackend() = default;
  /// A new segment of `bytes`; nullptr when the device has no memory for it (any other
  /// failure throws).
  virtual void* raw_alloc(size_t bytes) = 0;
  virtual void raw_free(void* ptr) = 0;
  /// An event recorded now on `stream`: it completes when the work queued there so far has.
  virtual void* record_event(void* stream) = 0;
  /// True when the event has completed; then the pool destroys it with destroy_event.
  virtual bool event_done(void* event) = 0;
  virtual void destroy_event(void* event) = 0;
  /// Waits until all work queued on the device has finished (every recorded event is done).
  virtual void synchronize() = 0;
  /// Free and total bytes of the device, for the out-of-memory message.
  virtual void mem_info(size_t* free, size_t* total) = 0;
  /// The device as the out-of-memory message names it ("GPU 0").
  virtual std::string name() const = 0;
  /// The id of the graph capture that `stream` takes part in (cudaStreamGetCaptureInfo), 0 if
  /// none. Asked only while the pool routes a capture to a private pool.
  virtual uint64_t capture_id(void* stream) = 0;
};

/// Byte counts of a pool. `allocated` counts blocks handed out, in their rounded sizes (what
/// the block occupies, as PyTorch's allocated_bytes), from allocate() until free(); `reserved`
/// counts the segments got from the backend and not yet returned to it.
struct PoolStats {
  int64_t allocated = 0;
  int64_t max_allocated = 0;
  int64_t reserved = 0;
  int64_t max_reserved = 0;
  int64_t requested = 0;          ///< the sizes callers asked for, of the blocks handed out
  int64_t num_segments = 0;       ///< segments held now
  int64_t num_alloc_retries = 0;  ///< backend allocations that failed and were retried
  int64_t num_ooms = 0;           ///< allocations that threw OutOfMemoryError
  int64_t lost_blocks = 0;        ///< freed blocks never reused: their events could not be recorded
};

/// Names a private pool of a CachingPool (Note [Graph pools]); 0 names none.
using PoolId = uint64_t;

/// A caching pool of device memory blocks in the manner of PyTorch's CUDACachingAllocator.
/// Thread-safe: every public call takes the pool's lock.
///
/// Sizes round up to 512 bytes. Requests of up to 1 MiB come from the small pool, whose
/// segments are 2 MiB; larger ones from the large pool, whose segments are 20 MiB for requests
/// under 10 MiB and the request rounded up to 2 MiB otherwise. A request takes the smallest
/// free block of its pool and stream that fits (best fit) and splits off the rest when the rest
/// is worth keeping (512 bytes in the small pool, more than 1 MiB in the large). A freed block
/// merges with the free blocks beside it in its segment, so a segment whose blocks are all free
/// is one block again. Blocks belong to the stream they were allocated on; a block used on
/// other streams (record_stream) returns to the pool only after events recorded on those
/// streams at free() have completed.
class CachingPool {
 public:
  explicit CachingPool(std::unique_ptr<PoolBackend> backend);
  /// Returns the cached segments that are wholly free to the backend; blocks still handed out
  /// are leaked (their owners may outlive the pool).
  ~CachingPool();
  CachingPool(const CachingPool&) = delete;
  CachingPool& operator=(const CachingPool&) = delete;

  /// A block of at least nbytes for use on `stream` (nullptr for 0 bytes). When the backend is
  /// out of memory, waits for the device, returns every free cached segment and retries once;
  /// then throws OutOfMemoryError giving the requested, allocated, reserved, free and total
  /// bytes and the device.
  void* allocate(size_t nbytes, void* stream);
  /// Returns a block from allocate() (nullptr is ignored). Throws InternalError for a pointer
  /// the pool did not hand out.
  void free(void* ptr);
  /// Marks the block at ptr as used on `stream` too, so that after free() it is reused only
  /// once the work queued on `stream` by then has finished. Throws ValueError for a pointer the
  /// pool did not hand out.
  void record_stream(void* ptr, void* stream);
  /// Waits for the device, then returns every wholly free segment to the backend (but those of
  /// private pools still in use). Not during a capture: throws.
  void empty_cache();

  /// Until end_private(capture), blocks allocated on any stream taking part in graph capture
  /// `capture` (PoolBackend::capture_id) come from private pool `id` (made on first use) and
  /// return to it when freed (Note [Graph pools]). While any capture is routed so, the pool
  /// queries no events, waits for nothing and gives no memory back, which a capture forbids.
  /// Each call adds a user of `id`. Throws ValueError if `capture` is routed already or `id` or
  /// `capture` is 0.
  void begin_private(PoolId id, uint64_t capture);
  /// Ends the routing of `capture`. Throws ValueError if it was not routed.
  void end_private(uint64_t capture);
  /// Drops a user of private pool `id` (a graph reset). With none left, its wholly free segments
  /// go back to the backend now and the rest once their last blocks are freed. Throws ValueError
  /// for a pool without users.
  void release_private(PoolId id);
  /// The private pool that the block at ptr came from, 0 if none (for tests).
  PoolId private_pool_of(void* ptr) const;

  PoolStats stats() const;
  /// Sets the peaks to the current values.
  void reset_peak_stats();
  /// For tests: the block sizes of the segment holding address ptr, in address order, free
  /// blocks negative (blocks waiting on events count as used); empty when no segment holds it.
  std::vector<int64_t> segment_layout(void* ptr) const;

  static constexpr size_t kMinBlockSize = 512;
  static constexpr size_t kSmallSize = size_t{1} << 20;
  static constexpr size_t kSmallBuffer = size_t{2} << 20;
  static constexpr size_t kLargeBuffer = size_t{20} << 20;
  static constexpr size_t kMinLargeAlloc = size_t{10} << 20;
  static constexpr size_t kRoundLarge = size_t{2} << 20;

 private:
  struct Block;
  struct BlockLess {
    bool operator()(const Block* a, const Block* b) const;
  };
  using FreeSet = std::set<Block*, BlockLess>;
  struct Private {
    PoolId id = 0;
    FreeSet small, large;
    int users = 0;
    int64_t segments = 0;
  };

  Block* find_free(FreeSet& pool, size_t size, void* stream);
  Block* new_segment(FreeSet& pool, size_t size, void* stream, Private* owner);
  Block* alloc_after_oom(FreeSet& pool, size_t size, size_t nbytes, void* stream, Private* owner);
  Private* route_of(void* stream);
  Block* split(FreeSet& pool, Block* b, size_t size);
  void free_block(Block* b);
  void process_events();
  void release_free_segments();
  void release_free_segments(FreeSet& pool);
  void release_unused_privates();
  void release_segment(Block* b);
  void record_free_events(Block* b);
  bool capturing() const { return !routes_.empty(); }
  [[noreturn]] void throw_oom(size_t nbytes);
  FreeSet& pool_of(const Block* b);

  std::unique_ptr<PoolBackend> backend_;
  mutable std::mutex mu_;
  FreeSet small_, large_;
  std::unordered_map<void*, Block*> live_;
  /// Events of freed blocks per stream, in record order (one stream's events complete in order,
  /// so the scan of a stream stops at the first that has not).
  std::map<void*, std::deque<std::pair<void*, Block*>>> pending_;
  std::map<PoolId, std::unique_ptr<Private>> privates_;
  std::map<uint64_t, Private*> routes_;  ///< captures whose blocks come from a private pool
  /// Blocks used on other streams and freed during a capture: their events are recorded once no
  /// capture is underway (an event recorded into a capture cannot be queried).
  std::vector<Block*> deferred_;
  PoolStats stats_;
};

}  // namespace ember::detail
