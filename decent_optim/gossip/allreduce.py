"""All-reduce exchange: a group of ranks averages uniformly with one all-reduce of a copy.

For a group of ``k`` ranks point-to-point would send ``k - 1`` full buffers from every rank; a
ring all-reduce sends about two, and needs one receive buffer instead of ``k - 1``. The same
strategy carries a periodic global average (the group is the whole process group).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from decent_optim.gossip.exchange import Exchange, Link
from decent_optim.gossip.handle import NO_MIX, GossipHandle, PendingMix

__all__ = ["GroupAllReduce"]


class GroupAllReduce(Exchange):
    """Every member ends with the mean of the group: all-reduce a copy, scale while copying back.

    Args:
        link: the Gossiper's link (its receive buffers hold the copy).
        size: the number of ranks in the group.
        group: the process group of exactly those ranks.
    """

    def __init__(self, link: Link, size: int, group: Any) -> None:
        self.link, self.size, self.group = link, size, group

    def start(self, buffers: Sequence[Tensor], step: int) -> GossipHandle:
        copies = self.link.receive_buffers(0, buffers)
        works: list[tuple[Any, int | None]] = []
        for src, dst in zip(buffers, copies):
            dst.copy_(src)
            works.append((dist.all_reduce(dst, group=self.group, async_op=True), None))
            self.link.count_allreduce(dst, self.size)
        scale = 1.0 / self.size

        def finish(defer_addend: bool) -> list[PendingMix]:
            # scaling while copying back costs nothing extra: nothing is left to the caller
            for buf, total in zip(buffers, copies):
                torch.mul(total, scale, out=buf)
            return [NO_MIX] * len(buffers)

        return self.link.handle(works, finish, buffers, step)
