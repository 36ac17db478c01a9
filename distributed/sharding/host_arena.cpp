#include <ember/distributed/sharding/detail/host_arena.h>

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstring>
#include <mutex>

#include <ember/tensor/allocator.h>
#include <ember/tensor/error.h>

namespace ember::dist::detail {
namespace {

// Note [Released arena faults]
// Reading a sharded module's parameters while they are released (module->forward(x) called
// directly, so fully_shard's hooks never gathered them) touches a PROT_NONE page. Without help
// that is a bare "Segmentation fault"; the handler below recognises an address inside a
// released arena and says what happened before the default action ends the process. Only
// async-signal-safe calls are used: the table is read with atomics, the message with write(2).
// Faults anywhere else go to the handler that was installed before ours.
constexpr int kSlots = 4096;
constexpr size_t kHugePage = size_t{2} << 20;
struct Slot {
  std::atomic<uintptr_t> begin{0}, end{0};
  std::atomic<const char*> label{nullptr};
};
std::array<Slot, kSlots> g_slots;
std::mutex g_slots_mu;  // registration only (never taken in the handler)
struct sigaction g_previous {};
std::once_flag g_install_once;

void write_all(const char* s) {
  size_t n = std::strlen(s);
  while (n > 0) {
    const ssize_t w = ::write(STDERR_FILENO, s, n);
    if (w <= 0) return;
    s += w;
    n -= static_cast<size_t>(w);
  }
}

void on_segv(int sig, siginfo_t* info, void* ctx) {
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  for (const Slot& s : g_slots) {
    const uintptr_t b = s.begin.load(std::memory_order_acquire);
    if (b == 0 || addr < b || addr >= s.end.load(std::memory_order_acquire)) continue;
    const char* label = s.label.load(std::memory_order_acquire);
    write_all("ember: ");
    write_all(label != nullptr ? label : "fully_shard");
    write_all(": a parameter was read while the module is resharded (its memory is released "
              "between uses). Call the module as (*module)(x) or module->call(...) so that "
              "fully_shard's forward hooks gather the parameters; module->forward(x) skips the "
              "hooks (see docs/sharding.md).\n");
    break;
  }
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, ctx);
    return;
  }
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN &&
      g_previous.sa_handler != nullptr) {
    g_previous.sa_handler(sig);
    return;
  }
  // Default action: restore it; returning re-runs the faulting access, which now ends the
  // process as it would have without us.
  signal(sig, SIG_DFL);
}

void install_handler() {
  struct sigaction sa {};
  sa.sa_sigaction = &on_segv;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &g_previous);
}

int register_range(void* p, size_t n, const char* label) {
  std::call_once(g_install_once, install_handler);
  std::lock_guard<std::mutex> lock(g_slots_mu);
  for (int i = 0; i < kSlots; ++i) {
    Slot& s = g_slots[i];
    if (s.begin.load(std::memory_order_relaxed) != 0) continue;
    s.label.store(label, std::memory_order_release);
    s.end.store(reinterpret_cast<uintptr_t>(p) + n, std::memory_order_release);
    s.begin.store(reinterpret_cast<uintptr_t>(p), std::memory_order_release);
    return i;
  }
  return -1;  // table full: faults in this arena are reported as plain faults
}

void unregister_range(int slot) {
  if (slot < 0) return;
  std::lock_guard<std::mutex> lock(g_slots_mu);
  g_slots[slot].begin.store(0, std::memory_order_release);
  g_slots[slot].end.store(0, std::memory_order_release);
  g_slots[slot].label.store(nullptr, std::memory_order_release);
}

}  // namespace

HostArena::HostArena(size_t nbytes, std::string label)
    : nbytes_(nbytes), label_(std::move(label)) {
  EMBER_CHECK(nbytes > 0, "[", label_, "] an arena needs at least one byte");
  // Reserved 2 MiB-aligned and advised for transparent huge pages: every gather touches the
  // whole block again after a release, and in 4 KiB pages that is one page fault per 4 KiB
  // (Note [Caching allocators] in tensor/allocator.h has the same reason for large tensors).
  reserved_ = nbytes + kHugePage;
  void* p = ::mmap(nullptr, reserved_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1,
                   0);
  EMBER_CHECK_TYPE(OutOfMemoryError, p != MAP_FAILED, "[", label_, "] could not reserve ", nbytes,
                   " bytes of address space: ", std::strerror(errno));
  base_ = p;
  const auto at = (reinterpret_cast<uintptr_t>(p) + kHugePage - 1) / kHugePage * kHugePage;
  data_ = reinterpret_cast<void*>(at);
  ::madvise(data_, nbytes_, MADV_HUGEPAGE);  // advice only: without it, small pages
  slot_ = register_range(data_, nbytes_, label_.c_str());
}

HostArena::~HostArena() {
  release();
  unregister_range(slot_);
  ::munmap(base_, reserved_);
}

void HostArena::commit() {
  if (committed_) return;
  EMBER_CHECK_TYPE(OutOfMemoryError, ::mprotect(data_, nbytes_, PROT_READ | PROT_WRITE) == 0, "[",
                   label_, "] could not map ", nbytes_, " bytes: ", std::strerror(errno));
  committed_ = true;
  cpu_allocator_account(static_cast<int64_t>(nbytes_));
}

void HostArena::release() {
  if (!committed_) return;
  // MADV_DONTNEED on private anonymous memory frees the pages at once (the next touch reads
  // zeros); PROT_NONE then turns any stray read into a reported fault instead of zeros.
  ::madvise(data_, nbytes_, MADV_DONTNEED);
  ::mprotect(data_, nbytes_, PROT_NONE);
  committed_ = false;
  cpu_allocator_account(-static_cast<int64_t>(nbytes_));
}

}  // namespace ember::dist::detail
