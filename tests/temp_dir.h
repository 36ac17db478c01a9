// A unique temporary folder for a test, removed with its contents even when the test fails.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

namespace ember::test {

/// A unique folder under the system's temp dir, removed (with its contents) at the end even when
/// the test fails.
struct TempDir {
  std::string path;
  explicit TempDir(const char* prefix = "ember_example_test") {
    std::string t = (std::filesystem::temp_directory_path() / (std::string(prefix) + "_XXXXXX")).string();
    EXPECT_NE(mkdtemp(t.data()), nullptr) << std::strerror(errno);
    path = t;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string operator/(const std::string& name) const { return path + "/" + name; }
  /// The names in the folder, sorted.
  std::vector<std::string> list() const {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(path))
      names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }
};

}  // namespace ember::test
