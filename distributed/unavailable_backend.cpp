#include <ember/distributed/detail/unavailable_backend.h>

namespace ember::dist {

BackendFactory detail::unavailable_backend(std::string name, std::string what, std::string option,
                                           std::string install) {
  return [=](const BackendArgs&) -> std::shared_ptr<ProcessGroup> {
    throw NotImplementedError(detail::str_cat(
        "[init_process_group] backend '", name, "' is not in this build: Ember was configured "
        "without ", what, " (", option, "=OFF, or it was not found). Install ", install,
        " and configure again with -D", option, "=ON"));
  };
}

}  // namespace ember::dist
