// EMBER_REQUIRE_GLOO(): skips the test in builds without gloo (EMBER_WITH_GLOO=OFF), where the
// gloo process group is a stand-in that throws.
#pragma once

#include <gtest/gtest.h>

#include <ember/distributed/backends/process_group_gloo.h>

#define EMBER_REQUIRE_GLOO() \
  if (!::ember::dist::gloo_available()) GTEST_SKIP() << "built without gloo (EMBER_WITH_GLOO=OFF)"
