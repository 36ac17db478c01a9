#!/usr/bin/python3
"""PyTorch's side of tests/examples/torch_interop_test.cpp: the Fashion-MNIST models of
benchmarks/vs_pytorch/fashion_mnist_torch.py (imported, not copied), evaluated or trained here.

    torch_fashion_mnist.py eval WEIGHTS.pt [--model cnn] [--data DIR]
    torch_fashion_mnist.py train OUT.pt --steps N [--model cnn] [--data DIR] [--seed S]

eval loads WEIGHTS.pt strictly (every name and shape must match torch's model) and prints
"torch_test_accuracy=A correct=C of N" for torch's forward over the whole test set; train runs N
SGD steps from torch's seeded initial weights, saves the state_dict and prints the same line.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "benchmarks", "vs_pytorch"))
import fashion_mnist_torch as ref  # noqa: E402


def report(model, data):
    tx, ty = ref.load(data, False)
    _, acc = ref.evaluate(model, tx, ty, 0, 1, torch.device("cpu"))
    print(f"torch_test_accuracy={acc:.6f} correct={round(acc * len(ty))} of {len(ty)}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("command", choices=["eval", "train"])
    p.add_argument("weights")
    p.add_argument("--model", default="cnn", choices=["cnn", "mlp"])
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = ref.make_model(args.model)
    if args.command == "eval":
        model.load_state_dict(torch.load(args.weights, map_location="cpu"))
    else:
        x, y = ref.load(args.data, True)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        order = torch.randperm(len(y))
        for step in range(args.steps):
            idx = order[step * 64:(step + 1) * 64]
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        torch.save(model.state_dict(), args.weights)
    report(model, args.data)


if __name__ == "__main__":
    sys.exit(main())
