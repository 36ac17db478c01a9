#include <ember/nn/layers/container.h>

#include <string>

namespace ember::nn {

ModuleSequence::ModuleSequence(std::vector<std::shared_ptr<Module>> modules) {
  for (auto& m : modules) push_back(std::move(m));
}

void ModuleSequence::push_back(std::shared_ptr<Module> m) {
  // Not name(): called from the constructor it would say "Module".
  EMBER_CHECK(m != nullptr, "[Sequential/ModuleList push_back] module ", modules_.size(),
              " is null");
  add_child(std::to_string(modules_.size()), m);
  modules_.push_back(std::move(m));
}

std::shared_ptr<Module> ModuleSequence::operator[](int64_t i) const {
  const int64_t n = static_cast<int64_t>(modules_.size());
  EMBER_CHECK_TYPE(IndexError, i >= -n && i < n, "[", name(), "] index ", i,
                   " is out of range for ", n, " modules");
  return modules_[i < 0 ? i + n : i];
}

Tensor Sequential::forward(const Tensor& input) {
  Tensor x = input;
  for (const auto& m : modules_) x = (*m)(x);  // the children's forward hooks run
  return x;
}

}  // namespace ember::nn
