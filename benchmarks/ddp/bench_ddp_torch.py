#!/usr/bin/python3
"""PyTorch side of benchmarks/ddp/bench_ddp: one block of the same measurement with torch's
DistributedDataParallel over gloo (Debian's python3-torch 1.13).

Each rank trains a DDP-wrapped model and a plain local copy on the same random batches, in
alternating sub-blocks of 10 steps with a barrier before each (warm-up steps of each kind
first), then times 5 all-reduces of every gradient as one flat float32 buffer. Rank 0 prints
    RESULT step_ms compute_ms allreduce_ms
(the mean over ranks of each rank's median). Same models as bench_ddp.cpp with torch's default
init, SGD lr 0.01 momentum 0.9, zero_grad(set_to_none=True) as Ember's default, threads per rank
as given (OMP/OpenBLAS/torch all set before torch starts its pools).

    /usr/bin/python3 bench_ddp_torch.py --np 2 --model mlp --batch 64 --steps 50 --threads 1

It starts its own ranks (forked, gloo on 127.0.0.1 with a free port); world size 1 is still DDP.
"""
import argparse
import os
import socket
import statistics
import sys
import time

SUB_BLOCK = 10
POOL_BATCHES = 4
ALLREDUCE_ITERS = 5


def make_model(nn, name):
    if name == "cnn":
        return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))


def worker(rank, world, port, args):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(make_model(nn, args.model))
    torch.manual_seed(0)
    local = make_model(nn, args.model)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.01, momentum=0.9)
    torch.manual_seed(1000 + rank)
    xs = [torch.randn(args.batch, 1, 28, 28) for _ in range(POOL_BATCHES)]
    ys = [torch.randint(0, 10, (args.batch,)) for _ in range(POOL_BATCHES)]
    numel = sum(p.numel() for p in local.parameters())
    flat = torch.zeros(numel)
    counters = {"ddp": 0, "local": 0}

    def step(model, opt, kind):
        i = counters[kind]
        counters[kind] = (i + 1) % POOL_BATCHES
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(xs[i]), ys[i]).backward()
        opt.step()

    for _ in range(args.warmup):
        step(ddp, ddp_opt, "ddp")
    for _ in range(args.warmup):
        step(local, local_opt, "local")
    ddp_ms, local_ms, ar_ms = [], [], []
    done = 0
    while done < args.steps:
        n = min(SUB_BLOCK, args.steps - done)
        for model, opt, kind, out in ((ddp, ddp_opt, "ddp", ddp_ms), (local, local_opt, "local", local_ms)):
            dist.barrier()
            for _ in range(n):
                t0 = time.perf_counter()
                step(model, opt, kind)
                out.append((time.perf_counter() - t0) * 1e3)
        done += n
    dist.barrier()
    for _ in range(ALLREDUCE_ITERS):
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        ar_ms.append((time.perf_counter() - t0) * 1e3)
    r = torch.tensor([statistics.median(ddp_ms), statistics.median(local_ms), statistics.median(ar_ms)],
                     dtype=torch.float64)
    dist.all_reduce(r)
    r /= world
    if rank == 0:
        print(f"RESULT {r[0].item():.4f} {r[1].item():.4f} {r[2].item():.4f}", flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, default=1)
    p.add_argument("--model", default="cnn", choices=["cnn", "mlp"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="per rank; 0: cores / np")
    args = p.parse_args()
    if args.threads <= 0:
        args.threads = max(1, len(os.sched_getaffinity(0)) // args.np)
    # Before torch loads: its OpenMP and OpenBLAS pools start with this many threads.
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(args.np, port, args), nprocs=args.np, start_method="fork")


if __name__ == "__main__":
    sys.exit(main())
