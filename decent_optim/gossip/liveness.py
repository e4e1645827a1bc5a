"""Whether a silent member's process is gone: a listening socket per member, probed by the others.

In an agreement (:mod:`decent_optim.gossip.membership`) a member that has not posted is left out
at once only where a survivor names it (its connection closed in a survivor's wait); otherwise
the survivors wait twice the membership's timeout for it, since a live member may just be slow
to notice the change. With two workers lost at once that wait was the common case: a survivor
whose round was cut short by the change that *another* survivor posted (it learns of it from
the store) never sees its own dead neighbour's closed connection, so the second dead worker
was named by nobody (6.4-7.0 s with timeout 3, where one loss takes 0.5 s).

So each member listens on a TCP socket of its own (a :class:`Beacon`, any free port, a daemon
thread that accepts and closes) and posts its address in the store. A survivor probes the
silent members nobody names: a connection *refused* means that no process listens there any
more, i.e. the member's process is gone (the kernel closes a dead process's sockets), and it
is left out without waiting. A hung (stopped) process still gets its connections accepted by
the kernel, and an unreachable host refuses nothing: both are inconclusive, and the timeout
stays their bound. A loopback address is probed only from the same host and network namespace
(:func:`here`), where it means the same thing. The probe needs what gloo's own connections need
(any port of a worker reachable from the others); a firewall that *rejects* (rather than drops)
connections to ports it does not know would make a live member look gone.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

__all__ = ["Beacon", "dead", "every_one_gone", "gone", "here", "post", "ready", "unanswered"]

#: seconds a probe waits for a connection (refused is immediate; a dead host is inconclusive)
PROBE_S = 0.2


def here() -> str:
    """This host and network namespace, as a beacon's address names them."""
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{socket.gethostname()}/{netns}"


def _address_towards(store: dist.Store) -> str:
    """This host's address on the way to ``store`` (a TCPStore's host), else loopback."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((store.host, store.port))  # no packet is sent: this picks the route
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


class Beacon:
    """This member's listening socket, and the text that tells the others where it is."""

    def __init__(self, store: dist.Store):
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("0.0.0.0", 0))
        self._socket.listen(64)
        port = self._socket.getsockname()[1]
        self.address = f"{here()} {_address_towards(store)} {port}"
        threading.Thread(
            target=self._accept, name="decent_optim-membership-beacon", daemon=True
        ).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._socket.accept()
            except OSError:
                return  # closed
            conn.close()

    def close(self) -> None:
        self._socket.close()


def gone(address: str) -> bool:
    """Whether the member whose beacon posted ``address`` is certainly gone (its connection
    refused); False where it cannot tell."""
    where, host, port = address.split()
    if host.startswith("127.") and where != here():
        return False  # another host's loopback
    try:
        with socket.create_connection((host, int(port)), timeout=PROBE_S):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def post(store: dist.Store, key: str) -> Beacon:
    """Start this process's beacon and post its address under ``key``."""
    beacon = Beacon(store)
    store.set(key, beacon.address)
    return beacon


def dead(store: dist.Store, prefix: str, ids: set[int]) -> set[int]:
    """The members of ``ids`` whose beacon (posted under ``{prefix}/{id}``) refuses a
    connection: their processes are gone."""
    keys = {i: f"{prefix}/{i}" for i in ids}
    return {i for i, k in keys.items() if store.check([k]) and gone(store.get(k).decode())}


def every_one_gone(store: dist.Store, membership: Any, ids: Iterable[int]) -> bool:
    """Whether the process of every member of ``ids`` is gone (a newcomer's question: then no
    one is left to let it in)."""
    members = set(ids) - {membership.me}
    return bool(members) and dead(store, f"{membership.prefix}/beacon", members) == members


def unanswered(me: int, generation: int, waited: float, gone: bool) -> str:
    """The message of a newcomer whose request to join nobody answered."""
    if gone:
        return (
            f"[id {me}] every member of the job is gone (finished, or lost): nobody is left to "
            f"let this newcomer in (generation {generation}). Restart the job from its last "
            "checkpoint; under torchrun, one agent per GPU (--nproc-per-node 1) keeps a "
            "worker's loss from stopping its node-mates (docs/surviving_failures, \"Under "
            'torchrun")'
        )
    return (
        f"[id {me}] no member answered the request to join generation {generation} within "
        f"{waited:g} s: do the members still train?"
    )


def ready(store: dist.Store, key: str, membership: Any, members: Iterable[int]) -> str | None:
    """Post that ``membership``'s member is ready to connect the group of ``members`` (under
    ``{key}/{id}``) and wait until all are: None, or why not (one is gone, or the membership's
    timeout passed). A member that dies between the decision and the new group's rendezvous
    (a node-mate its torchrun agent stops right after a loss) would otherwise hold every other
    one in ``init_process_group`` for the whole timeout."""
    store.set(f"{key}/{membership.me}", "")
    waiting = set(members) - {membership.me}
    deadline, probe = time.monotonic() + membership.timeout, time.monotonic()
    beacons = f"{membership.prefix}/beacon"
    while True:
        waiting = {i for i in waiting if not store.check([f"{key}/{i}"])}
        if not waiting:
            return None
        if time.monotonic() >= probe:
            lost = dead(store, beacons, waiting)
            if lost:
                return f"id(s) {sorted(lost)} gone before the new group connected"
            probe = time.monotonic() + 0.05
        if time.monotonic() >= deadline:
            return f"id(s) {sorted(waiting)} not ready within {membership.timeout:g} s"
        time.sleep(membership.poll)
