"""Small helpers shared by the tiny-model training scripts."""
import contextlib
import csv
import math
import os
import random
import time

import numpy as np
import torch


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def device_and_amp(amp="auto"):
    """(device, autocast context factory). bf16 autocast on the GPU; fp32 on the CPU unless amp='bf16'."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    use = amp == "bf16" or (amp == "auto" and dev.type == "cuda")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    def ctx():
        return torch.autocast(dev.type, dtype=torch.bfloat16) if use else contextlib.nullcontext()
    return dev, ctx, use


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


class Clock:
    """Training-loop time budget: ends at min(start + seconds, deadline - reserve)."""

    def __init__(self, seconds, deadline=None, reserve=0.0):
        self.t0 = time.time()
        end = self.t0 + seconds
        if deadline:
            end = min(end, deadline - reserve)
        self.end = max(end, self.t0 + 1.0)
        self.budget = self.end - self.t0

    def elapsed(self):
        return time.time() - self.t0

    def frac(self):
        return min(1.0, self.elapsed() / self.budget)

    def done(self):
        return time.time() >= self.end


def lr_at(step, frac, lr, warmup, min_frac):
    """Linear warmup by steps, then cosine by elapsed-time fraction down to lr * min_frac."""
    w = min(1.0, (step + 1) / max(1, warmup))
    return lr * w * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def adamw(params, lr, betas, weight_decay, dev):
    """AdamW; weight decay on matrices only (not on norms and biases)."""
    params = [p for p in params if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    kw = {"fused": True} if dev.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), **kw)


class CsvLog:
    def __init__(self, path, columns):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.f = open(path, "w", newline="")
        self.w = csv.writer(self.f)
        self.w.writerow(columns)
        self.cols = columns

    def row(self, **kv):
        self.w.writerow(["" if kv.get(c) is None else (f"{kv[c]:.6g}" if isinstance(kv[c], float) else kv[c])
                         for c in self.cols])
        self.f.flush()


def windows(stream, starts, T):
    """Rows stream[s : s+T] for each start (stream: 1-D int tensor on the device)."""
    idx = starts[:, None] + torch.arange(T, device=stream.device)[None, :]
    return stream[idx].long()
