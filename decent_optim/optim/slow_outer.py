r"""Local steps with an outer Nesterov step that each rank takes on its own slow weights.

``local_steps=H, outer=LocalOuterSGD(lr=eta, momentum=mu, every=K)``: the rounds are those of
plain local steps (:mod:`~decent_optim.optim.local_steps`: the anchors travel during the whole
next period and nobody waits), and every ``K`` steps (a multiple of ``H``) rank :math:`i` also
takes torch.optim.SGD's momentum step on its *slow weights* :math:`\theta_i`, with the
pseudo-gradient of the last ``K`` steps, before the period's anchor is taken:

.. math::
    \Delta_i = \theta_i - x_i, \qquad b_i \leftarrow \mu b_i + \Delta_i, \qquad
    \theta_i \leftarrow \theta_i - \eta (\Delta_i + \mu b_i) \ \text{(Nesterov; else }
    \eta b_i), \qquad x_i \leftarrow \theta_i .

The outer step needs no round of its own, so it costs no waiting: it is the step-:math:`K`
Nesterov outer optimizer (SNOO, Kallusky et al. 2025) of each rank's own model, while the
local steps' rounds keep the models, and so the :math:`\Delta_i`, close. (DiLoCo over gossip,
``outer=OuterSGD``, instead steps the anchors and waits for their round.) The :math:`\theta_i`
start as the parameters at the first step. Checkpoints save them and their momentum with the
anchors (:mod:`~decent_optim.optim.local_checkpoint`).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from decent_optim.flat import FlatParams
from decent_optim.gossip import Gossiper, LocalGossiper
from decent_optim.optim.local_steps import LocalRounds, check_outer_rates, sgd_outer_step

__all__ = ["LocalOuterSGD", "SlowOuterRounds", "SlowWeights"]


@dataclass(frozen=True)
class LocalOuterSGD:
    """The outer step of ``outer=LocalOuterSGD(...)``: each rank's own, every ``every`` steps.

    The defaults are the measured recommendation for ``local_steps=4`` (docs: "Fewer steps: an
    outer step on each rank's slow weights"): outer lr 0.5, Nesterov momentum 0.7, every 32
    steps. ``every`` must be a multiple of ``local_steps``, except with ``uneven=True``, where
    it counts DDP-equivalent steps (:mod:`~decent_optim.optim.uneven_outer`). With
    ``local_steps=2, uneven=True`` at 16 workers, ``every=16, lr=0.7, momentum=0.5`` was
    measured best (docs: "The outer step at sixteen workers"); the defaults overshoot there.
    """

    lr: float = 0.5
    momentum: float = 0.7
    every: int = 32
    nesterov: bool = True

    def __post_init__(self) -> None:
        check_outer_rates("LocalOuterSGD", self.lr, self.momentum, self.nesterov)
        if self.momentum >= 1:
            raise ValueError(f"LocalOuterSGD.momentum must be < 1, got {self.momentum!r}")
        every = self.every
        if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1:
            raise ValueError(
                f"LocalOuterSGD.every must be an int >= 1 (steps between outer steps), got "
                f"{self.every!r}"
            )
        # plain numbers (numpy's too), so that the setting a checkpoint records reads alike
        object.__setattr__(self, "every", int(every))
        object.__setattr__(self, "lr", float(self.lr))
        object.__setattr__(self, "momentum", float(self.momentum))


class SlowWeights:
    """The slow weights :math:`\theta_i` and their momentum, per bucket, and the outer step on
    them: what the rounds with ``outer=LocalOuterSGD`` add (a mixin; the rounds say when)."""

    #: checkpoint keys -> attributes, added to the rounds' ``SAVED`` (local_checkpoint)
    SAVED_SLOW = {"slow": "slow", "slow_momentum": "slow_momentum"}
    slow_outer: LocalOuterSGD
    slow: list[Tensor] | None = None  # the slow weights, from the first step
    slow_momentum: list[Tensor] | None = None  # from the first outer step

    def start_slow(self, buffers: list[Tensor]) -> None:
        """The slow weights start as the parameters (at the first step, unless restored)."""
        if self.slow is None:
            self.slow = [b.clone() for b in buffers]

    def slow_step(self, buffers: list[Tensor]) -> None:
        """The outer step on every bucket (:func:`sgd_outer_step`), then ``x = theta``."""
        assert self.slow is not None  # start_slow() ran first
        outer = self.slow_outer
        old: list[Tensor | None] = [None] * len(self.slow)
        if self.slow_momentum is not None:
            old = list(self.slow_momentum)
        with torch.no_grad():
            bufs = [
                sgd_outer_step(theta, x, buf, outer.lr, outer.momentum, outer.nesterov)
                for x, theta, buf in zip(buffers, self.slow, old)
            ]
        self.slow_momentum = [b for b in bufs if b is not None] or None


class SlowOuterRounds(SlowWeights, LocalRounds):
    """The rounds of plain local steps, and the slow-weight outer step of the module docstring."""

    SAVED = {**LocalRounds.SAVED, **SlowWeights.SAVED_SLOW}

    def __init__(
        self,
        gossip: Gossiper | LocalGossiper,
        flat: FlatParams,
        global_avg_every: int | None,
        local_steps: int,
        outer: LocalOuterSGD,
    ) -> None:
        super().__init__(gossip, flat, global_avg_every, local_steps, None)  # plain rounds
        self.slow_outer = outer
        self.slow = self.slow_momentum = None

    def take(self) -> None:  # type: ignore[override]
        """As local steps; at the first step the slow weights start as the parameters."""
        super().take()
        self.start_slow(self._flat.buffers)

    def launch(self) -> None:
        """Count a completed step; every ``every`` steps the outer step; at a period's end send."""
        if (self.count + 1) % self.slow_outer.every == 0:
            self.slow_step(self._flat.buffers)
        super().launch()

    @property
    def setting(self) -> LocalOuterSGD:
        return self.slow_outer

    def reset(self, count: int, in_flight: bool) -> None:
        """Continue from a checkpoint; slow weights come from it too, else from the parameters."""
        super().reset(count, in_flight)
        self.slow = self.slow_momentum = None
