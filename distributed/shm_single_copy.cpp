// Note [single-copy collectives]
// The staged collectives (Note [shared-memory collectives]) copy every byte into the segment and
// out again. For large blocks a rank instead copies straight between its buffer and its peers'
// with Linux cross-memory attach (process_vm_readv / process_vm_writev: the kernel copies
// between the two address spaces, one copy per byte). Each such collective is one step of
// run_steps:
//   Publish: a rank writes into its own slot a table of its buffers' addresses and sizes (in its
//     own address space), then raises arrive;
//   Combine (once every rank published, and the ranks agree on the collective): a rank reads the
//     tables and moves the data it is responsible for;
//   the reduced wait: nobody returns, and so nobody reuses or frees a buffer, until every rank is
//     done with the others' buffers.
// Who moves what:
//   broadcast: each non-root reads root's buffer into its own.
//   allgather, gather: each collecting rank reads every peer's input into its outputs.
//   scatter: each non-root reads its block from root's inputs.
//   alltoall: rank j reads block j of every peer's inputs.
//   reduce_scatter: rank r reads block r of every peer in pieces that stay in cache, reduces
//     them with its own block in rank order and writes its output.
//   allreduce, reduce: rank r reduces share r (1/size of the buffer) the same way, then writes the
//     reduced piece into its own buffer and into every peer's (reduce: into root's only). Share r
//     of every buffer is read and written by rank r alone, so no rank's writes race another's
//     reads, and each element is reduced once, by one rank, in rank order: bitwise the same
//     result everywhere, as on the staged path.
// A rank moves each byte once instead of twice (a reduction reads its peers' share once and
// writes the result once per rank), and no slot size caps a step, so there is one
// synchronisation per collective instead of two per chunk.
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
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include <ember/distributed/detail/shm_allreduce.h>
#include <ember/distributed/detail/shm_segments.h>
#include <ember/distributed/errors.h>
#include <ember/tensor/log.h>

namespace ember::detail {

namespace {

// The smallest block that takes single copies unless EMBER_GLOO_SHM_SINGLE_COPY_BYTES says:
// below it the system calls and page pinning cost more than the staged copies they save.
constexpr size_t kDefaultSingleCopyBytes = size_t{256} << 10;
// A reduction reads its peers' parts in pieces of this many bytes per rank, so that a piece is
// still in cache when it is reduced and written out.
constexpr size_t kPieceBytes = size_t{128} << 10;
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
    throw ValueError(str_cat(name, "='", v, "' must be an integer in [", lo, ", ", hi, "] (",
                             what, ")"));
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

const void* offset(const void* p, size_t bytes) { return static_cast<const char*>(p) + bytes; }
void* offset(void* p, size_t bytes) { return static_cast<char*>(p) + bytes; }

void copy(void* dst, const void* src, size_t bytes) {
  if (dst != src && bytes > 0) std::memcpy(dst, src, bytes);
}

// The entries of rank r's table within elements [a, b) of its buffers taken as one.
std::vector<ShmAllreduce::Entry> entries_in(const Segments& s, size_t a, size_t b, size_t elem) {
  std::vector<ShmAllreduce::Entry> v;
  s.for_each(a, b, [&](char* p, size_t, size_t n) { v.push_back({p, n * elem}); });
  return v;
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

void ShmAllreduce::agree_single_copy(Store& store, size_t wanted, Duration timeout) {
  store.set("ember_shm/probe/" + std::to_string(rank_),
            std::to_string(reinterpret_cast<uintptr_t>(&probe_word)));
  std::string why;
  for (int r = 0; r < size_ && wanted != SIZE_MAX; ++r) {
    const uintptr_t at = std::stoull(store.get_string("ember_shm/probe/" + std::to_string(r),
                                                      timeout));
    uint64_t got = 0;
    iovec local{&got, sizeof(got)}, remote{reinterpret_cast<void*>(at), sizeof(got)};
    if (::process_vm_readv(pid_of(r), &local, 1, &remote, 1, 0) != sizeof(got) ||
        got != kProbeValue) {
      why = str_cat("reading rank ", r, " (pid ", pid_of(r), ") failed: ",
                    got == 0 ? std::strerror(errno) : "wrong value");
      wanted = SIZE_MAX;
    }
  }
  if (!why.empty()) {
    logging::info("[gloo] rank ", rank_, ": cross-memory attach is refused (", why,
                  "); the shared-memory collectives stage every byte through the segment");
  }
  store.set("ember_shm/single/" + std::to_string(rank_),
            wanted == SIZE_MAX ? std::string("off") : std::to_string(wanted));
  size_t agreed = 0;
  for (int r = 0; r < size_; ++r) {
    const std::string v = store.get_string("ember_shm/single/" + std::to_string(r), timeout);
    agreed = v == "off" ? SIZE_MAX : std::max<size_t>(agreed, std::stoull(v));
    if (agreed == SIZE_MAX) break;
  }
  single_copy_bytes_ = agreed;
}

bool ShmAllreduce::single_copy(size_t bytes) {
  if (bytes == 0 || bytes < single_copy_bytes_) return false;
  single_copies_.fetch_add(1);
  return true;
}

void ShmAllreduce::peer_copy(int r, const std::vector<Entry>& local,
                             const std::vector<Entry>& remote, bool write,
                             const char* kind) const {
  std::vector<iovec> l = iovecs(local), m = iovecs(remote);
  size_t li = 0, mi = 0;
  const int pid = pid_of(r);
  while (li < l.size() && mi < m.size()) {
    const auto ln = static_cast<unsigned long>(std::min<size_t>(IOV_MAX, l.size() - li));
    const auto mn = static_cast<unsigned long>(std::min<size_t>(IOV_MAX, m.size() - mi));
    const ssize_t done = write ? ::process_vm_writev(pid, &l[li], ln, &m[mi], mn, 0)
                               : ::process_vm_readv(pid, &l[li], ln, &m[mi], mn, 0);
    if (done < 0 && errno == EINTR) continue;
    if (done <= 0) {
      const int e = done < 0 ? errno : EFAULT;
      if (e == ESRCH) {
        throw std::runtime_error(str_cat("rank ", r, " (pid ", pid, ") exited while this rank ",
                                         write ? "wrote its part of" : "read its part of",
                                         " the shared-memory ", kind, " (single copy)"));
      }
      throw std::runtime_error(str_cat("cross-memory attach to rank ", r, " (pid ", pid,
                                       ") failed in the shared-memory ", kind, ": ",
                                       std::strerror(e), " (EMBER_GLOO_SHM_SINGLE_COPY=0 "
                                       "stages every byte through the segment instead)"));
    }
    advance(l, li, static_cast<size_t>(done));
    advance(m, mi, static_cast<size_t>(done));
  }
}

void ShmAllreduce::run_direct(uint64_t ticket, const Desc& desc, const std::vector<Entry>& mine,
                              Clock::time_point deadline, const DirectFn& body) {
  // The slot holds a count, then an address and a size per entry.
  if (2 * mine.size() + 1 > chunk_ / sizeof(uint64_t)) {
    throw std::invalid_argument(str_cat("shared-memory collectives: ", mine.size(),
                                        " buffers do not fit a slot of ", chunk_, " bytes"));
  }
  run_steps(ticket, desc, 1, deadline, [&](Phase phase, size_t, const Area& area) {
    if (phase == Phase::Publish) {
      auto* w = reinterpret_cast<uint64_t*>(area.slot(rank_));
      w[0] = mine.size();
      for (size_t i = 0; i < mine.size(); ++i) {
        w[1 + 2 * i] = reinterpret_cast<uintptr_t>(mine[i].data);
        w[2 + 2 * i] = mine[i].bytes;
      }
    } else if (phase == Phase::Combine) {
      std::vector<std::vector<Entry>> tables(static_cast<size_t>(size_));
      for (int r = 0; r < size_; ++r) {
        const auto* w = reinterpret_cast<const uint64_t*>(area.slot(r));
        auto& t = tables[static_cast<size_t>(r)];
        for (uint64_t i = 0; i < w[0]; ++i) {
          t.push_back({reinterpret_cast<const void*>(w[1 + 2 * i]), w[2 + 2 * i]});
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
                 peer_copy(root, {{data, bytes}}, tables[static_cast<size_t>(root)], false,
                           "broadcast");
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
                   peer_copy(r, {{outs[R], bytes}}, tables[R], false,
                             root < 0 ? "allgather" : "gather");
                 }
               }
             });
}

void ShmAllreduce::scatter_direct(uint64_t ticket, const std::vector<const void*>& ins, void* out,
                                  size_t count, Dtype dtype, int root,
                                  Clock::time_point deadline) {
  const size_t bytes = count * static_cast<size_t>(itemsize(dtype));
  std::vector<Entry> mine;
  for (const void* p : ins) mine.push_back({p, bytes});
  run_direct(ticket, Desc{Kind::Scatter, dtype, count, ReduceOp::Sum, root}, mine, deadline,
             [&](const std::vector<std::vector<Entry>>& tables) {
               const auto me = static_cast<size_t>(rank_);
               if (rank_ == root) {
                 copy(out, ins[me], bytes);
               } else {
                 peer_copy(root, {{out, bytes}}, {tables[static_cast<size_t>(root)][me]}, false,
                           "scatter");
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
                   peer_copy(j, {{outs[J], bytes}}, {tables[J][me]}, false, "alltoall");
                 }
               }
             });
}

// ---- reductions ---------------------------------------------------------------------------------

// Piece r of the channel's scratch, `pieces` pieces of kPieceBytes: one per peer for what it
// read from that peer, and this rank's for the reduced piece.
namespace {
char* scratch_piece(std::vector<char>& scratch, int pieces, int r) {
  const size_t need = kPieceBytes * static_cast<size_t>(pieces);
  if (scratch.size() < need) scratch.resize(need);
  return scratch.data() + kPieceBytes * static_cast<size_t>(r);
}
}  // namespace

void ShmAllreduce::reduce_scatter_direct(uint64_t ticket, const std::vector<const void*>& blocks,
                                         void* out, size_t count, Dtype dtype,
                                         const Reduction& red, Clock::time_point deadline) {
  const size_t elem = static_cast<size_t>(itemsize(dtype));
  const size_t per = kPieceBytes / elem;
  std::vector<char>& scratch = scratch_[ticket % static_cast<size_t>(channels_)];
  std::vector<Entry> mine;
  for (const void* p : blocks) mine.push_back({p, count * elem});
  std::vector<const void*> srcs(static_cast<size_t>(size_));
  const auto me = static_cast<size_t>(rank_);
  run_direct(ticket, Desc{Kind::ReduceScatter, dtype, count, red.op, -1}, mine, deadline,
             [&](const std::vector<std::vector<Entry>>& tables) {
               for (size_t first = 0; first < count; first += per) {
                 const size_t n = std::min(per, count - first);
                 for (int r = 0; r < size_; ++r) {
                   const auto R = static_cast<size_t>(r);
                   if (r == rank_) {
                     srcs[R] = offset(blocks[me], first * elem);
                     continue;
                   }
                   char* p = scratch_piece(scratch, size_, r);
                   peer_copy(r, {{p, n * elem}}, {{offset(tables[R][me].data, first * elem),
                                                    n * elem}},
                             false, "reduce_scatter");
                   srcs[R] = p;
                 }
                 // Through scratch: out may be blocks[rank] itself, still a source.
                 char* reduced = scratch_piece(scratch, size_, rank_);
                 combine(reduced, srcs, n, red);
                 std::memcpy(offset(out, first * elem), reduced, n * elem);
               }
             });
}

void ShmAllreduce::reduce_spans_direct(uint64_t ticket, const std::vector<Span>& spans,
                                       const Desc& desc, const Reduction& red,
                                       Clock::time_point deadline) {
  const size_t elem = static_cast<size_t>(itemsize(desc.dtype));
  const size_t per = kPieceBytes / elem;
  const Segments data(spans, elem);
  const size_t count = data.count();
  if (2 * spans.size() + 1 > chunk_ / sizeof(uint64_t)) {
    // More buffers than a slot's table holds: packed into one and back, so that this rank
    // still takes the path that every rank takes.
    std::vector<char> packed(count * elem);
    data.for_each(0, count, [&](char* p, size_t pos, size_t n) {
      std::memcpy(packed.data() + pos * elem, p, n * elem);
    });
    reduce_spans_direct(ticket, {Span{packed.data(), count}}, desc, red, deadline);
    data.for_each(0, count, [&](char* p, size_t pos, size_t n) {
      std::memcpy(p, packed.data() + pos * elem, n * elem);
    });
    return;
  }
  const char* kind = desc.root < 0 ? "allreduce" : "reduce";
  std::vector<char>& scratch = scratch_[ticket % static_cast<size_t>(channels_)];
  std::vector<Entry> mine;
  for (const Span& s : spans) mine.push_back({s.data, s.count * elem});
  const bool keep = desc.root < 0 || desc.root == rank_;
  std::vector<const void*> srcs(static_cast<size_t>(size_));
  run_direct(ticket, desc, mine, deadline, [&](const std::vector<std::vector<Entry>>& tables) {
    // Every rank's buffers, as spans of its own address space.
    std::vector<std::vector<Span>> their(static_cast<size_t>(size_));
    for (int r = 0; r < size_; ++r) {
      for (const Entry& e : tables[static_cast<size_t>(r)]) {
        their[static_cast<size_t>(r)].push_back({const_cast<void*>(e.data), e.bytes / elem});
      }
    }
    std::vector<Segments> peers;
    peers.reserve(their.size());
    for (const auto& t : their) peers.emplace_back(t, elem);
    const size_t a = count * static_cast<size_t>(rank_) / static_cast<size_t>(size_);
    const size_t b = count * static_cast<size_t>(rank_ + 1) / static_cast<size_t>(size_);
    char* reduced = scratch_piece(scratch, size_, rank_);
    for (size_t first = a; first < b; first += per) {
      const size_t last = std::min(b, first + per);
      for (int r = 0; r < size_; ++r) {
        if (r == rank_) continue;
        peer_copy(r, {{scratch_piece(scratch, size_, r), (last - first) * elem}},
                  entries_in(peers[static_cast<size_t>(r)], first, last, elem), false, kind);
      }
      data.for_each(first, last, [&](char* own, size_t pos, size_t n) {
        for (int r = 0; r < size_; ++r) {
          srcs[static_cast<size_t>(r)] =
              r == rank_ ? own : scratch_piece(scratch, size_, r) + (pos - first) * elem;
        }
        combine(reduced + (pos - first) * elem, srcs, n, red);
        if (keep) std::memcpy(own, reduced + (pos - first) * elem, n * elem);
      });
      for (int r = 0; r < size_; ++r) {
        if (r == rank_ || (desc.root >= 0 && r != desc.root)) continue;
        peer_copy(r, {{reduced, (last - first) * elem}},
                  entries_in(peers[static_cast<size_t>(r)], first, last, elem), true, kind);
      }
    }
  });
}

}  // namespace ember::detail
