r"""The clock of uneven ranks: what the rounds' summed step counts tell a rank (:class:`Clock`),
and the loop they must write.

It owns the counters of :mod:`~decent_optim.optim.uneven`'s rounds that come from the sums of
step counts: the ranks' summed steps :math:`S_k` at the last mixed round, this rank's count when
it launched it, the offset a resume at another world size adds, the budget, and the period of
steps before the next launch.

**Progress and the budget.** With each round every rank also launches a sum of the ranks' step
counts (no waiting), read when the round is mixed: every rank learns the same total
:math:`S_k` at the same round. The progress
(:meth:`~decent_optim.optim.uneven.UnevenPeriods.progress`) is :math:`S_k / n` plus the rank's
own steps since it launched round :math:`k` (DDP-equivalent steps, for learning-rate
schedules); after :meth:`~decent_optim.optim.uneven.UnevenPeriods.stop_at` every rank stops after
the step that mixes the first round with :math:`S_k / n + H` at the budget or beyond -- the same
round on every rank, so none waits for a round that no one will send, and a run ends at most a
period past its budget. A checkpoint keeps these counters
(:meth:`~decent_optim.optim.uneven.UnevenPeriods.state`); loaded by another number of
ranks, the progress goes on (:meth:`Clock.carry`).

**Shorter periods for slow ranks**: a rank slower than the mean launches its rounds after fewer
steps.

In :mod:`~decent_optim.optim.uneven` a rank mixes a round once it has arrived and it has taken
its period of steps since launching it. With a period of :math:`H` steps on every rank, a
period lasts as long as the slowest rank needs for its :math:`H`: with one rank at a quarter
speed, every other rank takes :math:`4H` steps between mixes, and drifts as far. With
``Uneven(adaptive=True)`` (the default) a rank that took :math:`c_i` steps between launching
rounds :math:`k-1` and :math:`k`, where the ranks took :math:`\bar c = (S_k - S_{k-1}) / n` on
average (:math:`S_k`: their summed step counts at launching round :math:`k`), takes

.. math::
    m_i = \min\left(H, \max\left(1, \left\lfloor H c_i / \bar c + \tfrac12 \right\rfloor\right)\right)

steps before it launches a round, from the launch after it mixed round :math:`k` on. A period
then lasts about :math:`H` steps of an average rank instead of :math:`H` of the slowest: at a
quarter speed the slow rank takes one step per period and the others about four. Every number
comes from the rounds' sums, so where the rounds arrive as before the periods are as before;
on even hardware every :math:`c_i = \bar c = H`, so :math:`m_i = H`.

**The loop.** The ranks take different numbers of steps, so everything that every rank must do
at the same point -- stop, evaluate, save, call a collective -- goes at a *round*
(``opt.round``), never at a step count. :data:`LOOP` is that loop in words, for the errors that
refuse other loops; :data:`HINT` is what a failed round says usually causes it in this mode;
:func:`check_same_round` compares the ranks' rounds before a collective, so that one called at
different rounds is an error on every rank instead of a collective matched with the wrong one
(or a hang).
"""

from __future__ import annotations

from typing import Any

from decent_optim.gossip.collectives import comm_device
from decent_optim.optim.agreement import Account, agree

__all__ = ["HINT", "LOOP", "Clock", "check_same_round", "next_period"]

#: the loop uneven ranks need, for the errors that send users to it
LOOP = (
    "opt.stop_at(total_steps) before the loop, then `while not opt.stopped: ... opt.step()`, "
    "with collectives (opt.averaged(), checkpoints) at rounds: `if opt.round % k == 0 and "
    "opt.round != last:` (see docs/uneven_hardware)"
)

#: what usually stops a neighbour's rounds in this mode (GossipError's hint)
HINT = (
    "With uneven=True a peer also stops sending rounds when it left its training loop before "
    "opt.stopped turned true (a `for step in range(N)` loop: ranks take different numbers of "
    "steps, an early `break`), stopped at another budget, or waits in a collective that it "
    "called at another round. Every rank needs the same loop: " + LOOP
)


def check_same_round(gossip: Any, round: int, what: str) -> None:
    """Raise the same :class:`~decent_optim.optim.agreement.AgreementError` on every rank of
    ``gossip``'s group if they reached the collective ``what`` at different rounds (one small
    all-gather, bounded by the gossip's timeout; nothing in a world of one)."""
    group = getattr(gossip, "group", None)
    if group is None:
        return
    account = Account(settings=[("the round", f"opt.round {round}")])
    hint = (
        "With uneven=True ranks reach the same step count at different rounds, so "
        f"collectives go at rounds, not at step counts (`t % k == 0`): {LOOP}"
    )
    timeout = getattr(gossip, "timeout", None)
    agree(account, group, comm_device(group), what, hints={"the round": hint}, timeout=timeout)


def next_period(local_steps: int, summed: float, world_size: int, own: int) -> int:
    """:math:`m_i` of the module docstring: ``summed`` = :math:`S_k - S_{k-1}`, ``own`` =
    :math:`c_i`; ``local_steps`` when there is nothing to compare with."""
    mean = summed / world_size
    if own <= 0 or not mean > 0:
        return local_steps
    return min(local_steps, max(1, int(local_steps * own / mean + 0.5)))


class Clock:
    """The counters of the module docstring, for ``local_steps`` steps a period and, with
    ``adaptive``, shorter periods for slow ranks (:func:`next_period`)."""

    def __init__(self, local_steps: int, adaptive: bool) -> None:
        self.local_steps, self.adaptive = local_steps, adaptive
        self.budget: float | None = None  # of stop_at, in DDP-equivalent steps
        self.restart()

    def restart(self) -> None:
        """As at a fresh start (no round mixed); the budget stays."""
        self.total: float | None = None  # the ranks' summed steps at the last mixed round
        self.count_at_launch = 0  # this rank's steps when it launched the last mixed round
        # added to the count this rank sends with a round: the progress its steps before a
        # resume at another world size stand for (0 otherwise; see carry)
        self.offset = 0.0
        self.stopped = False
        self.restart_periods()

    def restart_periods(self) -> None:
        """``local_steps`` again: old speeds say nothing of a new group."""
        #: the steps this rank takes before it launches its next round
        self.period = self.next = self.local_steps

    def progress(self, count: int, world: int) -> float:
        """DDP-equivalent steps at this rank's ``count``: :math:`S_k / n` plus its steps since
        it launched round :math:`k` (its own count before any round was mixed)."""
        if self.total is None:
            return float(count)
        return self.total / world + (count - self.count_at_launch)

    def sent(self, count: int) -> float:
        """What this rank adds to the sum of a round it launches at ``count`` steps."""
        return float(count) + self.offset

    def launched(self) -> None:
        """A round was launched: the period from now on is the one computed at the last mix."""
        self.period = self.next

    def mixed(self, total: float, count: int, world: int) -> None:
        """A round's sum arrived: ``total``, for the round this rank launched at ``count``."""
        if self.adaptive and self.total is not None:
            self.next = next_period(
                self.local_steps, total - self.total, world, count - self.count_at_launch
            )
        self.total, self.count_at_launch = total, count
        self.check(world)

    def carry(self, before: int, world: int) -> None:
        r"""From a group of ``before`` ranks to one of ``world`` (a resize, a change of live
        membership): the total :math:`S_k` of the last mixed round becomes
        :math:`n S_k / n_{old}`, so the progress, :math:`S_k / n_{old} + c - c_k`, is what it
        was, and the rank sends :math:`c + S_k / n_{old} - c_k` with its rounds instead of its
        count :math:`c` (:attr:`offset`): the first round mixed in the new group sums to
        :math:`n S_k / n_{old}` plus every rank's steps since, and the progress goes on without
        a jump."""
        if self.total is not None:
            progress = self.total / before
            self.total = progress * world
            self.offset = progress - self.count_at_launch

    def stop_at(self, steps: float, world: int) -> None:
        """Set the budget; after a stop, a larger budget goes on."""
        self.budget, self.stopped = float(steps), False
        self.check(world)

    def check(self, world: int) -> None:
        """Stop when :math:`S_k / n + H` reaches the budget: by the end of the step that mixes
        round :math:`k` every rank has taken at least ``local_steps`` steps since launching it,
        so the same number on every rank."""
        if self.budget is None or self.total is None:
            return
        if self.total / world + self.local_steps >= self.budget:
            self.stopped = True

    def state(self) -> dict[str, object]:
        """The counters a checkpoint keeps (of :meth:`UnevenPeriods.state
        <decent_optim.optim.uneven.UnevenPeriods.state>`)."""
        return {
            "total": self.total,
            "count_at_launch": self.count_at_launch,
            "offset": self.offset,
            "period": [self.period, self.next],
        }

    def load(self, state: dict[str, object]) -> None:
        """Take back :meth:`state` (entries absent from older checkpoints: their defaults)."""
        get = state.get
        self.total = None if state["total"] is None else float(state["total"])  # type: ignore[arg-type]
        self.count_at_launch = int(state["count_at_launch"])  # type: ignore[call-overload]
        self.offset = float(get("offset", 0.0))  # type: ignore[arg-type]
        self.period, self.next = (int(m) for m in get("period", [self.local_steps] * 2))  # type: ignore[attr-defined]
