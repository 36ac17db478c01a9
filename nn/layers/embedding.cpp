#include <ember/nn/layers/embedding.h>

#include <ember/nn/functional.h>
#include <ember/nn/init.h>

namespace ember::nn {

namespace {
std::optional<int64_t> wrap_padding_idx(std::optional<int64_t> idx, int64_t n) {
  if (!idx) return idx;
  EMBER_CHECK(*idx >= -n && *idx < n, "[Embedding] padding_idx must be within num_embeddings (in [",
              -n, ", ", n, ")), got ", *idx);
  return *idx < 0 ? *idx + n : *idx;
}
}  // namespace

Embedding::Embedding(int64_t num_embeddings, int64_t embedding_dim,
                     std::optional<int64_t> padding_idx)
    : num_embeddings(num_embeddings),
      embedding_dim(embedding_dim),
      padding_idx(wrap_padding_idx(padding_idx, num_embeddings)) {
  EMBER_CHECK(num_embeddings >= 0 && embedding_dim >= 0,
              "[Embedding] expected non-negative sizes, got num_embeddings=", num_embeddings,
              ", embedding_dim=", embedding_dim);
  weight = register_parameter("weight", empty({num_embeddings, embedding_dim}));
  reset_parameters();
}

void Embedding::reset_parameters() {
  init::normal_(weight);
  if (padding_idx) {
    NoGradGuard no_grad;
    weight[*padding_idx].fill_(0);
  }
}

std::string Embedding::extra_repr() const {
  std::string s = std::to_string(num_embeddings) + ", " + std::to_string(embedding_dim);
  if (padding_idx) s += ", padding_idx=" + std::to_string(*padding_idx);
  return s;
}

Tensor Embedding::forward(const Tensor& input) {
  return functional::embedding(input, weight, padding_idx);
}

}  // namespace ember::nn
