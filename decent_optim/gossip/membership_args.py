"""The checks of :class:`~decent_optim.gossip.membership.Membership`'s arguments, before any side
effect, and of where it is built (inside or outside a running group, a repeated join).

``timeout`` and ``poll`` take seconds as the optimizer's ``timeout=`` does: a real number or a
:class:`datetime.timedelta`, returned as a float. ``timeout`` must be finite (it is the one bound
of a hung member: ``inf`` would make every agreement wait forever) and at least
:data:`MIN_TIMEOUT_S`; ``poll`` below it.
"""

from __future__ import annotations

import datetime
import math
import numbers
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "MIN_TIMEOUT_S",
    "built",
    "check_arguments",
    "check_place",
    "check_suspects",
    "warn_if_alone",
]

#: the shortest membership timeout: the store's and gloo's timeouts count whole milliseconds,
#: and an agreement needs a few store round trips and a new group's rendezvous within it
MIN_TIMEOUT_S = 0.1


def _seconds(name: str, value: object, advice: str) -> float:
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"Membership's {name} takes seconds (a float or a datetime.timedelta), got "
            f"{value!r}{advice}"
        )
    return float(value)


def check_arguments(
    store: object, prefix: object, timeout: object, poll: object, join: object, backend: object
) -> tuple[float, float]:
    """Raise on a bad argument of ``Membership``; return ``timeout`` and ``poll`` in seconds."""
    import torch.distributed as dist

    if not isinstance(store, dist.Store):
        raise TypeError(
            "Membership needs a torch.distributed Store that outlives every worker: "
            "`python -m decent_optim.store --port PORT` on a host that does not train, or "
            f"torchrun's agent store; got {store!r}"
        )
    if not isinstance(prefix, str) or not prefix:
        raise TypeError(
            f"Membership's prefix must be a non-empty str (one per job), got {prefix!r}"
        )
    limit = _seconds(
        "timeout",
        timeout,
        " (it bounds every wait of an agreement; None is no bound a survivor could live with: "
        "pass the optimizer's timeout, e.g. timeout=60)"
        if timeout is None
        else "",
    )
    if not math.isfinite(limit) or limit < MIN_TIMEOUT_S:
        raise ValueError(
            f"Membership's timeout must be finite and at least {MIN_TIMEOUT_S:g} seconds, got "
            f"{timeout!r}: it is how long the survivors wait for a silent member before they "
            "leave it out (pass the optimizer's timeout, e.g. timeout=60)"
        )
    every = _seconds("poll", poll, "")
    if not 0 < every < limit:
        raise ValueError(
            f"Membership's poll (seconds between two looks at the store) must be > 0 and below "
            f"the timeout ({limit:g} s), got {poll!r}; the default 0.005 suits most jobs"
        )
    if not isinstance(join, bool):
        raise TypeError(f"Membership's join must be True or False, got {join!r}")
    if not isinstance(backend, str):
        raise TypeError(
            f"Membership's backend must be a name such as 'gloo' or 'nccl', got {backend!r}"
        )
    return limit, every


def check_suspects(suspects: Iterable[int], world: int) -> list[int]:
    """The ranks of ``suspects`` (of ``rebuild``), refused unless each is one of ``0..world-1``."""
    ranks = list(suspects)
    bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < world)]
    if bad:
        raise ValueError(f"suspects must be ranks of the current group (0..{world - 1}), got {bad}")
    return ranks


def check_place(join: bool, initialized: bool) -> None:
    """Raise unless ``Membership(join=join)`` fits this process: a member is built after
    ``init_process_group``, a newcomer outside any group (``initialized``: whether one runs)."""
    owner = _built_by()
    rebuilt = None if owner is None else owner.view
    if join and initialized and rebuilt is not None:
        raise RuntimeError(
            "Membership(store, join=True): this process is in the running job already (live "
            f"membership built its group: {rebuilt}); a process joins once. Keep using the "
            "Membership and the optimizer it has (a process left out, with MembershipError, "
            "may join again)"
        )
    if initialized == join:
        raise RuntimeError(
            "Membership(store, join=True) is for a process outside the running group: do not "
            "call init_process_group (joining builds the group)"
            if join
            else "build Membership after dist.init_process_group, on every rank (or pass "
            "join=True in a process that joins a running job)"
        )


#: the Membership whose rebuild built this process's current default group, if one did
_built_by: Callable[[], Any] = lambda: None  # noqa: E731  (a dead weakref's answer)


def built(membership: object) -> None:
    """Record that ``membership`` has just built this process's default group."""
    global _built_by
    _built_by = weakref.ref(membership)


def warn_if_alone(world: int) -> None:
    """Warn a job of one worker that its ``membership=`` does nothing."""
    if world == 1:
        warnings.warn(
            "Membership in a world of one: an optimizer given it has no live membership "
            "(there is nobody to lose, and it never reads the store, so no newcomer can "
            "join); start the job with two or more workers",
            UserWarning,
            stacklevel=3,
        )
