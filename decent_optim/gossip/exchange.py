"""Exchange strategies: the interface every way of carrying out a gossip round implements.

A :class:`~decent_optim.gossip.Gossiper` decides, once per round of the topology's period, which
:class:`Exchange` carries that round out for this rank (see its docstring for the choice); the
strategy moves the buffers and returns a :class:`~decent_optim.gossip.GossipHandle` whose
``finish`` leaves the mix in them. A new way of exchanging (compressed values, push-sum) is a new
subclass in its own module plus one line in the Gossiper's choice; nothing above the gossip
layer changes.

What the strategies of one Gossiper share lives in :class:`Link`: the process group and the
rank's place in it, the timeout, and the receive buffers, which are allocated once and reused
every round (and lent to the optimizer as scratch between rounds: :meth:`Link.idle_buffer`).
"""

from __future__ import annotations

import datetime
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from decent_optim.gossip.handle import DONE, GossipHandle, PendingMix

__all__ = ["Exchange", "Idle", "Link"]


class Link:
    """This rank's connection to its process group, shared by the exchange strategies.

    Args:
        group: the process group the topology's ranks index.
        rank, world_size: this rank's place in ``group`` and the group's size.
        global_ranks: the world rank of every group rank (point-to-point ops address them).
        timeout: how long a handle waits before raising :class:`GossipError`.
        first_tag: the tag of bucket 0's point-to-point messages; bucket ``b`` uses
            ``first_tag + b``. Optimizers sharing a process group use disjoint ranges, so a
            message of one can never be received into a buffer of another.
    """

    def __init__(
        self,
        group: Any,
        rank: int,
        world_size: int,
        global_ranks: list[int],
        timeout: datetime.timedelta | None,
        first_tag: int = 0,
    ) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size
        self.global_ranks = global_ranks
        self.timeout, self.first_tag = timeout, first_tag
        self._slots: dict[int, list[Tensor]] = {}  # in-neighbour slot -> one buffer per bucket
        self._scratch: dict[object, Tensor] = {}
        self._in_flight = False  # a round holds the receive buffers (started, not yet mixed)
        #: what a failed wait for a round says usually causes it, in place of the default
        #: (the schedule of rounds knows best: see Gossiper.hint)
        self.hint: str | None = None
        #: payload bytes this rank sent in rounds since construction (not the sums of step
        #: counts); an all-reduce counts what a ring all-reduce sends, :meth:`count_allreduce`
        self.bytes_sent = 0
        #: runs a handle's wait while watching for a change of membership (live membership's
        #: :meth:`~decent_optim.gossip.membership.Membership.watch`); None waits directly
        self.watch: Callable[[Callable[[], None]], None] | None = None

    def count_allreduce(self, tensor: Tensor, size: int) -> None:
        """Count an all-reduce of ``tensor`` over ``size`` ranks as a ring sends it:
        :math:`2 (k - 1) / k` of the tensor from every rank (the backend may choose otherwise)."""
        self.bytes_sent += 2 * (size - 1) * tensor.numel() * tensor.element_size() // size

    def receive_buffers(self, slot: int, like: Sequence[Tensor]) -> list[Tensor]:
        """Buffers shaped like ``like`` for in-neighbour number ``slot``, allocated once."""
        out = self._slots.get(slot)
        if out is None or [(o.shape, o.dtype, o.device) for o in out] != [
            (b.shape, b.dtype, b.device) for b in like
        ]:
            out = self._slots[slot] = [torch.empty_like(b) for b in like]
        return out

    def scratch(self, key: object, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A one-dimensional buffer for ``key``, allocated once (again only if it must grow).

        Strategies that need working space of their own during a round (payloads, partial
        sums) share it through here: only one round is in flight at a time.
        """
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel or (buf.dtype, buf.device) != (dtype, device):
            buf = self._scratch[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

    def idle_buffer(self, index: int, like: Tensor) -> Tensor | None:
        """A receive buffer of bucket ``index`` that no round is using now, or None.

        Between mixing a round and starting the next one the receive buffers hold nothing
        anyone needs; the optimizer uses one as scratch for its update instead of allocating
        another parameter-sized buffer. It must be done with it before the next round starts.
        """
        if self._in_flight:
            return None
        slot = self._slots.get(0)
        if slot is None or index >= len(slot):
            return None
        buf = slot[index]
        if (buf.shape, buf.dtype, buf.device) != (like.shape, like.dtype, like.device):
            return None
        return buf

    def handle(
        self,
        works: list[tuple[Any, int | None]],
        finish: Callable[[bool], list[PendingMix]],
        buffers: Sequence[Tensor],
        step: int,
        phases: Sequence[Callable[[], list[tuple[Any, int | None]]]] = (),
    ) -> GossipHandle:
        """The handle of a round that holds the receive buffers until it is mixed or dropped
        (``phases``: the exchanges its :meth:`~GossipHandle.wait` runs after ``works``)."""
        self._in_flight = True

        def release() -> None:
            self._in_flight = False

        return GossipHandle(
            works,
            finish,
            buffers=buffers,
            round=step,
            rank=self.rank,
            timeout=self.timeout,
            on_close=release,
            hint=self.hint,
            phases=phases,
            watch=self.watch,
        )


class Exchange(ABC):
    """One way of carrying out a round for this rank: move the buffers, then mix them.

    ``start`` must not write ``buffers`` (the caller may read them while the round travels);
    the returned handle's ``finish`` may, after every transfer completed.
    """

    @abstractmethod
    def start(self, buffers: Sequence[Tensor], step: int) -> GossipHandle:
        """Launch round ``step`` for ``buffers``; every rank of the round launches it too."""


class Idle(Exchange):
    """A round in which this rank mixes with nobody (it sits out, or the world is one rank)."""

    def start(self, buffers: Sequence[Tensor], step: int) -> GossipHandle:
        return DONE
