"""torch.distributed (gloo) reference for bench_collectives: same ops, sizes and timing loop.

Prints one "bytes time_us" line per size on rank 0. Run with Debian's PyTorch:
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
    if op in ("allreduce", "broadcast"):
        return [torch.full((count,), v)]
    k = count // n
    if op == "allgather":
        return [torch.empty(k * n), torch.full((k,), v)]
    if op == "reduce_scatter":
        return [torch.empty(k), [torch.full((k,), v) for _ in range(n)]]
    return [[torch.empty(k) for _ in range(n)], [torch.full((k,), v) for _ in range(n)]]


def issue(op, b):
    if op == "allreduce":
        return dist.all_reduce(b[0], async_op=True)
    if op == "broadcast":
        return dist.broadcast(b[0], 0, async_op=True)
    if op == "allgather":
        return dist.all_gather(list(b[0].chunk(dist.get_world_size())), b[1], async_op=True)
    if op == "reduce_scatter":
        # gloo has no reduce_scatter in torch 1.13: the same composite Ember's default uses.
        flat = torch.cat(b[1])
        w = dist.all_reduce(flat, async_op=True)
        w.wait()
        b[0].copy_(flat.chunk(dist.get_world_size())[dist.get_rank()])
        return w
    return dist.all_to_all(b[0], b[1], async_op=True)


def worker(rank, args, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.np)
    n = args.np
    size = args.min_bytes
    while size <= args.max_bytes:
        count = size // 4
        if args.op not in ("allreduce", "broadcast"):
            count = max(count // n, 1) * n
        b = bufs(args.op, count, n, rank)
        for _ in range(args.warmup + 1):
            issue(args.op, b).wait()
        dist.barrier()
        t0 = time.perf_counter()
        if args.mode == "latency":
            for _ in range(args.iters):
                issue(args.op, b).wait()
        else:
            works = [issue(args.op, b) for _ in range(args.iters)]
            for w in works:
                w.wait()
        us = (time.perf_counter() - t0) / args.iters * 1e6
        if rank == 0:
            print(count * 4, f"{us:.1f}", flush=True)
        size *= 2
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
