#!/usr/bin/python3
"""examples/gpt in PyTorch (1.13 or current): the same model, initialisation, data windows, optimizer,
schedule and clipping, for benchmarks/vs_pytorch/run_gpt.py to run beside Ember's.

- Model: token + learned position embeddings, pre-LayerNorm blocks (fused qkv Linear, causal
  attention written out as softmax(QK^T/sqrt(d) + causal mask)V since PyTorch 1.13 has no fused
  attention, 4x GELU(tanh) MLP), final LayerNorm, LM head tied to the token embedding; biases on;
  init N(0, 0.02), residual projections N(0, 0.02/sqrt(2*layers)), LayerNorms ones/zeros.
- Data: the token file Ember writes (examples/gpt --cache-dir DIR leaves DIR/<name>.tokens, one
  uint8 per byte), or a file in llm.c's format (a header of 256 int32: 20240520, 1, the token
  count; then uint16 tokens), told apart by that magic as Ember does: GPT-2 shards, or the one
  examples/gpt --data synthetic names in its banner. --vocab defaults as examples/gpt's: 50304
  (GPT-2's 50257 padded to a multiple of 128) for llm.c's files, else 256. Windows are drawn
  exactly as nn/data/token_stream.h describes: the training
  starts through torch.utils.data.DistributedSampler(seed, drop_last=True) with set_epoch, the
  validation windows spread evenly over the last 10%. Both frameworks see the same batches.
- AdamW betas (0.9, 0.95), weight decay 0.1 on 2-D weights only, 50 warm-up steps then cosine to
  a tenth of the peak lr, gradient norm clipped.
- --shard zero: ZeroRedundancyOptimizer over DDP; --shard fsdp (PyTorch 2.6 or later): FSDP2's
  fully_shard on every block and then the root, as examples/gpt --shard fsdp. --compile
  torch.compiles the wrapped model; --warmup-steps leaves its compiling steps out of tokens/s.
- --pp N (PyTorch 2.4 or later, e.g. setup_torch.sh's): torch.distributed.pipelining over all N
  ranks, as examples/gpt --pp: the blocks cut into equal stages (one per rank, or two with the
  interleaved and zero-bubble schedules), the first with the embeddings, the last with ln_f and
  the head on its own copy of wte, the two copies' gradients summed over the ranks before each
  update (what Ember does; torch's pipelining leaves tying to the user), the norm clipped over
  the ranks.

    /usr/bin/python3 gpt_torch.py --tokens ~/.cache/ember/bible.data.tokens --nproc 2 --steps 200

Rank 0 prints val_loss=X, tokens_per_s=N (training tokens over all ranks per second of training
steps, evaluation excluded), flops_per_token=N (6N + 12 L d T, N the parameters with the tied
head once, as PaLM (appendix B) and nanoGPT count; llm.c's gpt2_estimate_mfu counts
6N + 6 L d T, 6.6% fewer at GPT-2 124M's shape: docs/quickstart.md converts), mfu=X
(tokens_per_s x flops_per_token over --peak-tflops, or the GPU's dense peak by its name, times
the ranks; unknown when neither gives a peak) and
peak_rss_mb=N (the largest ru_maxrss over the ranks) on their own lines, as examples/gpt does.
"""
import argparse
import math
import os
import resource
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.utils.data import DistributedSampler

import torch_launch

BYTE_VOCAB = 256
GPT2_PADDED_VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 128, as llm.c's
LLMC_MAGIC, LLMC_VERSION, LLMC_HEADER_INTS = 20240520, 1, 256
WARMUP = 50

# Dense peak TFLOPS by (a part of) torch.cuda.get_device_name and precision (bf16/fp16 autocast,
# float32 on TF32 with --allow-tf32, plain float32), as examples/gpt's table.
# SXM parts: the PCIe and NVL H100s have lower peaks and are left to --peak-tflops.
PEAK_TFLOPS = [("H100", {"low": 989.4, "tf32": 494.7, "fp32": 67.0}),
               ("H200", {"low": 989.4, "tf32": 494.7, "fp32": 67.0}),
               ("A100", {"low": 312.0, "tf32": 156.0, "fp32": 19.5})]


def is_llmc(path):
    with open(path, "rb") as f:
        head = f.read(4)
    return len(head) == 4 and int.from_bytes(head, "little") == LLMC_MAGIC


def read_tokens(path):
    """The tokens of a byte file or an llm.c file, memory-mapped (TokenFile's checks)."""
    if not is_llmc(path):
        return np.memmap(path, dtype=np.uint8, mode="r")
    size = os.path.getsize(path)
    header_bytes = LLMC_HEADER_INTS * 4
    what = f"gpt_torch.py: '{path}' begins with llm.c's magic ({LLMC_MAGIC}) but"
    if size < header_bytes:
        sys.exit(f"{what} is {size} bytes long: expected a header of {header_bytes} bytes")
    header = np.fromfile(path, dtype="<i4", count=LLMC_HEADER_INTS)
    if header[1] != LLMC_VERSION:
        sys.exit(f"{what} its version is {header[1]}: expected {LLMC_VERSION} (uint16 tokens)")
    n = int(header[2])
    if size == header_bytes:
        sys.exit(f"{what} holds no tokens: expected a header of {header_bytes} bytes and then the "
                 f"tokens, got the header alone (its count is {n})")
    if n <= 0 or size != header_bytes + 2 * n:
        sys.exit(f"{what} its header's count of {n} tokens disagrees with its size: expected "
                 f"{header_bytes + 2 * n} bytes, got {size}")
    return np.memmap(path, dtype="<u2", mode="r", offset=header_bytes, shape=(n,))


def peak_tflops(a):
    """--peak-tflops, else the table's entry for this GPU and precision; None when unknown."""
    if a.peak_tflops > 0:
        return a.peak_tflops
    if not a.device.startswith("cuda") or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(torch.device(a.device))
    if "PCIe" in name or "NVL" in name:
        return None
    for part, peaks in PEAK_TFLOPS:
        if part in name:
            return peaks["low" if a.amp != "off" else "tf32" if a.allow_tf32 else "fp32"]
    return None


def print_flops(a, n_params, tokens_per_s, world):
    """flops_per_token= and mfu= (examples/gpt's lines): 6N + 12 L d T, PaLM's and nanoGPT's
    count (llm.c's is 6N + 6 L d T)."""
    flops = 6 * n_params + 12 * a.layers * a.dim * a.context
    print(f"flops_per_token={flops}")
    peak = peak_tflops(a)
    print(f"mfu={tokens_per_s * flops / (peak * 1e12 * world):.4f}" if peak else "mfu=unknown",
          flush=True)


class Block(nn.Module):
    def __init__(self, dim, heads, context, dropout, fused):
        super().__init__()
        self.heads, self.p, self.fused = heads, dropout, fused
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.gelu = nn.GELU(approximate="tanh")
        self.fc_proj = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)
        self.register_buffer("mask", torch.full((context, context), float("-inf")).triu(1),
                             persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        D = C // self.heads
        q, k, v = (t.view(B, T, self.heads, D).transpose(1, 2)
                   for t in self.qkv(self.ln1(x)).split(C, dim=2))
        if self.fused:  # PyTorch 2's fused kernels (flash or memory-efficient on a GPU)
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0,
                                               is_causal=True)
        else:
            att = q @ k.transpose(-2, -1) / math.sqrt(D) + self.mask[:T, :T]
            att = F.dropout(F.softmax(att, dim=-1), self.p, self.training)
            y = att @ v
        y = y.transpose(1, 2).reshape(B, T, C)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.fc_proj(self.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.checkpoint = a.checkpoint_activations
        self.wte = nn.Embedding(a.vocab, a.dim)
        self.wpe = nn.Embedding(a.context, a.dim)
        self.drop = nn.Dropout(a.dropout)
        self.blocks = nn.ModuleList(Block(a.dim, a.heads, a.context, a.dropout, a.attention == "fused")
                                    for _ in range(a.layers))
        self.ln_f = nn.LayerNorm(a.dim)
        self.head = nn.Linear(a.dim, a.vocab, bias=False)
        self.head.weight = self.wte.weight  # tied: one Parameter
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "ln" in name:
                    continue
                if name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02)
            for b in self.blocks:
                for w in (b.proj.weight, b.fc_proj.weight):
                    w.normal_(0.0, 0.02 / math.sqrt(2 * a.layers))

    def forward(self, idx):
        T = idx.shape[1]
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
        for b in self.blocks:
            if self.checkpoint and self.training:
                x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
            else:
                x = b(x)
        return self.head(self.ln_f(x))


def lr_factor(step, steps):
    warmup = min(WARMUP, steps)
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


class Windows:
    """nn/data/token_stream.h's scheme, index for index."""

    class _Len:
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

    def __init__(self, path, context, batch, world, rank, seed, validation_fraction=0.1):
        self.tok = read_tokens(path)
        n = len(self.tok)
        self.n_val = int(n * validation_fraction)
        self.n_train = n - self.n_val
        self.T, self.B, self.world, self.rank = context, batch, world, rank
        # TokenStream's two length checks (nn/data/token_stream.cpp's train_split): one step needs
        # B windows on every rank, each of T + 1 tokens; a validation window T + 1 tokens.
        need = context + batch * world
        if self.n_train < need:
            sys.exit(f"gpt_torch.py: '{path}' is too short: its training split holds "
                     f"{self.n_train} tokens, one step of {batch} windows of {context} tokens on "
                     f"each of {world} ranks needs at least {need}")
        if self.n_val != 0 and self.n_val < context + 1:
            sys.exit(f"gpt_torch.py: '{path}' is too short: its validation split holds "
                     f"{self.n_val} tokens, one window of context {context} needs {context + 1}")
        self.sampler = DistributedSampler(self._Len(self.n_train - context), num_replicas=world,
                                          rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.steps_per_epoch = len(self.sampler) // batch
        self.epoch, self.order = -1, []

    def train_offsets(self, step):
        epoch, k = divmod(step, self.steps_per_epoch)
        if epoch != self.epoch:
            self.sampler.set_epoch(epoch)
            self.order, self.epoch = list(iter(self.sampler)), epoch
        return self.order[k * self.B:(k + 1) * self.B]

    def validation_offsets(self, batch, batches):
        windows = batches * self.B * self.world
        starts = self.n_val - self.T
        return [self.n_train + ((batch * self.B + i) * self.world + self.rank) * (starts - 1) //
                max(windows - 1, 1) for i in range(self.B)]

    def batch_at(self, offsets):
        x = np.stack([self.tok[o:o + self.T] for o in offsets]).astype(np.int64)
        y = np.stack([self.tok[o + 1:o + self.T + 1] for o in offsets]).astype(np.int64)
        return torch.from_numpy(x), torch.from_numpy(y)


def amp_context(a):
    kind = "cuda" if a.device.startswith("cuda") else "cpu"
    if a.amp == "off":
        return torch.autocast(kind, enabled=False)
    return torch.autocast(kind, dtype=torch.bfloat16 if a.amp == "bf16" else torch.float16)


def evaluate(model, data, a, world):
    model.eval()
    total = 0.0
    with torch.no_grad(), amp_context(a):
        for i in range(a.eval_batches):
            x, y = data.batch_at(data.validation_offsets(i, a.eval_batches))
            x, y = x.to(a.device), y.to(a.device)
            total += F.cross_entropy(model(x).float().view(-1, a.vocab), y.view(-1)).item()
    model.train()
    t = torch.tensor([total], dtype=torch.float64, device=a.device)
    if world > 1:
        dist.all_reduce(t)
    return t.item() / (a.eval_batches * world)


class Stage(nn.Module):
    """Blocks `indices` of `gpt`, after its embeddings when `embed`, before ln_f and the tied
    head when `head`: examples/gpt_pipeline.h's GPTPart."""

    def __init__(self, gpt, indices, embed, head):
        super().__init__()
        self.embed, self.head = embed, head
        if embed or head:
            self.wte = gpt.wte
        if embed:
            self.wpe, self.drop = gpt.wpe, gpt.drop
        self.blocks = nn.ModuleList(gpt.blocks[i] for i in indices)
        if head:
            self.ln_f = gpt.ln_f

    def forward(self, x):
        if self.embed:
            T = x.shape[1]
            x = self.drop(self.wte(x) + self.wpe(torch.arange(T, device=x.device)))
        for b in self.blocks:
            x = b(x)
        return F.linear(self.ln_f(x), self.wte.weight) if self.head else x


def worker_pp(rank, world, a):
    """--pp: every rank one column of the pipeline (no data parallelism)."""
    from torch.distributed import pipelining as pl
    kinds = {"gpipe": (pl.ScheduleGPipe, 1), "1f1b": (pl.Schedule1F1B, 1),
             "interleaved-1f1b": (pl.ScheduleInterleaved1F1B, 2),
             "zero-bubble": (pl.ScheduleInterleavedZeroBubble, 2)}
    cls, per_rank = kinds[a.schedule]
    S = world * per_rank
    if a.layers % S or a.batch_size % a.microbatches:
        sys.exit(f"gpt_torch.py: --layers {a.layers} into {S} stages, --batch-size {a.batch_size} "
                 f"into {a.microbatches} micro-batches")
    torch.manual_seed(a.seed)
    gpt = GPT(a).to(a.device)
    n_params = sum(p.numel() for p in gpt.parameters())
    per = a.layers // S
    mine = [s for s in range(S) if s % world == rank]  # looped placement, as Ember's
    parts = [Stage(gpt, range(s * per, (s + 1) * per), s == 0, s == S - 1) for s in mine]
    dev = torch.device(a.device)
    stages = [pl.PipelineStage(m, s, S, dev) for m, s in zip(parts, mine)]

    def loss_fn(out, y):
        return F.cross_entropy(out.float().view(-1, a.vocab), y.view(-1))

    sched = cls(stages if per_rank > 1 else stages[0], a.microbatches, loss_fn=loss_fn)
    params = list({id(p): p for m in parts for p in m.parameters()}.values())
    tied = gpt.wte.weight
    holds_tied = any(m.embed or m.head for m in parts)
    holds_first = any(m.embed for m in parts)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, a.steps))
    data = Windows(a.tokens, a.context, a.batch_size, 1, 0, a.seed)
    data.train_offsets(0)
    first, last = 0 in mine, S - 1 in mine
    if rank == 0:
        print(f"gpt_torch: pipeline of {S} stages over {world} ranks ({a.schedule}, "
              f"{a.microbatches} micro-batches), {n_params} parameters (layers {a.layers}, heads "
              f"{a.heads}, dim {a.dim}, context {a.context}), batch {a.batch_size}, {a.steps} "
              f"steps, torch {torch.__version__}, {a.threads} threads per rank", flush=True)
    train_s = 0.0
    for step in range(a.steps):
        t0 = time.perf_counter()
        x, y = data.batch_at(data.train_offsets(step))
        opt.zero_grad(set_to_none=True)
        losses = []
        kwargs = {"target": y.to(dev), "losses": losses} if last else {}
        if first:
            sched.step(x.to(dev), **kwargs)
        else:
            sched.step(**kwargs)
        g = tied.grad if holds_tied and tied.grad is not None else torch.zeros_like(tied)
        dist.all_reduce(g)
        if holds_tied and tied.grad is None:
            tied.grad = g
        if a.grad_clip > 0:
            counted = [p.grad for p in params
                       if p.grad is not None and (holds_first or p is not tied)]
            sq = torch.stack([c.float().pow(2).sum() for c in counted]).sum().reshape(1)
            dist.all_reduce(sq)
            torch.nn.utils.clip_grads_with_norm_(params, a.grad_clip, sq.sqrt()[0])
        opt.step()
        lr_sched.step()
        loss = torch.tensor([sum(l.item() for l in losses) / max(1, len(losses))])
        dist.broadcast(loss, src=(S - 1) % world)
        train_s += time.perf_counter() - t0
    if rank == 0:
        tps = a.steps * a.batch_size * a.context / train_s
        print(f"loss={loss.item():.4f}")
        print(f"tokens_per_s={tps:.0f}", flush=True)
        print_flops(a, n_params, tps, world)


def worker(rank, world, a):
    if a.pp > 1:
        return worker_pp(rank, world, a)
    torch.backends.cuda.matmul.allow_tf32 = a.allow_tf32
    torch.manual_seed(a.seed)
    model = GPT(a).to(a.device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    if a.shard == "fsdp":  # FSDP2, as examples/gpt --shard fsdp: every block, then the root
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:
            sys.exit(f"gpt_torch.py: --shard fsdp needs FSDP2's fully_shard (PyTorch 2.6 or later; "
                     f"this is {torch.__version__})")
        for b in model.blocks:
            fully_shard(b)
        net = fully_shard(model)
        # fully_shard replaced the parameters by sharded DTensors: the groups take the new ones.
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
    else:
        net = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    if a.compile:
        net = torch.compile(net)
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if a.shard == "zero":  # examples/gpt --shard zero: each rank holds 1/N of AdamW's moments
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=a.lr,
                                      betas=(0.9, 0.95), eps=1e-8)
    else:
        opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    scaler = (torch.amp.GradScaler("cuda", enabled=a.amp == "fp16")
              if hasattr(torch.amp, "GradScaler")  # torch.cuda.amp's is deprecated since 2.4
              else torch.cuda.amp.GradScaler(enabled=a.amp == "fp16"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, a.steps))
    data = Windows(a.tokens, a.context, a.batch_size, world, rank, a.seed)
    data.train_offsets(0)  # the epoch's order before the clock starts, as Ember does
    lead = rank == 0
    if lead:
        print(f"gpt_torch: world size {world}, backend gloo, device {a.device}, {n_params} parameters "
              f"(layers {a.layers}, heads {a.heads}, dim {a.dim}, context {a.context}), batch "
              f"{a.batch_size} per rank, {a.steps} steps, amp {a.amp}, torch {torch.__version__}, "
              f"{a.threads} threads per rank{', compiled' if a.compile else ''}", flush=True)
    log_every = a.log_every or max(1, a.steps // 20)
    timed_steps = a.steps - a.warmup_steps
    train_s, val, evaluated, window = 0.0, float("nan"), False, []
    for step in range(a.steps):
        t0 = time.perf_counter()
        x, y = data.batch_at(data.train_offsets(step))
        x, y = x.to(a.device), y.to(a.device)
        opt.zero_grad(set_to_none=True)
        with amp_context(a):
            loss = F.cross_entropy(net(x).float().view(-1, a.vocab), y.view(-1))
        scaler.scale(loss).backward()
        if a.grad_clip > 0:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        scaler.step(opt)
        scaler.update()
        sched.step()
        window.append(loss.item())
        if step >= a.warmup_steps:  # torch.compile compiles in the first steps
            train_s += time.perf_counter() - t0
        done = step + 1
        if lead and (done % log_every == 0 or done == a.steps):
            tps = (done - a.warmup_steps) * a.batch_size * a.context * world / train_s if train_s else 0
            print(f"step {done}/{a.steps}  loss {sum(window) / len(window):.4f}  "
                  f"lr {opt.param_groups[0]['lr']:.2e}  {tps:.0f} tok/s", flush=True)
            window = []
        evaluated = a.eval_every > 0 and done % a.eval_every == 0
        if evaluated:
            val = evaluate(net, data, a, world)
            if lead:
                print(f"step {done}: validation loss {val:.4f}", flush=True)
    if not evaluated:
        val = evaluate(net, data, a, world)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    if world > 1:
        dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if lead:
        tps = timed_steps * a.batch_size * a.context * world / train_s
        print(f"val_loss={val:.4f}")
        print(f"tokens_per_s={tps:.0f}")
        print_flops(a, n_params, tps, world)
        print(f"peak_rss_mb={rss.item():.0f}", flush=True)
        if a.device.startswith("cuda"):
            print(f"peak_allocated_mb={torch.cuda.max_memory_allocated() / 2**20:.1f}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", required=True,
                   help="the token file examples/gpt wrote or named, or any in llm.c's format")
    p.add_argument("--vocab", type=int, default=0,
                   help="the model's vocabulary (default: 50304 for llm.c's token files, else 256)")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="one GPU's dense peak TFLOPS in the precision trained, for mfu= (default: "
                        "by torch.cuda.get_device_name: H100/H200 SXM 989.4 bf16/fp16, 67 "
                        "float32; A100 312, 19.5; else mfu=unknown)")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--amp", default="off", choices=["off", "bf16", "fp16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--attention", default="written", choices=["written", "fused"],
                   help="written out (PyTorch 1.13) or F.scaled_dot_product_attention (PyTorch 2)")
    p.add_argument("--checkpoint-activations", action="store_true")
    p.add_argument("--shard", default="none", choices=["none", "zero", "fsdp"],
                   help="zero: DDP with torch.distributed.optim.ZeroRedundancyOptimizer; fsdp: "
                        "FSDP2's fully_shard on every block and the root (PyTorch 2.6 or later; "
                        "torch 1.13's FSDP does not import under this Python)")
    p.add_argument("--compile", action="store_true", help="torch.compile the (wrapped) model")
    p.add_argument("--allow-tf32", action="store_true",
                   help="torch.backends.cuda.matmul.allow_tf32 = True (float32 matmuls on TF32)")
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="first steps left out of tokens_per_s (compilation)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages' ranks (every rank)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", default="1f1b",
                   choices=["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"])
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--log-every", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="per rank; 0: cores / nproc")
    a = p.parse_args()
    if not os.path.exists(a.tokens):
        sys.exit(f"gpt_torch.py: no token file at {a.tokens} (run examples/gpt once with --cache-dir)")
    if a.vocab <= 0:
        a.vocab = GPT2_PADDED_VOCAB if is_llmc(a.tokens) else BYTE_VOCAB
    largest = int(read_tokens(a.tokens).max())
    if largest >= a.vocab:
        sys.exit(f"gpt_torch.py: '{a.tokens}' holds token {largest}, which a vocabulary of "
                 f"{a.vocab} cannot embed: expected every token < {a.vocab} (--vocab)")
    if not 0 <= a.warmup_steps < a.steps:
        sys.exit(f"gpt_torch.py: --warmup-steps {a.warmup_steps} must be below --steps {a.steps}")
    if a.pp > 1 and a.pp != a.nproc:
        sys.exit("gpt_torch.py: --pp must equal --nproc (no data parallelism with it)")
    torch_launch.launch(worker, a)


if __name__ == "__main__":
    sys.exit(main())
