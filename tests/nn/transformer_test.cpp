// MultiheadAttention and TransformerEncoderLayer: values and gradients against PyTorch 1.13
// (tests/nn/transformer_reference.h, from make_transformer_reference.py), torch's state_dict
// names and initialisation, masks and their equivalences, gradcheck.
#include <ember/nn/layers/transformer.h>

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <ember/nn/attention.h>
#include <ember/nn/layers/embedding.h>
#include <ember/nn/functional.h>
#include <ember/nn/optim/adam.h>
#include <ember/nn/optim/sgd.h>
#include <ember/nn/io/serialize.h>
#include <ember/tensor/gpu/cuda.h>
#include "tests/autograd/grad_util.h"
#include "tests/nn/transformer_reference.h"

namespace ember::nn {
namespace {

using test::expect_close;
using test::expect_error;
using test::rand_t;
using NamedRef = std::vector<std::pair<std::string, std::vector<double>>>;

std::vector<std::string> names(const NamedTensors& v) {
  std::vector<std::string> r;
  for (const auto& [n, t] : v) r.push_back(n);
  return r;
}

/// The reference script's set_params: parameters in named_parameters() order from lcg seeds
/// 1000, 1001, ... scaled by 0.5.
void set_params(Module& m) {
  NoGradGuard no_grad;
  uint64_t seed = 1000;
  for (auto& [n, p] : m.named_parameters()) {
    Tensor(p).copy_(rand_t(p.shape(), p.dtype(), seed++) * 0.5);
  }
}

/// The max absolute difference between two tensors of one shape.
double max_diff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  return (a.to(kFloat64) - b.to(kFloat64)).abs().max().item<double>();
}

class TransformerRef : public ::testing::TestWithParam<Dtype> {
 protected:
  Dtype dt() const { return GetParam(); }
  double tol() const { return dt() == kFloat64 ? 1e-10 : 2e-5; }
  Tensor leaf(IntList shape, uint64_t seed) const {
    Tensor t = rand_t(shape, dt(), seed);
    t.requires_grad_();
    return t;
  }
  /// Sum of (t * lcg(seed)): a loss whose gradient for t is the lcg tensor.
  Tensor weighted(const Tensor& t, uint64_t seed) const {
    return (t * rand_t(t.shape(), dt(), seed)).sum();
  }
  /// The reference's query, key and value gradients (k<Case>Dq, Dk, Dv).
  void expect_qkv_grads(const Tensor& q, const Tensor& k, const Tensor& v,
                        const std::vector<double>& dq, const std::vector<double>& dk,
                        const std::vector<double>& dv) const {
    expect_close(q.grad(), dq, tol(), "query grad");
    expect_close(k.grad(), dk, tol(), "key grad");
    expect_close(v.grad(), dv, tol(), "value grad");
  }
  void expect_grads(const Module& m, const NamedRef& want, const std::string& what) const {
    const NamedTensors params = m.named_parameters();
    ASSERT_EQ(params.size(), want.size()) << what;
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_EQ(params[i].first, want[i].first) << what;
      expect_close(params[i].second.grad(), want[i].second, tol(), what + " " + want[i].first);
    }
  }
};

TEST_P(TransformerRef, MhaSelfAttentionWithAveragedWeights) {
  auto mha = std::make_shared<MultiheadAttention>(8, 2);
  mha->to(dt());
  set_params(*mha);
  const Tensor x = leaf({4, 2, 8}, 1);
  auto [y, w] = mha->forward(x, x, x);
  EXPECT_EQ(y.dtype(), dt());
  (weighted(y, 2) + weighted(w, 3)).backward();
  expect_close(y, test::ref::kMhaSelfY, tol(), "output");
  expect_close(w, test::ref::kMhaSelfW, tol(), "weights");
  expect_close(x.grad(), test::ref::kMhaSelfDx, tol(), "input grad");
  expect_grads(*mha, test::ref::kMhaSelfGrads, "MhaSelf");
}

TEST_P(TransformerRef, MhaCrossAttentionKdimVdimBatchFirstBoolMasks) {
  MultiheadAttentionOptions o;
  o.kdim = 6;
  o.vdim = 5;
  o.batch_first = true;
  auto mha = std::make_shared<MultiheadAttention>(8, 2, o);
  mha->to(dt());
  set_params(*mha);
  const Tensor q = leaf({2, 3, 8}, 11), k = leaf({2, 5, 6}, 12), v = leaf({2, 5, 5}, 13);
  // true = NOT allowed (MultiheadAttention's meaning)
  const Tensor am = tensor({0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0}).to(kBool).view({3, 5});
  const Tensor kpm = tensor({0, 0, 0, 1, 0, 0, 1, 0, 0, 1}).to(kBool).view({2, 5});
  auto [y, w] = mha->forward(q, k, v, kpm, true, am, /*average_attn_weights=*/false);
  EXPECT_EQ(w.shape(), Shape({2, 2, 3, 5}));
  (weighted(y, 14) + weighted(w, 15)).backward();
  expect_close(y, test::ref::kMhaCrossY, tol(), "output");
  expect_close(w, test::ref::kMhaCrossW, tol(), "weights");
  expect_qkv_grads(q, k, v, test::ref::kMhaCrossDq, test::ref::kMhaCrossDk,
                   test::ref::kMhaCrossDv);
  expect_grads(*mha, test::ref::kMhaCrossGrads, "MhaCross");
}

TEST_P(TransformerRef, MhaFloat3dMaskWithoutWeightsTakesTheSdpaPath) {
  auto mha = std::make_shared<MultiheadAttention>(8, 4);
  mha->to(dt());
  set_params(*mha);
  const Tensor q = leaf({3, 2, 8}, 21), k = leaf({5, 2, 8}, 22), v = leaf({5, 2, 8}, 23);
  const Tensor fm = rand_t({8, 3, 5}, dt(), 24) * 2.0;
  const Tensor kpm = tensor({0, 0, 1, 0, 0, 1, 0, 0, 0, 0}).to(kBool).view({2, 5});
  auto [y, w] = mha->forward(q, k, v, kpm, /*need_weights=*/false, fm);
  EXPECT_FALSE(w.defined());
  weighted(y, 25).backward();
  expect_close(y, test::ref::kMhaMaskY, tol(), "output");
  expect_qkv_grads(q, k, v, test::ref::kMhaMaskDq, test::ref::kMhaMaskDk,
                   test::ref::kMhaMaskDv);
  expect_grads(*mha, test::ref::kMhaMaskGrads, "MhaMask");
}

TEST_P(TransformerRef, MhaAddBiasKvAndZeroAttn) {
  // Query 2 masks every real key: only the bias and zero keys remain (no NaN).
  MultiheadAttentionOptions o;
  o.add_bias_kv = true;
  o.add_zero_attn = true;
  auto mha = std::make_shared<MultiheadAttention>(8, 2, o);
  EXPECT_EQ(names(mha->state_dict()),
            (std::vector<std::string>{"in_proj_weight", "in_proj_bias", "bias_k", "bias_v",
                                      "out_proj.weight", "out_proj.bias"}));
  mha->to(dt());
  set_params(*mha);
  const Tensor q = leaf({3, 2, 8}, 41), k = leaf({4, 2, 8}, 42), v = leaf({4, 2, 8}, 43);
  const Tensor am = tensor({0, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1}).to(kBool).view({3, 4});
  const Tensor kpm = tensor({0, 0, 1, 0, 0, 0, 0, 0}).to(kBool).view({2, 4});
  auto [y, w] = mha->forward(q, k, v, kpm, true, am, false);
  EXPECT_EQ(w.shape(), Shape({2, 2, 3, 6}));
  (weighted(y, 44) + weighted(w, 45)).backward();
  expect_close(y, test::ref::kMhaBiasKvY, tol(), "output");
  expect_close(w, test::ref::kMhaBiasKvW, tol(), "weights");
  expect_qkv_grads(q, k, v, test::ref::kMhaBiasKvDq, test::ref::kMhaBiasKvDk,
                   test::ref::kMhaBiasKvDv);
  expect_grads(*mha, test::ref::kMhaBiasKvGrads, "MhaBiasKv");
  // the scaled_dot_product_attention path agrees
  NoGradGuard no_grad;
  EXPECT_LT(max_diff(mha->forward(q, k, v, kpm, false, am).output, y), 100 * tol());
}

struct TelCase {
  bool norm_first;
  const char* activation;
  const std::vector<double>* y;
  const std::vector<double>* dx;
  const NamedRef* grads;
};

TEST_P(TransformerRef, EncoderLayerNormFirstBothWaysReluAndGelu) {
  namespace r = test::ref;
  const TelCase cases[] = {
      {false, "relu", &r::kTelPostReluY, &r::kTelPostReluDx, &r::kTelPostReluGrads},
      {false, "gelu", &r::kTelPostGeluY, &r::kTelPostGeluDx, &r::kTelPostGeluGrads},
      {true, "relu", &r::kTelPreReluY, &r::kTelPreReluDx, &r::kTelPreReluGrads},
      {true, "gelu", &r::kTelPreGeluY, &r::kTelPreGeluDx, &r::kTelPreGeluGrads},
  };
  // Causal src_mask (true above the diagonal) and a padding mask hiding the last key of
  // sequence 0.
  const Tensor causal = gt(arange(0, 5).unsqueeze(0), arange(0, 5).unsqueeze(1));
  const Tensor kpm = tensor({0, 0, 0, 0, 1, 0, 0, 0, 0, 0}).to(kBool).view({2, 5});
  for (const TelCase& c : cases) {
    const std::string what = std::string(c.norm_first ? "pre-" : "post-") + c.activation;
    TransformerEncoderLayerOptions o;
    o.dim_feedforward = 16;
    o.dropout = 0.0;
    o.activation = c.activation;
    o.norm_first = c.norm_first;
    o.batch_first = std::string(c.activation) == "gelu";
    auto layer = std::make_shared<TransformerEncoderLayer>(8, 2, o);
    layer->to(dt());
    set_params(*layer);
    const Tensor x = leaf(o.batch_first ? IntList{2, 5, 8} : IntList{5, 2, 8}, 31);
    const Tensor y = layer->forward(x, causal, kpm);
    weighted(y, 32).backward();
    expect_close(y, *c.y, tol(), what + " output");
    expect_close(x.grad(), *c.dx, tol(), what + " input grad");
    expect_grads(*layer, *c.grads, what);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, TransformerRef, ::testing::Values(kFloat32, kFloat64),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// ---- names, initialisation, options ----------------------------------------------------------

TEST(MultiheadAttention, StateDictNamesAreTorchs) {
  MultiheadAttention packed(8, 2);
  EXPECT_EQ(names(packed.state_dict()),
            (std::vector<std::string>{"in_proj_weight", "in_proj_bias", "out_proj.weight",
                                      "out_proj.bias"}));
  EXPECT_EQ(packed.in_proj_weight.shape(), Shape({24, 8}));
  MultiheadAttentionOptions o;
  o.kdim = 3;
  o.bias = false;
  MultiheadAttention separate(8, 2, o);
  EXPECT_EQ(names(separate.state_dict()),
            (std::vector<std::string>{"q_proj_weight", "k_proj_weight", "v_proj_weight",
                                      "out_proj.weight"}));
  EXPECT_EQ(separate.k_proj_weight.shape(), Shape({8, 3}));
  EXPECT_EQ(separate.v_proj_weight.shape(), Shape({8, 8}));
}

TEST(MultiheadAttention, InitIsXavierUniformWithZeroBiases) {
  manual_seed(0);
  MultiheadAttention mha(16, 4);
  // xavier_uniform on [3E, E]: bound sqrt(6 / (E + 3E))
  const double bound = std::sqrt(6.0 / (16 + 48));
  const Tensor w = mha.in_proj_weight.detach();
  EXPECT_LE(w.abs().max().item<double>(), bound);
  EXPECT_GT(w.abs().max().item<double>(), 0.8 * bound);  // spread over the whole range
  EXPECT_EQ(mha.in_proj_bias.abs().max().item<double>(), 0.0);
  EXPECT_EQ(mha.out_proj->bias.abs().max().item<double>(), 0.0);
  EXPECT_GT(mha.out_proj->weight.abs().max().item<double>(), 0.0);
}

TEST(TransformerEncoderLayer, StateDictNamesAreTorchs) {
  TransformerEncoderLayer layer(8, 2, {.dim_feedforward = 16});
  EXPECT_EQ(names(layer.state_dict()),
            (std::vector<std::string>{
                "self_attn.in_proj_weight", "self_attn.in_proj_bias",
                "self_attn.out_proj.weight", "self_attn.out_proj.bias", "linear1.weight",
                "linear1.bias", "linear2.weight", "linear2.bias", "norm1.weight", "norm1.bias",
                "norm2.weight", "norm2.bias"}));
  std::vector<std::string> children;
  for (const auto& [n, c] : layer.named_children()) children.push_back(n);
  EXPECT_EQ(children, (std::vector<std::string>{"self_attn", "linear1", "dropout", "linear2",
                                                "norm1", "norm2", "dropout1", "dropout2"}));
  EXPECT_EQ(layer.linear1->weight.shape(), Shape({16, 8}));
}

TEST(MultiheadAttention, RefusesWhatItDoesNotSupport) {
  expect_error<ValueError>([] { MultiheadAttention(10, 3); }, {"divisible by num_heads"});
  expect_error<ValueError>(
      [] { TransformerEncoderLayer(8, 2, {.activation = "tanh"}); }, {"activation", "tanh"});
  MultiheadAttention mha(8, 2);
  const Tensor x = rand_t({4, 2, 8}, kFloat32, 1);
  expect_error<ValueError>([&] { mha.forward(x, x, x, {}, true, zeros({4, 3}, kBool)); },
                           {"attn_mask", "[4, 4]"});
  expect_error<ValueError>([&] { mha.forward(x, x, x, zeros({2, 3}, kBool)); },
                           {"key_padding_mask", "[2, 4]"});
  expect_error<TypeError>([&] { mha.forward(x, x, x, zeros({2, 4}, kInt64)); },
                          {"key_padding_mask", "int64"});
  expect_error<ValueError>([&] { mha.forward(rand_t({4, 2, 6}, kFloat32, 2), x, x); },
                           {"features"});
}

// ---- equivalences ----------------------------------------------------------------------------

TEST(MultiheadAttention, WeightsPathAndSdpaPathAgree) {
  MultiheadAttention mha(8, 2);
  mha.to(kFloat64);
  const Tensor x = rand_t({5, 3, 8}, kFloat64, 1);
  const Tensor kpm = tensor({0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0}).to(kBool).view({3, 5});
  const Tensor am = rand_t({5, 5}, kFloat64, 2);
  const Tensor a = mha.forward(x, x, x, kpm, true, am).output;
  const Tensor b = mha.forward(x, x, x, kpm, false, am).output;
  EXPECT_LT(max_diff(a, b), 1e-12);
}

TEST(MultiheadAttention, IsCausalEqualsTheExplicitCausalMask) {
  MultiheadAttention mha(8, 2);
  mha.to(kFloat64);
  const Tensor x = rand_t({5, 2, 8}, kFloat64, 3);
  const Tensor causal = gt(arange(0, 5).unsqueeze(0), arange(0, 5).unsqueeze(1));
  const Tensor want = mha.forward(x, x, x, {}, true, causal).output;
  // no weights, no padding: scaled_dot_product_attention's is_causal
  EXPECT_LT(max_diff(mha.forward(x, x, x, {}, false, {}, true, true).output, want), 1e-12);
  // with weights: the mask is built here
  auto [y, w] = mha.forward(x, x, x, {}, true, {}, true, true);
  EXPECT_LT(max_diff(y, want), 1e-12);
  EXPECT_EQ(w.select(0, 0).select(0, 0).select(0, 1).item<double>(), 0.0);  // key 1 > query 0
  // with a padding mask
  const Tensor kpm = tensor({0, 1, 0, 0, 0, 0, 0, 0, 0, 0}).to(kBool).view({2, 5});
  EXPECT_LT(max_diff(mha.forward(x, x, x, kpm, false, {}, true, true).output,
                     mha.forward(x, x, x, kpm, false, causal).output),
            1e-12);
}

TEST(MultiheadAttention, UnbatchedInputIsOneBatchElement) {
  MultiheadAttentionOptions o;
  o.batch_first = true;
  MultiheadAttention mha(8, 2, o);
  mha.to(kFloat64);
  const Tensor q = rand_t({3, 8}, kFloat64, 4), kv = rand_t({4, 8}, kFloat64, 5);
  const Tensor kpm = tensor({0, 0, 1, 0}).to(kBool);
  auto [y, w] = mha.forward(q, kv, kv, kpm);
  auto [yb, wb] = mha.forward(q.unsqueeze(0), kv.unsqueeze(0), kv.unsqueeze(0), kpm.unsqueeze(0));
  EXPECT_EQ(y.shape(), Shape({3, 8}));
  EXPECT_EQ(w.shape(), Shape({3, 4}));
  EXPECT_LT(max_diff(y, yb.squeeze(0)), 1e-12);
  EXPECT_LT(max_diff(w, wb.squeeze(0)), 1e-12);
}

TEST(MultiheadAttention, BoolMaskMeansNotAllowedTheOppositeOfSdpa) {
  // A key masked by attn_mask = true gets zero weight.
  MultiheadAttention mha(4, 1);
  const Tensor x = rand_t({3, 1, 4}, kFloat32, 6);
  Tensor am = zeros({3, 3}, kBool);
  am = masked_fill(am, eq(arange(0, 3).unsqueeze(0), 2).expand({3, 3}), true);  // key 2 masked
  auto [y, w] = mha.forward(x, x, x, {}, true, am);
  EXPECT_EQ(w.select(0, 0).select(1, 2).abs().max().item<double>(), 0.0);
  EXPECT_GT(w.select(0, 0).select(1, 0).abs().min().item<double>(), 0.0);
}

TEST(MultiheadAttention, DropoutOnlyInTraining) {
  MultiheadAttentionOptions o;
  o.dropout = 0.5;
  MultiheadAttention mha(8, 2, o);
  const Tensor x = rand_t({6, 2, 8}, kFloat32, 7);
  mha.eval();
  const Tensor a = mha.forward(x, x, x).output, b = mha.forward(x, x, x).output;
  EXPECT_EQ(max_diff(a, b), 0.0);
  mha.train();
  manual_seed(1);
  auto [c, w] = mha.forward(x, x, x, {}, true, {}, false);
  EXPECT_GT(max_diff(a, c), 1e-3);
  // torch returns the weights after dropout: some are zero
  EXPECT_EQ(eq(w, 0.0).sum().item<double>() > 0, true);
}

TEST(MultiheadAttention, GradcheckFloat64WithMasks) {
  auto mha = std::make_shared<MultiheadAttention>(4, 2);
  mha->to(kFloat64);
  const Tensor kpm = tensor({0, 0, 1, 0, 0, 0}).to(kBool).view({2, 3});
  const Tensor am = rand_t({2, 3}, kFloat64, 8);
  auto params = mha->named_parameters();
  std::vector<Tensor> inputs = {test::leaf({2, 2, 4}, 9), test::leaf({3, 2, 4}, 10),
                                test::leaf({3, 2, 4}, 11)};
  for (auto& [n, p] : params) inputs.push_back(p.detach().clone().requires_grad_());
  for (bool need_weights : {true, false}) {
    test::expect_gradcheck(
        [&](const std::vector<Tensor>& in) {
          // the perturbed copies become the module's parameters
          for (size_t i = 0; i < params.size(); ++i) {
            if (params[i].first == "out_proj.weight" || params[i].first == "out_proj.bias") {
              mha->out_proj->set_parameter(params[i].first.substr(9), in[3 + i]);
            } else {
              mha->set_parameter(params[i].first, in[3 + i]);
            }
          }
          auto [y, w] = mha->forward(in[0], in[1], in[2], kpm, need_weights, am);
          return need_weights ? std::vector<Tensor>{y, w} : std::vector<Tensor>{y};
        },
        inputs);
  }
}

TEST(TransformerEncoderLayer, EvalModeIsDeterministicAndTrainingDropsOut) {
  auto layer = std::make_shared<TransformerEncoderLayer>(
      8, 2, TransformerEncoderLayerOptions{.dim_feedforward = 16, .dropout = 0.3});
  const Tensor x = rand_t({5, 2, 8}, kFloat32, 12);
  layer->eval();
  const Tensor a = layer->forward(x);
  EXPECT_EQ(max_diff(a, layer->forward(x)), 0.0);
  layer->train();
  EXPECT_GT(max_diff(a, layer->forward(x)), 1e-4);
}

TEST(TransformerEncoderLayer, CudaMatchesCpuWithMasks) {
  if (!cuda::is_available()) GTEST_SKIP() << cuda::unavailable_reason();
  const Device dev = cuda_device(0);
  for (Dtype dt : {kFloat32, kFloat64}) {
    for (bool need_weights : {true, false}) {
      manual_seed(5);
      auto cpu = std::make_shared<TransformerEncoderLayer>(
          8, 2, TransformerEncoderLayerOptions{.dim_feedforward = 16, .dropout = 0.0});
      cpu->to(dt);
      auto gpu = std::make_shared<TransformerEncoderLayer>(
          8, 2, TransformerEncoderLayerOptions{.dim_feedforward = 16, .dropout = 0.0});
      gpu->to(dev, dt);
      gpu->load_state_dict(cpu->state_dict());
      const Tensor causal = gt(arange(0, 5).unsqueeze(0), arange(0, 5).unsqueeze(1));
      const Tensor kpm = tensor({0, 0, 0, 1, 0, 0, 0, 0, 0, 0}).to(kBool).view({2, 5});
      Tensor xc = rand_t({5, 2, 8}, dt, 1).requires_grad_();
      Tensor xg = xc.detach().to(dev).requires_grad_();
      const Tensor yc = cpu->forward(xc, causal, kpm);
      const Tensor yg = gpu->forward(xg, causal.to(dev), kpm.to(dev));
      const double tol = dt == kFloat64 ? 1e-10 : 1e-4;
      EXPECT_LT(max_diff(yg.cpu(), yc), tol);
      yc.sum().backward();
      yg.sum().backward();
      EXPECT_LT(max_diff(xg.grad().cpu(), xc.grad()), tol);
      auto pc = cpu->parameters(), pg = gpu->parameters();
      for (size_t i = 0; i < pc.size(); ++i) {
        EXPECT_LT(max_diff(pg[i].grad().cpu(), pc[i].grad()), tol) << i;
      }
      // explicit weights on the device too
      MultiheadAttention& a = *gpu->self_attn;
      auto [o, w] = a.forward(xg.detach(), xg.detach(), xg.detach(), kpm.to(dev), need_weights);
      EXPECT_EQ(o.device(), dev);
      EXPECT_EQ(w.defined(), need_weights);
    }
  }
}

// ---- weight tying -----------------------------------------------------------------------------

/// A token embedding and an LM head sharing one weight [V, D], as GPT-2 does.
class TiedLm : public Module {
 public:
  TiedLm() {
    emb = register_module("emb", std::make_shared<Embedding>(10, 4));
    lm_head = register_module("lm_head", std::make_shared<Linear>(4, 10, false));
    lm_head->set_parameter("weight", emb->weight);
  }
  Tensor forward(const Tensor& tokens) override { return lm_head->forward(emb->forward(tokens)); }
  std::shared_ptr<Embedding> emb;
  std::shared_ptr<Linear> lm_head;
};

const Tensor kTokens = tensor({1, 3, 3, 7, 0}).to(kInt64);

TEST(WeightTying, ParametersListTheSharedTensorOnceStateDictUnderBothNames) {
  TiedLm m;
  EXPECT_TRUE(m.lm_head->weight.is_same(m.emb->weight));
  EXPECT_EQ(names(m.named_parameters()), (std::vector<std::string>{"emb.weight"}));
  EXPECT_EQ(m.parameters().size(), 1u);
  // torch's state_dict keeps both keys
  const NamedTensors sd = m.state_dict();
  EXPECT_EQ(names(sd), (std::vector<std::string>{"emb.weight", "lm_head.weight"}));
  EXPECT_EQ(sd[0].second.data_ptr(), sd[1].second.data_ptr());
  // conversion keeps the tie
  m.to(kFloat64);
  EXPECT_TRUE(m.lm_head->weight.is_same(m.emb->weight));
  EXPECT_EQ(m.lm_head->weight.dtype(), kFloat64);
}

TEST(WeightTying, GradientSumsBothUsesAndOptimizersStepOnce) {
  manual_seed(1);
  TiedLm m;
  const Tensor w0 = m.emb->weight.detach().clone();
  square(m.forward(kTokens)).sum().backward();
  // the same computation written with one leaf used twice
  Tensor w = w0.clone().requires_grad_();
  square(functional::linear(functional::embedding(kTokens, w), w)).sum().backward();
  const Tensor g = m.emb->weight.grad();
  EXPECT_LT(max_diff(g, w.grad()), 1e-6);
  optim::SGD sgd(m.parameters(), {.lr = 0.1});
  sgd.step();
  EXPECT_LT(max_diff(m.emb->weight.detach(), w0 - 0.1 * g), 1e-7);  // once, not twice
  optim::AdamW adam(m.parameters());
  EXPECT_EQ(adam.param_groups()[0].params.size(), 1u);
  // both handles listed by hand: refused rather than stepped twice
  expect_error<ValueError>([&] { optim::AdamW({m.emb->weight, m.lm_head->weight}); },
                           {"same tensor"});
}

TEST(WeightTying, SavedAndLoadedBackTied) {
  manual_seed(2);
  TiedLm a;
  const std::string path =
      (std::filesystem::temp_directory_path() /
       ("ember_tied_" + std::to_string(::getpid()) + ".safetensors"))
          .string();
  save_state_dict(path, a.state_dict());
  const SafetensorsFile f = load_safetensors(path);
  std::filesystem::remove(path);
  EXPECT_TRUE(f.contains("emb.weight") && f.contains("lm_head.weight"));
  manual_seed(3);
  TiedLm b;
  b.load_state_dict(f.tensors());
  EXPECT_TRUE(b.lm_head->weight.is_same(b.emb->weight));
  EXPECT_EQ(max_diff(b.emb->weight.detach(), a.emb->weight.detach()), 0.0);
  EXPECT_EQ(max_diff(b.forward(kTokens), a.forward(kTokens)), 0.0);
}

TEST(WeightTying, SetParameterChecksItsArguments) {
  TiedLm m;
  expect_error<ValueError>([&] { m.lm_head->set_parameter("gamma", m.emb->weight); },
                           {"set_parameter", "Linear", "gamma"});
  expect_error<ValueError>([&] { m.lm_head->set_parameter("weight", Tensor()); },
                           {"undefined"});
  LayerNorm ln(4);
  expect_error<NotImplementedError>([&] { ln.set_parameter("weight", ones({4})); },
                                    {"LayerNorm", "on_parameter_set"});
  // MultiheadAttention keeps its handles in step
  MultiheadAttention a(4, 2), b(4, 2);
  b.set_parameter("in_proj_weight", a.in_proj_weight);
  EXPECT_TRUE(b.in_proj_weight.is_same(a.in_proj_weight));
}

}  // namespace
}  // namespace ember::nn
