#!/usr/bin/python3
# Computes the PyTorch reference values for tests/nn/transformer_test.cpp (MultiheadAttention
# and TransformerEncoderLayer) and writes them to tests/nn/transformer_reference.h. Run with
# Debian's PyTorch 1.13:
#   /usr/bin/python3 tests/nn/make_transformer_reference.py > tests/nn/transformer_reference.h
# Inputs, weights and output gradients are tests/tensor/test_util.h's lcg_values (as in
# make_reference.py), so the C++ tests build bit-identical tensors. Parameters are set in
# named_parameters() order from seeds 1000, 1001, ... scaled by 0.5. Everything is float64.
import torch
import torch.nn as nn

from reference_util import OUT, T, emit, fmt

torch.set_default_dtype(torch.float64)


def emit_named(name, pairs):
    body = ",\n".join('    {"%s", {\n%s\n    }}' % (n, fmt(t.detach().reshape(-1).tolist()))
                      for n, t in pairs)
    OUT.append("inline const std::vector<std::pair<std::string, std::vector<double>>> k%s = {\n"
               "%s\n};" % (name, body))


def set_params(mod):
    with torch.no_grad():
        for i, (n, p) in enumerate(mod.named_parameters()):
            p.copy_(T(list(p.shape), 1000 + i, 0.5))


def leaf(shape, seed):
    return T(shape, seed).requires_grad_()


def grads(mod):
    return [(n, p.grad) for n, p in mod.named_parameters()]


# ---- MultiheadAttention ----
# Self-attention, [L, N, E], weights averaged; loss weighs the output and the weights.
mha = nn.MultiheadAttention(8, 2)
set_params(mha)
x = leaf([4, 2, 8], 1)
y, w = mha(x, x, x)
((y * T(list(y.shape), 2)).sum() + (w * T(list(w.shape), 3)).sum()).backward()
emit("MhaSelfY", y); emit("MhaSelfW", w); emit("MhaSelfDx", x.grad)
emit_named("MhaSelfGrads", grads(mha))

# Cross-attention with kdim/vdim, batch_first, bool attn_mask [L, S] and bool key_padding_mask,
# per-head weights.
mha = nn.MultiheadAttention(8, 2, kdim=6, vdim=5, batch_first=True)
set_params(mha)
q, k, v = leaf([2, 3, 8], 11), leaf([2, 5, 6], 12), leaf([2, 5, 5], 13)
am = torch.tensor([[False, True, False, False, True],
                   [False, False, True, False, False],
                   [True, False, False, False, False]])
kpm = torch.tensor([[False, False, False, True, False],
                    [False, True, False, False, True]])
y, w = mha(q, k, v, key_padding_mask=kpm, attn_mask=am, average_attn_weights=False)
((y * T(list(y.shape), 14)).sum() + (w * T(list(w.shape), 15)).sum()).backward()
emit("MhaCrossY", y); emit("MhaCrossW", w)
emit("MhaCrossDq", q.grad); emit("MhaCrossDk", k.grad); emit("MhaCrossDv", v.grad)
emit_named("MhaCrossGrads", grads(mha))

# Distinct query/key/value of one width, float attn_mask [N * H, L, S] and bool
# key_padding_mask, no weights (Ember's scaled_dot_product_attention path).
mha = nn.MultiheadAttention(8, 4)
set_params(mha)
q, k, v = leaf([3, 2, 8], 21), leaf([5, 2, 8], 22), leaf([5, 2, 8], 23)
fm = T([8, 3, 5], 24, 2.0)
kpm = torch.tensor([[False, False, True, False, False], [True, False, False, False, False]])
y, w = mha(q, k, v, key_padding_mask=kpm, attn_mask=fm, need_weights=False)
assert w is None
(y * T(list(y.shape), 25)).sum().backward()
emit("MhaMaskY", y)
emit("MhaMaskDq", q.grad); emit("MhaMaskDk", k.grad); emit("MhaMaskDv", v.grad)
emit_named("MhaMaskGrads", grads(mha))

# add_bias_kv and add_zero_attn (two extra keys every query may attend to), bool masks.
mha = nn.MultiheadAttention(8, 2, add_bias_kv=True, add_zero_attn=True)
set_params(mha)
q, k, v = leaf([3, 2, 8], 41), leaf([4, 2, 8], 42), leaf([4, 2, 8], 43)
am = torch.tensor([[False, True, False, False], [False, False, True, True],
                   [True, True, True, True]])
kpm = torch.tensor([[False, False, True, False], [False, False, False, False]])
y, w = mha(q, k, v, key_padding_mask=kpm, attn_mask=am, average_attn_weights=False)
((y * T(list(y.shape), 44)).sum() + (w * T(list(w.shape), 45)).sum()).backward()
emit("MhaBiasKvY", y); emit("MhaBiasKvW", w)
emit("MhaBiasKvDq", q.grad); emit("MhaBiasKvDk", k.grad); emit("MhaBiasKvDv", v.grad)
emit_named("MhaBiasKvGrads", grads(mha))

# ---- TransformerEncoderLayer ----
# d_model 8, 2 heads, feed-forward 16, dropout 0, bool src_mask [S, S] (causal) and bool
# src_key_padding_mask; every combination of norm_first and activation; batch_first for gelu.
causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
kpm = torch.tensor([[False, False, False, False, True], [False, False, False, False, False]])
for norm_first in [False, True]:
    for act in ["relu", "gelu"]:
        bf = act == "gelu"
        layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0,
                                           activation=act, layer_norm_eps=1e-5,
                                           batch_first=bf, norm_first=norm_first)
        set_params(layer)
        x = leaf([2, 5, 8] if bf else [5, 2, 8], 31)
        y = layer(x, src_mask=causal, src_key_padding_mask=kpm)
        (y * T(list(y.shape), 32)).sum().backward()
        name = "Tel" + ("Pre" if norm_first else "Post") + act.capitalize()
        emit(name + "Y", y); emit(name + "Dx", x.grad)
        emit_named(name + "Grads", grads(layer))

print("// Generated by tests/nn/make_transformer_reference.py with PyTorch %s (float64). "
      "Do not edit." % torch.__version__)
print("#pragma once\n\n#include <string>\n#include <utility>\n#include <vector>\n\n"
      "namespace ember::test::ref {\n")
print("\n".join(OUT))
print("\n}  // namespace ember::test::ref")
