"""What an optimizer tells about its worker: rank, world size, live membership, bytes sent.

:class:`WorkerFacts` is a mixin of :class:`~decent_optim.optim.engine.DecentralizedOptimizer`;
every fact is read from the current gossiper, so after a change of live membership it is the new
group's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decent_optim.gossip.membership import View
    from decent_optim.optim.rounds import Rounds

__all__ = ["WorkerFacts"]


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
