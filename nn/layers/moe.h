// Mixture of experts: a token-choice top-k router over SwiGLU experts (Mixtral's and DeepSeek's
// layer, torchtitan's MoE). Each token goes to the k experts its router scores highest, and its
// output is their outputs weighted by the router's probabilities:
//
//   auto moe = std::make_shared<nn::MoE>(nn::MoEOptions{.dim = 256, .hidden = 512,
//                                                       .experts = 8, .top_k = 2});
//   Tensor y = moe->forward(x);                          // x, y: [..., 256]
//   Tensor loss = task_loss + 0.01 * moe->aux_loss();    // keeps the experts' loads even
//
// Dropless: every assignment is computed (no capacity factor drops tokens), each expert once over
// all the rows routed to it. The grouping by expert is counted on the host (for CUDA tensors
// one small copy of the chosen experts a forward, as torchtitan's token counts are), so the
// experts run as plain matmuls over contiguous row blocks. Where the rows go to be computed is
// the layer's ExpertDispatch: here by default, or to the ranks holding each expert under
// expert parallelism (dist::parallelize_experts, distributed/tensor_parallel/expert_parallel.h).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ember/nn/layers/linear.h>
#include <ember/nn/module.h>

namespace ember::nn {

struct MoEOptions {
  int64_t dim = 0;      ///< width of a token (input and output)
  int64_t hidden = 0;   ///< an expert's hidden width (SwiGLU: w2(silu(x w1) * (x w3)))
  int64_t experts = 8;  ///< experts in the layer
  int64_t top_k = 2;    ///< experts per token
  /// Rescale each token's k routing weights to sum to 1 (Mixtral); false keeps them as the
  /// softmax over all experts gave them (torchtitan's default). With top_k 1 the rescaled
  /// weight is always 1 and the router learns only from aux_loss(): Switch Transformer's top-1
  /// routing is normalize_weights = false.
  bool normalize_weights = true;
};

class MoE;

/// Where a MoE's rows are computed. forward() hands run() the tokens' rows grouped by expert,
/// `counts[e]` rows for expert e (every expert of the layer, in order), and expects the experts'
/// outputs in the same order. The default runs them here; expert parallelism sends each row to
/// the rank holding its expert and brings the result back.
class ExpertDispatch {
 public:
  virtual ~ExpertDispatch() = default;
  virtual Tensor run(MoE& moe, const Tensor& rows, const std::vector<int64_t>& counts) = 0;
};

class MoE : public Module {
 public:
  /// Router and experts start as Linear layers of their shapes do (U(-1/sqrt(fan_in),
  /// 1/sqrt(fan_in))), from the global generator. Throws ValueError for a size below 1 or
  /// top_k above the experts.
  explicit MoE(const MoEOptions& options);
  std::string name() const override { return "MoE"; }
  /// "dim=256, hidden=512, experts=8, top_k=2" (and "local_experts=2:4" when sharded)
  std::string extra_repr() const override;
  /// x [..., dim] -> [..., dim]. Records aux_loss() and tokens_per_expert().
  Tensor forward(const Tensor& x) override;

  /// The experts held here applied to rows grouped by them: counts[i] rows for expert
  /// first_expert() + i, for each of local_experts(). Returns [rows, dim].
  Tensor run_local_experts(const Tensor& rows, const std::vector<int64_t>& counts);
  /// Switch Transformer's load-balancing loss of the last forward: experts x the sum over
  /// experts of (the share of this forward's assignments it got) x (its mean router
  /// probability); 1 when the loads are even, up to experts when one expert gets everything.
  /// Differentiable through the router (the shares are counts). Undefined before a forward.
  Tensor aux_loss() const { return aux_loss_; }
  /// How many of the last forward's tokens chose each expert (size experts).
  const std::vector<int64_t>& tokens_per_expert() const { return tokens_per_expert_; }

  /// Keeps experts [first, first + count) and drops the others' weights (what expert
  /// parallelism does on each rank); forward then needs a dispatch that reaches the rest.
  /// Throws ValueError for a range outside the experts held.
  void keep_experts(int64_t first, int64_t count);
  int64_t first_expert() const { return first_expert_; }
  int64_t local_experts() const { return local_experts_; }
  /// Replaces the dispatch (null: back to running every expert here).
  void set_dispatch(std::shared_ptr<ExpertDispatch> dispatch);

  const MoEOptions options;
  std::shared_ptr<Linear> router;  ///< dim -> experts, no bias
  /// The experts held here, stacked: w1, w3 [local_experts, dim, hidden], w2 [.., hidden, dim].
  Tensor w1, w3, w2;

 protected:
  void on_parameter_set(const std::string& name, const Tensor& t) override;

 private:
  int64_t first_expert_ = 0, local_experts_ = 0;
  std::shared_ptr<ExpertDispatch> dispatch_;
  Tensor aux_loss_;
  std::vector<int64_t> tokens_per_expert_;
};

}  // namespace ember::nn
