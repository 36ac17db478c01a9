// Exchanging variable-length byte strings (descriptors, serialized state) through a process
// group's collectives rather than the store: the store is for bootstrap, and its values would
// bypass the group's backend, timeout and error reporting. Not part of the public API.
#pragma once

#include <string>
#include <vector>

#include <ember/distributed/process_group.h>

namespace ember::dist::detail {

/// Every rank's `mine`, indexed by rank: on every rank (root < 0: an all-gather), or on `root`
/// only (a gather; other ranks get an empty vector). A collective: every rank calls it with the
/// same root. An all-gather of the lengths, then one collective of byte tensors padded to the
/// longest, on the group's default device; each wait is bounded by the group's timeout.
std::vector<std::string> exchange_bytes(dist::ProcessGroup& pg, const std::string& mine,
                                        int root = -1);

}  // namespace ember::dist::detail
