"""Sums of a few numbers over every rank, point to point, launched without waiting.

Uneven ranks (:mod:`~decent_optim.optim.uneven`) sum their step counts with every round. An
all-reduce would be a collective of the process group, matched in call order with any other
collective of that group -- a barrier of the user's, an evaluation's average -- so a rank
calling one of those while another launches its sum would pair the wrong operations. Here every
rank sends its values to every other on a tag of its own, which no collective and no round
uses, and adds what it received in rank order, so every rank holds the same bits. :math:`n - 1`
small messages each way per sum: fine for the numbers of a round, not for tensors.
"""

from __future__ import annotations

from torch import Tensor

from decent_optim.gossip.exchange import Link
from decent_optim.gossip.handle import NO_MIX, GossipHandle, PendingMix
from decent_optim.gossip.nodes import post

__all__ = ["sum_async"]


def sum_async(
    link: Link, values: Tensor, tag: int, what: str, hint: str | None = None
) -> GossipHandle:
    """Launch the sum of ``values`` over ``link``'s group on ``tag``; every rank launches its
    sums in the same order. After the handle's :meth:`~GossipHandle.wait` (at most the link's
    timeout; ``what`` and ``hint`` for its error) and :meth:`~GossipHandle.mix_`, ``values``
    holds the sum; with live membership a change another member started ends the wait
    (:class:`~decent_optim.gossip.membership.MembershipChanged`)."""
    others = [r for r in range(link.world_size) if r != link.rank]
    received = {r: values.new_empty(values.shape) for r in others}
    own = values.clone()  # sent, and added in its place in the order
    receives = [(received[r], r, tag) for r in others]
    works = post(link, receives, [(own, r, tag) for r in others], count=False)

    def finish(defer_addend: bool) -> list[PendingMix]:
        values.zero_()
        for r in range(link.world_size):
            values.add_(own if r == link.rank else received[r])
        return [NO_MIX]

    # watched as the rounds are (live membership): a change another member started ends it
    return GossipHandle(
        works,
        finish,
        buffers=[values],
        rank=link.rank,
        timeout=link.timeout,
        what=what,
        hint=hint,
        watch=link.watch,
    )
