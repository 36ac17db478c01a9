// Note [shared-memory allreduce]
// Ranks on one machine need not talk through loopback TCP: Gloo's transport copies every byte
// from user space into the kernel and out again, with a system call per message. When every
// rank of a gloo group runs on this machine, allreduce instead goes through one shared-memory
// segment (torch's gloo backend has no such path: its ranks on one host still exchange over
// TCP).
//
// Layout: a header page (magic, nonce, the ranks' pids, the abort word), then one channel per
// worker thread, each with a control page (a doorbell, a waiter count, and per rank a 64-byte
// line with its two progress counters and its call's kind, element count, dtype, op and root)
// and size + 1 buffers of `chunk` bytes: one slot per rank and one result.
//
// A buffer moves in chunks. For each chunk, every rank r:
//   1. copies the parts of its chunk that the other ranks will reduce into its slot (its own
//      share stays in its buffer), then raises arrive[r] to the step number;
//   2. waits until every arrive[] has reached the step, then reduces its share (1/size of the
//      chunk) over the ranks in rank order 0..size-1, reading its own part from its buffer
//      and the others' from their slots, into the result buffer; raises reduced[r];
//   3. waits until every reduced[] has reached the step, and copies the other ranks' reduced
//      shares into its buffer (its own went there in step 2, straight from its cache).
// Each share is reduced by one rank, so all ranks get bitwise the same values. Reuse is safe
// without more flags: a rank writes its slot for the next chunk only after every reduced[]
// said that all reads of the slots are over, and writes the result for the next chunk only
// after every arrive[] of that chunk, which each rank raises after copying the last result out.
// A rank moves about twice the bytes that one memcpy of its buffer would, with two
// synchronisations per chunk and no system call unless it has to sleep.
//
// Waiting polls briefly (pausing, then yielding the core), then sleeps on the channel's doorbell
// (a futex on the shared page: posters bump it and wake sleepers only when the waiter count
// says there are any). A sleeper wakes at least every 100 ms to check its deadline, the abort
// word (a rank that failed any collective sets it, so the others fail at once instead of at
// their timeout) and whether the ranks it waits for are still alive (their pids, the ranks
// sharing a PID namespace).
//
// Large broadcasts, gathers, scatters and alltoalls skip the segment's slots and copy straight
// between the ranks' buffers (Note [single-copy collectives] in shm_single_copy.cpp); large
// reductions over tensors from empty_shareable() reduce straight from the peers' mapped buffers
// into every rank's (Note [mapped reductions] in shm_mapped.cpp).
//
// The segment is unlinked as soon as every rank has mapped it, so nothing is left in /dev/shm
// however the processes end after the group's set-up.
//
// allreduce_coalesced runs the same steps over several buffers taken as one (Segments below):
// a chunk may span buffers, and nothing is packed. The other collectives run in the same steps
// (run_steps below; Note [shared-memory collectives] in shm_collectives.cpp), and at the first
// step of every collective each rank checks that all ranks passed the same description.
#include <ember/distributed/backends/detail/shm_allreduce.h>

#include <fcntl.h>
#include <signal.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <vector>

#include <ember/distributed/errors.h>

namespace ember::dist::detail {
namespace {

constexpr uint64_t kMagic = 0x454d42525348414dULL;  // "EMBRSHAM"
constexpr size_t kPage = 4096;
constexpr size_t kLine = 64;
constexpr size_t kHeaderFixed = 512;  // SegmentHeader, then the pids
constexpr size_t kWhyBytes = 256;
// The segment stays under this, shrinking the chunk with more ranks or channels.
constexpr size_t kMaxSegmentBytes = size_t{64} << 20;
constexpr size_t kMaxChunk = size_t{1} << 20;
constexpr size_t kMinChunk = size_t{64} << 10;
// Waiting first polls with a pause instruction (the other ranks of a small collective are
// usually a fraction of a microsecond behind, and a futex sleep and wake-up costs several
// microseconds), then polls with sched_yield (on a machine with more ranks than cores the rank
// awaited may need this core to get there), then sleeps on the doorbell.
constexpr auto kPauseFor = std::chrono::microseconds(2);
constexpr auto kYieldFor = std::chrono::microseconds(100);
constexpr auto kSleepSlice = std::chrono::milliseconds(100);

struct SegmentHeader {
  uint64_t magic;
  uint64_t nonce;
  int32_t size;
  int32_t channels;
  uint64_t chunk;
  uint32_t abort_claim;  // the first rank to abort takes it (then writes why, then aborted)
  uint32_t aborted;      // 0, or the aborting rank + 1
  char why[kWhyBytes];
};
static_assert(sizeof(SegmentHeader) <= kHeaderFixed);

struct ChannelControl {
  uint32_t bell;
  uint32_t waiters;
};

struct RankLine {
  uint32_t arrive;
  uint32_t reduced;
  uint64_t count;  // the collective this rank runs (ShmAllreduce::Desc), written at its first step
  uint32_t dtype;
  uint32_t op;
  uint32_t kind;
  int32_t root;
};
static_assert(sizeof(RankLine) <= kLine);

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

template <typename T>
std::atomic_ref<T> atom(T& x) {
  return std::atomic_ref<T>(x);
}

long futex(uint32_t* addr, int op, uint32_t val, const timespec* ts) {
  return ::syscall(SYS_futex, addr, op, val, ts, nullptr, 0);
}

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

std::string read_first_line(const char* path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

std::string link_target(const char* path) {
  char buf[256] = {};
  const ssize_t n = ::readlink(path, buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

// Ranks with equal keys share the machine's memory and their pids mean the same processes.
// Different network namespaces count as different machines: Ember's multi-node tests are
// namespaces on one host, and there the network is what is under test.
std::string machine_key() {
  const std::string boot = read_first_line("/proc/sys/kernel/random/boot_id");
  const std::string net = link_target("/proc/self/ns/net");
  const std::string pid = link_target("/proc/self/ns/pid");
  if (boot.empty() || net.empty() || pid.empty()) return {};
  return boot + "|" + net + "|" + pid;
}

// True once `pid` has exited, a zombie included (a killed rank whose parent has not reaped it
// yet still answers kill(pid, 0)).
bool process_gone(int pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  const std::string stat = read_first_line(("/proc/" + std::to_string(pid) + "/stat").c_str());
  if (stat.empty()) return false;  // unreadable: assume alive, the deadline still applies
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos || paren + 2 >= stat.size()) return false;
  const char state = stat[paren + 2];
  return state == 'Z' || state == 'X';
}

struct Layout {
  size_t header;   // header page(s): SegmentHeader and the pids
  size_t control;  // per channel: ChannelControl line, then one RankLine per rank
  size_t channel;  // per channel: control + (size + 1) chunks
  size_t total;
};

Layout layout(int size, int channels, size_t chunk) {
  Layout l{};
  l.header = round_up(kHeaderFixed + sizeof(int32_t) * static_cast<size_t>(size), kPage);
  l.control = round_up(kLine * (1 + static_cast<size_t>(size)), kPage);
  l.channel = l.control + chunk * (static_cast<size_t>(size) + 1);
  l.total = l.header + l.channel * static_cast<size_t>(channels);
  return l;
}

size_t chunk_for(int size, int channels) {
  const size_t per = kMaxSegmentBytes / (static_cast<size_t>(channels) * (size + 1));
  return std::clamp(per / kPage * kPage, kMinChunk, kMaxChunk);
}

SegmentHeader& header_of(void* base) { return *static_cast<SegmentHeader*>(base); }
int32_t* pids_of(void* base) {
  return reinterpret_cast<int32_t*>(static_cast<char*>(base) + kHeaderFixed);
}

struct Mapping {
  void* base = MAP_FAILED;
  size_t bytes = 0;
  ~Mapping() {
    if (base != MAP_FAILED) ::munmap(base, bytes);
  }
  void* release() {
    void* b = base;
    base = MAP_FAILED;
    return b;
  }
};

// Maps the segment `name` (creating it with `bytes` when create); false if it cannot. *created
// says whether this call made the name (which must then be unlinked).
bool map_segment(const std::string& name, size_t bytes, bool create, Mapping& m, bool* created) {
  const int fd = create ? ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600)
                        : ::shm_open(name.c_str(), O_RDWR, 0);
  if (created) *created = create && fd >= 0;
  if (fd < 0) return false;
  struct stat st {};
  // fallocate reserves the pages now: on a full /dev/shm a later first touch would SIGBUS.
  const bool sized = create ? ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)) == 0
                            : ::fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == bytes;
  if (sized) {
    m.base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    m.bytes = bytes;
  }
  ::close(fd);
  return m.base != MAP_FAILED;
}

}  // namespace

// ---- set-up -------------------------------------------------------------------------------------

namespace {
// This process's PID namespace as the inode number in "pid:[4026531836]"; empty if unknown.
std::string pid_namespace_id() {
  const std::string t = link_target("/proc/self/ns/pid");
  const size_t open = t.find('['), close = t.find(']');
  if (open == std::string::npos || close == std::string::npos || close <= open + 1) return {};
  std::string id = t.substr(open + 1, close - open - 1);
  return std::all_of(id.begin(), id.end(), [](char c) { return c >= '0' && c <= '9'; })
             ? id
             : std::string();
}

bool all_of_class(const std::string& s, int (*is)(int)) {
  return !s.empty() &&
         std::all_of(s.begin(), s.end(), [is](char c) { return is(static_cast<unsigned char>(c)) != 0; });
}
}  // namespace

// The segment's name: "/ember-<tag>-n<pidns>-<pid>-<nonce>" under emberrun, whose EMBER_SHM_TAG
// names the job on this node, so that the launcher can sweep a name a killed rank 0 left behind
// (it exists from creation until every rank has mapped it); "/ember-n<pidns>-<pid>-<nonce>"
// elsewhere, which the next group made on this machine sweeps once its creator is gone
// (sweep_stale_segments). Without a known PID namespace: "/ember-[<tag>-]<pid>-<nonce>".
static std::string segment_name(uint64_t nonce) {
  std::ostringstream n;
  n << "/ember-";
  const char* tag = std::getenv("EMBER_SHM_TAG");
  if (tag != nullptr && *tag != '\0' && std::strlen(tag) <= 32 &&
      std::all_of(tag, tag + std::strlen(tag), [](char c) { return std::isalnum(static_cast<unsigned char>(c)); })) {
    n << tag << "-";
  }
  const std::string ns = pid_namespace_id();
  if (!ns.empty()) n << "n" << ns << "-";
  n << ::getpid() << "-" << std::hex << nonce;
  return n.str();
}

std::optional<SegmentName> parse_segment_name(const std::string& file) {
  const std::string prefix = "ember-";
  if (file.rfind(prefix, 0) != 0) return std::nullopt;
  std::vector<std::string> parts;
  std::istringstream in(file.substr(prefix.size()));
  for (std::string part; std::getline(in, part, '-');) parts.push_back(part);
  if (parts.size() != 3 && parts.size() != 4) return std::nullopt;
  const std::string& ns = parts[parts.size() - 3];
  const std::string& pid = parts[parts.size() - 2];
  const std::string& nonce = parts[parts.size() - 1];
  if (ns.size() < 2 || ns[0] != 'n' || !all_of_class(ns.substr(1), ::isdigit) ||
      !all_of_class(pid, ::isdigit) || pid.size() > 9 || !all_of_class(nonce, ::isxdigit) ||
      (parts.size() == 4 && !all_of_class(parts[0], ::isalnum))) {
    return std::nullopt;
  }
  return SegmentName{ns.substr(1), std::stoi(pid)};
}

int sweep_stale_segments() {
  const std::string ns = pid_namespace_id();
  if (ns.empty()) return 0;
  int swept = 0;
  try {  // a clean-up: whatever goes wrong in it must not fail the group being made
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
      const std::string file = e.path().filename().string();
      const std::optional<SegmentName> n = parse_segment_name(file);
      if (!n || n->pid_namespace != ns || n->pid == ::getpid() || n->pid <= 0 ||
          !process_gone(n->pid)) {
        continue;
      }
      if (::shm_unlink(("/" + file).c_str()) == 0) ++swept;  // EACCES: another user's
    }
  } catch (const std::exception&) {
  }
  return swept;
}

std::unique_ptr<ShmAllreduce> ShmAllreduce::create(Store& store, int rank, int size, int channels,
                                                   Duration timeout, size_t single_copy_bytes) {
  const size_t single_copy =
      single_copy_bytes > 0 ? single_copy_bytes : single_copy_bytes_from_env();
  const std::string key = machine_key();
  store.set("ember_shm/key/" + std::to_string(rank), key.empty() ? std::string("?") : key);
  const size_t chunk = chunk_for(size, channels);
  const Layout l = layout(size, channels, chunk);
  Mapping m;
  if (rank == 0) {
    bool local = !key.empty();
    for (int r = 1; r < size && local; ++r) {
      local = store.get_string("ember_shm/key/" + std::to_string(r), timeout) == key;
    }
    uint64_t nonce = 0;
    std::string name;
    bool created = false;
    if (local) {
      sweep_stale_segments();
      std::random_device rd;
      nonce = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(::getpid());
      name = segment_name(nonce);
      if (map_segment(name, l.total, true, m, &created)) {
        SegmentHeader& h = header_of(m.base);
        h.magic = kMagic;
        h.nonce = nonce;
        h.size = size;
        h.channels = channels;
        h.chunk = chunk;
        pids_of(m.base)[0] = static_cast<int32_t>(::getpid());
      }
    }
    if (created && std::getenv("EMBER_TEST_KILL_AFTER_SHM_CREATE") != nullptr) {
      // Test hook: die as a Ctrl-C or kill -9 here would, with the name still there.
      std::fprintf(stderr, "EMBER_TEST_KILL_AFTER_SHM_CREATE: rank 0 created %s\n", name.c_str());
      std::fflush(stderr);
      ::raise(SIGKILL);
    }
    // Whatever happens next, the name goes once every rank has answered.
    struct Unlink {
      std::string n;
      ~Unlink() {
        if (!n.empty()) ::shm_unlink(n.c_str());
      }
    } unlink{created ? name : std::string()};
    std::ostringstream offer;
    if (m.base != MAP_FAILED) offer << name << " " << std::hex << nonce;
    store.set("ember_shm/name", offer.str());
    bool all = m.base != MAP_FAILED;
    for (int r = 1; r < size; ++r) {
      all = store.get_string("ember_shm/ok/" + std::to_string(r), timeout) == "1" && all;
    }
    store.set("ember_shm/use", std::string(all ? "1" : "0"));
    if (!all) return nullptr;
  } else {
    const std::string offer = store.get_string("ember_shm/name", timeout);
    bool ok = false;
    if (!offer.empty()) {
      std::istringstream in(offer);
      std::string name;
      uint64_t nonce = 0;
      in >> name >> std::hex >> nonce;
      if (map_segment(name, l.total, false, m, nullptr)) {
        const SegmentHeader& h = header_of(m.base);
        ok = h.magic == kMagic && h.nonce == nonce && h.size == size &&
             h.channels == channels && h.chunk == chunk;
        if (ok) pids_of(m.base)[rank] = static_cast<int32_t>(::getpid());
      }
    }
    store.set("ember_shm/ok/" + std::to_string(rank), std::string(ok ? "1" : "0"));
    if (store.get_string("ember_shm/use", timeout) != "1") return nullptr;
  }
  std::unique_ptr<ShmAllreduce> shm(
      new ShmAllreduce(rank, size, channels, chunk, m.release(), l.total));
  shm->agree_single_copy(store, single_copy,
                         single_copy_bytes == 0 && ShmAllreduce::single_copy_bytes_is_default(),
                         timeout);
  return shm;
}

ShmAllreduce::ShmAllreduce(int rank, int size, int channels, size_t chunk, void* base,
                           size_t bytes)
    : rank_(rank),
      size_(size),
      channels_(channels),
      chunk_(chunk),
      base_(base),
      bytes_(bytes),
      turn_(static_cast<size_t>(channels), 0),
      step_(static_cast<size_t>(channels), 0),
      maps_(new_peer_maps(size)) {}

ShmAllreduce::~ShmAllreduce() {
  maps_.reset();  // the peers' shareable regions (Note [mapped reductions])
  ::munmap(base_, bytes_);
}

int ShmAllreduce::pid_of(int r) const { return pids_of(base_)[r]; }

bool ShmAllreduce::in_this_process(int r) const { return r == rank_ || pid_of(r) == ::getpid(); }

// ---- channels -----------------------------------------------------------------------------------

uint64_t ShmAllreduce::next_ticket() {
  std::lock_guard<std::mutex> lock(mu_);
  return tickets_++;
}

// Allreduces of one channel run in ticket order on this rank (as on every rank), one at a time.
void ShmAllreduce::wait_turn(uint64_t ticket, Clock::time_point deadline) {
  const size_t c = ticket % static_cast<size_t>(channels_);
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_until(lock, deadline,
                      [&] { return aborted_ || turn_[c] == ticket / channels_; })) {
    throw std::runtime_error(
        "timed out waiting for this rank's earlier collective on the same shared-memory channel");
  }
  if (aborted_) throw std::runtime_error("the group failed an earlier collective");
}

void ShmAllreduce::end_turn(uint64_t ticket) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++turn_[ticket % static_cast<size_t>(channels_)];
  }
  cv_.notify_all();
}

void ShmAllreduce::abort(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = true;
  }
  cv_.notify_all();
  SegmentHeader& h = header_of(base_);
  uint32_t unclaimed = 0;
  if (atom(h.abort_claim).compare_exchange_strong(unclaimed, 1)) {
    const size_t n = std::min(why.size(), kWhyBytes - 1);
    std::memcpy(h.why, why.data(), n);
    h.why[n] = '\0';
    atom(h.aborted).store(static_cast<uint32_t>(rank_ + 1));
  }
  const Layout l = layout(size_, channels_, chunk_);
  for (int c = 0; c < channels_; ++c) {
    auto* ctl = reinterpret_cast<ChannelControl*>(static_cast<char*>(base_) + l.header +
                                                  l.channel * static_cast<size_t>(c));
    atom(ctl->bell).fetch_add(1);
    futex(&ctl->bell, FUTEX_WAKE, INT_MAX, nullptr);
  }
}

namespace {

// Throws naming the rank that aborted the group (abort()) and why, if one has.
void check_abort(SegmentHeader& h) {
  const uint32_t a = atom(h.aborted).load(std::memory_order_acquire);
  if (a != 0) {
    throw std::runtime_error(
        str_cat("rank ", a - 1, " gave up after an error (", std::string(h.why), ")"));
  }
}

}  // namespace

void ShmAllreduce::throw_if_aborted() const { check_abort(header_of(base_)); }

// ---- steps ------------------------------------------------------------------------------------

namespace {

const char* kind_name(ShmAllreduce::Kind k) {
  static const char* const kNames[] = {"?",      "allreduce", "reduce",         "broadcast",
                                       "allgather", "gather",  "scatter", "reduce_scatter",
                                       "alltoall",  "barrier"};
  const auto i = static_cast<size_t>(k);
  return i < std::size(kNames) ? kNames[i] : "?";
}

bool reduces(ShmAllreduce::Kind k) {
  return k == ShmAllreduce::Kind::Allreduce || k == ShmAllreduce::Kind::Reduce ||
         k == ShmAllreduce::Kind::ReduceScatter;
}

// "reduce_scatter (sum) of 1000 elements of float32", "+ with root 1" for the rooted ones.
std::string describe(const ShmAllreduce::Desc& d) {
  std::string s = kind_name(d.kind);
  if (d.kind == ShmAllreduce::Kind::Barrier) return s;
  if (reduces(d.kind)) s += str_cat(" (", to_string(d.op), ")");
  s += str_cat(" of ", d.count, " elements of ", d.dtype);
  if (d.root >= 0) s += str_cat(" with root ", d.root);
  return s;
}

// ThreadSanitizer tracks memory by address. Ranks that are threads of one process map the
// segment each at its own address, so TSan cannot see that one rank's post and another's wait
// on the same counter synchronise, and reports the mapped reductions' accesses to a peer's
// tensor (at one address in both) as races. One address per segment stands in for the
// counters: a post releases it and a finished wait acquires it.
#if defined(__SANITIZE_THREAD__)
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
void* tsan_sync(uint64_t nonce) {
  static std::mutex mu;
  static std::map<uint64_t, std::unique_ptr<char>> syncs;
  std::lock_guard<std::mutex> lock(mu);
  auto& p = syncs[nonce];
  if (!p) p = std::make_unique<char>();
  return p.get();
}
void tsan_release(uint64_t nonce) { __tsan_release(tsan_sync(nonce)); }
void tsan_acquire(uint64_t nonce) { __tsan_acquire(tsan_sync(nonce)); }
#else
void tsan_release(uint64_t) {}
void tsan_acquire(uint64_t) {}
#endif

// One channel's shared state, as this rank sees it.
struct Channel {
  SegmentHeader* header;
  const int32_t* pids;
  ChannelControl* ctl;
  RankLine* lines;  // [size]
  int rank;
  int size;
  const char* kind;  // for errors: "allreduce"

  void check_abort() const { dist::detail::check_abort(*header); }

  void post(uint32_t RankLine::*field, uint32_t step) const {
    tsan_release(header->nonce);
    atom(lines[rank].*field).store(step);
    atom(ctl->bell).fetch_add(1);
    if (atom(ctl->waiters).load() > 0) futex(&ctl->bell, FUTEX_WAKE, INT_MAX, nullptr);
  }

  // The first rank whose `field` has not reached `step`, or -1.
  int lagging(uint32_t RankLine::*field, uint32_t step) const {
    for (int r = 0; r < size; ++r) {
      if (static_cast<int32_t>(atom(lines[r].*field).load(std::memory_order_acquire) - step) < 0)
        return r;
    }
    return -1;
  }

  void wait_all(uint32_t RankLine::*field, uint32_t step,
                ShmAllreduce::Clock::time_point deadline, const char* doing, size_t chunk_no,
                size_t chunks) const {
    const auto start = ShmAllreduce::Clock::now();
    bool yielding = false;
    for (int i = 1;; ++i) {
      if (lagging(field, step) < 0) return tsan_acquire(header->nonce);
      if (yielding) {
        ::sched_yield();
      } else {
        cpu_relax();
      }
      if (yielding || i % 16 == 0) {
        const auto spent = ShmAllreduce::Clock::now() - start;
        if (spent >= kPauseFor + kYieldFor) break;
        yielding = spent >= kPauseFor;
      }
    }
    auto next_check = ShmAllreduce::Clock::now() + kSleepSlice;
    for (;;) {
      atom(ctl->waiters).fetch_add(1);
      const uint32_t bell = atom(ctl->bell).load();
      const int late = lagging(field, step);
      if (late < 0) {
        atom(ctl->waiters).fetch_sub(1);
        return tsan_acquire(header->nonce);
      }
      if (atom(header->aborted).load() != 0) {  // only once it is clear the wait is not over
        atom(ctl->waiters).fetch_sub(1);
        check_abort();
      }
      const auto now = ShmAllreduce::Clock::now();
      if (now >= deadline) {
        atom(ctl->waiters).fetch_sub(1);
        throw std::runtime_error(str_cat(
            "timed out waiting for rank ", late, " to ", doing, " chunk ", chunk_no + 1, " of ",
            chunks, " (shared-memory ", kind, ")"));
      }
      const auto slice = std::min<ShmAllreduce::Clock::duration>(deadline - now, kSleepSlice);
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(slice).count();
      const timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
      futex(&ctl->bell, FUTEX_WAIT, bell, &ts);
      atom(ctl->waiters).fetch_sub(1);
      if (ShmAllreduce::Clock::now() >= next_check) {
        next_check = ShmAllreduce::Clock::now() + kSleepSlice;
        const int r = lagging(field, step);
        if (r >= 0 && process_gone(pids[r])) {
          throw std::runtime_error(str_cat(
              "rank ", r, " (pid ", pids[r], ") exited while this rank waited for it to ", doing,
              " chunk ", chunk_no + 1, " of ", chunks, " (shared-memory ", kind, ")"));
        }
      }
    }
  }

  void publish(const ShmAllreduce::Desc& d) const {
    RankLine& mine = lines[rank];
    mine.count = d.count;
    mine.dtype = static_cast<uint32_t>(d.dtype);
    mine.op = static_cast<uint32_t>(d.op);
    mine.kind = static_cast<uint32_t>(d.kind);
    mine.root = d.root;
  }

  // After every rank published its description: throws naming the first rank that differs.
  void check_agreement(const ShmAllreduce::Desc& d) const {
    for (int r = 0; r < size; ++r) {
      const RankLine& o = lines[r];
      const ShmAllreduce::Desc theirs{static_cast<ShmAllreduce::Kind>(o.kind),
                                      static_cast<Dtype>(o.dtype), o.count,
                                      static_cast<ReduceOp>(o.op), o.root};
      if (theirs.kind != d.kind || theirs.dtype != d.dtype || theirs.count != d.count ||
          theirs.op != d.op || theirs.root != d.root) {
        throw std::runtime_error(str_cat("ranks disagree: rank ", rank, " passed ", describe(d),
                                         " but rank ", r, " passed ", describe(theirs)));
      }
    }
  }
};

}  // namespace

// Each step: Publish, every rank's arrive; Combine, every rank's reduced; Collect. A rank
// writes slots only before an arrive wait and the result only after one, reads slots only
// between the two waits and the result only after the reduced wait, so one step's writes never
// race another rank's reads of the step before (Note [shared-memory allreduce]).
void ShmAllreduce::run_steps(uint64_t ticket, const Desc& desc, size_t steps,
                             Clock::time_point deadline, const StepFn& body) {
  run_steps_until(ticket, desc, steps, deadline, body);
}

void ShmAllreduce::run_steps_until(uint64_t ticket, const Desc& desc, size_t& steps,
                                   Clock::time_point deadline, const StepFn& body) {
  wait_turn(ticket, deadline);
  struct EndTurn {
    ShmAllreduce* self;
    uint64_t ticket;
    ~EndTurn() { self->end_turn(ticket); }
  } end{this, ticket};

  const size_t c = ticket % static_cast<size_t>(channels_);
  const Layout l = layout(size_, channels_, chunk_);
  char* base = static_cast<char*>(base_) + l.header + l.channel * c;
  const Channel ch{&header_of(base_),
                   pids_of(base_),
                   reinterpret_cast<ChannelControl*>(base),
                   reinterpret_cast<RankLine*>(base + kLine),
                   rank_,
                   size_,
                   kind_name(desc.kind)};
  const Area area{base + l.control, base + l.control + chunk_ * static_cast<size_t>(size_),
                  chunk_};
  ch.check_abort();
  const bool empty = steps == 0;  // one step all the same, to check that the ranks agree
  steps = std::max<size_t>(steps, 1);
  const bool reduction = reduces(desc.kind);
  for (size_t k = 0; k < steps; ++k) {
    const uint32_t step = ++step_[c];
    if (!empty) body(Phase::Publish, k, area);
    if (k == 0) ch.publish(desc);
    ch.post(&RankLine::arrive, step);
    ch.wait_all(&RankLine::arrive, step, deadline, "write its part of", k, steps);
    if (k == 0) ch.check_agreement(desc);
    if (!empty) body(Phase::Combine, k, area);
    ch.post(&RankLine::reduced, step);
    ch.wait_all(&RankLine::reduced, step, deadline,
                reduction ? "reduce its share of" : "read its part of", k, steps);
    if (!empty) body(Phase::Collect, k, area);
  }
}

void ShmAllreduce::combine(char* out, const std::vector<const void*>& srcs, size_t n,
                           const Reduction& r) const {
  r.fn(out, srcs[0], srcs[1], n);
  for (int k = 2; k < size_; ++k) r.fn(out, out, srcs[static_cast<size_t>(k)], n);
  if (r.divide) r.divide(out, n, size_);
}

// ---- the allreduce ------------------------------------------------------------------------------

namespace {

// Spans of elements taken as one buffer, the concatenation of the spans.
class Segments {
 public:
  Segments(const std::vector<ShmAllreduce::Span>& spans, size_t elem) : spans_(spans), elem_(elem) {
    starts_.reserve(spans.size());
    for (const auto& s : spans) {
      starts_.push_back(count_);
      count_ += s.count;
    }
  }
  size_t count() const { return count_; }

  // f(pointer, position, n) for each piece of elements [a, b) that lies in one span, in order;
  // `position` is the piece's first element in the concatenation.
  template <typename F>
  void for_each(size_t a, size_t b, F&& f) const {
    if (a >= b) return;
    size_t i = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), a) -
                                   starts_.begin()) - 1;
    while (a < b) {
      const size_t end = std::min(b, starts_[i] + spans_[i].count);
      if (end > a) f(static_cast<char*>(spans_[i].data) + (a - starts_[i]) * elem_, a, end - a);
      a = std::max(a, end);
      ++i;
    }
  }

 private:
  const std::vector<ShmAllreduce::Span>& spans_;
  size_t elem_;
  std::vector<size_t> starts_;
  size_t count_ = 0;
};

}  // namespace

// The steps of Note [shared-memory allreduce]; a reduce (desc.root >= 0) runs the same steps,
// but only its root keeps the reduced shares.
void ShmAllreduce::reduce_spans(uint64_t ticket, const std::vector<Span>& spans, const Desc& desc,
                                const Reduction& red, Clock::time_point deadline) {
  const size_t elem = static_cast<size_t>(itemsize(desc.dtype));
  const Segments data(spans, elem);
  const size_t count = data.count();
  const size_t per_chunk = chunk_ / elem;
  const size_t chunks = (count + per_chunk - 1) / per_chunk;
  const bool keep = desc.root < 0 || desc.root == rank_;
  std::vector<const void*> srcs(static_cast<size_t>(size_));
  const StepFn staged = [&](Phase phase, size_t k, const Area& area) {
    const size_t first = k * per_chunk;
    const size_t n = std::min(per_chunk, count - std::min(count, first));
    // Rank r's share of this chunk: elements [first + share_begin(r), first + share_begin(r+1)).
    auto share_begin = [&](int r) { return first + n * static_cast<size_t>(r) / size_; };
    auto at = [&](char* buffer, size_t pos) { return buffer + (pos - first) * elem; };
    if (phase == Phase::Publish) {  // 1. the other ranks' shares of this chunk into the slot
      for (int r = 0; r < size_; ++r) {
        if (r == rank_) continue;
        data.for_each(share_begin(r), share_begin(r + 1), [&](char* p, size_t pos, size_t m) {
          std::memcpy(at(area.slot(rank_), pos), p, m * elem);
        });
      }
    } else if (phase == Phase::Combine) {  // 2. reduce this rank's share, in rank order
      data.for_each(share_begin(rank_), share_begin(rank_ + 1), [&](char* p, size_t pos,
                                                                    size_t m) {
        for (int r = 0; r < size_; ++r) {
          srcs[static_cast<size_t>(r)] = r == rank_ ? p : at(area.slot(r), pos);
        }
        char* out = at(area.result, pos);
        combine(out, srcs, m, red);
        if (keep) std::memcpy(p, out, m * elem);  // still in this core's cache
      });
    } else if (keep) {  // 3. the other ranks' reduced shares
      for (int r = 0; r < size_; ++r) {
        if (r == rank_) continue;
        data.for_each(share_begin(r), share_begin(r + 1), [&](char* p, size_t pos, size_t m) {
          std::memcpy(p, at(area.result, pos), m * elem);
        });
      }
    }
  };
  if (!may_map(count * elem)) return run_steps(ticket, desc, chunks, deadline, staged);
  // One buffer of every rank in shareable memory: Note [mapped reductions].
  const Entry mine = spans.size() == 1 ? Entry{spans[0].data, count * elem} : Entry{nullptr, 0};
  run_mapped_or_staged(ticket, desc, {mine}, chunks, deadline, staged,
                       [&](const PeerBuffers& peers) {
                         mapped_reduce(peers, desc.dtype, count, desc.root, red);
                       });
}

void ShmAllreduce::run(uint64_t ticket, const std::vector<Span>& spans, Dtype dtype, ReduceOp op,
                       ReduceFn fn, DivideFn divide, Clock::time_point deadline) {
  size_t count = 0;
  for (const Span& s : spans) count += s.count;
  reduce_spans(ticket, spans, Desc{Kind::Allreduce, dtype, count, op, -1}, {op, fn, divide},
               deadline);
}

void ShmAllreduce::reduce(uint64_t ticket, void* data, size_t count, Dtype dtype,
                          const Reduction& r, int root, Clock::time_point deadline) {
  reduce_spans(ticket, {Span{data, count}}, Desc{Kind::Reduce, dtype, count, r.op, root}, r,
               deadline);
}

// A barrier is one step that moves nothing: its two rounds (every rank's arrive, then every
// rank's reduced) are what a barrier needs, and the agreement check fails a rank that meets
// another collective at the same ticket instead of mixing the two.
void ShmAllreduce::barrier(uint64_t ticket, Clock::time_point deadline) {
  run_steps(ticket, Desc{Kind::Barrier, Dtype::UInt8, 0, ReduceOp::Sum, -1}, 1, deadline,
            [](Phase, size_t, const Area&) {});
}

}  // namespace ember::dist::detail
