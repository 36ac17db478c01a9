// Communication hooks by name, and hooks compiled as plug-ins.
//
//   auto made = dist::make_comm_hook("topk:ratio=0.01", ddp.process_group_ptr());
//   ddp.register_comm_hook(made.hook, made.name);
//   ... after each optimizer step: if (made.after_step) made.after_step(params);
//   made.state_dict();                                  // for a checkpoint (empty if stateless)
//
// A spec is a registered name, optionally followed by ':' and comma-separated key=value options
// ("powersgd:rank=4,start=10"). Every built-in hook is registered (registered_comm_hooks() lists
// them with their options); a program registers its own with register_comm_hook, and a shared
// library registers its hooks when loaded with load_comm_hook_plugin:
//
//   // my_hook.cpp, built as a shared library against the installed Ember (docs/ddp.md)
//   #include <ember/distributed/ddp/hook_registry.h>
//   static void init() {
//     ember::dist::register_comm_hook("halved", [](const ember::dist::CommHookArgs& args) {
//       ...; return ember::dist::MadeCommHook{.hook = ...};
//     }, "my hook");
//   }
//   EMBER_COMM_HOOK_PLUGIN(init)
//
// The plug-in is refused, naming the library, if it lacks the EMBER_COMM_HOOK_PLUGIN symbols,
// was built against another Ember version (C++ types cross the boundary: they must agree), its
// init throws, or it registers a name that is taken. A hook made from a registered factory that
// throws while DDP runs it has its error prefixed with the hook's name and where it came from.
//
// Threads: the registry is guarded by a mutex; register before building the DDP that uses it.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ember/distributed/ddp/comm_hooks.h>
#include <ember/nn/module.h>
#include <ember/version.h>

namespace ember::dist {

/// What a factory is given: DDP's group and the spec's options, with typed readers that name
/// the hook and the option in their errors.
struct CommHookArgs {
  std::string name;
  std::shared_ptr<ProcessGroup> group;
  std::map<std::string, std::string> options;

  /// The option's value, or `fallback` if absent. Throws ValueError (naming the hook, the option
  /// and the text) if it does not parse.
  double number(const std::string& key, double fallback) const;
  int64_t integer(const std::string& key, int64_t fallback) const;
  /// "1", "true", "on" / "0", "false", "off".
  bool flag(const std::string& key, bool fallback) const;
  std::string text(const std::string& key, const std::string& fallback) const;

  /// The options a reader above has asked for (make_comm_hook refuses the others).
  mutable std::vector<std::string> read;
};

/// A hook made by a factory, and what a training loop needs besides registering it.
struct MadeCommHook {
  /// The spec's name (make_comm_hook fills it in).
  std::string name;
  CommHook hook;
  /// Run after each optimizer step with the optimizer's parameters (model averaging); null if
  /// the scheme needs nothing there.
  std::function<void(const std::vector<Tensor>& params)> after_step;
  /// The hook's state for a checkpoint, and its restore; null if stateless.
  std::function<nn::NamedTensors()> state_dict;
  std::function<void(const nn::NamedTensors&)> load_state_dict;
  /// One line on what the hook sent so far ("sent 1.2 MB, 31.9x fewer bytes than all-reduce");
  /// null if it keeps no statistics.
  std::function<std::string()> summary;
};

using CommHookFactory = std::function<MadeCommHook(const CommHookArgs& args)>;

/// Registers `factory` under `name` ([A-Za-z0-9_]+). `description` says what it does and lists
/// its options. Throws ValueError if the name is malformed or taken (naming who registered it).
void register_comm_hook(const std::string& name, CommHookFactory factory,
                        const std::string& description);

/// Makes the hook `spec` names for DDP over `group`. Throws ValueError naming the spec and listing
/// the registered names if the name is unknown, an option is malformed or the factory refuses
/// its options; options the factory did not read are refused too (a typo is not ignored).
MadeCommHook make_comm_hook(const std::string& spec, std::shared_ptr<ProcessGroup> group);

struct RegisteredCommHook {
  std::string name;
  std::string description;
  /// "built-in", "program" or the plug-in's path.
  std::string origin;
};
/// Every registered hook, sorted by name.
std::vector<RegisteredCommHook> registered_comm_hooks();

/// Loads a plug-in (dlopen) and runs its init, which registers its hooks. Throws ValueError
/// naming `path` if it cannot be loaded, lacks the EMBER_COMM_HOOK_PLUGIN symbols, was built for
/// another ABI or Ember version, or its init throws (then whatever it registered is removed).
/// Loading the same path twice is refused.
void load_comm_hook_plugin(const std::string& path);

/// The plug-in interface's version; a plug-in built for another one is refused.
inline constexpr int kCommHookPluginAbi = 1;

}  // namespace ember::dist

/// Defines a comm-hook plug-in's entry points; `init` (a void() function) registers its hooks.
#define EMBER_COMM_HOOK_PLUGIN(init)                                                     \
  extern "C" int ember_comm_hook_plugin_abi() { return ::ember::dist::kCommHookPluginAbi; } \
  extern "C" const char* ember_comm_hook_plugin_version() { return EMBER_VERSION; }      \
  extern "C" void ember_comm_hook_plugin_init() { init(); }
