"""torch.distributed (gloo) reference for bench_collectives: same ops, sizes and timing loop.

Prints one "op bytes time_us" line per op and size on rank 0 (--op: a comma-separated list). Run with Debian's PyTorch:
    /usr/bin/python3 bench_collectives_torch.py --np 2 --op allreduce
"""
import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def bufs(op, count, n, rank):
    v = float(rank + 1)
    k = count // n

    def lst(fill=None):
        return [torch.full((k,), fill) if fill else torch.empty(k) for _ in range(n)]

    if op in ("allreduce", "broadcast", "reduce"):
        return [torch.full((count,), v)]
    if op == "allgather":
        return [torch.empty(k * n), torch.full((k,), v)]
    if op == "allgather_list":
        return [lst(), torch.full((k,), v)]
    if op == "gather":
        return [lst() if rank == 0 else None, torch.full((k,), v)]
    if op == "reduce_scatter":
        return [torch.empty(k), torch.full((k * n,), v)]
    if op == "reduce_scatter_list":
        return [torch.empty(k), lst(v)]
    if op == "scatter":
        return [torch.empty(k), lst(v) if rank == 0 else None]
    if op == "alltoall":  # gloo has only the single-tensor form: rank blocks along dim 0
        return [torch.empty(k * n), torch.full((k * n,), v)]
    return []  # barrier


def reduce_scatter_composite(out, flat):
    # gloo has no reduce_scatter in torch 1.13: the same composite Ember's default uses.
    w = dist.all_reduce(flat, async_op=True)
    w.wait()
    out.copy_(flat.chunk(dist.get_world_size())[dist.get_rank()])
    return w


def issue(op, b):
    if op == "allreduce":
        return dist.all_reduce(b[0], async_op=True)
    if op == "broadcast":
        return dist.broadcast(b[0], 0, async_op=True)
    if op == "reduce":
        return dist.reduce(b[0], 0, async_op=True)
    if op == "allgather":
        return dist.all_gather(list(b[0].chunk(dist.get_world_size())), b[1], async_op=True)
    if op == "allgather_list":
        return dist.all_gather(b[0], b[1], async_op=True)
    if op == "gather":
        return dist.gather(b[1], b[0], dst=0, async_op=True)
    if op == "reduce_scatter":
        return reduce_scatter_composite(b[0], b[1].clone())
    if op == "reduce_scatter_list":
        return reduce_scatter_composite(b[0], torch.cat(b[1]))
    if op == "scatter":
        return dist.scatter(b[0], b[1], src=0, async_op=True)
    if op == "alltoall":
        return dist.all_to_all_single(b[0], b[1], async_op=True)
    return dist.barrier(async_op=True)


def time_op(args, op, rank):
    n = args.np
    size = args.min_bytes
    while size <= args.max_bytes:
        count = 0 if op == "barrier" else size // 4
        if op not in ("allreduce", "broadcast", "reduce", "barrier"):
            count = max(count // n, 1) * n
        b = bufs(op, count, n, rank)
        for _ in range(args.warmup + 1):
            issue(op, b).wait()
        dist.barrier()
        t0 = time.perf_counter()
        if args.mode == "latency":
            for _ in range(args.iters):
                issue(op, b).wait()
        else:
            works = [issue(op, b) for _ in range(args.iters)]
            for w in works:
                w.wait()
        us = (time.perf_counter() - t0) / args.iters * 1e6
        if rank == 0:
            print(op, count * 4, f"{us:.1f}", flush=True)
        if op == "barrier":
            break
        size *= 2


def worker(rank, args, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.np)
    for op in args.op.split(","):
        time_op(args, op, rank)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--op", default="allreduce")
    p.add_argument("--min-bytes", type=int, default=4096)
    p.add_argument("--max-bytes", type=int, default=16 << 20)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--mode", default="pipelined", choices=["pipelined", "latency"])
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args, port), nprocs=args.np)


if __name__ == "__main__":
    main()
