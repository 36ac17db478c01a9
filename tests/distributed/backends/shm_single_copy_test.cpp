// The single-copy shared-memory collectives (Note [single-copy collectives] in
// distributed/backends/shm_single_copy.cpp), driven through ShmAllreduce itself so that each test chooses
// the path: every rank asks for single copies from 1 byte (always), or for none (the staged
// path), and the results must be bitwise the staged path's. Ranks are forked processes (cross-
// memory attach between processes) and threads of this process (between threads).
#include <ember/distributed/backends/detail/shm_allreduce.h>
#include <gtest/gtest.h>
#include <linux/capability.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <barrier>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>

#include "tests/distributed/backends/shm_test_util.h"

namespace ember::dist {
namespace {

using ember::dist::detail::ShmAllreduce;
using namespace std::chrono_literals;
using test::make_shm;
using test::require;
using test::run_processes;
using test::run_threads;
using test::soon;
using Clock = ShmAllreduce::Clock;
using Bytes = std::vector<uint8_t>;

constexpr size_t kAlways = 1;
constexpr size_t kNever = SIZE_MAX;

// Rank r's block j of `bytes` bytes: different on every rank, block and byte.
Bytes block(int rank, int j, size_t bytes) {
  Bytes b(bytes);
  for (size_t i = 0; i < bytes; ++i) b[i] = static_cast<uint8_t>(i * 7 + rank * 31 + j * 13 + 1);
  return b;
}

std::vector<void*> pointers(std::vector<Bytes>& v) {
  std::vector<void*> p;
  for (Bytes& b : v) p.push_back(b.data());
  return p;
}
std::vector<const void*> const_pointers(const std::vector<Bytes>& v) {
  std::vector<const void*> p;
  for (const Bytes& b : v) p.push_back(b.data());
  return p;
}

// One collective of `count` elements of `dtype` per block on `shm`; returns every byte this rank
// ends with (its outputs, in order).
using Op = std::function<std::vector<Bytes>(ShmAllreduce& shm, int rank, int n, size_t count,
                                            Dtype dtype)>;
struct NamedOp {
  const char* name;
  Op run;
};

const std::vector<NamedOp>& ops() {
  static const std::vector<NamedOp> all = {
      {"broadcast",
       [](ShmAllreduce& shm, int rank, int n, size_t count, Dtype d) {
         Bytes b = block(rank, 0, count * itemsize(d));
         shm.broadcast(shm.next_ticket(), b.data(), count, d, n - 1, soon());
         return std::vector<Bytes>{b};
       }},
      {"allgather",
       [](ShmAllreduce& shm, int rank, int n, size_t count, Dtype d) {
         const size_t bytes = count * itemsize(d);
         std::vector<Bytes> outs(static_cast<size_t>(n), Bytes(bytes));
         const Bytes in = block(rank, 0, bytes);
         shm.gather(shm.next_ticket(), in.data(), pointers(outs), count, d, -1, soon());
         return outs;
       }},
      {"allgather in place",
       [](ShmAllreduce& shm, int rank, int n, size_t count, Dtype d) {
         const size_t bytes = count * itemsize(d);
         std::vector<Bytes> outs(static_cast<size_t>(n), Bytes(bytes));
         outs[static_cast<size_t>(rank)] = block(rank, 0, bytes);
         shm.gather(shm.next_ticket(), outs[static_cast<size_t>(rank)].data(), pointers(outs),
                    count, d, -1, soon());
         return outs;
       }},
      {"gather",
       [](ShmAllreduce& shm, int rank, int n, size_t count, Dtype d) {
         const size_t bytes = count * itemsize(d);
         std::vector<Bytes> outs(rank == 1 ? static_cast<size_t>(n) : 0, Bytes(bytes));
         const Bytes in = block(rank, 0, bytes);
         shm.gather(shm.next_ticket(), in.data(), pointers(outs), count, d, 1, soon());
         return outs;
       }},
      {"scatter",
       [](ShmAllreduce& shm, int rank, int n, size_t count, Dtype d) {
         const size_t bytes = count * itemsize(d);
         std::vector<Bytes> ins;
         for (int j = 0; rank == 0 && j < n; ++j) ins.push_back(block(rank, j, bytes));
         Bytes out(bytes);
         shm.scatter(shm.next_ticket(), const_pointers(ins), out.data(), count, d, 0, soon());
         return std::vector<Bytes>{out};
       }},
      {"alltoall",
       [](ShmAllreduce& shm, int rank, int n, size_t count, Dtype d) {
         const size_t bytes = count * itemsize(d);
         std::vector<Bytes> ins, outs(static_cast<size_t>(n), Bytes(bytes));
         for (int j = 0; j < n; ++j) ins.push_back(block(rank, j, bytes));
         shm.alltoall(shm.next_ticket(), const_pointers(ins), pointers(outs), count, d, soon());
         return outs;
       }},
  };
  return all;
}

// Empty, tiny, odd and larger than a channel's slots (several staged steps).
struct Size {
  Dtype d;
  size_t count;
};
const Size kSizes[] = {{kFloat32, 0},      {kFloat32, 1},  {kFloat32, 1001},
                       {kFloat16, 300007}, {kInt64, 1001}, {kUInt8, 1100003}};

// Runs every op at every size on `direct` (single copies always) and `staged`, and requires
// bitwise the same outputs; then that the direct group took the single-copy path for each
// non-empty call and the staged one never did.
void compare_paths(ShmAllreduce& direct, ShmAllreduce& staged, int rank, int n) {
  require(direct.single_copy_bytes() == kAlways && staged.single_copy_bytes() == kNever,
          "rank " + std::to_string(rank) + ": single_copy_bytes() " +
              std::to_string(direct.single_copy_bytes()) + " and " +
              std::to_string(staged.single_copy_bytes()));
  uint64_t calls = 0;
  for (const NamedOp& op : ops()) {
    for (const Size& s : kSizes) {
      const std::vector<Bytes> a = op.run(direct, rank, n, s.count, s.d);
      const std::vector<Bytes> b = op.run(staged, rank, n, s.count, s.d);
      require(a == b, std::string(op.name) + " of " + std::to_string(s.count) +
                          " elements on rank " + std::to_string(rank) +
                          ": the single-copy and staged paths differ");
      calls += s.count > 0;
    }
  }
  require(direct.single_copies() == calls && staged.single_copies() == 0,
          "rank " + std::to_string(rank) + ": " + std::to_string(direct.single_copies()) +
              " single copies over the direct group (want " + std::to_string(calls) + "), " +
              std::to_string(staged.single_copies()) + " over the staged one");
}

// The staged results are right in the first place: rank r ends with what the closed form says.
void check_allgather(ShmAllreduce& shm, int rank, int n) {
  const size_t count = 300007;
  const std::vector<Bytes> outs = ops()[1].run(shm, rank, n, count, kFloat32);
  for (int r = 0; r < n; ++r) {
    require(outs[static_cast<size_t>(r)] == block(r, 0, count * 4),
            "allgather on rank " + std::to_string(rank) + ": block " + std::to_string(r) +
                " is not rank " + std::to_string(r) + "'s input");
  }
}

class ShmSingleCopy : public ::testing::TestWithParam<int> {};

TEST_P(ShmSingleCopy, ProcessesGetBitwiseTheStagedResults) {
  const int n = GetParam();
  run_processes(n, [n](int rank, Store& store) {
    auto direct = make_shm(store, "direct", rank, n, kAlways);
    auto staged = make_shm(store, "staged", rank, n, kNever);
    check_allgather(*staged, rank, n);
    compare_paths(*direct, *staged, rank, n);
  });
}

TEST_P(ShmSingleCopy, ThreadsGetBitwiseTheStagedResults) {
  const int n = GetParam();
  run_threads(n, [n](int rank, Store& store) {
    auto direct = make_shm(store, "direct", rank, n, kAlways);
    auto staged = make_shm(store, "staged", rank, n, kNever);
    compare_paths(*direct, *staged, rank, n);
  });
}

// One rank that refuses single copies (as when the kernel refuses cross-memory attach, or
// EMBER_GLOO_SHM_SINGLE_COPY=0 on that rank) puts the whole group on the staged path, and the
// results are still right; otherwise the group takes the largest threshold any rank asked for.
TEST_P(ShmSingleCopy, OneRefusingRankKeepsTheGroupStaged) {
  const int n = GetParam();
  run_processes(n, [n](int rank, Store& store) {
    auto refused = make_shm(store, "refused", rank, n, rank == n - 1 ? kNever : kAlways);
    require(refused->single_copy_bytes() == kNever,
            "rank " + std::to_string(rank) + ": single_copy_bytes() is " +
                std::to_string(refused->single_copy_bytes()));
    check_allgather(*refused, rank, n);
    require(refused->single_copies() == 0, "a single copy with a refusing rank");
    auto larger = make_shm(store, "larger", rank, n, rank == 0 ? 5000 : 100);
    require(larger->single_copy_bytes() == 5000, "rank " + std::to_string(rank) +
                                                     ": agreed threshold " +
                                                     std::to_string(larger->single_copy_bytes()));
  });
}

// The kernel refusing cross-memory attach for real: the last rank is not dumpable and the others
// lack CAP_SYS_PTRACE (dropped here, for a test run as root), so reading it fails with EPERM.
// Every rank then agrees on the staged path, which still gives the right results.
TEST_P(ShmSingleCopy, KernelRefusalKeepsTheGroupStaged) {
  const int n = GetParam();
  run_processes(n, [n](int rank, Store& store) {
    __user_cap_header_struct h{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct caps[2] = {};
    require(::syscall(SYS_capget, &h, caps) == 0, "capget");
    caps[0].effective &= ~(1u << CAP_SYS_PTRACE);
    require(::syscall(SYS_capset, &h, caps) == 0, "capset");
    if (rank == n - 1) require(::prctl(PR_SET_DUMPABLE, 0) == 0, "PR_SET_DUMPABLE");
    auto shm = make_shm(store, "kernel", rank, n, kAlways);
    require(shm->single_copy_bytes() == kNever,
            "rank " + std::to_string(rank) + ": single_copy_bytes() is " +
                std::to_string(shm->single_copy_bytes()) + " though rank " + std::to_string(n - 1) +
                " cannot be read");
    check_allgather(*shm, rank, n);
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, ShmSingleCopy, ::testing::Values(2, 4),
                         [](const auto& info) { return "n" + std::to_string(info.param); });

// Ranks that pass different counts fail on every rank naming both, even when the counts put
// one rank on the single-copy path and the other on the staged one.
TEST(ShmSingleCopyMismatch, CountsAcrossTheThresholdFailOnEveryRank) {
  run_processes(2, [](int rank, Store& store) {
    auto shm = make_shm(store, "mismatch", rank, 2, 4001);
    const size_t count = rank == 0 ? 1000 : 1001;  // 4000 bytes staged, 4004 single copy
    std::string msg;
    try {
      Bytes in(count * 4), out0(count * 4), out1(count * 4);
      shm->gather(shm->next_ticket(), in.data(), {out0.data(), out1.data()}, count, kFloat32, -1,
                  soon());
    } catch (const std::exception& e) {
      msg = e.what();
    }
    require(msg.find("ranks disagree") != std::string::npos &&
                msg.find("allgather of 1000 elements of float32") != std::string::npos &&
                msg.find("allgather of 1001 elements of float32") != std::string::npos,
            "rank " + std::to_string(rank) + ": " + msg);
  });
}

// Note [single copies when oversubscribed]: with every rank thread pinned to one CPU, a group
// of 2 and of 4 ranks is oversubscribed on any machine, and alltoall and scatter take single
// copies from 256 KiB blocks (bitwise the staged results) while allgather of the same blocks
// and an alltoall of smaller ones stay staged. Ranks pinned to CPUs of their own are not
// oversubscribed, nor is a group where a rank chose the threshold.
class ShmSingleCopyOversubscribed : public ::testing::TestWithParam<int> {};

void pin_to(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  require(::sched_setaffinity(0, sizeof(set), &set) == 0, "sched_setaffinity");
}

// The CPUs this thread may run on, lowest first.
std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  require(::sched_getaffinity(0, sizeof(set), &set) == 0, "sched_getaffinity");
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

TEST_P(ShmSingleCopyOversubscribed, AlltoallAndScatterTakeSingleCopiesFromSmallerBlocks) {
  const int n = GetParam();
  ::unsetenv("EMBER_GLOO_SHM_SINGLE_COPY_BYTES");
  const int cpu = allowed_cpus().front();
  const size_t big = ShmAllreduce::kOversubscribedSingleCopyBytes;  // bytes per block
  run_threads(n, [&](int rank, Store& store) {
    pin_to(cpu);
    auto shm = make_shm(store, "over", rank, n, 0);
    auto staged = make_shm(store, "staged", rank, n, kNever);
    const std::string who = "rank " + std::to_string(rank) + ": ";
    require(shm->heavy_single_copy_bytes() == big && shm->single_copy_bytes() > big,
            who + "thresholds " + std::to_string(shm->heavy_single_copy_bytes()) + " and " +
                std::to_string(shm->single_copy_bytes()));
    const auto& all = ops();
    const auto by_name = [&](const std::string& name) {
      for (const NamedOp& op : all) {
        if (name == op.name) return op.run;
      }
      throw std::logic_error(name);
    };
    struct Case {
      const char* op;
      size_t count;  // uint8 elements per block
      bool single;
    };
    const Case cases[] = {{"alltoall", big, true},
                          {"scatter", big + 3, true},
                          {"alltoall", big - 1, false},
                          {"allgather", big, false},
                          {"broadcast", big, false}};
    for (const Case& c : cases) {
      const uint64_t before = shm->single_copies();
      const auto a = by_name(c.op)(*shm, rank, n, c.count, kUInt8);
      const auto b = by_name(c.op)(*staged, rank, n, c.count, kUInt8);
      require(a == b, who + c.op + " of " + std::to_string(c.count) + " bytes differs from staged");
      require((shm->single_copies() - before == 1) == c.single,
              who + c.op + " of " + std::to_string(c.count) + " bytes per block " +
                  (c.single ? "did not take" : "took") + " a single copy");
    }
  });
}

TEST(ShmSingleCopyNotOversubscribed, RanksWithCpusOfTheirOwnOrAChosenThresholdKeepTheDefault) {
  const std::vector<int> cpus = allowed_cpus();
  ::unsetenv("EMBER_GLOO_SHM_SINGLE_COPY_BYTES");
  if (cpus.size() >= 2) {
    run_threads(2, [&](int rank, Store& store) {
      pin_to(cpus[static_cast<size_t>(rank)]);
      auto shm = make_shm(store, "own", rank, 2, 0);
      require(shm->heavy_single_copy_bytes() == shm->single_copy_bytes(),
              "2 ranks on CPUs of their own: alltoall's threshold is " +
                  std::to_string(shm->heavy_single_copy_bytes()));
    });
  }
  // One rank that chose the threshold (as the variable does) keeps it for every collective.
  const int cpu = cpus.front();
  run_threads(2, [&](int rank, Store& store) {
    pin_to(cpu);
    auto shm = make_shm(store, "chosen", rank, 2, rank == 0 ? size_t{8} << 20 : 0);
    require(shm->heavy_single_copy_bytes() == size_t{8} << 20 &&
                shm->single_copy_bytes() == size_t{8} << 20,
            "a chosen threshold: alltoall's is " + std::to_string(shm->heavy_single_copy_bytes()));
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, ShmSingleCopyOversubscribed, ::testing::Values(2, 4),
                         [](const auto& info) { return "n" + std::to_string(info.param); });

// The switch: 0 turns single copies off, a byte count sets the threshold, nonsense is named.
TEST(ShmSingleCopyEnv, SwitchAndThreshold) {
  const auto with = [](const char* on, const char* bytes) {
    if (on)
      ::setenv("EMBER_GLOO_SHM_SINGLE_COPY", on, 1);
    else
      ::unsetenv("EMBER_GLOO_SHM_SINGLE_COPY");
    if (bytes)
      ::setenv("EMBER_GLOO_SHM_SINGLE_COPY_BYTES", bytes, 1);
    else
      ::unsetenv("EMBER_GLOO_SHM_SINGLE_COPY_BYTES");
    return ShmAllreduce::single_copy_bytes_from_env();
  };
  EXPECT_EQ(with("0", "4096"), kNever);
  EXPECT_EQ(with("1", "4096"), 4096u);
  EXPECT_EQ(with(nullptr, "123"), 123u);
  EXPECT_GT(with(nullptr, nullptr), 0u);
  EXPECT_LT(with(nullptr, nullptr), kNever);
  EXPECT_THROW(with("2", nullptr), ValueError);
  EXPECT_THROW(with(nullptr, "0"), ValueError);
  EXPECT_THROW(with(nullptr, "1k"), ValueError);
  with(nullptr, nullptr);
}

}  // namespace
}  // namespace ember::dist
