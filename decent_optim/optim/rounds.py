"""The gossip timeline of one optimizer: one class for every schedule of rounds, made of parts.

A step mixes the round in flight when it is due, updates, and launches the next when one is
due; every rank launches the same rounds in the same order, whatever happens locally, because
its neighbours wait for them. :class:`Rounds` holds the round in flight and the step counter,
and asks its parts, each of which owns its state:

* **when** a round is mixed and launched, and what ``round``, ``progress`` and the budget are
  (:class:`When`): step-locked on a :class:`~decent_optim.optim.local_steps.Periods` cadence
  (every step is ``Periods(1)``), or uneven periods that end once the neighbours' round has
  arrived (:mod:`~decent_optim.optim.uneven`, which owns **how long** to wait for it:
  :mod:`~decent_optim.optim.poll`);
* **what travels**: the parameters in place, or the anchors (:mod:`~decent_optim.optim.travel`);
* **what happens at a period's end** (:mod:`~decent_optim.optim.outer`);
* **who** the members are: fixed, or live membership (:class:`Members`), which reaches the
  rounds only through the methods named there.

:func:`~decent_optim.optim.schedules.make_rounds` chooses the parts, one line each.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor

from decent_optim.flat import FlatParams
from decent_optim.gossip import Gossiper, GossipHandle, LocalGossiper, PendingMix
from decent_optim.optim.outer import PeriodEnd
from decent_optim.optim.travel import Anchors, InPlace

__all__ = ["Members", "Rounds", "When"]


class When(Protocol):
    """When rounds are mixed and launched, and what the round, progress and budget are (the
    parts import :class:`Rounds`, never the other way: the rounds know them by this)."""

    hint: str | None  # what a failed round says usually causes it (None: the gossip's own)
    local_steps: int

    def progress(self, rounds: Rounds) -> float: ...
    def stopped(self, rounds: Rounds) -> bool: ...
    def round(self, rounds: Rounds) -> int: ...
    def stop_at(self, rounds: Rounds, steps: float) -> None: ...
    def check_round(self, rounds: Rounds, what: str) -> None: ...
    def check_step(self, rounds: Rounds) -> None: ...  # before a step: raise if it may not run
    def take(self, rounds: Rounds) -> list[PendingMix] | None: ...  # before the update
    def slow_due(self, rounds: Rounds) -> bool: ...  # after it: the slow step now?
    def launches(self, rounds: Rounds) -> bool: ...  # a round now (the step counted)?
    def send(self, rounds: Rounds) -> None: ...  # launch it (what travels is sealed)
    def next_round(self, rounds: Rounds) -> tuple[int, int | None]: ...  # index, start step
    def synchronize(self, rounds: Rounds) -> None: ...
    def wait(self, rounds: Rounds, check_writes: bool) -> None: ...
    def reset(self, rounds: Rounds) -> None: ...
    def mark(self, rounds: Rounds) -> int: ...  # what a newcomer takes of the source's
    def enter(self, rounds: Rounds, resume: int, mark: int) -> None: ...  # a newcomer's start
    def regrouped(self, rounds: Rounds, before: int) -> None: ...
    def state(self, rounds: Rounds) -> dict[str, object] | None: ...  # None: the count says it
    def load(self, rounds: Rounds, state: dict[str, object]) -> None: ...  # after a reset


class Members(Protocol):
    """Who the members are, as the rounds ask it: live membership
    (:class:`~decent_optim.optim.live.Live`, one path for every schedule), which may skip a
    round, rebuild the group first, or drop a round that failed. It acts on the rounds only
    through their methods (:meth:`Rounds.drop`, :meth:`Rounds.start_round`,
    :meth:`Rounds.regrouped`, :meth:`Rounds.join`, :meth:`Rounds.saved`,
    :meth:`Rounds.load_saved`) and their ``gossip``, ``count`` and ``round``."""

    resume: int  # rounds below this are not launched (a survivor catching up)
    membership: Any  # the gossip.membership.Membership

    @property
    def view(self) -> Any: ...  # the current group (a gossip.membership.View)
    # launch round ``rounds.count`` (Rounds.start_round), or not, or rebuild first
    def send(self, rounds: Rounds) -> None: ...
    # wait for ``handle``'s round; False where it failed and the group was rebuilt
    def arrived(self, rounds: Rounds, handle: GossipHandle, after: int) -> bool: ...
    # drop the round in flight and rebuild the group (``after``: the count at the step's end)
    def recover(self, rounds: Rounds, suspects: tuple[int, ...], after: int) -> None: ...
    # send newcomers their state; None, or the ranks to declare lost
    def hand_over(self, rounds: Rounds) -> tuple[int, ...] | None: ...
    # uneven periods: rebuild after ``error`` ended a round (re-raise any other error)
    def failed(self, rounds: Rounds, error: BaseException) -> None: ...
    # uneven periods, before a launch: raise if a change of the group was asked for
    def asked(self) -> None: ...


class Rounds:
    """Launches, waits for and mixes the rounds of ``gossip`` over the buckets of ``flat``, as
    its parts say (module docstring).

    Args:
        gossip: the exchange (a :class:`~decent_optim.gossip.LocalGossiper` for one worker).
        flat: the buckets whose buffers (or anchors) travel.
        global_avg_every: average over every rank instead of the topology's round at the
            rounds launched at a multiple of this many steps (Gossip-PGA); None never.
        when, travel, end: the parts.
    """

    def __init__(
        self,
        gossip: Gossiper | LocalGossiper,
        flat: FlatParams,
        global_avg_every: int | None,
        when: When,
        travel: InPlace | Anchors,
        end: PeriodEnd,
    ) -> None:
        self.when, self.travel, self.end = when, travel, end
        self.gossip, self._flat, self._every = gossip, flat, global_avg_every
        self.count = 0  # completed steps
        self._pending: GossipHandle | None = None
        # a round was launched and is not mixed yet, also one this rank sits out (whose handle
        # is None): every rank of a round must say alike whether it is in flight (checkpoints)
        self._sent = False
        self._relaunch = False  # a loaded checkpoint had the round in flight
        self.held_by: str | None = None  # a block that will restore the buffers (averaged())
        self.live: Members | None = None  # live membership (optim.live): survives a lost rank

    @property
    def gossip(self) -> Gossiper | LocalGossiper:
        """The current exchange (live membership replaces it at a change, with the hint)."""
        return self._gossip

    @gossip.setter
    def gossip(self, gossip: Gossiper | LocalGossiper) -> None:
        self._gossip = gossip
        if self.when.hint is not None:
            gossip.hint = self.when.hint

    # -- what the optimizer reads: DDP-equivalent steps, rounds alike on every rank, the budget
    @property
    def progress(self) -> float:
        return self.when.progress(self)

    @property
    def round(self) -> int:
        return self.when.round(self)

    @property
    def stopped(self) -> bool:
        return self.when.stopped(self)

    def stop_at(self, steps: float) -> None:
        self.when.stop_at(self, steps)

    @property
    def in_flight(self) -> bool:
        """Whether a round has been launched (or must be relaunched) and not mixed."""
        return self._sent or self._relaunch

    def saved(self) -> dict[str, list[Tensor] | None] | None:
        """What a checkpoint keeps besides the parameters, one flat per bucket (None: not
        taken yet), by its key (:mod:`~decent_optim.optim.local_checkpoint`); None where the
        parameters themselves travel (nothing to keep)."""
        if not self.travel.anchored:
            return None
        return {**self.travel.saved(), **self.end.state()}

    def load_saved(self, key: str, flats: list[Tensor]) -> None:
        """Take back one entry of :meth:`saved`."""
        if key in self.travel.saved():
            self.travel.load(key, flats)
        else:
            self.end.load(key, flats)

    # -- a step -------------------------------------------------------------------------------
    def take(self) -> list[PendingMix] | None:
        """Before a step's update: mix the round that is due; returns per bucket what is left
        of its mix for the update to fuse (or None)."""
        self.check_free("step()")
        self.when.check_step(self)
        self.travel.begin()
        mixes = self.when.take(self)
        self.end.start(self._flat.buffers)
        return mixes

    def launch(self) -> None:
        """After a step's update: the slow step when due, count the step, and at a period's end
        the period end's step and the round."""
        if self.when.slow_due(self):
            self.end.slow_step(self._flat.buffers)
        self.count += 1
        if self.when.launches(self):
            self.travel.seal(self.end)
            self.when.send(self)

    def synchronize(self) -> None:
        """Wait for the round in flight and mix it completely now."""
        self.check_free("synchronize()")
        self.when.synchronize(self)

    def wait(self, *, check_writes: bool = True) -> None:
        """Complete the transfers of the round in flight without mixing it (it stays pending)."""
        self.when.wait(self, check_writes)

    def transfers(self, check_writes: bool) -> None:
        """Complete the transfers of the round in flight; ``check_writes=False`` when the
        parameters were given new memory: their versions changed, the memory sent was not."""
        if self._pending is not None:
            if check_writes:
                self.travel.check(self.count)
            self._pending.wait()
            self.travel.clear()

    def readopt(self, owner: str) -> None:
        """Take back parameters moved with ``.to()`` or given new ``.data`` (``owner`` names the
        optimizer in errors). Where they travel (:mod:`~decent_optim.optim.travel`), new values
        while a round is in flight settle it first, as ``synchronize()`` before the write would
        have: its mix goes into the old memory, then the new values replace it, so the next step
        updates exactly them, as torch.optim would (mixing them with the neighbours' values of
        the round before would halve the change)."""
        if self._flat.moved() and self.travel.anchored:
            self._flat.readopt(owner)
        elif self._flat.moved():
            changed = self._flat.changed(owner)
            self.wait(check_writes=False)
            if self._sent and any(changed):
                handle, self._pending, self._sent = self._pending, None, False
                if handle is not None:
                    handle.mix_()
            self._flat.readopt(owner, changed)
            self.record_versions()  # the versions of the memory taken back
        self.travel.fits(owner)

    def record_versions(self) -> None:
        """After a launch, or a block that restored the parameters: nothing raced."""
        self.travel.record(self._pending)

    def check_round(self, what: str) -> None:
        """Raise on every rank if they call the collective ``what`` at different rounds."""
        self.when.check_round(self, what)

    def check_free(self, what: str) -> None:
        """Raise if ``what`` would be undone by the block holding the buffers."""
        if self.held_by is not None:
            raise RuntimeError(
                f"{what} inside {self.held_by}: the block puts every rank's own parameters back "
                f"on exit, which would undo it; call {what} after the block"
            )

    def reset(self, count: int, in_flight: bool) -> None:
        """Continue from a checkpoint: drop the round in flight, then stand at ``count`` steps.

        With ``in_flight`` the next step first launches that round again: every rank resumes
        together, so the sends match, and the mix reproduces the uninterrupted run. What the
        parts keep comes from the checkpoint next (:mod:`~decent_optim.optim.local_checkpoint`),
        else from the parameters at the next step.
        """
        if self._pending is not None:
            self._pending.discard()  # the round of the old trajectory: finish it, drop it
            self._pending = None
        self.gossip.reset()  # public copies of compressed gossip: the next rounds send exact values
        self.count, self._relaunch, self._sent = count, in_flight, False
        self.travel.reset()
        self.end.reset()
        self.when.reset(self)

    # -- the parts' and live membership's means -------------------------------------------------
    def launch_round(self) -> None:
        """Launch the round due (through live membership, which may skip it or rebuild)."""
        if self.live is not None:
            self.live.send(self)
        else:
            self.start_round()

    def start_round(self) -> None:
        """Launch the round due on the current gossip (live membership's :meth:`send`)."""
        self._pending = self.start()
        self._sent = self.gossip.world_size > 1  # a world of one has no rounds to resend

    def start(self) -> GossipHandle | None:
        """Start the round the cadence names with what travels; None if it sends nothing."""
        index, at = self.when.next_round(self)
        every = self._every
        global_average = every is not None and at is not None and at % every == 0
        handle = self.gossip.start(self.travel.buffers(), index, global_average=global_average)
        return None if handle.is_noop else handle

    def mix_in(self, after: int | None, deferred: bool = False) -> list[PendingMix] | None:
        """Take the round in flight and mix it in (``deferred``: per bucket, for the update).
        ``after``: the count at this step's end, where live membership rebuilds on a failed
        round and drops it; None raises the failure instead."""
        self.travel.check(self.count)
        self.travel.clear()
        if self._relaunch:  # a loaded checkpoint had it in flight: launched again first
            self._relaunch = False  # (every rank resumes together, so the sends match)
            self._pending = self.start()
        handle, self._pending, self._sent = self._pending, None, False
        if handle is None:
            return None
        if after is not None and self.live is not None:
            if not self.live.arrived(self, handle, after):
                return None
        return self.travel.mix(handle, deferred)

    def drop(self) -> None:
        """Forget the round in flight without waiting for it (it failed, or was never sent)."""
        self._pending, self._sent = None, False
        self.travel.clear()

    def join(self, count: int, resume: int, mark: int) -> None:
        """A newcomer's rounds once its state arrived (:mod:`~decent_optim.optim.joining`): at
        the source's ``count`` steps and cadence ``mark``, the members resuming gossip at round
        ``resume``; what it sends is what it holds (the anchors not received: its parameters)."""
        self.travel.begin()
        self.count = count
        self.when.enter(self, resume, mark)

    def regrouped(self, before: int) -> None:
        """After live membership rebuilt the group of ``before`` ranks at a failed round."""
        self.when.regrouped(self, before)
