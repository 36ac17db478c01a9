// What the ProcessGroupThreads and DDP-on-threads tests share: running a body on N rank
// threads of one world (CPU or CUDA, each CUDA rank on its own stream), optionally through a
// DelayingGroup.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <ember/distributed/backends/process_group_threads.h>
#include <ember/distributed/debug/delaying_group.h>
#include <ember/tensor/gpu/cuda.h>
#include "tests/distributed/store/store_test_util.h"

namespace ember::test {

#define EMBER_REQUIRE_CUDA() \
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason()

/// How run_threads builds each rank's group.
struct ThreadsSetup {
  int n = 2;
  /// kCPU, or a CUDA device: every rank thread then makes its own stream current.
  Device device = kCPU;
  /// Wrap each rank's group in a DelayingGroup with these options.
  std::optional<dist::DelayOptions> delay;
  /// ProcessGroupThreads' in_place_coalesced.
  bool in_place_coalesced = false;
  dist::Duration timeout = std::chrono::seconds(60);
};

/// A description for test names and failure messages: "4 ranks, cuda:0, delayed x2".
inline std::string describe(const ThreadsSetup& s) {
  std::string d = std::to_string(s.n) + (s.n == 1 ? " rank" : " ranks");
  d += s.device.is_cpu() ? ", cpu" : ", cuda";
  if (s.delay) d += ", delayed x" + std::to_string(s.delay->scale);
  if (s.in_place_coalesced) d += ", in place";
  return d;
}

/// Runs body(group, rank) on s.n threads of a fresh world; throws dist::RankThreadError with
/// the first failure (run_rank_threads).
inline void run_threads_or_throw(
    const ThreadsSetup& s,
    const std::function<void(std::shared_ptr<dist::ProcessGroup>, int)>& body) {
  auto world = dist::ThreadWorld::create(s.n);
  dist::run_rank_threads(world, [&](int rank) {
    std::optional<cuda::StreamGuard> own_stream;
    if (s.device.is_cuda()) {
      cuda::set_device(s.device.index);
      own_stream.emplace(cuda::Stream::create(s.device.index));
    }
    std::shared_ptr<dist::ProcessGroup> pg = std::make_shared<dist::ProcessGroupThreads>(
        world, rank, dist::ProcessGroup::Options{s.timeout}, s.in_place_coalesced);
    if (s.delay) pg = std::make_shared<dist::DelayingGroup>(pg, *s.delay);
    body(pg, rank);
    if (s.device.is_cuda()) cuda::current_stream(s.device.index).synchronize();
  });
}

/// run_threads_or_throw, its failure reported as a gtest failure naming the setup.
inline void run_threads(const ThreadsSetup& s,
                        const std::function<void(std::shared_ptr<dist::ProcessGroup>, int)>& body) {
  try {
    run_threads_or_throw(s, body);
  } catch (const dist::RankThreadError& e) {
    FAIL() << describe(s) << ": " << e.what();
  }
}

}  // namespace ember::test
