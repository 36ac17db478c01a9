// The source and build folders of this build, for the tests and benchmarks that run the
// examples or read scripts and data from the tree.
//
// They live in one generated translation unit (cmake/build_paths.cpp.in, the library
// ember_build_paths) instead of -D flags on every test and benchmark: an absolute path on a
// compile line is part of ccache's key, so every clone at a new path (CI's clean clone) used to
// recompile each of those files; now it recompiles that one file.
#pragma once

#include <string>

namespace ember::build_paths {

/// The source tree this build was configured from (no trailing slash).
const std::string& source_dir();
/// The build folder (CMake's PROJECT_BINARY_DIR; no trailing slash).
const std::string& binary_dir();

}  // namespace ember::build_paths

#define EMBER_SOURCE_DIR (::ember::build_paths::source_dir())
#define EMBER_BINARY_DIR (::ember::build_paths::binary_dir())
