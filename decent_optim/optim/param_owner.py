"""Which decentralized optimizer a parameter belongs to, and how optimizers tell themselves apart.

A parameter becomes a view of one optimizer's flat buffer (:mod:`decent_optim.flat`), so:

* it belongs to one optimizer: building another on it hands it over, and the first refuses to
  step from then on (:meth:`ParamOwner.claim`) -- torch.optim would let both update it;
* two parameters must not share memory (tied weights made as two ``Parameter`` objects over one
  tensor, or one parameter given twice): each would get a place of its own in the buffer and
  the tie would be lost, so :func:`~decent_optim.flat_checks.check_disjoint` refuses them;
* optimizers sharing a process group get a *slot* each, the lowest free one on every rank
  (:meth:`ParamOwner.slots_taken` is gathered at start-up), which picks their channel and
  message tags (:func:`~decent_optim.gossip.collectives.channel`), and a *number*, the order in
  which this process built them on the group (:meth:`ParamOwner.number`), which the ranks
  compare (:mod:`decent_optim.optim.startup`).
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import Tensor

__all__ = ["ParamOwner"]


class ParamOwner:
    """An optimizer's place among the live decentralized optimizers of this process."""

    _live: weakref.WeakSet[ParamOwner] = weakref.WeakSet()
    # id(parameter) -> the parameter and its optimizer's membership (both weakly), its name
    _owners: dict[int, tuple[weakref.ref[Tensor], weakref.ref[ParamOwner], str | None]] = {}
    # process group -> how many decentralized optimizers this process has built on it
    _built: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()

    def __init__(self, name: str, group: Any, slot: int) -> None:
        self.name, self.group, self.slot = name, group, slot
        self.lost: str | None = None  # why this optimizer may no longer step

    @classmethod
    def number(cls, group: Any) -> int:
        """Count one more optimizer built on ``group`` (None: a world of one); its number."""
        if group is None:
            return 0
        count = cls._built.get(group, 0)
        cls._built[group] = count + 1
        return count

    @classmethod
    def slots_taken(cls, group: Any) -> int:
        """Bit mask of the slots live optimizers of ``group`` hold in this process."""
        return sum(1 << m.slot for m in list(cls._live) if m.group is group)

    def claim(self, params: list[Tensor], names: list[str | None]) -> None:
        """Own ``params``; an optimizer that had one of them may no longer step."""
        type(self)._live.add(self)
        owners = type(self)._owners
        for p, name in zip(params, names):
            entry = owners.get(id(p))
            old = entry[1]() if entry is not None and entry[0]() is p else None
            if old is not None and old is not self and old.lost is None:
                known = entry[2] or name  # type: ignore[index]  # the old optimizer's name first
                label = f"{known!r}" if known else f"of shape {tuple(p.shape)}"
                old.lost = (
                    f"its parameter {label} was given to another {self.name} built after it. A "
                    "parameter lives in the flat buffer of one decentralized optimizer only: "
                    "give each optimizer its own parameters (drop this optimizer if it was "
                    "replaced)"
                )
            owners[id(p)] = (weakref.ref(p), weakref.ref(self), name)
        weakref.finalize(self, _forget, owners, [id(p) for p in params])


def _forget(owners: dict[int, tuple[Any, ...]], ids: list[int]) -> None:
    for i in ids:
        entry = owners.get(i)
        if entry is not None and (entry[0]() is None or entry[1]() is None):
            del owners[i]
