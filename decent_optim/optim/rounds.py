"""The gossip timeline of one optimizer: the round in flight, the round counter, global averages.

Round ``t`` carries the values every rank held after its ``t``-th step. A step waits for the round
its predecessor launched, mixes it, updates, and launches the next; every rank launches exactly
one round per step, whatever happens locally, because its neighbours wait for it. Round 0 would
mix the identical start values broadcast from rank 0, so the first step waits for nothing.

A round in flight sends the parameters' own storage, without a copy. Writing a parameter in
place before the round is taken (weight clipping after ``step()``) would race with the send:
the neighbours would receive some old and some new values, and differently in every run. So
the parameters' version counters (which torch bumps on every in-place write through the tensor
or a view of it, ``p.detach()`` included) are read when a round is launched and compared when
it is taken; a difference raises, and ``synchronize()`` first is the way to write between
steps. Writes through ``p.data`` bypass those counters, but ``p.data = t`` gives the parameter new
memory, which :meth:`Rounds.readopt` notices: it settles the round (whose memory was not
written) and then takes ``t``.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from decent_optim.flat import FlatParams
from decent_optim.gossip import Gossiper, GossipHandle, LocalGossiper, PendingMix

__all__ = ["Members", "Rounds"]


class Members(Protocol):
    """Who the members are, as the rounds ask it: live membership
    (:class:`~decent_optim.optim.live.Live`, one path for every schedule), which may skip a
    round, rebuild the group first, or drop a round that failed. It acts on the rounds only
    through their methods (:meth:`Rounds.drop`, :meth:`Rounds.start_round`,
    :meth:`Rounds.regrouped`, :meth:`Rounds.join`) and their ``gossip``, ``count`` and
    ``round``."""

    resume: int  # rounds below this are not launched (a survivor catching up)
    membership: Any  # the gossip.membership.Membership

    @property
    def view(self) -> Any:
        """The current group (a :class:`~decent_optim.gossip.membership.View`)."""

    def send(self, rounds: Rounds) -> None:
        """Launch round ``rounds.count`` (:meth:`Rounds.start_round`), or not, or rebuild first."""

    def arrived(self, rounds: Rounds, handle: GossipHandle, after: int) -> bool:
        """Wait for ``handle``'s round; False where it failed and the group was rebuilt."""

    def recover(self, rounds: Rounds, suspects: tuple[int, ...], after: int) -> None:
        """Drop the round in flight and rebuild the group (``after``: the count at the end)."""

    def hand_over(self, rounds: Rounds) -> tuple[int, ...] | None:
        """Send newcomers their state; None, or the ranks to declare lost."""

    def failed(self, rounds: Rounds, error: BaseException) -> None:
        """Uneven periods: rebuild after ``error`` ended a round (re-raise any other error)."""

    def asked(self) -> None:
        """Uneven periods, before a launch: raise if a change of the group was asked for."""


class Rounds:
    """Launches, waits for and mixes the rounds of ``gossip`` over the buckets of ``flat``.

    Args:
        gossip: the exchange (a :class:`~decent_optim.gossip.LocalGossiper` for one worker).
        flat: the buckets whose buffers travel.
        global_avg_every: average over every rank instead of the topology's round every this
            many steps (Gossip-PGA); None never.
    """

    def __init__(
        self, gossip: Gossiper | LocalGossiper, flat: FlatParams, global_avg_every: int | None
    ) -> None:
        self.gossip, self._flat, self._every = gossip, flat, global_avg_every
        self.count = 0  # completed steps; the next step waits on round `count`
        self._pending: GossipHandle | None = None
        # a round was launched and is not mixed yet, also one this rank sits out (whose handle
        # is None): every rank of a round must say alike whether it is in flight (checkpoints)
        self._sent = False
        self._relaunch = False  # a loaded checkpoint had round `count` in flight
        self._params = [p for b in flat.buckets for p in b.params]
        self._versions: list[int] | None = None  # of the parameters when _pending was launched
        self.held_by: str | None = None  # a block that will restore the buffers (averaged())
        self.budget: float | None = None  # of stop_at, in DDP-equivalent steps
        self.live: Members | None = None  # live membership (optim.live): survives a lost rank

    @property
    def progress(self) -> float:
        """DDP-equivalent steps taken: every rank steps once per round, so the step count."""
        return float(self.count)

    @property
    def round(self) -> int:
        """Rounds completed, counted alike on every rank (one per step here)."""
        return self.count

    @property
    def stopped(self) -> bool:
        """Whether the budget of :meth:`stop_at` is reached."""
        return self.budget is not None and self.count >= self.budget

    def stop_at(self, steps: float) -> None:
        """Set the budget, in DDP-equivalent steps."""
        self.budget = float(steps)

    @property
    def in_flight(self) -> bool:
        """Whether round :attr:`count` has been launched (or must be relaunched) and not mixed."""
        return self._sent or self._relaunch

    def take(self) -> list[PendingMix] | None:
        """Wait for the round in flight; returns per bucket what is left of its mix (or None)."""
        self.check_free("step()")
        handle = self._take()
        if handle is None or not self._arrived(handle, self.count + 1):
            return None
        return handle.wait_and_mix_deferred_()

    def launch(self) -> None:
        """Count a completed step and launch the round of its values."""
        self.count += 1
        self._launch_round()
        self.record_versions()

    def _launch_round(self) -> None:
        """Launch round :attr:`count` (through live membership, which may skip it or rebuild)."""
        if self.live is not None:
            self.live.send(self)
            return
        self._pending = self._start()
        self._sent = self.gossip.world_size > 1  # a world of one has no rounds to resend

    def enter(self, resume: int) -> None:
        """A newcomer's first round, at the end of its optimizer's construction (the members
        resume gossip at round ``resume``): round :attr:`count` if the members launch it now
        (live membership decides)."""
        self._launch_round()
        self.record_versions()

    def join(self, count: int, resume: int) -> None:
        """A newcomer's rounds once its state arrived (:mod:`~decent_optim.optim.joining`): at
        the source's ``count`` steps, the members resuming gossip at round ``resume``."""
        self.count = count
        self.enter(resume)

    def regrouped(self, before: int) -> None:
        """After live membership rebuilt the group of ``before`` ranks at a failed round:
        nothing to do for step-locked rounds (the next launch is on the new group)."""

    def drop(self) -> None:
        """Forget the round in flight without waiting for it (it failed, or was never sent)."""
        self._pending, self._sent, self._versions = None, False, None

    def start_round(self) -> None:
        """Launch round :attr:`count` on the current gossip (live membership's :meth:`send`)."""
        self._pending = self._start()
        self._sent = self.gossip.world_size > 1

    def _arrived(self, handle: GossipHandle, after: int) -> bool:
        """Whether ``handle``'s round arrived: always, but with live membership a round that
        failed is dropped and the group rebuilt (``after``: the count at this step's end)."""
        return self.live is None or self.live.arrived(self, handle, after)

    def synchronize(self) -> None:
        """Wait for the round in flight and mix it completely into the buffers."""
        self.check_free("synchronize()")
        handle = self._take()
        if handle is not None:
            handle.wait_and_mix_()

    def wait(self, *, check_writes: bool = True) -> None:
        """Complete the transfers of the round in flight without mixing it (it stays pending).

        ``check_writes=False`` when parameters were given new memory (``.to()``, ``p.data =``):
        their version counters changed, but the memory being sent was not written.
        """
        if self._pending is not None:
            if check_writes:
                self._check_versions()
            self._pending.wait()
            self._versions = None  # the sends are complete: writes are safe until the next launch

    def readopt(self, owner: str) -> None:
        """Take back parameters moved with ``.to()`` or given new ``.data`` (``owner`` names the
        optimizer in errors): after the round's transfers, which read the old, unwritten memory.

        New values (``p.data = t``) while a round is in flight settle the round first, as
        ``synchronize()`` before the write would have: its mix goes into the old memory, then
        the new values replace it, so the next step updates exactly them, as torch.optim would.
        (Mixing them with the neighbours' values of the round before would halve the change.)
        """
        if self._flat.moved():
            changed = self._flat.changed(owner)
            self.wait(check_writes=False)
            if self._sent and any(changed):
                handle, self._pending, self._sent = self._pending, None, False
                if handle is not None:
                    handle.mix_()
            self._flat.readopt(owner, changed)
            self.record_versions()  # the versions of the memory taken back

    def check_round(self, what: str) -> None:
        """Raise on every rank if they call the collective ``what`` at different rounds; here
        every rank steps once per round, so a collective at the same step is at the same
        round, and there is nothing to check (:class:`~decent_optim.optim.uneven.UnevenRounds`
        checks)."""

    def check_free(self, what: str) -> None:
        """Raise if ``what`` would be undone by the block holding the buffers."""
        if self.held_by is not None:
            raise RuntimeError(
                f"{what} inside {self.held_by}: the block puts every rank's own parameters back "
                f"on exit, which would undo it; call {what} after the block"
            )

    def record_versions(self) -> None:
        """Remember the parameters' versions: they must not change while a round is in flight."""
        pending = self._pending is not None and not torch.compiler.is_compiling()
        self._versions = [p._version for p in self._params] if pending else None

    def _check_versions(self) -> None:
        if self._versions is None:
            return
        now = [p._version for p in self._params]
        if now != self._versions:
            written = [p for p, a, b in zip(self._params, now, self._versions) if a != b]
            self._versions = None  # said once; the caller decides what to do
            raise RuntimeError(
                f"{len(written)} parameter(s) (the first of shape {tuple(written[0].shape)}) "
                f"were written in place after step() while gossip round {self.count} was "
                "still sending them (e.g. weight clipping, p.copy_(...), "
                "model.load_state_dict(...)); the neighbours may have received half-written "
                "values. Call opt.synchronize() before writing parameters between steps: it "
                "finishes the round, and the next step() sends the written values"
            )

    def reset(self, count: int, in_flight: bool) -> None:
        """Continue from a checkpoint: drop the round in flight, then stand at round ``count``.

        With ``in_flight`` the next step first launches round ``count`` again: every rank resumes
        together, so the sends match, and the mix reproduces the uninterrupted run.
        """
        if self._pending is not None:
            self._pending.discard()  # the round of the old trajectory: finish it, drop it
            self._pending = None
        self.gossip.reset()  # public copies of compressed gossip: the next rounds send exact values
        self.count, self._relaunch, self._versions = count, in_flight, None
        self._sent = False

    def _take(self) -> GossipHandle | None:
        self._check_versions()
        self._versions = None  # the round is taken: writes are safe until the next launch
        return self._taken()

    def _taken(self) -> GossipHandle | None:
        """The round in flight, no longer pending; first launched again where a loaded
        checkpoint had it in flight (every rank resumes together, so the sends match)."""
        if self._relaunch:
            self._relaunch = False
            self._pending = self._start()
        handle, self._pending, self._sent = self._pending, None, False
        return handle

    def _start(self) -> GossipHandle | None:
        every = self._every
        global_average = every is not None and self.count % every == 0
        handle = self.gossip.start(self._flat.buffers, self.count, global_average=global_average)
        return None if handle.is_noop else handle
