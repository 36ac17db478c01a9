// Note [single-copy collectives]
// The staged collectives (Note [shared-memory collectives]) copy every byte into the segment and
// out again, and each step's copy out waits for its copy in. For large blocks the collectives
// that only move data (broadcast, allgather, gather, scatter, alltoall) instead copy straight
// from the peers' buffers into this rank's with Linux cross-memory attach (process_vm_readv:
// the kernel copies between the two address spaces, one copy per byte). Each is one step of
// run_steps:
//   Publish: a rank writes into its own slot a table of its buffers' addresses and sizes (in its
//     own address space), then raises arrive;
//   Combine (once every rank published, and the ranks agree on the collective): a rank reads the
//     tables and copies what it receives from the peers' buffers into its own;
//   the reduced wait: nobody returns, and so nobody reuses or frees a buffer, until every rank is
//     done reading the others'.
// Who reads what:
//   broadcast: each non-root reads root's buffer.
//   allgather, gather: each collecting rank reads every peer's input into its outputs (starting
//     at the next rank, so that the ranks' reads spread over different peers).
//   scatter: each non-root reads its block from root's inputs.
//   alltoall: rank j reads block j of every peer's inputs.
// A rank copies each byte it receives once instead of the sender copying it in and the receiver
// copying it out, and no slot size caps a step: one synchronisation per collective instead of
// two per chunk.
//
// The reductions (allreduce, reduce, reduce_scatter) stay staged. Cross-memory attach cannot
// let a rank reduce straight from its peer's pages: it copies them into this rank's memory
// first, so a reduction would make the same number of copies as the staged one (there the peer
// makes the copy into the slot, in parallel with this rank's), and it measured slower
// (docs/distributed_pg.md). Reading peers' buffers without a copy needs them mapped into this
// process, that is tensors allocated in shared memory.
//
// When: every rank must take the same path, so the choice depends only on the collective's
// description, which every rank checks at the first step (a rank that passed another count
// fails there on every rank, whichever path each took), and on single_copy_bytes(), which the
// ranks agree on when the group is made: each rank reads a word from every peer with
// process_vm_readv, and single copies are on only if every rank could read every peer and none
// turned them off (EMBER_GLOO_SHM_SINGLE_COPY=0); the threshold is the largest any rank asked
// for. Cross-memory attach needs the right to ptrace the peer: the same user, and under Yama's
// ptrace_scope=1 a peer that is a descendant or that allowed it (PR_SET_PTRACER). Ember does not
// relax that itself (PR_SET_PTRACER_ANY would let any process of the user read the rank's
// memory): where the kernel refuses, the group logs why and stays on the staged path. Ranks
// that are threads of one process read each other the same way (reading one's own process is
// always allowed).
//
// Failures read as on the staged path: a peer that died makes process_vm_readv fail with ESRCH,
// which names the rank and its pid; a rank waiting for a dead one names it from its pid as
// before; any failure aborts the group's other ranks through the abort word.
//
// Note [single copies when oversubscribed]
// Below 2 MiB blocks the staged path is as fast as single copies where every rank has a CPU of
// its own. Where the ranks outnumber the CPUs they may run on (4 ranks on 2 cores, the usual
// test and CI shape), each of a staged collective's steps ends in two waits that cost context
// switches, and the collectives whose staged path copies the most per rank lose most: a rank of
// an alltoall copies 2(n-1)+1 blocks staged (its n-1 outgoing ones in, the n-1 incoming ones
// out, its own) against n single copies, and scatter's root copies n-1 blocks in before any rank
// can copy one out. So on such a group, and only when no rank chose a threshold
// (EMBER_GLOO_SHM_SINGLE_COPY_BYTES, or create()'s argument), alltoall and scatter take single
// copies from kOversubscribedSingleCopyBytes per block. Allgather, gather and broadcast copy as
// many bytes per rank either way and measured slower with single copies from 4 KiB pages, so
// they keep the default threshold (docs/benchmarks.md has the study). "The CPUs they may run
// on" is the union of the ranks' affinity masks, exchanged with the agreement: ranks pinned to
// one CPU each are not oversubscribed, though each one's own mask holds a single CPU.
#include <ember/distributed/backends/detail/shm_allreduce.h>
#include <ember/distributed/errors.h>
#include <ember/tensor/detail/thread_count.h>
#include <ember/tensor/observe/log.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>

namespace ember::dist::detail {

namespace {

// The smallest block that takes single copies unless EMBER_GLOO_SHM_SINGLE_COPY_BYTES says. The
// kernel copies page by page after pinning the peer's pages: from 4 KiB pages far slower than
// memcpy, from transparent huge pages about as fast, and Ember's allocator advises huge pages for
// tensors from this size (a huge page: tensor/allocator.cpp); below it the staged path, whose
// slots stay in cache, is as fast where every rank has a CPU of its own.
constexpr size_t kDefaultSingleCopyBytes = size_t{2} << 20;
// What the ranks read from each other when the group is made, to learn whether they may.
constexpr uint64_t kProbeValue = 0x454d4252434d4121ULL;  // "EMBRCMA!"
volatile uint64_t probe_word = kProbeValue;

size_t parse_env(const char* name, size_t lo, size_t hi, const char* what) {
  const char* v = std::getenv(name);
  if (!v || !*v) return 0;
  char* end = nullptr;
  errno = 0;
  const unsigned long long x = std::strtoull(v, &end, 10);
  if (*v == '-' || errno != 0 || *end != '\0' || x < lo || x > hi) {
    throw ValueError(
        str_cat(name, "='", v, "' must be an integer in [", lo, ", ", hi, "] (", what, ")"));
  }
  return static_cast<size_t>(x);
}

const char* env_set(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

std::vector<iovec> iovecs(const std::vector<ShmAllreduce::Entry>& es) {
  std::vector<iovec> v;
  v.reserve(es.size());
  for (const auto& e : es) {
    if (e.bytes > 0) v.push_back({const_cast<void*>(e.data), e.bytes});
  }
  return v;
}

// Drops the first n bytes of v[i...], moving i past the iovecs that are used up.
void advance(std::vector<iovec>& v, size_t& i, size_t n) {
  while (n > 0 && i < v.size()) {
    const size_t take = std::min(n, v[i].iov_len);
    v[i].iov_base = static_cast<char*>(v[i].iov_base) + take;
    v[i].iov_len -= take;
    n -= take;
    if (v[i].iov_len == 0) ++i;
  }
}

void copy(void* dst, const void* src, size_t bytes) {
  if (dst != src && bytes > 0) std::memcpy(dst, src, bytes);
}

// Entry i of rank r's table; throws if r published fewer.
ShmAllreduce::Entry entry(const std::vector<std::vector<ShmAllreduce::Entry>>& tables, int r,
                          size_t i) {
  const auto& t = tables[static_cast<size_t>(r)];
  if (i >= t.size()) {
    throw std::runtime_error(str_cat("rank ", r, " published ", t.size(), " buffers, fewer than ",
                                     i + 1, " (single copy)"));
  }
  return t[i];
}

}  // namespace

size_t ShmAllreduce::single_copy_bytes_from_env() {
  const size_t on = parse_env("EMBER_GLOO_SHM_SINGLE_COPY", 0, 1,
                              "1: large collectives copy straight between the ranks' buffers");
  if (env_set("EMBER_GLOO_SHM_SINGLE_COPY") && on == 0) return SIZE_MAX;
  const size_t bytes = parse_env("EMBER_GLOO_SHM_SINGLE_COPY_BYTES", 1, SIZE_MAX - 1,
                                 "the smallest block that takes single copies");
  return bytes > 0 ? bytes : kDefaultSingleCopyBytes;
}

bool ShmAllreduce::single_copy_bytes_is_default() {
  return env_set("EMBER_GLOO_SHM_SINGLE_COPY_BYTES") == nullptr;
}

void ShmAllreduce::agree_single_copy(Store& store, size_t wanted, bool automatic,
                                     Duration timeout) {
  store.set("ember_shm/probe/" + std::to_string(rank_),
            std::to_string(reinterpret_cast<uintptr_t>(&probe_word)));
  std::string why;
  for (int r = 0; r < size_ && wanted != SIZE_MAX; ++r) {
    const uintptr_t at =
        std::stoull(store.get_string("ember_shm/probe/" + std::to_string(r), timeout));
    uint64_t got = 0;
    iovec local{&got, sizeof(got)}, remote{reinterpret_cast<void*>(at), sizeof(got)};
    if (::process_vm_readv(pid_of(r), &local, 1, &remote, 1, 0) != sizeof(got) ||
        got != kProbeValue) {
      why = str_cat("reading rank ", r, " (pid ", pid_of(r),
                    ") failed: ", got == 0 ? std::strerror(errno) : "wrong value");
      wanted = SIZE_MAX;
    }
  }
  if (!why.empty()) {
    logging::info("[gloo] rank ", rank_, ": cross-memory attach is refused (", why,
                  "); the shared-memory collectives stage every byte through the segment");
  }
  // Whether this rank can map every peer's shareable memory (Note [mapped reductions]); every
  // rank publishes its probe, which stays open for the group's life, so no peer can miss it.
  const bool maps = probe_mapping(store, timeout) && wanted != SIZE_MAX;
  // "<bytes> map|nomap auto|fixed <affinity bits>", or "off".
  store.set("ember_shm/single/" + std::to_string(rank_),
            wanted == SIZE_MAX
                ? std::string("off")
                : str_cat(wanted, maps ? " map " : " nomap ", automatic ? "auto " : "fixed ",
                          ember::detail::affinity_mask()));
  size_t agreed = 0;
  bool all_map = true, all_auto = true;
  std::string cpus;  // the union of the ranks' affinity masks
  for (int r = 0; r < size_; ++r) {
    const std::string v = store.get_string("ember_shm/single/" + std::to_string(r), timeout);
    if (v == "off") {
      agreed = SIZE_MAX;
      break;
    }
    std::istringstream in(v);
    size_t bytes = 0;
    std::string map, mode, bits;
    in >> bytes >> map >> mode >> bits;
    agreed = std::max(agreed, bytes);
    all_map = all_map && map == "map";
    all_auto = all_auto && mode == "auto" && !bits.empty();
    if (bits.size() > cpus.size()) cpus.resize(bits.size(), '0');
    for (size_t c = 0; c < bits.size(); ++c) {
      if (bits[c] == '1') cpus[c] = '1';
    }
  }
  single_copy_bytes_ = agreed;
  const auto usable = std::count(cpus.begin(), cpus.end(), '1');
  heavy_single_copy_bytes_ = all_auto && agreed != SIZE_MAX && size_ > usable
                                 ? std::min(agreed, kOversubscribedSingleCopyBytes)
                                 : agreed;
  mapping_ = agreed != SIZE_MAX && all_map;
}

bool ShmAllreduce::single_copy(size_t bytes, bool heavy) {
  if (bytes == 0 || bytes < (heavy ? heavy_single_copy_bytes_ : single_copy_bytes_)) return false;
  single_copies_.fetch_add(1);
  return true;
}

void ShmAllreduce::peer_read(int r, const std::vector<Entry>& local,
                             const std::vector<Entry>& remote, const char* kind) {
  if (local.size() == 1 && remote.size() == 1 && remote[0].region != nullptr) {
    // A shareable peer buffer: a plain copy from its mapping (Note [mapped reductions]), which
    // unlike cross-memory attach does not pin the peer's 4 KiB pages one by one.
    if (remote[0].bytes < local[0].bytes) {
      throw std::runtime_error(str_cat("rank ", r, " published fewer bytes than this rank reads in "
                                       "the shared-memory ", kind, " (single copy)"));
    }
    auto [src, keep] = mapped_pointer(r, remote[0].region);
    copy(const_cast<void*>(local[0].data), src, local[0].bytes);
    return;
  }
  std::vector<iovec> l = iovecs(local), m = iovecs(remote);
  size_t li = 0, mi = 0;
  const int pid = pid_of(r);
  while (li < l.size() && mi < m.size()) {
    const auto ln = static_cast<unsigned long>(std::min<size_t>(IOV_MAX, l.size() - li));
    const auto mn = static_cast<unsigned long>(std::min<size_t>(IOV_MAX, m.size() - mi));
    const ssize_t done = ::process_vm_readv(pid, &l[li], ln, &m[mi], mn, 0);
    if (done < 0 && errno == EINTR) continue;
    if (done <= 0) {
      const int e = done < 0 ? errno : EFAULT;
      if (e == ESRCH) {
        throw std::runtime_error(str_cat("rank ", r, " (pid ", pid, ") exited while this rank ",
                                         "read its part of the shared-memory ", kind,
                                         " (single copy)"));
      }
      throw std::runtime_error(str_cat("cross-memory attach to rank ", r, " (pid ", pid,
                                       ") failed in the shared-memory ", kind, ": ",
                                       std::strerror(e),
                                       " (EMBER_GLOO_SHM_SINGLE_COPY=0 "
                                       "stages every byte through the segment instead)"));
    }
    advance(l, li, static_cast<size_t>(done));
    advance(m, mi, static_cast<size_t>(done));
  }
  if (li < l.size()) {
    throw std::runtime_error(str_cat("rank ", r,
                                     " published fewer bytes than this rank reads in "
                                     "the shared-memory ",
                                     kind, " (single copy)"));
  }
}

void ShmAllreduce::run_direct(uint64_t ticket, const Desc& desc, const std::vector<Entry>& mine,
                              Clock::time_point deadline, const DirectFn& body) {
  check_table_fits(mine.size());
  run_steps(ticket, desc, 1, deadline, [&](Phase phase, size_t, const Area& area) {
    if (phase == Phase::Publish) {
      write_table(area.slot(rank_), mine);
    } else if (phase == Phase::Combine) {
      std::vector<std::vector<Entry>> tables(static_cast<size_t>(size_));
      for (int r = 0; r < size_; ++r) {
        const auto* w = reinterpret_cast<const uint64_t*>(area.slot(r));
        const uint64_t* entries = w + 2;
        const bool mappable = mapping_ && !in_this_process(r);
        if (mappable) drop_freed(r, w[1], entries, w[0]);
        auto& t = tables[static_cast<size_t>(r)];
        for (uint64_t i = 0; i < w[0]; ++i) {
          const uint64_t* e = entries + kEntryWords * i;
          t.push_back({reinterpret_cast<const void*>(e[5]), e[4],
                       mappable && e[0] != 0 ? e : nullptr});
        }
      }
      body(tables);
    }
  });
}

// ---- data movement ------------------------------------------------------------------------------

void ShmAllreduce::broadcast_direct(uint64_t ticket, void* data, size_t count, Dtype dtype,
                                    int root, Clock::time_point deadline) {
  const size_t bytes = count * static_cast<size_t>(itemsize(dtype));
  run_direct(ticket, Desc{Kind::Broadcast, dtype, count, ReduceOp::Sum, root}, {{data, bytes}},
             deadline, [&](const std::vector<std::vector<Entry>>& tables) {
               if (rank_ != root) {
                 peer_read(root, {{data, bytes}}, tables[static_cast<size_t>(root)], "broadcast");
               }
             });
}

void ShmAllreduce::gather_direct(uint64_t ticket, const void* in, const std::vector<void*>& outs,
                                 size_t count, Dtype dtype, int root, Clock::time_point deadline) {
  const size_t bytes = count * static_cast<size_t>(itemsize(dtype));
  const Kind kind = root < 0 ? Kind::Allgather : Kind::Gather;
  const bool collects = root < 0 || root == rank_;
  run_direct(ticket, Desc{kind, dtype, count, ReduceOp::Sum, root}, {{in, bytes}}, deadline,
             [&](const std::vector<std::vector<Entry>>& tables) {
               if (!collects) return;
               // Starting at the next rank spreads the ranks' reads over different peers.
               for (int i = 0; i < size_; ++i) {
                 const int r = (rank_ + i) % size_;
                 const auto R = static_cast<size_t>(r);
                 if (r == rank_) {
                   copy(outs[R], in, bytes);
                 } else {
                   peer_read(r, {{outs[R], bytes}}, tables[R], root < 0 ? "allgather" : "gather");
                 }
               }
             });
}

void ShmAllreduce::scatter_direct(uint64_t ticket, const std::vector<const void*>& ins, void* out,
                                  size_t count, Dtype dtype, int root, Clock::time_point deadline) {
  const size_t bytes = count * static_cast<size_t>(itemsize(dtype));
  std::vector<Entry> mine;
  for (const void* p : ins) mine.push_back({p, bytes});
  run_direct(ticket, Desc{Kind::Scatter, dtype, count, ReduceOp::Sum, root}, mine, deadline,
             [&](const std::vector<std::vector<Entry>>& tables) {
               const auto me = static_cast<size_t>(rank_);
               if (rank_ == root) {
                 copy(out, ins[me], bytes);
               } else {
                 peer_read(root, {{out, bytes}}, {entry(tables, root, me)}, "scatter");
               }
             });
}

void ShmAllreduce::alltoall_direct(uint64_t ticket, const std::vector<const void*>& ins,
                                   const std::vector<void*>& outs, size_t count, Dtype dtype,
                                   Clock::time_point deadline) {
  const size_t bytes = count * static_cast<size_t>(itemsize(dtype));
  std::vector<Entry> mine;
  for (const void* p : ins) mine.push_back({p, bytes});
  run_direct(ticket, Desc{Kind::Alltoall, dtype, count, ReduceOp::Sum, -1}, mine, deadline,
             [&](const std::vector<std::vector<Entry>>& tables) {
               const auto me = static_cast<size_t>(rank_);
               for (int i = 0; i < size_; ++i) {
                 const int j = (rank_ + i) % size_;
                 const auto J = static_cast<size_t>(j);
                 if (j == rank_) {
                   copy(outs[J], ins[J], bytes);
                 } else {
                   peer_read(j, {{outs[J], bytes}}, {entry(tables, j, me)}, "alltoall");
                 }
               }
             });
}

}  // namespace ember::dist::detail
