// empty_shareable(): each tensor its own memfd, registered by address so that the shared-memory
// collectives can tell which buffers their peers may map (Note [mapped reductions] in
// shm_mapped.cpp). A region per tensor keeps the bookkeeping to a map: these are long-lived
// buffers (gradient buckets, sharded parameters, benchmark operands), not per-step temporaries.
#include <ember/distributed/backends/shareable.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>

#include <ember/distributed/backends/detail/shareable.h>
#include <ember/distributed/errors.h>
#include <ember/tensor/ops/creation.h>

namespace ember::dist {
namespace detail {
namespace {

struct Region {
  uint64_t id;
  int fd;
  size_t bytes;
};

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
// Keyed by the mapping's first byte.
std::map<uintptr_t, Region>& registry() {
  static std::map<uintptr_t, Region> r;
  return r;
}
std::atomic<uint64_t> next_id{1};
std::atomic<uint64_t> frees{0};

}  // namespace

std::string shareable_name(uint64_t id) { return "ember-shareable-" + std::to_string(id); }

uint64_t shareable_frees() { return frees.load(); }

std::optional<ShareableRef> find_shareable(const void* data, size_t bytes) {
  const auto p = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& reg = registry();
  auto it = reg.upper_bound(p);
  if (it == reg.begin()) return std::nullopt;
  --it;
  const Region& r = it->second;
  if (p - it->first > r.bytes || bytes > r.bytes - (p - it->first)) return std::nullopt;
  return ShareableRef{r.id, r.fd, r.bytes, p - it->first};
}

}  // namespace detail


Tensor empty_shareable(IntList shape, TensorOptions opts) {
  EMBER_CHECK(opts.device_.is_cpu(), "empty_shareable: expected a CPU tensor, got device ",
              opts.device_);
  EMBER_CHECK(!opts.pinned_, "empty_shareable: pinned memory cannot be shareable");
  for (int64_t d : shape) EMBER_CHECK(d >= 0, "empty_shareable: expected sizes >= 0, got ", d);
  const int64_t numel = Shape(shape).numel();
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t want = static_cast<size_t>(numel) * static_cast<size_t>(itemsize(opts.dtype_));
  const size_t bytes = std::max(page, (want + page - 1) / page * page);
  const uint64_t id = detail::next_id.fetch_add(1);
  const int fd = ::memfd_create(detail::shareable_name(id).c_str(), MFD_CLOEXEC);
  if (fd < 0) {
    throw DistError(detail::str_cat("empty_shareable: memfd_create failed: ", std::strerror(errno)));
  }
  // Reserving the pages now turns a full tmpfs into this error instead of a SIGBUS at first touch.
  const int err = ::ftruncate(fd, static_cast<off_t>(bytes)) != 0
                      ? errno
                      : ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  void* base = err == 0 ? ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                        : MAP_FAILED;
  if (base == MAP_FAILED) {
    const int e = err != 0 ? err : errno;
    ::close(fd);
    throw DistError(detail::str_cat("empty_shareable: could not get ", bytes,
                                    " bytes of shared memory: ", std::strerror(e)));
  }
  {
    std::lock_guard<std::mutex> lock(detail::registry_mutex());
    detail::registry()[reinterpret_cast<uintptr_t>(base)] = {id, fd, bytes};
  }
  auto release = [fd, bytes](void* p) {
    {
      std::lock_guard<std::mutex> lock(detail::registry_mutex());
      detail::registry().erase(reinterpret_cast<uintptr_t>(p));
    }
    ::munmap(p, bytes);
    ::close(fd);
    detail::frees.fetch_add(1);
  };
  return from_blob(base, shape, opts, release);
}

bool is_shareable(const Tensor& t) {
  return t.defined() && t.device().is_cpu() &&
         detail::find_shareable(t.data_ptr(), static_cast<size_t>(t.nbytes())).has_value();
}

}  // namespace ember::dist
