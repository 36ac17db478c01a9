// Hooks by name (make_comm_hook) and as plug-ins (load_comm_hook_plugin), on rank threads. The
// plug-ins are tests/distributed/ddp/plugins/hook_plugin.cpp built as a user would build one, and
// broken ways (tests/CMakeLists.txt).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>

#include <ember/distributed/backends/process_group_threads.h>
#include <ember/distributed/ddp/compression_hooks.h>
#include <ember/distributed/ddp/ddp.h>
#include <ember/distributed/ddp/hook_registry.h>
#include <ember/distributed/init.h>
#include <ember/nn/layers/linear.h>
#include <ember/tensor/ops/creation.h>
#include "tests/distributed/backends/threads_test_util.h"

namespace ember::dist {
namespace {

std::string plugin(const std::string& variant) {
  return std::string(EMBER_TEST_PLUGIN_DIR) + "/libtest_hook_plugin_" + variant + ".so";
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

#define EXPECT_MENTIONS(text, part) EXPECT_NE((text).find(part), std::string::npos) << (text)

// Rank r's bucket: r + i / 100.
Tensor input(int rank, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = static_cast<float>(rank) + i / 100.0f;
  return from_vector(v);
}

// One bucket through the hook that hook_of(rank, group) makes, on 2 rank threads; rank 0's result.
std::vector<float> run_once(const std::function<CommHook(int, std::shared_ptr<ProcessGroup>)>& hook_of,
                            int64_t n = 200) {
  std::vector<float> out;
  test::ThreadsSetup setup;
  setup.n = 2;
  test::run_threads_or_throw(setup, [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    CommHook hook = hook_of(rank, pg);
    GradBucket bucket(0, 1, input(rank, n), {zeros({n})}, {0}, pg);
    Tensor got = hook(bucket)->value().at(0);
    if (rank == 0) out = got.to_vector<float>();
  });
  return out;
}

TEST(HookRegistry, ListsTheBuiltIns) {
  const auto hooks = registered_comm_hooks();
  for (const char* name : {"allreduce", "fp16", "bf16", "noop", "powersgd", "batched_powersgd",
                           "quantization_pertensor", "quantization_perchannel", "int8", "sign",
                           "topk", "post_localsgd"}) {
    auto it = std::find_if(hooks.begin(), hooks.end(), [&](const auto& h) { return h.name == name; });
    ASSERT_NE(it, hooks.end()) << name;
    EXPECT_EQ(it->origin, "built-in");
    EXPECT_FALSE(it->description.empty());
  }
}

TEST(HookRegistry, AHookByNameEqualsTheHookItself) {
  const auto by_name = run_once([](int, std::shared_ptr<ProcessGroup> pg) {
    return make_comm_hook("topk:ratio=0.05,error_feedback=0", pg).hook;
  });
  const auto direct = run_once([](int, std::shared_ptr<ProcessGroup>) {
    return bind_hook(std::make_shared<CompressionState>(
                         CompressionOptions{.error_feedback = false, .topk_ratio = 0.05}),
                     topk_compress_hook);
  });
  EXPECT_EQ(by_name, direct);
  // The options every compressing hook takes, and the ones only one does.
  const auto sign_by_name = run_once([](int, std::shared_ptr<ProcessGroup> pg) {
    return make_comm_hook("sign:block=64,momentum=0.5", pg).hook;
  });
  const auto sign_direct = run_once([](int, std::shared_ptr<ProcessGroup>) {
    return bind_hook(std::make_shared<CompressionState>(
                         CompressionOptions{.sign_block = 64, .momentum = 0.5}),
                     sign_compress_hook);
  });
  EXPECT_EQ(sign_by_name, sign_direct);
  // And the state and summary come with it.
  test::ThreadsSetup setup;
  setup.n = 2;
  test::run_threads_or_throw(setup, [](std::shared_ptr<ProcessGroup> pg, int rank) {
    MadeCommHook made = make_comm_hook("sign", pg);
    EXPECT_EQ(made.name, "sign");
    ASSERT_TRUE(made.state_dict && made.load_state_dict && made.summary);
    EXPECT_MENTIONS(made.summary(), "no compressed step yet");
    GradBucket bucket(0, 1, input(rank, 64), {zeros({64})}, {0}, pg);
    made.hook(bucket)->wait();
    EXPECT_MENTIONS(made.summary(), "x fewer bytes");
    const nn::NamedTensors state = made.state_dict();
    EXPECT_TRUE(std::any_of(state.begin(), state.end(),
                            [](const auto& kv) { return kv.first == "residual.0"; }));
    made.load_state_dict(state);
  });
}

TEST(HookRegistry, RefusesBadSpecsNamingWhatIsWrong) {
  test::ThreadsSetup setup;
  setup.n = 1;
  test::run_threads_or_throw(setup, [](std::shared_ptr<ProcessGroup> pg, int) {
    EXPECT_MENTIONS(error_of([&] { make_comm_hook("tpok", pg); }),
                    "no hook named 'tpok' (from 'tpok'); registered: allreduce, batched_powersgd");
    EXPECT_MENTIONS(error_of([&] { make_comm_hook("topk:ratio", pg); }),
                    "options are key=value separated by commas, got 'ratio'");
    EXPECT_MENTIONS(error_of([&] { make_comm_hook("topk:ratio=abc", pg); }),
                    "[comm hook 'topk'] option ratio expects a number, got 'abc'");
    EXPECT_MENTIONS(error_of([&] { make_comm_hook("topk:ration=0.1", pg); }),
                    "hook 'topk' takes no option 'ration'");
    EXPECT_MENTIONS(error_of([&] { make_comm_hook("topk:ratio=2", pg); }),
                    "[comm hook 'topk:ratio=2' (built-in)] [CompressionState] topk_ratio must be in (0, 1], got 2");
    EXPECT_MENTIONS(error_of([&] { make_comm_hook("sign:block=12", pg); }),
                    "sign_block must be a positive multiple of 8, got 12");
    EXPECT_MENTIONS(error_of([&] { make_comm_hook("int8:masking=1", pg); }),
                    "hook 'int8' takes no option 'masking'");
    EXPECT_MENTIONS(error_of([&] { make_comm_hook("topk:masking=1", pg); }),
                    "momentum_masking masks the velocity and needs momentum > 0, got momentum 0");
    EXPECT_MENTIONS(error_of([&] { make_comm_hook("sign:error_feedback=maybe", pg); }),
                    "option error_feedback expects 1/true/on or 0/false/off, got 'maybe'");
    EXPECT_MENTIONS(
        error_of([&] { make_comm_hook("sign:exchange=ring", pg); }),
        "[comm hook 'sign'] option exchange expects auto, two_phase or allgather, got 'ring'");
    EXPECT_MENTIONS(error_of([&] { make_comm_hook("topk:exchange=allgather", pg); }),
                    "hook 'topk' takes no option 'exchange'");
    // The exchange chosen by name is the state's (and its checkpoint's).
    for (const auto& [spec, want] : {std::pair{"int8", 0}, std::pair{"int8:exchange=two_phase", 1},
                                     std::pair{"sign:exchange=allgather", 2}}) {
      const nn::NamedTensors state = make_comm_hook(spec, pg).state_dict();
      auto it = std::find_if(state.begin(), state.end(),
                             [](const auto& kv) { return kv.first == "option.exchange"; });
      ASSERT_NE(it, state.end()) << spec;
      EXPECT_EQ(it->second.template to_vector<int64_t>()[0], want) << spec;
    }
  });
}

TEST(HookRegistry, AProgramRegistersItsOwnButNotATakenName) {
  register_comm_hook("program_halved", [](const CommHookArgs&) {
    MadeCommHook m;
    m.hook = [](GradBucket& b) {
      Tensor t = b.buffer() * 0.5f;
      return completed_future({t});
    };
    return m;
  }, "halves the local gradient");
  const auto hooks = registered_comm_hooks();
  auto it = std::find_if(hooks.begin(), hooks.end(), [](const auto& h) { return h.name == "program_halved"; });
  ASSERT_NE(it, hooks.end());
  EXPECT_EQ(it->origin, "program");
  const auto got = run_once([](int, std::shared_ptr<ProcessGroup> pg) {
    return make_comm_hook("program_halved", pg).hook;
  });
  EXPECT_FLOAT_EQ(got[10], 0.05f);
  EXPECT_MENTIONS(error_of([] { register_comm_hook("sign", [](const CommHookArgs&) { return MadeCommHook{}; }, ""); }),
                  "'sign' is already registered (built-in); program cannot register it again");
  EXPECT_MENTIONS(error_of([] { register_comm_hook("bad name", [](const CommHookArgs&) { return MadeCommHook{}; }, ""); }),
                  "a hook's name is letters, digits and '_', got 'bad name'");
}

TEST(HookRegistry, PostLocalSgdByNameAveragesAfterTheStepFromStart) {
  test::ThreadsSetup setup;
  setup.n = 2;
  test::run_threads_or_throw(setup, [](std::shared_ptr<ProcessGroup> pg, int rank) {
    MadeCommHook made = make_comm_hook("post_localsgd:start=1,period=2", pg);
    ASSERT_TRUE(made.after_step);
    Tensor p = full({3}, static_cast<float>(rank));
    p.set_grad(zeros({3}));
    made.after_step({p});  // step 0: warm-up, no averaging
    EXPECT_EQ(p.to_vector<float>()[0], static_cast<float>(rank));
    made.after_step({p});  // step 1 = start: averaged
    EXPECT_EQ(p.to_vector<float>()[0], 0.5f);
    const nn::NamedTensors state = made.state_dict();
    MadeCommHook fresh = make_comm_hook("post_localsgd:start=1,period=2", pg);
    fresh.load_state_dict(state);
    EXPECT_EQ(fresh.state_dict().back().second.to_vector<int64_t>()[0], 2);  // averager_step
  });
}

// int8:node=2 on 4 ranks with default groups: nodes {0, 1} and {2, 3}, the hook between ranks
// 0 and 2; the same values as compress_across_nodes over groups made by hand, and only the
// leaders compress. A node size that does not divide the world is refused naming the option.
TEST(HookRegistry, CompressionAcrossNodesByName) {
  constexpr int64_t kN = 300;
  std::vector<std::vector<float>> by_name(4), by_hand(4);
  std::vector<std::string> summaries(4);
  run_rank_threads(4, [&](int rank) {
    MadeCommHook made = make_comm_hook("int8:node=2,error_feedback=0", default_group());
    GradBucket bucket(0, 1, input(rank, kN), {zeros({kN})}, {0}, default_group());
    by_name[rank] = made.hook(bucket)->value().at(0).to_vector<float>();
    summaries[rank] = made.summary();
    const std::string bad = error_of([] { make_comm_hook("int8:node=3", default_group()); });
    if (bad.find("option node=3 must divide the group's 4 ranks") == std::string::npos) {
      throw std::runtime_error("node=3 not refused by name: " + bad);
    }
  }, std::chrono::seconds(60));
  std::vector<std::shared_ptr<ThreadWorld>> nodes{ThreadWorld::create(2), ThreadWorld::create(2)};
  auto leaders_world = ThreadWorld::create(2);
  auto node_world = ThreadWorld::create(4);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 4; ++rank) {
    threads.emplace_back([&, rank] {
      auto local = std::make_shared<ProcessGroupThreads>(nodes[rank / 2], rank % 2);
      std::shared_ptr<ProcessGroup> leaders;
      if (rank % 2 == 0) leaders = std::make_shared<ProcessGroupThreads>(leaders_world, rank / 2);
      auto state = std::make_shared<CompressionState>(CompressionOptions{.error_feedback = false});
      CommHook hook = compress_across_nodes(bind_hook(state, int8_compress_hook), local, leaders);
      auto world = std::make_shared<ProcessGroupThreads>(node_world, rank);
      GradBucket bucket(0, 1, input(rank, kN), {zeros({kN})}, {0}, world);
      by_hand[rank] = hook(bucket)->value().at(0).to_vector<float>();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 4; ++r) EXPECT_EQ(by_name[r], by_hand[r]) << "rank " << r;
  EXPECT_MENTIONS(summaries[0], "x fewer bytes");
  EXPECT_MENTIONS(summaries[1], "no compressed step yet");  // not a leader
}

// ---- plug-ins ----------------------------------------------------------------------------------

TEST(HookPlugin, LoadsRegistersAndRuns) {
  const std::string path = plugin("good");
  load_comm_hook_plugin(path);
  const auto hooks = registered_comm_hooks();
  auto it = std::find_if(hooks.begin(), hooks.end(), [](const auto& h) { return h.name == "test_scaled"; });
  ASSERT_NE(it, hooks.end());
  EXPECT_EQ(it->origin, path);
  const auto got = run_once([](int, std::shared_ptr<ProcessGroup> pg) {
    return make_comm_hook("test_scaled:scale=0.5", pg).hook;
  });
  EXPECT_FLOAT_EQ(got[0], 0.25f);  // ranks 0 and 1: average 0.5, times 0.5
  EXPECT_MENTIONS(error_of([&] { load_comm_hook_plugin(path); }), "already loaded");

  // Its hook that throws inside DDP's backward names itself and the library.
  const std::string e = error_of([] {
    test::ThreadsSetup setup;
    setup.n = 2;
    test::run_threads_or_throw(setup, [](std::shared_ptr<ProcessGroup> pg, int) {
      auto model = std::make_shared<nn::Linear>(4, 2);
      DistributedDataParallel ddp(model, pg);
      MadeCommHook made = make_comm_hook("test_throws", pg);
      ddp.register_comm_hook(made.hook, made.name);
      ddp.forward(ones({3, 4})).sum().backward();
    });
  });
  EXPECT_MENTIONS(e, "[comm hook 'test_throws' (" + path + ")] this hook always fails");
}

TEST(HookPlugin, RefusesBrokenLibrariesNamingThem) {
  const std::string abi = plugin("wrong_abi");
  EXPECT_MENTIONS(error_of([&] { load_comm_hook_plugin(abi); }),
                  "[load_comm_hook_plugin] " + abi + ": was built for plug-in ABI " +
                      std::to_string(kCommHookPluginAbi + 1));
  const std::string no_init = plugin("without_init");
  EXPECT_MENTIONS(error_of([&] { load_comm_hook_plugin(no_init); }),
                  no_init + ": has no symbol ember_comm_hook_plugin_init");
  const std::string taken = plugin("takes_a_built_in_name");
  EXPECT_MENTIONS(error_of([&] { load_comm_hook_plugin(taken); }),
                  "'allreduce' is already registered (built-in); " + taken +
                      " cannot register it again");
  const std::string throws = plugin("init_throws");
  EXPECT_MENTIONS(error_of([&] { load_comm_hook_plugin(throws); }),
                  throws + ": its init failed: cannot find its configuration");
  const auto hooks = registered_comm_hooks();
  EXPECT_TRUE(std::none_of(hooks.begin(), hooks.end(),
                           [](const auto& h) { return h.name == "test_partial"; }))
      << "what a failed init registered is removed";
  EXPECT_MENTIONS(error_of([] { load_comm_hook_plugin("/nonexistent/libnothing.so"); }),
                  "/nonexistent/libnothing.so: cannot be loaded");
}

}  // namespace
}  // namespace ember::dist
