#!/usr/bin/python3
# Computes the PyTorch reference values for tests/nn/layers_test.cpp and loss_test.cpp and writes
# them to tests/nn/nn_reference.h. Run with Debian's PyTorch 1.13:
#   /usr/bin/python3 tests/nn/make_reference.py > tests/nn/nn_reference.h
# Inputs and weights are tests/tensor/test_util.h's lcg_values (re-implemented below), so the
# C++ tests build bit-identical tensors. Everything is computed in float64; the C++ tests compare
# float64 results tightly and float32 results loosely.
import torch
import torch.nn as nn
import torch.nn.functional as F

from reference_util import OUT, T, emit

torch.set_default_dtype(torch.float64)


def set_(p, v):
    with torch.no_grad():
        p.copy_(v)


def run(mod, x, gseed, prefix, params=()):
    x = x.clone().requires_grad_()
    y = mod(x)
    y.backward(T(list(y.shape), gseed))
    emit(prefix + "Y", y)
    emit(prefix + "Dx", x.grad)
    for n in params:
        emit(prefix + "D" + n, getattr(mod, n).grad)
    return y


# ---- Linear ----
lin = nn.Linear(5, 3)
set_(lin.weight, T([3, 5], 11)); set_(lin.bias, T([3], 12))
run(lin, T([4, 5], 13), 14, "Linear", ["weight", "bias"])
lin.zero_grad()
run(lin, T([2, 2, 5], 15), 16, "Linear3d")

# ---- Conv2d ----
conv = nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2)
set_(conv.weight, T([6, 2, 3, 3], 21)); set_(conv.bias, T([6], 22))
run(conv, T([2, 4, 7, 6], 23), 24, "ConvA", ["weight", "bias"])
conv = nn.Conv2d(3, 2, (2, 3), stride=(1, 2), padding=(1, 0), dilation=(2, 1), bias=False)
set_(conv.weight, T([2, 3, 2, 3], 25))
run(conv, T([1, 3, 5, 6], 26), 27, "ConvB", ["weight"])

# ---- BatchNorm1d ----
bn = nn.BatchNorm1d(3)
set_(bn.weight, T([3], 31)); set_(bn.bias, T([3], 32))
run(bn, T([4, 3, 5], 33, 2.0), 34, "Bn1d", ["weight", "bias"])
emit("Bn1dMean1", bn.running_mean); emit("Bn1dVar1", bn.running_var)
bn(T([6, 3], 35, 3.0))
emit("Bn1dMean2", bn.running_mean); emit("Bn1dVar2", bn.running_var)
bn.eval()
emit("Bn1dEvalY", bn(T([2, 3], 36)))
bn = nn.BatchNorm1d(3, momentum=None)
bn(T([4, 3, 5], 33, 2.0)); bn(T([6, 3], 35, 3.0))
emit("Bn1dCumMean", bn.running_mean); emit("Bn1dCumVar", bn.running_var)
bn = nn.BatchNorm1d(3, affine=False, track_running_stats=False)
run(bn, T([4, 3], 37), 38, "Bn1dPlain")

# ---- BatchNorm2d ----
bn = nn.BatchNorm2d(2)
set_(bn.weight, T([2], 41)); set_(bn.bias, T([2], 42))
run(bn, T([3, 2, 4, 5], 43, 2.0), 44, "Bn2d", ["weight", "bias"])
emit("Bn2dMean", bn.running_mean); emit("Bn2dVar", bn.running_var)
bn.eval()
run(bn, T([1, 2, 2, 3], 45), 46, "Bn2dEval")

# ---- LayerNorm ----
ln = nn.LayerNorm([4, 5])
set_(ln.weight, T([4, 5], 51)); set_(ln.bias, T([4, 5], 52))
run(ln, T([3, 4, 5], 53, 2.0), 54, "Ln", ["weight", "bias"])
ln = nn.LayerNorm(5, elementwise_affine=False)
run(ln, T([2, 3, 5], 55), 56, "LnPlain")

# ---- Embedding ----
emb = nn.Embedding(10, 3, padding_idx=4)
set_(emb.weight, T([10, 3], 61))
idx = torch.tensor([[1, 2, 4], [4, 3, 9]])
y = emb(idx)
y.backward(T([2, 3, 3], 62))
emit("EmbY", y); emit("EmbDweight", emb.weight.grad)

# ---- Pooling ----
xp = T([2, 3, 7, 6], 71)
run(nn.MaxPool2d(3, stride=2, padding=1), xp, 72, "MaxPool")
run(nn.MaxPool2d((2, 3), stride=(2, 1), dilation=(1, 2), ceil_mode=True), xp, 75, "MaxPoolB")
run(nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False), xp, 73, "AvgPool")
run(nn.AvgPool2d(2), xp, 76, "AvgPoolB")
run(nn.AdaptiveAvgPool2d((3, 2)), xp, 74, "AdaPool")

# ---- Activations ----
xa = T([3, 4], 81, 3.0)
for name, m in [("Relu", nn.ReLU()), ("Gelu", nn.GELU()), ("GeluTanh", nn.GELU("tanh")),
                ("Silu", nn.SiLU()), ("Tanh", nn.Tanh()), ("Sigmoid", nn.Sigmoid()),
                ("Softmax1", nn.Softmax(1)), ("Softmax0", nn.Softmax(0)),
                ("LogSoftmax", nn.LogSoftmax(1))]:
    run(m, xa, 82, name)

# ---- Losses ----
def loss_case(prefix, fn, inputs, gseed=None):
    ins = [t.clone().requires_grad_() for t in inputs]
    out = fn(*ins)
    if out.dim() == 0:
        out.backward()
    else:
        out.backward(T(list(out.shape), gseed))
    emit(prefix, out)
    for i, t in enumerate(ins):
        emit(prefix + "D%d" % i, t.grad)


x = T([5, 4], 91, 2.0)
t = torch.tensor([1, 0, 3, 3, 2])
t_ign = torch.tensor([1, 0, -100, 3, 2])
w = torch.tensor([0.5, 1.0, 2.0, 1.5])
loss_case("CeMean", lambda a: F.cross_entropy(a, t), [x])
loss_case("CeSum", lambda a: F.cross_entropy(a, t, reduction="sum"), [x])
loss_case("CeNone", lambda a: F.cross_entropy(a, t, reduction="none"), [x], 101)
loss_case("CeWeight", lambda a: F.cross_entropy(a, t, weight=w), [x])
loss_case("CeIgnore", lambda a: F.cross_entropy(a, t_ign), [x])
loss_case("CeIgnore0", lambda a: F.cross_entropy(a, t, ignore_index=3), [x])
loss_case("CeSmooth", lambda a: F.cross_entropy(a, t, label_smoothing=0.1), [x])
for red in ["mean", "sum", "none"]:
    loss_case("CeAll" + red.capitalize(),
              lambda a: F.cross_entropy(a, t_ign, weight=w, label_smoothing=0.2, reduction=red),
              [x], 102)
xk = T([2, 3, 2, 2], 92, 2.0)
tk = torch.tensor([[[0, 2], [1, -100]], [[2, 2], [0, 1]]])
wk = torch.tensor([1.0, 0.25, 3.0])
loss_case("CeKdim", lambda a: F.cross_entropy(a, tk, weight=wk, label_smoothing=0.1), [xk])
loss_case("CeKdimNone", lambda a: F.cross_entropy(a, tk, reduction="none"), [xk], 103)
loss_case("CeUnbatched", lambda a: F.cross_entropy(a, torch.tensor(2), label_smoothing=0.3),
          [T([4], 93)])
probs = torch.softmax(T([5, 4], 94, 2.0), 1)
loss_case("CeProb", lambda a, p: F.cross_entropy(a, p, weight=w, label_smoothing=0.1), [x, probs])
loss_case("CeProbNone", lambda a, p: F.cross_entropy(a, p, reduction="none"), [x, probs], 104)

logp = torch.log_softmax(x, 1)
loss_case("NllMean", lambda a: F.nll_loss(a, t_ign, weight=w), [logp])
loss_case("NllSum", lambda a: F.nll_loss(a, t_ign, weight=w, reduction="sum"), [logp])
loss_case("NllNone", lambda a: F.nll_loss(a, t_ign, weight=w, reduction="none"), [logp], 105)
loss_case("NllPlain", lambda a: F.nll_loss(a, t), [logp])

a = T([3, 4], 95); b = T([3, 4], 96)
loss_case("MseMean", lambda p, q: F.mse_loss(p, q), [a, b])
loss_case("MseSum", lambda p, q: F.mse_loss(p, q, reduction="sum"), [a, b])
loss_case("MseNone", lambda p, q: F.mse_loss(p, q, reduction="none"), [a, b], 106)

xb = T([3, 4], 97, 4.0)
xb[0, 0] = 100.0
xb[0, 1] = -100.0
xb[1, 2] = 0.0
tb = (T([3, 4], 98) + 1) / 2
wb = T([4], 99).abs() + 0.5
pw = torch.tensor([0.5, 1.0, 2.0, 3.0])
loss_case("BceMean", lambda p, q: F.binary_cross_entropy_with_logits(p, q), [xb, tb])
for red in ["mean", "sum", "none"]:
    loss_case("BceAll" + red.capitalize(),
              lambda p, q: F.binary_cross_entropy_with_logits(p, q, weight=wb, pos_weight=pw,
                                                              reduction=red), [xb, tb], 107)

print("// Generated by tests/nn/make_reference.py with PyTorch %s (float64). Do not edit."
      % torch.__version__)
print("#pragma once\n\n#include <vector>\n\nnamespace ember::test::ref {\n")
print("\n".join(OUT))
print("\n}  // namespace ember::test::ref")
