// The shared-memory collectives that ProcessGroupGloo uses when every rank of the group runs on
// this machine (Note [shared-memory allreduce] in shm_allreduce.cpp, Note [shared-memory
// collectives] in shm_collectives.cpp, Note [single-copy collectives] in shm_single_copy.cpp).
// Internal: not installed, not part of the public API.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <ember/distributed/process_group.h>
#include <ember/distributed/store/store.h>
#include <ember/tensor/dtype.h>
#include <ember/tensor/tensor.h>


namespace ember::dist::detail {

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

  /// Single copies from EMBER_GLOO_SHM_SINGLE_COPY (0 or 1, default 1) and
  /// EMBER_GLOO_SHM_SINGLE_COPY_BYTES (the smallest block that takes them): SIZE_MAX when off.
  /// Throws ValueError for a value that is not one of those.
  static size_t single_copy_bytes_from_env();
  /// True when EMBER_GLOO_SHM_SINGLE_COPY_BYTES is not set (the threshold is Ember's choice).
  static bool single_copy_bytes_is_default();
  /// Collective: every rank of the group calls it once, right after the group has connected.
  /// Returns a channel set shared by all `size` ranks when they all run on this machine (same
  /// boot, network and PID namespaces, and the segment opens on every rank); otherwise null.
  /// `channels` is how many collectives may run at once on a rank
  /// (the group's worker threads). Keys are written under "ember_shm/" in `store`, which must
  /// be private to the group. Throws DistTimeoutError if a rank does not take part in time.
  /// `single_copy_bytes`: what this rank asks for as single_copy_bytes() (SIZE_MAX: none);
  /// 0 takes single_copy_bytes_from_env(), and when neither variable is set lets an
  /// oversubscribed group lower alltoall's and scatter's threshold (heavy_single_copy_bytes()).
  static std::unique_ptr<ShmAllreduce> create(Store& store, int rank, int size, int channels,
                                              Duration timeout, size_t single_copy_bytes = 0);
  ~ShmAllreduce();
  ShmAllreduce(const ShmAllreduce&) = delete;
  ShmAllreduce& operator=(const ShmAllreduce&) = delete;

  /// The ticket of the next collective. Called in issue order, which is the same on every
  /// rank, so the k-th collective of every rank meets the others' on the same channel.
  uint64_t next_ticket();

  /// A barrier among the ranks as the `ticket`-th operation (a ticket from next_ticket(), like an
  /// allreduce's): returns once every rank has reached this ticket. Throws as run() does.
  void barrier(uint64_t ticket, Clock::time_point deadline);

  /// `count` elements at `data`.
  struct Span {
    void* data;
    size_t count;
  };
  /// A buffer that a rank publishes for its peers to read (Note [single-copy
  /// collectives]): `data` is an address in the publishing rank's process.
  struct Entry {
    const void* data;
    size_t bytes;
    /// For a peer's buffer: its published table entry, when the buffer is shareable (Note
    /// [mapped reductions]): a reader then copies from its mapping instead of with
    /// cross-memory attach.
    const uint64_t* region = nullptr;
  };
  /// How two ranks' values combine: `fn` (Avg: the sum), then `divide`, if given, divides each
  /// reduced element by the group size.
  struct Reduction {
    ReduceOp op;
    ReduceFn fn;
    DivideFn divide;
  };
  /// Allreduces the spans (one dtype, taken as one concatenated buffer: allreduce_coalesced
  /// without packing copies; every rank's spans may be cut differently as long as the totals
  /// agree) in place with every rank's allreduce of the same ticket; every rank ends with
  /// bitwise the same values. Blocks until done. Throws std::runtime_error saying "timed out"
  /// at `deadline` (naming the rank still awaited), or naming a rank that died, a rank that
  /// gave up (abort()), or ranks that passed a different collective, element count, dtype, op
  /// or root (every collective below throws the same errors). `fn` combines two ranks' values
  /// (Avg: the sum); `divide`, if given, divides each reduced share by the group size before
  /// the ranks copy it.
  void run(uint64_t ticket, const std::vector<Span>& spans, Dtype dtype, ReduceOp op,
           ReduceFn fn, DivideFn divide, Clock::time_point deadline);

  // The other collectives (Note [shared-memory collectives] in shm_collectives.cpp). Each takes
  // the next ticket in issue order as run() does; `count` is the element count of one rank's
  // block, and every buffer is contiguous and holds `count` elements of `dtype`.

  /// The allreduce's steps, but only `root` copies the result into `data`; the other ranks'
  /// `data` is left as it was.
  void reduce(uint64_t ticket, void* data, size_t count, Dtype dtype, const Reduction& r,
              int root, Clock::time_point deadline);
  /// out = the reduction over ranks of their blocks[rank] (blocks: one pointer per rank; out
  /// may be blocks[rank] itself, but must not overlap the other blocks).
  void reduce_scatter(uint64_t ticket, const std::vector<const void*>& blocks, void* out,
                      size_t count, Dtype dtype, const Reduction& r, Clock::time_point deadline);
  /// Every rank's `data` ends with root's.
  void broadcast(uint64_t ticket, void* data, size_t count, Dtype dtype, int root,
                 Clock::time_point deadline);
  /// outs[r] (one per rank) receives rank r's `in`; with root >= 0 (gather) only root passes
  /// outs, the other ranks an empty list; root < 0 is allgather.
  void gather(uint64_t ticket, const void* in, const std::vector<void*>& outs, size_t count,
              Dtype dtype, int root, Clock::time_point deadline);
  /// out receives root's ins[rank] (only root passes ins, one per rank).
  void scatter(uint64_t ticket, const std::vector<const void*>& ins, void* out, size_t count,
               Dtype dtype, int root, Clock::time_point deadline);
  /// outs[r] receives rank r's ins[rank] (both one per rank).
  void alltoall(uint64_t ticket, const std::vector<const void*>& ins,
                const std::vector<void*>& outs, size_t count, Dtype dtype,
                Clock::time_point deadline);

  /// Broadcasts, gathers, scatters and alltoalls whose block (`count` x element size) has at
  /// least this many bytes read the peers' buffers directly instead of staging through the
  /// segment (Note [single-copy collectives]); SIZE_MAX when the group cannot (cross-memory
  /// attach refused or turned off on some rank). The same on every rank.
  size_t single_copy_bytes() const { return single_copy_bytes_; }
  /// The same for alltoall and scatter, the collectives whose staged path copies the most per
  /// rank: kOversubscribedSingleCopyBytes when the group's ranks outnumber the CPUs they may
  /// run on and no rank chose a threshold (Note [single copies when oversubscribed]), otherwise
  /// single_copy_bytes(). The same on every rank.
  size_t heavy_single_copy_bytes() const { return heavy_single_copy_bytes_; }
  static constexpr size_t kOversubscribedSingleCopyBytes = size_t{256} << 10;
  /// How many collectives took the single-copy path on this rank so far.
  uint64_t single_copies() const { return single_copies_.load(); }
  /// How many reductions reduced straight from the peers' mapped buffers on this rank so far
  /// (Note [mapped reductions] in shm_mapped.cpp).
  uint64_t mapped_reductions() const { return mapped_reductions_.load(); }
  /// How many of the peers' shareable regions this rank keeps mapped now.
  size_t mapped_regions() const;
  /// Reductions of at least this many bytes per rank ask whether every rank's buffers are
  /// shareable (when the group allows single copies at all).
  static constexpr size_t kMappedMinBytes = size_t{256} << 10;

  /// This rank failed a collective: every rank's collective that is waiting now or starts
  /// later fails at once, naming this rank and `why`.
  void abort(const std::string& why);

  /// What a rank passed to a collective; ranks that differ fail naming both.
  enum class Kind : uint32_t {
    Allreduce = 1,
    Reduce,
    Broadcast,
    Allgather,
    Gather,
    Scatter,
    ReduceScatter,
    Alltoall,
    Barrier
  };
  struct Desc {
    Kind kind;
    Dtype dtype;
    uint64_t count;
    ReduceOp op = ReduceOp::Sum;  // for the reductions
    int32_t root = -1;            // for the rooted collectives
  };

 private:
  /// A channel's data area as this rank sees it: `size` slots of `chunk` bytes, then the
  /// result buffer of `chunk` bytes (contiguous: the slots may be taken as one buffer).
  struct Area {
    char* slots;
    char* result;
    size_t chunk;
    char* slot(int r) const { return slots + chunk * static_cast<size_t>(r); }
  };
  /// The phases of one step (Note [shared-memory collectives]). Of the shared memory, Publish
  /// writes only slots, Combine (after every rank published) reads slots and writes only this
  /// rank's part of the result, Collect (after every rank combined) reads only the result.
  enum class Phase { Publish, Combine, Collect };
  using StepFn = std::function<void(Phase phase, size_t step, const Area& area)>;
  /// Runs `steps` steps (at least one, for the check that the ranks agree on `desc`) of the
  /// collective `ticket` on its channel, calling `body` for each phase of each step.
  void run_steps(uint64_t ticket, const Desc& desc, size_t steps, Clock::time_point deadline,
                 const StepFn& body);
  /// run_steps, but `body` may lower `steps` during the Combine phase of step 0 (where every
  /// rank has seen what every other rank published, so all decide alike).
  void run_steps_until(uint64_t ticket, const Desc& desc, size_t& steps,
                       Clock::time_point deadline, const StepFn& body);
  /// out = the reduction of srcs[0..size) in rank order (then divided, for Avg); n elements.
  void combine(char* out, const std::vector<const void*>& srcs, size_t n,
               const Reduction& r) const;
  /// Elements of each block that one step of reduce_scatter or alltoall moves.
  size_t block_piece(Dtype dtype) const;
  /// The allreduce (root < 0) or the reduce to root, over `spans`.
  void reduce_spans(uint64_t ticket, const std::vector<Span>& spans, const Desc& desc,
                    const Reduction& r, Clock::time_point deadline);

  // Note [single-copy collectives] (shm_single_copy.cpp).
  /// Collective, at the end of create(): every rank tries to read each peer's memory and says
  /// whether it wants single copies and from what size (`automatic`: the default, which the
  /// group may lower for alltoall and scatter); sets the thresholds for all.
  void agree_single_copy(Store& store, size_t wanted, bool automatic, Duration timeout);
  /// True (and counted) when a collective of `bytes` per block takes the single-copy path;
  /// `heavy` for alltoall and scatter.
  bool single_copy(size_t bytes, bool heavy = false);
  /// Runs one step of `desc`: Publish writes `mine` into this rank's slot; after every rank has,
  /// `body` runs with the peers' entries (tables[r], r != rank); then waits until every rank is
  /// done with the others' buffers.
  using DirectFn = std::function<void(const std::vector<std::vector<Entry>>& tables)>;
  void run_direct(uint64_t ticket, const Desc& desc, const std::vector<Entry>& mine,
                  Clock::time_point deadline, const DirectFn& body);
  /// Copies rank r's `remote` bytes (addresses in r's process) into this process's `local`
  /// ones (the lists may be cut differently) with cross-memory attach. Throws naming r if it
  /// exited or the kernel refuses.
  void peer_read(int r, const std::vector<Entry>& local, const std::vector<Entry>& remote,
                 const char* kind);
  /// True for this rank and for ranks that are threads of this process: their buffers are
  /// used where they lie, not read or mapped from another process.
  bool in_this_process(int r) const;
  /// Rank r's pid (all ranks share a PID namespace).
  int pid_of(int r) const;
  void broadcast_direct(uint64_t ticket, void* data, size_t count, Dtype dtype, int root,
                        Clock::time_point deadline);
  void gather_direct(uint64_t ticket, const void* in, const std::vector<void*>& outs,
                     size_t count, Dtype dtype, int root, Clock::time_point deadline);
  void scatter_direct(uint64_t ticket, const std::vector<const void*>& ins, void* out,
                      size_t count, Dtype dtype, int root, Clock::time_point deadline);
  void alltoall_direct(uint64_t ticket, const std::vector<const void*>& ins,
                       const std::vector<void*>& outs, size_t count, Dtype dtype,
                       Clock::time_point deadline);

  // Note [mapped reductions] (shm_mapped.cpp).
  /// peers[r][i]: rank r's buffer i, as mapped into this process.
  using PeerBuffers = std::vector<std::vector<char*>>;
  using MappedFn = std::function<void(const PeerBuffers& peers)>;
  /// True when a reduction of `bytes` per rank negotiates (the same on every rank).
  bool may_map(size_t bytes) const;
  /// In agree_single_copy: publishes a probe region and tries to map every peer's; false (and
  /// logged) if some peer's cannot be.
  bool probe_mapping(Store& store, Duration timeout);
  /// Words of a table entry in a slot: region id (0: not shareable), fd, region bytes, offset,
  /// buffer bytes, the buffer's address in its own process.
  static constexpr size_t kEntryWords = 6;
  /// Throws if `entries` table entries do not fit a slot.
  void check_table_fits(size_t entries) const;
  /// Writes into `slot` the table of `mine`: their count, this process's count of freed
  /// shareable regions, then per buffer its region (id 0: not shareable), fd, region size,
  /// offset, size and address.
  void write_table(char* slot, const std::vector<Entry>& mine) const;
  /// Rank r's buffer of table entry `e` as mapped here (mapping its region once), with what keeps
  /// the mapping alive while it is used.
  std::pair<char*, std::shared_ptr<void>> mapped_pointer(int r, const uint64_t* e);
  /// Drops this rank's mappings of rank r's regions if r freed some since (Note [mapped
  /// reductions]); `entries`: the n table entries of r that the collective uses.
  void drop_freed(int r, uint64_t frees, const uint64_t* entries, size_t n);
  /// Throws the abort word's error if some rank gave up.
  void throw_if_aborted() const;
  /// Step 0: every rank publishes where `mine` lie; if every rank's buffers are all shareable,
  /// `mapped` runs in step 0 with them mapped, and that is the collective. Otherwise `staged`
  /// runs as steps 1..staged_steps (its steps numbered from 0). An Entry with null data is not
  /// shareable.
  void run_mapped_or_staged(uint64_t ticket, const Desc& desc, const std::vector<Entry>& mine,
                            size_t staged_steps, Clock::time_point deadline,
                            const StepFn& staged, const MappedFn& mapped);
  /// Reduces elements [first, end) of peers[r][block] over the ranks r in rank order, piece by
  /// piece through a buffer that stays in cache, and hands each piece to `write(at, piece,
  /// bytes)` (`at`: the piece's first element).
  using WriteFn = std::function<void(size_t at, const char* piece, size_t bytes)>;
  void reduce_pieces(const PeerBuffers& peers, size_t block, Dtype dtype, size_t first,
                     size_t end, const Reduction& r, const WriteFn& write) const;
  /// The allreduce (root < 0) or the reduce to root of one buffer per rank, each rank reducing
  /// its share from every rank's buffer and writing it into every rank's (root's).
  void mapped_reduce(const PeerBuffers& peers, Dtype dtype, size_t count, int root,
                     const Reduction& r) const;
  /// This rank's block of a reduce_scatter: out = the reduction of every rank's block rank_.
  void mapped_reduce_scatter(const PeerBuffers& peers, void* out, Dtype dtype, size_t count,
                             const Reduction& r) const;
  struct PeerMaps;
  static PeerMaps* new_peer_maps(int size);
  struct PeerMapsDeleter {
    void operator()(PeerMaps* m) const;
  };

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
  size_t single_copy_bytes_ = SIZE_MAX;
  size_t heavy_single_copy_bytes_ = SIZE_MAX;
  std::atomic<uint64_t> single_copies_{0};
  std::atomic<uint64_t> mapped_reductions_{0};
  std::unique_ptr<PeerMaps, PeerMapsDeleter> maps_;
  bool mapping_ = false;            // every rank can map every peer's shareable memory
  Tensor map_probe_;                 // this rank's probe region (probe_mapping)
};

/// The parts of a segment's file name in /dev/shm that say who made it:
/// "ember-[<tag>-]n<pid namespace>-<pid>-<nonce>" (segment_name() in shm_allreduce.cpp).
struct SegmentName {
  std::string pid_namespace;  // the inode number of the creator's PID namespace
  int pid = 0;                // the creator (a group's rank 0)
};
/// Nothing for a name of another form (not Ember's, or from before the namespace was in it).
std::optional<SegmentName> parse_segment_name(const std::string& file);
/// Unlinks the names in /dev/shm whose creator, a process of this PID namespace, has exited
/// (a rank 0 killed between creating its group's segment and every rank mapping it, outside
/// emberrun, which sweeps its own job's names at exit). A name from another PID namespace is
/// left alone: its pid means another process here. Returns how many names it unlinked.
int sweep_stale_segments();

}  // namespace ember::dist::detail
