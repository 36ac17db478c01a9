#!/usr/bin/env python3
"""bench_checkpoint's state in PyTorch: torch.distributed.checkpoint's save, async_save and load
of a GPT-2 124M-shaped model's parameters and AdamW's moments (get_state_dict: names as keys),
replicated on --nproc ranks over gloo (DCP's planner spreads the replicated tensors over the
ranks, as Ember's does), for benchmarks/checkpoint/run.py. Needs PyTorch >= 2.4
(benchmarks/vs_pytorch/setup_torch.sh's). Rank 0 prints save_s=, load_s=, async_block_s= (medians
of --repeats).
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vs_pytorch"))
import torch_launch  # noqa: E402


class Gpt2Shapes(torch.nn.Module):
    """GPT-2's parameters under their names (the computation does not matter here)."""

    def __init__(self, a):
        super().__init__()
        d = a.dim
        self.wte = torch.nn.Embedding(a.vocab, d)
        self.wpe = torch.nn.Embedding(a.context, d)
        self.blocks = torch.nn.ModuleList()
        for _ in range(a.layers):
            b = torch.nn.Module()
            b.ln1, b.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            b.qkv, b.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
            b.fc, b.fc_proj = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
            self.blocks.append(b)
        self.ln_f = torch.nn.LayerNorm(d)


def worker(rank, world, a):
    torch.manual_seed(0)
    model = Gpt2Shapes(a)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad()
    base = a.dir
    saves, loads, blocks = [], [], []
    for r in range(a.repeats):
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=os.path.join(base, "sync"))
        dist.barrier()
        saves.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=os.path.join(base, f"async{r}"))
        blocks.append(time.perf_counter() - t0)
        fut.result()
        dist.barrier()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        t0 = time.perf_counter()
        dcp.load(state, checkpoint_id=os.path.join(base, "sync"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        dist.barrier()
        loads.append(time.perf_counter() - t0)
        if rank == 0:
            print(f"round {r + 1}: save {saves[-1]:.2f} s, async blocks {blocks[-1]:.3f} s, "
                  f"load {loads[-1]:.2f} s", flush=True)
    if rank == 0:
        print(f"save_s={statistics.median(saves):.4f}\nload_s={statistics.median(loads):.4f}\n"
              f"async_block_s={statistics.median(blocks):.4f}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args()
    made = not a.dir
    a.dir = a.dir or tempfile.mkdtemp(prefix="dcp_torch_")
    try:
        torch_launch.launch(worker, a)
    finally:
        if made:
            shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
