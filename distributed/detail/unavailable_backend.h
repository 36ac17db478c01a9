// What a build without one of the optional backends registers in its place (backends/no_*.cpp):
// a factory that says what the build lacks and how to get it. Internal.
#pragma once

#include <string>

#include <ember/distributed/init.h>

namespace ember::dist::detail {

/// A factory that throws NotImplementedError: "[init_process_group] backend '<name>' is not in
/// this build: Ember was configured without <what> (<option>=OFF, or it was not found).
/// Install <install> and configure again with -D<option>=ON".
BackendFactory unavailable_backend(std::string name, std::string what, std::string option,
                                   std::string install);

}  // namespace ember::dist::detail
