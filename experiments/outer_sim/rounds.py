r"""Schedules of rounds on stacked workers (``task.py``): what each method does between steps.

Each method is called after every step's update with the completed step count ``c`` (all
workers step together here) and may change the stacked parameters ``x``. ``W(r)`` is the
topology's mixing matrix of round ``r``; ``mix(W, t)`` is :math:`\sum_j w_{ij} t_j` for every
``i``. An outer step is torch.optim.SGD's (Nesterov) step on a pseudo-gradient, as
``decent_optim.OuterSGD``:
:math:`b \leftarrow \mu b + \Delta,\ \theta \leftarrow \theta - \eta(\Delta + \mu b)`.

* ``Local`` -- ``local_steps=H`` as the package does it: at the end of period k the anchor takes
  the parameters and round k is launched; it is mixed in one step before period k+1 ends
  (``x += W a - a``), so it travels for a whole period.
* ``DiLoCo`` -- the all-reduce baseline: blocking, exact mean of the pseudo-gradients, outer step
  on the shared :math:`\theta`, every worker restarts from it.
* ``BlockingOuter`` -- today's ``outer=`` over gossip: the outer step on each worker's own anchor,
  then a blocking round that mixes the anchors.
* ``DelayedOuter`` -- the candidate of issue 32: the round of period k carries the outer
  parameters :math:`\theta_i` and the pseudo-gradient :math:`\Delta_i^k` (optionally the outer
  momentum) and travels during period k+1, while the worker goes on from its own parameters.
  At the end of period k+1 the outer step uses the *mixed* pseudo-gradient of period k on the
  mixed :math:`\theta`, and the worker's parameters become the new :math:`\theta_i` plus the
  local progress of period k+1 (a provisional, unmixed step that the next outer step replaces).
  With ``W`` the exact mean it is one-period-delayed DiLoCo.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Params = dict[str, torch.Tensor]
Mixing = Callable[[int], torch.Tensor]  # round -> (n, n) float32 matrix


def mix(w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return torch.einsum("ij,j...->i...", w, t)


def exact_mean(n: int) -> Mixing:
    return lambda r: torch.full((n, n), 1.0 / n)


def outer_step(theta, delta, buf, lr, momentum, nesterov=True):
    """torch.optim.SGD's momentum step on ``theta`` with gradient ``delta``; returns the buffer."""
    if momentum:
        buf = delta.clone() if buf is None else buf * momentum + delta
        step = delta + momentum * buf if nesterov else buf
    else:
        step = delta
    return theta - lr * step, buf


class Every:
    """Every-step gossip (``local_steps=1``): mix after every update, with round c's matrix."""

    def __init__(self, mixing: Mixing, h: int = 1) -> None:
        self.mixing = mixing

    def __call__(self, x: Params, c: int) -> None:
        w = self.mixing(c)
        for k in x:
            x[k] = mix(w, x[k])


class Ddp:
    """Nothing between steps: the gradients are averaged before the update (``runner``)."""

    averages_gradients = True

    def __call__(self, x: Params, c: int) -> None:
        pass


class Local:
    def __init__(self, mixing: Mixing, h: int) -> None:
        self.mixing, self.h = mixing, h
        self.anchor: Params | None = None
        self.in_flight: Params | None = None  # the mixed anchors of the round travelling

    def before_update(self, x: Params, c: int) -> None:
        if self.anchor is None:
            self.anchor = {k: v.clone() for k, v in x.items()}
        if (c + 1) % self.h == 0 and self.in_flight is not None:
            for k in x:
                x[k] += self.in_flight[k] - self.anchor[k]
            self.anchor, self.in_flight = self.in_flight, None

    def __call__(self, x: Params, c: int) -> None:
        if c % self.h:
            return
        self.anchor = {k: v.clone() for k, v in x.items()}
        w = self.mixing(c // self.h)
        self.in_flight = {k: mix(w, v) for k, v in self.anchor.items()}


class DiLoCo:
    def __init__(self, h: int, lr: float = 0.7, momentum: float = 0.9) -> None:
        self.h, self.lr, self.momentum = h, lr, momentum
        self.theta: Params | None = None
        self.buf: dict[str, torch.Tensor | None] = {}

    def before_update(self, x: Params, c: int) -> None:
        if self.theta is None:
            self.theta = {k: v[0].clone() for k, v in x.items()}

    def __call__(self, x: Params, c: int) -> None:
        if c % self.h:
            return
        for k in x:
            delta = (self.theta[k] - x[k]).mean(0)
            self.theta[k], self.buf[k] = outer_step(
                self.theta[k], delta, self.buf.get(k), self.lr, self.momentum
            )
            x[k] = self.theta[k].expand_as(x[k]).clone()


class Snoo(DiLoCo):
    """DDP's averaged gradients inside, DiLoCo's outer step every H (SNOO, arXiv 2510.15830):
    does the outer Nesterov step help this task with one model?"""

    averages_gradients = True


class BlockingOuter:
    def __init__(self, mixing: Mixing, h: int, lr: float = 0.7, momentum: float = 0.9) -> None:
        self.mixing, self.h, self.lr, self.momentum = mixing, h, lr, momentum
        self.anchor: Params | None = None
        self.buf: dict[str, torch.Tensor | None] = {}

    def before_update(self, x: Params, c: int) -> None:
        if self.anchor is None:
            self.anchor = {k: v.clone() for k, v in x.items()}

    def __call__(self, x: Params, c: int) -> None:
        if c % self.h:
            return
        w = self.mixing(c // self.h)
        for k in x:
            delta = self.anchor[k] - x[k]
            a, self.buf[k] = outer_step(
                self.anchor[k], delta, self.buf.get(k), self.lr, self.momentum
            )
            self.anchor[k] = mix(w, a)
            x[k] = self.anchor[k].clone()


class DelayedOuter:
    """See the module docstring. ``mix_momentum``: the round carries the outer momentum too."""

    def __init__(
        self,
        mixing: Mixing,
        h: int,
        lr: float = 0.7,
        momentum: float = 0.9,
        mix_momentum: bool = False,
    ) -> None:
        self.mixing, self.h, self.lr, self.momentum = mixing, h, lr, momentum
        self.mix_momentum = mix_momentum
        self.theta: Params | None = None
        self.start: Params | None = None  # the parameters at the start of this period
        self.buf: dict[str, torch.Tensor | None] = {}
        self.in_flight: tuple[Params, Params, dict] | None = None  # mixed theta, delta, buf

    def before_update(self, x: Params, c: int) -> None:
        if self.theta is None:
            self.theta = {k: v.clone() for k, v in x.items()}
            self.start = {k: v.clone() for k, v in x.items()}

    def __call__(self, x: Params, c: int) -> None:
        if c % self.h:
            return
        delta = {k: self.start[k] - x[k] for k in x}  # this period's local progress, negated
        if self.in_flight is not None:
            theta, mixed_delta, bufs = self.in_flight
            for k in x:
                buf = bufs.get(k) if self.mix_momentum else self.buf.get(k)
                self.theta[k], self.buf[k] = outer_step(
                    theta[k], mixed_delta[k], buf, self.lr, self.momentum
                )
                x[k] = self.theta[k] - delta[k]
        w = self.mixing(c // self.h)
        bufs = {k: None if b is None else mix(w, b) for k, b in self.buf.items()}
        self.in_flight = (
            {k: mix(w, v) for k, v in self.theta.items()},
            {k: mix(w, v) for k, v in delta.items()},
            bufs,
        )
        self.start = {k: v.clone() for k, v in x.items()}


class LocalOuter(Local):
    r"""``local_steps=H`` with a Nesterov outer step every ``k`` periods on each worker's own
    parameters (SNOO over gossip): slow weights :math:`\theta_i`, pseudo-gradient
    :math:`\Delta_i = \theta_i - x_i`, then :math:`x_i \leftarrow \theta_i`. It needs no
    round of its own: the local steps' rounds keep the workers' :math:`x_i`, and so their
    :math:`\Delta_i`, close; the outer step is local arithmetic at a period's end, before the
    anchor of the next round is taken (the package's ``outer=LocalOuterSGD``)."""

    def __init__(self, mixing: Mixing, h: int, k: int, lr: float, momentum: float) -> None:
        super().__init__(mixing, h)
        self.k, self.lr, self.momentum = k, lr, momentum
        self.theta: Params | None = None
        self.buf: dict[str, torch.Tensor | None] = {}

    def __call__(self, x: Params, c: int) -> None:
        if self.theta is None:
            self.theta = {k: v.clone() for k, v in self.anchor.items()}
        if c % (self.h * self.k) == 0:
            for k in x:
                delta = self.theta[k] - x[k]
                self.theta[k], self.buf[k] = outer_step(
                    self.theta[k], delta, self.buf.get(k), self.lr, self.momentum
                )
                x[k] = self.theta[k].clone()
        super().__call__(x, c)
