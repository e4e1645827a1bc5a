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

This module holds the *when* of these rounds: :class:`Periods`, a cadence every rank computes
from its step count alone, and :class:`StepLocked`, the part of
:class:`~decent_optim.optim.rounds.Rounds` that mixes and launches on it. Every-step gossip is
``Periods(1)`` with the parameters themselves travelling; local steps send the anchors
(:mod:`~decent_optim.optim.travel`), so parameters may be written at any time. What happens at a
period's end (nothing, the outer step on the anchors above, or one on each rank's slow weights)
is a part of its own, :mod:`~decent_optim.optim.outer`, which owns its state. Checkpoints of the
anchors and of that state: :mod:`~decent_optim.optim.local_checkpoint`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decent_optim.gossip import PendingMix
    from decent_optim.optim.rounds import Rounds

__all__ = ["Periods", "StepLocked"]


@dataclass(frozen=True)
class Periods:
    """When the periods of local steps end: every ``local_steps`` steps. Another cadence is a
    subclass passed as ``local_steps=`` (e.g. :mod:`~decent_optim.optim.doubling`); each method
    answers for a step count, the same on every rank."""

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


class StepLocked:
    """The rounds of the module docstring on the cadence ``periods``: in the step that ends a
    period, before the update, the round launched at its start is mixed (waiting for it, as
    every rank steps alike); after the update, a period's end launches the next."""

    hint: str | None = None  # a failed round: the gossip's own hint

    def __init__(self, periods: Periods) -> None:
        self.periods, self.local_steps = periods, periods.local_steps
        self.budget: float | None = None  # of stop_at, in DDP-equivalent steps

    def progress(self, rounds: Rounds) -> float:
        """Every rank steps once per step: DDP-equivalent steps are the step count."""
        return float(rounds.count)

    def round(self, rounds: Rounds) -> int:
        """Periods completed (one round is launched at the end of each)."""
        return self.periods.index(rounds.count)

    def stopped(self, rounds: Rounds) -> bool:
        return self.budget is not None and rounds.count >= self.budget

    def stop_at(self, rounds: Rounds, steps: float) -> None:
        self.budget = float(steps)

    def check_round(self, rounds: Rounds, what: str) -> None:
        """Every rank steps once per step, so a collective at the same step is at the same
        round: nothing to check (uneven periods check)."""

    def check_step(self, rounds: Rounds) -> None:
        pass

    def take(self, rounds: Rounds) -> list[PendingMix] | None:
        if self.periods.ends(rounds.count + 1):
            return rounds.mix_in(rounds.count + 1, deferred=True)
        return None

    def slow_due(self, rounds: Rounds) -> bool:
        n = rounds.gossip.world_size  # step-locked: the ranks' summed steps are n times the count
        return rounds.end.crossed(rounds.count * n, (rounds.count + 1) * n, n)

    def launches(self, rounds: Rounds) -> bool:
        return self.periods.ends(rounds.count)

    def send(self, rounds: Rounds) -> None:
        rounds.launch_round()
        rounds.record_versions()
        if rounds.end.waits and self.periods.ends(rounds.count):
            # waited for now, not overlapped with the next period: starting a period from the
            # unmixed outer step, which DiLoCo's rates amplify about 7x, trained far worse
            # (+23% against DiLoCo's +0.8% in the time-to-quality benchmark; docs/algorithms)
            rounds.mix_in(rounds.count)

    def next_round(self, rounds: Rounds) -> tuple[int, int | None]:
        """The round of the period holding the count, launched at its start (also when
        launched again after a resume)."""
        start = self.periods.start(rounds.count)
        return self.periods.index(start), start

    def synchronize(self, rounds: Rounds) -> None:
        # with the parameters in place a failed round raises here, as in the other collectives
        # of live membership; the anchors' round is dropped as in a step
        rounds.mix_in(rounds.count if rounds.travel.anchored else None)

    def wait(self, rounds: Rounds, check_writes: bool) -> None:
        rounds.transfers(check_writes)

    def reset(self, rounds: Rounds) -> None:
        pass

    def mark(self, rounds: Rounds) -> int:
        return -1  # the count says everything

    def enter(self, rounds: Rounds, resume: int, mark: int) -> None:
        """A newcomer's first round: the one the members launch now, if they do (live
        membership decides); mixed at once where the period end waits for it (DiLoCo), as the
        members did in the step that took the newcomer in."""
        self.send(rounds)

    def regrouped(self, rounds: Rounds, before: int) -> None:
        """Nothing to do: the next launch is on the new group."""

    def state(self, rounds: Rounds) -> dict[str, object] | None:
        return None  # the step count says where the periods stand

    def load(self, rounds: Rounds, state: dict[str, object]) -> None:
        pass
