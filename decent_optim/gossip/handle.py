"""A gossip round in flight: :class:`GossipHandle` waits for it (with a deadline) and mixes it.

The last part of a mix can be left to the caller (:class:`PendingMix`): the optimizer then applies
it inside its own update, which saves passes over the buffer. A round of several exchanges in a
row can leave all but the first to :meth:`GossipHandle.wait` (``phases``), so that its launch
waits for nobody. What a failed wait raises is worded in :mod:`~decent_optim.gossip.failures`."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from torch import Tensor

from decent_optim.gossip.failures import (
    PEER_GONE_HINT,
    GossipError,
    connection_closed,
    explain,
)

__all__ = ["DONE", "NO_MIX", "GossipHandle", "PendingMix"]


class PendingMix(NamedTuple):
    """What is left of one buffer's mix: ``mixed = (buffer + addend) * factor``.

    ``addend`` is None when nothing is left to add (then ``mixed = buffer * factor``). For a pair
    round the buffer still holds the rank's own values, ``addend`` the peer's and ``factor`` is
    1/2; the addend is a receive buffer of the gossip and stays valid until the next round starts.
    """

    factor: float = 1.0
    addend: Tensor | None = None

    @property
    def empty(self) -> bool:
        """True when the buffer already holds the mix."""
        return self.factor == 1.0 and self.addend is None

    def sum_into_(self, buf: Tensor) -> PendingMix:
        """Add the addend to ``buf`` now; returns what is left (the factor)."""
        if self.addend is not None:
            buf.add_(self.addend)
        return PendingMix(self.factor)

    def apply_(self, buf: Tensor) -> None:
        """Finish the mix in ``buf``."""
        self.sum_into_(buf)
        if self.factor != 1.0:
            buf.mul_(self.factor)


#: the mix of a buffer that needs nothing more
NO_MIX = PendingMix()


class GossipHandle:
    """A round in flight. :meth:`wait` completes the exchange, :meth:`mix_` applies it.

    ``wait_and_mix_`` does both. Waiting without mixing lets a caller use the process group or
    the buffers in between (e.g. a global average for evaluation) and still mix this round later.

    ``finish(defer_addend)`` (run once, after every transfer completed) writes the mix into
    ``buffers`` up to what it returns per buffer as a :class:`PendingMix`: a scalar factor, and,
    when ``defer_addend`` is true and the round allows it, one received buffer still to add.

    ``phases``: further exchanges that depend on what the earlier ones received; :meth:`wait`
    runs each once the transfers before it completed, and it posts and returns its own. They
    must not write ``buffers`` (only ``finish`` does).
    """

    def __init__(
        self,
        works: list[tuple[Any, int | None]],
        finish: Callable[[bool], list[PendingMix]] | None,
        *,
        buffers: Sequence[Tensor] = (),
        round: int = 0,
        rank: int = 0,
        timeout: datetime.timedelta | None = None,
        on_close: Callable[[], None] | None = None,
        what: str | None = None,
        group_peers: Sequence[int] = (),
        hint: str | None = None,
        late: Callable[[], list[int]] | None = None,
        phases: Sequence[Callable[[], list[tuple[Any, int | None]]]] = (),
        watch: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        self._works = works  # (work, peer it talks to, or None for a group collective)
        self._phases = list(phases)
        self._finish = finish
        self._buffers = list(buffers)
        self._on_close = on_close  # run once the received values are consumed or dropped
        self.round, self.rank, self.timeout = round, rank, timeout
        # for collectives outside the rounds (start-up, checks, averages): what the wait is for,
        # the other ranks of the group (a group collective cannot tell which one is missing,
        # ``late`` can: see gossip.arrival), and what usually causes a failure there
        self.what = what if what is not None else f"gossip round {round}"
        self._group_peers, self._hint, self._late = list(group_peers), hint, late
        # runs the wait while watching for a change of membership (live membership's
        # Membership.watch), which ends it early; None waits here
        self._watch = watch

    @property
    def is_noop(self) -> bool:
        """True for a round with nothing to exchange or mix (e.g. a rank sitting out)."""
        return not self._works and self._finish is None and not self._phases

    def ready(self) -> bool:
        """Whether every send and receive of the round has completed, without waiting.

        A failed transfer counts as completed: :meth:`wait` then raises its error at once. A
        round with phases still to run is not ready: only :meth:`wait` runs them.
        """
        return not self._phases and all(work.is_completed() for work, _ in self._works)

    def wait(self) -> None:
        """Block until every send and receive of the round completed (at most ``timeout``, and
        as long again for each of its ``phases``, run here).

        Raises :class:`GossipError` naming the round (or check), the peers and the seconds waited:
        on a timeout, and on any transport error; a closed connection (a dead peer's "Connection
        closed by peer" or "Connection reset by peer") is reported as the peer being gone, not
        as a timeout. With ``watch`` (live membership), a change another member started ends
        the wait with :class:`~decent_optim.gossip.membership.MembershipChanged`.
        """
        if not self._works and not self._phases:
            return  # waited for already (or nothing to wait for): no helper thread to start
        if self._watch is None:
            self._wait_phases()
        else:
            self._watch(self._wait_phases)

    def _wait_phases(self) -> None:
        try:
            self._wait_works()
            while self._phases:
                phase = self._phases.pop(0)
                try:
                    self._works = phase()
                except RuntimeError as err:  # a dead peer's transport error, raised by a send
                    why = f"posting its next exchange failed. {PEER_GONE_HINT}. Cause: {err}"
                    raise GossipError(f"[rank {self.rank}] {self.what}: {why}") from err
                self._wait_works()
        except BaseException:
            self._phases = []  # a failed round posts nothing more
            raise

    def _wait_works(self) -> None:
        works, self._works = self._works, []
        start = time.monotonic()
        deadline = None if self.timeout is None else start + self.timeout.total_seconds()
        for k, (work, _) in enumerate(works):
            try:
                if deadline is None:
                    work.wait()
                else:
                    left = max(deadline - time.monotonic(), 0.001)
                    work.wait(datetime.timedelta(seconds=left))
            except RuntimeError as err:
                waiting = sorted({p for _, p in works[k:] if p is not None})
                failed = works[k][1]  # the peer of the transfer that failed (None: a collective)
                message = explain(
                    f"[rank {self.rank}] {self.what}",
                    err,
                    waiting=waiting,
                    failed=failed,
                    group_peers=self._group_peers,
                    start=start,
                    deadline=deadline,
                    timeout=self.timeout,
                    late=self._late,
                    hint=self._hint,
                )
                error = GossipError(message)
                closed = connection_closed(err) and failed is not None
                error.peers = (failed,) if closed and failed is not None else tuple(waiting)
                raise error from err

    def mix_(self) -> None:
        """Overwrite the buffers with the weighted mix (once; after :meth:`wait`)."""
        for buf, pending in zip(self._buffers, self._run_finish(False)):
            pending.apply_(buf)

    def mix_unscaled_(self) -> list[float]:
        """:meth:`mix_` without its last multiplication; returns the factor left per buffer.

        Afterwards buffer ``b`` holds ``mixed_b / factors[b]``: for a round of equal weights
        ``w`` (a pair: 1/2) it holds the plain sum of the values, in one pass, and the factor is
        ``w``; otherwise the factor is 1.0 and the buffer is mixed. The caller must apply every
        factor other than 1.0 -- ``buf.mul_(factor)``, or folded into its own update of the
        buffer -- before the buffer is read as parameters or sent again. A pair's sum
        ``x_i + x_j`` is the same floating-point number on both ranks, so as long as both
        apply the factor the same way they keep identical values.
        """
        return [pending.factor for pending in self._run_finish(False)]

    def mix_deferred_(self) -> list[PendingMix]:
        """Like :meth:`mix_unscaled_`, but a pair round also leaves the peer's values unadded.

        Returns per buffer the :class:`PendingMix` the caller must apply before the buffer is
        read as parameters or sent again; the addends stay valid until the next round starts.
        """
        return self._run_finish(True)

    def _run_finish(self, defer_addend: bool) -> list[PendingMix]:
        if self._works or self._phases:
            raise RuntimeError("mix_() before wait(): the round is still in flight")
        finish, self._finish = self._finish, None
        pending = finish(defer_addend) if finish is not None else [NO_MIX] * len(self._buffers)
        self._close()
        return pending

    def discard(self) -> None:
        """Complete the exchange but drop its values (the parameters stay as they are)."""
        self.wait()
        self._finish = None
        self._close()

    def _close(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    def wait_and_mix_(self) -> None:
        self.wait()
        self.mix_()

    def wait_and_mix_unscaled_(self) -> list[float]:
        """:meth:`wait`, then :meth:`mix_unscaled_`; returns its factors (see there)."""
        self.wait()
        return self.mix_unscaled_()

    def wait_and_mix_deferred_(self) -> list[PendingMix]:
        """:meth:`wait`, then :meth:`mix_deferred_`; returns what is left to apply (see there)."""
        self.wait()
        return self.mix_deferred_()


#: The handle of a round with nothing to exchange (one worker, or a rank sitting out).
DONE = GossipHandle([], None)
