"""Live membership for an optimizer: after a member is lost, the survivors' group and gossiper.

:func:`regroup` is what an optimizer calls when a round failed (a peer died, or another member
started a change): the survivors agree on the members and rebuild the default group
(:meth:`Membership.rebuild <decent_optim.gossip.membership.Membership.rebuild>`), tell each
other how many steps each has taken, and build a :class:`~decent_optim.gossip.Gossiper` for the
topology at the new size on the new group. The optimizer side is :mod:`decent_optim.optim.live`.

The survivors notice a loss at different steps (a neighbour of the lost rank at once, a rank two
hops away one round later, when its neighbours stop answering), so their step counts differ by
a step or two (a period or two, with local steps) when they rebuild; the largest is the round
at which gossip resumes.

A newcomer (:mod:`decent_optim.optim.joining`) :func:`enter` s the group the members rebuild with
it, and the source :func:`give` s it the state it :func:`take` s, point to point over the new
group, on tags above every optimizer's round tags.
"""

from __future__ import annotations

import datetime
import warnings
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from decent_optim import topologies
from decent_optim.gossip.codec_base import Codec
from decent_optim.gossip.collectives import channel, comm_device, gather_ints
from decent_optim.gossip.failures import GossipError
from decent_optim.gossip.gossiper import Gossiper
from decent_optim.gossip.membership import Membership, MembershipError, View
from decent_optim.gossip.watch import waits
from decent_optim.topologies import Topology

__all__ = ["Regrouped", "enter", "give", "gossiper", "regroup", "take", "topology_for"]

#: the tags of a state transfer (the newcomer's fit, the head, then one per tensor)
TAG = 1 << 30


class Regrouped(NamedTuple):
    """The survivors' new group: its view, its gossiper, and the round at which gossip resumes
    (the largest step count of a survivor at the end of the step in which it rebuilt)."""

    view: View
    gossip: Gossiper
    resume: int
    group: object


def regroup(
    membership: Membership,
    suspects: Iterable[int],
    count: int,
    topology: Callable[[View], Topology],
    *,
    timeout: datetime.timedelta | None,
    slot: int = 0,
    compression: str | Codec | None = None,
    deferred: bool = False,
) -> Regrouped:
    """Rebuild the default group without the lost members (``suspects``: ranks of the current
    group this rank believes dead) and gossip on it from now on.

    ``count``: this rank's step count at the end of the current step; ``topology``: the topology
    for a view of the new group; ``compression``: the optimizer's codec, whose public copies
    start over on the new groups (see :func:`gossiper`); ``deferred``: as the first gossiper's
    (``uneven=True``: no launch waits for a node-mate). A member lost while the survivors
    exchange their counts is agreed on in one more generation. Raises
    :class:`~decent_optim.gossip.membership.MembershipError` if this rank was left out.
    """
    ranks = list(suspects)
    for _ in range(membership.view.world_size):
        view = membership.rebuild(ranks)
        group = dist.group.WORLD
        try:
            counts = gather_ints(
                [count],
                group,
                comm_device(group),
                timeout,
                what=f"the survivors' step counts (generation {view.generation})",
                hint="a survivor was lost right after the change of membership",
            )
        except GossipError as err:
            ranks = list(err.peers)
            continue
        gossip = gossiper(membership, topology(view), slot, timeout, compression, deferred)
        return Regrouped(view, gossip, max(c[0] for c in counts), group)
    raise GossipError(
        f"[id {membership.me}] the survivors kept losing members while rebuilding their group "
        f"(generation {membership.view.generation}); restart the job from a checkpoint"
    )


def gossiper(
    membership: Membership,
    topology: Topology,
    slot: int,
    timeout: datetime.timedelta | None,
    compression: str | Codec | None = None,
    deferred: bool = False,
) -> Gossiper:
    """Gossip with ``topology`` on the current default group, its waits watched by
    ``membership``.

    With ``compression``, its compressed groups are new ones, without public copies: their
    first rounds send exact values, on every member alike (all of them build this gossiper at
    the change, none primes it, since the members' parameters differ), as after a resume at
    another world size; the copies of the old groups are dropped with the old gossiper.
    """
    group = dist.group.WORLD
    gossip = Gossiper(
        topology,
        channel(group, slot),
        timeout=timeout,
        slot=slot,
        compression=compression,
        deferred=deferred,
    )
    gossip.watch = membership.watch
    return gossip


def topology_for(name: str, view: View, local_world_size: int) -> Topology:
    """The topology ``name`` for the survivors of ``view``.

    ``local_world_size`` is kept while the members are whole nodes of the first group (every
    member's node-mates are members: the new ranks then still fill nodes in order); otherwise
    every worker counts as a node of its own (exchanges stay exact; only the by-node saving on
    slow links is lost). A topology that does not fit the new size (``one-peer-exp`` on 3
    workers) falls back to ``"ring"``, with a warning.
    """
    n, width, members = view.world_size, local_world_size, set(view.members)
    if any(m - m % width + k not in members for m in members for k in range(width)):
        width = 1
    try:
        return topologies.get(name, n, width)
    except ValueError as err:
        warnings.warn(
            f"live membership: topology {name!r} does not fit the {n} survivors ({err}); "
            'they gossip with topology="ring" instead',
            UserWarning,
            stacklevel=2,
        )
        return topologies.get("ring", n, width)


def enter(membership: Membership, timeout: datetime.timedelta | None) -> tuple[View, int, Any]:
    """A newcomer's :func:`regroup`: join, and take part in the members' exchange of step
    counts (with none of its own). Returns the view, the round at which gossip resumes, the
    group."""
    view = membership.rebuild()
    group = dist.group.WORLD
    try:
        counts = gather_ints(
            [0], group, comm_device(group), timeout, what="the step counts at a join", hint=None
        )
    except GossipError as err:
        raise MembershipError(f"[id {membership.me}] joining failed: {err}; join again") from err
    return view, max(c[0] for c in counts), group


def give(
    membership: Membership,
    rank: int,
    fit: list[int],
    head: list[int],
    payload: Callable[[], list[Tensor]],
    timeout: float | None,
) -> bool:
    """Hand newcomer ``rank`` which of its ``fit`` (hashes of what it built, one per part)
    differ from this rank's, the ``head`` (numbers) and, if none differs, the tensors of
    ``payload()``. Returns whether the fits matched.

    Raises :class:`MembershipChanged` or the transport's ``RuntimeError`` (as
    :meth:`Membership.wait`).
    """
    theirs = torch.zeros(len(fit), dtype=torch.int64)
    membership.wait([_p2p(dist.irecv, theirs, rank, TAG)], timeout)
    differ = sum(1 << i for i, (a, b) in enumerate(zip(theirs.tolist(), fit)) if a != b)
    works = [_p2p(dist.isend, torch.tensor([differ, *head]), rank, TAG + 1)]
    if not differ:
        works += [_p2p(dist.isend, t, rank, TAG + 2 + i) for i, t in enumerate(payload())]
    membership.wait(works, timeout)
    return not differ


def take(
    fit: list[int], heads: int, payload: list[Tensor], timeout: float | None
) -> tuple[int, list[int]]:
    """A newcomer's side of :func:`give` (from rank 0): which parts of ``fit`` differ (a bit
    mask, bit ``i`` for ``fit[i]``) and the ``heads`` numbers of the head, with ``payload``
    filled where none differs; where some differ, this rank has left the group.

    Its waits are not cut short by a change another member starts: what was sent arrives
    anyway (a newcomer in the group takes part in the change at its first round), and a
    source that gave up sends nothing more, which ends in the transport's timeout.
    """
    head = torch.zeros(1 + heads, dtype=torch.int64)
    mine = torch.tensor(fit, dtype=torch.int64)
    waits([_p2p(dist.isend, mine, 0, TAG), _p2p(dist.irecv, head, 0, TAG + 1)], timeout)()
    differ = int(head[0])
    if differ:
        dist.destroy_process_group()  # the members drop this rank as a lost one
        return differ, []
    waits([_p2p(dist.irecv, t, 0, TAG + 2 + i) for i, t in enumerate(payload)], timeout)()
    return 0, [int(v) for v in head[1:].tolist()]


def _p2p(op: Callable[..., dist.Work | None], tensor: Tensor, peer: int, tag: int) -> dist.Work:
    work = op(tensor, peer, tag=tag)
    assert work is not None  # this rank is in the default group
    return work
