"""The membership store as the members depend on it: its name in messages, whether this process
hosts it, and what its loss means.

Every change of membership goes through the store (:mod:`decent_optim.gossip.membership`); the
rounds do not. So a lost store stops only the changes: a member that cannot reach it while it
trains goes on without live membership (:meth:`Membership.pending
<decent_optim.gossip.membership.Membership.pending>` turns false once, with a warning, instead
of ending a healthy job), and the next change that needs it raises an error that names the
store (:func:`lost`), unless the store is back by then. A store started again on the same
address (``python -m decent_optim.store --port PORT``) holds no keys: :func:`resume` looks for
it (at most once a second from the rounds' check, and at once before a change), seeds it with
what every member knows alike (where newcomers' ids start, the generation, this member's
liveness beacon) and membership goes on: a loss or a join after the store's return is agreed
as before. Only a plain ``TCPStore`` can be opened again (a ``PrefixStore`` hides its prefix).

A store hosted by a worker dies with that worker, and then no survivor can agree on anything:
:func:`hosted_here` tells (Linux: a listening TCP socket on the store's port among this
process's open files), and :class:`Membership` warns.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
import warnings
from typing import Any

import torch.distributed as dist

__all__ = ["describe", "hosted_here", "lost", "resume", "warn_if_hosted", "warn_paused"]

#: seconds between two looks for a store that came back, from the rounds' check
RETRY_S = 1.0

_log = logging.getLogger("decent_optim.gossip.membership")

#: where to serve the store instead (the docs' "The store")
_SERVE = (
    "serve the store from a process that trains nothing: `python -m decent_optim.store "
    "--port PORT` on a host that does not train, or torchrun's agent store "
    '(docs/surviving_failures, "The store")'
)

#: the warning for a worker that hosts the store
_HOSTED = (
    "Membership: this process hosts the membership store ({store}) and trains: if it dies, "
    "the store dies with it and the survivors cannot agree on who is left (every change of "
    "membership goes through the store), so live membership cannot survive this worker. "
    f"Instead {_SERVE}"
)


def _base(store: dist.Store) -> dist.Store:
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def describe(store: dist.Store) -> str:
    """The store as a message names it: ``TCPStore host:port``, or its type."""
    base = _base(store)
    if isinstance(base, dist.TCPStore):
        return f"TCPStore {base.host}:{base.port}"
    return type(base).__name__


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            # local address "ADDR:PORT" in hex; state 0A is LISTEN; column 9 the inode
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes


def hosted_here(store: dist.Store) -> bool:
    """Whether this process serves ``store`` (a ``TCPStore`` built with ``is_master=True``
    here). False where it cannot tell (not Linux, not a TCPStore)."""
    base = _base(store)
    if not isinstance(base, dist.TCPStore):
        return False
    inodes = _listening_inodes(base.port)
    if not inodes:
        return False
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            return True
    return False


def warn_if_hosted(store: dist.Store) -> None:
    """Warn if this process, which builds a Membership and so trains, hosts ``store``."""
    if hosted_here(store):
        warnings.warn(_HOSTED.format(store=describe(store)), UserWarning, stacklevel=3)


def warn_paused(me: int, store: dist.Store, err: BaseException) -> None:
    """Warn (and log) that member ``me`` lost the store while it trains."""
    message = (
        f"[id {me}] the membership store ({describe(store)}) cannot be reached ({err}): "
        "training goes on, but live membership is paused until the store is back on its "
        "address (start it again there): meanwhile a newcomer cannot join, and a lost worker "
        f"ends the job with MembershipError. Next time {_SERVE}"
    )
    _log.warning(message)
    warnings.warn(message, UserWarning, stacklevel=3)


def lost(me: int, store: dist.Store, err: BaseException, what: str) -> str:
    """The message of a change of membership (``what``) that the lost store made impossible."""
    return (
        f"[id {me}] {what} needs the membership store ({describe(store)}), which cannot be "
        f"reached ({err}): the survivors cannot agree on who is left. Restart the job from its "
        f"last checkpoint (decent_optim.checkpoint), and {_SERVE}"
    )


def _reopen(store: dist.Store, timeout: float) -> dist.TCPStore | None:
    """A new client of ``store``'s address if a server answers there now, else None."""
    if not isinstance(store, dist.TCPStore):
        return None
    try:  # a refused connection is at once: no client's connect loop to wait out
        with socket.create_connection((store.host, store.port), timeout=0.05):
            pass
        return dist.TCPStore(
            store.host,
            store.port,
            is_master=False,
            use_libuv=bool(getattr(store, "libuvBackend", True)),
            timeout=datetime.timedelta(seconds=timeout),
        )
    except (OSError, RuntimeError):
        return None


def resume(membership: Any, now: bool = False) -> bool:
    """Whether ``membership`` (a :class:`~decent_optim.gossip.membership.Membership` that lost
    its store) has its store again: if one answers on the address (looked for at most every
    :data:`RETRY_S` seconds unless ``now``), seed it and use it from now on."""
    clock = time.monotonic()
    if membership.joining or (not now and clock < membership.retry):
        return False
    membership.retry = clock + RETRY_S
    store = _reopen(membership.store, membership.timeout)
    if store is None:
        return False
    prefix, view = membership.prefix, membership.view
    try:
        store.compare_set(f"{prefix}/world", "", str(max(view.members) + 1))
        store.set(f"{prefix}/generation", str(view.generation))
        store.set(f"{prefix}/beacon/{membership.me}", membership.beacon.address)
    except (OSError, RuntimeError):
        return False  # lost again
    membership.store, membership.reachable = store, True
    _log.warning(
        "[id %d] the membership store (%s) is back: live membership goes on (generation %d)",
        membership.me,
        describe(store),
        view.generation,
    )
    return True
