// Note [mapped reductions]
// A staged reduction (Note [shared-memory allreduce]) moves each rank's buffer about three times:
// into the slots, through the reduction into the result buffer, out again. Cross-memory attach
// cannot help (Note [single-copy collectives]): the kernel must copy a peer's value into this
// process before it can be added. When the buffers themselves are shared memory (tensors from
// dist::empty_shareable(), each a memfd), a rank maps its peers' buffers and reduces straight
// from them:
//   allreduce: rank r takes its share of the elements (1/size of them), reads that share from
//     every rank's buffer in rank order, reduces it piece by piece into a small buffer that
//     stays in its cache, and writes each piece into every rank's buffer (its own included);
//   reduce: the same, writing only into root's buffer (the others' are left as they were);
//   reduce_scatter: rank r reduces block r of every rank's input into its output.
// Each rank reads its share once from every buffer and writes it once into every buffer: for 2
// ranks, one memcpy's bytes per rank in all. Each share is still reduced by one rank in rank
// order, so every rank gets bitwise what the staged path gives. Reading and writing a piece
// through the cache-resident buffer also makes an output that is one of the inputs (in place)
// safe.
//
// When: the ranks must agree, and whether a buffer is shareable is known only to its own rank.
// Opening a peer's memfd through /proc needs the right to ptrace it, as cross-memory attach
// does, but checked against this rank's effective capabilities: so when the group is made
// (agree_single_copy) each rank also publishes a one-page probe region and maps every peer's,
// and mapping is on only if single copies are and every rank could. On such a group a reduction
// of at least kMappedMinBytes per rank spends its step 0 on the question: each rank publishes in its slot, per buffer,
// the region's number, its memfd, size and the buffer's offset (or "not shareable"); after the
// arrive wait every rank reads every table and, if all are shareable, maps what it lacks and
// reduces (Combine of step 0); the reduced wait is then the end: no rank returns, and so
// reuses its buffer, before every rank has written every share. Otherwise the staged steps
// follow as steps 1.., having cost one extra synchronisation.
//
// Mapping: a peer's memfd is opened through /proc/<pid>/fd/<fd> (checked to be the region it
// named, by its memfd name and size), mapped whole, and cached by (rank, region): a region is
// mapped once, not per collective (the first touch of each page is a fault). A mapping keeps
// the region's memory alive after its owner freed it, so each table also carries the owner's
// count of freed regions: when it has moved, the peer drops every mapping of that owner that
// the collective does not use (after DDP rebuilds its buckets, say, the old ones go at the next
// reduction, and the live ones are mapped again once). The cache also keeps at most
// kMapsPerPeer regions per peer, dropping the least recently used; a region that a concurrent
// collective still uses stays mapped until it is done. A rank's own buffers, and
// those of ranks that are threads of this process, are used where they lie. Failures read as
// elsewhere: a rank that cannot map a peer's buffer though the probe worked (the peer changed
// its credentials since, or this process ran out of file descriptors) fails the collective
// naming the peer, and the abort word fails the others at once.
#include <ember/distributed/backends/detail/shareable.h>
#include <ember/distributed/backends/detail/shm_allreduce.h>
#include <ember/distributed/backends/shareable.h>
#include <ember/distributed/errors.h>
#include <ember/tensor/observe/log.h>
#include <ember/tensor/tensor.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>

namespace ember::dist::detail {

namespace {

// The regions of one peer that stay mapped here.
constexpr size_t kMapsPerPeer = 256;
// The piece that one reduction step keeps in this core's cache.
constexpr size_t kPieceBytes = size_t{32} << 10;

struct Mapped {
  void* base = MAP_FAILED;
  size_t bytes = 0;
  ~Mapped() {
    if (base != MAP_FAILED) ::munmap(base, bytes);
  }
};

// memcpy with non-temporal stores where the target has them (x86-64), for a destination that is
// not in cache; stream_fence() orders them before the rank's post.
void stream_copy(char* dst, const char* src, size_t bytes) {
#if defined(__SSE2__)
  size_t done = 0;
  while (done < bytes && (reinterpret_cast<uintptr_t>(dst + done) & 15) != 0) {
    dst[done] = src[done];
    ++done;
  }
  for (; done + 64 <= bytes; done += 64) {
    const auto* s = reinterpret_cast<const __m128i*>(src + done);
    auto* d = reinterpret_cast<__m128i*>(dst + done);
    const __m128i a = _mm_loadu_si128(s), b = _mm_loadu_si128(s + 1), c = _mm_loadu_si128(s + 2),
                  e = _mm_loadu_si128(s + 3);
    _mm_stream_si128(d, a);
    _mm_stream_si128(d + 1, b);
    _mm_stream_si128(d + 2, c);
    _mm_stream_si128(d + 3, e);
  }
  if (done < bytes) std::memcpy(dst + done, src + done, bytes - done);
#else
  std::memcpy(dst, src, bytes);
#endif
}

void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

std::string fd_path(int pid, int fd) {
  return "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
}

}  // namespace

struct ShmAllreduce::PeerMaps {
  std::mutex mu;
  // Per peer rank: region id -> mapping; `order` most recently used first.
  struct Peer {
    std::map<uint64_t, std::shared_ptr<Mapped>> regions;
    std::list<uint64_t> order;
    uint64_t frees_seen = 0;  // the peer's shareable_frees() when this rank last looked
  };
  std::vector<Peer> peers;
};

ShmAllreduce::PeerMaps* ShmAllreduce::new_peer_maps(int size) {
  auto* m = new PeerMaps;
  m->peers.resize(static_cast<size_t>(size));
  return m;
}

void ShmAllreduce::PeerMapsDeleter::operator()(PeerMaps* m) const { delete m; }

// Rank r has freed regions since this rank last looked (`frees` is its count): any cached one
// may be among them, and its memory stays alive as long as it is mapped here, so every mapping
// of r's that this collective does not use goes (those it uses are alive: r holds them).
void ShmAllreduce::drop_freed(int r, uint64_t frees, const uint64_t* entries, size_t n) {
  std::lock_guard<std::mutex> lock(maps_->mu);
  auto& peer = maps_->peers[static_cast<size_t>(r)];
  if (peer.frees_seen == frees) return;
  peer.frees_seen = frees;
  for (auto it = peer.regions.begin(); it != peer.regions.end();) {
    bool used = false;
    for (size_t i = 0; i < n && !used; ++i) used = entries[kEntryWords * i] == it->first;
    if (used) {
      ++it;
    } else {
      peer.order.remove(it->first);
      it = peer.regions.erase(it);
    }
  }
}

size_t ShmAllreduce::mapped_regions() const {
  std::lock_guard<std::mutex> lock(maps_->mu);
  size_t n = 0;
  for (const auto& p : maps_->peers) n += p.regions.size();
  return n;
}

bool ShmAllreduce::may_map(size_t bytes) const { return mapping_ && bytes >= kMappedMinBytes; }

namespace {

// Maps rank r's region (pid's memfd `fd`, named for `id`, `bytes` long).
std::shared_ptr<Mapped> map_region(int r, int pid, int fd, uint64_t id, size_t bytes) {
  const std::string path = fd_path(pid, fd);
  auto fail = [&](const std::string& why) {
    return std::runtime_error(str_cat("cannot map rank ", r, "'s shareable buffer (", path,
                                      "): ", why,
                                      " (EMBER_GLOO_SHM_SINGLE_COPY=0 stages every byte "
                                      "through the segment instead)"));
  };
  char link[256] = {};
  const ssize_t n = ::readlink(path.c_str(), link, sizeof(link) - 1);
  const std::string want = "/memfd:" + shareable_name(id);
  const std::string got(link, n > 0 ? static_cast<size_t>(n) : 0);
  if (n < 0) throw fail(std::strerror(errno));
  if (got.compare(0, want.size(), want) != 0 ||
      (got.size() > want.size() && got[want.size()] != ' ')) {
    throw fail("it is " + got + ", not " + want);
  }
  const int local = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (local < 0) throw fail(std::strerror(errno));
  struct stat st {};
  auto m = std::make_shared<Mapped>();
  if (::fstat(local, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
    ::close(local);
    throw fail(str_cat("its size is ", st.st_size, ", not ", bytes));
  }
  // Populated now: the reduction would otherwise fault on each page of it.
  m->base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, local, 0);
  const int e = errno;
  ::close(local);
  if (m->base == MAP_FAILED) throw fail(std::string("mmap: ") + std::strerror(e));
  m->bytes = bytes;
  return m;
}

}  // namespace

bool ShmAllreduce::probe_mapping(Store& store, Duration timeout) {
  // Every rank publishes its probe (or "none"), so no peer waits in vain.
  std::string offer = "none";
  bool ok = true;
  try {
    map_probe_ = dist::empty_shareable({1}, kUInt8);
    const auto ref = find_shareable(map_probe_.data_ptr(), 1);
    offer = str_cat(ref->id, " ", ref->fd, " ", ref->region_bytes);
  } catch (const std::exception& e) {
    logging::info("[gloo] rank ", rank_, ": ", e.what(),
                  "; reductions over shareable tensors stay staged");
    ok = false;
  }
  store.set("ember_shm/map/" + std::to_string(rank_), offer);
  for (int r = 0; r < size_; ++r) {
    const std::string theirs = store.get_string("ember_shm/map/" + std::to_string(r), timeout);
    if (in_this_process(r) || !ok) continue;
    std::istringstream in(theirs);
    uint64_t id = 0, bytes = 0;
    int fd = -1;
    if (!(in >> id >> fd >> bytes)) {  // "none": that rank logs why
      ok = false;
      continue;
    }
    try {
      map_region(r, pid_of(r), fd, id, static_cast<size_t>(bytes));
    } catch (const std::exception& e) {
      logging::info("[gloo] rank ", rank_, ": ", e.what(),
                    "; reductions over shareable tensors stay staged");
      ok = false;
    }
  }
  return ok;
}

void ShmAllreduce::check_table_fits(size_t entries) const {
  if (2 + kEntryWords * entries > chunk_ / sizeof(uint64_t)) {
    throw std::invalid_argument(str_cat("shared-memory collectives: ", entries,
                                        " buffers do not fit a slot of ", chunk_, " bytes"));
  }
}

void ShmAllreduce::write_table(char* slot, const std::vector<Entry>& mine) const {
  auto* w = reinterpret_cast<uint64_t*>(slot);
  w[0] = mine.size();
  w[1] = shareable_frees();
  for (size_t i = 0; i < mine.size(); ++i) {
    uint64_t* e = w + 2 + kEntryWords * i;
    const auto ref = mine[i].data ? find_shareable(mine[i].data, mine[i].bytes)
                                  : std::optional<ShareableRef>();
    e[0] = ref ? ref->id : 0;
    e[1] = ref ? static_cast<uint64_t>(ref->fd) : 0;
    e[2] = ref ? ref->region_bytes : 0;
    e[3] = ref ? ref->offset : 0;
    e[4] = mine[i].bytes;
    e[5] = reinterpret_cast<uintptr_t>(mine[i].data);
  }
}

std::pair<char*, std::shared_ptr<void>> ShmAllreduce::mapped_pointer(int r, const uint64_t* e) {
  std::shared_ptr<Mapped> m;
  {
    std::lock_guard<std::mutex> lock(maps_->mu);
    auto& peer = maps_->peers[static_cast<size_t>(r)];
    auto it = peer.regions.find(e[0]);
    if (it != peer.regions.end()) {
      m = it->second;
      peer.order.remove(e[0]);
    }
    if (!m) {
      try {
        m = map_region(r, pid_of(r), static_cast<int>(e[1]), e[0], e[2]);
      } catch (const std::exception&) {
        throw_if_aborted();  // the peer gave up and let its buffer go: say why
        throw;
      }
      peer.regions[e[0]] = m;
      while (peer.regions.size() > kMapsPerPeer) {
        peer.regions.erase(peer.order.back());
        peer.order.pop_back();
      }
    }
    peer.order.push_front(e[0]);
  }
  if (e[3] > m->bytes || e[4] > m->bytes - e[3]) {
    throw std::runtime_error(str_cat("rank ", r, " published a buffer outside its region (",
                                     e[3], " + ", e[4], " bytes of ", m->bytes, ")"));
  }
  char* p = static_cast<char*>(m->base) + e[3];
  return {p, std::move(m)};
}

void ShmAllreduce::run_mapped_or_staged(uint64_t ticket, const Desc& desc,
                                        const std::vector<Entry>& mine, size_t staged_steps,
                                        Clock::time_point deadline, const StepFn& staged,
                                        const MappedFn& mapped) {
  check_table_fits(mine.size());
  size_t steps = 1 + staged_steps;
  // Mappings in use by this collective: a concurrent one's eviction cannot unmap them.
  std::vector<std::shared_ptr<void>> held;
  run_steps_until(ticket, desc, steps, deadline, [&](Phase phase, size_t k, const Area& area) {
    if (k > 0) return staged(phase, k - 1, area);
    if (phase == Phase::Publish) return write_table(area.slot(rank_), mine);
    if (phase != Phase::Combine) return;
    for (int r = 0; r < size_; ++r) {
      const auto* w = reinterpret_cast<const uint64_t*>(area.slot(r));
      if (w[0] != mine.size()) {
        throw std::runtime_error(str_cat("rank ", r, " published ", w[0], " buffers, this rank ",
                                         mine.size(), " (shared-memory reduction)"));
      }
      for (size_t i = 0; i < mine.size(); ++i) {
        if (w[2 + kEntryWords * i] == 0) return;  // not shareable: the staged steps follow
      }
    }
    PeerBuffers peers(static_cast<size_t>(size_));
    for (int r = 0; r < size_; ++r) {
      const auto* w = reinterpret_cast<const uint64_t*>(area.slot(r));
      const bool here = in_this_process(r);  // its buffers are used where they lie
      if (!here) drop_freed(r, w[1], w + 2, mine.size());
      for (size_t i = 0; i < mine.size(); ++i) {
        const uint64_t* e = w + 2 + kEntryWords * i;
        if (here) {
          peers[static_cast<size_t>(r)].push_back(reinterpret_cast<char*>(e[5]));
          continue;
        }
        auto [p, m] = mapped_pointer(r, e);
        peers[static_cast<size_t>(r)].push_back(p);
        held.push_back(std::move(m));
      }
    }
    mapped(peers);
    mapped_reductions_.fetch_add(1);
    steps = 1;
  });
}

void ShmAllreduce::reduce_pieces(const PeerBuffers& peers, size_t block, Dtype dtype,
                                 size_t first, size_t end, const Reduction& red,
                                 const WriteFn& write) const {
  const size_t elem = static_cast<size_t>(itemsize(dtype));
  const size_t per = std::max<size_t>(1, kPieceBytes / elem);
  std::unique_ptr<char[]> piece(new char[per * elem]);
  std::vector<const void*> srcs(static_cast<size_t>(size_));
  for (size_t a = first; a < end; a += per) {
    const size_t n = std::min(per, end - a);
    for (size_t r = 0; r < srcs.size(); ++r) srcs[r] = peers[r][block] + a * elem;
    combine(piece.get(), srcs, n, red);
    write(a, piece.get(), n * elem);
  }
}

void ShmAllreduce::mapped_reduce(const PeerBuffers& peers, Dtype dtype, size_t count, int root,
                                 const Reduction& red) const {
  const size_t elem = static_cast<size_t>(itemsize(dtype));
  const auto share = [&](int r) { return count * static_cast<size_t>(r) / static_cast<size_t>(size_); };
  reduce_pieces(peers, 0, dtype, share(rank_), share(rank_ + 1), red,
                [&](size_t a, const char* piece, size_t bytes) {
                  if (root >= 0) {
                    std::memcpy(peers[static_cast<size_t>(root)][0] + a * elem, piece, bytes);
                    return;
                  }
                  for (int i = 0; i < size_; ++i) {  // from the next rank: the ranks write
                    const auto r = static_cast<size_t>((rank_ + 1 + i) % size_);  // different peers
                    std::memcpy(peers[r][0] + a * elem, piece, bytes);
                  }
                });
}

void ShmAllreduce::mapped_reduce_scatter(const PeerBuffers& peers, void* out, Dtype dtype,
                                         size_t count, const Reduction& red) const {
  const size_t elem = static_cast<size_t>(itemsize(dtype));
  const auto me = static_cast<size_t>(rank_);
  // An output that is not this rank's own block was not just read, so its lines are not in
  // this core's cache: streaming stores skip reading them in before they are overwritten.
  const bool stream = out != peers[me][me];
  reduce_pieces(peers, me, dtype, 0, count, red, [&](size_t a, const char* piece, size_t bytes) {
    char* dst = static_cast<char*>(out) + a * elem;
    if (stream) {
      stream_copy(dst, piece, bytes);
    } else {
      std::memcpy(dst, piece, bytes);
    }
  });
  if (stream) stream_fence();
}

}  // namespace ember::dist::detail
