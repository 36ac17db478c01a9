# Shared by the reference scripts of tests/nn (make_reference.py, make_transformer_reference.py,
# make_attention_reference.py):
# tests/tensor/test_util.h's lcg_values re-implemented, so the C++ tests build bit-identical
# tensors, and the writer of `inline const std::vector<double> kName = {...};` entries.
import torch

M = 2 ** 64


def lcg(n, seed):
    s = (seed * 6364136223846793005 + 1442695040888963407) % M
    out = []
    for _ in range(n):
        s = (s * 6364136223846793005 + 1442695040888963407) % M
        out.append(((s >> 11) & ((1 << 20) - 1)) / (1 << 19) - 1.0)
    return out


def T(shape, seed, scale=1.0):
    n = 1
    for d in shape:
        n *= d
    return torch.tensor(lcg(n, seed)).reshape(shape) * scale


OUT = []


def fmt(vals):
    lines, line = [], "   "
    for v in vals:
        item = " " + repr(float(v)) + ","
        if len(line) + len(item) > 100:
            lines.append(line)
            line = "   "
        line += item
    lines.append(line)
    return "\n".join(lines)


def emit(name, t):
    vals = t.detach().reshape(-1).tolist() if torch.is_tensor(t) else list(t)
    OUT.append("inline const std::vector<double> k%s = {\n%s\n};" % (name, fmt(vals)))
