r"""Local steps for workers of uneven speed: a period ends when the neighbours' round is in.

With ``local_steps=H`` every rank launches round :math:`k` after its :math:`kH`-th step and mixes
it in :math:`H` steps later, waiting for it if it has not arrived: a rank half as fast as the
others makes all of them wait half the time. Here (``uneven=True``) a rank mixes a round only
once it has arrived, and goes on taking local steps until then:

* a rank launches its next round right after mixing the last one, once it has taken at least
  its period :math:`m_i` steps since it launched that one (:math:`H`, or fewer: below);
* from the :math:`m_i`-th step after a launch, before each step's update, it asks whether the
  round has arrived (no waiting) and, if so, mixes it in, :math:`x_i \leftarrow x_i + \sum_j
  w_{ij} a_j - a_i`, as :class:`~decent_optim.optim.local_steps.LocalRounds` does.

So every rank takes part in every round, in the same order, and nobody waits for anybody except
for the transfer itself: the faster ranks fill a period with more steps of their own. When every
round arrives in time the schedule is :class:`LocalRounds`' step for step, bit for bit.

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

**Asking without waiting.** Each round's transfers are waited for in a thread
(:mod:`~decent_optim.optim.waiter`), bounded by the optimizer's ``timeout``: a neighbour that died
or stopped calling ``step()`` raises :class:`~decent_optim.gossip.GossipError` at the next step.
The step counts are summed point to point (:mod:`~decent_optim.gossip.sums`), never by a
collective that a rank at another round could match; the package's own collectives compare
:attr:`UnevenRounds.round` first (:meth:`check_round`).

**The loop** ranks of uneven speed must write, and the checks that refuse others:
:mod:`~decent_optim.optim.uneven_loop`.
"""

from __future__ import annotations

import torch

from decent_optim.flat import FlatParams
from decent_optim.gossip import Gossiper, GossipHandle, LocalGossiper
from decent_optim.optim.local_steps import LocalRounds
from decent_optim.optim.outer import PeriodEnd
from decent_optim.optim.uneven_loop import HINT, LOOP, check_same_round
from decent_optim.optim.uneven_periods import Clock
from decent_optim.optim.waiter import Waiter

__all__ = ["UnevenRounds"]


class UnevenRounds(LocalRounds):
    """The rounds of the module docstring."""

    def __init__(
        self,
        gossip: Gossiper | LocalGossiper,
        flat: FlatParams,
        local_steps: int,
        cap: float | None = None,
        adaptive: bool = False,
        end: PeriodEnd | None = None,
    ) -> None:
        super().__init__(gossip, flat, None, local_steps, end or PeriodEnd())
        #: progress, budget and periods, from the rounds' sums of step counts (it owns them)
        self.clock = Clock(local_steps, adaptive)
        #: the most steps between launching a round and mixing it (None: no cap)
        self.longest = None if cap is None else max(local_steps, int(cap * local_steps))
        gossip.hint = HINT
        self.launched = 0  # rounds launched; round k is launched k-th
        self.mixed = 0  # rounds mixed
        self.since = 0  # steps since the last launch (since the start before the first)
        self._out = False  # round `launched` is in flight (its handle may be a no-op)
        self._sum: tuple[GossipHandle, torch.Tensor, int] | None = None  # (handle, sum, count)
        self._waiter: Waiter | None = None
        self._due = False  # this step mixed a round that calls for the slow step (optim.outer)

    @property
    def in_flight(self) -> bool:
        return self._out or self._relaunch

    @property
    def progress(self) -> float:
        """DDP-equivalent steps so far: the ranks' mean step count at the last mixed round, plus
        this rank's steps since it launched that round (its own count before any)."""
        return self.clock.progress(self.count, self.gossip.world_size)

    @property
    def round(self) -> int:
        """Rounds mixed: every rank mixes round k as its k-th, at its own step."""
        return self.mixed

    @property
    def stopped(self) -> bool:
        """Whether the budget was reached at a mixed round (the same round on every rank)."""
        return self.clock.stopped

    def stop_at(self, steps: float) -> None:
        """Stop at the first mixed round whose DDP-equivalent progress reaches ``steps``; after
        a stop, a larger budget goes on (every rank must call it alike)."""
        self.clock.stop_at(steps, self.gossip.world_size)

    def check_round(self, what: str) -> None:
        """Raise the same error on every rank if they call the collective ``what`` at
        different rounds (:func:`~decent_optim.optim.uneven_loop.check_same_round`)."""
        check_same_round(self.gossip, self.round, what)

    def take(self) -> None:  # type: ignore[override]
        """Before a step's update: mix the round in flight if it has arrived (no waiting); note
        whether the round mixed (if any) calls for the slow step (:mod:`~decent_optim.optim.outer`)."""
        mixed, total = self.mixed, self.clock.total
        self._take()
        self.end.start(self._flat.buffers)
        self._due = self.mixed != mixed and self.end.crossed(total, self.clock.total, self._n)

    @property
    def _n(self) -> int:
        return self.gossip.world_size

    def _take(self) -> None:
        self.check_free("step()")
        if self.clock.budget is None:
            raise RuntimeError(
                "step() with uneven=True before opt.stop_at(...): the ranks take different "
                "numbers of steps, so a loop of `for step in range(N)` would end on some ranks "
                f"while the others wait for their rounds. Write {LOOP}"
            )
        if self.clock.stopped:
            raise RuntimeError(
                f"step() after the budget of {self.clock.budget:g} steps was reached (at round "
                f"{self.mixed}, progress {self.progress:.1f}); every rank stopped at that round. "
                "End the loop on `opt.stopped`"
            )
        if self.anchor is None:
            self.anchor = [b.clone() for b in self._flat.buffers]
        resent = self._relaunch
        if resent:  # resumed with the round in flight: send it again at once
            self._relaunch = False
            self._send(self._resend_count)
        if not self._out or self.since < self.clock.period - 1:
            return None
        # a round resent at a resume is waited for where it was due: every rank resent it
        # together, and the resumed run then mixes where the saved one would have
        capped = self.longest is not None and self.since >= self.longest - 1
        if resent or capped or self._waiter is None or self._waiter.done.is_set():
            self._settle()
        return None

    def launch(self) -> None:
        """Count a completed step; launch the next round once the last one is mixed and at
        least ``local_steps`` steps were taken since it was launched; first the slow step if
        :meth:`take` called for it."""
        if self._due:
            self._due = False
            self.end.slow_step(self._flat.buffers)
        self.count += 1
        self.since += 1
        if self.clock.stopped or self._out or self.since < self.clock.period:
            return
        assert self.anchor is not None  # take() ran first
        self.end.anchor_step(self._flat.buffers, self.anchor)
        self.launched += 1
        self.since = 0
        self.clock.launched()
        self._send(self.count)

    def synchronize(self) -> None:
        """Mix the round in flight now (waiting for it), instead of when it arrives; the slow
        step at once if that round calls for it."""
        self.check_free("synchronize()")
        mixed, total = self.mixed, self.clock.total
        if self._relaunch:
            self._relaunch = False
            self._send(self._resend_count)
        if self._out:
            self._settle()
        if self.mixed != mixed and self.end.crossed(total, self.clock.total, self._n):
            self.end.slow_step(self._flat.buffers)

    def wait(self, *, check_writes: bool = True) -> None:
        """Let the round in flight finish its transfers (its waiter thread owns the wait)."""
        if self._waiter is not None:
            self._waiter.thread.join()

    def reset(self, count: int, in_flight: bool) -> None:
        """Continue from a checkpoint at ``count`` steps as from a fresh start (no round mixed);
        :meth:`load_schedule_state` then restores where the periods stood."""
        super().reset(count, in_flight)
        if self._waiter is not None:
            self._waiter.thread.join()
        if self._sum is not None:
            self._sum[0].discard()
        self._sum, self._out, self._waiter = None, False, None
        self.launched = self.mixed = self.since = 0
        self.clock.restart()

    def regrouped(self, before: int) -> None:
        """After live membership rebuilt the group (:meth:`Live.failed
        <decent_optim.optim.live.Live.failed>`): the round in flight and its sum dropped, stand at round ``live.resume``, the
        progress carried over from the old group of ``before`` ranks, the periods restarted."""
        assert self.live is not None
        self._sum, self._waiter, self._out, self._relaunch = None, None, False, False
        self.gossip.hint = HINT
        self.launched = self.mixed = self.live.resume
        self.clock.carry(before, self.gossip.world_size)
        self.clock.restart_periods()

    def enter(self, resume: int) -> None:
        """A newcomer's rounds after its state arrived: at round ``resume``, the next launched
        at the end of its first step."""
        self.launched = self.mixed = resume
        self.since = self.local_steps
        self.clock.restart_periods()
        self.gossip.hint = HINT  # on the gossiper at the members' size (Live.adopt)

    def schedule_state(self) -> dict[str, object]:
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
            "world_size": self.gossip.world_size,
            "period": clock["period"],
        }

    def load_schedule_state(self, state: dict[str, object]) -> None:
        """Take back :meth:`schedule_state` (after :meth:`reset`). Saved by a world of
        another size (a resize by ``checkpoint.load``), the round in flight is dropped (the
        resize leaves none pending) and the progress carries over (:meth:`Clock.carry
        <decent_optim.optim.uneven_periods.Clock.carry>`)."""
        self.launched, self.mixed = int(state["launched"]), int(state["mixed"])  # type: ignore[call-overload]
        self.since = int(state["since"])  # type: ignore[call-overload]
        self.clock.load(state)
        sent = state["sum_count"]
        self._resend_count = self.count if sent is None else int(sent)  # type: ignore[call-overload]
        if not self.in_flight:  # a resize dropped the round in flight: it is launched anew
            self.launched = self.mixed
        saved = int(state.get("world_size") or self.gossip.world_size)  # type: ignore[call-overload]
        if saved != self.gossip.world_size and self.clock.total is not None:
            self.clock.carry(saved, self.gossip.world_size)
            self.clock.restart_periods()  # old speeds say nothing of the new world
        self.clock.check(self.gossip.world_size)

    # -- internals -------------------------------------------------------------------------------
    _resend_count = 0

    def _send(self, count: int) -> None:
        """Launch round :attr:`launched` with the anchors, and the sum of the step counts
        (``count``: this rank's steps when it launched the round)."""
        values = torch.tensor([self.clock.sent(count)], dtype=torch.float64)
        what = f"the step counts of round {self.launched}"
        try:
            if self.live is not None:
                self.live.asked()  # a change asked for (a newcomer): rebuild first
            self._pending = self._start()
            self._sum = (self.gossip.sum_async(values, what, HINT), values, count)
        except RuntimeError as err:  # a change asked for, or a dead peer's error from a send
            return self._failed(err)
        self._out = True
        handles = [h for h in (self._pending, self._sum[0]) if h is not None and not h.is_noop]
        self._waiter = Waiter(handles) if handles else None

    def _settle(self) -> None:
        """Mix the round in (waiting at most the timeout), then its summed step counts."""
        if self._waiter is not None:
            waiter, self._waiter = self._waiter, None
            waiter.thread.join()
            if waiter.error is not None:  # dropped and rebuilt with membership=, else raised
                return self._failed(waiter.error)
        self._mix_in(self.count)
        self._out = False
        self.mixed += 1
        if self._sum is not None:
            handle, values, count = self._sum
            handle.wait_and_mix_()
            self.clock.mixed(float(values.item()), count, self.gossip.world_size)
            self._sum = None
        else:
            self.clock.check(self.gossip.world_size)

    def _failed(self, error: BaseException) -> None:
        """A round ended in ``error``: live membership rebuilds (:meth:`regrouped` after),
        else it is raised."""
        if self.live is None:
            raise error
        self.live.failed(self, error)

    def _start(self) -> GossipHandle | None:
        assert self.anchor is not None
        handle = self.gossip.start(self.anchor, self.launched)
        return None if handle.is_noop else handle
