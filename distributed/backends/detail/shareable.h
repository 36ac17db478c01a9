// Where a buffer from empty_shareable() lies, for the shared-memory collectives (Note [mapped
// reductions] in shm_mapped.cpp). Internal: not installed, not part of the public API.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>


namespace ember::dist::detail {

/// A buffer inside one shareable region of this process.
struct ShareableRef {
  uint64_t id;            ///< the region's number, unique in this process (never 0)
  int fd;                 ///< the region's memfd in this process
  uint64_t region_bytes;  ///< the memfd's size
  uint64_t offset;        ///< the buffer's first byte in the memfd
};

/// The region holding all of [data, data + bytes), if one does.
std::optional<ShareableRef> find_shareable(const void* data, size_t bytes);

/// How many regions this process has freed so far: a peer that mapped some of them drops its
/// mappings when this changes.
uint64_t shareable_frees();

/// The memfd name of region `id`, which a peer checks after opening the fd.
std::string shareable_name(uint64_t id);

}  // namespace ember::dist::detail
