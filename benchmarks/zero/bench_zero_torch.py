#!/usr/bin/python3
"""PyTorch side of benchmarks/zero/bench_zero: the same measurement with torch 1.13's DDP over
gloo, once with a full Adam per rank and once with torch.distributed.optim.ZeroRedundancyOptimizer
(Adam), in alternating sub-blocks of 10 steps. Rank 0 prints
    RESULT ddp_ms zero_ms ddp_state_bytes zero_state_bytes
(step times: the mean over ranks of each rank's median; state bytes: the largest rank's).

    /usr/bin/python3 bench_zero_torch.py --np 2 --batch 32 --steps 30 --threads 1
"""
import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer


def make_mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048),
                         nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))


def state_bytes(opt):
    n = 0
    for s in opt.state.values():
        for v in s.values():
            if torch.is_tensor(v):
                n += v.numel() * v.element_size()
    return n


def worker(rank, args, port):
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.np)
    torch.manual_seed(0)
    plain = nn.parallel.DistributedDataParallel(make_mlp())
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-4)
    torch.manual_seed(0)
    sharded = nn.parallel.DistributedDataParallel(make_mlp())
    zero_opt = ZeroRedundancyOptimizer(sharded.parameters(), optimizer_class=torch.optim.Adam,
                                       lr=1e-4)
    torch.manual_seed(1000 + rank)
    xs = [torch.randn(args.batch, 1, 28, 28) for _ in range(4)]
    ys = [torch.randint(0, 10, (args.batch,)) for _ in range(4)]
    nxt = [0]

    def train(model, opt):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(xs[nxt[0]]), ys[nxt[0]]).backward()
        opt.step()
        nxt[0] = (nxt[0] + 1) % len(xs)

    for _ in range(args.warmup):
        train(plain, plain_opt)
        train(sharded, zero_opt)
    times = {"plain": [], "zero": []}
    done = 0
    while done < args.steps:
        n = min(10, args.steps - done)
        for name, model, opt in (("plain", plain, plain_opt), ("zero", sharded, zero_opt)):
            dist.barrier()
            for _ in range(n):
                t0 = time.perf_counter()
                train(model, opt)
                times[name].append((time.perf_counter() - t0) * 1e3)
        done += n
    r = torch.tensor([statistics.median(times["plain"]), statistics.median(times["zero"])],
                     dtype=torch.float64)
    dist.all_reduce(r)
    s = torch.tensor([state_bytes(plain_opt), state_bytes(zero_opt.optim)], dtype=torch.float64)
    dist.all_reduce(s, op=dist.ReduceOp.MAX)
    if rank == 0:
        print("RESULT %.3f %.3f %d %d" % (r[0] / args.np, r[1] / args.np, s[0], s[1]), flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args, port), nprocs=args.np)


if __name__ == "__main__":
    main()
