// The CUDA caching allocator's block bookkeeping (detail::CachingPool) on a fake device: a memory
// budget handing out addresses that are never dereferenced, and streams whose queued work
// completes only when the test says so. The same class runs on the GPU behind cudaMalloc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include <ember/tensor/detail/caching_pool.h>
#include <ember/tensor/error.h>

namespace ember {
namespace {

using detail::CachingPool;
constexpr size_t kMiB = size_t{1} << 20;
constexpr int64_t kMiB64 = int64_t{1} << 20;

// What the fake device did, shared between the test and the backend the pool owns.
struct FakeState {
  size_t budget = 0;
  size_t used = 0;
  uintptr_t next_addr = uintptr_t{1} << 40;
  std::map<uintptr_t, size_t> segments;
  int64_t mallocs = 0, failed_mallocs = 0, frees = 0, syncs = 0;
  // Stream work as tickets: an event waits for the ticket its stream had when it was recorded.
  std::map<void*, int64_t> queued, completed;
  std::map<void*, std::pair<void*, int64_t>> events;  // event -> (stream, ticket)
  int64_t next_event = 1, events_destroyed = 0;
  // Set while a capture is underway: what a CUDA graph capture forbids then fails the test.
  bool capturing = false;
  // Set to make record_event throw, as the runtime does once a kernel has lost the context.
  bool dead = false;
  std::map<void*, uint64_t> capture_of;  // streams taking part in a capture, by its id

  void finish(void* stream) { completed[stream] = queued[stream]; }
};

class FakeDevice final : public detail::PoolBackend {
 public:
  explicit FakeDevice(std::shared_ptr<FakeState> s) : s_(std::move(s)) {}
  void* raw_alloc(size_t bytes) override {
    if (s_->used + bytes > s_->budget) {
      ++s_->failed_mallocs;
      return nullptr;
    }
    const uintptr_t addr = s_->next_addr;
    s_->next_addr += (bytes + 4 * kMiB) / (2 * kMiB) * (2 * kMiB);  // gaps between segments
    s_->segments[addr] = bytes;
    s_->used += bytes;
    ++s_->mallocs;
    return reinterpret_cast<void*>(addr);
  }
  void raw_free(void* ptr) override {
    EXPECT_FALSE(s_->capturing) << "cudaFree during a capture";
    auto it = s_->segments.find(reinterpret_cast<uintptr_t>(ptr));
    ASSERT_NE(it, s_->segments.end()) << "raw_free of a pointer that is not a segment";
    s_->used -= it->second;
    s_->segments.erase(it);
    ++s_->frees;
  }
  void* record_event(void* stream) override {
    EXPECT_FALSE(s_->capturing) << "an event recorded during a capture";
    if (s_->dead) throw CudaError("CUDA error: an illegal memory access was encountered (sticky)");
    void* e = reinterpret_cast<void*>(s_->next_event++);
    s_->events[e] = {stream, ++s_->queued[stream]};
    return e;
  }
  bool event_done(void* event) override {
    EXPECT_FALSE(s_->capturing) << "an event queried during a capture";
    auto [stream, ticket] = s_->events.at(event);
    return s_->completed[stream] >= ticket;
  }
  void destroy_event(void* event) override {
    EXPECT_EQ(s_->events.erase(event), 1u);
    ++s_->events_destroyed;
  }
  void synchronize() override {
    EXPECT_FALSE(s_->capturing) << "a device synchronisation during a capture";
    ++s_->syncs;
    for (auto& [stream, ticket] : s_->queued) s_->completed[stream] = ticket;
  }
  void mem_info(size_t* free, size_t* total) override {
    *free = s_->budget - s_->used;
    *total = s_->budget;
  }
  std::string name() const override { return "GPU 7"; }
  uint64_t capture_id(void* stream) override {
    auto it = s_->capture_of.find(stream);
    return it == s_->capture_of.end() ? 0 : it->second;
  }

 private:
  std::shared_ptr<FakeState> s_;
};

void* const kStreamA = reinterpret_cast<void*>(0xA0);
void* const kStreamB = reinterpret_cast<void*>(0xB0);

class CachingPoolTest : public ::testing::Test {
 protected:
  void make_pool(size_t budget) {
    state_ = std::make_shared<FakeState>();
    state_->budget = budget;
    pool_ = std::make_unique<CachingPool>(std::make_unique<FakeDevice>(state_));
  }
  void SetUp() override { make_pool(size_t{1} << 40); }
  void* alloc(size_t n, void* stream = kStreamA) { return pool_->allocate(n, stream); }
  // A capture `id` of `streams` into private pool `pool`, as CUDAGraph::capture_begin makes one.
  void begin_capture(detail::PoolId pool, uint64_t id, std::vector<void*> streams) {
    for (void* s : streams) state_->capture_of[s] = id;
    pool_->begin_private(pool, id);
    state_->capturing = true;
  }
  void end_capture(uint64_t id) {
    state_->capturing = false;
    std::erase_if(state_->capture_of, [id](const auto& e) { return e.second == id; });
    pool_->end_private(id);
  }
  std::vector<int64_t> layout(void* p) const { return pool_->segment_layout(p); }
  static std::vector<int64_t> mib(std::vector<int64_t> v) {
    for (auto& x : v) x *= kMiB64;
    return v;
  }
  static char* at(void* p, size_t off) { return static_cast<char*>(p) + off; }

  std::shared_ptr<FakeState> state_;
  std::unique_ptr<CachingPool> pool_;
};

TEST_F(CachingPoolTest, SmallRequestsRoundTo512AndShareOneTwoMiBSegment) {
  void* a = alloc(1);
  void* b = alloc(1000);
  void* c = alloc(kMiB);
  EXPECT_EQ(b, at(a, 512));
  EXPECT_EQ(c, at(a, 512 + 1024));
  EXPECT_EQ(layout(a), (std::vector<int64_t>{512, 1024, kMiB64, -(kMiB64 - 1536)}));
  const auto s = pool_->stats();
  EXPECT_EQ(s.allocated, 512 + 1024 + kMiB64);
  EXPECT_EQ(s.requested, 1 + 1000 + kMiB64);
  EXPECT_EQ(s.reserved, 2 * kMiB64);
  EXPECT_EQ(s.num_segments, 1);
  EXPECT_EQ(state_->mallocs, 1);
  EXPECT_EQ(pool_->allocate(0, kStreamA), nullptr);
}

TEST_F(CachingPoolTest, LargeRequestsUseTwentyMiBSegmentsOrTheirOwnRoundedSize) {
  void* a = alloc(3 * kMiB);  // 1 MiB < size < 10 MiB: a 20 MiB segment
  EXPECT_EQ(layout(a), mib({3, -17}));
  void* big = alloc(50 * kMiB + 1);  // fits nothing cached: a segment of 52 MiB, split
  EXPECT_EQ(layout(big), (std::vector<int64_t>{50 * kMiB64 + 512, -(2 * kMiB64 - 512)}));
  void* b = alloc(12 * kMiB);  // best fit: the 17 MiB rest of the first segment
  EXPECT_EQ(b, at(a, 3 * kMiB));
  EXPECT_EQ(layout(a), mib({3, 12, -5}));
  EXPECT_EQ(pool_->stats().reserved, 72 * kMiB64);
  EXPECT_EQ(state_->mallocs, 2);
}

TEST_F(CachingPoolTest, LargeRemainderOfOneMiBOrLessStaysWithTheBlock) {
  void* a = alloc(10 * kMiB);  // a 10 MiB segment
  pool_->free(a);
  void* b = alloc(9 * kMiB + 512);  // the rest (1 MiB - 512) is not worth a block
  EXPECT_EQ(b, a);
  EXPECT_EQ(layout(b), mib({10}));
  EXPECT_EQ(pool_->stats().allocated, 10 * kMiB64);  // the whole block counts
  EXPECT_EQ(pool_->stats().requested, 9 * kMiB64 + 512);
}

TEST_F(CachingPoolTest, FreedBlocksMergeWithFreeNeighboursIntoOneSegmentBlock) {
  void* a = alloc(4 * kMiB);
  void* b = alloc(4 * kMiB);
  void* c = alloc(4 * kMiB);
  ASSERT_EQ(b, at(a, 4 * kMiB));
  ASSERT_EQ(c, at(a, 8 * kMiB));
  EXPECT_EQ(layout(a), mib({4, 4, 4, -8}));
  pool_->free(b);
  EXPECT_EQ(layout(a), mib({4, -4, 4, -8}));
  pool_->free(a);
  EXPECT_EQ(layout(a), mib({-8, 4, -8}));
  pool_->free(c);
  EXPECT_EQ(layout(a), mib({-20}));
  // The merged block serves a request of the whole segment without a new cudaMalloc.
  void* whole = alloc(20 * kMiB);
  EXPECT_EQ(whole, a);
  EXPECT_EQ(state_->mallocs, 1);
  pool_->free(whole);
  EXPECT_EQ(pool_->stats().allocated, 0);
}

TEST_F(CachingPoolTest, BestFitTakesTheSmallestFreeBlockThatFits) {
  // One 20 MiB segment: [a 2][x 2][b 6][y 2][c 3][z 2][rest 3], then a, b and c freed: free
  // blocks of 2, 6 and 3 MiB kept apart by live ones.
  void* a = alloc(2 * kMiB);
  void* x = alloc(2 * kMiB);
  void* b = alloc(6 * kMiB);
  void* y = alloc(2 * kMiB);
  void* c = alloc(3 * kMiB);
  void* z = alloc(2 * kMiB);
  ASSERT_EQ(layout(a), mib({2, 2, 6, 2, 3, 2, -3}));
  for (void* p : {a, b, c}) pool_->free(p);
  // 2.5 MiB: the 3 MiB blocks fit best (the lower address wins a tie); first fit by address
  // would have split the 6 MiB one.
  void* d = alloc(5 * kMiB / 2);
  EXPECT_EQ(d, c);
  EXPECT_EQ(layout(a), mib({-2, 2, -6, 2, 3, 2, -3}));
  void* e = alloc(5 * kMiB);  // only the 6 MiB block fits; its 1 MiB rest is not split off
  EXPECT_EQ(e, b);
  EXPECT_EQ(layout(a), mib({-2, 2, 6, 2, 3, 2, -3}));
  EXPECT_EQ(state_->mallocs, 1);
  for (void* p : {x, y, z, d, e}) pool_->free(p);
  EXPECT_EQ(layout(a), mib({-20}));
}

TEST_F(CachingPoolTest, BlocksAreReusedOnlyOnTheStreamTheyWereAllocatedOn) {
  void* a = alloc(4 * kMiB, kStreamA);
  pool_->free(a);
  void* b = alloc(4 * kMiB, kStreamB);
  EXPECT_NE(b, a);
  EXPECT_EQ(state_->mallocs, 2);
  void* c = alloc(4 * kMiB, kStreamA);
  EXPECT_EQ(c, a);
  EXPECT_EQ(state_->mallocs, 2);
}

TEST_F(CachingPoolTest, BlockUsedOnAnotherStreamIsReusedOnlyAfterItsEvent) {
  void* a = alloc(4 * kMiB, kStreamA);
  pool_->record_stream(a, kStreamB);
  pool_->record_stream(a, kStreamA);  // its own stream: nothing to wait for
  pool_->free(a);
  EXPECT_EQ(state_->events.size(), 1u);
  EXPECT_EQ(layout(a), mib({4, -16}));  // waiting, neither free nor merged
  void* b = alloc(4 * kMiB, kStreamA);
  EXPECT_NE(b, a);
  EXPECT_EQ(pool_->stats().allocated, 4 * kMiB64);  // a counts as freed at once
  state_->finish(kStreamB);
  pool_->free(b);
  void* c = alloc(4 * kMiB, kStreamA);
  EXPECT_EQ(c, a);
  EXPECT_EQ(state_->events_destroyed, 1);
  EXPECT_TRUE(state_->events.empty());
  EXPECT_EQ(state_->syncs, 0);
  pool_->free(c);
  EXPECT_EQ(layout(a), mib({-20}));
}

TEST_F(CachingPoolTest, WorkQueuedOnTheOtherStreamAfterTheFreeIsNotWaitedFor) {
  void* a = alloc(kMiB, kStreamA);
  pool_->record_stream(a, kStreamB);
  pool_->free(a);
  state_->finish(kStreamB);
  ++state_->queued[kStreamB];  // later work on B has nothing to do with a
  EXPECT_EQ(alloc(kMiB, kStreamA), a);
}

// A block used on other streams, freed after the context was lost (its events cannot be
// recorded): free does not throw (it runs in tensor destructors) and the block is never handed
// out again, since nothing can say when those streams are done with it.
TEST_F(CachingPoolTest, ABlockWhoseEventsCannotBeRecordedIsFreedWithoutThrowingAndNeverReused) {
  void* a = alloc(4 * kMiB, kStreamA);
  pool_->record_stream(a, kStreamB);
  state_->dead = true;
  EXPECT_NO_THROW(pool_->free(a));
  state_->dead = false;
  EXPECT_EQ(pool_->stats().lost_blocks, 1);
  EXPECT_EQ(pool_->stats().allocated, 0);
  state_->finish(kStreamB);
  std::vector<void*> later;
  for (int i = 0; i < 4; ++i) {
    later.push_back(alloc(4 * kMiB, kStreamA));
    EXPECT_NE(later.back(), a) << "allocation " << i;
  }
  for (void* p : later) pool_->free(p);
  pool_->empty_cache();
  EXPECT_EQ(pool_->stats().reserved, 20 * kMiB64);  // a's segment, held by a
}

TEST_F(CachingPoolTest, RecordStreamOfAForeignPointerIsAnError) {
  int x = 0;
  EXPECT_THROW(pool_->record_stream(&x, kStreamB), ValueError);
}

TEST_F(CachingPoolTest, OneLargeBlockIsSplitForManySmallerRequests) {
  void* big = alloc(64 * kMiB);
  pool_->free(big);
  std::vector<void*> parts;
  for (int i = 0; i < 8; ++i) parts.push_back(alloc(8 * kMiB));
  EXPECT_EQ(pool_->stats().reserved, 64 * kMiB64);
  EXPECT_EQ(state_->mallocs, 1);
  for (void* p : parts) pool_->free(p);
  EXPECT_EQ(layout(big), mib({-64}));
}

// Long runs of mixed sizes must not fragment memory: with blocks kept whole and reused only for
// requests of at least half their size, each new size needs a new segment, the cache fills
// the device and every few hundred steps the allocator must synchronise and give everything
// back. Split and merged blocks settle after a warm-up: later steps need almost no new
// segments and never run out of the budget.
TEST_F(CachingPoolTest, ChurnOfMixedSizesSettlesWithoutNewSegmentsOrRetries) {
  constexpr size_t kLiveCap = 256 * kMiB;
  make_pool(3 * kLiveCap);
  std::mt19937_64 rng(12345);
  std::vector<std::pair<void*, size_t>> live;
  size_t live_bytes = 0;
  int64_t mallocs_after_warmup = 0;
  for (int step = 0; step < 50000; ++step) {
    if (step == 10000) mallocs_after_warmup = -state_->mallocs;
    const size_t base = size_t{1} << (9 + rng() % 16);  // 512 B .. 16 MiB, log-uniform
    const size_t n = base + rng() % base;
    if (!live.empty() && (live_bytes + n > kLiveCap || rng() % 2 == 0)) {
      const size_t i = rng() % live.size();
      pool_->free(live[i].first);
      live_bytes -= live[i].second;
      live[i] = live.back();
      live.pop_back();
    } else {
      live.emplace_back(alloc(n, rng() % 4 == 0 ? kStreamB : kStreamA), n);
      live_bytes += n;
    }
  }
  mallocs_after_warmup += state_->mallocs;
  const auto s = pool_->stats();
  EXPECT_LE(mallocs_after_warmup, 16) << "segments got from the device after the warm-up";
  EXPECT_EQ(s.num_alloc_retries, 0);
  for (auto& [p, n] : live) pool_->free(p);
  EXPECT_EQ(pool_->stats().allocated, 0);
  pool_->empty_cache();
  EXPECT_EQ(pool_->stats().reserved, 0);
  EXPECT_TRUE(state_->segments.empty());
}

TEST_F(CachingPoolTest, OutOfMemoryReleasesCachedSegmentsAndRetries) {
  make_pool(100 * kMiB);
  void* a = alloc(60 * kMiB);
  pool_->free(a);
  void* b = alloc(80 * kMiB);  // 60 + 80 > 100: the cached 60 MiB go back, then it fits
  EXPECT_NE(b, nullptr);
  auto s = pool_->stats();
  EXPECT_EQ(s.reserved, 80 * kMiB64);
  EXPECT_EQ(s.num_alloc_retries, 1);
  EXPECT_EQ(s.num_ooms, 0);
  EXPECT_EQ(state_->syncs, 1);
  EXPECT_EQ(state_->failed_mallocs, 1);
}

TEST_F(CachingPoolTest, OutOfMemoryWaitsForBlocksFreedOnOtherStreams) {
  make_pool(100 * kMiB);
  void* a = alloc(60 * kMiB, kStreamA);
  pool_->record_stream(a, kStreamB);
  pool_->free(a);
  // The block waits for B; the device synchronises, the block is free and is the one that fits.
  void* b = alloc(60 * kMiB, kStreamA);
  EXPECT_EQ(b, a);
  EXPECT_EQ(state_->syncs, 1);
  EXPECT_EQ(state_->mallocs, 1);
  EXPECT_EQ(pool_->stats().num_alloc_retries, 1);
}

TEST_F(CachingPoolTest, OutOfMemoryErrorGivesTheSizesAndTheDevice) {
  make_pool(100 * kMiB);
  void* a = alloc(80 * kMiB);
  void* small = alloc(1000);  // 2 MiB reserved, 1 KiB of it allocated
  try {
    alloc(30 * kMiB);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    const std::string m = e.what();
    for (const char* part :
         {"CUDA out of memory. Tried to allocate 30.00 MiB.",
          "GPU 7 has a total capacity of 100.00 MiB of which 18.00 MiB is free.",
          "80.00 MiB is allocated by Ember", "2.00 MiB is reserved by Ember but unallocated",
          "requested 31457280", "allocated 83887104", "reserved 85983232", "free 18874368",
          "total 104857600"}) {
      EXPECT_NE(m.find(part), std::string::npos) << "missing \"" << part << "\" in: " << m;
    }
  }
  EXPECT_EQ(pool_->stats().num_ooms, 1);
  // The pool still works after the error.
  pool_->free(a);
  void* c = alloc(30 * kMiB);
  EXPECT_EQ(c, a);
  pool_->free(c);
  pool_->free(small);
}

TEST_F(CachingPoolTest, EmptyCacheReturnsOnlyWhollyFreeSegments) {
  void* a = alloc(4 * kMiB);
  void* b = alloc(30 * kMiB);
  void* c = alloc(512);
  pool_->free(b);
  pool_->free(c);
  pool_->empty_cache();
  EXPECT_EQ(pool_->stats().reserved, 20 * kMiB64);  // a's segment stays
  EXPECT_EQ(state_->segments.size(), 1u);
  pool_->free(a);
  pool_->empty_cache();
  EXPECT_EQ(pool_->stats().reserved, 0);
  EXPECT_EQ(pool_->stats().num_segments, 0);
}

TEST_F(CachingPoolTest, PeaksFollowTheCountsAndReset) {
  void* a = alloc(30 * kMiB);
  pool_->free(a);
  auto s = pool_->stats();
  EXPECT_EQ(s.allocated, 0);
  EXPECT_EQ(s.max_allocated, 30 * kMiB64);
  EXPECT_EQ(s.max_reserved, 30 * kMiB64);
  pool_->empty_cache();
  pool_->reset_peak_stats();
  s = pool_->stats();
  EXPECT_EQ(s.max_allocated, 0);
  EXPECT_EQ(s.max_reserved, 0);
  void* b = alloc(512);
  s = pool_->stats();
  EXPECT_EQ(s.max_allocated, 512);
  EXPECT_EQ(s.max_reserved, 2 * kMiB64);
  pool_->free(b);
}

// Note [Graph pools]: what a capture allocates stays in its private pool, reused within the
// capture, kept from everything else, and given back when the graph is.
TEST_F(CachingPoolTest, PrivatePoolServesTheCapturingStreamAndKeepsItsMemoryUntilReleased) {
  void* before = alloc(kMiB, kStreamA);
  pool_->free(before);
  begin_capture(1, 100, {kStreamA});
  void* a = alloc(kMiB, kStreamA);
  EXPECT_NE(a, before);  // the default pool's free block is not taken
  EXPECT_EQ(pool_->private_pool_of(a), 1u);
  void* other = alloc(kMiB, kStreamB);  // another stream allocates as usual meanwhile
  EXPECT_EQ(pool_->private_pool_of(other), 0u);
  pool_->free(a);
  void* again = alloc(kMiB, kStreamA);  // reused within the capture: the graph runs in order
  EXPECT_EQ(again, a);
  void* big = alloc(30 * kMiB, kStreamA);
  EXPECT_EQ(pool_->private_pool_of(big), 1u);
  pool_->free(big);
  end_capture(100);
  const int64_t reserved = pool_->stats().reserved;
  EXPECT_EQ(reserved, (2 + 2 + 2 + 30) * kMiB64);
  // After the capture the stream allocates from the default pool; the graph's memory stays out.
  void* after = alloc(30 * kMiB, kStreamA);
  EXPECT_EQ(pool_->private_pool_of(after), 0u);
  EXPECT_NE(after, big);
  pool_->free(after);
  pool_->empty_cache();  // the default pool's segments go; the graph's stay
  EXPECT_EQ(pool_->stats().reserved, (2 + 2 + 30) * kMiB64);
  EXPECT_EQ(pool_->segment_layout(big), mib({-30}));
  // The graph is reset while `again` (its static output) lives: the free 30 MiB go back now,
  // the small segment when its last block is freed.
  pool_->release_private(1);
  EXPECT_EQ(pool_->stats().reserved, (2 + 2) * kMiB64);
  EXPECT_TRUE(pool_->segment_layout(big).empty());
  pool_->free(again);
  EXPECT_EQ(pool_->stats().reserved, 2 * kMiB64);
  pool_->free(other);
  pool_->empty_cache();
  EXPECT_EQ(pool_->stats().reserved, 0);
  EXPECT_TRUE(state_->segments.empty());
  EXPECT_THROW(pool_->release_private(1), ValueError);  // gone
}

TEST_F(CachingPoolTest, CaptureQueriesNoEventsWaitsForNothingAndGivesNothingBack) {
  make_pool(100 * kMiB);
  void* shared = alloc(4 * kMiB, kStreamA);
  pool_->record_stream(shared, kStreamB);
  void* cached = alloc(30 * kMiB, kStreamA);
  pool_->free(cached);
  begin_capture(3, 200, {kStreamA});
  void* a = alloc(20 * kMiB, kStreamA);
  pool_->free(shared);  // used on B: waits for B, but its event cannot be recorded now
  EXPECT_TRUE(state_->events.empty());
  EXPECT_EQ(pool_->segment_layout(shared), mib({4, -16}));
  // 20 + 30 + 20 + 40 > 100 (the cached 30 MiB would make room): no retry, which would
  // synchronise and free, but the error at once.
  EXPECT_THROW(alloc(40 * kMiB, kStreamA), OutOfMemoryError);
  EXPECT_EQ(pool_->stats().num_alloc_retries, 0);
  EXPECT_THROW(pool_->empty_cache(), ValueError);
  end_capture(200);
  EXPECT_EQ(state_->events.size(), 1u);  // recorded now, on B
  state_->finish(kStreamB);
  EXPECT_EQ(alloc(4 * kMiB, kStreamA), shared);
  pool_->free(a);
  EXPECT_EQ(pool_->private_pool_of(a), 0u);  // freed: no longer handed out
  EXPECT_EQ(pool_->segment_layout(a), mib({-20}));
  pool_->release_private(3);
  EXPECT_TRUE(pool_->segment_layout(a).empty());
}

// A capture that forks onto a second stream (a collective's, a prefetch's) allocates there from
// its pool as well.
TEST_F(CachingPoolTest, EveryStreamOfTheCaptureAllocatesFromItsPool) {
  begin_capture(4, 300, {kStreamA, kStreamB});
  void* a = alloc(kMiB, kStreamA);
  void* b = alloc(kMiB, kStreamB);
  EXPECT_EQ(pool_->private_pool_of(a), 4u);
  EXPECT_EQ(pool_->private_pool_of(b), 4u);
  end_capture(300);
  pool_->free(a);
  pool_->free(b);
  pool_->release_private(4);
  EXPECT_EQ(pool_->stats().reserved, 0);
}

TEST_F(CachingPoolTest, PoolSharedByTwoGraphsOutlivesTheFirst) {
  begin_capture(9, 1, {kStreamA});
  void* first = alloc(kMiB, kStreamA);
  pool_->free(first);
  end_capture(1);
  begin_capture(9, 2, {kStreamA});  // a second graph captured into the same pool
  EXPECT_EQ(alloc(kMiB, kStreamA), first);
  end_capture(2);
  pool_->free(first);
  pool_->release_private(9);
  EXPECT_EQ(pool_->segment_layout(first), mib({-2}));  // the second graph still uses it
  pool_->release_private(9);
  EXPECT_TRUE(pool_->segment_layout(first).empty());
  EXPECT_EQ(pool_->stats().reserved, 0);
}

TEST_F(CachingPoolTest, PrivatePoolMisuseIsAnError) {
  EXPECT_THROW(pool_->begin_private(0, 5), ValueError);
  EXPECT_THROW(pool_->begin_private(2, 0), ValueError);
  pool_->begin_private(2, 5);
  EXPECT_THROW(pool_->begin_private(4, 5), ValueError);
  EXPECT_THROW(pool_->end_private(6), ValueError);
  pool_->end_private(5);
  EXPECT_THROW(pool_->end_private(5), ValueError);
  EXPECT_THROW(pool_->release_private(5), ValueError);
  pool_->release_private(2);
}

// Threads on their own streams never get overlapping blocks, and every byte comes back.
TEST_F(CachingPoolTest, ConcurrentThreadsGetDisjointBlocks) {
  std::mutex mu;
  std::map<uintptr_t, uintptr_t> live;  // start -> end, across all threads
  bool overlap = false;
  auto worker = [&](int t) {
    std::mt19937 rng(static_cast<unsigned>(t));
    void* stream = reinterpret_cast<void*>(uintptr_t{0x100} * static_cast<uintptr_t>(t + 1));
    std::vector<void*> mine;
    for (int i = 0; i < 2000; ++i) {
      if (!mine.empty() && rng() % 2) {
        void* p = mine.back();
        mine.pop_back();
        {
          std::lock_guard<std::mutex> lock(mu);
          live.erase(reinterpret_cast<uintptr_t>(p));
        }
        pool_->free(p);
        continue;
      }
      const size_t n = size_t{512} << (rng() % 14);
      void* p = pool_->allocate(n, stream);
      const auto lo = reinterpret_cast<uintptr_t>(p);
      std::lock_guard<std::mutex> lock(mu);
      auto next = live.lower_bound(lo);
      if (next != live.end() && next->first < lo + n) overlap = true;
      if (next != live.begin() && std::prev(next)->second > lo) overlap = true;
      live[lo] = lo + n;
      mine.push_back(p);
    }
    for (void* p : mine) {
      {
        std::lock_guard<std::mutex> lock(mu);
        live.erase(reinterpret_cast<uintptr_t>(p));
      }
      pool_->free(p);
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
  EXPECT_FALSE(overlap);
  EXPECT_EQ(pool_->stats().allocated, 0);
  EXPECT_EQ(pool_->stats().requested, 0);
}

}  // namespace
}  // namespace ember
