#!/usr/bin/env python3
"""The PyTorch side of bench_cuda: the same cases on the same GPU, timed the same way as
bench_util.h (warm-up, batches calibrated to --min-time, median of --samples batches, a device
synchronize inside each timed batch), printing the same BENCH lines.

    python3 bench_cuda_torch.py [--filter S] [--samples N] [--min-time SEC]

PyTorch's defaults are kept: float32 matmul without TF32, cuDNN allowed TF32 (as Ember).
"""
import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_tensor_bench import median_seconds  # noqa: E402

M = 1 << 20


def timed(args, name, fn, flops=0.0, nbytes=0.0):
    if args.filter and args.filter not in name:
        return
    sec = median_seconds(fn, args.samples, args.min_time, torch.cuda.synchronize)
    print(f"BENCH name={name} sec={sec:.9g} flops={flops:.6g} bytes={nbytes:.6g}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--filter", default="")
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--min-time", type=float, default=0.2)
    args = p.parse_args()
    dev = torch.device("cuda")
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

    def g(*shape, dtype=torch.float32):
        return torch.randn(*shape, device=dev).to(dtype)

    a, b = g(64 * M), torch.empty(64 * M, device=dev)
    timed(args, "copy_f32_64M", lambda: b.copy_(a), 0, 2.0 * 4 * 64 * M)
    for d in (torch.float32, torch.bfloat16):
        x, y = g(16 * M, dtype=d), g(16 * M, dtype=d)
        timed(args, f"add_{names[d]}_16M", lambda: torch.add(x, y), 16.0 * M,
              3.0 * x.element_size() * 16 * M)
    x, y = g(4096, 4096), g(4096)
    timed(args, "add_bcast_f32_4096x4096", lambda: torch.add(x, y), 16.0 * M, 2.0 * 4 * 16 * M)
    x = g(64 * M)
    timed(args, "sum_f32_64M", lambda: x.sum(), 64.0 * M, 4.0 * 64 * M)
    x = g(8192, 8192)
    timed(args, "sum_dim1_f32_8192x8192", lambda: x.sum(1), 64.0 * M, 4.0 * 64 * M)
    timed(args, "sum_dim0_f32_8192x8192", lambda: x.sum(0), 64.0 * M, 4.0 * 64 * M)
    x = g(8192, 4096)
    timed(args, "softmax_f32_8192x4096", lambda: torch.softmax(x, 1), 0, 2.0 * 4 * 32 * M)
    del a, b, x, y
    for d, n in ((torch.float32, 4096), (torch.bfloat16, 8192), (torch.float16, 8192)):
        x, y = g(n, n, dtype=d), g(n, n, dtype=d)
        timed(args, f"matmul_{names[d]}_{n}", lambda: torch.mm(x, y), 2.0 * n ** 3,
              3.0 * x.element_size() * n * n)
    x, w = g(64, 128, 28, 28), g(128, 128, 3, 3)
    timed(args, "conv3x3_f32_n64_c128_28", lambda: F.conv2d(x, w, padding=1),
          2.0 * 64 * 128 * 28 * 28 * 128 * 9, 0)
    sizes = [(4096 << (i * 7 % 14)) + i * 37 % 11 * 512 for i in range(64)]
    live = [None] * 8

    def churn():
        for i, n in enumerate(sizes):
            live[i % len(live)] = torch.empty(n, dtype=torch.uint8, device=dev)
    timed(args, "alloc_churn_mixed_64", churn)
    del live
    for batch in (64, 1024):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(),
                              nn.Linear(128, 10)).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x = g(batch, 1, 28, 28)
        y = torch.randint(0, 10, (batch,), device=dev)

        def step():
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        timed(args, f"cnn_train_step_b{batch}", step)
    del model, opt, x, y
    gpt_cases(args, dev)


# ---- one step of examples/gpt, op by op (bench_cuda.cpp's gpt_* cases) ----
TOKENS, WIDTH, HEADS, CONTEXT, VOCAB, LAYERS = 16384, 384, 6, 256, 256, 6


def gpt_params_with_grads(dev):
    shapes = [(VOCAB, WIDTH), (CONTEXT, WIDTH)]
    for _ in range(LAYERS):
        shapes += [(WIDTH,), (WIDTH,), (3 * WIDTH, WIDTH), (3 * WIDTH,), (WIDTH, WIDTH), (WIDTH,),
                   (WIDTH,), (WIDTH,), (4 * WIDTH, WIDTH), (4 * WIDTH,), (WIDTH, 4 * WIDTH),
                   (WIDTH,)]
    shapes += [(WIDTH,), (WIDTH,)]
    params = []
    for s in shapes:
        p = (torch.randn(*s) * 0.02).to(dev).requires_grad_()
        p.grad = (torch.randn(*s) * 1e-3).to(dev)
        params.append(p)
    return params


def gpt_cases(args, dev):
    def leaf(*shape, dtype=torch.float32):
        return torch.randn(*shape, device=dev).to(dtype).requires_grad_()

    def fwd_bwd(name, leaves, forward, nbytes):
        y = forward()
        dy = None if y.dim() == 0 else torch.randn(y.shape, device=dev).to(y.dtype)
        del y

        def step():
            for t in leaves:
                t.grad = None
            forward().backward(dy)
        timed(args, name, step, 0, nbytes)

    ln = nn.LayerNorm(WIDTH).to(dev)
    x = leaf(TOKENS, WIDTH)
    fwd_bwd("gpt_layernorm_fwdbwd_f32_16384x384", list(ln.parameters()) + [x], lambda: ln(x),
            5.0 * 4 * TOKENS * WIDTH)
    x = leaf(TOKENS, 4 * WIDTH, dtype=torch.bfloat16)
    fwd_bwd("gpt_gelu_tanh_fwdbwd_bf16_16384x1536", [x], lambda: F.gelu(x, approximate="tanh"),
            5.0 * 2 * TOKENS * 4 * WIDTH)
    a = torch.randn(TOKENS, 4 * WIDTH, device=dev).bfloat16()
    b = torch.randn(4 * WIDTH, device=dev).bfloat16()
    timed(args, "gpt_bias_add_bf16_16384x1536", lambda: torch.add(a, b), TOKENS * 4.0 * WIDTH,
          2.0 * 2 * TOKENS * 4 * WIDTH)
    timed(args, "gpt_bias_grad_sum0_bf16_16384x1536", lambda: a.sum(0), TOKENS * 4.0 * WIDTH,
          2.0 * TOKENS * 4 * WIDTH)
    fc = nn.Linear(WIDTH, 4 * WIDTH).to(dev)
    x = leaf(TOKENS, WIDTH)

    def fc_forward():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return fc(x)
    fwd_bwd("gpt_linear_fwdbwd_bf16_16384x384x1536", list(fc.parameters()) + [x], fc_forward, 0)
    del a, b, x
    s = leaf(HEADS * 64, CONTEXT, CONTEXT)
    mask = torch.full((CONTEXT, CONTEXT), float("-inf"), device=dev).triu(1)
    fwd_bwd("gpt_softmax_causal_fwdbwd_f32_384x256x256", [s], lambda: F.softmax(s + mask, -1),
            7.0 * 4 * s.numel())
    del s
    logits = leaf(TOKENS, VOCAB)
    target = torch.randint(0, VOCAB, (TOKENS,), device=dev)
    fwd_bwd("gpt_cross_entropy_fwdbwd_f32_16384x256", [logits],
            lambda: F.cross_entropy(logits, target), 3.0 * 4 * logits.numel())
    del logits
    logits = leaf(16384, 50304, dtype=torch.bfloat16)
    target = torch.randint(0, 50304, (16384,), device=dev)

    def ce_amp():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return F.cross_entropy(logits, target)
    fwd_bwd("gpt124m_cross_entropy_fwdbwd_bf16_amp_16384x50304", [logits], ce_amp,
            3.0 * 2 * logits.numel())
    del logits
    emb = nn.Embedding(VOCAB, WIDTH).to(dev)
    idx = torch.randint(0, VOCAB, (64, CONTEXT), device=dev)
    fwd_bwd("gpt_embedding_fwdbwd_f32_256x384_16384", list(emb.parameters()), lambda: emb(idx),
            2.0 * 4 * TOKENS * WIDTH)
    # PyTorch's defaults on CUDA, as gpt_torch.py runs them: AdamW and clip_grad_norm_ take
    # their multi-tensor (foreach) implementations.
    params = gpt_params_with_grads(dev)
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    timed(args, "gpt_adamw_step_f32_10.8M", opt.step, 0, 7.0 * 4 * 10844160)
    params = gpt_params_with_grads(dev)
    timed(args, "gpt_clip_grad_norm_f32_10.8M",
          lambda: torch.nn.utils.clip_grad_norm_(params, 1.0), 0, 3.0 * 4 * 10844160)
    del opt, params
    # gpt_torch.py's Block (the model beside examples/gpt) with PyTorch 2's fused attention,
    # as the GPU comparison of the GPT runs it.
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "vs_pytorch"))
    from gpt_torch import Block  # noqa: E402
    torch.manual_seed(0)
    block = Block(WIDTH, HEADS, CONTEXT, 0.0, True).to(dev)
    x = leaf(64, CONTEXT, WIDTH)

    def block_forward():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return block(x)
    fwd_bwd("gpt_block_fwdbwd_bf16_b64_t256", list(block.parameters()) + [x], block_forward, 0)
    del block, x
    gpt_train_steps(args, dev)


def gpt_train_steps(args, dev):
    """bench_cuda's gpt_train_step cases: the whole step eagerly, and replayed as a CUDA graph
    (torch.cuda.graph, capturable AdamW, the step warmed up on a side stream as PyTorch's
    documentation does)."""
    from gpt_torch import GPT  # noqa: E402
    import types
    cfg = types.SimpleNamespace(vocab=VOCAB, dim=WIDTH, heads=HEADS, layers=LAYERS,
                                context=CONTEXT, dropout=0.0, attention="fused",
                                checkpoint_activations=False)
    for batch in (8, 64):
        name = f"gpt_train_step_bf16_b{batch}_t256"
        if args.filter and args.filter not in name:
            continue
        for graphed in (False, True):
            torch.manual_seed(0)
            model = GPT(cfg).to(dev)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95),
                                    weight_decay=0.1, capturable=graphed)
            x = torch.randint(0, VOCAB, (batch, CONTEXT), device=dev)
            y = torch.randint(0, VOCAB, (batch, CONTEXT), device=dev)

            def step():
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x).view(-1, VOCAB), y.view(-1))
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
            if not graphed:
                timed(args, name, step)
                continue
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            timed(args, name + "_cuda_graph", graph.replay)


if __name__ == "__main__":
    main()
