#include <ember/tensor/version.h>

namespace ember {

const char* version() { return EMBER_VERSION; }

}  // namespace ember
