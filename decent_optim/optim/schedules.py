"""Which schedule of rounds an optimizer runs, from its keywords: the parts of its rounds.

One :class:`~decent_optim.optim.rounds.Rounds` runs every schedule; :func:`make_rounds` chooses
its parts (listed there), one line each: when (step-locked on a cadence of ``local_steps=``, or
uneven periods), what travels (the parameters in place for every-step gossip without ``outer``,
else the anchors), and the period end of ``outer=``. The keywords are checked here, before
anything is built, with an error that says what to pass.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from decent_optim.flat import FlatParams
from decent_optim.gossip import Gossiper, LocalGossiper
from decent_optim.optim.local_steps import Periods, StepLocked
from decent_optim.optim.outer import AnchorOuter, LocalOuterSGD, OuterSGD, PeriodEnd, SlowOuter
from decent_optim.optim.rounds import Rounds
from decent_optim.optim.travel import Anchors, InPlace
from decent_optim.optim.uneven import UnevenPeriods

__all__ = ["EVERY_STEP", "Schedule", "Uneven", "check", "make_rounds"]

_NAMED = {"diloco": OuterSGD(0.7, 0.9, True)}


@dataclass(frozen=True)
class Uneven:
    """The setting of ``uneven=``: ``uneven=True`` is ``Uneven()``.

    ``cap``: a rank takes at most ``cap * local_steps`` steps between launching a round and
    mixing it; at the last of them it waits for the round (None: never waits). It bounds how
    far the fastest rank drifts from its neighbours within a period when the speeds differ by
    more than ``cap`` times: the cluster then runs at ``cap`` times its slowest rank's pace.

    ``adaptive``: a rank that took fewer steps than the ranks' mean in the last period takes
    proportionally fewer (at least one) before it launches the next round, so that a slow rank
    does not stretch every period to ``local_steps`` of its own slow steps while the others drift
    (:mod:`~decent_optim.optim.uneven`). On even hardware it changes nothing.
    """

    cap: float | None = 8
    adaptive: bool = True

    def __post_init__(self) -> None:
        cap = self.cap
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not cap >= 1:
                raise ValueError(
                    f"Uneven.cap must be a number >= 1 (periods of at most cap * local_steps "
                    f"steps) or None (no cap), got {cap!r}"
                )
            object.__setattr__(self, "cap", float(cap))
        if not isinstance(self.adaptive, bool):
            raise TypeError(f"Uneven.adaptive must be True or False, got {self.adaptive!r}")


@dataclass(frozen=True)
class Schedule:
    """The validated schedule keywords of an optimizer."""

    local_steps: int = 1
    outer: OuterSGD | LocalOuterSGD | None = None
    uneven: Uneven | None = None
    #: another cadence than every ``local_steps`` steps (``local_steps=`` a Periods)
    periods: Periods | None = None

    def describe(self) -> str:
        """The setting the ranks must agree on, as a string."""
        text = f"{self.periods or self.local_steps}, outer {self.outer!r}"
        return f"{text}, {self.uneven!r}" if self.uneven else text


EVERY_STEP = Schedule()


def check(
    local_steps: object, outer: object, global_avg_every: int | None, uneven: object = False
) -> Schedule:
    """The validated schedule; a clear error for anything else."""
    periods = None
    if isinstance(local_steps, Periods) and type(local_steps) is not Periods:
        periods, local_steps = local_steps, local_steps.local_steps  # another cadence
        if uneven:
            raise ValueError(f"uneven=True takes local_steps=an int, not {periods!r}")
    if isinstance(local_steps, bool) or not isinstance(local_steps, numbers.Integral):
        raise TypeError(
            f"local_steps must be an int (gossip every this many steps), got "
            f"{type(local_steps).__name__} {local_steps!r}"
        )
    local_steps = int(local_steps)
    if local_steps < 1:
        raise ValueError(f"local_steps must be >= 1 (1: gossip every step), got {local_steps}")
    if isinstance(outer, str):
        if outer not in _NAMED:
            raise ValueError(
                f"outer must be None, {sorted(_NAMED)} or a decent_optim.OuterSGD(lr=..., "
                f"momentum=..., nesterov=...), got {outer!r}"
            )
        outer = _NAMED[outer]
    if outer is not None and not isinstance(outer, (OuterSGD, LocalOuterSGD)):
        raise TypeError(
            f"outer must be None, {sorted(_NAMED)}, a decent_optim.OuterSGD or a "
            f"decent_optim.LocalOuterSGD, got {type(outer).__name__}"
        )
    if not isinstance(uneven, (bool, Uneven)):
        raise TypeError(
            f"uneven must be True, False or a decent_optim.Uneven(cap=...), got "
            f"{type(uneven).__name__} {uneven!r}"
        )
    setting = Uneven() if uneven is True else uneven or None
    # uneven ranks count `every` in DDP-equivalent steps, which fall anywhere in a period
    if isinstance(outer, LocalOuterSGD) and not uneven and outer.every % local_steps:
        raise ValueError(
            f"LocalOuterSGD(every={outer.every}) must be a multiple of local_steps={local_steps}: "
            "the outer step is taken at the end of a period; pass every="
            f"{max(1, round(outer.every / local_steps)) * local_steps}"
        )
    if global_avg_every is not None and global_avg_every % local_steps:
        raise ValueError(
            f"global_avg_every={global_avg_every} must be a multiple of local_steps="
            f"{local_steps}: the global average replaces one of the rounds, which are launched "
            "every local_steps steps"
        )
    if uneven and isinstance(outer, OuterSGD):
        raise ValueError(
            'uneven=True does not take outer="diloco" or an OuterSGD: the outer step\'s round '
            "would make the ranks wait for the slowest; pass outer=decent_optim.LocalOuterSGD() "
            "(an outer step on each rank's own slow weights, no round of its own) or outer=None"
        )
    if uneven and global_avg_every is not None:
        raise ValueError(
            "uneven=True does not take global_avg_every=: a global average makes every rank "
            "wait for the slowest, which uneven=True exists to avoid; pass global_avg_every=None"
        )
    return Schedule(local_steps, outer, setting, periods)


def make_rounds(
    gossip: Gossiper | LocalGossiper,
    flat: FlatParams,
    global_avg_every: int | None,
    schedule: Schedule,
) -> Rounds:
    """The rounds of an optimizer with ``schedule``: its parts (module docstring)."""
    outer, uneven, local_steps = schedule.outer, schedule.uneven, schedule.local_steps
    end = (
        PeriodEnd()
        if outer is None
        else SlowOuter(outer)
        if isinstance(outer, LocalOuterSGD)
        else AnchorOuter(outer)
    )
    when = (
        UnevenPeriods(local_steps, uneven.cap, uneven.adaptive)
        if uneven is not None
        else StepLocked(schedule.periods or Periods(local_steps))
    )
    every_step = local_steps == 1 and outer is None and schedule.periods is None and not uneven
    travel = InPlace(flat) if every_step else Anchors(flat)
    return Rounds(gossip, flat, global_avg_every, when, travel, end)
