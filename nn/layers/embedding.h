// Embedding layer.
#pragma once

#include <optional>

#include <ember/nn/module.h>

namespace ember::nn {

/// A lookup table (torch.nn.Embedding): int64/int32 indices of any shape -> [*, embedding_dim].
/// weight [num_embeddings, embedding_dim] starts as N(0, 1) from the global generator. With
/// padding_idx (negative counts from num_embeddings) that row starts at zero and receives no
/// gradient.
class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t embedding_dim,
            std::optional<int64_t> padding_idx = std::nullopt);
  std::string name() const override { return "Embedding"; }
  /// "10, 3" or "10, 3, padding_idx=0"
  std::string extra_repr() const override;
  Tensor forward(const Tensor& input) override;
  void reset_parameters();

  const int64_t num_embeddings, embedding_dim;
  const std::optional<int64_t> padding_idx;  ///< non-negative once constructed
  Tensor weight;

 protected:
  /// Keeps weight pointing at the parameter (set_parameter: weight tying).
  void on_parameter_set(const std::string&, const Tensor& t) override { weight = t; }
};

}  // namespace ember::nn
