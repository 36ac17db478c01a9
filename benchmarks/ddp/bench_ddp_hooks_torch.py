#!/usr/bin/python3
"""PyTorch's DDP with a communication hook, one rank of a job started by a launcher (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT): the PyTorch side of benchmarks/ddp/compression.sh.

The same models, batches and optimizer as bench_ddp (SGD lr 0.01 momentum 0.9, set_to_none),
the hooks PyTorch has on CPU, by bench_ddp's --comm-hook names:
    none, allreduce, fp16, powersgd:rank=R,start=S, post_localsgd:start=S,period=P,local=L
(torch's quantization hooks need CUDA; it has no sign or top-k hook). Rank 0 prints
    RESULT step_ms
(the mean over ranks of each rank's median step time over --steps steps after --warmup).

    GLOO_SOCKET_IFNAME=eth0 RANK=0 WORLD_SIZE=4 ... bench_ddp_hooks_torch.py --hook fp16
"""
import argparse
import os
import statistics
import sys
import time

POOL_BATCHES = 4


def options(spec):
    name, _, rest = spec.partition(":")
    opts = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return name, opts


def make_model(nn, name):
    if name == "mlp512":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512),
                             nn.ReLU(), nn.Linear(512, 10))
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mlp512", choices=["mlp", "mlp512"])
    p.add_argument("--hook", default="none")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as plsgd
    from torch.distributed.algorithms.model_averaging import averagers

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(make_model(nn, args.model))
    name, opts = options(args.hook)
    averager = None
    if name == "allreduce":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif name == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "powersgd":
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=int(opts.get("rank", 1)),
                                            start_powerSGD_iter=int(opts.get("start", 1000)))
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif name == "post_localsgd":
        start, period, local = int(opts.get("start", 100)), int(opts.get("period", 4)), int(opts.get("local", 0))
        sub = None
        # torch's new_subgroups needs CUDA; the same consecutive groups through new_group.
        for first in range(0, world, local or world):
            g = dist.new_group(list(range(first, first + local))) if local > 0 else None
            if first <= rank < first + local:
                sub = g
        state = plsgd.PostLocalSGDState(None, sub, start, post_local_gradient_allreduce=local > 0)
        ddp.register_comm_hook(state, plsgd.post_localSGD_hook)
        averager = averagers.PeriodicModelAverager(period=period, warmup_steps=start)
    elif name != "none":
        print(f"bench_ddp_hooks_torch: PyTorch has no CPU hook for {args.hook}", file=sys.stderr)
        return 2
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    torch.manual_seed(1000 + rank)
    xs = [torch.randn(args.batch, 1, 28, 28) for _ in range(POOL_BATCHES)]
    ys = [torch.randint(0, 10, (args.batch,)) for _ in range(POOL_BATCHES)]
    times = []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(xs[i % POOL_BATCHES]), ys[i % POOL_BATCHES]).backward()
        opt.step()
        if averager is not None:
            averager.average_parameters(ddp.parameters())
        if i >= args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    r = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(r)
    if rank == 0:
        print(f"RESULT {r[0].item() / world:.4f}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
