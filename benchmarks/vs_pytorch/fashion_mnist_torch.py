#!/usr/bin/python3
"""The PyTorch side of benchmarks/vs_pytorch: examples/fashion_mnist's job in Debian's
python3-torch (1.13) with its DDP over gloo, written to match the Ember program line for line:
same models (PyTorch's default init, which Ember's layers reproduce), same normalisation, batch
per rank, SGD with momentum, DistributedSampler(shuffle, seed) with set_epoch, evaluation over
the whole test set split into contiguous slices, threads per rank, and the same output lines
("epoch E/N: ... img/s", "test_accuracy=0.xxxx") and metrics JSONL, so run.py reads both alike.

    /usr/bin/python3 fashion_mnist_torch.py --nproc 2 --model cnn --epochs 1 [--comm-hook fp16]

It starts its own ranks (one process each, gloo on 127.0.0.1 with a free port).
"""
import argparse
import gzip
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torch_launch

MEAN, STD = 0.2860, 0.3530


def read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    magic = int.from_bytes(data[0:4], "big")
    ndim = magic & 0xFF
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load(root, train):
    prefix = "train" if train else "t10k"
    x = read_idx(os.path.join(root, prefix + "-images-idx3-ubyte.gz"))
    y = read_idx(os.path.join(root, prefix + "-labels-idx1-ubyte.gz"))
    x = torch.from_numpy(x.copy()).float().div_(255).sub_(MEAN).div_(STD).unsqueeze(1)
    return x, torch.from_numpy(y.astype(np.int64))


def make_model(name):
    if name == "cnn":
        return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10))


def evaluate(model, x, y, rank, world, dev):
    model.eval()
    n = x.shape[0]
    begin, end = n * rank // world, n * (rank + 1) // world
    loss_sum = correct = 0.0
    with torch.no_grad():
        for i in range(begin, end, 1000):
            j = min(i + 1000, end)
            xb, yb = x[i:j].to(dev), y[i:j].to(dev)
            logits = model(xb)
            loss_sum += F.cross_entropy(logits, yb, reduction="sum").item()
            correct += (logits.argmax(1) == yb).sum().item()
    t = torch.tensor([loss_sum, correct, float(end - begin)], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(t)
    model.train()
    return t[0].item() / t[2].item(), t[1].item() / t[2].item()


def worker(rank, world, args):
    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    model = make_model(args.model).to(dev)
    if world > 1:
        kwargs = {}
        if args.comm_hook == "powersgd":
            # torch 1.13's PowerSGD over gloo crashes with more than one bucket ("op.preamble.length
            # <= op.nbytes": ranks issue the hook's allreduces in different orders); the workaround
            # is one bucket for the whole model, first bucket included.
            dist._DEFAULT_FIRST_BUCKET_BYTES = 1 << 30
            kwargs["bucket_cap_mb"] = 1024
        model = nn.parallel.DistributedDataParallel(model, **kwargs)
        if args.comm_hook != "none":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
            if args.comm_hook == "fp16":
                model.register_comm_hook(None, default_hooks.fp16_compress_hook)
            elif args.comm_hook == "powersgd":
                state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                                    start_powerSGD_iter=10)
                model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            else:
                raise SystemExit("--comm-hook: expected none, fp16 or powersgd")
    if args.compile:
        # torch.compile (Inductor generates C++ for the CPU); with DDP it compiles the wrapper, as
        # PyTorch's docs show. Its first steps compile: --warmup-steps leaves them out of img/s.
        model = torch.compile(model)
    x, y = load(args.data, True)
    tx, ty = load(args.data, False)
    dataset = torch.utils.data.TensorDataset(x, y)
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=world, rank=rank,
                                                              shuffle=True, seed=args.seed)
    # Batches gathered with one index per batch (x[idx]), as Ember's in-memory dataset does: the
    # stock DataLoader over a TensorDataset indexes and collates sample by sample in Python,
    # which would cost PyTorch more than its training step does here.
    def batches():
        idx = torch.tensor(list(iter(sampler)), dtype=torch.int64)
        for i in range(0, len(idx), args.batch_size):
            j = idx[i:i + args.batch_size]
            yield x[j], y[j]

    class Loader:
        def __iter__(self):
            return batches()

        def __len__(self):
            return (len(sampler) + args.batch_size - 1) // args.batch_size

    loader = Loader()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    metrics = open(args.metrics, "w") if args.metrics and rank == 0 else None
    if rank == 0:
        print(f"fashion_mnist_torch: world size {world}, model {args.model}, torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads per rank", flush=True)
    steps_per_epoch = len(loader)
    total_steps = min(args.max_steps, args.epochs * steps_per_epoch) if args.max_steps else args.epochs * steps_per_epoch

    def lr_at(step):  # the same schedule as the Ember program
        if args.lr_schedule == "constant":
            return args.lr
        return 0.5 * args.lr * (1 + math.cos(math.pi * step / total_steps))

    step_total = 0
    acc = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.perf_counter()
        losses = []
        steps = 0
        timed_from = 0
        for xb, yb in loader:
            if epoch == 0 and steps == args.warmup_steps and steps > 0:
                t0 = time.perf_counter()  # img/s from here: the warm-up (compilation) left out
                timed_from = steps
            xb, yb = xb.to(dev), yb.to(dev)  # per batch from host memory, as the Ember program
            for group in opt.param_groups:
                group["lr"] = lr_at(step_total)
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            steps += 1
            step_total += 1
            if args.max_steps and step_total >= args.max_steps:
                break
        dt = time.perf_counter() - t0
        test_loss, acc = evaluate(model, tx, ty, rank, world, dev)
        ips = (steps - timed_from) * args.batch_size * world / dt
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: train loss {sum(losses) / len(losses):.4f}, "
                  f"test loss {test_loss:.4f}, test accuracy {100 * acc:.2f}%, {dt:.1f} s, {ips:.0f} img/s",
                  flush=True)
            if metrics:
                metrics.write(json.dumps({"kind": "epoch", "epoch": epoch + 1, "global_step": step_total,
                                          "train_loss": sum(losses) / len(losses), "test_loss": test_loss,
                                          "test_accuracy": acc, "time_s": dt, "images_per_s": ips}) + "\n")
                metrics.flush()
        if args.max_steps and step_total >= args.max_steps:
            break
    if rank == 0:
        print(f"test_accuracy={acc:.4f}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--model", default="cnn", choices=["cnn", "mlp"])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--lr-schedule", default="cosine", choices=["constant", "cosine"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="per rank; 0: cores / nproc")
    p.add_argument("--comm-hook", default="none", choices=["none", "fp16", "powersgd"])
    p.add_argument("--metrics", default="")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--compile", action="store_true", help="torch.compile the model (PyTorch 2)")
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="first steps of the first epoch left out of img/s (compilation)")
    args = p.parse_args()
    torch_launch.launch(worker, args)


if __name__ == "__main__":
    sys.exit(main())
