r"""Groups whose ranks live on several nodes: split by node, average inside, exchange between.

Only the links between nodes are slow. A uniform group of a round whose ranks live on more than
one node (rank // ``local_world_size``) is split by node into :class:`Parts` of equal size
:math:`L` (parts of unequal size are split into single ranks). Member ``k`` of a part handles
the ``k``-th of :math:`L` shards of every buffer, so that each part exchanges exactly one copy of
the buffer with every other part, spread over its members, and every slow link carries one copy
per direction -- a ring all-reduce over the whole group
(:class:`~decent_optim.gossip.allreduce.GroupAllReduce`) carries :math:`2(k-1)/k` of a copy per
hop, 1.5 copies for a group of 4 on two nodes. A round, for a member of part :math:`a` of :math:`p` parts:

1. (launch, :math:`L > 1`) send each partner its shard of the values, receive the own shard of
   theirs, average: :math:`m_a`, the part's mean on this shard (the launch waits for the
   partners, which sit on the same node);
2. (launch) send :math:`m_a` -- or, compressed (:mod:`~decent_optim.gossip.compressed`), a
   compressed change of it -- to the member with this shard in every other part, and post the
   receives of theirs;
3. (mix) write the shard of the result;
4. (mix, :math:`L > 1`) exchange the written shards with the partners.

:class:`NodeAverage` is the exact round, :math:`x_i \leftarrow \frac1p \sum_b m_b`, the group
mean (every member sums the parts in the same order, so all hold the same bits); the compressed
one is :class:`~decent_optim.gossip.compressed.CompressedGroup`. Everything travels point to
point, so no process sub-groups are needed.

**Deferred rounds** (``deferred=True``, for ranks that must not wait for one another at a
launch: ``uneven=True``). The launch only posts step 1; the handle's
:meth:`~decent_optim.gossip.GossipHandle.wait` runs the rest as it becomes possible -- the
part's mean and step 2 once step 1 arrived, step 3 and 4 once step 2 arrived -- writing into the
receive buffers, and its mix copies them into the buffers. The same operations on the same
values: the same bits as a step-locked round, for one more pass over the buffers. A rank whose
wait runs in a thread of its own (uneven rounds) thus never waits for its node's other ranks in
its step, and the slow link still carries one copy per direction. The transfers of one round
are posted from two threads (step 1 by the launching one, the rest by the waiting one), never at
the same time: every rank posts its messages to a peer in one order, the round's order, and
point-to-point messages of one tag are matched in the order they were posted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from decent_optim.gossip.codecs import CHUNK
from decent_optim.gossip.exchange import Exchange, Link
from decent_optim.gossip.handle import NO_MIX, GossipHandle, PendingMix

__all__ = ["AcrossNodes", "NodeAverage", "Parts", "post"]

#: step 3 of a round: writes this rank's shard of the result into the views it is given; returns
#: what must wait for the mix itself (a deferred round's state changes), or None
Mix = Callable[[list[Tensor]], Callable[[], None] | None]
#: a strategy's step 2: posts it for the part's means; returns its transfers and its step 3
Across = Callable[[list[Tensor]], tuple[list[tuple[Any, int | None]], Mix]]


class Parts:
    """How one averaging group of a round splits over nodes, as seen from ``rank``.

    Args:
        group: the group's ranks, ascending.
        rank: this rank (a member).
        local_world_size: ranks per node; rank ``r`` is on node ``r // local_world_size``.
    """

    def __init__(self, group: Sequence[int], rank: int, local_world_size: int) -> None:
        nodes: dict[int, list[int]] = {}
        for member in group:
            nodes.setdefault(member // local_world_size, []).append(member)
        parts = [tuple(members) for _, members in sorted(nodes.items())]
        if len({len(p) for p in parts}) > 1:  # unequal parts cannot pair shard for shard
            parts = [(member,) for member in group]
        self.group, self.parts, self.rank = tuple(group), parts, rank
        self.width = len(parts[0])
        self.mine = next(a for a, part in enumerate(parts) if rank in part)
        self.slot = parts[self.mine].index(rank)

    @property
    def crosses_nodes(self) -> bool:
        return len(self.parts) > 1

    def counterparts(self) -> list[int]:
        """The member with this rank's shard in every other part, in part order."""
        return [part[self.slot] for a, part in enumerate(self.parts) if a != self.mine]

    def partners(self) -> list[tuple[int, int]]:
        """``(shard, rank)`` of the other members of this rank's part."""
        return [(k, m) for k, m in enumerate(self.parts[self.mine]) if m != self.rank]

    def shard(self, numel: int, k: int) -> tuple[int, int]:
        """Elements ``[lo, hi)`` of shard ``k`` of a buffer of ``numel`` (whole int8 chunks)."""
        size = -(-numel // self.width)
        size = -(-size // CHUNK) * CHUNK
        lo = min(k * size, numel)
        return lo, min(lo + size, numel)

    def __repr__(self) -> str:
        return f"Parts({self.parts}, rank={self.rank})"


class AcrossNodes(Exchange):
    """The steps 1 and 4 of the module docstring, shared by the exact and compressed rounds.

    ``deferred``: for parts of more than one rank, the launch only posts step 1; the rest runs
    in the handle's :meth:`~decent_optim.gossip.GossipHandle.wait` (module docstring).
    """

    def __init__(self, link: Link, parts: Parts, deferred: bool = False) -> None:
        self.link, self.parts, self.deferred = link, parts, deferred

    def _launch(self, buffers: Sequence[Tensor], step: int, across: Across) -> GossipHandle:
        """A round of steps 1-4 around the strategy's own steps 2 and 3: ``across(means)``
        posts step 2 for this rank's shard of the part's means (one per buffer) and returns
        its transfers and step 3, which writes this rank's shard of the result into the views
        it is given."""
        parts, link = self.parts, self.link
        shards = [parts.shard(b.numel(), parts.slot) for b in buffers]
        own = [b[lo:hi] for b, (lo, hi) in zip(buffers, shards)]
        if parts.width == 1:  # no partners: step 2 at once, nobody waited for
            works, mix = across(own)

            def finish_alone(defer_addend: bool) -> list[PendingMix]:
                mix(own)
                return [NO_MIX] * len(buffers)

            return link.handle(works, finish_alone, buffers, step)
        first, received = self._post_parts(buffers, shards)
        pending: list[Mix] = []

        def second() -> list[tuple[Any, int | None]]:
            works, mix = across(self._part_means(buffers, shards, received))
            pending.append(mix)
            return works

        if not self.deferred:
            self._wait(first, step)
            works = second()

            def finish(defer_addend: bool) -> list[PendingMix]:
                pending[0](own)
                self._wait(self._post_gather(buffers, shards), step)
                return [NO_MIX] * len(buffers)

            return link.handle(works, finish, buffers, step)
        # the result gathers in the receive buffers, and reaches `buffers` only in finish: the
        # caller may read them until it mixes (uneven rounds subtract the anchor first)
        result = link.receive_buffers(0, buffers)

        left: list[Callable[[], None] | None] = []

        def third() -> list[tuple[Any, int | None]]:
            left.append(pending[0]([r[lo:hi] for r, (lo, hi) in zip(result, shards)]))
            return self._post_gather(result, shards)

        def copy_back(defer_addend: bool) -> list[PendingMix]:
            if left[0] is not None:
                left[0]()
            for buf, r in zip(buffers, result):
                buf.copy_(r)
            return [NO_MIX] * len(buffers)

        return link.handle(first, copy_back, buffers, step, phases=[second, third])

    def _post_parts(
        self, buffers: Sequence[Tensor], shards: list[tuple[int, int]]
    ) -> tuple[list[tuple[Any, int | None]], list[list[Tensor]]]:
        """Step 1, posted: each partner's shard of every buffer out, this rank's shard of
        theirs in (returns the transfers and, per buffer, the receive buffers)."""
        parts, link = self.parts, self.link
        partners = parts.partners()
        receives, sends, received = [], [], []
        for b, (buf, (lo, hi)) in enumerate(zip(buffers, shards)):
            theirs = [
                link.scratch(("part", b, k), hi - lo, buf.dtype, buf.device) for k, _ in partners
            ]
            received.append(theirs)
            for (k, peer), r in zip(partners, theirs):
                receives.append((r, peer, link.first_tag + b))
                a, z = parts.shard(buf.numel(), k)
                sends.append((buf[a:z], peer, link.first_tag + b))
        return post(link, receives, sends), received

    def _part_means(
        self, buffers: Sequence[Tensor], shards: list[tuple[int, int]], received: list[list[Tensor]]
    ) -> list[Tensor]:
        """Step 1, once received: the mean over this rank's part of its shard of every buffer."""
        means = []
        for b, (buf, (lo, hi)) in enumerate(zip(buffers, shards)):
            mean = self.link.scratch(("mean", b), hi - lo, buf.dtype, buf.device)
            torch.add(buf[lo:hi], received[b][0], out=mean)
            for r in received[b][1:]:
                mean.add_(r)
            means.append(mean.div_(self.parts.width))
        return means

    def _post_gather(
        self, buffers: Sequence[Tensor], shards: list[tuple[int, int]]
    ) -> list[tuple[Any, int | None]]:
        """Step 4, posted: every member's mixed shard into every partner's buffers."""
        receives, sends, first = [], [], self.link.first_tag
        for b, (buf, (lo, hi)) in enumerate(zip(buffers, shards)):
            for k, peer in self.parts.partners():
                a, z = self.parts.shard(buf.numel(), k)
                receives.append((buf[a:z], peer, first + b))
                sends.append((buf[lo:hi], peer, first + b))
        return post(self.link, receives, sends)

    def _wait(self, works: list[tuple[Any, int | None]], step: int) -> None:
        """Complete the exchanges of a step of the round (raises GossipError after the timeout)."""
        link = self.link
        timeout, watch = link.timeout, link.watch
        GossipHandle(works, None, round=step, rank=link.rank, timeout=timeout, watch=watch).wait()


class NodeAverage(AcrossNodes):
    """The exact group mean over parts of more than one rank (module docstring)."""

    def start(self, buffers: Sequence[Tensor], step: int) -> GossipHandle:
        parts, link = self.parts, self.link

        def across(means: list[Tensor]) -> tuple[list[tuple[Any, int | None]], Mix]:
            peers = parts.counterparts()
            received = [
                [
                    link.scratch(("from", b, k), m.numel(), m.dtype, m.device)
                    for k in range(len(peers))
                ]
                for b, m in enumerate(means)
            ]
            first = link.first_tag  # the optimizer slot's tags
            receives = [
                (r, peer, first + b) for b, rs in enumerate(received) for peer, r in zip(peers, rs)
            ]
            sends = [(m, peer, first + b) for b, m in enumerate(means) for peer in peers]

            def mix(out: list[Tensor]) -> None:
                for b, x in enumerate(out):
                    ordered = received[b][: parts.mine] + [means[b]] + received[b][parts.mine :]
                    # straight into the shard: for parts of more than one rank every addend is
                    # a scratch buffer, so no copy of the sum is needed
                    torch.add(ordered[0], ordered[1], out=x)
                    for m in ordered[2:]:
                        x.add_(m)
                    x.div_(len(ordered))

            return post(link, receives, sends), mix

        return self._launch(buffers, step, across)


def post(
    link: Link,
    receives: list[tuple[Tensor, int, int]],
    sends: list[tuple[Tensor, int, int]],
    count: bool = True,
) -> list[tuple[Any, int | None]]:
    """Post ``(buffer, group rank, tag)`` receives, then sends; empty buffers are skipped.
    ``count``: add the bytes sent to ``link.bytes_sent`` (a round's payloads).

    A bucket's tag is ``link.first_tag + bucket`` (the optimizer slot's range, as :class:`Link`
    says), so that optimizers sharing a group never receive each other's messages.

    Receives go first for the reason :mod:`~decent_optim.gossip.p2p` gives. Both sides skip the
    same empty buffers: their sizes follow from the buffer sizes alone.
    """
    ops, peers = [], []
    for kind, items in ((dist.irecv, receives), (dist.isend, sends)):
        for buf, peer, tag in items:
            if buf.numel():
                ops.append(dist.P2POp(kind, buf, link.global_ranks[peer], link.group, tag=tag))
                peers.append(peer)
    if not ops:
        return []
    works: list[tuple[Any, int | None]] = list(zip(dist.batch_isend_irecv(ops), peers))
    if count:
        link.bytes_sent += sum(buf.numel() * buf.element_size() for buf, _, _ in sends)
    return works
