"""Lose a worker and keep training, without a restart: live membership (docs/surviving_failures).

    LIVE_KILL=2:30 python examples/live_membership.py --workers 4      # rank 2 dies before step 30

The survivors' ``step()`` returns: they agree on who is left through a store that outlives every
worker, rebuild their process group in-process, and go on gossiping on the ring of 3. Each
survivor prints the seconds from the kill to the step in which it rebuilt, and its loss.

**Where the store lives.** It must outlive any worker, so no worker can host it (rank 0's
store dies with rank 0). Here the launching process hosts it (``--workers N``: a ``TCPStore``
in this process, which starts N workers and trains nothing), as torchrun's agent hosts its
store. Or start it on its own with the package's command, on a machine that does not train
(this script's ``--serve-store PORT`` does the same), and point the workers at it::

    python -m decent_optim.store --port 29555 &
    RANK=0 WORLD_SIZE=4 python examples/live_membership.py --store HOST:29555 &   # one per worker

**Under torchrun** with several workers a node: one ``torchrun --standalone`` job per node,
joined through the store by ``decent_optim.gossip.torchrun.membership`` (docs/surviving_failures,
"Under torchrun"); this script's ``--workers`` is a demo on one machine.

``LIVE_KILL=RANK:STEP``: that rank SIGKILLs itself before that step (the fault is injected).

**A worker joins.** ``LIVE_JOIN=STEP`` (with ``--workers``): when id 0 has taken STEP steps,
the launcher starts one more worker (``--join``), which builds its optimizer with
``Membership(store, join=True)``: the members let it in at their next round, new rank 0 sends
it its parameters and Adam state, and it trains on as rank N. It prints the seconds from its
process start to its first completed step in the group; the members print their slowest step
around the join against their median step::

    LIVE_JOIN=50 python examples/live_membership.py --workers 3 --steps 200
"""

import argparse
import datetime
import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from decent_optim import DecentralizedAdamW
from decent_optim.gossip import store_service
from decent_optim.gossip.membership import Membership, View


def serve(port: int) -> dist.TCPStore:
    """A store on this machine that lives as long as this process (port 0: any free one): the
    package's (``python -m decent_optim.store --port PORT`` serves the same alone)."""
    return store_service.serve("0.0.0.0", port)


def launch(workers: int, argv: list[str]) -> int:
    """Host the store and start ``workers`` workers; wait for them, never stop a survivor.
    With ``LIVE_JOIN``, start one more when id 0 asks (``example/join_now``)."""
    store = serve(0)
    procs = []
    command = [sys.executable, __file__, "--store", f"127.0.0.1:{store.port}", *argv]
    for rank in range(workers):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(workers))
        procs.append(subprocess.Popen(command, env=env))
    if "LIVE_JOIN" in os.environ:
        store.wait(["example/join_now"], datetime.timedelta(seconds=600))
        env = dict(os.environ, LIVE_STARTED=repr(time.time()))
        procs.append(subprocess.Popen([*command, "--join"], env=env))
    codes = [p.wait() for p in procs]
    print(f"exit codes by rank: {codes}", flush=True)
    return 0 if all(c in (0, -signal.SIGKILL) for c in codes) else 1


def batch(member: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``member``'s data at ``step``: a fixed linear teacher plus noise."""
    teacher = torch.Generator().manual_seed(0)
    w = torch.randn(32, 8, generator=teacher)
    gen = torch.Generator().manual_seed(1_000_003 * member + step)
    x = torch.randn(64, 32, generator=gen)
    return x, torch.tanh(x @ w) + 0.1 * torch.randn(64, 8, generator=gen)


def train(store_address: str, steps: int, timeout: float, pause: float, join: bool) -> None:
    under_torchrun = store_address == "torchrun"
    if under_torchrun:  # the agents' rendezvous store, which no worker hosts (the docs say how)
        host, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    else:
        host, port = store_address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, use_libuv=True)
    if under_torchrun and not join:
        rank = int(os.environ["RANK"])
        dist.init_process_group("gloo")  # torchrun's rendezvous
        live = Membership(store, prefix="example/live", timeout=timeout)
    elif join:  # a newcomer: no init_process_group, joining builds the group
        rank = -1
        live = Membership(store, prefix="example/live", timeout=timeout, join=True)
        started = float(os.environ["LIVE_STARTED"])
        print(f"[newcomer] imports done {time.time() - started:.2f} s after its process started",
              flush=True)  # fmt: skip
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        # the first group rendezvouses on a prefix of its own; Membership uses another
        dist.init_process_group("gloo", store=dist.PrefixStore("init", store), rank=rank,
                                world_size=world)  # fmt: skip
        live = Membership(store, prefix="example/live", timeout=timeout)
        check = []
        for _ in range(200):  # what a member pays per round to notice a join
            begin = time.perf_counter()
            live.pending()
            check.append(time.perf_counter() - begin)
        print(f"[id {rank}] the store check of a round: {1e6 * sorted(check)[100]:.0f} us "
              "(median of 200)", flush=True)  # fmt: skip
    victim, kill_at = (int(v) for v in os.environ.get("LIVE_KILL", "-1:-1").split(":"))
    join_at = int(os.environ.get("LIVE_JOIN", "-1"))

    def on_change(view: View) -> None:
        # a training loop would reshard its data here: rank view.rank of view.world_size
        print(f"[id {rank}] now rank {view.rank} of {view.world_size} (generation "
              f"{view.generation}, lost ids {list(view.lost)})", flush=True)  # fmt: skip

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)
    )  # fmt: skip
    opt = DecentralizedAdamW(
        model.parameters(), lr=3e-3, topology="ring", timeout=4 * timeout,
        membership=live, on_membership_change=on_change,
    )  # fmt: skip
    first, view = 0, live.view  # live.view is opt.membership
    if join:  # it holds new rank 0's state, and counts from its step
        rank = view.members[view.rank]
        first = int(opt.state[next(model.parameters())]["step"])
        print(f"[id {rank}] joined as rank {view.rank} of {opt.world_size} at step {first}, "
              f"{time.time() - started:.2f} s after its process started", flush=True)  # fmt: skip
    took, changed = [], []
    for step in range(first, steps):
        if rank == victim and step == kill_at:
            store.set("example/killed_at", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == 0 and step == join_at:
            store.set("example/join_now", "1")
        begin = time.perf_counter()
        time.sleep(pause)  # the rest of a real step's compute
        x, y = batch(rank, step)  # by id: a survivor keeps its own data stream
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        generation = live.view.generation
        opt.step()
        opt.zero_grad()
        took.append(time.perf_counter() - begin)
        if join and step == first:
            print(f"[id {rank}] first step in the group completed {time.time() - started:.2f} s "
                  "after its process started", flush=True)  # fmt: skip
        if live.view.generation != generation:
            changed.append(len(took) - 1)
            if live.view.lost:
                killed = float(store.get("example/killed_at").decode())
                print(f"[id {rank}] step {step} completed {time.time() - killed:.2f} s after "
                      "the kill, in the rebuilt group", flush=True)  # fmt: skip
    for at in changed:  # the steps around a change, against the median step
        near = took[max(0, at - 2) : at + 3]
        print(f"[id {rank}] slowest step around the change at step {first + at}: "
              f"{max(near):.3f} s (median step {sorted(took)[len(took) // 2]:.3f} s)",
              flush=True)  # fmt: skip
    print(f"[id {rank}] done: {steps} steps, last loss {loss.item():.4f}, "
          f"world size {opt.world_size}", flush=True)  # fmt: skip
    opt.synchronize()  # the last round, before its group goes
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, help="start this many workers and host the store")
    parser.add_argument(
        "--serve-store", type=int, metavar="PORT",
        help="only host the store (as `python -m decent_optim.store --port PORT` does)",
    )  # fmt: skip
    parser.add_argument("--store", help="HOST:PORT of the store (a worker)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--timeout", type=float, default=5.0, help="membership's, in seconds")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds of compute per step")
    parser.add_argument("--join", action="store_true", help="join a running job (a newcomer)")
    args, rest = parser.parse_known_args()
    if args.serve_store is not None:  # kept for old scripts: the package's command does it
        return store_service.main(["--port", str(args.serve_store)])
    if args.workers:
        argv = ["--steps", str(args.steps), "--timeout", str(args.timeout)]
        return launch(args.workers, [*argv, "--pause", str(args.pause)])
    if not args.store:
        parser.error("pass --workers N, or --store HOST:PORT with RANK and WORLD_SIZE set")
    train(args.store, args.steps, args.timeout, args.pause, args.join)
    return 0


if __name__ == "__main__":
    sys.exit(main())
