r"""Compressed gossip with error feedback (CHOCO-gossip) for the groups that cross nodes.

Sending rounded parameters adds fresh rounding noise every round, and the copies random-walk
apart. Instead (Koloskova, Stich and Jaggi, ICML 2019) the members of a group keep *public
copies* :math:`\hat x_b` of every part's values, which all members hold bit for bit, and send
only the compressed change of their own. For a member of part :math:`a` of :math:`p` parts (the
split of a group by node, :mod:`~decent_optim.gossip.nodes`; :math:`m_a` the part's mean):

.. math::
    q_a = Q(m_a - \hat x_a), \qquad \hat x_b \leftarrow \hat x_b + q_b \ \text{ for every part } b,
    \qquad x_i \leftarrow m_a + \frac{\gamma}{p} \sum_{b \ne a} (\hat x_b - \hat x_a)

What :math:`Q` leaves out of :math:`m_a - \hat x_a` is not lost: it is still in the difference
next round (error feedback), so the copies track the values as closely as an exact exchange
would. The members of two parts add exactly opposite terms, so a round leaves the group's sum
unchanged whatever :math:`Q` did (up to the rounding of the additions). :math:`\gamma = 1`
(:data:`GAMMA`); :math:`Q` is a :mod:`~decent_optim.gossip.codecs` codec.

The steps are those of :mod:`~decent_optim.gossip.nodes`; member ``k`` of a part keeps the
public copies of its shard only (:math:`p` shards of :math:`1/L` of each bucket). In step 2 it
encodes :math:`q_a`, adds it to its own copy in the same pass, and sends it; in step 3 it adds
every other :math:`q_b` to its copy and writes :math:`x_i` on its shard. The first round of a
group (and the first after :meth:`CompressedGroup.reset`) has no public copies yet: it sends
:math:`m_a` exactly, and every member sets the copies to the values sent.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from decent_optim.gossip.codecs import SLICE, Codec
from decent_optim.gossip.exchange import Link
from decent_optim.gossip.handle import NO_MIX, GossipHandle, PendingMix
from decent_optim.gossip.nodes import AcrossNodes, Parts, post

__all__ = ["GAMMA", "CompressedGroup", "mix_shard_"]

#: the consensus step size of the mix (1: with an exact codec, the plain group average)
GAMMA = 1.0


class CompressedGroup(AcrossNodes):
    """The rounds of one group that crosses nodes, compressed by ``codec`` (module docstring).

    One instance serves every round of the period with this group: the public copies belong to
    the group, not to the round.
    """

    def __init__(self, link: Link, parts: Parts, codec: Codec) -> None:
        super().__init__(link, parts)
        self.codec = codec
        self._copies: list[list[Tensor]] = []  # per bucket: each part's public copy of the shard
        self._layout: list[tuple[int, torch.dtype, torch.device]] = []
        self._primed = False  # the copies hold values every member agrees on

    def reset(self) -> None:
        """Forget the public copies: the next round sends exact values (all members must call it)."""
        self._primed = False

    def start(self, buffers: Sequence[Tensor], step: int) -> GossipHandle:
        parts, link, codec = self.parts, self.link, self.codec
        shards, own, means = self._shards(buffers, step)
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
