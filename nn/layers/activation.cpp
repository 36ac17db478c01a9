#include <ember/nn/layers/activation.h>

namespace ember::nn {

Tensor ReLU::forward(const Tensor& input) { return relu(input); }

GELU::GELU(std::string approximate) : approximate(std::move(approximate)) {
  EMBER_CHECK(this->approximate == "none" || this->approximate == "tanh",
              "[GELU] expected approximate 'none' or 'tanh', got '", this->approximate, "'");
}
std::string GELU::extra_repr() const { return "approximate='" + approximate + "'"; }
Tensor GELU::forward(const Tensor& input) { return gelu(input, approximate.c_str()); }

Tensor SiLU::forward(const Tensor& input) { return silu(input); }
Tensor Tanh::forward(const Tensor& input) { return tanh(input); }
Tensor Sigmoid::forward(const Tensor& input) { return sigmoid(input); }

std::string Softmax::extra_repr() const { return "dim=" + std::to_string(dim); }
Tensor Softmax::forward(const Tensor& input) { return softmax(input, dim); }

std::string LogSoftmax::extra_repr() const { return "dim=" + std::to_string(dim); }
Tensor LogSoftmax::forward(const Tensor& input) { return log_softmax(input, dim); }

}  // namespace ember::nn
