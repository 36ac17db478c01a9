"""PyTorch reference for bench_attention, timed forward + backward the same way: the installed
PyTorch's F.scaled_dot_product_attention where it has one (PyTorch 2: flash attention on the CPU,
flash or memory-efficient kernels on a GPU), unless --impl written; under PyTorch 1.13 (Debian's,
no fused attention) the written-out attention code before PyTorch 2 used. Which one ran is
printed as impl=.

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
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--impl", default="auto", choices=["auto", "written", "fused"])
    ap.add_argument("--allow-tf32", action="store_true",
                    help="torch.backends.cuda.matmul.allow_tf32 = True")
    a = ap.parse_args()
    if a.allow_tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    fused = a.impl == "fused" or (a.impl == "auto" and
                                  hasattr(torch.nn.functional, "scaled_dot_product_attention"))
    dtype = getattr(torch, a.dtype)
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    shape = (a.batch, a.heads, a.seq, a.dim)
    q, k, v = (torch.randn(shape).to(a.device, dtype).requires_grad_() for _ in range(3))
    g = torch.randn(shape).to(a.device, dtype)
    mask = torch.ones(a.seq, a.seq, dtype=torch.bool, device=a.device).tril() if a.causal else None
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)

    def step():
        q.grad = k.grad = v.grad = None
        if fused:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=a.causal)
        else:
            out = attention(q, k, v, mask)
        out.backward(g)
        sync()

    for _ in range(2):
        step()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    times = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    times.sort()
    print("impl=%s" % ("fused" if fused else "written"))
    print("sec=%.9g" % times[len(times) // 2], flush=True)


if __name__ == "__main__":
    main()
