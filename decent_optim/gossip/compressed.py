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

**Non-finite values.** An inf or NaN in what a part sends enters every holder's public copy,
and every later difference against that copy is non-finite too: exact gossip forgets a bad value
once the parameters are repaired, the copies would not. So each round notes (on the device, no
host read) whether a payload held one; the holders of a copy see the same payloads, so they
decide alike, and at the next round they forget their copies (:meth:`CompressedGroup.reset`)
and send exact values, which recovers as exact gossip does once every rank has repaired its
parameters. The rank whose own values were non-finite says so in a ``RuntimeWarning`` naming
its rank and the round, once until it sends finite values again: like torch.optim, which never
checks parameters, training goes on (a loss-spike handler or a reload may repair them), but
not silently. Reading the note costs one host read of two flags per round, at the next launch.

The steps are those of :mod:`~decent_optim.gossip.nodes`; member ``k`` of a part keeps the
public copies of its shard only (:math:`p` shards of :math:`1/L` of each bucket). In step 2 it
encodes :math:`q_a`, adds it to its own copy in the same pass, and sends it; in step 3 it adds
every other :math:`q_b` to its copy and writes :math:`x_i` on its shard. The first round of a
group (and the first after :meth:`CompressedGroup.reset`) has no public copies yet: it sends
:math:`m_a` exactly, and every member sets the copies to the values sent.
"""

from __future__ import annotations

import warnings
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
        # of the last round: (own payload non-finite, some payload non-finite), on the device
        self._flags: Tensor | None = None
        self._round = 0  # the round those flags are of
        self._reported = False  # the own non-finite values were reported (until they are finite)

    def reset(self) -> None:
        """Forget the public copies: the next round sends exact values (all members must call it)."""
        self._primed = False

    def start(self, buffers: Sequence[Tensor], step: int) -> GossipHandle:
        parts, link, codec = self.parts, self.link, self.codec
        self._check_last_round()
        self._round = step
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
        sent_bad = self._any([self._nonfinite(out, primed) for out in outgoing])
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
            # what every holder of these copies received: the same payloads, the same answer
            got = [self._nonfinite(buf, primed) for ins in incoming for buf in ins]
            self._flags = torch.stack([sent_bad, self._any([sent_bad, *got])])
            self._primed = True
            if parts.width > 1:
                self._gather(buffers, shards, step)
            return [NO_MIX] * len(buffers)

        return link.handle(works, finish, buffers, step)

    def _nonfinite(self, payload: Tensor, primed: bool) -> Tensor:
        """Whether a payload (exact values when not ``primed``) holds inf or NaN (0-d, device)."""
        return self.codec.nonfinite(payload) if primed else ~torch.isfinite(payload).all()

    @staticmethod
    def _any(flags: list[Tensor]) -> Tensor:
        return torch.stack(flags).any() if flags else torch.tensor(False)

    def _check_last_round(self) -> None:
        """Act on the flags of the last round: report own non-finite values, forget copies
        that took non-finite ones (module docstring)."""
        if self._flags is None:
            return
        sent_bad, some_bad = (bool(v) for v in self._flags.tolist())
        self._flags = None
        if some_bad:
            self._primed = False  # the copies are non-finite: start over with exact values
        if sent_bad and not self._reported:
            warnings.warn(
                f"[rank {self.link.rank}] compressed gossip round {self._round}: the parameters "
                "this rank sent hold non-finite values (inf or NaN), and its peers mixed them "
                f"in (ranks {list(self.parts.group)}), as exact gossip would. Repair the "
                "parameters on every rank (a loss-spike handler, a checkpoint reload): the "
                "public copies start over with exact values, so nothing non-finite stays",
                RuntimeWarning,
                stacklevel=2,
            )
        self._reported = sent_bad

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
