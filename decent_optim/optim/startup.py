"""Start-up of a decentralized optimizer: the workers, the topology, the buckets, equal start values.

A collective: every rank builds its optimizer at the same point of the program. In order:

1. find the process group and its size, and build the topology for it;
2. check that the ranks agree on the parameters (one all-gather), before anything changes;
3. pack the trainable parameters into buckets (:class:`~decent_optim.flat.FlatParams`);
4. broadcast rank 0's values, so that every rank starts from the same :math:`x^{(0)}`.

Step 4 overwrites a rank's own values. When they differed from rank 0's -- a resume that loaded
each rank's weights into the model before building the optimizer -- they are kept aside
(:class:`Stash`) until ``load_state_dict`` can put them back, or the first step drops them.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from decent_optim import topologies
from decent_optim._validation import resolve_local_world_size
from decent_optim.flat import FlatParams, check_disjoint, check_flattenable
from decent_optim.gossip import (
    Gossiper,
    LocalGossiper,
    broadcast_,
    check_same_parameters,
    comm_device,
    resolve_group,
)
from decent_optim.topologies import Topology

__all__ = ["Connected", "Stash", "connect"]


class Stash:
    """This rank's own start values, which the start-up broadcast overwrote."""

    def __init__(self, own: list[Tensor], broadcast: list[Tensor]) -> None:
        self._own = own
        self._print = _fingerprint(broadcast)

    def restore(self, buffers: list[Tensor]) -> None:
        """Put the rank's values back, unless the buffers changed since the broadcast."""
        if _fingerprint(buffers) == self._print:
            with torch.no_grad():
                for buf, own in zip(buffers, self._own):
                    buf.copy_(own)


@dataclass
class Connected:
    """What start-up hands the engine."""

    gossip: Gossiper | LocalGossiper
    topology: Topology
    flat: FlatParams
    frozen: list[Tensor]
    stash: Stash | None


def connect(
    groups: list[list[Tensor]],
    *,
    topology: str | Topology,
    process_group: Any,
    bucket_cap_mb: float,
    local_world_size: int | None,
    timeout: datetime.timedelta | None,
) -> Connected:
    """Steps 1-4 of the module docstring for the parameters of each param group in ``groups``."""
    every = [p for params in groups for p in params]
    for p in every:
        check_flattenable(p)
    check_disjoint(every)
    group, world_size = resolve_group(process_group)
    topo = topologies.get(topology, world_size, resolve_local_world_size(local_world_size))
    if world_size > 1:
        check_same_parameters(every, group, comm_device(group, every))
    frozen = [p for p in every if not p.requires_grad]
    flat = FlatParams([[p for p in params if p.requires_grad] for params in groups], bucket_cap_mb)
    if world_size == 1:
        return Connected(LocalGossiper(topo), topo, flat, frozen, None)
    own = [b.clone() for b in flat.buffers]
    broadcast_(flat.buffers, group)
    broadcast_([p.detach() for p in frozen], group)
    differs = any(not torch.equal(a, b) for a, b in zip(own, flat.buffers))
    stash = Stash(own, flat.buffers) if differs else None
    return Connected(Gossiper(topo, group, timeout=timeout), topo, flat, frozen, stash)


def _fingerprint(buffers: list[Tensor]) -> list[tuple[float, float]]:
    """Cheap summary of the values (sum and 2-norm in float64), to notice a change."""
    return [
        (float(b.sum(dtype=torch.float64)), float(torch.linalg.vector_norm(b, dtype=torch.float64)))
        for b in buffers
    ]
