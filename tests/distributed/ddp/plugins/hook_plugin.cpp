// Comm-hook plug-ins for tests/distributed/ddp/hook_registry_test.cpp, one source built several
// ways (tests/CMakeLists.txt): a good plug-in as a user would write it, and broken ones.
#include <stdexcept>

#include <ember/distributed/ddp/hook_registry.h>
#include <ember/tensor/grad_mode.h>

namespace {

using namespace ember;

// A user's hook: the bucket averaged over the group, then scaled by its option "scale".
dist::MadeCommHook scaled_average(const dist::CommHookArgs& args) {
  const double scale = args.number("scale", 1.0);
  dist::MadeCommHook made;
  made.hook = [scale](dist::GradBucket& bucket) {
    Tensor buffer = bucket.buffer();
    dist::AllreduceOptions o;
    o.op = dist::ReduceOp::Avg;
    return bucket.process_group().allreduce(buffer, o)->future()->then(
        [buffer, scale](dist::Future& f) mutable {
          NoGradGuard no_grad;
          buffer.copy_(f.value()[0] * static_cast<float>(scale));
          return std::vector<Tensor>{buffer};
        });
  };
  return made;
}

[[maybe_unused]] dist::MadeCommHook throwing(const dist::CommHookArgs&) {
  dist::MadeCommHook made;
  made.hook = [](dist::GradBucket&) -> std::shared_ptr<dist::Future> {
    throw std::runtime_error("this hook always fails");
  };
  return made;
}

[[maybe_unused]] void init() {
#if defined(PLUGIN_TAKES_A_BUILT_IN_NAME)
  dist::register_comm_hook("allreduce", scaled_average, "a second allreduce");
#elif defined(PLUGIN_INIT_THROWS)
  dist::register_comm_hook("test_partial", scaled_average, "registered, then init fails");
  throw std::runtime_error("cannot find its configuration");
#else
  dist::register_comm_hook("test_scaled", scaled_average, "average times scale; scale=1");
  dist::register_comm_hook("test_throws", throwing, "throws when run");
#endif
}

}  // namespace

#if defined(PLUGIN_WRONG_ABI)
extern "C" int ember_comm_hook_plugin_abi() { return ember::dist::kCommHookPluginAbi + 1; }
extern "C" const char* ember_comm_hook_plugin_version() { return EMBER_VERSION; }
extern "C" void ember_comm_hook_plugin_init() { init(); }
#elif defined(PLUGIN_WITHOUT_INIT)
extern "C" int ember_comm_hook_plugin_abi() { return ember::dist::kCommHookPluginAbi; }
extern "C" const char* ember_comm_hook_plugin_version() { return EMBER_VERSION; }
#else
EMBER_COMM_HOOK_PLUGIN(init)
#endif
