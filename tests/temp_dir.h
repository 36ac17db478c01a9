// A unique temporary folder for a test, removed with its contents even when the test fails.
#pragma once

#include <stdlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

namespace ember::test {

/// A fresh folder under the system's temp dir, removed (with its contents) on destruction, so a
/// failing test leaves nothing behind.
class TempDir {
 public:
  /// Throws if the folder cannot be made: the test fails there, not later on a missing path.
  explicit TempDir(const std::string& prefix = "ember_test") {
    namespace fs = std::filesystem;
    const std::string tmpl = (fs::temp_directory_path() / (prefix + "_XXXXXX")).string();
    std::string p = tmpl;  // mkdtemp rewrites the X's even when it fails; the message names tmpl
    if (::mkdtemp(p.data()) == nullptr) {
      const int err = errno;
      throw std::runtime_error("mkdtemp(" + tmpl + "): " + std::strerror(err));
    }
    path_ = p;
  }
  /// Errors are ignored: a destructor must not throw, and a leftover folder fails no test.
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  /// The folder's path.
  const std::string& path() const { return path_; }
  /// The path of `name` in the folder (which need not exist yet).
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  /// The names in the folder, sorted, so a test can compare them with a fixed list.
  std::vector<std::string> list() const {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(path_))
      names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

 private:
  std::string path_;
};

}  // namespace ember::test
