"""Lose and take in workers while training, on the emulated cluster: live membership measured.

One run, on 4 emulated nodes of one worker each, rank 2 SIGKILLed when the run reaches step 100::

    flock /tmp/emulate.lock /work/shared/tools/emulate-cluster --nodes 4 --rate 1gbit -- \\
        bash -c 'exec python "$0" --node "$NODE_RANK" --nodes "$NNODES" --per-node 1 \\
                 --store "$MASTER_ADDR:29601" --workdir /tmp/live --events kill:2@100' \\
        experiments/live_membership/cluster.py
    python experiments/live_membership/report.py /tmp/live

Every node runs this script as its *controller*: node 0's also hosts the store (a ``TCPStore``
that outlives every worker: it trains nothing, as torchrun's agent), and each controller starts
its node's workers as plain processes (a launcher that leaves the survivors alone) and carries
out the faults of its node. Workers train the convergence study's character GPT
(``benchmarks/_text.py``, workload ``char``) with ``DecentralizedAdamW`` and
``membership=Membership(store)``; each step is padded to ``--device-ms`` of emulated device time
(a sleep after the backward pass), so that the two shared cores do not decide the speed.

``--events``: comma-separated ``KIND:TARGET@STEP``, carried out when the first worker completes
step STEP: ``kill:ID`` (SIGKILL worker ID), ``stop:ID`` (SIGSTOP: a hung worker, killed when the
run ends), ``killnode:NODE`` (SIGKILL every worker of the node at once) and ``join:NODE`` (start
a newcomer there, ``Membership(store, join=True)``). ``--data-ids`` gives the first workers other
data streams (a baseline on the survivors' data: ``--data-ids 0,1,3`` for ranks 0-2).

Written under ``--workdir``: ``metrics-ID.jsonl`` (each completed step: wall time, loss,
generation, world size), ``params/ID-STEP.pt`` (the flat parameters every ``--dump-every`` steps
and at the end: the report computes the consensus distance and the held-out loss of the members'
mean from them, so the workers run no collective beyond their gossip), ``events.jsonl`` (when
each fault was carried out) and ``joins.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import _text  # noqa: E402

PREFIX = "cluster/live"


def parse_events(text: str) -> list[tuple[str, int, int]]:
    """``kill:2@100,join:1@150`` -> ``[("kill", 2, 100), ("join", 1, 150)]``."""
    events = []
    for item in filter(None, text.split(",")):
        kind, rest = item.split(":")
        target, step = rest.split("@")
        if kind not in ("kill", "stop", "killnode", "join"):
            raise SystemExit(f"unknown event {kind!r} in {item!r}")
        events.append((kind, int(target), int(step)))
    return events


def connect(address: str, host: bool) -> dist.TCPStore:
    name, port = address.rsplit(":", 1)
    return dist.TCPStore(
        "0.0.0.0" if host else name, int(port), is_master=host, wait_for_workers=False,
        use_libuv=True, timeout=datetime.timedelta(seconds=600),
    )  # fmt: skip


def append(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


# ---------------------------------------------------------------------------- the controller


def controller(args: argparse.Namespace) -> int:
    store = connect(args.store, host=args.node == 0)
    workdir = Path(args.workdir)
    (workdir / "params").mkdir(parents=True, exist_ok=True)
    world = args.nodes * args.per_node
    data_ids = [int(i) for i in args.data_ids.split(",")] if args.data_ids else list(range(world))
    procs: dict[int, subprocess.Popen] = {}  # by pid
    stopped: set[int] = set()
    lock = threading.Lock()
    command = [sys.executable, __file__, *sys.argv[1:], "--worker"]

    def start(env: dict[str, str]) -> None:
        proc = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1", **env})
        with lock:
            procs[proc.pid] = proc

    for local in range(args.per_node):
        rank = args.node * args.per_node + local
        start({"RANK": str(rank), "WORLD_SIZE": str(world), "DATA_ID": str(data_ids[rank])})

    def carry_out(kind: str, target: int, step: int, index: int) -> None:
        own = connect(args.store, host=False)  # a client's waits are not thread-safe
        own.wait([f"reached/{step}"], datetime.timedelta(seconds=3600))
        if kind == "join":
            if target == args.node:
                at = time.time()
                start({"LIVE_STARTED": repr(at), "JOIN_INDEX": str(index)})
                append(workdir / "events.jsonl", {"event": index, "kind": kind, "node": target,
                                                  "step": step, "t": at})  # fmt: skip
            return
        if kind == "killnode":
            if target != args.node:
                return
            with lock:
                victims = [p for p in procs.values() if p.poll() is None]
        else:
            node, pid = own.get(f"where/{target}").decode().split(":")
            if int(node) != args.node:
                return
            victims = [procs[int(pid)]]
        sig = signal.SIGSTOP if kind == "stop" else signal.SIGKILL
        at = time.time()
        for proc in victims:
            os.kill(proc.pid, sig)
        if kind == "stop":
            stopped.update(p.pid for p in victims)
        append(workdir / "events.jsonl", {"event": index, "kind": kind, "target": target,
                                          "step": step, "t": at})  # fmt: skip

    threads = [
        threading.Thread(target=carry_out, args=(*event, i), daemon=True)
        for i, event in enumerate(parse_events(args.events))
    ]
    for thread in threads:
        thread.start()
    while True:  # wait for every worker that runs (a newcomer may still be started)
        with lock:
            running = [p for p in procs.values() if p.pid not in stopped and p.poll() is None]
        if not running and store.check(["finished"]):
            break  # a hung worker stays hung until the others finished
        if not running and not stopped and not any(t.is_alive() for t in threads):
            break
        time.sleep(0.2)
    for pid in stopped:
        os.kill(pid, signal.SIGKILL)  # hung until now: declared dead by the others long ago
    codes = {pid: p.wait() for pid, p in procs.items()}
    print(f"[node {args.node}] worker exit codes: {sorted(codes.values())}", flush=True)
    store.add("nodes_done", 1)
    if args.node == 0:  # the store must outlive every worker of every node
        while store.add("nodes_done", 0) < args.nodes:
            time.sleep(0.2)
    bad = [c for c in codes.values() if c not in (0, -signal.SIGKILL)]
    return 1 if bad else 0


# ---------------------------------------------------------------------------- the worker


def worker(args: argparse.Namespace) -> None:
    from decent_optim import DecentralizedAdamW
    from decent_optim.gossip.membership import Membership

    workdir = Path(args.workdir)
    store = connect(args.store, host=False)
    joining = "LIVE_STARTED" in os.environ
    if joining:
        live = Membership(store, prefix=PREFIX, timeout=args.timeout, join=True)
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", store=dist.PrefixStore("init", store), rank=rank,
                                world_size=world)  # fmt: skip
        live = Membership(store, prefix=PREFIX, timeout=args.timeout)
    work = _text.load("char", val_batches=1)
    torch.manual_seed(args.seed)
    model = work.make_model()
    opt = DecentralizedAdamW(
        model.parameters(), lr=args.lr, topology=args.topology, timeout=4 * args.timeout,
        local_world_size=args.per_node, membership=live, compression=args.compression,
        local_steps=args.local_steps,
    )  # fmt: skip
    view = live.view
    me = view.members[view.rank]
    store.set(f"where/{me}", f"{args.node}:{os.getpid()}")
    data_id = me if joining else int(os.environ["DATA_ID"])
    first = int(opt.state[next(model.parameters())]["step"]) if joining else 0
    if joining:
        append(workdir / "joins.jsonl", {"id": me, "index": int(os.environ["JOIN_INDEX"]),
                                         "started": float(os.environ["LIVE_STARTED"]),
                                         "let_in": time.time(), "step": first})  # fmt: skip
    triggers = {step for _, _, step in parse_events(args.events)}
    metrics = workdir / f"metrics-{me}.jsonl"
    device = args.device_ms / 1000

    def dump(step: int) -> None:
        flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
        path = workdir / "params" / f"{me}-{step}.pt"
        torch.save(flat, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)  # whole, even if this worker is killed while saving

    for step in range(first, args.steps):
        begin = time.perf_counter()
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        gen = torch.Generator().manual_seed(1_000_003 * data_id + 7919 * args.seed + step)
        x, y = work.batch(args.batch_size, gen)
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        time.sleep(max(0.0, begin + device - time.perf_counter()))  # the emulated device
        opt.step()
        opt.zero_grad()
        view = live.view
        append(metrics, {"id": me, "step": step, "t": time.time(), "loss": loss.item(),
                         "generation": view.generation, "world": view.world_size,
                         "took": time.perf_counter() - begin})  # fmt: skip
        if step in triggers:
            store.set(f"reached/{step}", "1")
        if step % args.dump_every == 0:
            dump(step)
    opt.synchronize()  # the last round, mixed in, before the group goes
    dump(args.steps)
    store.set("finished", "1")
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--node", type=int, required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--per-node", type=int, default=1)
    parser.add_argument("--store", required=True, help="HOST:PORT; node 0 hosts it")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--events", default="", help="kill:ID@STEP,stop:ID@STEP,...")
    parser.add_argument("--data-ids", default="", help="the first workers' data streams")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--device-ms", type=float, default=150.0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=6e-3)
    parser.add_argument("--topology", default="ring")
    parser.add_argument("--compression", help="the optimizer's, e.g. int8")
    parser.add_argument("--local-steps", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=5.0, help="Membership's, in seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dump-every", type=int, default=25)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    return controller(args)


if __name__ == "__main__":
    sys.exit(main())
