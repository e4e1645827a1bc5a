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
is never written while its round travels. What happens at a period's end (nothing, the outer
step on the anchors above, or one on each rank's slow weights) is a part of its own,
:mod:`~decent_optim.optim.outer`, which owns its state. Checkpoints of the anchors and of that
state: :mod:`~decent_optim.optim.local_checkpoint`. ``local_steps=1`` without ``outer`` is not this class
but the ordinary :class:`~decent_optim.optim.rounds.Rounds` (every-step gossip, bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from decent_optim.flat import FlatParams
from decent_optim.gossip import Gossiper, GossipHandle, LocalGossiper
from decent_optim.optim.outer import PeriodEnd
from decent_optim.optim.rounds import Rounds

__all__ = ["LocalRounds", "Periods"]


@dataclass(frozen=True)
class Periods:
    """When the periods of local steps end: every ``local_steps`` steps (the cadence part of
    :class:`LocalRounds`). Another cadence is a subclass passed as ``local_steps=``; each
    method answers for a step count, the same on every rank."""

    local_steps: int

    def ends(self, count: int) -> bool:
        """Whether a period ends at ``count`` steps (its round is launched, the last mixed)."""
        return count % self.local_steps == 0

    def start(self, count: int) -> int:
        """The step count at which the period holding ``count`` started."""
        return count - count % self.local_steps

    def index(self, count: int) -> int:
        """Periods completed at ``count`` steps (the index of the round launched then)."""
        return count // self.local_steps


class LocalRounds(Rounds):
    """The rounds of the module docstring: one every ``local_steps`` steps, carrying the anchors,
    and ``end`` (:mod:`~decent_optim.optim.outer`) at the end of each period."""

    def __init__(
        self,
        gossip: Gossiper | LocalGossiper,
        flat: FlatParams,
        global_avg_every: int | None,
        local_steps: int,
        end: PeriodEnd,
        periods: Periods | None = None,
    ) -> None:
        super().__init__(gossip, flat, global_avg_every)
        self.local_steps, self.end = local_steps, end
        self.periods = periods or Periods(local_steps)
        # taken from the parameters at the first step (not at construction: the model may still
        # be loaded between building the optimizer and stepping)
        self.anchor: list[Tensor] | None = None

    @property
    def setting(self) -> object:
        """The outer setting a checkpoint records and a resume must match."""
        return self.end.setting

    def saved(self) -> dict[str, list[Tensor] | None]:
        """What a checkpoint keeps besides the parameters, one flat per bucket (None: not
        taken yet), by its key (:mod:`~decent_optim.optim.local_checkpoint`)."""
        return {"anchor": self.anchor, **self.end.state()}

    def load_saved(self, key: str, flats: list[Tensor]) -> None:
        """Take back one entry of :meth:`saved`."""
        if key == "anchor":
            self.anchor = flats
        else:
            self.end.load(key, flats)

    @property
    def round(self) -> int:
        """Periods completed (one round is launched at the end of each)."""
        return self.periods.index(self.count)

    def take(self) -> None:  # type: ignore[override]
        """Before a step's update: at the end of a period, mix the round that travelled in."""
        self.check_free("step()")
        if self.anchor is None:
            self.anchor = [b.clone() for b in self._flat.buffers]
        if self.periods.ends(self.count + 1):
            self._mix_in(self.count + 1)
        self.end.start(self._flat.buffers)
        return None

    def launch(self) -> None:
        """Count a completed step; the slow step when due; at a period's end the period end's
        step and the round."""
        n = self.gossip.world_size  # step-locked: the ranks' summed steps are n times the count
        if self.end.crossed(self.count * n, (self.count + 1) * n, n):
            self.end.slow_step(self._flat.buffers)
        self.count += 1
        if not self.periods.ends(self.count):
            return
        assert self.anchor is not None  # take() ran first
        self.end.anchor_step(self._flat.buffers, self.anchor)
        self._launch_round()
        if self.end.waits:
            # waited for now, not overlapped with the next period: starting a period from the
            # unmixed outer step, which DiLoCo's rates amplify about 7x, trained far worse
            # (+23% against DiLoCo's +0.8% in the time-to-quality benchmark; docs/algorithms)
            self._mix_in(self.count)

    def enter(self, resume: int) -> None:
        """A newcomer's first round; where the period end waits for it (DiLoCo), mixed at once,
        as the members did in the step that took the newcomer in."""
        super().enter(resume)
        if self.end.waits and self.periods.ends(self.count):
            self._mix_in(self.count)

    def join(self, count: int, resume: int) -> None:
        """A newcomer's rounds: what it sends is what it holds (the anchors not received)."""
        if self.anchor is None:
            self.anchor = [b.clone() for b in self._flat.buffers]
        super().join(count, resume)

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
        self.anchor = None
        self.end.reset()

    def _mix_in(self, after: int) -> None:
        # after: the count at the end of this step (live membership's resume round)
        handle = self._taken()
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

    def _start(self) -> GossipHandle | None:
        # the round of period count // H, launched at its start (also when launched again)
        start = self.periods.start(self.count)
        every = self._every
        global_average = every is not None and start % every == 0
        assert self.anchor is not None
        handle = self.gossip.start(
            self.anchor, self.periods.index(start), global_average=global_average
        )
        return None if handle.is_noop else handle
