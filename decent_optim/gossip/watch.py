"""Waits that a change of membership cuts short, and the peers named by the waits it left behind.

Live membership's :meth:`Membership.wait <decent_optim.gossip.membership.Membership.wait>` and
:meth:`~decent_optim.gossip.membership.Membership.watch` run here. gloo's point-to-point
``Work.is_completed()`` stays False and a timed-out wait closes the connection, so a wait cannot
be polled in short slices: it runs in a helper thread while the caller's thread checks the store
for a change, the checks spaced from 0.1 ms doubling up to ``poll``. When a change comes the
caller leaves, and the helper goes on until its transfers end.

Late blame: a failed wait that names a single peer (timed out, or closed) makes it a suspect
in the agreement of the generation the wait was started in (``Membership._agree`` reads
:meth:`Waits.blamed`). This matters for a wait left behind for a change: its member is already
agreeing when it ends, and a hung peer is then left out when its neighbours' waits time out,
not after the agreement's own wait for a silent member. A timed-out collective names every
rank it still waited for, which blames none.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Iterable

import torch.distributed as dist

__all__ = ["Waits", "waits"]


def waits(works: Iterable[dist.Work], timeout: float | None) -> Callable[[], None]:
    """A function that waits for each of ``works`` in turn, each for at most ``timeout`` seconds
    (None: the group's timeout)."""
    todo = list(works)
    limit = None if timeout is None else datetime.timedelta(seconds=timeout)

    def run() -> None:
        for work in todo:
            work.wait() if limit is None else work.wait(limit)

    return run


class Waits:
    """One member's watched waits, and the peers that those left for a change have named."""

    def __init__(self, poll: float, changed: type[BaseException]):
        self.poll, self.changed = poll, changed
        # (generation, ranks) a wait named after this member had left it for a change
        self.late: list[tuple[int, tuple[int, ...]]] = []

    def run(
        self,
        wait: Callable[[], None],
        me: int,
        generation: int,
        pending: Callable[[], bool],
    ) -> None:
        """Run ``wait`` in a helper thread and return or raise what it does, unless ``pending()``
        turns true first: then raise ``changed`` (member id ``me``; ``generation``: the current
        one, whose agreement a late blame goes to).

        The helper is not a daemon: a gloo wait still running when the interpreter exits aborts
        the process ("terminate called without an active exception").
        """
        outcome: list[BaseException] = []
        done = threading.Event()

        def run() -> None:
            try:
                wait()
            except BaseException as exc:  # handed to the caller below
                outcome.append(exc)
                peers = tuple(getattr(exc, "peers", ()))
                self.late.append((generation, peers if len(peers) == 1 else ()))
            done.set()

        threading.Thread(target=run, name="decent_optim-membership-wait", daemon=False).start()
        pause = 1e-4
        while not done.wait(pause):
            if pending():
                raise self.changed(
                    f"[id {me}] another member started a change of membership "
                    f"(generation {generation}): call rebuild()"
                )
            pause = min(2 * pause, self.poll)
        if outcome:
            raise outcome[0]

    def blamed(self, generation: int, members: tuple[int, ...]) -> set[int]:
        """The ids (``members`` by rank) that waits of ``generation`` named."""
        return {
            members[r]
            for at, ranks in self.late
            if at == generation
            for r in ranks
            if r < len(members)
        }

    def forget(self, generation: int) -> None:
        """Drop the blames of ``generation`` and earlier ones (their agreement is over)."""
        self.late = [(at, ranks) for at, ranks in self.late if at > generation]
