"""The gossip timeline of one optimizer: the round in flight, the round counter, global averages.

Round ``t`` carries the values every rank held after its ``t``-th step. A step waits for the round
its predecessor launched, mixes it, updates, and launches the next; every rank launches exactly
one round per step, whatever happens locally, because its neighbours wait for it. Round 0 would
mix the identical start values broadcast from rank 0, so the first step waits for nothing.
"""

from __future__ import annotations

from decent_optim.flat import FlatParams
from decent_optim.gossip import Gossiper, GossipHandle, LocalGossiper, PendingMix

__all__ = ["Rounds"]


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
        self._relaunch = False  # a loaded checkpoint had round `count` in flight

    @property
    def in_flight(self) -> bool:
        """Whether round :attr:`count` has been launched (or must be relaunched) and not mixed."""
        return self._pending is not None or self._relaunch

    def take(self) -> list[PendingMix] | None:
        """Wait for the round in flight; returns per bucket what is left of its mix (or None)."""
        handle = self._take()
        return handle.wait_and_mix_deferred_() if handle is not None else None

    def launch(self) -> None:
        """Count a completed step and launch the round of its values."""
        self.count += 1
        self._pending = self._start()

    def synchronize(self) -> None:
        """Wait for the round in flight and mix it completely into the buffers."""
        handle = self._take()
        if handle is not None:
            handle.wait_and_mix_()

    def wait(self) -> None:
        """Complete the transfers of the round in flight without mixing it (it stays pending)."""
        if self._pending is not None:
            self._pending.wait()

    def reset(self, count: int, in_flight: bool) -> None:
        """Continue from a checkpoint: drop the round in flight, then stand at round ``count``.

        With ``in_flight`` the next step first launches round ``count`` again: every rank resumes
        together, so the sends match, and the mix reproduces the uninterrupted run.
        """
        if self._pending is not None:
            self._pending.discard()  # the round of the old trajectory: finish it, drop it
            self._pending = None
        self.gossip.reset()  # public copies of compressed gossip: the next rounds send exact values
        self.count, self._relaunch = count, in_flight

    def _take(self) -> GossipHandle | None:
        if self._relaunch:
            self._relaunch = False
            self._pending = self._start()
        handle, self._pending = self._pending, None
        return handle

    def _start(self) -> GossipHandle | None:
        every = self._every
        global_average = every is not None and self.count % every == 0
        handle = self.gossip.start(self._flat.buffers, self.count, global_average=global_average)
        return None if handle.is_noop else handle
