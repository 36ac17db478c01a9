#include <ember/nn/loss.h>

namespace ember::nn {

namespace {

void check_reduction(const char* op, const std::string& r) {
  EMBER_CHECK(r == "mean" || r == "sum" || r == "none", "[", op,
              "] expected reduction 'mean', 'sum' or 'none', got '", r, "'");
}

// Registers `t` (if defined) as a buffer so to() converts it, and keeps the same handle.
void keep_as_buffer(Module& m, const char* name, Tensor& t) {
  if (t.defined()) t = m.register_buffer(name, t.detach());
}

}  // namespace

CrossEntropyLoss::CrossEntropyLoss(functional::CrossEntropyOptions options)
    : options(std::move(options)) {
  check_reduction("CrossEntropyLoss", this->options.reduction);
  keep_as_buffer(*this, "weight", this->options.weight);
}
Tensor CrossEntropyLoss::forward(const Tensor& input, const Tensor& target) {
  return functional::cross_entropy(input, target, options);
}

NLLLoss::NLLLoss(functional::NLLLossOptions options) : options(std::move(options)) {
  check_reduction("NLLLoss", this->options.reduction);
  keep_as_buffer(*this, "weight", this->options.weight);
}
Tensor NLLLoss::forward(const Tensor& input, const Tensor& target) {
  return functional::nll_loss(input, target, options);
}

MSELoss::MSELoss(std::string reduction) : reduction(std::move(reduction)) {
  check_reduction("MSELoss", this->reduction);
}
Tensor MSELoss::forward(const Tensor& input, const Tensor& target) {
  return functional::mse_loss(input, target, reduction);
}

BCEWithLogitsLoss::BCEWithLogitsLoss(functional::BCEWithLogitsOptions options)
    : options(std::move(options)) {
  check_reduction("BCEWithLogitsLoss", this->options.reduction);
  keep_as_buffer(*this, "weight", this->options.weight);
  keep_as_buffer(*this, "pos_weight", this->options.pos_weight);
}
Tensor BCEWithLogitsLoss::forward(const Tensor& input, const Tensor& target) {
  return functional::binary_cross_entropy_with_logits(input, target, options);
}

}  // namespace ember::nn
