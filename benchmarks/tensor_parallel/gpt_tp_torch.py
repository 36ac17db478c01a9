#!/usr/bin/env python3
"""examples/gpt --tp N in current PyTorch (2.4 or later: torch.distributed.tensor.parallel), for
benchmarks/tensor_parallel/run.py to run beside Ember's: the same GPT shape, data windows,
optimizer, schedule and clipping as gpt_torch.py, laid out over a (dp, tp) DeviceMesh by
parallelize_module with Megatron's plan, as examples/gpt_parallel.h lays Ember's out:

- wte RowwiseParallel (vocabulary parallel) with a sequence-sharded output, wpe's output cut to
  the rank's part of the sequence (PrepareModuleOutput), dropouts and LayerNorms SequenceParallel;
- attention's q, k and v ColwiseParallel by heads, its output projection RowwiseParallel; the
  MLP's fc ColwiseParallel, fc_proj RowwiseParallel; each attention and MLP gathers its input
  once (PrepareModuleInput), as torchtitan does;
- the LM head ColwiseParallel with vocabulary-sharded logits and loss_parallel().

Two differences from Ember's model, neither changing the work: q, k and v are three Linears
(PyTorch's ColwiseParallel cannot split a fused one by heads; Ember's output_chunks does), and
the head is not tied to wte (tying breaks when parallelize_module distributes the parameter
twice), which costs AdamW the head's moments (vocabulary x width) once more.

    build/torch-venv/bin/python gpt_tp_torch.py --tokens ~/.cache/ember/bible.data.tokens \\
        --nproc 2 --tp 2 --layers 8 --dim 512 --heads 8 --steps 20

Rank 0 prints tokens_per_s=N (training tokens of the whole job per second: the data-parallel
ranks' batches) and peak_rss_mb=N as examples/gpt does.
"""
import argparse
import math
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vs_pytorch"))
import torch_launch  # noqa: E402
from gpt_torch import VOCAB, Windows, lr_factor  # noqa: E402

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,  # noqa: E402
                                               PrepareModuleOutput, RowwiseParallel,
                                               SequenceParallel, loss_parallel,
                                               parallelize_module)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, _ = x.shape
        # Under tensor parallelism each rank holds its heads: the local width decides how many.
        q, k, v = (m(x).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class Mlp(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.fc_proj = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.fc_proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.ln2, self.mlp = nn.LayerNorm(dim), Mlp(dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, a.dim)
        self.wpe = nn.Embedding(a.context, a.dim)
        self.drop = nn.Dropout(0.0)
        self.blocks = nn.ModuleList(Block(a.dim, a.heads) for _ in range(a.layers))
        self.ln_f = nn.LayerNorm(a.dim)
        self.head = nn.Linear(a.dim, VOCAB, bias=False)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "ln" in name:
                    continue
                if name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02)
            for b in self.blocks:
                for w in (b.attn.proj.weight, b.mlp.fc_proj.weight):
                    w.normal_(0.0, 0.02 / math.sqrt(2 * a.layers))

    def forward(self, idx):
        T = idx.shape[1]
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def plan(layers):
    p = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "wpe": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0)),
        "drop": SequenceParallel(use_local_output=True),  # the residual stream stays local
        "ln_f": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                use_local_output=False),
    }
    for i in range(layers):
        b = f"blocks.{i}."
        p.update({
            b + "ln1": SequenceParallel(),
            b + "attn": PrepareModuleInput(input_layouts=(Shard(1),),
                                           desired_input_layouts=(Replicate(),)),
            b + "attn.q": ColwiseParallel(),
            b + "attn.k": ColwiseParallel(),
            b + "attn.v": ColwiseParallel(),
            b + "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            b + "ln2": SequenceParallel(),
            b + "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                          desired_input_layouts=(Replicate(),)),
            b + "mlp.fc": ColwiseParallel(),
            b + "mlp.fc_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    return p


def clip_grad_norm_(params, max_norm, tp_group):
    """The whole model's gradient norm, shards counted once, and the gradients scaled to it.
    torch.nn.utils.clip_grad_norm_ refuses this model: parameters PrepareModuleOutput leaves alone
    (wpe's) stay plain tensors beside the DTensors."""
    sharded = torch.zeros((), dtype=torch.float64)
    whole = torch.zeros((), dtype=torch.float64)
    grads = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        is_dtensor = isinstance(g, DTensor)
        local = g.to_local() if is_dtensor else g
        grads.append(local)
        sq = local.double().pow(2).sum()
        if is_dtensor and any(pl.is_shard() for pl in g.placements):
            sharded += sq
        else:
            whole += sq
    dist.all_reduce(sharded, group=tp_group)
    total = (sharded + whole).sqrt().item()
    coef = max_norm / (total + 1e-6)
    if coef < 1:
        for g in grads:
            g.mul_(coef)
    return total


def worker(rank, world, a):
    mesh = init_device_mesh("cpu", (world // a.tp, a.tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(a.seed)
    model = GPT(a)
    parallelize_module(model, mesh["tp"], plan(a.layers))
    dp = mesh["dp"]
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, a.steps))
    n_dp, dp_rank = dp.size(), dp.get_local_rank()
    data = Windows(a.tokens, a.context, a.batch_size, n_dp, dp_rank, a.seed)
    data.train_offsets(0)
    lead = rank == 0
    if lead:
        print(f"gpt_tp_torch: {mesh}, torch {torch.__version__}, {a.threads} threads per rank",
              flush=True)
    train_s = 0.0
    for step in range(a.steps):
        t0 = time.perf_counter()
        x, y = data.batch_at(data.train_offsets(step))
        opt.zero_grad(set_to_none=True)
        with loss_parallel():
            loss = F.cross_entropy(model(x).flatten(0, 1), y.view(-1))
            loss.backward()
        if n_dp > 1:  # data parallel over dp: average the (local) gradients
            for p in model.parameters():
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(g, group=dp.get_group())
                g /= n_dp
        if a.grad_clip > 0:
            clip_grad_norm_(model.parameters(), a.grad_clip, mesh["tp"].get_group())
        opt.step()
        sched.step()
        loss_value = loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()
        train_s += time.perf_counter() - t0
        if lead and ((step + 1) % max(1, a.steps // 5) == 0):
            print(f"step {step + 1}/{a.steps}  loss {loss_value:.4f}", flush=True)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if lead:
        print(f"val_loss={loss_value:.4f}")
        print(f"tokens_per_s={a.steps * a.batch_size * a.context * n_dp / train_s:.0f}")
        print(f"peak_rss_mb={rss.item():.0f}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", required=True, help="the token file examples/gpt wrote")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16, help="per data-parallel rank")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="per rank; 0: cores / ranks")
    a = p.parse_args()
    if a.nproc % a.tp:
        sys.exit(f"--tp {a.tp} must divide --nproc {a.nproc}")
    torch_launch.launch(worker, a)


if __name__ == "__main__":
    main()
