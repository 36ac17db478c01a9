// Attention for nn code: scaled_dot_product_attention (torch.nn.functional's, PyTorch 2
// semantics), its math path and the choice of implementation (torch.nn.attention.sdpa_kernel)
// are tensor-layer ops, documented in tensor/ops/attention.h; nn::functional names the same
// functions and types, as torch.nn.functional does.
#pragma once

#include <ember/tensor/ops/attention.h>
#include <ember/tensor/ops.h>

namespace ember::nn::functional {

using ember::cudnn_sdp_enabled;
using ember::enable_cudnn_sdp;
using ember::kAttentionMathBudgetBytes;
using ember::scaled_dot_product_attention;
using ember::scaled_dot_product_attention_math;
using ember::sdp_backend;
using ember::SdpBackend;
using ember::SdpBackendGuard;
using ember::set_sdp_backend;

}  // namespace ember::nn::functional
