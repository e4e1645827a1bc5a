"""Lose a node, keep the run: two torchrun agents, one killed at a step and brought back later.

    python experiments/elastic/scenario.py --workdir /tmp/elastic            # localhost
    python experiments/elastic/scenario.py --workdir /tmp/elastic --plot docs/images/elastic.png

Starts two elastic torchrun agents ("nodes") of ``--nproc-per-node`` workers each, on the c10d
rendezvous hosted by the first (``is_host=1``: the surviving node must host it), running
``examples/train_charlm.py`` with a checkpoint every ``--save-every`` steps. When the run has
completed step ``--kill-at`` it kills the second agent's whole process tree (SIGKILL); the first
node's workers raise ``GossipError``, its agent restarts them as a smaller world, and they resume
from the newest complete checkpoint. After ``--rejoin-after`` more steps it starts the second
agent again: the first agent sees a node waiting, restarts its workers, and the run continues at
the full size until ``--steps``. Prints and writes (``summary.json``) the steps lost, the
seconds from the kill to the next completed step and from the rejoin to the first step at full
size; ``--plot`` draws the loss curve across both changes.

``--node-cmd`` wraps each agent's command line (the emulated cluster runs one per network
namespace: see ``emulated.sh``); by default both run on localhost as plain processes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "train_charlm.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def agent(args: argparse.Namespace, port: int, host: bool, log: Path) -> subprocess.Popen:
    """One elastic torchrun agent ("node"), in a session of its own (to kill its whole tree)."""
    conf = (
        f"is_host={int(host)},last_call_timeout={args.last_call},join_timeout=300,"
        f"keep_alive_interval={args.keep_alive_interval},"
        f"keep_alive_max_attempt={args.keep_alive_max_attempt}"
    )
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", f"1:{args.nodes}", "--nproc-per-node", str(args.nproc_per_node),
        "--max-restarts", str(args.max_restarts), "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{args.host}:{port}", "--rdzv-id", "elastic-scenario",
        "--rdzv-conf", conf, "--monitor-interval", "0.2",
        *(["--local-addr", os.environ["EMU_NODE_ADDR"]] if "EMU_NODE_ADDR" in os.environ else []),
        str(SCRIPT), "--steps", str(args.steps), "--log-every", "1",
        "--eval-every", str(args.steps), "--save-every", str(args.save_every),
        "--checkpoint-dir", str(args.workdir / "ckpt"), "--metrics", str(args.workdir / "metrics.jsonl"),
        "--gossip-timeout", "30", "--batch-size", str(args.batch_size),
    ]  # fmt: skip
    if args.background:
        cmd.append("--background")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # A store of its own for every rendezvous round: torchrun's shared one keeps the previous
    # round's keys, and gloo then connects to the dead workers' addresses (torch 2.x)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.Popen(
        cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (torchrun starts each worker in a session of its own,
    so killing the agent's process group would leave them running)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(children.get(tree[-1], []))
    return tree


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants, as a node that loses power."""
    for member in descendants(pid):
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


def records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def wait_for(what: str, test, procs: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not test():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        if procs[0] is not None and procs[0].poll() is not None and not test():
            raise RuntimeError(f"the first agent exited ({procs[0].returncode}) before {what}")
        time.sleep(0.1)


def run(args: argparse.Namespace) -> dict:
    args.workdir.mkdir(parents=True, exist_ok=True)
    metrics = args.workdir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    port = int(os.environ["MASTER_PORT"]) if args.role == "node1" else free_port()
    full = args.nodes * args.nproc_per_node
    # role node1: the first node's agent runs in its own namespace (emulated.sh), not here
    first = None if args.role == "node1" else agent(args, port, True, args.workdir / "node0.log")
    second = agent(args, port, False, args.workdir / "node1.log")
    procs = [first, second]
    try:

        def done_at(world: int, after: float = 0.0) -> list[dict]:
            return [
                r for r in records(metrics)
                if "loss" in r and r["world_size"] == world and r["time"] > after
            ]  # fmt: skip

        wait_for(f"step {args.kill_at}", lambda: any(
            r["step"] >= args.kill_at for r in done_at(full)), procs, args.timeout)  # fmt: skip
        kill_tree(second.pid)
        killed_at = time.time()
        second.wait()
        last_before = max(r["step"] for r in records(metrics) if "loss" in r)
        small = full - args.nproc_per_node
        wait_for(
            "a step at the smaller size", lambda: done_at(small, killed_at), procs, args.timeout
        )
        start = next(
            r for r in records(metrics) if r.get("event") == "start" and r["time"] > killed_at
        )
        resumed_small = done_at(small, killed_at)[0]
        wait_for(f"{args.rejoin_after} steps at the smaller size", lambda: any(
            r["step"] >= resumed_small["step"] + args.rejoin_after
            for r in done_at(small, killed_at)), procs, args.timeout)  # fmt: skip
        rejoined_at = time.time()
        second = procs[1] = agent(args, port, False, args.workdir / "node1-rejoined.log")
        wait_for("a step at the full size", lambda: done_at(full, rejoined_at), procs, args.timeout)
        before_rejoin = max(r["step"] for r in done_at(small, killed_at))  # the last at that size
        grown = next(
            r for r in records(metrics) if r.get("event") == "start" and r["time"] > rejoined_at
        )
        first_full = done_at(full, rejoined_at)[0]
        for proc in procs:
            if proc is not None:
                proc.wait(timeout=args.timeout)
        codes = [None if p is None else p.returncode for p in procs]
    finally:
        for proc in procs:
            if proc is not None and proc.poll() is None:
                kill_tree(proc.pid)
    summary = {
        "world_sizes": [full, small, full],
        "kill_after_step": last_before,
        "resumed_from_step": start["step"],
        "steps_lost_at_kill": last_before - start["step"],
        "seconds_kill_to_next_step": round(resumed_small["time"] - killed_at, 1),
        "rejoin_after_step": before_rejoin,
        "resumed_at_full_size_from_step": grown["step"],
        "steps_lost_at_rejoin": before_rejoin - grown["step"],
        "seconds_rejoin_to_next_step": round(first_full["time"] - rejoined_at, 1),
        "final_step": max(r["step"] for r in records(metrics) if "loss" in r),
        "exit_codes": codes,
    }
    (args.workdir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def plot(workdir: Path, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = records(workdir / "metrics.jsonl")
    losses = [r for r in rows if "loss" in r]
    t0 = rows[0]["time"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8))
    for world in sorted({r["world_size"] for r in losses}, reverse=True):
        mine = [r for r in losses if r["world_size"] == world]
        ax.plot([r["step"] for r in mine], [r["loss"] for r in mine], ".", ms=3,
                label=f"{world} workers")  # fmt: skip
        bx.plot([r["time"] - t0 for r in mine], [r["step"] for r in mine], ".", ms=3,
                label=f"{world} workers")  # fmt: skip
    for r in rows:
        if r.get("event") == "start" and r["step"]:
            ax.axvline(r["step"], color="grey", lw=0.8, ls="--")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over workers)")
    ax.set_title("Loss across the failure and the rejoin")
    bx.set_xlabel("seconds since start")
    bx.set_ylabel("step completed")
    bx.set_title("Progress: steps redone after each restart")
    for a in (ax, bx):
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, required=True, help="shared by both nodes")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--kill-at", type=int, default=45)
    p.add_argument("--rejoin-after", type=int, default=30, help="steps at the smaller size")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--last-call", type=int, default=5, help="rendezvous last-call seconds")
    p.add_argument(
        "--keep-alive-interval", type=int, default=5,
        help="seconds between an agent's heartbeats (torch's default)",
    )  # fmt: skip
    p.add_argument(
        "--keep-alive-max-attempt", type=int, default=3,
        help="missed heartbeats after which the rendezvous counts a node as gone (torch's default)",
    )  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="the rendezvous host (the first node)")
    p.add_argument("--background", action="store_true", help="background checkpoint saves")
    p.add_argument("--timeout", type=float, default=300.0, help="per phase")
    p.add_argument("--plot", help="write the loss curve here")
    p.add_argument(
        "--role", choices=["local", "node0", "node1"], default="local",
        help="local: both agents here; node0/node1: one node of emulated.sh",
    )  # fmt: skip
    args = p.parse_args()
    if args.role == "node0":  # the rendezvous host: just its agent, to the end
        args.host = os.environ["MASTER_ADDR"]
        sys.exit(
            agent(args, int(os.environ["MASTER_PORT"]), True, args.workdir / "node0.log").wait()
        )
    if args.role == "node1":
        args.host = os.environ["MASTER_ADDR"]
    summary = run(args)
    print(json.dumps(summary, indent=1))
    if args.plot:
        plot(args.workdir, args.plot)


if __name__ == "__main__":
    main()
