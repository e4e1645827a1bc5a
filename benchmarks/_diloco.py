r"""DiLoCo with all-reduce (Douillard et al. 2023, arXiv 2311.08105): the baseline of the local steps.

One implementation for the two places that measure against it: ``benchmarks/time_to_quality.py``
(wall-clock to a target loss) and the convergence study's ``local`` stage
(``experiments/convergence``: the loss at a fixed step count).

Every worker runs its own inner optimizer (the caller's, e.g. ``torch.optim.AdamW``) for ``H``
steps from the shared outer parameters :math:`\theta`. Then the pseudo-gradients
:math:`\Delta_i = \theta - x_i` are averaged by a blocking all-reduce (DiLoCo waits for it) and
:math:`\theta` takes torch.optim.SGD's momentum step on the mean :math:`\Delta`:

.. math::
    b \leftarrow \mu b + \Delta \ (b = \Delta \text{ at the first outer step}), \qquad
    \theta \leftarrow \theta - \eta (\Delta + \mu b) \ \text{(Nesterov; else } \eta b),

after which every worker starts the next period from :math:`\theta`. The inner optimizer keeps
its state across periods, as DiLoCo does. Published setting: :math:`\eta = 0.7`,
:math:`\mu = 0.9`, Nesterov. Everything is in one flat vector of the parameters, so an outer
step is one all-reduce.

``H`` may differ between ranks (the benchmark's ``diloco:...:hetero``, torchft's answer to uneven
devices: ``H_i`` = round(H x rank i's speed), so a slower rank takes fewer inner steps and all
reach the sync together): rank i syncs after its own ``H_i`` steps, so every rank still enters
the k-th all-reduce as its k-th, and the outer step is the same plain mean of the
:math:`\Delta_i` (not weighted by ``H_i``, as torchft's ``Manager.allreduce`` divides by the
number of replicas).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector


@contextmanager
@torch.no_grad()
def averaged_parameters(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """Within the block ``params`` are the workers' mean (an all-reduce each); restored on exit."""
    backup = [p.detach().clone() for p in params]
    for p in params:
        dist.all_reduce(p)
        p.div_(dist.get_world_size())
    try:
        yield
    finally:
        for p, saved in zip(params, backup):
            p.copy_(saved)


class DiLoCo:
    """Wraps an inner optimizer: ``step()`` is its step, plus DiLoCo's outer step every ``H``.

    ``param_groups`` and ``zero_grad`` are the inner optimizer's, so a training loop that sets
    the learning rate through ``param_groups`` drives the inner rate; a ``torch.optim``
    scheduler takes ``.inner``. Every rank of the default process group must call ``step``,
    ``averaged`` and ``consensus_distance`` at the same points (they are collectives).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        inner: torch.optim.Optimizer,
        local_steps: int,
        lr: float = 0.7,
        momentum: float = 0.9,
        nesterov: bool = True,
    ) -> None:
        if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
            raise ValueError(f"local_steps must be an int >= 1, got {local_steps!r}")
        if nesterov and momentum <= 0:
            raise ValueError("Nesterov needs a momentum > 0 (or pass nesterov=False)")
        self.params = list(params)
        self.inner = inner
        self.local_steps = local_steps
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.theta = parameters_to_vector(self.params).detach().clone()  # the outer parameters
        self.momentum_buffer: torch.Tensor | None = None
        self.steps = 0

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        """The inner step; after every ``local_steps``-th, the outer step (a collective)."""
        self.inner.step()
        self.steps += 1
        if self.steps % self.local_steps == 0:
            self.outer_step()

    @torch.no_grad()
    def outer_step(self) -> None:
        delta = self.theta - parameters_to_vector(self.params)
        dist.all_reduce(delta)
        delta.div_(dist.get_world_size())
        if self.momentum_buffer is None:
            self.momentum_buffer = delta.clone()
        else:
            self.momentum_buffer.mul_(self.momentum).add_(delta)
        if self.nesterov:
            update = delta.add_(self.momentum_buffer, alpha=self.momentum)
        else:
            update = self.momentum_buffer
        self.theta.sub_(update, alpha=self.lr)
        # copy (vector_to_parameters would make the parameters views of theta, and the inner
        # steps would then move the outer parameters too)
        start = 0
        for p in self.params:
            p.copy_(self.theta[start : start + p.numel()].view_as(p))
            start += p.numel()

    def averaged(self) -> AbstractContextManager[None]:
        """Within the block the parameters are the workers' mean (mid-period, the workers
        differ); restored on exit. Parameters only: buffers (BatchNorm) are left as they are."""
        return averaged_parameters(self.params)

    @torch.no_grad()
    def consensus_distance(self) -> float:
        r"""This rank's :math:`\lVert x_i - \bar x \rVert_2` (0 right after an outer step)."""
        x = parameters_to_vector(self.params).double()
        mean = x.clone()
        dist.all_reduce(mean)
        mean.div_(dist.get_world_size())
        return math.sqrt(float((x - mean).square().sum()))
