"""The time-to-quality task (``benchmarks/time_to_quality.py``) for N workers in one process.

The workers' parameters are stacked (a leading dimension of N), each worker's gradient taken at
its own parameters and batch, so an algorithm of the rounds can be
tried on the benchmark's model, data order, schedule and AdamW without processes or a network.
What it measures is steps (link-independent); wall-clock comes from the emulated cluster.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import functional_call

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train_charlm  # noqa: E402

Params = dict[str, torch.Tensor]


@dataclass
class Hyper:
    """The benchmark's defaults (``time_to_quality.py``): DDP's tuned rate and its schedule."""

    steps: int = 1200
    warmup: int = 240
    lr: float = 6e-3
    global_batch: int = 32
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip: float = 1.0
    val_batches: int = 16

    def lr_factor(self, step: int) -> float:
        """Of the peak, for the step about to be taken (warm-up, cosine to 10%, then constant)."""
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


class Task:
    """Model, data and evaluation of the benchmark for ``n`` workers, seed ``seed``."""

    def __init__(self, n: int, seed: int, hyper: Hyper | None = None) -> None:
        self.n, self.seed, self.hyper = n, seed, hyper or Hyper()
        corpus = train_charlm.load_corpus(n_sentences=20_000, val_batches=self.hyper.val_batches)
        self.train, self.val = corpus.train, corpus.val_batches
        torch.manual_seed(seed)
        self.model = train_charlm.CharGPT(corpus.vocab_size)
        self.names = [k for k, _ in self.model.named_parameters()]
        self.decay = {k: p.dim() >= 2 for k, p in self.model.named_parameters()}
        self.local_batch = self.hyper.global_batch // n

    def initial(self) -> Params:
        """Every worker's start: the seed's model, stacked n times."""
        return {
            k: p.detach().unsqueeze(0).repeat(self.n, *[1] * p.dim()).clone()
            for k, p in self.model.named_parameters()
        }

    def batches(self, steps: list[int], ranks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank r's batch of its step s, as the benchmark draws it (seeded by seed, rank, step)."""
        xs, ys = [], []
        for rank, step in zip(ranks, steps):
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + rank * 10_007 + step)
            x, y = train_charlm.get_batch(self.train, self.local_batch, gen)
            xs.append(x)
            ys.append(y)
        return torch.stack(xs), torch.stack(ys)

    def grads(
        self, params: Params, x: torch.Tensor, y: torch.Tensor, ranks=None, average=False
    ) -> Params:
        """Per-worker gradients (of the workers in ``ranks``, default all; zeros for the
        others), clipped per worker to the benchmark's norm; with ``average`` (DDP) their mean,
        clipped once, for every worker. One worker at a time: ``vmap``
        has no batching rule for CPU attention and runs 10x slower."""
        ranks = range(self.n) if ranks is None else ranks
        g = {k: torch.zeros_like(v) for k, v in params.items()}
        for j, i in enumerate(ranks):
            mine = {k: v[i].detach().requires_grad_() for k, v in params.items()}
            logits = functional_call(self.model, mine, (x[j],))
            F.cross_entropy(logits.flatten(0, 1), y[j].flatten()).backward()
            for k, v in mine.items():
                g[k][i] = v.grad
        if average:
            g = {k: v.mean(0, keepdim=True).expand_as(v).clone() for k, v in g.items()}
        norms = torch.sqrt(sum(v.flatten(1).square().sum(1) for v in g.values()))
        scale = (self.hyper.clip / (norms + 1e-6)).clamp(max=1.0)
        return {k: v * scale.view(-1, *[1] * (v.dim() - 1)) for k, v in g.items()}

    @torch.no_grad()
    def loss_of_mean(self, params: Params) -> float:
        """Held-out loss of the workers' mean model (the benchmark's consensus model)."""
        mean = {k: v.mean(0) for k, v in params.items()}
        total = 0.0
        for x, y in self.val:
            logits = functional_call(self.model, mean, (x,))
            total += float(F.cross_entropy(logits.flatten(0, 1), y.flatten()))
        return total / len(self.val)


class AdamW:
    """torch.optim.AdamW on stacked parameters, with a step count per worker (some may idle)."""

    def __init__(self, task: Task, params: Params) -> None:
        self.h = task.hyper
        self.decay = task.decay
        self.m = {k: torch.zeros_like(v) for k, v in params.items()}
        self.v = {k: torch.zeros_like(v) for k, v in params.items()}
        self.t = torch.zeros(task.n)

    @torch.no_grad()
    def step(self, params: Params, grads: Params, lr: torch.Tensor, mask: torch.Tensor) -> None:
        """One step for the workers where ``mask`` is set; ``lr`` per worker."""
        b1, b2 = self.h.betas
        self.t += mask
        t = self.t.clamp(min=1)
        bias1, bias2 = 1 - b1**t, 1 - b2**t
        for k, p in params.items():
            shape = (-1, *[1] * (p.dim() - 1))
            on = mask.view(shape).bool()
            g = grads[k]
            m = torch.where(on, self.m[k] * b1 + g * (1 - b1), self.m[k])
            v = torch.where(on, self.v[k] * b2 + g * g * (1 - b2), self.v[k])
            self.m[k], self.v[k] = m, v
            wd = self.h.weight_decay if self.decay[k] else 0.0
            step_size = (lr / bias1).view(shape)
            denom = (v / bias2.view(shape)).sqrt() + self.h.eps
            new = p * (1 - lr.view(shape) * wd) - step_size * m / denom
            p.copy_(torch.where(on, new, p))
