// Containers: Sequential (a chain of modules) and ModuleList (an indexable list of modules).
// Both register their elements as children named "0", "1", ..., so parameter names read
// "0.weight", "1.running_mean", ... exactly as PyTorch's.
#pragma once

#include <memory>
#include <vector>

#include <ember/nn/module.h>

namespace ember::nn {

/// What Sequential and ModuleList share: an ordered list of child modules named by position.
class ModuleSequence : public Module {
 public:
  /// Appends m as child number size(). Throws ValueError for a null module.
  void push_back(std::shared_ptr<Module> m);
  size_t size() const { return modules_.size(); }
  bool empty() const { return modules_.empty(); }
  /// The i-th module; negative i counts from the end. Throws IndexError out of range.
  std::shared_ptr<Module> operator[](int64_t i) const;
  /// The i-th module as a T; throws TypeError if it is not one.
  template <typename T>
  std::shared_ptr<T> at(int64_t i) const {
    std::shared_ptr<Module> m = (*this)[i];
    auto t = std::dynamic_pointer_cast<T>(m);
    EMBER_CHECK_TYPE(TypeError, t != nullptr, "[", name(), "::at] module ", i, " is a ", m->name(),
                     ", not the type asked for");
    return t;
  }
  auto begin() const { return modules_.begin(); }
  auto end() const { return modules_.end(); }

 protected:
  ModuleSequence() = default;
  explicit ModuleSequence(std::vector<std::shared_ptr<Module>> modules);
  std::vector<std::shared_ptr<Module>> modules_;
};

/// Modules applied in order, each to the previous one's output (torch.nn.Sequential):
///   auto net = std::make_shared<Sequential>(std::make_shared<Linear>(784, 128),
///                                           std::make_shared<ReLU>(),
///                                           std::make_shared<Linear>(128, 10));
class Sequential : public ModuleSequence {
 public:
  Sequential() = default;
  explicit Sequential(std::vector<std::shared_ptr<Module>> modules)
      : ModuleSequence(std::move(modules)) {}
  template <typename... Ms>
  requires(sizeof...(Ms) > 0) explicit Sequential(std::shared_ptr<Ms>... modules)
      : ModuleSequence(std::vector<std::shared_ptr<Module>>{std::move(modules)...}) {}

  std::string name() const override { return "Sequential"; }
  /// Runs every module in order; an empty Sequential returns its input.
  Tensor forward(const Tensor& input) override;
};

/// An indexable list of submodules (torch.nn.ModuleList) with no forward of its own: the owning
/// module decides how to call them. Its modules' parameters belong to the owner.
class ModuleList : public ModuleSequence {
 public:
  ModuleList() = default;
  explicit ModuleList(std::vector<std::shared_ptr<Module>> modules)
      : ModuleSequence(std::move(modules)) {}
  std::string name() const override { return "ModuleList"; }
};

}  // namespace ember::nn
