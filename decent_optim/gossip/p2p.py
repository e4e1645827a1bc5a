"""Point-to-point exchange: every rank sends its buffers to the ranks that mix them in.

For a pair (ring, one-peer-exp, most rounds of alternating-exp-ring) this moves one buffer
each way, the minimum possible, and needs no copy of the parameters; it also carries rounds
with arbitrary weights (a :class:`~decent_optim.topologies.CustomTopology`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor

from decent_optim.gossip.exchange import Exchange, Link
from decent_optim.gossip.handle import GossipHandle, PendingMix
from decent_optim.topologies import Topology

__all__ = ["PointToPoint"]


class PointToPoint(Exchange):
    """Round ``step`` of ``topology`` by ``batch_isend_irecv``, one receive buffer per in-neighbour.

    A round whose weights are all equal (a pair: 1/2) leaves the plain sum of the values and
    hands the weight back as the factor still to apply -- or, for a pair asked to defer, leaves
    the peer's values unadded too; any other round mixes completely.
    """

    def __init__(self, link: Link, topology: Topology) -> None:
        self.link, self.topology = link, topology

    def start(self, buffers: Sequence[Tensor], step: int) -> GossipHandle:
        link, rank = self.link, self.link.rank
        weights = self.topology.weights(rank, step)
        sources = self.topology.in_peers(rank, step)
        received = [link.receive_buffers(slot, buffers) for slot in range(len(sources))]
        ops, peers = [], []
        # every receive before any send: gloo moves a buffer only after the peer's "ready to
        # receive" notice arrived, and notices travel behind data on the same TCP stream. A rank
        # that reaches the round after its peer would otherwise queue its whole buffer ahead of
        # its own notice, and the two directions would cross the link one after the other
        for b in range(len(buffers)):
            for slot, peer in enumerate(sources):
                ops.append(
                    dist.P2POp(
                        dist.irecv,
                        received[slot][b],
                        link.global_ranks[peer],
                        link.group,
                        tag=link.first_tag + b,
                    )
                )
                peers.append(peer)
        for b, buf in enumerate(buffers):
            for peer in self.topology.out_peers(rank, step):
                ops.append(
                    dist.P2POp(
                        dist.isend, buf, link.global_ranks[peer], link.group, tag=link.first_tag + b
                    )
                )
                peers.append(peer)
        works: list[tuple[Any, int | None]] = []
        if ops:
            works = list(zip(dist.batch_isend_irecv(ops), peers))
            outs = len(self.topology.out_peers(rank, step))
            link.bytes_sent += outs * sum(b.numel() * b.element_size() for b in buffers)
        own = weights.get(rank, 0.0)
        peer_weights = [weights[j] for j in sources]
        uniform = own > 0 and all(w == own for w in peer_weights)

        def finish(defer_addend: bool) -> list[PendingMix]:
            # only now, after every send of `buf` completed, may `buf` be overwritten
            if uniform and defer_addend and len(sources) == 1:  # a pair: nothing to do yet
                return [PendingMix(own, received[0][b]) for b in range(len(buffers))]
            for b, buf in enumerate(buffers):
                if uniform:  # leave the plain sum, the caller applies the equal weight
                    for slot in range(len(sources)):
                        buf.add_(received[slot][b])
                    continue
                buf.mul_(own)
                for slot, w in enumerate(peer_weights):
                    buf.add_(received[slot][b], alpha=w)
            return [PendingMix(own if uniform else 1.0)] * len(buffers)

        return link.handle(works, finish, buffers, step)
