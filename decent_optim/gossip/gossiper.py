"""Gossiper: carries out the topology's rounds over a process group, choosing a strategy per round."""

from __future__ import annotations

import datetime
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor

from decent_optim.gossip import codecs
from decent_optim.gossip.allreduce import GroupAllReduce
from decent_optim.gossip.codec_base import Codec
from decent_optim.gossip.collectives import identical, wait_bounded
from decent_optim.gossip.compressed import CompressedGroup, loader
from decent_optim.gossip.exchange import Exchange, Idle, Link
from decent_optim.gossip.failures import GossipError
from decent_optim.gossip.handle import GossipHandle
from decent_optim.gossip.local import LocalGossiper
from decent_optim.gossip.nodes import NodeAverage, Parts
from decent_optim.gossip.p2p import PointToPoint
from decent_optim.gossip.sums import sum_async
from decent_optim.topologies import Topology

__all__ = ["TRANSPORTS", "Gossiper", "LocalGossiper"]  # LocalGossiper: gossip.local

TRANSPORTS = ("auto", "p2p", "allreduce")
#: point-to-point tags per optimizer slot (so at most this many buckets per optimizer)
TAGS_PER_SLOT = 1 << 20


class Gossiper:
    """Neighbour exchange over a process group, following a :class:`Topology`.

    Each round of the period is carried out by one :class:`~decent_optim.gossip.exchange.Exchange`,
    chosen here once: a rank alone in its group sits the round out; a uniform group with several
    ranks on each of several nodes averages by node, so that the slow link carries one copy per
    direction (:class:`~decent_optim.gossip.nodes.NodeAverage`); any other uniform group of three
    or more ranks all-reduces on a sub-group; pairs and rounds with arbitrary weights go point to
    point. ``transport`` forces one strategy: ``"p2p"``, or ``"allreduce"`` (which needs every
    round to be a partition into uniform groups). With ``compression``, a group whose members
    live on more than one node (rank // ``topology.local_world_size``) exchanges compressed
    differences against public copies instead (:class:`~decent_optim.gossip.compressed.CompressedGroup`);
    groups inside one node stay exact.

    Args:
        topology: the schedule; its ``world_size`` must equal the group's size.
        group: the process group (default: the world). Topology ranks are ranks in this group.
        transport: ``"auto"``, ``"p2p"`` or ``"allreduce"``.
        timeout: how long :meth:`GossipHandle.wait` waits for a round before raising
            :class:`GossipError` naming the round and the peers; ``None`` waits as long as the
            process group allows.
        slot: which of the optimizers sharing ``group`` this gossiper serves (0 for the first);
            its point-to-point messages carry tags of their own (see
            :func:`~decent_optim.gossip.collectives.channel` for the collectives).
        compression: None (exact), a codec of :mod:`decent_optim.gossip.codecs` or its name
            (``"bf16"``, ``"int8"``, ``"int4"``, ``"top1%+int2"``, ...: :func:`.codecs.get`) for
            the groups that cross nodes; needs every round to be a partition into uniform groups.
        by_node: whether a group with several ranks on each of several nodes is exchanged part
            by part (:mod:`~decent_optim.gossip.nodes`), which saves slow-link traffic (one copy
            per direction); False: every rank exchanges its own copy.
        deferred: whether those part-by-part rounds do all their waiting in
            :meth:`GossipHandle.wait` (their launch only posts; same bits), which the caller may
            run in a thread of its own: no launch waits for a node-mate (``uneven=True``).

    Sub-groups for all-reduce are created here, collectively: every rank of ``group`` must
    build its ``Gossiper`` at the same point of the program.
    """

    def __init__(
        self,
        topology: Topology,
        group: Any = None,
        transport: str = "auto",
        timeout: datetime.timedelta | None = None,
        slot: int = 0,
        compression: str | Codec | None = None,
        by_node: bool = True,
        deferred: bool = False,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self._codec = None if compression is None else codecs.get(compression)
        group = group if group is not None else dist.group.WORLD
        world_size = dist.get_world_size(group)
        if topology.world_size != world_size:
            raise ValueError(
                f"topology {topology!r} is for {topology.world_size} ranks, "
                f"the process group has {world_size}"
            )
        for r in range(topology.period):
            if topology.groups(r) is None and transport == "allreduce":
                raise ValueError(
                    f"transport='allreduce' needs uniform group rounds, but round {r} of "
                    f"{topology!r} has arbitrary weights; use 'p2p' or 'auto'"
                )
            if topology.groups(r) is None and compression is not None:
                raise ValueError(
                    f"compression={compression!r} needs rounds that average uniform groups "
                    f"(complete, ring, one-peer-exp, alternating-exp-ring, or a CustomTopology "
                    f"of group averages), but round {r} of {topology!r} has arbitrary weights; "
                    "use compression=None with this topology"
                )
        global_ranks = [dist.get_global_rank(group, r) for r in range(world_size)]
        self._link = Link(
            group, dist.get_rank(group), world_size, global_ranks, timeout, slot * TAGS_PER_SLOT
        )
        self.topology, self.transport, self.timeout = topology, transport, timeout
        self._node_width = topology.local_world_size if by_node else 1
        self.deferred = deferred  # read by live membership (it builds the next one alike)
        self.group, self.rank, self.world_size = group, self._link.rank, world_size
        self._compressed: dict[tuple[int, ...], CompressedGroup] = {}
        subgroups = self._create_subgroups()
        self._rounds = [self._choose(r, subgroups) for r in range(topology.period)]
        self._global = GroupAllReduce(self._link, world_size, group)
        if compression is not None and not any(
            self._compresses(g) for r in range(topology.period) for g in topology.groups(r) or []
        ):
            warnings.warn(
                f"compression={compression!r} has no effect: no round of {topology!r} averages "
                f"across nodes (local_world_size={topology.local_world_size}), and exchanges "
                "inside a node stay exact. Pass local_world_size=1 to treat every worker as a node",
                UserWarning,
                stacklevel=2,
            )

    def _compresses(self, members: tuple[int, ...]) -> bool:
        """Whether the group's rounds are compressed: it spans nodes and a codec was given."""
        if self._codec is None:
            return False
        return Parts(members, members[0], self.topology.local_world_size).crosses_nodes

    def _by_node(self, members: tuple[int, ...]) -> bool:
        """Whether an exact group round goes by node (:mod:`~decent_optim.gossip.nodes`): its
        ranks live on several nodes, several on each, and no transport is forced."""
        parts = Parts(members, members[0], self._node_width)
        return self.transport == "auto" and parts.crosses_nodes and parts.width > 1

    def _compressed_group(self, members: tuple[int, ...]) -> CompressedGroup:
        """The strategy of a compressed group: one per group, whose public copies serve every
        round of the period that has this group."""
        found = self._compressed.get(members)
        if found is None:
            parts = Parts(members, self.rank, self._node_width)
            codec = self._codec
            assert codec is not None  # only groups that compress get here
            found = CompressedGroup(self._link, parts, codec, self.deferred)
            self._compressed[members] = found
        return found

    def _uses_allreduce(self, members: tuple[int, ...]) -> bool:
        if self.transport == "p2p":
            return False
        if self.transport == "allreduce":
            return len(members) > 1
        return len(members) > 2

    def _create_subgroups(self) -> dict[tuple[int, ...], Any]:
        """The process group of every all-reducing group of the period that holds this rank."""
        needed = sorted(
            {
                g
                for r in range(self.topology.period)
                for g in self.topology.groups(r) or []
                if self._uses_allreduce(g)
                and len(g) < self.world_size
                and not (self._compresses(g) or self._by_node(g))
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
            return {}
        made: dict[tuple[int, ...], Any] = {tuple(range(self.world_size)): self.group}
        for g in needed:
            # every rank creates every group, in one global order, members or not: that is
            # what new_group requires (use_local_synchronization names a group by how many
            # groups each member made before, which differs between members here)
            pg = dist.new_group([self._link.global_ranks[r] for r in g])
            if self.rank in g:
                made[g] = pg
        return made

    def _choose(self, r: int, subgroups: dict[tuple[int, ...], Any]) -> Exchange:
        groups = self.topology.groups(r)
        if groups is None:
            return PointToPoint(self._link, self.topology)
        mine = next(g for g in groups if self.rank in g)
        if len(mine) == 1:
            return Idle()
        if self._compresses(mine):
            return self._compressed_group(mine)
        if self._by_node(mine):
            parts = Parts(mine, self.rank, self.topology.local_world_size)
            return NodeAverage(self._link, parts, self.deferred)
        if self._uses_allreduce(mine):
            return GroupAllReduce(self._link, len(mine), subgroups[mine])
        return PointToPoint(self._link, self.topology)

    def start(
        self, buffers: Sequence[Tensor], step: int, *, global_average: bool = False
    ) -> GossipHandle:
        """Launch round ``step`` for ``buffers``; every rank must call it for every step.

        With ``global_average`` the round averages over the whole group instead of following
        the topology (periodic global averaging); every rank must pass the same value.
        """
        exchange = self._global if global_average else self._rounds[step % len(self._rounds)]
        try:
            return exchange.start(buffers, step)
        except RuntimeError as err:  # a dead peer's transport error, raised by the send itself
            if isinstance(err, GossipError):
                raise
            peers = sorted(
                set(self.topology.in_peers(self.rank, step))
                | set(self.topology.out_peers(self.rank, step))
            )
            why = "a peer has probably died" if self.hint is None else self.hint
            error = GossipError(
                f"[rank {self.rank}] gossip round {step}: launching it failed, with peer(s) "
                f"{peers}; {why}. Cause: {err}"
            )
            error.peers = tuple(peers) if len(peers) == 1 else ()  # else: which one is unknown
            raise error from err

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank sent in rounds since construction (:attr:`.Link.bytes_sent`)."""
        return self._link.bytes_sent

    @property
    def hint(self) -> str | None:
        """What a failed round says usually causes it (None: the default, for step-locked
        rounds); the schedule of rounds sets it."""
        return self._link.hint

    @hint.setter
    def hint(self, text: str | None) -> None:
        self._link.hint = text

    @property
    def timeout(self) -> datetime.timedelta | None:
        """How long a round's wait lasts before it raises (None: the group's timeout); live
        membership sets it where the optimizer was given none (optim.live_owner)."""
        return self._link.timeout

    @timeout.setter
    def timeout(self, timeout: datetime.timedelta | None) -> None:
        self._link.timeout = timeout

    @property
    def watch(self) -> Callable[[Callable[[], None]], None] | None:
        """What runs the rounds' waits while watching for a change of membership (live
        membership's :meth:`~decent_optim.gossip.membership.Membership.watch`); None: no one."""
        return self._link.watch

    @watch.setter
    def watch(self, watch: Callable[[Callable[[], None]], None] | None) -> None:
        self._link.watch = watch

    def average_(self, tensors: Sequence[Tensor], what: str = "the global average") -> None:
        """In place, synchronously: every tensor becomes its mean over the group's ranks
        (waited for at most the timeout; ``what`` names it in the error)."""
        works = [dist.all_reduce(t, group=self.group, async_op=True) for t in tensors]
        wait_bounded(works, self.group, self.timeout, what)
        for t in tensors:
            t.div_(self.world_size)

    def sum_async(
        self, values: Tensor, what: str = "the step count", hint: str | None = None
    ) -> GossipHandle:
        """Launch the sum of ``values`` over the group's ranks without waiting
        (:func:`~decent_optim.gossip.sums.sum_async`; ``what`` and ``hint`` for its error)."""
        return sum_async(self._link, values, self._link.first_tag + TAGS_PER_SLOT - 1, what, hint)

    def identical(self, values: Tensor, what: str = "a check") -> Callable[[], bool]:
        """Whether every rank passed bit-identical, nonzero ``values``: a collective launched
        now (one small all-reduce); the returned function waits for the answer (at most the
        timeout; ``what`` names it in the error)."""
        return identical(values, self.group, self.timeout, what)

    def idle_buffer(self, index: int, like: Tensor) -> Tensor | None:
        """A receive buffer of bucket ``index`` that no round is using now (see :class:`Link`)."""
        return self._link.idle_buffer(index, like)

    def reset(self) -> None:
        """Forget the public copies of compressed groups; their next rounds send exact values.

        Every rank must call it at the same point (e.g. when resuming from a checkpoint).
        """
        for exchange in self._compressed.values():
            exchange.reset()

    def prime(self, buffers: Sequence[Tensor]) -> None:
        """Start compressed groups' public copies from ``buffers``, equal on every rank (the
        start-up broadcast), where the codec does (:attr:`.Codec.primes_from_start`)."""
        if self._codec is not None and self._codec.primes_from_start:
            for exchange in self._compressed.values():
                exchange.prime(buffers)

    def compressed_state(self) -> dict[str, Any] | None:
        """This rank's compressed groups' state for a checkpoint; None without compression."""
        if self._codec is None:
            return None
        groups = {",".join(map(str, m)): g.state() for m, g in self._compressed.items()}
        return {"codec": self._codec.name, "groups": groups}

    def compressed_loader(self, state: Any, buffers: Sequence[Tensor]) -> Callable[[], None]:
        """Check a saved :meth:`compressed_state` against this rank (:func:`.compressed.loader`)."""
        return loader(self._compressed, self._codec, state, buffers)
