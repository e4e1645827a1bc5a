"""The gossip engine: the one module that talks to :mod:`torch.distributed`.

``Gossiper.start(buffers, step)`` launches round ``step`` of the topology asynchronously and
returns a :class:`GossipHandle`; ``handle.wait_and_mix_()`` finishes the exchange and overwrites
each buffer with ``sum_j W(step)[rank, j] * buffer_j``. Between the two calls the caller may read
the buffers (forward and backward) but must not write them: they are sent as they are, without
a copy.

Transport, per round and per group of the round:

* **pairs and arbitrary weights -> point-to-point** (``batch_isend_irecv``): each rank sends its
  buffer to every rank that mixes it in and receives one buffer per in-neighbour. For a pair
  (ring, one-peer-exp, most rounds of alternating-exp-ring) this moves one buffer each way, the
  minimum possible, and needs no copy of the parameters.
* **uniform groups of three or more -> all-reduce on a sub-group** of a copy of the buffer. For a
  group of ``k`` ranks point-to-point would send ``k - 1`` full buffers from every rank; a ring
  all-reduce sends about two, and needs one receive buffer instead of ``k - 1``.

Why this split: measured with ``benchmarks/gossip_transport.py`` on 4 CPU ranks with gloo
(median time per round; 1 / 16 / 64 MB buffers): for pairs, point-to-point took 0.56-0.82x the
time of a two-rank all-reduce (ring 16 MB: 32 ms vs 44 ms); for a group of four (``complete``),
all-reduce took 0.55-0.62x the time of three point-to-point exchanges per rank (16 MB: 46 ms vs
83 ms). Pass ``transport="p2p"`` or ``"allreduce"`` to :class:`Gossiper` to force one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor

from decent_optim.topologies import Topology

__all__ = ["GossipHandle", "Gossiper", "LocalGossiper", "TRANSPORTS"]

TRANSPORTS = ("auto", "p2p", "allreduce")


class GossipHandle:
    """A round in flight; :meth:`wait_and_mix_` completes it (at most once)."""

    def __init__(self, works: list[dist.Work], finish: Callable[[], None] | None) -> None:
        self._works = works
        self._finish = finish

    def wait_and_mix_(self) -> None:
        works, self._works = self._works, []
        for work in works:
            work.wait()
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()


_DONE = GossipHandle([], None)


class LocalGossiper:
    """World of one (or no process group): nothing to exchange, mixing is the identity."""

    rank = 0
    world_size = 1

    def __init__(self, topology: Topology | None = None) -> None:
        self.topology = topology

    def start(self, buffers: Sequence[Tensor], step: int) -> GossipHandle:
        return _DONE


class Gossiper:
    """Neighbour exchange over a process group, following a :class:`Topology`.

    Args:
        topology: the schedule; its ``world_size`` must equal the group's size.
        group: the process group (default: the world). Topology ranks are ranks in this group.
        transport: ``"auto"`` (see the module docstring), ``"p2p"`` or ``"allreduce"`` (the
            latter needs every round to be a partition into uniform groups).

    Sub-groups for all-reduce are created here, collectively: every rank of ``group`` must
    build its ``Gossiper`` at the same point of the program.
    """

    def __init__(
        self, topology: Topology, group: dist.ProcessGroup | None = None, transport: str = "auto"
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        # the world group is typed Optional, but it is set once the process group is initialised
        self.group = cast(dist.ProcessGroup, group if group is not None else dist.group.WORLD)
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        if topology.world_size != self.world_size:
            raise ValueError(
                f"topology {topology!r} is for {topology.world_size} ranks, "
                f"the process group has {self.world_size}"
            )
        self.topology = topology
        self.transport = transport
        self._global = [dist.get_global_rank(self.group, r) for r in range(self.world_size)]
        self._subgroups: dict[tuple[int, ...], object] = {}
        self._recv: dict[int, list[Tensor]] = {}  # in-neighbour slot -> one buffer per bucket
        if transport == "allreduce":
            for r in range(topology.period):
                if topology.groups(r) is None:
                    raise ValueError(
                        f"transport='allreduce' needs uniform group rounds, but round {r} of "
                        f"{topology!r} has arbitrary weights; use 'p2p' or 'auto'"
                    )
        self._create_subgroups()

    def _uses_allreduce(self, group: tuple[int, ...]) -> bool:
        if self.transport == "p2p":
            return False
        if self.transport == "allreduce":
            return len(group) > 1
        return len(group) > 2

    def _create_subgroups(self) -> None:
        needed = sorted(
            {
                g
                for r in range(self.topology.period)
                for g in self.topology.groups(r) or []
                if self._uses_allreduce(g) and len(g) < self.world_size
            }
        )
        if needed and dist.get_world_size() != self.world_size:
            # new_group is a collective of the *whole* world, and the ranks outside our group
            # never build this Gossiper; so a sub-world group gossips point-to-point only
            if self.transport == "allreduce":
                raise ValueError(
                    "transport='allreduce' needs sub-groups, which can only be created when the "
                    "optimizer's process group is the whole world; use 'p2p' or 'auto'"
                )
            self.transport = "p2p"
            return
        for g in needed:
            # every rank creates every group, in one global order, members or not: that is
            # what new_group requires (use_local_synchronization names a group by how many
            # groups each member made before, which differs between members here)
            pg = dist.new_group([self._global[r] for r in g])
            if self.rank in g:
                self._subgroups[g] = pg
        for r in range(self.topology.period):
            for g in self.topology.groups(r) or []:
                if self._uses_allreduce(g) and len(g) == self.world_size:
                    self._subgroups[g] = self.group

    def _buffers(self, slot: int, buffers: Sequence[Tensor]) -> list[Tensor]:
        """Receive buffers for in-neighbour number ``slot``, allocated once and reused."""
        out = self._recv.get(slot)
        if out is None or [(o.shape, o.dtype, o.device) for o in out] != [
            (b.shape, b.dtype, b.device) for b in buffers
        ]:
            out = self._recv[slot] = [torch.empty_like(b) for b in buffers]
        return out

    def start(self, buffers: Sequence[Tensor], step: int) -> GossipHandle:
        """Launch round ``step`` for ``buffers``; every rank must call it for every step."""
        groups = self.topology.groups(step)
        if groups is not None:
            mine = next(g for g in groups if self.rank in g)
            if len(mine) == 1:
                return _DONE
            if self._uses_allreduce(mine):
                return self._start_allreduce(buffers, mine)
        return self._start_p2p(buffers, step)

    def _start_allreduce(self, buffers: Sequence[Tensor], group: tuple[int, ...]) -> GossipHandle:
        copies = self._buffers(0, buffers)
        pg = self._subgroups[group]
        works = []
        for src, dst in zip(buffers, copies):
            dst.copy_(src)
            works.append(dist.all_reduce(dst, group=pg, async_op=True))
        scale = 1.0 / len(group)

        def finish() -> None:
            for buf, total in zip(buffers, copies):
                torch.mul(total, scale, out=buf)

        return GossipHandle(works, finish)

    def _start_p2p(self, buffers: Sequence[Tensor], step: int) -> GossipHandle:
        weights = self.topology.weights(self.rank, step)
        sources = self.topology.in_peers(self.rank, step)
        received = [self._buffers(slot, buffers) for slot in range(len(sources))]
        ops = []
        for b, buf in enumerate(buffers):
            for peer in self.topology.out_peers(self.rank, step):
                ops.append(dist.P2POp(dist.isend, buf, self._global[peer], self.group, tag=b))
            for slot, peer in enumerate(sources):
                ops.append(
                    dist.P2POp(dist.irecv, received[slot][b], self._global[peer], self.group, tag=b)
                )
        works = dist.batch_isend_irecv(ops) if ops else []
        own = weights.get(self.rank, 0.0)
        peer_weights = [weights[j] for j in sources]

        def finish() -> None:
            # only now, after every send of `buf` completed, may `buf` be overwritten
            for b, buf in enumerate(buffers):
                if len(sources) == 1 and own == peer_weights[0]:
                    buf.add_(received[0][b]).mul_(own)  # a pair: (x_i + x_j) * 1/2
                    continue
                buf.mul_(own)
                for slot, w in enumerate(peer_weights):
                    buf.add_(received[slot][b], alpha=w)

        return GossipHandle(works, finish)
