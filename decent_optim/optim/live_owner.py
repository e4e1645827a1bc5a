"""Live membership's one optimizer per process, and the bound on its rounds' waits.

Each optimizer with ``membership=`` rebuilds the default process group at a change on its own,
so two in one process would each destroy the group the other gossips on (and the other members
would declare this process dead): the second is refused while the first lives (:func:`check`).

A hung member closes no connection; the survivors notice it when their waits for its rounds
end. Without the optimizer's ``timeout=`` those waits last the process group's timeout (30 min
by default), far past ``Membership(timeout=...)``, which the user gave as the bound of a silent
member: so the rounds of an optimizer with ``membership=`` and no ``timeout=`` wait at most the
membership's timeout (:func:`take`), as every group a change rebuilds does already (it is
created with that timeout). Start-up is not bounded so: the ranks may reach the constructor far
apart.
"""

from __future__ import annotations

import datetime
import gc
import weakref
from typing import Any

from decent_optim.gossip import Gossiper
from decent_optim.gossip.membership import Membership

__all__ = ["check", "take"]

# the optimizer of this process that has live membership (weakly: a deleted one frees it)
_holder: list[weakref.ref[Any]] = []


def _current() -> Any:
    return _holder[0]() if _holder else None


def check(membership: object, name: str) -> None:
    """Raise if this process has a live optimizer with ``membership=`` already (``name``: the
    class of the one being built)."""
    if not isinstance(membership, Membership):
        return
    if _current() is not None:
        gc.collect()  # one only kept by a reference cycle (a traceback) is gone
    other = _current()
    if other is not None:
        raise RuntimeError(
            f"{name}(membership=...): this process has an optimizer with live membership "
            f"already ({type(other).__name__}); one decentralized optimizer with membership= "
            "per process, because each rebuilds the default group at a change on its own (the "
            "other members would declare this process dead). Build one optimizer over all the "
            "parameters (param groups for different settings), or delete the first one "
            "(`del opt`) before building another"
        )


def take(owner: Any, gossip: object, membership: object) -> None:
    """Make ``owner`` this process's optimizer with live membership, and bound its rounds'
    waits by the membership's timeout where it has no ``timeout=`` of its own."""
    if not isinstance(membership, Membership) or not isinstance(gossip, Gossiper):
        return  # no membership, or a world of one (Membership warned)
    _holder[:] = [weakref.ref(owner)]
    if gossip.timeout is None:
        gossip.timeout = datetime.timedelta(seconds=membership.timeout)
