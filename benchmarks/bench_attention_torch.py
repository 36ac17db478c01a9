"""PyTorch 1.13 reference for bench_attention: the written-out attention that code before
PyTorch 2 used (it has no F.scaled_dot_product_attention), timed forward + backward the same way.

    /usr/bin/python3 bench_attention_torch.py --batch 16 --heads 4 --seq 128 --dim 32 --causal

Prints "sec=<median seconds per forward+backward>" after a checked warm-up.
"""
import argparse
import math
import time

import torch


def attention(q, k, v, causal_mask):
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
    if causal_mask is not None:
        att = att.masked_fill(~causal_mask, float("-inf"))
    return torch.softmax(att, dim=-1) @ v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    shape = (a.batch, a.heads, a.seq, a.dim)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    g = torch.randn(shape)
    mask = torch.ones(a.seq, a.seq, dtype=torch.bool).tril() if a.causal else None

    def step():
        q.grad = k.grad = v.grad = None
        attention(q, k, v, mask).backward(g)

    for _ in range(2):
        step()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    times = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    times.sort()
    print("sec=%.9g" % times[len(times) // 2], flush=True)


if __name__ == "__main__":
    main()
