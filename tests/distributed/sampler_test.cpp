// dist::distributed_sampler: torch's DistributedSampler(dataset) with the replicas and the rank
// read from the default group (or a given one).
#include <gtest/gtest.h>

#include <chrono>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <ember/distributed/init.h>
#include <ember/distributed/sampler.h>
#include <ember/distributed/store/hash_store.h>
#include "tests/distributed/store/store_test_util.h"
#include "tests/tensor/test_util.h"

namespace ember::dist {
namespace {

using namespace std::chrono_literals;
using test::expect_error;

TEST(DistributedSampler, WithoutAGroupSaysWhatToDo) {
  ASSERT_FALSE(is_initialized());
  expect_error<ValueError>([] { (void)distributed_sampler(10); },
                           {"[distributed_sampler]", "not initialized",
                            "dist::init_process_group()", "nn::data::DistributedSampler"});
}

// Three rank threads, each with its own default group (the threads backend): each sampler is
// nn::data::DistributedSampler(n, 3, rank), and together they cover the data set; a sub-group
// given in the options splits over its own ranks.
TEST(DistributedSampler, TakesTheReplicasAndRankFromTheGroup) {
  constexpr int n = 3;
  auto store = std::make_shared<HashStore>();
  std::vector<std::vector<int64_t>> seen(n);
  std::vector<std::string> failures(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        InitOptions o;
        o.store = store;
        o.rank = r;
        o.world_size = n;
        o.backend = "threads";
        o.timeout = 60s;
        init_process_group(o);
        nn::data::TensorDataset data(zeros({10, 2}), zeros({10}));
        auto s = distributed_sampler(data, {.seed = 7});
        nn::data::DistributedSampler want(10, n, r, /*shuffle=*/true, /*seed=*/7);
        s->set_epoch(2);
        want.set_epoch(2);
        test::require(s->num_replicas() == n && s->rank() == r, "replicas and rank");
        seen[r] = s->indices();
        test::require(seen[r] == want.indices(), "the same indices as the explicit sampler");
        auto pair = new_group({0, 2});  // every rank calls it; rank 1 is not a member
        if (pair) {
          auto p = distributed_sampler(10, {.group = pair, .shuffle = false, .drop_last = true});
          test::require(p->num_replicas() == 2 && p->rank() == r / 2 && p->size() == 5,
                        "the sub-group's share");
        }
        destroy_process_group();
      } catch (const std::exception& e) {
        failures[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) ASSERT_EQ(failures[r], "") << "rank " << r;
  std::set<int64_t> all;
  for (const auto& v : seen) {
    EXPECT_EQ(v.size(), 4u);  // ceil(10 / 3), padded
    all.insert(v.begin(), v.end());
  }
  EXPECT_EQ(all.size(), 10u);
}

}  // namespace
}  // namespace ember::dist
