r"""Local steps: gossip every ``H`` steps, optionally with an outer Nesterov step (DiLoCo over gossip).

Rank :math:`i` keeps, per bucket, an *anchor* :math:`a_i` (what it last sent; with an outer
optimizer, its outer parameters :math:`\theta_i`) and, with outer momentum, a buffer :math:`b_i`.
Steps are counted from 0; period :math:`k` is the steps that take the count from :math:`kH` to
:math:`(k+1)H`. Without ``outer``, in the step that completes a period, before the local update,
the round launched at the end of the previous period (it carries :math:`a_j` and travelled
during the whole period) is mixed into the anchor, and the same change is added to the working
parameters:

.. math::
    a_i' = \sum_j w_{ij} a_j, \qquad x_i \leftarrow x_i + (a_i' - a_i), \qquad a_i \leftarrow a_i'.

After the update, when the count reaches a multiple of :math:`H`: without ``outer`` the anchor
becomes :math:`a_i \leftarrow x_i`; with ``outer`` the pseudo-gradient
:math:`\Delta_i = a_i - x_i` takes torch.optim.SGD's momentum step on the anchor,

.. math::
    b_i \leftarrow \mu b_i + \Delta_i, \qquad
    a_i \leftarrow a_i - \eta_{out} (\Delta_i + \mu b_i) \ \text{(Nesterov; else } \eta_{out} b_i),
    \qquad x_i \leftarrow a_i,

and round :math:`(count / H)` is launched with the anchor; with ``outer`` it is mixed at once
(the same formula, with :math:`x_i = a_i`: :math:`x_i = a_i = \sum_j w_{ij} a_j`), as DiLoCo
waits for its all-reduce. Mixing the outer parameters (not the
pseudo-gradients) keeps the workers' *mean* on exactly DiLoCo's outer dynamics and contracts the
disagreement of the :math:`\theta_i` by :math:`W` every round; the derivation is in
``docs/algorithms.rst`` ("Local steps"). ``outer=OuterSGD(lr=1, momentum=0)`` is the plain mode.

The anchors travel, never the parameters, so parameters may be written at any time; the anchor
is never written while its round travels. Checkpoints of the anchors:
:mod:`~decent_optim.optim.local_checkpoint`. ``local_steps=1`` without ``outer`` is not this class
but the ordinary :class:`~decent_optim.optim.rounds.Rounds` (every-step gossip, bit for bit).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from decent_optim.flat import FlatParams
from decent_optim.gossip import Gossiper, GossipHandle, LocalGossiper
from decent_optim.optim.rounds import Rounds

__all__ = ["OuterSGD", "LocalRounds", "check_outer_rates", "sgd_outer_step"]


@dataclass(frozen=True)
class OuterSGD:
    """The outer optimizer of ``outer=``: torch.optim.SGD's momentum step on the pseudo-gradient.

    ``outer="diloco"`` is ``OuterSGD(lr=0.7, momentum=0.9, nesterov=True)``, DiLoCo's published
    setting (Douillard et al. 2023). ``OuterSGD(lr=1.0, momentum=0.0, nesterov=False)`` is the
    plain mode (the anchor is the parameters).
    """

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True

    def __post_init__(self) -> None:
        check_outer_rates("OuterSGD", self.lr, self.momentum, self.nesterov)
        # plain numbers (numpy's too), so that the setting a checkpoint records reads alike
        object.__setattr__(self, "lr", float(self.lr))
        object.__setattr__(self, "momentum", float(self.momentum))


def check_outer_rates(owner: str, lr: object, momentum: object, nesterov: object) -> None:
    """The checks every outer-step setting shares, with errors naming ``owner``."""
    for name, value in (("lr", lr), ("momentum", momentum)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{owner}.{name} must be a number, got {type(value).__name__}")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{owner}.{name} must be a finite number >= 0, got {value!r}")
    if not lr > 0:  # type: ignore[operator]
        raise ValueError(f"{owner}.lr must be > 0, got {lr!r} (0 would never move)")
    if not isinstance(nesterov, bool):
        raise TypeError(f"{owner}.nesterov must be a bool, got {nesterov!r}")
    if nesterov and momentum == 0:
        raise ValueError(f"{owner}: Nesterov needs a momentum > 0 (or pass nesterov=False)")


def sgd_outer_step(
    theta: Tensor, x: Tensor, buf: Tensor | None, lr: float, momentum: float, nesterov: bool
) -> Tensor | None:
    """torch.optim.SGD's step on ``theta`` with the pseudo-gradient ``theta - x``, then
    ``x = theta``. Returns the momentum buffer (None without momentum)."""
    delta = torch.sub(theta, x)
    step = delta
    if momentum:
        # as torch.optim.SGD: the buffer starts as the first gradient
        buf = delta.clone() if buf is None else buf.mul_(momentum).add_(delta)
        step = delta.add_(buf, alpha=momentum) if nesterov else buf
    theta.sub_(step, alpha=lr)
    x.copy_(theta)
    return buf


class LocalRounds(Rounds):
    """The rounds of the module docstring: one every ``local_steps`` steps, carrying the anchors."""

    #: what a checkpoint keeps besides the parameters: its key -> the attribute (a flat per
    #: bucket, or None), see :mod:`~decent_optim.optim.local_checkpoint`
    SAVED = {"anchor": "anchor", "outer_momentum": "momentum"}

    def __init__(
        self,
        gossip: Gossiper | LocalGossiper,
        flat: FlatParams,
        global_avg_every: int | None,
        local_steps: int,
        outer: OuterSGD | None,
    ) -> None:
        super().__init__(gossip, flat, global_avg_every)
        self.local_steps, self.outer = local_steps, outer
        # taken from the parameters at the first step (not at construction: the model may still
        # be loaded between building the optimizer and stepping)
        self.anchor: list[Tensor] | None = None
        self.momentum: list[Tensor] | None = None  # outer momentum, from the first outer step

    @property
    def setting(self) -> object:
        """The outer setting a checkpoint records and a resume must match."""
        return self.outer

    @property
    def round(self) -> int:
        """Periods completed (one round is launched at the end of each)."""
        return self.count // self.local_steps

    def take(self) -> None:  # type: ignore[override]
        """Before a step's update: at the end of a period, mix the round that travelled in."""
        self.check_free("step()")
        if self.anchor is None:
            self.anchor = [b.clone() for b in self._flat.buffers]
        if (self.count + 1) % self.local_steps == 0:
            self._mix_in(self.count + 1)
        return None

    def launch(self) -> None:
        """Count a completed step; at the end of a period take the outer step and send."""
        self.count += 1
        if self.count % self.local_steps:
            return
        assert self.anchor is not None  # take() ran first
        with torch.no_grad():
            if self.outer is None:
                for x, a in zip(self._flat.buffers, self.anchor):
                    a.copy_(x)
            else:
                old: list[Tensor | None] = [None] * len(self.anchor)
                if self.momentum is not None:
                    old = list(self.momentum)
                bufs = [
                    self._outer_step(x, a, b)
                    for x, a, b in zip(self._flat.buffers, self.anchor, old)
                ]
                self.momentum = [b for b in bufs if b is not None] or None
        self._launch_round()
        if self.outer is not None:
            # waited for now, not overlapped with the next period: starting a period from the
            # unmixed outer step, which DiLoCo's rates amplify about 7x, trained far worse
            # (+23% against DiLoCo's +0.8% in the time-to-quality benchmark; docs/algorithms)
            self._mix_in(self.count)

    def synchronize(self) -> None:
        """Mix the round in flight now instead of at the end of the period."""
        self.check_free("synchronize()")
        self._mix_in(self.count)

    def wait(self, *, check_writes: bool = True) -> None:
        """Complete the transfers of the round in flight (the anchors) without mixing it."""
        if self._pending is not None:
            self._pending.wait()

    def readopt(self, owner: str) -> None:
        """Take back moved parameters; the anchors stay where they are, so no new device.

        No round to settle first: the anchors travel, never the parameters.
        """
        if self._flat.moved():
            self._flat.readopt(owner)
        if self.anchor is not None:
            for a, x in zip(self.anchor, self._flat.buffers):
                if (a.device, a.dtype) != (x.device, x.dtype):
                    raise RuntimeError(
                        f"{owner} with local_steps: parameters moved to {x.device} / {x.dtype} "
                        f"after the first step, but the outer parameters are on {a.device} / "
                        f"{a.dtype}. Move the model before building the optimizer, or save a "
                        "checkpoint and build a new optimizer after moving"
                    )

    def record_versions(self) -> None:
        """Nothing to guard: the parameters never travel, the anchors are written by no one."""
        self._versions = None

    def reset(self, count: int, in_flight: bool) -> None:
        """Continue from a checkpoint; the anchors come from it too (:func:`restore`), else from
        the parameters at the next step."""
        super().reset(count, in_flight)
        self.anchor = self.momentum = None

    def _mix_in(self, after: int) -> None:
        # after: the count at the end of this step (live membership's resume round)
        if self._relaunch:  # a checkpoint saved with the round in flight: send it again
            self._relaunch = False
            self._pending = self._start()
        handle, self._pending, self._sent = self._pending, None, False
        if handle is None or not self._arrived(handle, after):
            return
        assert self.anchor is not None
        with torch.no_grad():
            # x - a is the local progress of the period; the mixed anchor gets it back
            for x, a in zip(self._flat.buffers, self.anchor):
                x.sub_(a)
            handle.wait_and_mix_()
            for x, a in zip(self._flat.buffers, self.anchor):
                x.add_(a)

    def _outer_step(self, x: Tensor, a: Tensor, buf: Tensor | None) -> Tensor | None:
        """The outer step on the anchor ``a`` (:func:`sgd_outer_step`); returns the buffer."""
        outer = self.outer
        assert outer is not None
        return sgd_outer_step(a, x, buf, outer.lr, outer.momentum, outer.nesterov)

    def _start(self) -> GossipHandle | None:
        # the round of period count // H, launched at its start (also when launched again)
        start = self.count - self.count % self.local_steps
        every = self._every
        global_average = every is not None and start % every == 0
        assert self.anchor is not None
        handle = self.gossip.start(
            self.anchor, start // self.local_steps, global_average=global_average
        )
        return None if handle.is_noop else handle
