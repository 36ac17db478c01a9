"""How the PyTorch twins (fashion_mnist_torch.py, gpt_torch.py) start their ranks, in one place so
that both run alike: one process per rank, gloo on 127.0.0.1 with a free port, torch's threads
per rank set before anything else (0: cores / ranks, as emberrun gives Ember's workers)."""
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, worker, args):
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    worker(rank, world, args)
    if world > 1:
        dist.destroy_process_group()


def launch(worker, args):
    """Runs worker(rank, world, args) on args.nproc ranks: in this process for one, else in as
    many forked processes joined in a gloo group (torch.distributed's default group). Sets
    args.threads to cores / args.nproc when it is 0 or less."""
    if args.threads <= 0:
        args.threads = max(1, len(os.sched_getaffinity(0)) // args.nproc)
    port = _free_port()
    if args.nproc == 1:
        _rank(0, 1, port, worker, args)
    else:
        mp.start_processes(_rank, args=(args.nproc, port, worker, args), nprocs=args.nproc,
                           start_method="fork")
