// The version of the Ember library a program runs with (torch.__version__).
#pragma once

#include <ember/version.h>

namespace ember {

/// The library's version as built ("0.9.0"), the same string as EMBER_VERSION when the headers
/// and the library come from one build.
const char* version();

}  // namespace ember
