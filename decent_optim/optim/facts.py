"""What an optimizer tells about its worker and its progress: rank, world size, live membership,
bytes sent (:class:`WorkerFacts`), and how far training got, in DDP-equivalent steps, with a
budget every rank stops at together (:class:`Budgeted`). Both are mixins of
:class:`~decent_optim.optim.engine.DecentralizedOptimizer`; every fact is read from the current
gossiper and rounds, so after a change of live membership it is the new group's.

A loop of ``for step in range(N)`` on every rank fits schedules where every rank steps once per
round. With ``uneven=True`` the faster ranks take more steps than the slower ones, so the loop
ends on the optimizer's word instead::

    opt.stop_at(total_steps)                  # DDP-equivalent: the ranks' steps summed / n
    while not opt.stopped:
        for group in opt.param_groups:
            group["lr"] = peak_lr * schedule(opt.progress)
        ...
        opt.step()

:attr:`~Budgeted.progress` is the same on every rank up to a round's worth of steps, and
:attr:`~Budgeted.stopped` turns true on every rank at the same round, so no rank waits for a
round that another will not send. With every-step gossip and plain local steps both are the
rank's step count.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decent_optim.gossip.membership import View
    from decent_optim.optim.rounds import Rounds

__all__ = ["Budgeted", "WorkerFacts"]


class WorkerFacts:
    """``rank``, ``world_size``, ``membership`` and ``bytes_sent`` of an optimizer."""

    _rounds: Rounds

    @property
    def rank(self) -> int:
        """This worker's rank in the optimizer's process group (0 without one)."""
        return self._rounds.gossip.rank

    @property
    def world_size(self) -> int:
        """Number of workers gossiping (1 without a process group)."""
        return self._rounds.gossip.world_size

    @property
    def membership(self) -> View | None:
        """With ``membership=``: the current group's view (``generation``, ``members`` by their
        first rank, this worker's ``rank`` and ``world_size``, the ids ``lost`` last); else None."""
        return None if self._rounds.live is None else self._rounds.live.view

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this worker sent in gossip rounds since the optimizer was built (an
        all-reduce counted as a ring sends it; not restored from checkpoints: it restarts at 0)."""
        return self._rounds.gossip.bytes_sent


class Budgeted:
    """``progress``, ``stop_at`` and ``stopped`` of an optimizer, read from its rounds."""

    _rounds: Rounds

    @property
    def progress(self) -> float:
        """DDP-equivalent steps so far (the ranks' summed steps / their number)."""
        return self._rounds.progress

    def stop_at(self, steps: float) -> None:
        """End training after ``steps`` DDP-equivalent steps: :attr:`stopped` turns true then.

        With ``uneven=True`` it turns true at the first round whose summed steps reach the
        budget, at the same round on every rank; :meth:`step` afterwards raises.
        """
        if isinstance(steps, bool) or not isinstance(steps, numbers.Real) or not steps > 0:
            raise ValueError(f"stop_at needs a number of steps > 0, got {steps!r}")
        self._rounds.stop_at(float(steps))

    @property
    def round(self) -> int:
        """Gossip rounds completed, the same sequence on every rank: with ``uneven=True`` the
        point to evaluate or save at (``if opt.round % 20 == 0``), since step counts differ."""
        return self._rounds.round

    @property
    def stopped(self) -> bool:
        """Whether the budget of :meth:`stop_at` is reached (False without one)."""
        return self._rounds.stopped
