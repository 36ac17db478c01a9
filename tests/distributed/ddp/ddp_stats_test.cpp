// DistributedDataParallel::stats() and the straggler report, used as a training loop would:
// ranks are threads of this process (ProcessGroupThreads), collectives delayed by a
// DelayingGroup so that communication takes measurable time.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <numeric>
#include <thread>

#include <ember/distributed/ddp/comm_hooks.h>
#include <ember/distributed/ddp/compression_hooks.h>
#include <ember/distributed/ddp/ddp.h>
#include <ember/distributed/debug/stragglers.h>
#include <ember/nn/layers/activation.h>
#include <ember/nn/layers/container.h>
#include <ember/nn/layers/linear.h>
#include "tests/distributed/ddp/ddp_test_util.h"
#include "tests/distributed/backends/threads_test_util.h"

namespace ember::dist {
namespace {

using namespace std::chrono_literals;
using test::Batch;
using test::loss_of;
using test::require;

constexpr int64_t kIn = 5, kOut = 3, kRows = 8;

std::shared_ptr<nn::Sequential> make_model() {
  manual_seed(7);
  return std::make_shared<nn::Sequential>(std::make_shared<nn::Linear>(kIn, 16),
                                          std::make_shared<nn::Tanh>(),
                                          std::make_shared<nn::Linear>(16, kOut));
}

Batch make_batch() {
  manual_seed(8);
  return {randn({kRows, kIn}), randn({kRows, kOut})};
}

test::ThreadsSetup delayed(int n) {
  test::ThreadsSetup s;
  s.n = n;
  s.delay = DelayOptions{.cycles = 0, .cpu_delay = 5ms, .scale = 1.0};
  return s;
}

DDPOptions small_buckets() {
  DDPOptions o;
  o.bucket_cap_mb = 200.0 / (1024 * 1024);  // several buckets
  o.first_bucket_cap_mb = o.bucket_cap_mb;
  return o;
}

TEST(DDPStats, CountsBucketsIterationsAndTimesCommunication) {
  std::vector<std::shared_ptr<nn::Sequential>> models{make_model(), make_model()};
  const Batch batch = make_batch();
  test::run_threads(delayed(2), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    DistributedDataParallel ddp(models[rank], pg, small_buckets());
    DDPStats s = ddp.stats();
    require(s.iterations == 0 && s.world_size == 2 && s.rank == rank, "fresh stats");
    require(s.backend == pg->backend_name(), "backend " + s.backend);
    require(s.comm_hook.empty(), "no hook registered, got '" + s.comm_hook + "'");
    for (int i = 0; i < 3; ++i) loss_of(ddp, batch).backward();
    {
      auto guard = ddp.no_sync();  // not synchronised: not timed
      loss_of(ddp, batch).backward();
    }
    s = ddp.stats();
    require(s.iterations == 3, "3 synchronised iterations, got " + std::to_string(s.iterations));
    require(s.parameters == 4, "4 parameters, got " + std::to_string(s.parameters));
    require(s.bucket_count == static_cast<int64_t>(ddp.bucket_indices().size()) &&
                s.bucket_count > 1,
            "bucket count " + std::to_string(s.bucket_count));
    require(std::accumulate(s.bucket_bytes.begin(), s.bucket_bytes.end(), int64_t{0}) ==
                int64_t{4} * ((kIn + 1) * 16 + (16 + 1) * kOut),
            "the buckets hold every parameter's bytes");
    require(s.rebuilds == 1 && ddp.buckets_rebuilt(), "one rebuild after the first iteration");
    require(s.unused_parameters == 0, "every parameter used");
    // Each collective's result is held back 5 ms: communication takes at least that, and the
    // end of backward waits for most of it.
    require(s.communication.last_ms >= 4.5 && s.communication.mean_ms >= 4.5,
            "communication " + std::to_string(s.communication.last_ms) + " ms");
    require(s.exposed_communication.last_ms > 0 &&
                s.exposed_communication.last_ms <= s.communication.last_ms + 1e-6,
            "exposed communication " + std::to_string(s.exposed_communication.last_ms) + " ms");
    require(s.overlapped_communication.last_ms <= s.communication.last_ms + 1e-6,
            "overlap within communication");
    require(s.forward.last_ms > 0 && s.backward.last_ms > 0, "forward and backward timed");
  });
}

TEST(DDPStats, NamesTheCommHookAndCountsUnusedParameters) {
  const Batch batch = make_batch();
  struct Hooked {
    std::string want;
    std::function<void(DistributedDataParallel&)> register_hook;
  };
  const std::vector<Hooked> cases = {
      {"fp16_compress", [](auto& d) { d.register_comm_hook(fp16_compress_hook); }},
      {"allreduce", [](auto& d) { d.register_comm_hook(allreduce_hook); }},
      {"custom", [](auto& d) { d.register_comm_hook([](GradBucket& b) { return allreduce_hook(b); }); }},
      {"mine", [](auto& d) { d.register_comm_hook(allreduce_hook, "mine"); }},
  };
  for (const Hooked& c : cases) {
    std::vector<std::shared_ptr<nn::Sequential>> models{make_model(), make_model()};
    test::ThreadsSetup s;
    s.n = 2;
    test::run_threads(s, [&](std::shared_ptr<ProcessGroup> pg, int rank) {
      DDPOptions o;
      o.find_unused_parameters = true;
      // A third layer that forward never uses: its weight and bias get no gradient.
      auto model = models[rank];
      model->push_back(std::make_shared<nn::Linear>(kOut, 2));
      struct FirstThree : nn::Module {
        std::shared_ptr<nn::Sequential> m;
        explicit FirstThree(std::shared_ptr<nn::Sequential> s) : m(std::move(s)) {
          register_module("m", m);
        }
        std::string name() const override { return "FirstThree"; }
        Tensor forward(const Tensor& x) override {
          Tensor y = x;
          for (size_t i = 0; i < 3; ++i) y = (*m)[i]->forward(y);
          return y;
        }
      };
      DistributedDataParallel ddp(std::make_shared<FirstThree>(model), pg, o);
      c.register_hook(ddp);
      loss_of(ddp, batch).backward();
      const DDPStats st = ddp.stats();
      require(st.comm_hook == c.want, "hook name '" + st.comm_hook + "', want '" + c.want + "'");
      require(st.unused_parameters == 2,
              "2 unused parameters, got " + std::to_string(st.unused_parameters));
      require(st.find_unused_parameters, "the option is reported");
    });
  }
}

// Note [DDP bytes]: DDP's own all-reduce counts as a ring moves it; hooks count what they send;
// a hook that does not count leaves the bytes unknown (-1).
TEST(DDPStats, CountsTheBytesEachBucketSent) {
  const Batch batch = make_batch();
  struct Case {
    const char* name;
    std::function<void(DistributedDataParallel&)> hook;
    std::function<void(const DDPStats&)> check;
  };
  const std::vector<Case> cases = {
      {"no hook", nullptr,
       [](const DDPStats& s) {
         int64_t want = 0;
         for (size_t i = 0; i < s.bucket_bytes.size(); ++i) {
           EXPECT_EQ(s.bucket_bytes_sent[i], s.bucket_bytes[i] * 2 * 3 / 4) << i;  // 4 ranks
           want += s.bucket_bytes[i] * 2 * 3 / 4;
         }
         EXPECT_EQ(s.bytes_sent, want);
         EXPECT_EQ(s.allreduce_bytes, want);
         EXPECT_DOUBLE_EQ(s.compression_ratio, 1.0);
       }},
      {"fp16", [](DistributedDataParallel& d) { d.register_comm_hook(fp16_compress_hook); },
       [](const DDPStats& s) {
         EXPECT_EQ(s.bytes_sent * 2, s.allreduce_bytes);
         EXPECT_DOUBLE_EQ(s.compression_ratio, 2.0);
       }},
      {"sign",
       [](DistributedDataParallel& d) {
         d.register_comm_hook(std::make_shared<CompressionState>(), sign_compress_hook, "sign");
       },
       [](const DDPStats& s) {
         EXPECT_GT(s.bytes_sent, 0);
         EXPECT_GT(s.compression_ratio, 3.0);  // tiny buckets: the scales weigh
       }},
      {"a hook that does not count",
       [](DistributedDataParallel& d) {
         d.register_comm_hook([](GradBucket& b) {
           Tensor buffer = b.buffer();
           AllreduceOptions avg;
           avg.op = ReduceOp::Avg;
           return b.process_group().allreduce(buffer, avg)->future();
         });
       },
       [](const DDPStats& s) {
         EXPECT_EQ(s.bytes_sent, -1);
         for (int64_t n : s.bucket_bytes_sent) EXPECT_EQ(n, -1);
         EXPECT_EQ(s.compression_ratio, 0.0);
       }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<std::shared_ptr<nn::Sequential>> models;
    for (int r = 0; r < 4; ++r) models.push_back(make_model());
    test::ThreadsSetup setup;
    setup.n = 4;
    test::run_threads(setup, [&](std::shared_ptr<ProcessGroup> pg, int rank) {
      DistributedDataParallel ddp(models[rank], pg, small_buckets());
      if (c.hook) c.hook(ddp);
      for (int step = 0; step < 2; ++step) {
        models[rank]->zero_grad();
        loss_of(ddp, test::slice(batch, rank, 4)).backward();
      }
      const DDPStats s = ddp.stats();
      ASSERT_EQ(s.bucket_bytes_sent.size(), s.bucket_bytes.size());
      ASSERT_GT(s.bucket_count, 1);
      if (rank == 0) c.check(s);
    });
  }
}

TEST(Stragglers, GathersEveryRanksTimesAndNamesTheSlowest) {
  test::ThreadsSetup s;
  s.n = 3;
  std::mutex mu;
  std::vector<std::string> reports;
  test::run_threads(s, [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    // As in synchronous training: every step about as long, the others waiting for rank 1.
    const StepTimes mine{15.0 + rank, 0.5 * rank, rank == 1 ? 1.0 : 6.0};
    const std::vector<StepTimes> all = gather_step_times(*pg, mine);
    require(all.size() == 3, "one entry per rank");
    for (int r = 0; r < 3; ++r) {
      require(all[r].step_ms == 15.0 + r && all[r].data_ms == 0.5 * r,
              "rank " + std::to_string(r) + "'s times");
    }
    require(slowest_rank(all) == 1, "rank 1 is the slowest");
    std::lock_guard<std::mutex> lock(mu);
    reports.push_back(straggler_report(all));
  });
  ASSERT_EQ(reports.size(), 3u);
  EXPECT_EQ(reports[0], reports[1]);
  EXPECT_EQ(reports[0],
            "step time over 3 ranks: min 15.0 ms (rank 0), median 16.0 ms, max 17.0 ms (rank 2); "
            "slowest rank 1: busy 15.0 ms (+36.4% over the median), data 0.5 ms, compute 14.5 ms, "
            "waiting on communication 1.0 ms");
}

TEST(Stragglers, RejectsBadTimesAndEmptyLists) {
  EXPECT_THROW(straggler_report({}), ValueError);
  EXPECT_THROW(slowest_rank({}), ValueError);
  test::ThreadsSetup s;
  s.n = 1;
  test::run_threads(s, [&](std::shared_ptr<ProcessGroup> pg, int) {
    try {
      gather_step_times(*pg, {-1, 0, 0});
      FAIL() << "a negative step time was accepted";
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("gather_step_times"), std::string::npos) << e.what();
    }
    EXPECT_EQ(straggler_report(gather_step_times(*pg, {4, 1, 1})),
              "step time over 1 rank: min 4.0 ms (rank 0), median 4.0 ms, max 4.0 ms (rank 0); "
              "slowest rank 0: busy 3.0 ms (+0.0% over the median), data 1.0 ms, compute 2.0 ms, "
              "waiting on communication 1.0 ms");
  });
}

}  // namespace
}  // namespace ember::dist
