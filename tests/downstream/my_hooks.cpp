// A user's comm-hook plug-in built against the installed Ember (docs/ddp.md, "Plug-ins"):
// "doubled_average" averages the bucket over the group in float64 and scales it by its option
// "scale" (default 1); train_ddp loads it with dist::load_comm_hook_plugin.
#include <ember/ember.h>

namespace {

namespace dist = ember::dist;

dist::MadeCommHook doubled_average(const dist::CommHookArgs& args) {
  const double scale = args.number("scale", 1.0);
  dist::MadeCommHook made;
  made.hook = [scale](dist::GradBucket& bucket) {
    ember::Tensor wide = bucket.buffer().to(ember::kFloat64, /*copy=*/true);
    wide.div_(bucket.process_group().size() / scale);
    auto sum = bucket.process_group().allreduce(wide, {.op = dist::ReduceOp::Sum});
    return sum->future()->then([buffer = bucket.buffer()](dist::Future& f) mutable {
      ember::NoGradGuard no_grad;
      buffer.copy_(f.value()[0]);
      return std::vector<ember::Tensor>{buffer};
    });
  };
  return made;
}

void init() {
  dist::register_comm_hook("doubled_average", doubled_average,
                           "average in float64, times scale; scale=1");
}

}  // namespace

EMBER_COMM_HOOK_PLUGIN(init)
