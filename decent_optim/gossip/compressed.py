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
unchanged whatever :math:`Q` did (up to the rounding of the additions). :math:`Q` is a
:mod:`~decent_optim.gossip.codecs` codec and :math:`\gamma` its :attr:`~.Codec.gamma` (1, the
plain group average, for bf16 and int8; less for codecs that drop most of a difference).

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

**Checkpoints.** A group's state -- the public copies, whether they are primed, the flags of
the last round, and with a round in flight the payloads it sent -- is saved with the optimizer
(:meth:`CompressedGroup.state`, :func:`loader`), so that a resume at the same world size goes on
bit for bit: the round in flight is sent again with the saved payloads (the own copy already
took them in, so encoding again would count them twice). At another world size the copies
belong to groups that no longer exist: they are reset, and the first rounds send exact values.

The steps are those of :mod:`~decent_optim.gossip.nodes`; member ``k`` of a part keeps the
public copies of its shard only (:math:`p` shards of :math:`1/L` of each bucket). In step 2 it
encodes :math:`q_a`, adds it to its own copy in the same pass, and sends it; in step 3 it adds
every other :math:`q_b` to its copy and writes :math:`x_i` on its shard. The first round of a
group (and the first after :meth:`CompressedGroup.reset`) has no public copies yet: it sends
:math:`m_a` exactly, and every member sets the copies to the values sent -- unless the codec
starts them from the start-up broadcast (:attr:`.Codec.primes_from_start`,
:meth:`CompressedGroup.prime`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from decent_optim.gossip.codecs import Codec, slice_len
from decent_optim.gossip.copies import mix_shard_
from decent_optim.gossip.exchange import Link
from decent_optim.gossip.handle import GossipHandle
from decent_optim.gossip.nodes import AcrossNodes, Mix, Parts, post

__all__ = ["GAMMA", "CompressedGroup", "loader"]

#: the consensus step of bf16 and int8 (1: with an exact codec, the plain group average)
GAMMA = 1.0
#: the keys of a group's saved state (:meth:`CompressedGroup.state`)
_STATE_KEYS = {"copies", "primed", "flags", "reported", "round", "sent"}


class CompressedGroup(AcrossNodes):
    """The rounds of one group that crosses nodes, compressed by ``codec`` (module docstring).

    One instance serves every round of the period with this group: the public copies belong to
    the group, not to the round.
    """

    def __init__(self, link: Link, parts: Parts, codec: Codec, deferred: bool = False) -> None:
        super().__init__(link, parts, deferred)
        self.codec = codec
        self._copies: list[list[Tensor]] = []  # per bucket: each part's public copy of the shard
        self._layout: list[tuple[int, torch.dtype, torch.device]] = []
        self._primed = False  # the copies hold values every member agrees on
        # of the last round: (own payload non-finite, some payload non-finite), on the device
        self._flags: Tensor | None = None
        self._round = 0  # the round those flags are of
        self._reported = False  # the own non-finite values were reported (until they are finite)
        self._sent: list[Tensor] | None = None  # the payloads of the round in flight
        self._resend: tuple[int, list[Tensor]] | None = None  # (round, payloads) of a checkpoint

    def reset(self) -> None:
        """Forget the public copies: the next round sends exact values (all members must call it)."""
        self._primed, self._resend = False, None

    def prime(self, buffers: Sequence[Tensor]) -> None:
        """Every part's public copy of this rank's shards of ``buffers``, which hold the same
        values on every member (the start-up broadcast): the first round sends compressed
        differences, not exact values."""
        self._copies, self._layout = [], []
        for b in buffers:
            lo, hi = self._bounds(b)
            self._copies.append([b[lo:hi].clone() for _ in self.parts.parts])
            self._layout.append((hi - lo, b.dtype, b.device))
        self._primed, self._resend = True, None

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the group (module docstring), copied."""
        flags = None if self._flags is None else [bool(v) for v in self._flags.tolist()]
        # loaded and not sent yet: the round in flight is still to be sent with those payloads
        sent = self._sent if self._resend is None else self._resend[1]
        return {
            "copies": [[c.clone() for c in held] for held in self._copies] if self._layout else [],
            "primed": self._primed,
            "flags": flags,
            "reported": self._reported,
            "round": self._round,
            "sent": None if sent is None else [p.clone() for p in sent],
        }

    def loader(self, state: Any, buffers: Sequence[Tensor]) -> Callable[[], None]:
        """Check :meth:`state` of a checkpoint against this group's shards of ``buffers``;
        returns what puts it back (after :meth:`reset`)."""
        if not isinstance(state, dict) or set(state) != _STATE_KEYS:
            raise ValueError(f"a group's entry must have the keys {sorted(_STATE_KEYS)}")
        layout = [(hi - lo, b.dtype, b.device) for b in buffers for lo, hi in [self._bounds(b)]]
        copies, sent = state["copies"], state["sent"]
        fits = [[(n, dtype)] * len(self.parts.parts) for n, dtype, _ in layout]
        if copies and [[(c.numel(), c.dtype) for c in held] for held in copies] != fits:
            raise ValueError("its public copies do not fit this optimizer's buckets")
        if sent is not None and [p.numel() for p in sent] != [
            self.codec.nbytes(n) for n, _, _ in layout
        ]:
            raise ValueError("the payloads of its round in flight do not fit this codec's")

        def restore() -> None:
            self._copies = [
                [c.to(device, dtype, copy=True) for c in held]
                for held, (_, dtype, device) in zip(copies, layout)
            ]
            self._layout = layout if copies else []
            self._primed = bool(state["primed"]) and bool(copies)
            flags = state["flags"]
            self._flags = None if flags is None else torch.tensor(flags, dtype=torch.bool)
            self._reported, self._round = bool(state["reported"]), int(state["round"])
            if sent is not None:
                payloads = [p.to(device, copy=True) for p, (_, _, device) in zip(sent, layout)]
                self._resend = (self._round, payloads)

        return restore

    def _bounds(self, buffer: Tensor) -> tuple[int, int]:
        return self.parts.shard(buffer.numel(), self.parts.slot)

    def start(self, buffers: Sequence[Tensor], step: int) -> GossipHandle:
        self._check_last_round()
        self._round = step
        return self._launch(buffers, step, lambda means: self._across(means, step))

    def _across(self, means: list[Tensor], step: int) -> tuple[list[tuple[Any, int | None]], Mix]:
        """Steps 2 and 3 of the module docstring for the part's means of this rank's shards."""
        parts, link, codec = self.parts, self.link, self.codec
        copies = self._copies_for(means)
        primed, peers = self._primed, parts.counterparts()
        resend, self._resend = self._resend, None
        if resend is not None and resend[0] != step:
            resend = None
        outgoing: list[Tensor] = []
        incoming: list[list[Tensor]] = []
        for b, (m, held) in enumerate(zip(means, copies)):
            if primed:
                size = codec.nbytes(m.numel())
                out = link.scratch(("payload", b), size, torch.uint8, m.device)
                if resend is not None:  # sent before a checkpoint: the own copy has it
                    out.copy_(resend[1][b])
                else:
                    # random codecs: new draws every round, the same ones after a resume
                    seed = (((step << 20) + b) << 16) + parts.mine
                    codec.encode_(m, held[parts.mine], out, absorb=True, seed=seed)
                ins = [
                    link.scratch(("payload", b, k), size, torch.uint8, m.device)
                    for k in range(len(peers))
                ]
            else:  # exact values, received straight into the copies
                out, ins = m, [c for a, c in enumerate(held) if a != parts.mine]
                held[parts.mine].copy_(m)
            outgoing.append(out)
            incoming.append(ins)
        self._sent = outgoing if primed else None
        sent_bad = self._any([self._nonfinite(out, primed) for out in outgoing])
        first = link.first_tag  # the optimizer slot's tags
        receives = [
            (buf, peer, first + b)
            for b, ins in enumerate(incoming)
            for peer, buf in zip(peers, ins)
        ]
        sends = [(out, peer, first + b) for b, out in enumerate(outgoing) for peer in peers]

        # a deferred round writes its result in the handle's wait(), possibly long before the
        # mix: the copies take the payloads only at the mix, so that a checkpoint in between
        # holds what a step-locked round's would (the payloads of the round in flight)
        staged = self.deferred and parts.width > 1

        def mix(out: list[Tensor]) -> Callable[[], None] | None:
            held = [list(c) for c in copies]
            for b, x in enumerate(out):
                if staged and primed:
                    for a, c in enumerate(copies[b]):
                        if a != parts.mine:
                            held[b][a] = link.scratch(
                                ("staged", b, a), c.numel(), c.dtype, c.device
                            )
                            held[b][a].copy_(c)
                acc = link.scratch("acc", min(slice_len(x.device), x.numel()), x.dtype, x.device)
                payloads = incoming[b] if primed else None
                mix_shard_(x, means[b], held[b], parts.mine, payloads, codec, acc)

            def commit() -> None:
                for mine, new in zip(copies, held):
                    for c, n in zip(mine, new):
                        if c is not n:
                            c.copy_(n)
                # what every holder of these copies received: the same payloads, the same answer
                got = [self._nonfinite(buf, primed) for ins in incoming for buf in ins]
                self._flags = torch.stack([sent_bad, self._any([sent_bad, *got])])
                self._primed, self._sent = True, None

            if staged:
                return commit
            commit()
            return None

        return post(link, receives, sends), mix

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


def loader(
    groups: Mapping[tuple[int, ...], CompressedGroup],
    codec: Codec | None,
    state: Any,
    buffers: Sequence[Tensor],
) -> Callable[[], None]:
    """Check the saved state of a rank's compressed groups (``{"codec", "groups"}``, keyed by
    ``"0,1"`` member lists); returns what restores it. Raises ValueError on a state that does
    not fit; a state of another codec restores nothing (the copies start over)."""
    if codec is None or not isinstance(state, dict) or state.get("codec") != codec.name:
        return lambda: None
    saved = state.get("groups")
    names = {",".join(map(str, members)): group for members, group in groups.items()}
    if not isinstance(saved, dict) or set(saved) != set(names):
        got = sorted(saved) if isinstance(saved, dict) else saved
        raise ValueError(
            f"it holds the public copies of the compressed groups {got}, this rank's are "
            f"{sorted(names)} (another topology or local_world_size)"
        )
    restores = [group.loader(saved[name], buffers) for name, group in names.items()]

    def restore() -> None:
        for one in restores:
            one()

    return restore
