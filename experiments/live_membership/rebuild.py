"""How fast can the survivors of a SIGKILL rebuild a gloo process group in-process? (issue 42)

Usage: ``python experiments/live_membership/rebuild.py [--repeats 3] [--approach NAME ...]``.

Four gloo ranks on localhost run all-reduces in a loop; the parent SIGKILLs rank 2 and takes the
time. The three survivors notice (a failed wait, or a key another survivor left in the store),
rebuild a group among themselves with one approach, complete an all-reduce and a ring exchange
whose values they check, and report the time. The store is a ``TCPStore`` hosted by the parent,
which is no worker (as torchrun's agent store is). Printed per approach and repeat: the seconds
from the kill to each survivor's first error and to its checked collective in the new group, or
the error that stopped the approach.

Approaches:

* ``reinit``: ``destroy_process_group()`` then ``init_process_group`` again on a
  ``PrefixStore`` of the generation, ranks renumbered 0..2.
* ``reinit_abort``: the same, with ``ProcessGroup.abort()`` on the old default group before
  ``destroy_process_group()``.
* ``new_group_local``: ``new_group(survivors, use_local_synchronization=True)`` on the old
  default group (global ranks kept; the default group keeps its dead member).
* ``new_group``: ``new_group(survivors)``, the default synchronisation (all ranks of the default
  group must take part).
* ``new_group_barrier``: the same with ``TORCH_DIST_INIT_BARRIER=1`` (a barrier of all ranks of
  the default group after the group's creation).
* ``shrink``: ``shrink_group([2])``, torch's communicator shrink.
* ``engine``: :class:`decent_optim.gossip.membership.Membership` (agreement through the store,
  then ``reinit``), each survivor passing only what it noticed itself.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

WORLD, VICTIM = 4, 2
TIMEOUT = datetime.timedelta(seconds=10)
APPROACHES = (
    "reinit",
    "reinit_abort",
    "new_group_local",
    "new_group",
    "new_group_barrier",
    "shrink",
    "engine",
)


def _check(dist, torch, group, ranks, me):
    """An all-reduce and a ring exchange in ``group``; values checked; ``ranks``: old ranks by new."""
    n = len(ranks)
    t = torch.tensor([float(ranks[me])])
    dist.all_reduce(t, group=group)
    assert t.item() == float(sum(ranks)), (t.item(), ranks)
    send = torch.tensor([float(ranks[me])])
    recv = torch.empty(1)
    right, left = (me + 1) % n, (me - 1) % n
    to = dist.get_global_rank(group, right) if group is not None else right
    frm = dist.get_global_rank(group, left) if group is not None else left
    reqs = [dist.isend(send, to, group=group), dist.irecv(recv, frm, group=group)]
    for r in reqs:
        r.wait()
    assert recv.item() == float(ranks[left]), (recv.item(), ranks)


def worker(rank, port, approach, tag, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"{tag}/gen0", store),
        rank=rank,
        world_size=WORLD,
        timeout=TIMEOUT,
    )
    signal_key = f"{tag}/noticed"
    if approach == "engine":  # built at start, as a training script would (no import later)
        from decent_optim.gossip.membership import Membership

        live = Membership(store, prefix=f"{tag}/live", timeout=TIMEOUT.total_seconds())
    queue.put(("ready", rank, os.getpid()))
    t = torch.ones(1 << 10)
    noticed, detected = [], None
    while detected is None:
        work = dist.all_reduce(t, async_op=True)
        while True:
            if work.is_completed():
                try:
                    work.wait()
                except RuntimeError as exc:
                    detected, noticed = time.time(), [VICTIM]
                    store.set(signal_key, str(rank))
                    first = str(exc).splitlines()[0][:160]
                break
            if store.check([signal_key]):
                detected, first = time.time(), "store key"
                break
            time.sleep(0.001)
    del work  # a failed Work holds the old group's gloo context (and its sockets) alive
    survivors = [r for r in range(WORLD) if r != VICTIM]
    try:
        if approach in ("reinit", "reinit_abort"):
            t0 = time.time()
            if approach == "reinit_abort":
                dist.group.WORLD.abort()  # ends the work in flight and closes the sockets
            dist.destroy_process_group()
            first += f" | destroy {time.time() - t0:.3f} s"
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore(f"{tag}/gen1", store),
                rank=survivors.index(rank),
                world_size=len(survivors),
                timeout=TIMEOUT,
            )
            _check(dist, torch, None, survivors, survivors.index(rank))
        elif approach in ("new_group_local", "new_group", "new_group_barrier"):
            if approach == "new_group_barrier":  # torch's opt-in barrier after a group's creation
                os.environ["TORCH_DIST_INIT_BARRIER"] = "1"
            group = dist.new_group(
                survivors,
                timeout=TIMEOUT,
                use_local_synchronization=approach == "new_group_local",
            )
            _check(dist, torch, group, survivors, survivors.index(rank))
        elif approach == "shrink":
            group = dist.shrink_group([VICTIM])
            _check(dist, torch, group, survivors, survivors.index(rank))
        elif approach == "engine":
            view = live.rebuild(suspects=noticed)
            _check(dist, torch, None, view.members, view.rank)
        else:
            raise ValueError(f"unknown approach {approach!r}")
        queue.put(("done", rank, detected, time.time(), first))
    except Exception as exc:
        text = f"{type(exc).__name__}: {str(exc).strip()}"
        queue.put(("failed", rank, detected, time.time(), text[:400], traceback.format_exc()))
    queue.close()
    queue.join_thread()  # put() hands over to a feeder thread: flush it before the hard exit
    os._exit(0)


def run_once(approach, tag, port):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, approach, tag, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    pids = {}
    while len(pids) < WORLD:
        kind, rank, pid = queue.get(timeout=120)
        pids[rank] = pid
    time.sleep(1.0)  # let the loop of all-reduces run
    killed = time.time()
    os.kill(pids[VICTIM], signal.SIGKILL)
    replies = {}
    deadline = time.monotonic() + 60
    while len(replies) < WORLD - 1 and time.monotonic() < deadline:
        try:
            reply = queue.get(timeout=max(0.1, deadline - time.monotonic()))
        except Exception:
            break
        replies[reply[1]] = reply
    for p in procs:
        p.join(timeout=2)
        if p.exitcode is None:
            p.kill()
    return killed, replies


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--approach", nargs="*", default=list(APPROACHES), choices=APPROACHES)
    args = parser.parse_args()
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    print(f"torch {torch.__version__}, {WORLD} gloo ranks, SIGKILL of rank {VICTIM}")
    for approach in args.approach:
        totals = []
        for i in range(args.repeats):
            # a fresh key space per run: the store outlives every run, as an agent's would
            killed, replies = run_once(approach, f"{approach}{i}", store.port)
            ok = all(r[0] == "done" for r in replies.values()) and len(replies) == WORLD - 1
            for rank, reply in sorted(replies.items()):
                det = f"{reply[2] - killed:6.3f}" if reply[2] else "     -"
                print(
                    f"{approach:16s} run {i} rank {rank}: {reply[0]:6s} noticed +{det} s, "
                    f"finished +{reply[3] - killed:6.3f} s  ({reply[4]})"
                )
            if ok:
                totals.append(max(r[3] for r in replies.values()) - killed)
            elif len(replies) < WORLD - 1:
                print(f"{approach:16s} run {i}: no answer from some survivors within 60 s")
        if totals:
            print(
                f"==> {approach}: kill -> last survivor's checked collective: median "
                f"{statistics.median(totals):.3f} s (min {min(totals):.3f}, max {max(totals):.3f},"
                f" {len(totals)} runs)"
            )
        else:
            print(f"==> {approach}: failed in every run")


if __name__ == "__main__":
    main()
