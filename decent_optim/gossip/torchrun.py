"""Live membership under torchrun: one ``torchrun --standalone`` job per node, joined by the store.

torchrun's agent treats its node's workers as one group: when one exits it stops the others
(SIGTERM) and, with ``--max-restarts``, starts them all again; across nodes its rendezvous makes
every agent wait for the others at the end (an exit barrier, 300 s for a dead node's agent). So
each node runs its own job, ``torchrun --standalone --nproc-per-node W --max-restarts N``: no
rendezvous across nodes, so no barrier, and a node's failure is that node's. The workers of
all nodes meet in the membership store (``python -m decent_optim.store``, on a host that does
not train), and :func:`membership` makes them one job:

* at the first launch (``TORCHELASTIC_RESTART_COUNT`` 0) the first ``nodes * W`` workers to
  arrive are the job's first group: each agent's workers take a node number from the store
  (local rank 0 draws it, for its agent: host, agent store, run id), so the global rank is ``node * W +
  LOCAL_RANK`` (node-mates stay neighbours: ``LOCAL_WORLD_SIZE`` shapes the topology), and
  :func:`membership` calls ``init_process_group`` with those ranks (torchrun's ``RANK`` and
  ``WORLD_SIZE`` count one node only: read ``dist.get_rank()``, or the optimizer's);
* a worker the agent restarted (its ``TORCHELASTIC_RESTART_COUNT`` above 0), or one more than
  the first group holds, is a newcomer: it gets ``Membership(store, join=True)`` and no group;
  its optimizer's constructor joins the running job (:mod:`decent_optim.optim.joining`).

When a worker dies its agent SIGTERMs its node-mates: the other nodes' survivors leave all of
them out in one change (their processes are gone: :mod:`~decent_optim.gossip.liveness`) and
train on; the agent restarts the node's workers and they rejoin as newcomers. Every agent
exits with its workers: 0 where they finished.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping

import torch.distributed as dist

from decent_optim.gossip.liveness import here
from decent_optim.gossip.membership import Membership

__all__ = ["membership", "open_store"]

#: how long the first group's workers may arrive apart (seconds)
START_S = 600.0


def open_store(address: str, timeout: float = START_S) -> dist.TCPStore:
    """A client of the membership store at ``HOST:PORT`` (``python -m decent_optim.store``)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(
            f"the membership store's address is HOST:PORT (where `python -m decent_optim.store "
            f"--port PORT` runs), got {address!r}"
        )
    return dist.TCPStore(
        host,
        int(port),
        is_master=False,
        use_libuv=True,
        timeout=datetime.timedelta(seconds=timeout),
    )


def _int(env: Mapping[str, str], name: str, default: str | None = None) -> int:
    value = env.get(name, default)
    if value is None:
        raise RuntimeError(
            f"decent_optim.gossip.torchrun.membership runs in a worker started by torchrun "
            f"(one `torchrun --standalone --nproc-per-node W` per node); {name} is not set"
        )
    return int(value)


def membership(
    store: str | dist.Store,
    *,
    nodes: int,
    prefix: str = "decent_optim/live",
    timeout: float = 60.0,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
) -> Membership:
    """This torchrun worker's :class:`Membership`, after ``init_process_group`` with its global
    rank (first launch), or a newcomer's (``join=True``: a restarted worker, no group yet).

    ``store``: the membership store (``HOST:PORT`` of ``python -m decent_optim.store``, or a
    ``Store``); ``nodes``: how many nodes (torchrun jobs) the first group has, each with the
    same ``--nproc-per-node``; ``prefix``: one per job, new to the store; ``timeout`` and
    ``backend``: the :class:`Membership`'s. Pass the result to the optimizer's
    ``membership=``; ``result.joining`` tells a newcomer (it takes its step count from the
    optimizer's state once built).
    """
    env = os.environ if env is None else env
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes= is the number of torchrun jobs of the first group, got {nodes!r}")
    local, width = _int(env, "LOCAL_RANK"), _int(env, "LOCAL_WORLD_SIZE")
    restarts = _int(env, "TORCHELASTIC_RESTART_COUNT", "0")
    # this agent: its store's address on this host (a run id is "none" unless --standalone)
    agent = f"{here()}/{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}/{env.get('TORCHELASTIC_RUN_ID')}"
    if isinstance(store, str):
        store = open_store(store)
    world = nodes * width
    first = restarts == 0 and store.add(f"{prefix}/launch/arrived", 1) <= world
    if not first:
        return Membership(store, prefix=prefix, timeout=timeout, join=True, backend=backend)
    key = f"{prefix}/launch/node/{agent}"
    if local == 0:
        store.set(key, str(store.add(f"{prefix}/launch/nodes", 1) - 1))
    node = int(store.get(key).decode())  # waits for the node's local rank 0
    if node >= nodes:
        raise RuntimeError(
            f"more torchrun jobs started than nodes={nodes} (this is node {node}), or their "
            f"--nproc-per-node differ ({width} here): start `nodes` jobs of the same size at "
            "first; later ones join the running job when they are restarted"
        )
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"{prefix}/launch/init", store),
        rank=node * width + local,
        world_size=world,
        timeout=datetime.timedelta(seconds=START_S),
    )
    return Membership(store, prefix=prefix, timeout=timeout, backend=backend)
