"""A stand-in gossiper for one process: each round mixes every bucket with a stored "received" copy.

It gives an optimizer's full step (mix + update) the arithmetic and the memory of a pair round
(``ring`` at two workers: the peer's values and the weight 1/2, left to the update rule) without
a network or a second process, so one GPU or CPU process can time and measure it.

``lend``: what :meth:`idle_buffer` lends the update as scratch between rounds, as the real
gossiper lends its receive buffer. The timing benchmark lends a separate buffer, because its
stored copy must stay as it is for the next round (no transfer refills it); the memory benchmark
lends the stored copy itself, so the loopback holds one receive-sized buffer per bucket like the
real gossiper (its values then change, which a memory measurement does not mind).
"""

from __future__ import annotations

import torch

from decent_optim.gossip import GossipHandle, PendingMix


class Loopback:
    """A gossiper whose round mixes each buffer with a stored copy: the math of a pair round."""

    rank, world_size = 0, 1

    def __init__(self, lend: str = "separate") -> None:
        if lend not in ("separate", "received"):
            raise ValueError(f"lend must be 'separate' or 'received', got {lend!r}")
        self.lend = lend
        self.received: list[torch.Tensor] | None = None
        self.receive_buffers: dict[int, torch.Tensor] = {}

    def start(self, buffers, step, **kwargs) -> GossipHandle:  # kwargs: global_average
        if self.received is None:
            self.received = [b.clone() for b in buffers]
        received = self.received

        def finish(defer_addend: bool) -> list[PendingMix]:
            if defer_addend:  # what Gossiper leaves after a pair round
                return [PendingMix(0.5, other) for other in received]
            for buf, other in zip(buffers, received):
                buf.add_(other)
            return [PendingMix(0.5)] * len(buffers)

        return GossipHandle([], finish, buffers=buffers)

    def idle_buffer(self, index: int, like: torch.Tensor) -> torch.Tensor:
        if self.lend == "received" and self.received is not None:
            return self.received[index]
        if index not in self.receive_buffers:
            self.receive_buffers[index] = torch.empty_like(like)
        return self.receive_buffers[index]


def loop_back(opt, lend: str = "separate") -> None:
    """Replace ``opt``'s gossip (a world of one) by a :class:`Loopback`."""
    gossip = Loopback(lend)
    if lend == "received":  # lendable from the first step on, like a receive buffer made early
        gossip.received = [bucket.data.clone() for bucket in opt._flat.buckets]
    opt._rounds.gossip = gossip
