"""Which ranks reached a collective: a mark per rank in the store, read only after a timeout.

A group collective that times out cannot say which rank is missing (every rank waits on all
the others). For the collectives where "which rank never came" is the useful answer -- a rank
that skipped ``decent_optim.checkpoint.load`` -- each rank first sets a key of its own in the
process group's key-value store (the one ``init_process_group`` rendezvoused through), and a
rank whose wait timed out reads which keys are absent. The happy path costs one ``set`` per
rank; the reads happen only after a timeout.

Keys are numbered per collective name and group, in the order this process reached them, so
every rank that reaches the n-th ``load`` on a group marks the same key. Without a store (no
process group, or a torch without the private accessor) nothing is marked and the error says
only what the group collective knows.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch.distributed as dist

__all__ = ["Arrival"]

#: per (collective name, group's global ranks), how many this process has reached
_REACHED: dict[tuple[str, tuple[int, ...]], int] = {}


def _store() -> Any:
    try:  # private, but there since torch 1.x; the optional part of an error message only
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


class Arrival:
    """This rank's mark at collective ``what`` on ``group``, set when it is made."""

    def __init__(self, what: str, group: Any) -> None:
        ranks = tuple(dist.get_process_group_ranks(group))
        count = _REACHED[(what, ranks)] = _REACHED.get((what, ranks), 0) + 1
        tag = hashlib.blake2b(f"{what}|{ranks}".encode(), digest_size=8).hexdigest()
        self._prefix = f"decent_optim/arrived/{tag}/{count}/"
        self._size, self._rank = len(ranks), dist.get_rank(group)
        self._store = _store()
        if self._store is not None:
            try:
                self._store.set(f"{self._prefix}{self._rank}", b"1")
            except Exception:  # a store that cannot be written: no names in the error
                self._store = None

    def missing(self) -> list[int]:
        """Group ranks that have not marked their arrival (empty when it cannot be told)."""
        if self._store is None:
            return []
        try:
            return [
                r
                for r in range(self._size)
                if r != self._rank and not self._store.check([f"{self._prefix}{r}"])
            ]
        except Exception:  # the store's host died with its rank: nothing to tell
            return []
