r"""Local steps for workers of uneven speed: a period ends when the neighbours' round is in.

With ``local_steps=H`` every rank launches round :math:`k` after its :math:`kH`-th step and mixes
it in :math:`H` steps later, waiting for it if it has not arrived: a rank half as fast as the
others makes all of them wait half the time. Here (``uneven=True``) a rank mixes a round only
once it has arrived, and goes on taking local steps until then:

* a rank launches its next round right after mixing the last one, once it has taken at least
  its period :math:`m_i` steps since it launched that one (:math:`H`, or fewer: below);
* from the :math:`m_i`-th step after a launch, before each step's update, it asks whether the
  round has arrived (no waiting) and, if so, mixes it in, :math:`x_i \leftarrow x_i + \sum_j
  w_{ij} a_j - a_i`, as step-locked local steps do
  (:mod:`~decent_optim.optim.local_steps`).

So every rank takes part in every round, in the same order, and nobody waits for anybody except
for the transfer itself: the faster ranks fill a period with more steps of their own. When every
round arrives in time the schedule is step-locked local steps' step for step, bit for bit.

**The mean.** The mix keeps :math:`\frac1n \sum_i x_i` (doubly stochastic mixing), and each rank
adds its own local progress to it: a rank that took twice the steps moves the mean twice as
far, as its samples count twice in DDP's average. So a plain average is the right weighting (no
push-sum weights), as every period starts from the mixed anchors; local drift stays, as with
any local steps.

**Progress and the budget** come from a sum of the ranks' step counts launched with each round
and read when it is mixed, so every rank learns the same total at the same round; the counters
they keep are a part of their own, :class:`~decent_optim.optim.uneven_periods.Clock`.

**A cap on drift.** With ``uneven=Uneven(cap=c)`` a rank takes at most :math:`cH` steps
after launching a round; at the :math:`cH`-th it waits for the round. A rank many times faster
than its slowest neighbour would otherwise drift through as many steps of its own per period.

**Shorter periods for slow ranks** (``Uneven(adaptive=True)``, the default): a rank that took
fewer steps than the mean in the last period takes fewer before its next launch
(:mod:`~decent_optim.optim.uneven_periods`).

**Asking without waiting** (how long a rank waits: :mod:`~decent_optim.optim.poll`). Each
round's transfers are waited for in a thread of their own, bounded by the optimizer's
``timeout``: a neighbour that died or stopped calling ``step()`` raises
:class:`~decent_optim.gossip.GossipError` at the next step.
The step counts are summed point to point (:mod:`~decent_optim.gossip.sums`), never by a
collective that a rank at another round could match; the package's own collectives compare
:attr:`UnevenPeriods.round` first (:meth:`~UnevenPeriods.check_round`).

**The loop** ranks of uneven speed must write, and the checks that refuse others:
:mod:`~decent_optim.optim.uneven_periods`.

The part of :class:`~decent_optim.optim.rounds.Rounds` that says when: :class:`UnevenPeriods`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from decent_optim.gossip import GossipHandle
from decent_optim.optim.poll import Poll
from decent_optim.optim.uneven_periods import HINT, LOOP, Clock, check_same_round

if TYPE_CHECKING:
    from decent_optim.optim.rounds import Rounds

__all__ = ["UnevenPeriods"]


class UnevenPeriods:
    """The periods of the module docstring, of at least ``local_steps`` steps, at most
    ``cap * local_steps`` (None: no cap), with ``adaptive`` shorter periods for slow ranks."""

    hint: str | None = HINT

    def __init__(self, local_steps: int, cap: float | None, adaptive: bool) -> None:
        self.local_steps = local_steps
        #: progress, budget and periods, from the rounds' sums of step counts (it owns them)
        self.clock = Clock(local_steps, adaptive)
        self.poll = Poll(None if cap is None else max(local_steps, int(cap * local_steps)))
        self.launched = 0  # rounds launched; round k is launched k-th
        self.mixed = 0  # rounds mixed
        self.since = 0  # steps since the last launch (since the start before the first)
        self._sum: tuple[GossipHandle, torch.Tensor, int] | None = None  # (handle, sum, count)
        self._due = False  # this step mixed a round that calls for the slow step (optim.outer)
        # a newcomer before its first mixed round: its source's summed steps at the last one,
        # where the slow step's rule stands for the members
        self._joined: float | None = None
        self._resend_count = 0  # this rank's count when it launched a round resent at a resume

    def progress(self, rounds: Rounds) -> float:
        """DDP-equivalent steps so far: the ranks' mean step count at the last mixed round, plus
        this rank's steps since it launched that round (its own count before any)."""
        return self.clock.progress(rounds.count, rounds.gossip.world_size)

    def round(self, rounds: Rounds) -> int:
        """Rounds mixed: every rank mixes round k as its k-th, at its own step."""
        return self.mixed

    def stopped(self, rounds: Rounds) -> bool:
        """Whether the budget was reached at a mixed round (the same round on every rank)."""
        return self.clock.stopped

    def stop_at(self, rounds: Rounds, steps: float) -> None:
        """Stop at the first mixed round whose DDP-equivalent progress reaches ``steps``; after
        a stop, a larger budget goes on (every rank must call it alike)."""
        self.clock.stop_at(steps, rounds.gossip.world_size)

    def check_round(self, rounds: Rounds, what: str) -> None:
        """Raise the same error on every rank if they call the collective ``what`` at
        different rounds (:func:`~decent_optim.optim.uneven_periods.check_same_round`)."""
        check_same_round(rounds.gossip, self.mixed, what)

    def check_step(self, rounds: Rounds) -> None:
        if self.clock.budget is None:
            raise RuntimeError(
                "step() with uneven=True before opt.stop_at(...): the ranks take different "
                "numbers of steps, so a loop of `for step in range(N)` would end on some ranks "
                f"while the others wait for their rounds. Write {LOOP}"
            )
        if self.clock.stopped:
            raise RuntimeError(
                f"step() after the budget of {self.clock.budget:g} steps was reached (at round "
                f"{self.mixed}, progress {self.progress(rounds):.1f}); every rank stopped at that "
                "round. End the loop on `opt.stopped`"
            )

    def take(self, rounds: Rounds) -> None:
        """Before a step's update: mix the round in flight if it has arrived (no waiting); note
        whether the round mixed (if any) calls for the slow step (:mod:`~decent_optim.optim.outer`)."""
        self._due = False
        resent = self._resend(rounds)
        # a round resent at a resume is waited for where it was due: every rank resent it
        # together, and the resumed run then mixes where the saved one would have
        if rounds._sent and self.since >= self.clock.period - 1:
            if resent or self.poll.ready(self.since):
                self._settle(rounds)
        return None

    def slow_due(self, rounds: Rounds) -> bool:
        due, self._due = self._due, False
        return due

    def launches(self, rounds: Rounds) -> bool:
        """A round once the last one is mixed and at least the period's steps were taken since
        it was launched."""
        self.since += 1
        return not (self.clock.stopped or rounds._sent or self.since < self.clock.period)

    def send(self, rounds: Rounds) -> None:
        self.launched += 1
        self.since = 0
        self.clock.launched()
        self._send(rounds, rounds.count)

    def next_round(self, rounds: Rounds) -> tuple[int, int | None]:
        return self.launched, None

    def synchronize(self, rounds: Rounds) -> None:
        """Mix the round in flight now (waiting for it), instead of when it arrives; the slow
        step at once if that round calls for it."""
        self._resend(rounds)
        if rounds._sent:
            self._settle(rounds)
        if self.slow_due(rounds):
            rounds.end.slow_step(rounds._flat.buffers)

    def wait(self, rounds: Rounds, check_writes: bool) -> None:
        self.poll.join()

    def reset(self, rounds: Rounds) -> None:
        """Continue from a checkpoint as from a fresh start (no round mixed); :meth:`load`
        then restores where the periods stood."""
        self.poll.join()
        if self._sum is not None:
            self._sum[0].discard()
        self._sum, self._joined = None, None
        self.poll.forget()
        self.launched = self.mixed = self.since = 0
        self.clock.restart()

    def regrouped(self, rounds: Rounds, before: int) -> None:
        """After live membership rebuilt the group (:meth:`Live.failed
        <decent_optim.optim.live.Live.failed>`): the round in flight and its sum dropped, stand
        at round ``live.resume``, the progress carried over from the old group of ``before``
        ranks, the periods restarted."""
        assert rounds.live is not None
        self._sum, rounds._sent, rounds._relaunch = None, False, False
        self.poll.forget()
        self.launched = self.mixed = rounds.live.resume
        self.clock.carry(before, rounds.gossip.world_size)
        self.clock.restart_periods()

    def mark(self, rounds: Rounds) -> int:
        """What a newcomer takes of this source's clock: the ranks' summed steps at the last
        mixed round (whole steps: all the slow step's rule reads; -1: none yet)."""
        total = self.clock.total if self.clock.total is not None else self._joined
        return -1 if total is None else int(total)

    def enter(self, rounds: Rounds, resume: int, mark: int) -> None:
        """A newcomer's rounds after its state arrived: at round ``resume``, the next launched
        at the end of its first step; its first mixed round takes the slow step where the
        members' does (``mark``: the source's :meth:`mark`)."""
        self._joined = None if mark < 0 else float(mark)
        self.launched = self.mixed = resume
        self.since = self.local_steps
        self.clock.restart_periods()

    def state(self, rounds: Rounds) -> dict[str, object]:
        """What a checkpoint keeps besides the anchors (see local_checkpoint)."""
        clock = self.clock.state()
        return {
            "launched": self.launched,
            "mixed": self.mixed,
            "since": self.since,
            "total": clock["total"],
            "count_at_launch": clock["count_at_launch"],
            "sum_count": None if self._sum is None else self._sum[2],
            "offset": clock["offset"],
            "world_size": rounds.gossip.world_size,
            "period": clock["period"],
        }

    def load(self, rounds: Rounds, state: dict[str, object]) -> None:
        """Take back :meth:`state` (after :meth:`reset`). Saved by a world of another size (a
        resize by ``checkpoint.load``), the round in flight is dropped (the resize leaves none
        pending) and the progress carries over (:meth:`Clock.carry
        <decent_optim.optim.uneven_periods.Clock.carry>`)."""
        self.launched, self.mixed = int(state["launched"]), int(state["mixed"])  # type: ignore[call-overload]
        self.since = int(state["since"])  # type: ignore[call-overload]
        self.clock.load(state)
        sent = state["sum_count"]
        self._resend_count = rounds.count if sent is None else int(sent)  # type: ignore[call-overload]
        if not rounds.in_flight:  # a resize dropped the round in flight: it is launched anew
            self.launched = self.mixed
        world = rounds.gossip.world_size
        saved = int(state.get("world_size") or world)  # type: ignore[call-overload]
        if saved != world and self.clock.total is not None:
            self.clock.carry(saved, world)
            self.clock.restart_periods()  # old speeds say nothing of the new world
        self.clock.check(world)

    # -- internals -------------------------------------------------------------------------------
    def _resend(self, rounds: Rounds) -> bool:
        """Resumed with the round in flight: send it again at once (every rank resumes alike)."""
        resent, rounds._relaunch = rounds._relaunch, False
        if resent:
            self._send(rounds, self._resend_count)
        return resent

    def _send(self, rounds: Rounds, count: int) -> None:
        """Launch round :attr:`launched` with the anchors, and the sum of the step counts
        (``count``: this rank's steps when it launched the round)."""
        values = torch.tensor([self.clock.sent(count)], dtype=torch.float64)
        what = f"the step counts of round {self.launched}"
        try:
            if rounds.live is not None:
                rounds.live.asked()  # a change asked for (a newcomer): rebuild first
            rounds._pending = rounds.start()
            self._sum = (rounds.gossip.sum_async(values, what, HINT), values, count)
        except RuntimeError as err:  # a change asked for, or a dead peer's error from a send
            return self._failed(rounds, err)
        rounds._sent = True
        handles = [h for h in (rounds._pending, self._sum[0]) if h is not None and not h.is_noop]
        self.poll.watch(handles)

    def _settle(self, rounds: Rounds) -> None:
        """Mix the round in (waiting at most the timeout), then its summed step counts."""
        error = self.poll.finish()
        if error is not None:  # dropped and rebuilt with membership=, else raised
            return self._failed(rounds, error)
        rounds.mix_in(rounds.count)
        self.mixed += 1
        world, before = rounds.gossip.world_size, self.clock.total
        if self._sum is not None:
            handle, values, count = self._sum
            handle.wait_and_mix_()
            self.clock.mixed(float(values.item()), count, world)
            self._sum = None
        else:
            self.clock.check(world)
        if before is None:
            before, self._joined = self._joined, None
        # the slow step when this round's sum crossed a multiple of every (optim.outer)
        self._due = rounds.end.crossed(before, self.clock.total, world)

    def _failed(self, rounds: Rounds, error: BaseException) -> None:
        """A round ended in ``error``: live membership rebuilds (:meth:`regrouped` after),
        else it is raised."""
        if rounds.live is None:
            raise error
        rounds.live.failed(rounds, error)
