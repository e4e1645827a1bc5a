"""The group of live members after a change of membership, as every member sees it (its own
module so that the membership protocol and the log of its changes both read it)."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["View"]


class View(NamedTuple):
    """The group after a change: ``members[r]`` is the id (first rank) of the new rank ``r``."""

    generation: int
    members: tuple[int, ...]
    rank: int
    lost: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return len(self.members)
