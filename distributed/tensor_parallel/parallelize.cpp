#include <ember/distributed/tensor_parallel/parallelize.h>

#include <sstream>

namespace ember::dist {

namespace {

constexpr const char* kOp = "[parallelize_module]";

std::vector<std::string> split(const std::string& path) {
  std::vector<std::string> parts;
  std::stringstream ss(path);
  for (std::string p; std::getline(ss, p, '.');) parts.push_back(p);
  return parts;
}

bool matches(const std::vector<std::string>& pattern, const std::vector<std::string>& name) {
  if (pattern.size() != name.size()) return false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] != "*" && pattern[i] != name[i]) return false;
  }
  return true;
}

// For an error: the children of the deepest module the path's prefix names.
std::string near_miss(nn::Module& root, const std::vector<std::string>& pattern) {
  std::vector<std::shared_ptr<nn::Module>> level{root.shared_from_this()};
  std::string where = "the model";
  for (const std::string& part : pattern) {
    std::vector<std::shared_ptr<nn::Module>> next;
    for (const auto& m : level) {
      for (const auto& [name, child] : m->named_children()) {
        if (part == "*" || part == name) next.push_back(child);
      }
    }
    if (next.empty()) {
      std::string names;
      for (const auto& m : level) {
        for (const auto& [name, child] : m->named_children()) {
          names += (names.empty() ? "" : ", ") + name;
        }
      }
      return detail::str_cat("no '", part, "' in ", where, " (it has: ",
                             names.empty() ? "no submodules" : names, ")");
    }
    where = "'" + part + "'";
    level = std::move(next);
  }
  return "no module";
}

}  // namespace

std::shared_ptr<nn::Module> parallelize_module(std::shared_ptr<nn::Module> module,
                                               const std::shared_ptr<DeviceMesh>& mesh,
                                               const ParallelizePlan& plan, int src_data_rank) {
  EMBER_CHECK(module != nullptr && mesh != nullptr, kOp, " expected a module and a mesh");
  EMBER_CHECK(mesh->ndim() == 1, kOp, " expected a 1-D mesh, got ", mesh->str(),
              ": slice the tensor-parallel dimension first (mesh[\"tp\"])");
  const auto named = module->named_modules();
  for (const PlanEntry& e : plan) {
    EMBER_CHECK(e.style != nullptr, kOp, " the plan's entry '", e.path, "' has no style");
    const std::vector<std::string> pattern = split(e.path);
    bool found = false;
    for (const auto& [name, m] : named) {
      if (name.empty() || !matches(pattern, split(name))) continue;
      e.style->apply(*m, mesh, name, src_data_rank);
      found = true;
    }
    EMBER_CHECK(found, kOp, " the plan names '", e.path, "', which matches no submodule: ",
                near_miss(*module, pattern));
  }
  return module;
}

std::shared_ptr<nn::Module> parallelize_module(std::shared_ptr<nn::Module> module,
                                               const std::shared_ptr<DeviceMesh>& mesh,
                                               const ParallelStyle& style, int src_data_rank) {
  EMBER_CHECK(module != nullptr && mesh != nullptr, kOp, " expected a module and a mesh");
  EMBER_CHECK(mesh->ndim() == 1, kOp, " expected a 1-D mesh, got ", mesh->str(),
              ": slice the tensor-parallel dimension first (mesh[\"tp\"])");
  style.apply(*module, mesh, "", src_data_rank);
  return module;
}

}  // namespace ember::dist
