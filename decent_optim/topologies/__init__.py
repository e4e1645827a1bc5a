"""Communication graphs: the mixing matrix :math:`W^{(t)}` of every gossip round.

A topology is a periodic schedule of doubly stochastic matrices; round ``t`` uses
``W(t mod period)``. Every rank computes the same schedule from ``(world_size, step)`` alone,
without talking to the others, so all the logic that decides who sends to whom lives here, in
pure Python and torch, and can be checked on paper. This module never imports
:mod:`torch.distributed`.

Two shapes of round exist. Most built-in rounds are *group averages*: the ranks are partitioned
into groups and every member of a group ends with the plain mean of the group (ring pairs, the
whole world for ``complete``, the node blocks of ``alternating-exp-ring``). Such rounds can be
carried out with an all-reduce per group. A :class:`CustomTopology` may have arbitrary weights;
its rounds are only described by their rows.
"""

from __future__ import annotations

from decent_optim.topologies.base import Topology
from decent_optim.topologies.builtin import (
    AlternatingExpRingTopology,
    CompleteTopology,
    OnePeerExpTopology,
    RingTopology,
)
from decent_optim.topologies.custom import CustomTopology
from decent_optim.topologies.finite_time import BaseTopology

__all__ = [
    "AlternatingExpRingTopology",
    "BaseTopology",
    "CompleteTopology",
    "CustomTopology",
    "OnePeerExpTopology",
    "RingTopology",
    "Topology",
    "get",
    "names",
]

_NAMED: dict[str, type[Topology]] = {
    "complete": CompleteTopology,
    "ring": RingTopology,
    "one-peer-exp": OnePeerExpTopology,
    "alternating-exp-ring": AlternatingExpRingTopology,
}


def names() -> list[str]:
    """The fixed names :func:`get` accepts; it also takes ``base-<b>`` for any ``b >= 2``
    (:class:`BaseTopology`), which ``plan`` does not measure yet."""
    return list(_NAMED)


def get(name: str | Topology, world_size: int, local_world_size: int = 1) -> Topology:
    """The topology called ``name`` for ``world_size`` workers (a :class:`Topology` passes through).

    Raises:
        ValueError: unknown name, or a world size the topology does not fit; the message says
            which names or sizes are valid.
    """
    if isinstance(name, Topology):
        if name.world_size != world_size:
            raise ValueError(
                f"topology {name!r} is built for world_size={name.world_size}, "
                f"but the process group has {world_size} ranks"
            )
        return name
    if not isinstance(name, str):
        raise TypeError(f"topology must be a name (str) or a Topology, got {type(name).__name__}")
    base = name.removeprefix("base-")
    if base != name and base.isdigit():
        return BaseTopology(world_size, local_world_size, int(base))
    cls = _NAMED.get(name)
    if cls is None:
        valid = ", ".join(repr(k) for k in _NAMED)
        raise ValueError(
            f"unknown topology {name!r}; valid names are {valid}, 'base-<b>' (b >= 2, e.g. "
            "'base-4'), or pass a Topology"
        )
    return cls(world_size, local_world_size)
