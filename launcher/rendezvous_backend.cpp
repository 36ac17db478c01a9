#include <ember/launcher/rendezvous_backend.h>

// The registry: one row per name --rdzv-backend accepts, X(name, type), where `type` is the
// RendezvousBackendType constant that the backend's file (launcher/rendezvous_<name>.cpp)
// defines with external linkage. A row is the only line a new backend adds outside its file;
// the list is written out, not filled by static constructors in each file, because the
// launcher is a static library and the linker would drop a file nothing refers to. Errors and
// --help list the names in this order. "static", torchrun's default, is c10d's backend here:
// in both, node 0's agent hosts the store (docs/launcher.md, torchrun's options).
#define EMBER_RENDEZVOUS_BACKENDS(X) \
  X("static", kC10dRendezvous)       \
  X("c10d", kC10dRendezvous)         \
  X("etcd", kEtcdRendezvous)         \
  /* every row ends with a backslash, so a new one is one line */

namespace ember::launcher {

#define EMBER_DECLARE_RENDEZVOUS_BACKEND(name, type) extern const RendezvousBackendType type;
EMBER_RENDEZVOUS_BACKENDS(EMBER_DECLARE_RENDEZVOUS_BACKEND)
#undef EMBER_DECLARE_RENDEZVOUS_BACKEND

const std::vector<RegisteredRendezvousBackend>& rendezvous_backends() {
#define EMBER_RENDEZVOUS_BACKEND_ROW(name, type) {name, &type},
  static const std::vector<RegisteredRendezvousBackend> registry = {
      EMBER_RENDEZVOUS_BACKENDS(EMBER_RENDEZVOUS_BACKEND_ROW)};
#undef EMBER_RENDEZVOUS_BACKEND_ROW
  return registry;
}

const RendezvousBackendType* find_rendezvous_backend(const std::string& name) {
  for (const auto& b : rendezvous_backends())
    if (name == b.name) return b.type;
  return nullptr;
}

std::string rendezvous_backend_names() {
  const auto& all = rendezvous_backends();
  std::string out;
  for (size_t i = 0; i < all.size(); ++i) {
    out += (i == 0 ? "" : i + 1 == all.size() ? " or " : ", ");
    out += all[i].name;
  }
  return out;
}

}  // namespace ember::launcher
