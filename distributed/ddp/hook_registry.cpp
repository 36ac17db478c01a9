#include <ember/distributed/ddp/hook_registry.h>

#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdio>
#include <mutex>
#include <sstream>

#include <ember/distributed/ddp/compression_hooks.h>
#include <ember/distributed/ddp/detail/state_entries.h>
#include <ember/distributed/ddp/local_sgd.h>
#include <ember/distributed/ddp/powersgd.h>
#include <ember/distributed/init.h>

namespace ember::dist {

namespace {

constexpr const char* kOp = "[comm hook registry]";

struct Entry {
  CommHookFactory factory;
  std::string description;
  std::string origin;
};

// "1.2 MB" for byte counts in summaries.
std::string megabytes(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MB", static_cast<double>(bytes) / 1e6);
  return buf;
}

// A stateful hook's MadeCommHook: the hook bound to `state`, its state_dict and load_state_dict.
template <typename State, typename Hook>
MadeCommHook with_state(std::shared_ptr<State> state, Hook hook) {
  MadeCommHook made;
  made.hook = bind_hook(state, hook);
  made.state_dict = [state] { return state->state_dict(); };
  made.load_state_dict = [state](const nn::NamedTensors& s) { state->load_state_dict(s); };
  return made;
}

MadeCommHook stateless(CommHook hook) {
  MadeCommHook made;
  made.hook = std::move(hook);
  return made;
}

MadeCommHook powersgd(const CommHookArgs& a, bool batched) {
  auto state = std::make_shared<PowerSGDState>(PowerSGDOptions{
      .matrix_approximation_rank = a.integer("rank", 1),
      .start_powerSGD_iter = a.integer("start", 1000),
      .use_error_feedback = a.flag("error_feedback", true)});
  MadeCommHook made = with_state(state, batched ? batched_powersgd_hook : powersgd_hook);
  made.summary = [state] {
    const auto s = state->compression_stats();
    if (s.numel_after == 0) return std::string("powersgd: no compressed step yet");
    std::ostringstream os;
    os.precision(3);
    os << "powersgd: rank " << state->options().matrix_approximation_rank << ", " << s.numel_after
       << " of " << s.numel_before << " gradient elements all-reduced (" << s.rate << "x fewer)";
    return os.str();
  };
  return made;
}

// node=K: the job's ranks as nodes of K consecutive ranks (emberrun's and Slurm's layout: a
// node's ranks are numbered together), averaged exactly inside each node and `hook` run by the
// nodes' first ranks between them (compress_across_nodes). Collective over the world, as
// new_group is: every rank makes the hook with the same spec.
CommHook across_nodes(const CommHookArgs& a, int64_t node, CommHook hook) {
  EMBER_CHECK(node <= a.group->size() && a.group->size() % node == 0, "[comm hook '", a.name,
              "'] option node=", node, " must divide the group's ", a.group->size(), " ranks");
  const Subgroups nodes = new_subgroups(static_cast<int>(node), a.group);
  std::vector<int> leaders;
  for (const std::vector<int>& members : nodes.ranks) leaders.push_back(members.front());
  std::shared_ptr<ProcessGroup> between = new_group(leaders);
  return compress_across_nodes(std::move(hook), nodes.group, std::move(between));
}

MadeCommHook compression(const CommHookArgs& a,
                         std::shared_ptr<Future> (*hook)(CompressionState&, GradBucket&)) {
  CompressionOptions o;
  o.error_feedback = a.flag("error_feedback", o.error_feedback);
  o.start_iter = a.integer("start", o.start_iter);
  if (hook == int8_compress_hook) o.channel_size = a.integer("channel", o.channel_size);
  if (hook == sign_compress_hook) o.sign_block = a.integer("block", o.sign_block);
  if (hook == int8_compress_hook || hook == sign_compress_hook) {
    const std::string how = a.text("exchange", "auto");
    EMBER_CHECK(how == "auto" || how == "two_phase" || how == "allgather", "[comm hook '", a.name,
                "'] option exchange expects auto, two_phase or allgather, got '", how, "'");
    o.exchange = how == "two_phase"   ? CompressedExchange::kTwoPhase
                 : how == "allgather" ? CompressedExchange::kAllGather
                                      : CompressedExchange::kAuto;
  }
  o.momentum = a.number("momentum", o.momentum);
  if (hook == topk_compress_hook) {
    o.topk_ratio = a.number("ratio", o.topk_ratio);
    o.momentum_masking = a.flag("masking", o.momentum_masking);
  }
  const int64_t node = a.integer("node", 0);
  auto state = std::make_shared<CompressionState>(o);
  MadeCommHook made = with_state(state, hook);
  if (node > 0) made.hook = across_nodes(a, node, std::move(made.hook));
  made.summary = [state, name = a.name] {
    const auto s = state->stats();
    if (s.buckets == 0) return name + ": no compressed step yet";
    std::ostringstream os;
    os.precision(3);
    os << name << ": sent " << megabytes(s.bytes_sent) << " where all-reduce sends "
       << megabytes(s.allreduce_bytes) << " (" << s.ratio << "x fewer bytes)";
    return os.str();
  };
  return made;
}

// Post-local SGD with a periodic model averager: the hook, and the averaging after each step.
MadeCommHook post_local_sgd(const CommHookArgs& a) {
  const int64_t start = a.integer("start", 100);
  const int64_t period = a.integer("period", 4);
  const int64_t local = a.integer("local", 0);
  const bool allreduce = local > 0;
  std::shared_ptr<ProcessGroup> subgroup;
  if (allreduce) subgroup = new_subgroups(static_cast<int>(local), a.group).group;
  auto state = std::make_shared<PostLocalSGDState>(a.group, subgroup, start, allreduce);
  auto averager = std::make_shared<PeriodicModelAverager>(period, start, a.group);
  MadeCommHook made = with_state(state, post_localSGD_hook);
  made.after_step = [averager](const std::vector<Tensor>& params) {
    averager->average_parameters(params);
  };
  // The averager's step rides in the hook's state, so one checkpoint entry resumes both.
  made.state_dict = [state, averager] {
    nn::NamedTensors s = state->state_dict();
    s.emplace_back("averager_step", detail::int_entry(averager->step()));
    return s;
  };
  made.load_state_dict = [state, averager](const nn::NamedTensors& saved) {
    nn::NamedTensors rest;
    for (const auto& [name, t] : saved) {
      if (name == "averager_step") {
        averager->set_step(detail::read_int("[comm hook 'post_localsgd']", name, t));
      } else {
        rest.emplace_back(name, t);
      }
    }
    state->load_state_dict(rest);
  };
  return made;
}

std::map<std::string, Entry> built_ins() {
  std::map<std::string, Entry> m;
  auto add = [&m](const char* name, CommHookFactory f, const char* description) {
    m[name] = Entry{std::move(f), description, "built-in"};
  };
  add("allreduce", [](const CommHookArgs&) { return stateless(allreduce_hook); },
      "average over the group (the same as no hook)");
  add("fp16", [](const CommHookArgs&) { return stateless(fp16_compress_hook); },
      "all-reduce a float16 copy (half the bytes)");
  add("bf16", [](const CommHookArgs&) { return stateless(bf16_compress_hook); },
      "all-reduce a bfloat16 copy (half the bytes)");
  add("noop", [](const CommHookArgs&) { return stateless(noop_hook); },
      "no communication, for measuring; never for training");
  add("powersgd", [](const CommHookArgs& a) { return powersgd(a, false); },
      "layer-wise PowerSGD; rank=1, start=1000, error_feedback=1");
  add("batched_powersgd", [](const CommHookArgs& a) { return powersgd(a, true); },
      "whole-bucket PowerSGD; rank=1, start=1000, error_feedback=1");
  add("quantization_pertensor", [](const CommHookArgs&) { return stateless(quantization_pertensor_hook); },
      "torch's int8 quantization, one scale per bucket (all-gather)");
  add("quantization_perchannel", [](const CommHookArgs&) { return stateless(quantization_perchannel_hook); },
      "torch's int8 quantization, a scale per 512 elements (all-gather)");
  add(
      "int8", [](const CommHookArgs& a) { return compression(a, int8_compress_hook); },
      "int8 compressed all-reduce (~4x fewer bytes); channel=512, start=0, error_feedback=1, "
      "node=0 (K: exact inside nodes of K ranks, compressed between them), momentum=0 (applied "
      "before compression: then train with the optimizer's momentum 0), exchange=auto "
      "(two_phase, or allgather: compressed once, (W-1) buckets sent; auto: allgather at 2 "
      "ranks)");
  add(
      "sign", [](const CommHookArgs& a) { return compression(a, sign_compress_hook); },
      "1-bit compressed all-reduce (~30x fewer bytes); block=512, start=0, error_feedback=1, "
      "node=0, momentum=0, exchange=auto");
  add("topk", [](const CommHookArgs& a) { return compression(a, topk_compress_hook); },
      "top-k sparsification; ratio=0.01, start=0, error_feedback=1, node=0, momentum=0, "
      "masking=0 (DGC's momentum factor masking)");
  add("post_localsgd", post_local_sgd,
      "post-local SGD: all-reduce until start, then average parameters every period steps; "
      "start=100, period=4, local=0 (after start, gradients are averaged within consecutive "
      "groups of this many ranks, e.g. a node's; 0: not at all)");
  return m;
}

struct Registry {
  std::mutex mu;
  std::map<std::string, Entry> entries = built_ins();
  std::vector<std::string> plugins;  // paths loaded
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: plug-ins' hooks may outlive main
  return *r;
}

// Who registers now: "program" unless a plug-in's init is running.
thread_local const std::string* current_origin = nullptr;

bool valid_name(const std::string& name) {
  return !name.empty() && std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
  });
}

std::string names_list(const std::map<std::string, Entry>& entries) {
  std::string out;
  for (const auto& [name, e] : entries) out += (out.empty() ? "" : ", ") + name;
  return out;
}

// The hook's errors prefixed with its name and origin, so a plug-in's failure names itself.
CommHook naming_errors(CommHook hook, const std::string& name, const std::string& origin) {
  return [hook = std::move(hook), prefix = "[comm hook '" + name + "' (" + origin + ")] "](
             GradBucket& bucket) -> std::shared_ptr<Future> {
    try {
      return hook(bucket);
    } catch (const Error& e) {
      throw ValueError(prefix + e.what());
    } catch (const std::exception& e) {
      throw ValueError(prefix + e.what());
    }
  };
}

}  // namespace

namespace {

// Option `key` of `a` as a T spelled by its whole value (std::from_chars: no sign, space or
// suffix is skipped), or `fallback` when the spec does not set it; anything else is refused
// naming the hook, the option and `what` it expects.
template <typename T>
T parse_option(const CommHookArgs& a, const std::string& key, T fallback, const char* what) {
  a.read.push_back(key);
  auto it = a.options.find(key);
  if (it == a.options.end()) return fallback;
  const std::string& s = it->second;
  T v{};
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  EMBER_CHECK(!s.empty() && ec == std::errc() && end == s.data() + s.size(), "[comm hook '",
              a.name, "'] option ", key, " expects ", what, ", got '", s, "'");
  return v;
}

}  // namespace

double CommHookArgs::number(const std::string& key, double fallback) const {
  return parse_option<double>(*this, key, fallback, "a number");
}

int64_t CommHookArgs::integer(const std::string& key, int64_t fallback) const {
  return parse_option<int64_t>(*this, key, fallback, "an integer");
}

bool CommHookArgs::flag(const std::string& key, bool fallback) const {
  read.push_back(key);
  auto it = options.find(key);
  if (it == options.end()) return fallback;
  const std::string& v = it->second;
  if (v == "1" || v == "true" || v == "on") return true;
  if (v == "0" || v == "false" || v == "off") return false;
  EMBER_CHECK(false, "[comm hook '", name, "'] option ", key,
              " expects 1/true/on or 0/false/off, got '", v, "'");
  return fallback;
}

std::string CommHookArgs::text(const std::string& key, const std::string& fallback) const {
  read.push_back(key);
  auto it = options.find(key);
  return it == options.end() ? fallback : it->second;
}

void register_comm_hook(const std::string& name, CommHookFactory factory,
                        const std::string& description) {
  EMBER_CHECK(valid_name(name), kOp, " a hook's name is letters, digits and '_', got '", name, "'");
  EMBER_CHECK(factory != nullptr, kOp, " register_comm_hook('", name, "') got a null factory");
  const std::string origin = current_origin ? *current_origin : "program";
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.entries.find(name);
  EMBER_CHECK(it == r.entries.end(), kOp, " '", name, "' is already registered (",
              it == r.entries.end() ? "" : it->second.origin, "); ", origin,
              " cannot register it again");
  r.entries[name] = Entry{std::move(factory), description, origin};
}

MadeCommHook make_comm_hook(const std::string& spec, std::shared_ptr<ProcessGroup> group) {
  EMBER_CHECK(group != nullptr, kOp, " make_comm_hook('", spec, "') expects a process group, got null");
  const size_t colon = spec.find(':');
  CommHookArgs args;
  args.name = spec.substr(0, colon);
  args.group = std::move(group);
  if (colon != std::string::npos) {
    std::istringstream in(spec.substr(colon + 1));
    for (std::string item; std::getline(in, item, ',');) {
      const size_t eq = item.find('=');
      EMBER_CHECK(eq != std::string::npos && eq > 0, kOp, " '", spec,
                  "': options are key=value separated by commas, got '", item, "'");
      args.options[item.substr(0, eq)] = item.substr(eq + 1);
    }
  }
  Entry entry;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.entries.find(args.name);
    EMBER_CHECK(it != r.entries.end(), kOp, " no hook named '", args.name, "' (from '", spec,
                "'); registered: ", names_list(r.entries));
    entry = it->second;
  }
  MadeCommHook made;
  try {
    made = entry.factory(args);
  } catch (const std::exception& e) {
    throw ValueError("[comm hook '" + spec + "' (" + entry.origin + ")] " + e.what());
  }
  for (const auto& [key, value] : args.options) {
    EMBER_CHECK(std::find(args.read.begin(), args.read.end(), key) != args.read.end(), kOp, " '",
                spec, "': hook '", args.name, "' takes no option '", key, "' (", entry.description,
                ")");
  }
  EMBER_CHECK(made.hook != nullptr, kOp, " the factory of '", args.name, "' (", entry.origin,
              ") returned no hook");
  made.name = args.name;
  made.hook = naming_errors(std::move(made.hook), args.name, entry.origin);
  return made;
}

std::vector<RegisteredCommHook> registered_comm_hooks() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<RegisteredCommHook> out;
  for (const auto& [name, e] : r.entries) out.push_back({name, e.description, e.origin});
  return out;
}

void load_comm_hook_plugin(const std::string& path) {
  const std::string op = "[load_comm_hook_plugin] " + path + ":";
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    EMBER_CHECK(std::find(r.plugins.begin(), r.plugins.end(), path) == r.plugins.end(), op,
                " already loaded");
  }
  void* lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  EMBER_CHECK(lib != nullptr, op, " cannot be loaded: ", ::dlerror());
  auto symbol = [&](const char* name) {
    ::dlerror();
    void* s = ::dlsym(lib, name);
    if (s == nullptr) {
      ::dlclose(lib);
      EMBER_CHECK(false, op, " has no symbol ", name,
                  " (a plug-in defines its entry points with EMBER_COMM_HOOK_PLUGIN(init))");
    }
    return s;
  };
  auto abi = reinterpret_cast<int (*)()>(symbol("ember_comm_hook_plugin_abi"));
  auto version = reinterpret_cast<const char* (*)()>(symbol("ember_comm_hook_plugin_version"));
  auto init = reinterpret_cast<void (*)()>(symbol("ember_comm_hook_plugin_init"));
  if (abi() != kCommHookPluginAbi || std::string(version()) != EMBER_VERSION) {
    const std::string got = "plug-in ABI " + std::to_string(abi()) + ", Ember " + version();
    ::dlclose(lib);
    EMBER_CHECK(false, op, " was built for ", got, "; this program has plug-in ABI ",
                kCommHookPluginAbi, ", Ember " EMBER_VERSION ": rebuild it against this Ember");
  }
  current_origin = &path;
  try {
    init();
  } catch (const std::exception& e) {
    current_origin = nullptr;
    // Remove what it registered before failing; keep the library loaded (its code may be in use
    // by nothing now, but unloading a library whose init threw is not worth the risk).
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    std::erase_if(r.entries, [&](const auto& kv) { return kv.second.origin == path; });
    EMBER_CHECK(false, op, " its init failed: ", e.what());
  }
  current_origin = nullptr;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.plugins.push_back(path);
}

}  // namespace ember::dist
