r"""N workers of the time-to-quality task in one process: their parameters stacked, steps only.

What a many-worker run costs in *steps* does not depend on the link, so it can be measured
without processes or a network: the workers' parameters are one ``(n, P)`` tensor, each row a
worker's flat copy (``torch.nn.utils.parameters_to_vector``'s order). Worker ``i``'s gradient is
taken at its own row and its own batch, drawn exactly as the harness's worker loop draws it
(``_worker.py``: a generator seeded by seed, rank and step; the model built after
``torch.manual_seed(seed)``), and clipped to norm 1.0 as ``clip_grad_norm_`` clips it. The
schedule is the harness's (linear warm-up, cosine to 10% of the peak). The consensus model is the
rows' mean, evaluated on the workload's held-out batches. What each method does with the rows
between gradients is ``_sim_methods.py``.

One worker at a time through ``torch.func.functional_call``: the same kernels a rank runs, so the
numbers agree with a multi-rank run to float tolerance (``tests/test_bench_simulate.py``); the
cost is the global batch's forward and backward, as on one rank with the whole batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import _text
import torch
import torch.nn.functional as F
from torch.func import functional_call


@dataclass
class Schedule:
    """The harness's defaults for the time-to-quality workload (``time_to_quality.py``)."""

    steps: int = 480
    warmup: int = 48
    lr: float = 6e-3
    clip: float = 1.0

    def factor(self, step: int) -> float:
        """Of the peak, for the step about to be taken (0-based), as ``_worker.lr_factor``."""
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


class Task:
    """The workload ``name`` for ``n`` workers at global batch ``global_batch``, seed ``seed``."""

    def __init__(
        self, name: str, n: int, seed: int, global_batch: int = 32, val_batches: int = 8,
        local_world_size: int = 1,
    ) -> None:  # fmt: skip
        if global_batch % n:
            raise SystemExit(f"--global-batch {global_batch} is not a multiple of {n} workers")
        self.n, self.seed, self.local_world_size = n, seed, local_world_size
        self.local_batch = global_batch // n
        self.work = _text.load(name, val_batches)
        torch.manual_seed(seed)
        self.model = self.work.make_model()
        named = list(self.model.named_parameters())
        self.names = [k for k, _ in named]
        self.shapes = [p.shape for _, p in named]
        self.sizes = [p.numel() for _, p in named]
        self.numel = sum(self.sizes)
        #: 1.0 where weight decay applies (parameters of two or more dimensions), else 0.0
        self.decay = torch.cat([torch.full((p.numel(),), float(p.dim() >= 2)) for _, p in named])
        self.start = torch.cat([p.detach().flatten() for _, p in named])
        #: the package's buckets of the harness's two param groups (decayed, not), as indices
        #: into a row: a codec scales per chunk of a bucket (one bucket per group below 25 MB)
        where = torch.arange(self.numel)
        self.buckets = [where[self.decay == 1.0], where[self.decay == 0.0]]

    def initial(self) -> torch.Tensor:
        """Every worker's start: the seed's model, ``(n, P)``."""
        return self.start.unsqueeze(0).repeat(self.n, 1)

    def batch(self, rank: int, step: int, size: int | None = None):
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + rank * 10_007 + step)
        return self.work.batch(self.local_batch if size is None else size, gen)

    def _views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: v.view(s) for k, v, s in zip(self.names, flat.split(self.sizes), self.shapes)}

    def loss_grad(self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor):
        """The loss at parameters ``flat`` (P,) on ``(x, y)`` and its flat gradient."""
        leaf = flat.detach().clone().requires_grad_()
        logits = functional_call(self.model, self._views(leaf), (x,))
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        assert leaf.grad is not None
        return float(loss.detach()), leaf.grad

    def clip_(self, grad: torch.Tensor) -> torch.Tensor:
        """``clip_grad_norm_(..., 1.0)`` on one worker's flat gradient (norm of the per-tensor
        norms, as torch takes it)."""
        norms = torch.stack([g.norm() for g in grad.split(self.sizes)])
        coef = (1.0 / (norms.norm() + 1e-6)).clamp(max=1.0)
        return grad.mul_(coef)

    def grads(self, xs: torch.Tensor, step: int) -> torch.Tensor:
        """Every worker's clipped gradient of step ``step`` at its own row of ``xs``."""
        out = torch.empty_like(xs)
        for i in range(self.n):
            out[i] = self.clip_(self.loss_grad(xs[i], *self.batch(i, step))[1])
        return out

    def ddp_grad(self, x: torch.Tensor, step: int) -> torch.Tensor:
        """DDP's clipped gradient: the mean of the ranks' gradients, one forward of them all."""
        batches = [self.batch(i, step) for i in range(self.n)]
        inputs = torch.cat([b[0] for b in batches])
        targets = torch.cat([b[1] for b in batches])
        return self.clip_(self.loss_grad(x, inputs, targets)[1])

    @torch.no_grad()
    def loss_of(self, flat: torch.Tensor) -> float:
        """Held-out loss of the model with parameters ``flat``."""
        params = self._views(flat)
        val = self.work.val_batches
        total = sum(
            float(F.cross_entropy(functional_call(self.model, params, (x,)).flatten(0, 1), y.flatten()))
            for x, y in val
        )  # fmt: skip
        return total / len(val)
