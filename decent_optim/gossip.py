"""The gossip engine: the one module that talks to :mod:`torch.distributed`.

``Gossiper.start(buffers, step)`` launches round ``step`` of the topology asynchronously and
returns a :class:`GossipHandle`; ``handle.wait_and_mix_()`` finishes the exchange and overwrites
each buffer with ``sum_j W(step)[rank, j] * buffer_j``. Between the two calls the caller may read
the buffers (forward and backward) but must not write them: they are sent as they are, without
a copy. An optimizer calls ``handle.wait_and_mix_unscaled_()`` instead: a round whose weights are
all equal (a pair: 1/2) then leaves the plain sum ``sum_j buffer_j`` in the buffer, one pass, and
hands the factor back for the caller to apply -- usually folded into its own update, so that
mixing and updating cost one pass over the buffer less.

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

import datetime
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from decent_optim.topologies import Topology

__all__ = [
    "TRANSPORTS",
    "GossipError",
    "GossipHandle",
    "Gossiper",
    "LocalGossiper",
    "broadcast_",
    "check_same_parameters",
    "comm_device",
    "resolve_group",
]

TRANSPORTS = ("auto", "p2p", "allreduce")


class GossipError(RuntimeError):
    """A gossip round could not complete: a peer died, stopped stepping, or timed out."""


class GossipHandle:
    """A round in flight. :meth:`wait` completes the exchange, :meth:`mix_` applies it.

    ``wait_and_mix_`` does both. Waiting without mixing lets a caller use the process group or
    the buffers in between (e.g. a global average for evaluation) and still mix this round later.

    ``finish`` (run by :meth:`mix_unscaled_`, after every transfer completed) writes the mix into
    ``buffers`` up to one scalar factor per buffer, and returns those factors (1.0: none left).
    """

    def __init__(
        self,
        works: list[tuple[Any, int | None]],
        finish: Callable[[], list[float]] | None,
        *,
        buffers: Sequence[Tensor] = (),
        round: int = 0,
        rank: int = 0,
        timeout: datetime.timedelta | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self._works = works  # (work, peer it talks to, or None for a group collective)
        self._finish = finish
        self._buffers = list(buffers)
        self._on_close = on_close  # run once the received values are consumed or dropped
        self.round, self.rank, self.timeout = round, rank, timeout

    @property
    def is_noop(self) -> bool:
        """True for a round with nothing to exchange or mix (e.g. a rank sitting out)."""
        return not self._works and self._finish is None

    def wait(self) -> None:
        """Block until every send and receive of the round completed (at most ``timeout``)."""
        works, self._works = self._works, []
        deadline = None if self.timeout is None else time.monotonic() + self.timeout.total_seconds()
        for k, (work, _) in enumerate(works):
            try:
                if deadline is None:
                    work.wait()
                else:
                    left = max(deadline - time.monotonic(), 0.001)
                    work.wait(datetime.timedelta(seconds=left))
            except RuntimeError as err:
                waiting = sorted({p for _, p in works[k:] if p is not None})
                who = f"peer(s) {waiting}" if waiting else "its gossip group"
                limit = (
                    "" if self.timeout is None else f" (timeout {self.timeout.total_seconds():g} s)"
                )
                raise GossipError(
                    f"[rank {self.rank}] gossip round {self.round}: waiting on {who} failed{limit}. "
                    "A peer may have died, hung, or called step() fewer times than this rank; "
                    f"every rank must call step() once per iteration. Cause: {err}"
                ) from err

    def mix_(self) -> None:
        """Overwrite the buffers with the weighted mix (once; after :meth:`wait`)."""
        for buf, scale in zip(self._buffers, self.mix_unscaled_()):
            if scale != 1.0:
                buf.mul_(scale)

    def mix_unscaled_(self) -> list[float]:
        """:meth:`mix_` without its last multiplication; returns the factor left per buffer.

        Afterwards buffer ``b`` holds ``mixed_b / factors[b]``: for a round of equal weights
        ``w`` (a pair: 1/2) it holds the plain sum of the values, in one pass, and the factor is
        ``w``; otherwise the factor is 1.0 and the buffer is mixed. The caller must apply every
        factor other than 1.0 -- ``buf.mul_(factor)``, or folded into its own update of the
        buffer -- before the buffer is read as parameters or sent again. A pair's sum
        ``x_i + x_j`` is the same floating-point number on both ranks, so as long as both
        apply the factor the same way they keep identical values.
        """
        if self._works:
            raise RuntimeError("mix_() before wait(): the round is still in flight")
        finish, self._finish = self._finish, None
        factors = finish() if finish is not None else [1.0] * len(self._buffers)
        self._close()
        return factors

    def discard(self) -> None:
        """Complete the exchange but drop its values (the parameters stay as they are)."""
        self.wait()
        self._finish = None
        self._close()

    def _close(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    def wait_and_mix_(self) -> None:
        self.wait()
        self.mix_()

    def wait_and_mix_unscaled_(self) -> list[float]:
        """:meth:`wait`, then :meth:`mix_unscaled_`; returns its factors (see there)."""
        self.wait()
        return self.mix_unscaled_()


_DONE = GossipHandle([], None)


class LocalGossiper:
    """World of one (or no process group): nothing to exchange, mixing is the identity."""

    rank = 0
    world_size = 1

    def __init__(self, topology: Topology | None = None) -> None:
        self.topology = topology

    def start(
        self, buffers: Sequence[Tensor], step: int, *, global_average: bool = False
    ) -> GossipHandle:
        return _DONE

    def average_(self, tensors: Sequence[Tensor]) -> None:
        """The mean over one rank is the tensor itself."""

    def idle_buffer(self, index: int, like: Tensor) -> Tensor | None:
        """No communication buffers in a world of one."""
        return None


class Gossiper:
    """Neighbour exchange over a process group, following a :class:`Topology`.

    Args:
        topology: the schedule; its ``world_size`` must equal the group's size.
        group: the process group (default: the world). Topology ranks are ranks in this group.
        transport: ``"auto"`` (see the module docstring), ``"p2p"`` or ``"allreduce"`` (the
            latter needs every round to be a partition into uniform groups).
        timeout: how long :meth:`GossipHandle.wait` waits for a round before raising
            :class:`GossipError` naming the round and the peers; ``None`` waits as long as the
            process group allows.

    Sub-groups for all-reduce are created here, collectively: every rank of ``group`` must
    build its ``Gossiper`` at the same point of the program.
    """

    def __init__(
        self,
        topology: Topology,
        group: Any = None,
        transport: str = "auto",
        timeout: datetime.timedelta | None = None,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        if topology.world_size != self.world_size:
            raise ValueError(
                f"topology {topology!r} is for {topology.world_size} ranks, "
                f"the process group has {self.world_size}"
            )
        self.topology = topology
        self.transport = transport
        self.timeout = timeout
        self._global = [dist.get_global_rank(self.group, r) for r in range(self.world_size)]  # type: ignore[arg-type]  # resolved to a ProcessGroup above
        self._subgroups: dict[tuple[int, ...], object] = {}
        self._recv: dict[int, list[Tensor]] = {}  # in-neighbour slot -> one buffer per bucket
        self._in_flight = False  # a round holds the receive buffers (started, not yet mixed)
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

    def idle_buffer(self, index: int, like: Tensor) -> Tensor | None:
        """A receive buffer of bucket ``index`` that no round is using now, or None.

        Between ``wait_and_mix_`` and the next :meth:`start` the receive buffers hold nothing
        anyone needs; the optimizer uses one as scratch for its update instead of allocating
        another parameter-sized buffer. It must be done with it before the next :meth:`start`.
        """
        if self._in_flight:
            return None
        slot = self._recv.get(0)
        if slot is None or index >= len(slot):
            return None
        buf = slot[index]
        if (buf.shape, buf.dtype, buf.device) != (like.shape, like.dtype, like.device):
            return None
        return buf

    def _handle(
        self,
        works: list,
        finish: Callable[[], list[float]],
        buffers: Sequence[Tensor],
        step: int,
    ) -> GossipHandle:
        self._in_flight = True  # the receive buffers hold this round until it is closed

        def close() -> None:
            self._in_flight = False

        return GossipHandle(
            works, finish, buffers=buffers, round=step, rank=self.rank, timeout=self.timeout,
            on_close=close,
        )  # fmt: skip

    def start(
        self, buffers: Sequence[Tensor], step: int, *, global_average: bool = False
    ) -> GossipHandle:
        """Launch round ``step`` for ``buffers``; every rank must call it for every step.

        With ``global_average`` the round averages over the whole group instead of following
        the topology (periodic global averaging); every rank must pass the same value.
        """
        if global_average:
            return self._start_allreduce(buffers, tuple(range(self.world_size)), self.group, step)
        groups = self.topology.groups(step)
        if groups is not None:
            mine = next(g for g in groups if self.rank in g)
            if len(mine) == 1:
                return _DONE
            if self._uses_allreduce(mine):
                return self._start_allreduce(buffers, mine, self._subgroups[mine], step)
        return self._start_p2p(buffers, step)

    def average_(self, tensors: Sequence[Tensor]) -> None:
        """In place, synchronously: every tensor becomes its mean over the group's ranks."""
        works = [dist.all_reduce(t, group=self.group, async_op=True) for t in tensors]
        GossipHandle([(w, None) for w in works], None, rank=self.rank, timeout=self.timeout).wait()
        for t in tensors:
            t.div_(self.world_size)

    def _start_allreduce(
        self, buffers: Sequence[Tensor], group: tuple[int, ...], pg: Any, step: int
    ) -> GossipHandle:
        copies = self._buffers(0, buffers)
        works = []
        for src, dst in zip(buffers, copies):
            dst.copy_(src)
            works.append((dist.all_reduce(dst, group=pg, async_op=True), None))
        scale = 1.0 / len(group)

        def finish() -> list[float]:
            # scaling while copying back costs nothing extra: no factor is left to the caller
            for buf, total in zip(buffers, copies):
                torch.mul(total, scale, out=buf)
            return [1.0] * len(buffers)

        return self._handle(works, finish, buffers, step)

    def _start_p2p(self, buffers: Sequence[Tensor], step: int) -> GossipHandle:
        weights = self.topology.weights(self.rank, step)
        sources = self.topology.in_peers(self.rank, step)
        received = [self._buffers(slot, buffers) for slot in range(len(sources))]
        ops, peers = [], []
        # every receive before any send: gloo moves a buffer only after the peer's "ready to
        # receive" notice arrived, and notices travel behind data on the same TCP stream. A rank
        # that reaches the round after its peer would otherwise queue its whole buffer ahead of
        # its own notice, and the two directions would cross the link one after the other
        for b in range(len(buffers)):
            for slot, peer in enumerate(sources):
                ops.append(
                    dist.P2POp(dist.irecv, received[slot][b], self._global[peer], self.group, tag=b)
                )
                peers.append(peer)
        for b, buf in enumerate(buffers):
            for peer in self.topology.out_peers(self.rank, step):
                ops.append(dist.P2POp(dist.isend, buf, self._global[peer], self.group, tag=b))
                peers.append(peer)
        works = list(zip(dist.batch_isend_irecv(ops), peers)) if ops else []
        own = weights.get(self.rank, 0.0)
        peer_weights = [weights[j] for j in sources]
        uniform = own > 0 and all(w == own for w in peer_weights)

        def finish() -> list[float]:
            # only now, after every send of `buf` completed, may `buf` be overwritten
            for b, buf in enumerate(buffers):
                if uniform:  # e.g. a pair: leave x_i + x_j, the caller applies the 1/2
                    for slot in range(len(sources)):
                        buf.add_(received[slot][b])
                    continue
                buf.mul_(own)
                for slot, w in enumerate(peer_weights):
                    buf.add_(received[slot][b], alpha=w)
            return [own if uniform else 1.0] * len(buffers)

        return self._handle(works, finish, buffers, step)


def resolve_group(process_group: Any) -> tuple[Any, int]:
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise RuntimeError(
                "process_group was given but torch.distributed is not initialised; call "
                "dist.init_process_group(...) first"
            )
        return None, 1
    group = process_group if process_group is not None else dist.group.WORLD
    return group, dist.get_world_size(group)


def comm_device(group: Any, params: list[Tensor]) -> torch.device:
    backend = dist.get_backend(group)
    devices = {p.device.type for p in params}
    if backend == "nccl":
        if devices - {"cuda"}:
            raise ValueError(
                f"the NCCL backend exchanges CUDA tensors only, but parameters are on {sorted(devices)}; "
                "move the model to the GPU before building the optimizer, or use gloo"
            )
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo" and devices - {"cpu"}:
        raise ValueError(
            f"the gloo backend sends CPU tensors only, but parameters are on {sorted(devices)}; "
            "use the NCCL backend for GPU training"
        )
    return torch.device("cpu")


def check_same_parameters(params: list[Tensor], group: Any, device: torch.device) -> None:
    """All-gather a fingerprint of the parameter shapes and dtypes; raise on any difference."""
    desc = ";".join(f"{tuple(p.shape)}:{p.dtype}" for p in params)
    mine = torch.tensor(
        [len(params), sum(p.numel() for p in params), zlib.crc32(desc.encode())],
        dtype=torch.int64,
        device=device,
    )
    world = dist.get_world_size(group)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    rows = [tuple(int(v) for v in t.tolist()) for t in everyone]
    differ = [r for r in range(world) if rows[r] != rows[0]]
    if differ:
        detail = ", ".join(
            f"rank {r}: {rows[r][0]} tensors / {rows[r][1]} elements" for r in [0, *differ]
        )
        raise ValueError(
            "the parameters differ across ranks (shapes or dtypes); every rank must build the same "
            f"model before the optimizer. {detail}"
            + (
                ""
                if len({r[:2] for r in rows}) > 1
                else " (same sizes, different shapes or dtypes)"
            )
        )


def broadcast_(tensors: Sequence[Tensor], group: Any) -> None:
    """In place: every rank's tensors become group rank 0's."""
    src = dist.get_global_rank(group, 0)
    for t in tensors:
        dist.broadcast(t, src=src, group=group)
