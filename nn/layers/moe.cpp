#include <ember/nn/layers/moe.h>

#include <cmath>
#include <numeric>

#include <ember/nn/init.h>
#include <ember/nn/layers/layer_utils.h>
#include <ember/tensor/ops.h>

namespace ember::nn {

namespace {

// Runs every expert of the layer here.
class LocalDispatch final : public ExpertDispatch {
 public:
  Tensor run(MoE& moe, const Tensor& rows, const std::vector<int64_t>& counts) override {
    return moe.run_local_experts(rows, counts);
  }
};

}  // namespace

MoE::MoE(const MoEOptions& o) : options(o), local_experts_(o.experts) {
  EMBER_CHECK(o.dim > 0 && o.hidden > 0 && o.experts > 0 && o.top_k > 0,
              "[MoE] expected dim, hidden, experts and top_k of at least 1, got dim=", o.dim,
              ", hidden=", o.hidden, ", experts=", o.experts, ", top_k=", o.top_k);
  EMBER_CHECK(o.top_k <= o.experts, "[MoE] top_k=", o.top_k, " is more than the ", o.experts,
              " experts");
  router = register_module("router", std::make_shared<Linear>(o.dim, o.experts, false));
  const double in_bound = 1.0 / std::sqrt(static_cast<double>(o.dim));
  const double hidden_bound = 1.0 / std::sqrt(static_cast<double>(o.hidden));
  w1 = register_parameter("w1", empty({o.experts, o.dim, o.hidden}));
  w3 = register_parameter("w3", empty({o.experts, o.dim, o.hidden}));
  w2 = register_parameter("w2", empty({o.experts, o.hidden, o.dim}));
  {
    NoGradGuard no_grad;
    init::uniform_(w1, -in_bound, in_bound);
    init::uniform_(w3, -in_bound, in_bound);
    init::uniform_(w2, -hidden_bound, hidden_bound);
  }
  dispatch_ = std::make_shared<LocalDispatch>();
}

std::string MoE::extra_repr() const {
  std::string s = detail::str_cat("dim=", options.dim, ", hidden=", options.hidden,
                                  ", experts=", options.experts, ", top_k=", options.top_k);
  if (local_experts_ != options.experts) {
    s += detail::str_cat(", local_experts=", first_expert_, ":", first_expert_ + local_experts_);
  }
  return s;
}

void MoE::on_parameter_set(const std::string& name, const Tensor& t) {
  (name == "w1" ? w1 : name == "w3" ? w3 : w2) = t;
}

void MoE::keep_experts(int64_t first, int64_t count) {
  EMBER_CHECK(
      count > 0 && first >= first_expert_ && first + count <= first_expert_ + local_experts_,
      "[MoE] keep_experts(", first, ", ", count, ") is outside the experts held, ", first_expert_,
      " to ", first_expert_ + local_experts_ - 1);
  const int64_t at = first - first_expert_;
  NoGradGuard no_grad;
  set_parameter("w1", w1.narrow(0, at, count).clone());
  set_parameter("w3", w3.narrow(0, at, count).clone());
  set_parameter("w2", w2.narrow(0, at, count).clone());
  first_expert_ = first;
  local_experts_ = count;
}

void MoE::set_dispatch(std::shared_ptr<ExpertDispatch> dispatch) {
  dispatch_ = dispatch ? std::move(dispatch) : std::make_shared<LocalDispatch>();
}

Tensor MoE::run_local_experts(const Tensor& rows, const std::vector<int64_t>& counts) {
  EMBER_CHECK(static_cast<int64_t>(counts.size()) == local_experts_,
              "[MoE] expected a count for each of the ", local_experts_, " experts held, got ",
              counts.size());
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  EMBER_CHECK(rows.dim() == 2 && rows.size(0) == total && rows.size(1) == options.dim,
              "[MoE] expected [", total, ", ", options.dim, "] rows for the experts, got ",
              rows.shape());
  std::vector<Tensor> outs;
  int64_t at = 0;
  for (int64_t e = 0; e < local_experts_; ++e) {
    const int64_t c = counts[static_cast<size_t>(e)];
    if (c == 0) continue;
    const Tensor x = rows.narrow(0, at, c);
    at += c;
    const Tensor h = silu(matmul(x, w1.select(0, e))) * matmul(x, w3.select(0, e));
    outs.push_back(matmul(h, w2.select(0, e)));
  }
  if (outs.empty()) return zeros({0, options.dim}, rows.options());
  return outs.size() == 1 ? outs[0] : cat(outs, 0);
}

Tensor MoE::forward(const Tensor& x) {
  EMBER_CHECK(x.defined() && x.dim() >= 1 && x.size(-1) == options.dim,
              "[MoE] expected input [..., ", options.dim, "], got ",
              x.defined() ? x.shape() : Shape{});
  const int64_t E = options.experts, k = options.top_k;
  const Tensor t = x.reshape({-1, options.dim});
  const int64_t N = t.size(0);
  // The router's probabilities in float32 whatever the activations' dtype (under autocast its
  // logits are 16-bit): small differences between experts decide the routing.
  const Tensor probs = softmax(router->forward(t).to(kFloat32), -1);
  auto [weights, chosen] = topk(probs, k, -1);
  if (options.normalize_weights) weights = weights / weights.sum({-1}, true);

  // Group the N k assignments by expert (a stable counting sort): order[a] is the assignment
  // placed a-th, counts[e] how many expert e got.
  const std::vector<int64_t> expert = chosen.to(kCPU).to_vector<int64_t>();
  std::vector<int64_t> counts(static_cast<size_t>(E), 0);
  for (int64_t e : expert) ++counts[static_cast<size_t>(e)];
  std::vector<int64_t> start(static_cast<size_t>(E), 0);
  std::partial_sum(counts.begin(), counts.end() - 1, start.begin() + 1);
  std::vector<int64_t> order(expert.size()), token(expert.size());
  for (size_t a = 0; a < expert.size(); ++a) {
    const int64_t at = start[static_cast<size_t>(expert[a])]++;
    order[static_cast<size_t>(at)] = static_cast<int64_t>(a);
    token[static_cast<size_t>(at)] = static_cast<int64_t>(a) / k;
  }
  tokens_per_expert_ = counts;
  const Tensor order_t = from_vector(order, {N * k}).to(x.device());
  const Tensor token_t = from_vector(token, {N * k}).to(x.device());

  const Tensor outs = dispatch_->run(*this, index_select(t, 0, token_t), counts);
  const Tensor w = index_select(weights.reshape({-1}), 0, order_t).to(outs.dtype());
  Tensor y = zeros({N, options.dim}, outs.options());
  index_add_(y, 0, token_t, outs * w.unsqueeze(1));

  // Switch Transformer's balance loss: shares of assignments (constants) times mean
  // probabilities (differentiable).
  std::vector<float> share(counts.size());
  for (size_t e = 0; e < counts.size(); ++e) {
    share[e] = N > 0 ? static_cast<float>(counts[e]) / static_cast<float>(N * k) : 0.0f;
  }
  const Tensor mean_prob = N > 0 ? probs.mean({0}) : zeros({E}, probs.options());
  aux_loss_ = (from_vector(share, {E}).to(x.device()) * mean_prob).sum() * static_cast<double>(E);
  return y.reshape(x.shape());
}

}  // namespace ember::nn
