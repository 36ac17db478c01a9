// The mapped reductions (Note [mapped reductions] in distributed/backends/shm_mapped.cpp), driven through
// ShmAllreduce itself: allreduce, reduce and reduce_scatter over buffers from empty_shareable()
// on a group that allows single copies must give bitwise what the staged path gives over
// ordinary buffers, take the mapped path exactly when every rank's buffers are shareable and
// large enough, and fail by name when a peer's buffer cannot be mapped. Ranks are forked
// processes (each maps its peers' memfds) and threads of this process (buffers used in place).
#include <ember/distributed/backends/detail/shareable.h>
#include <ember/distributed/backends/detail/shm_kernels.h>
#include <ember/distributed/backends/shareable.h>
#include <ember/tensor/ops/creation.h>
#include <gtest/gtest.h>
#include <linux/capability.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "tests/distributed/backends/shm_test_util.h"

namespace ember::dist {
namespace {

using ember::dist::detail::ShmAllreduce;
using ember::dist::detail::pg_gloo::shm_reduction;
using test::make_shm;
using test::require;
using test::run_processes;
using test::run_threads;
using test::soon;
using Bytes = std::vector<uint8_t>;

constexpr size_t kAlways = 1;
constexpr size_t kNever = SIZE_MAX;

Bytes bytes_of(const Tensor& t) {
  Bytes b(static_cast<size_t>(t.nbytes()));
  std::memcpy(b.data(), t.data_ptr(), b.size());
  return b;
}

// Rank r's values for element i (j: which of a rank's tensors): small integers, exact in every
// dtype used, different on every rank so that the reduction order would show.
double value(int rank, int j, int64_t i) { return static_cast<double>((i * 7 + rank * 31 + j * 13) % 61) - 30; }

// A 1-d tensor of `count` elements, shareable or not, holding rank's values.
Tensor input(int rank, int j, int64_t count, Dtype d, bool shareable) {
  Tensor t = shareable ? empty_shareable({count}, d) : empty({count}, d);
  EMBER_DISPATCH_NUMERIC(d, "test input", [&]<typename T>() {
    T* p = t.template data<T>();
    for (int64_t i = 0; i < count; ++i) p[i] = static_cast<T>(static_cast<float>(value(rank, j, i)));
  });
  return t;
}

// One reduction of `count` elements of `d` per rank on `shm` over shareable buffers or not;
// returns every byte this rank ends with.
using Op = std::function<std::vector<Bytes>(ShmAllreduce& shm, int rank, int n, int64_t count,
                                            Dtype d, bool shareable)>;
struct NamedOp {
  const char* name;
  Op run;
  bool mappable;  // takes the mapped path when the buffers are shareable and large enough
};

std::vector<NamedOp> ops() {
  auto allreduce = [](ReduceOp op) {
    return [op](ShmAllreduce& shm, int rank, int, int64_t count, Dtype d, bool shareable) {
      Tensor t = input(rank, 0, count, d, shareable);
      const auto r = shm_reduction(d, op);
      shm.run(shm.next_ticket(), {{t.data_ptr(), static_cast<size_t>(count)}}, d, op, r.fn,
              r.divide, soon());
      return std::vector<Bytes>{bytes_of(t)};
    };
  };
  return {
      {"allreduce sum", allreduce(ReduceOp::Sum), true},
      {"allreduce avg", allreduce(ReduceOp::Avg), true},
      {"allreduce max", allreduce(ReduceOp::Max), true},
      {"allreduce of two spans",  // coalesced: not one buffer, so staged
       [](ShmAllreduce& shm, int rank, int, int64_t count, Dtype d, bool shareable) {
         Tensor a = input(rank, 0, count / 2, d, shareable);
         Tensor b = input(rank, 1, count - count / 2, d, shareable);
         const auto r = shm_reduction(d, ReduceOp::Sum);
         shm.run(shm.next_ticket(),
                 {{a.data_ptr(), static_cast<size_t>(a.numel())},
                  {b.data_ptr(), static_cast<size_t>(b.numel())}},
                 d, ReduceOp::Sum, r.fn, r.divide, soon());
         return std::vector<Bytes>{bytes_of(a), bytes_of(b)};
       },
       false},
      {"reduce to rank 1",  // the others' buffers must be left as they were
       [](ShmAllreduce& shm, int rank, int, int64_t count, Dtype d, bool shareable) {
         Tensor t = input(rank, 0, count, d, shareable);
         shm.reduce(shm.next_ticket(), t.data_ptr(), static_cast<size_t>(count), d,
                    shm_reduction(d, ReduceOp::Sum), 1, soon());
         return std::vector<Bytes>{bytes_of(t)};
       },
       true},
      {"reduce_scatter of a list",
       [](ShmAllreduce& shm, int rank, int n, int64_t count, Dtype d, bool shareable) {
         std::vector<Tensor> blocks;
         std::vector<const void*> ptrs;
         for (int j = 0; j < n; ++j) {
           blocks.push_back(input(rank, j, count, d, shareable));
           ptrs.push_back(blocks.back().data_ptr());
         }
         Tensor out = empty({count}, d);
         shm.reduce_scatter(shm.next_ticket(), ptrs, out.data_ptr(), static_cast<size_t>(count),
                            d, shm_reduction(d, ReduceOp::Avg), soon());
         return std::vector<Bytes>{bytes_of(out)};
       },
       true},
      {"reduce_scatter in place",  // blocks of one tensor, the output this rank's block
       [](ShmAllreduce& shm, int rank, int n, int64_t count, Dtype d, bool shareable) {
         Tensor all = input(rank, 0, count * n, d, shareable);
         std::vector<const void*> ptrs;
         for (int j = 0; j < n; ++j) {
           ptrs.push_back(static_cast<const char*>(all.data_ptr()) + j * count * itemsize(d));
         }
         shm.reduce_scatter(shm.next_ticket(), ptrs, const_cast<void*>(ptrs[rank]),
                            static_cast<size_t>(count), d, shm_reduction(d, ReduceOp::Sum),
                            soon());
         return std::vector<Bytes>{bytes_of(all)};
       },
       true},
  };
}

struct Size {
  Dtype d;
  int64_t count;
};
// Below kMappedMinBytes (staged either way), just above it, odd counts, float16's rounding.
const Size kSizes[] = {{kFloat32, 1001},
                       {kInt64, 40009},
                       {kFloat16, 300007},
                       {kFloat32, 600011}};

bool large(const Size& s) {
  return static_cast<size_t>(s.count) * itemsize(s.d) >= ShmAllreduce::kMappedMinBytes;
}

// Every op at every size on `mapped` (single copies on) over shareable buffers, where
// `shareable(rank)` says, and on `staged` (single copies off) over ordinary ones: bitwise the
// same; the mapped path taken exactly when every rank's buffers are shareable (`all`).
void compare_paths(ShmAllreduce& mapped, ShmAllreduce& staged, int rank, int n, bool mine,
                   bool all) {
  uint64_t want = mapped.mapped_reductions();
  for (const NamedOp& op : ops()) {
    for (const Size& s : kSizes) {
      const std::vector<Bytes> a = op.run(mapped, rank, n, s.count, s.d, mine);
      const std::vector<Bytes> b = op.run(staged, rank, n, s.count, s.d, false);
      require(a == b, std::string(op.name) + " of " + std::to_string(s.count) + " elements of " +
                          std::string(dtype_name(s.d)) + " on rank " + std::to_string(rank) +
                          ": the mapped and staged paths differ");
      want += all && op.mappable && large(s);
    }
  }
  require(mapped.mapped_reductions() == want && staged.mapped_reductions() == 0,
          "rank " + std::to_string(rank) + ": " + std::to_string(mapped.mapped_reductions()) +
              " mapped reductions (want " + std::to_string(want) + "), " +
              std::to_string(staged.mapped_reductions()) + " on the staged group");
}

// The staged results are right in the first place: an allreduce's sum is the closed form.
void check_sum(ShmAllreduce& shm, int rank, int n) {
  const int64_t count = 600011;
  const std::vector<Bytes> got = ops()[0].run(shm, rank, n, count, kFloat32, true);
  const auto* p = reinterpret_cast<const float*>(got[0].data());
  for (int64_t i = 0; i < count; ++i) {
    double want = 0;
    for (int r = 0; r < n; ++r) want += value(r, 0, i);
    if (p[i] != static_cast<float>(want)) {
      require(false, "rank " + std::to_string(rank) + ": element " + std::to_string(i) + " is " +
                         std::to_string(p[i]) + ", not " + std::to_string(want));
    }
  }
}

class ShmMapped : public ::testing::TestWithParam<int> {};

TEST_P(ShmMapped, ProcessesGetBitwiseTheStagedResults) {
  const int n = GetParam();
  run_processes(n, [n](int rank, Store& store) {
    auto mapped = make_shm(store, "mapped", rank, n, kAlways);
    auto staged = make_shm(store, "staged", rank, n, kNever);
    check_sum(*mapped, rank, n);
    const uint64_t before = mapped->mapped_reductions();
    require(before == 1, "the closed-form allreduce did not take the mapped path");
    compare_paths(*mapped, *staged, rank, n, true, true);
  });
}

TEST_P(ShmMapped, ThreadsGetBitwiseTheStagedResults) {
  const int n = GetParam();
  run_threads(n, [n](int rank, Store& store) {
    auto mapped = make_shm(store, "mapped", rank, n, kAlways);
    auto staged = make_shm(store, "staged", rank, n, kNever);
    compare_paths(*mapped, *staged, rank, n, true, true);
  });
}

// One rank with ordinary buffers keeps the whole collective staged, with the same results.
TEST_P(ShmMapped, OneOrdinaryBufferKeepsTheCollectiveStaged) {
  const int n = GetParam();
  run_processes(n, [n](int rank, Store& store) {
    auto mapped = make_shm(store, "mixed", rank, n, kAlways);
    auto staged = make_shm(store, "staged", rank, n, kNever);
    compare_paths(*mapped, *staged, rank, n, rank != n - 1, false);
  });
}

// A group whose ranks cannot read each other (single copies off) never maps.
TEST_P(ShmMapped, NoSingleCopiesNoMapping) {
  const int n = GetParam();
  run_processes(n, [n](int rank, Store& store) {
    auto off = make_shm(store, "off", rank, n, rank == 0 ? kNever : kAlways);
    auto staged = make_shm(store, "staged", rank, n, kNever);
    compare_paths(*off, *staged, rank, n, true, false);
  });
}

// A peer's mapping keeps a freed region's memory alive: once its owner has freed regions, the
// next reduction drops every mapping of that owner it does not use, and a region still in use
// is mapped once, not per call.
TEST_P(ShmMapped, MappingsOfFreedRegionsAreDropped) {
  const int n = GetParam();
  run_processes(n, [n](int rank, Store& store) {
    auto shm = make_shm(store, "freed", rank, n, kAlways);
    const auto peers = static_cast<size_t>(n - 1);
    const auto allreduce = ops()[0].run;
    const auto require_mapped = [&](size_t want, const char* when) {
      require(shm->mapped_regions() == want,
              "rank " + std::to_string(rank) + " " + when + ": " +
                  std::to_string(shm->mapped_regions()) + " regions mapped, want " +
                  std::to_string(want));
    };
    Tensor kept = input(rank, 0, 100003, kFloat32, true);
    for (int i = 0; i < 3; ++i) {
      const auto r = shm_reduction(kFloat32, ReduceOp::Sum);
      shm->run(shm->next_ticket(), {{kept.data_ptr(), 100003}}, kFloat32, ReduceOp::Sum, r.fn,
               nullptr, soon());
    }
    require_mapped(peers, "after 3 calls on one tensor");
    allreduce(*shm, rank, n, 100003, kFloat32, true);  // a tensor made and freed
    require_mapped(2 * peers, "with a freed peer region not yet noticed");
    allreduce(*shm, rank, n, 100003, kFloat32, true);
    require_mapped(peers, "after the owners freed theirs");
    require(shm->mapped_reductions() == 5, "not every call was mapped");
  });
}

// The collectives that only move data (Note [single-copy collectives]) read a shareable peer
// buffer from its mapping instead of with cross-memory attach: same bytes as staged, and the
// peers' regions end up mapped here.
TEST_P(ShmMapped, SingleCopiesReadShareablePeersThroughTheirMappings) {
  const int n = GetParam();
  run_processes(n, [n](int rank, Store& store) {
    auto direct = make_shm(store, "direct", rank, n, kAlways);
    auto staged = make_shm(store, "staged", rank, n, kNever);
    const int64_t count = 300007;
    for (bool shareable : {true, false}) {
      Tensor b = input(rank, 0, count, kFloat32, shareable);
      direct->broadcast(direct->next_ticket(), b.data_ptr(), count, kFloat32, n - 1, soon());
      Tensor b2 = input(rank, 0, count, kFloat32, false);
      staged->broadcast(staged->next_ticket(), b2.data_ptr(), count, kFloat32, n - 1, soon());
      require(bytes_of(b) == bytes_of(b2), "broadcast on rank " + std::to_string(rank));
      std::vector<Tensor> ins, outs, outs2;
      std::vector<const void*> in_ptrs;
      std::vector<void*> out_ptrs, out_ptrs2;
      for (int j = 0; j < n; ++j) {
        ins.push_back(input(rank, j, count, kFloat32, shareable));
        in_ptrs.push_back(ins.back().data_ptr());
        outs.push_back(empty({count}, kFloat32));
        outs2.push_back(empty({count}, kFloat32));
        out_ptrs.push_back(outs.back().data_ptr());
        out_ptrs2.push_back(outs2.back().data_ptr());
      }
      direct->alltoall(direct->next_ticket(), in_ptrs, out_ptrs, count, kFloat32, soon());
      staged->alltoall(staged->next_ticket(), in_ptrs, out_ptrs2, count, kFloat32, soon());
      for (int j = 0; j < n; ++j) {
        require(bytes_of(outs[j]) == bytes_of(outs2[j]), "alltoall on rank " + std::to_string(rank));
      }
      direct->gather(direct->next_ticket(), in_ptrs[0], out_ptrs, count, kFloat32, -1, soon());
      staged->gather(staged->next_ticket(), in_ptrs[0], out_ptrs2, count, kFloat32, -1, soon());
      for (int j = 0; j < n; ++j) {
        require(bytes_of(outs[j]) == bytes_of(outs2[j]), "allgather on rank " + std::to_string(rank));
      }
      // Shareable peers were read through their mappings (cross-memory attach maps nothing).
      require((direct->mapped_regions() > 0) == shareable,
              "rank " + std::to_string(rank) + ": " + std::to_string(direct->mapped_regions()) +
                  " regions mapped after the " + (shareable ? "shareable" : "ordinary") + " calls");
    }
    require(direct->single_copies() == 6, "not every call took the single-copy path");
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, ShmMapped, ::testing::Values(2, 4),
                         [](const auto& info) { return "n" + std::to_string(info.param); });

// Drops CAP_SYS_PTRACE from this process (effective and permitted, so that every rank holds the
// same capabilities, which the kernel compares): for a test run as root, a rank that is not
// dumpable then cannot be read or mapped.
void drop_ptrace() {
  __user_cap_header_struct h{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct caps[2] = {};
  require(::syscall(SYS_capget, &h, caps) == 0, "capget");
  caps[0].effective &= ~(1u << CAP_SYS_PTRACE);
  caps[0].permitted &= ~(1u << CAP_SYS_PTRACE);
  require(::syscall(SYS_capset, &h, caps) == 0, "capset");
}

// A peer that cannot be mapped when the group is made: the group agrees to stay staged, and the
// reductions over shareable tensors are still right.
TEST(ShmMappedRefused, AnUnmappablePeerAtTheStartKeepsReductionsStaged) {
  const int n = 3;
  run_processes(n, [n](int rank, Store& store) {
    drop_ptrace();
    if (rank == n - 1) require(::prctl(PR_SET_DUMPABLE, 0) == 0, "PR_SET_DUMPABLE");
    auto shm = make_shm(store, "refused", rank, n, kAlways);
    auto staged = make_shm(store, "staged", rank, n, kNever);
    compare_paths(*shm, *staged, rank, n, true, false);
  });
}

// The mapping refused after the group agreed on it (the last rank stops being dumpable): the
// ranks that cannot map it fail naming it; the last rank fails through the abort word, naming
// the rank that gave up and why.
TEST(ShmMappedRefused, AnUnmappablePeerLaterFailsEveryRankByName) {
  const int n = 3;
  run_processes(n, [n](int rank, Store& store) {
    drop_ptrace();
    auto shm = make_shm(store, "refused", rank, n, kAlways);
    if (rank == n - 1) require(::prctl(PR_SET_DUMPABLE, 0) == 0, "PR_SET_DUMPABLE");
    std::string msg;
    try {
      ops()[0].run(*shm, rank, n, 600011, kFloat32, true);
    } catch (const std::exception& e) {
      msg = e.what();
      shm->abort(msg);
    }
    // A rank that failed frees its buffer, so a slower rank may fail mapping that one instead
    // of rank 2's: every rank fails naming a buffer it cannot map, and some rank names rank 2's.
    store.set("msg/" + std::to_string(rank), test::to_bytes(msg));
    bool named = false;
    for (int r = 0; r < n; ++r) {
      named = named || test::to_string(store.get("msg/" + std::to_string(r), std::chrono::seconds(60)))
                               .find("cannot map rank 2's shareable buffer") != std::string::npos;
    }
    const std::string who = "rank " + std::to_string(rank) + ": ";
    require(named, who + "no rank named rank 2's buffer");
    require(msg.find("cannot map rank ") != std::string::npos &&
                msg.find("EMBER_GLOO_SHM_SINGLE_COPY=0") != std::string::npos,
            who + msg);
    // Rank 2 hears that the others gave up, unless it tried to map a buffer a failed rank had
    // already freed: then it names that one, as above.
    if (rank == n - 1) {
      require(msg.find("gave up") != std::string::npos ||
                  msg.find("shareable buffer") != std::string::npos,
              who + msg);
    }
  });
}

// empty_shareable() as a user sees it.
TEST(EmptyShareable, ZeroFilledRegisteredAndGivenBack) {
  Tensor t = empty_shareable({3, 5}, kFloat64);
  EXPECT_EQ(t.shape(), Shape({3, 5}));
  EXPECT_EQ(t.dtype(), kFloat64);
  EXPECT_TRUE(t.is_contiguous());
  const auto* p = t.data<double>();
  for (int i = 0; i < 15; ++i) EXPECT_EQ(p[i], 0.0);
  EXPECT_TRUE(is_shareable(t));
  EXPECT_TRUE(is_shareable(t.select(0, 1)));
  EXPECT_FALSE(is_shareable(zeros({3, 5}, kFloat64)));
  EXPECT_FALSE(is_shareable(Tensor()));
  const void* at = t.data_ptr();
  EXPECT_TRUE(ember::dist::detail::find_shareable(at, 15 * 8).has_value());
  EXPECT_FALSE(ember::dist::detail::find_shareable(at, 1 << 20).has_value());  // past its end
  t = Tensor();
  EXPECT_FALSE(ember::dist::detail::find_shareable(at, 8).has_value());
  Tensor none = empty_shareable({0}, kFloat32);
  EXPECT_EQ(none.numel(), 0);
  EXPECT_THROW(empty_shareable({2}, TensorOptions(kFloat32).device(Device("cuda"))), ValueError);
  EXPECT_THROW(empty_shareable({-1}, kFloat32), ValueError);
}

}  // namespace
}  // namespace ember::dist
