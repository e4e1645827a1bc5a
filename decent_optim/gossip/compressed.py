r"""Compressed gossip with error feedback (CHOCO-gossip) for the groups that cross nodes.

Sending rounded parameters adds fresh rounding noise every round, and the copies random-walk
apart. Instead (Koloskova, Stich and Jaggi, ICML 2019) every member keeps *public copies*
:math:`\hat x` that all members of the group hold bit for bit, and sends only the compressed
change of its own:

.. math::
    q_a = Q(m_a - \hat x_a), \qquad \hat x_b \leftarrow \hat x_b + q_b \ \text{ for every part } b,
    \qquad x_i \leftarrow m_a + \frac{\gamma}{p} \sum_{b \ne a} (\hat x_b - \hat x_a)
    \quad (i \in a)

What :math:`Q` leaves out of :math:`m_a - \hat x_a` is not lost: it is still in the difference
next round (error feedback), so the copies track the values as closely as an exact exchange would,
and the copies' mean moves only by what the values' mean moves. Because the members of a pair of
parts add exactly opposite terms, a round leaves the group's sum unchanged, whatever :math:`Q` did
(up to floating-point rounding). :math:`\gamma = 1` (:data:`GAMMA`); :math:`Q` is a
:mod:`~decent_optim.gossip.codecs` codec.

**Parts.** Only the slow links between nodes carry compressed values. A group of a round is split
by node (rank // ``local_world_size``) into :math:`p` parts of equal size :math:`L` (parts of
unequal size are split into single ranks; a group inside one node is not compressed at all, see
:class:`~decent_optim.gossip.Gossiper`). A part's members first average exactly among themselves,
:math:`m_a` (inside a node, fast), and the part then takes part as one: each member ``k`` of a
part handles the ``k``-th of :math:`L` shards of the buffer, keeps the public copies of that shard
only (:math:`p` shards per bucket, :math:`p/L` buffers in all), and exchanges its compressed shard
with member ``k`` of every other part, so each slow link carries one compressed copy of the
buffer per direction. Afterwards the members gather the shards. In steps, for a member of part
:math:`a`:

1. (launch, :math:`L > 1`) send each partner its shard of the values, receive the own shard of
   theirs, average: :math:`m_a`; with :math:`L = 1`, :math:`m_a = x_i` (no copy);
2. (launch) encode :math:`q_a`, add it to the own copy in the same pass, and post it to the
   counterparts, with the receives of theirs;
3. (mix) add every other :math:`q_b` to its copy, write :math:`x_i` on the shard;
4. (mix, :math:`L > 1`) exchange the written shards with the partners.

The first round of a group (and the first after :meth:`CompressedGroup.reset`) has no public
copies yet: it sends :math:`m_a` exactly, and every member sets the copies to the values sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from decent_optim.gossip.codecs import CHUNK, SLICE, Codec
from decent_optim.gossip.exchange import Exchange, Link
from decent_optim.gossip.handle import NO_MIX, GossipHandle, PendingMix

__all__ = ["GAMMA", "CompressedGroup", "Parts", "mix_shard_", "post"]

#: the consensus step size of the mix (1: with an exact codec, the plain group average)
GAMMA = 1.0


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


class CompressedGroup(Exchange):
    """The rounds of one group that crosses nodes, compressed by ``codec`` (module docstring).

    One instance serves every round of the period with this group: the public copies belong to
    the group, not to the round.
    """

    def __init__(self, link: Link, parts: Parts, codec: Codec) -> None:
        self.link, self.parts, self.codec = link, parts, codec
        self._copies: list[list[Tensor]] = []  # per bucket: each part's public copy of the shard
        self._layout: list[tuple[int, torch.dtype, torch.device]] = []
        self._primed = False  # the copies hold values every member agrees on

    def reset(self) -> None:
        """Forget the public copies: the next round sends exact values (all members must call it)."""
        self._primed = False

    def start(self, buffers: Sequence[Tensor], step: int) -> GossipHandle:
        parts, link, codec = self.parts, self.link, self.codec
        shards = [parts.shard(b.numel(), parts.slot) for b in buffers]
        own = [b[lo:hi] for b, (lo, hi) in zip(buffers, shards)]
        means = self._part_means(buffers, shards, step) if parts.width > 1 else own
        copies = self._copies_for(means)
        primed, peers = self._primed, parts.counterparts()
        outgoing: list[Tensor] = []
        incoming: list[list[Tensor]] = []
        for b, (m, held) in enumerate(zip(means, copies)):
            if primed:
                size = codec.nbytes(m.numel())
                out = link.scratch(("payload", b), size, torch.uint8, m.device)
                codec.encode_(m, held[parts.mine], out, absorb=True)  # the own copy, now
                ins = [
                    link.scratch(("payload", b, k), size, torch.uint8, m.device)
                    for k in range(len(peers))
                ]
            else:  # exact values, received straight into the copies
                out, ins = m, [c for a, c in enumerate(held) if a != parts.mine]
                held[parts.mine].copy_(m)
            outgoing.append(out)
            incoming.append(ins)
        receives = [
            (buf, peer, b) for b, ins in enumerate(incoming) for peer, buf in zip(peers, ins)
        ]
        sends = [(out, peer, b) for b, out in enumerate(outgoing) for peer in peers]
        works = post(link, receives, sends)

        def finish(defer_addend: bool) -> list[PendingMix]:
            for b, x in enumerate(own):
                acc = link.scratch("acc", min(SLICE, x.numel()), x.dtype, x.device)
                payloads = incoming[b] if primed else None
                mix_shard_(x, means[b], copies[b], parts.mine, payloads, codec, acc)
            self._primed = True
            if parts.width > 1:
                self._gather(buffers, shards, step)
            return [NO_MIX] * len(buffers)

        return link.handle(works, finish, buffers, step)

    def _part_means(
        self, buffers: Sequence[Tensor], shards: list[tuple[int, int]], step: int
    ) -> list[Tensor]:
        """Step 1: the mean over this rank's part of its shard of every buffer (waits for it)."""
        parts, link = self.parts, self.link
        partners = parts.partners()
        receives, sends, received = [], [], []
        for b, (buf, (lo, hi)) in enumerate(zip(buffers, shards)):
            theirs = [
                link.scratch(("part", b, k), hi - lo, buf.dtype, buf.device) for k, _ in partners
            ]
            received.append(theirs)
            for (k, peer), r in zip(partners, theirs):
                receives.append((r, peer, b))
                a, z = parts.shard(buf.numel(), k)
                sends.append((buf[a:z], peer, b))
        self._wait(post(link, receives, sends), step)
        means = []
        for b, (buf, (lo, hi)) in enumerate(zip(buffers, shards)):
            mean = link.scratch(("mean", b), hi - lo, buf.dtype, buf.device)
            torch.add(buf[lo:hi], received[b][0], out=mean)
            for r in received[b][1:]:
                mean.add_(r)
            means.append(mean.div_(parts.width))
        return means

    def _gather(self, buffers: Sequence[Tensor], shards: list[tuple[int, int]], step: int) -> None:
        """Step 4: every member's mixed shard into every partner's buffers."""
        receives, sends = [], []
        for b, (buf, (lo, hi)) in enumerate(zip(buffers, shards)):
            for k, peer in self.parts.partners():
                a, z = self.parts.shard(buf.numel(), k)
                receives.append((buf[a:z], peer, b))
                sends.append((buf[lo:hi], peer, b))
        self._wait(post(self.link, receives, sends), step)

    def _wait(self, works: list[tuple[Any, int | None]], step: int) -> None:
        link = self.link
        GossipHandle(works, None, round=step, rank=link.rank, timeout=link.timeout).wait()

    def _copies_for(self, means: list[Tensor]) -> list[list[Tensor]]:
        layout = [(m.numel(), m.dtype, m.device) for m in means]
        if layout != self._layout:  # first use, or the buffers changed: start over exactly
            count = len(self.parts.parts)
            self._copies = [
                [torch.zeros(n, dtype=dtype, device=device) for _ in range(count)]
                for n, dtype, device in layout
            ]
            self._layout, self._primed = layout, False
        return self._copies


def mix_shard_(
    x: Tensor,
    m: Tensor,
    copies: list[Tensor],
    mine: int,
    payloads: list[Tensor] | None,
    codec: Codec,
    acc: Tensor,
) -> None:
    """Step 3 of the module docstring for one shard: update the copies, then write ``x``.

    Args:
        x: this rank's shard of the buffer, written with the mix.
        m: its part's mean of the shard (``x`` itself for parts of one rank).
        copies: every part's public copy of the shard, in part order; ``copies[mine]``, the own,
            already holds this round's value (the encoder absorbed its payload).
        payloads: the other parts' payloads, in part order; None for a round of exact values,
            whose copies already hold what was received.
        acc: scratch of ``min(SLICE, x.numel())`` elements.
    """
    own = copies[mine]
    others = [c for a, c in enumerate(copies) if a != mine]
    alpha = GAMMA / len(copies)
    for lo in range(0, x.numel(), SLICE):
        hi = min(lo + SLICE, x.numel())
        if payloads is not None:  # every holder adds the same payload to a copy: they stay equal
            for payload, copy in zip(payloads, others):
                codec.decode_add_(payload, copy, lo, hi)
        a = acc[: hi - lo]
        torch.sub(others[0][lo:hi], own[lo:hi], out=a)
        for copy in others[1:]:
            a.add_(copy[lo:hi]).sub_(own[lo:hi])
        if m is x:
            x[lo:hi].add_(a, alpha=alpha)
        else:
            torch.add(m[lo:hi], a, alpha=alpha, out=x[lo:hi])


def post(
    link: Link, receives: list[tuple[Tensor, int, int]], sends: list[tuple[Tensor, int, int]]
) -> list[tuple[Any, int | None]]:
    """Post ``(buffer, group rank, tag)`` receives, then sends; empty buffers are skipped.

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
    return list(zip(dist.batch_isend_irecv(ops), peers))
