"""What the runtime model needs of a topology: a structural type, so the model imports no torch."""

from __future__ import annotations

from typing import Protocol

__all__ = ["Schedule"]


class Schedule(Protocol):
    """What the model needs of a :class:`decent_optim.Topology`."""

    @property
    def world_size(self) -> int: ...
    @property
    def local_world_size(self) -> int: ...
    @property
    def period(self) -> int: ...

    def groups(self, step: int) -> list[tuple[int, ...]] | None: ...
    def out_peers(self, rank: int, step: int) -> list[int]: ...
    def in_peers(self, rank: int, step: int) -> list[int]: ...
