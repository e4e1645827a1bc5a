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
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch.distributed as dist

from decent_optim.gossip.collectives import channel, comm_device, gather_ints
from decent_optim.gossip.failures import GossipError
from decent_optim.gossip.gossiper import Gossiper
from decent_optim.gossip.membership import Membership, View
from decent_optim.topologies import Topology

__all__ = ["Regrouped", "regroup"]


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
) -> Regrouped:
    """Rebuild the default group without the lost members (``suspects``: ranks of the current
    group this rank believes dead) and gossip on it from now on.

    ``count``: this rank's step count at the end of the current step; ``topology``: the topology
    for a view of the new group. A member lost while the survivors exchange their counts is
    agreed on in one more generation. Raises
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
        gossip = Gossiper(topology(view), channel(group, slot), timeout=timeout, slot=slot)
        gossip.watch = membership.watch
        return Regrouped(view, gossip, max(c[0] for c in counts), group)
    raise GossipError(
        f"[id {membership.me}] the survivors kept losing members while rebuilding their group "
        f"(generation {membership.view.generation}); restart the job from a checkpoint"
    )
