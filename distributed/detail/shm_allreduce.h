// The shared-memory allreduce that ProcessGroupGloo uses when every rank of the group runs on
// this machine (Note [shared-memory allreduce] in shm_allreduce.cpp). Internal: not installed,
// not part of the public API.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "distributed/process_group.h"
#include "distributed/store.h"
#include "tensor/dtype.h"

// In ember::detail, not ember::dist::detail (store_util.h says why).
namespace ember::detail {

using dist::Duration;
using dist::ReduceOp;
using dist::Store;

class ShmAllreduce {
 public:
  using Clock = std::chrono::steady_clock;
  /// c[i] = f(a[i], b[i]) for i < n; c may alias a.
  using ReduceFn = void (*)(void* c, const void* a, const void* b, size_t n);
  /// x[i] /= divisor for i < n (ReduceOp::Avg's last step).
  using DivideFn = void (*)(void* x, size_t n, int divisor);

  /// Collective: every rank of the group calls it once, right after the group has connected.
  /// Returns a channel set shared by all `size` ranks when they all run on this machine (same
  /// boot, network and PID namespaces, and the segment opens on every rank); otherwise null.
  /// `channels` is how many allreduces may run at once on a rank
  /// (the group's worker threads). Keys are written under "ember_shm/" in `store`, which must
  /// be private to the group. Throws DistTimeoutError if a rank does not take part in time.
  static std::unique_ptr<ShmAllreduce> create(Store& store, int rank, int size, int channels,
                                              Duration timeout);
  ~ShmAllreduce();
  ShmAllreduce(const ShmAllreduce&) = delete;
  ShmAllreduce& operator=(const ShmAllreduce&) = delete;

  /// The ticket of the next allreduce. Called in issue order, which is the same on every rank,
  /// so the k-th allreduce of every rank meets the others' on the same channel.
  uint64_t next_ticket();

  /// A barrier among the ranks as the `ticket`-th operation (a ticket from next_ticket(), like an
  /// allreduce's): returns once every rank has reached this ticket. Throws as run() does.
  void barrier(uint64_t ticket, Clock::time_point deadline);

  /// `count` elements at `data`.
  struct Span {
    void* data;
    size_t count;
  };
  /// Allreduces the spans (one dtype, taken as one concatenated buffer: allreduce_coalesced
  /// without packing copies; every rank's spans may be cut differently as long as the totals
  /// agree) in place with every rank's allreduce of the same ticket; every rank ends with
  /// bitwise the same values. Blocks until done. Throws std::runtime_error saying "timed out"
  /// at `deadline` (naming the rank still awaited), or naming a rank that died, a rank that
  /// gave up (abort()), or ranks that passed a different element count, dtype or op. `fn`
  /// combines two ranks' values (Avg: the sum); `divide`, if given, divides each reduced share
  /// by the group size before the ranks copy it.
  void run(uint64_t ticket, const std::vector<Span>& spans, Dtype dtype, ReduceOp op,
           ReduceFn fn, DivideFn divide, Clock::time_point deadline);

  /// This rank failed a collective: every rank's allreduce that is waiting now or starts later
  /// fails at once, naming this rank and `why`.
  void abort(const std::string& why);

 private:
  ShmAllreduce(int rank, int size, int channels, size_t chunk, void* base, size_t bytes);
  void wait_turn(uint64_t ticket, Clock::time_point deadline);
  void end_turn(uint64_t ticket);

  int rank_;
  int size_;
  int channels_;
  size_t chunk_;
  void* base_;
  size_t bytes_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint64_t> turn_;  // per channel: the next ticket / channels_ allowed in
  std::vector<uint32_t> step_;  // per channel: chunks moved so far (the shared flags' values)
  uint64_t tickets_ = 0;
  bool aborted_ = false;  // abort() was called here: waiting turns give up
};

}  // namespace ember::detail
