"""The gossiper of a world of one (or no process group): nothing to exchange, mixing is the
identity. It has the methods of :class:`~decent_optim.gossip.gossiper.Gossiper` the optimizers
call, so that they never ask which of the two they hold."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from decent_optim.gossip.handle import DONE, GossipHandle
from decent_optim.topologies import Topology

__all__ = ["LocalGossiper"]


class LocalGossiper:
    """World of one (or no process group): nothing to exchange, mixing is the identity."""

    rank = 0
    world_size = 1
    bytes_sent = 0  # nothing is ever sent
    hint: str | None = None  # as Gossiper.hint (nothing fails here)

    def __init__(self, topology: Topology | None = None) -> None:
        del topology  # accepted so that both gossipers are built alike

    def start(
        self, buffers: Sequence[Tensor], step: int, *, global_average: bool = False
    ) -> GossipHandle:
        return DONE

    def average_(self, tensors: Sequence[Tensor], what: str = "") -> None:
        """The mean over one rank is the tensor itself."""

    def sum_async(self, values: Tensor, what: str = "", hint: str | None = None) -> GossipHandle:
        """The sum over one rank is the tensor itself."""
        return DONE

    def idle_buffer(self, index: int, like: Tensor) -> Tensor | None:
        """No communication buffers in a world of one."""
        return None

    def reset(self) -> None:
        """Nothing to forget."""

    def compressed_state(self) -> None:
        """No compressed groups."""

    def compressed_loader(self, state: Any, buffers: Sequence[Tensor]) -> Callable[[], None]:
        return lambda: None  # nothing to restore

    def identical(self, values: Tensor, what: str = "") -> Callable[[], bool]:
        """No other rank to compare with."""
        return lambda: False
