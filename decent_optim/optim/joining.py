r"""Live membership, joining: a worker started while the job runs takes a member's state.

The newcomer builds its optimizer with ``membership=Membership(store, join=True)``
(:class:`decent_optim.gossip.membership.Membership`; no ``init_process_group``: joining builds
the group). The constructor blocks until the members have let it in:

1. it asks to join through the store; the members notice at their next round (one check of a
   store key per round, :meth:`Membership.pending
   <decent_optim.gossip.membership.Membership.pending>`), drop the round in flight if it
   was still travelling, and rebuild the default group with the newcomer at the end (ranks
   ``0..n``, a new generation) -- the same agreement as after a loss (:mod:`~.live`);
2. everyone exchanges step counts; gossip resumes at the largest, :math:`R`;
3. at the end of the step in which it rebuilt, the new rank 0 (the *source*) checks that the
   newcomer built the same optimizer (class, buckets, shapes, dtypes, state keys, schedule
   with its outer step and ``Uneven`` setting, ``global_avg_every``, topology name, codec:
   :func:`fit`, part by part, so that a refusal names what differs) and sends it, point to point over the new group, its parameters (the
   flat buffers and the frozen ones), its optimizer state (every state buffer and the step
   counters), what its rounds keep as a checkpoint does (the anchors, outer momentum, slow
   weights and their momentum), its step count :math:`c_0` (with ``uneven=True`` also the
   summed steps where its slow steps stand); a newcomer that differs gets a ``ValueError`` and
   is dropped by the members as a lost one;
4. the newcomer builds the topology of the same name at the new size, counts from
   :math:`c_0` (its steps up to :math:`R` are its own, without gossip, as a survivor catching
   up) and gossips from round :math:`R` on, step-locked with the others (with
   ``compression=``, on new groups whose first rounds send exact values, as the members';
   with ``uneven=True`` it stands at round :math:`R` and launches round :math:`R + 1`
   after its first step: :meth:`Live.failed <decent_optim.optim.live.Live.failed>`).

What the newcomer holds is a copy of the source's state :math:`x_0` at count :math:`c_0`, not
the mean, so the mean of the :math:`n+1` workers becomes
:math:`\bar x' = \bar x + (x_0 - \bar x)/(n + 1)`: it moves by :math:`1/(n+1)` of the source's
distance from the consensus, which gossip then keeps. Its hyper-parameters (``lr`` of its param
groups) and its data are its own: a loop with a schedule sets them from the step count
(``opt.state[p]["step"]`` holds the source's), and shards its data by ``opt.membership``
(``rank``, ``world_size``), as the members do in ``on_membership_change``, which is called on
the members, not on the newcomer.

The members pay nothing more per step than the store check; the source sends the state once
(three times the parameters for AdamW) while the others go on to their next round.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from decent_optim import topologies
from decent_optim.flat import FlatParams
from decent_optim.flat_checks import check_disjoint, check_flattenable
from decent_optim.gossip import Gossiper, GossipError, codecs, comm_device
from decent_optim.gossip.live import enter, give, take
from decent_optim.gossip.membership import Membership as LiveMembership
from decent_optim.gossip.membership import MembershipError
from decent_optim.optim import startup
from decent_optim.optim.param_owner import ParamOwner
from decent_optim.optim.startup import Connected

if TYPE_CHECKING:
    import datetime

    from decent_optim.optim.rounds import Rounds

#: the live membership of an optimizer (:class:`decent_optim.optim.live.Live`, which calls
#: :func:`hand_over`: named here without importing it, so that no import runs in a circle)
Live = Any

__all__ = ["connect", "finish", "fit", "hand_over", "receive", "starter"]


def starter(membership: LiveMembership | None) -> Callable[..., Connected]:
    """The start-up an optimizer with ``membership=`` runs: a newcomer's (:func:`connect`) or
    the one every other optimizer runs (:func:`decent_optim.optim.startup.connect`)."""
    if getattr(membership, "joining", False) is True:  # Membership(store, join=True)
        return functools.partial(connect, membership=membership)
    return startup.connect


def finish(owner: Any, start: Connected) -> None:
    """The end of an optimizer's construction: a newcomer receives its state (:func:`receive`)."""
    if start.resume is not None:  # only a newcomer's start-up (:func:`connect`) sets it
        receive(owner, start.resume)


def connect(
    groups: list[list[Tensor]],
    names: list[list[str] | None],
    *,
    name: str,
    failure: Exception | None,
    membership: LiveMembership | None,
    timeout: datetime.timedelta | None,
    bucket_cap_mb: float,
    deferred: bool = False,
    **_: Any,
) -> Connected:
    """The newcomer's start-up: steps 1-2 of the module docstring (the state comes later)."""
    if failure is not None:
        raise failure  # nobody waits on a newcomer yet: it fails alone
    assert membership is not None
    every = [p for params in groups for p in params]
    for p in every:
        check_flattenable(p)
    labels: list[str | None] = []
    for params, ns in zip(groups, names):
        labels += ns if ns is not None else [None] * len(params)
    check_disjoint(every, labels)
    view, resume, group = enter(membership, timeout)
    member = ParamOwner(name, group, slot=0)  # the source's slot comes with the state
    member.claim(every, labels)
    flat = FlatParams([[p for p in params if p.requires_grad] for params in groups], bucket_cap_mb)
    frozen = [p for p in every if not p.requires_grad]
    topo = topologies.get("complete", view.world_size)  # a stand-in until the source's width
    gossip = Gossiper(topo, group, timeout=timeout, deferred=deferred)  # Live.adopt keeps the flag
    return Connected(gossip, topo, flat, frozen, None, member, group, comm_device(group), resume)


def fit(owner: Any) -> list[tuple[str, str]]:
    """What the transfer needs alike on both sides (step 3 of the module docstring), part by
    part: a label for the refusal's message, and the setting as text."""
    live = owner._rounds.live
    layout = [
        (b.group_index, str(b.dtype), [tuple(p.shape) for p in b.params])
        for b in owner._flat.buckets
    ]
    # (a world of one, which has no live membership, for the tests of the parts)
    topology = repr(owner.topology) if live is None else live.topology
    compression = None if live is None else live.compression
    codec = None if compression is None else codecs.get(compression).name
    return [
        ("the class", type(owner).__name__),
        ("the parameters' shapes, dtypes or order", repr(layout)),
        ("the param groups' state keys", repr([owner.rule.keys(g) for g in owner.param_groups])),
        ("the parameters' names", repr([g.get("param_names") for g in owner.param_groups])),
        ("the frozen parameters", repr([(tuple(t.shape), str(t.dtype)) for t in owner._frozen])),
        ("the schedule (local_steps, outer=, uneven=)", owner._schedule.describe()),
        ("global_avg_every", repr(owner._global_avg_every)),
        ("the topology's name", topology),
        ("compression=", repr(codec)),
    ]


def _hashes(parts: list[tuple[str, str]]) -> list[int]:
    # 7 bytes: a non-negative int64 on the wire
    return [
        int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "big")
        for _, text in parts
    ]


def _params(owner: Any) -> list[Tensor]:
    return [p for b in owner._flat.buckets for p in b.params]


def _payload(owner: Any) -> list[Tensor]:
    """The tensors of the transfer, in the order both sides list them, and last which
    parameters have optimizer state (those that got an update), one byte each."""
    out = [b.data for b in owner._flat.buckets] + [p.detach() for p in owner._frozen]
    for b in owner._flat.buckets:
        out += [b.state(key)[0] for key in owner.rule.keys(owner.param_groups[b.group_index])]
        if owner.rule.counts_steps:
            out.append(b.steps()[0])
    out += [t for _, flats, _ in _saved(owner) for t in flats]
    bound = [bool(dict.get(owner.state, p)) for p in _params(owner)]
    return [*out, torch.tensor(bound, dtype=torch.uint8)]


def _saved(owner: Any) -> list[tuple[str, list[Tensor], bool]]:
    """What the rounds keep besides the parameters, as a checkpoint has it
    (:meth:`~decent_optim.optim.rounds.Rounds.saved`: the anchors, outer momentum,
    slow weights and their momentum): per entry its key, one flat per bucket (zeros where it
    is not taken yet, as on a newcomer) and whether it is taken."""
    saved = owner._rounds.saved() or {}
    buffers = owner._flat.buffers
    return [
        (key, [torch.zeros_like(b) for b in buffers] if flats is None else flats, flats is not None)
        for key, flats in saved.items()
    ]


def _seconds(live: Live) -> float | None:
    return None if live.timeout is None else live.timeout.total_seconds()


def hand_over(live: Live, rounds: Rounds, joiners: tuple[int, ...]) -> tuple[int, ...] | None:
    """The source's side of step 3 for the newcomers of rank ``joiners``; None when it went
    through, else the ranks to declare lost (empty: another member started a change)."""
    owner = live._owner()
    if owner is None:
        return None
    if owner._flat_state.stale:  # values written through opt.state: into the buffers first
        owner._flat_state.rebind(owner.state, owner.param_groups)
    taken = sum(1 << i for i, (_, _, there) in enumerate(_saved(owner)) if there)
    head = [rounds.count, live.slot, live.width, taken, rounds.when.mark(rounds)]
    mine, lost = _hashes(fit(owner)), []
    for rank in joiners:
        try:
            same = give(live.membership, rank, mine, head, lambda: _payload(owner), _seconds(live))
        except GossipError:  # MembershipChanged: another member started a change
            return ()
        except RuntimeError:  # the newcomer died or timed out
            same = False
        if not same:
            lost.append(rank)
    return tuple(lost) if lost else None


def receive(owner: Any, resume: int) -> None:
    """The newcomer's side of steps 3-4, at the end of its optimizer's construction (gossip
    resumes at round ``resume``)."""
    live, rounds = owner._rounds.live, owner._rounds
    me, live.resume = live.membership.me, resume
    payload, parts = _payload(owner), fit(owner)
    try:
        differ, head = take(_hashes(parts), 5, payload, _seconds(live))
    except (GossipError, RuntimeError) as err:
        raise MembershipError(f"[id {me}] the state transfer failed: {err}; join again") from err
    if differ:
        named = [f"{label} ({text})" for i, (label, text) in enumerate(parts) if differ >> i & 1]
        raise ValueError(
            f"[id {me}] this optimizer differs from the running members' in "
            f"{'; '.join(named)} (this newcomer's settings shown): build the same model and "
            "optimizer as they did, then join again"
        )
    count, slot, width, taken, mark = head
    owner._flat.publish()
    # the rounds' state, as a resume gets it (the received flats are the payload's own tensors)
    flats = payload[len(payload) - 1 - sum(len(f) for _, f, _ in _saved(owner)) : -1]
    for i, (key, mine, _) in enumerate(_saved(owner)):
        part, flats = flats[: len(mine)], flats[len(mine) :]
        if taken >> i & 1:
            rounds.load_saved(key, part)
    bound, k = payload[-1], 0
    for b in owner._flat.buckets:
        keys = owner.rule.keys(owner.param_groups[b.group_index])
        for i, p in enumerate(b.params):
            if bound[k]:
                entry = {key: b.shown(key)[i] for key in keys}
                if owner.rule.counts_steps:
                    entry["step"] = b.steps()[1][i]
                owner.state[p] = entry  # views of the received buffers: bound at the next step
            k += 1
    owner.topology, owner._member.slot = live.adopt(rounds, width, slot), slot
    owner._averaged.done = True  # the members asked at their first steps, long ago
    # step-locked: round `count`, if the others launch it now (count >= resume); uneven: it
    # stands at round `resume` and launches round `resume` + 1 after its first step
    rounds.join(count, resume, mark)
