#include <ember/nn/layers/dropout.h>

#include <ember/nn/functional.h>
#include <ember/nn/layers/layer_utils.h>

namespace ember::nn {

Dropout::Dropout(double p, bool inplace) : p(p), inplace(inplace) {
  EMBER_CHECK(p >= 0.0 && p <= 1.0,
              "[Dropout] dropout probability has to be between 0 and 1, but got ", p);
}

std::string Dropout::extra_repr() const {
  return "p=" + detail::repr_double(p) + ", inplace=" + detail::repr_bool(inplace);
}

Tensor Dropout::forward(const Tensor& input) {
  return functional::dropout(input, p, is_training(), inplace);
}

}  // namespace ember::nn
