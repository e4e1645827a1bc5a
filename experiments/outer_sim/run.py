"""Steps to DDP's final loss for schedules of rounds, simulated on the time-to-quality task.

    python experiments/outer_sim/run.py --seed 0 --methods ddp local:H8:x2 diloco:H16 \
        delayed:H8:olr0.5:om0.9 ...

A method is ``<kind>[:H<h>][:x<lr factor>][:olr<outer lr>][:om<outer momentum>][:mixmom]
[:exact]``; kinds: ``ddp``, ``every``, ``local``, ``diloco``, ``snoo``, ``blocking``, ``delayed`` (see
``rounds.py``). ``x`` scales DDP's peak rate (6e-3) for the inner AdamW. ``exact`` replaces the
topology's round by the exact mean. ``ddp`` runs first and sets the target (its final held-out
loss); every other method runs until its workers' mean reaches it or ``--max-factor`` x the
steps. Results append to ``--out`` (CSV, one row per run; a run already there is skipped).
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import rounds  # noqa: E402
from task import AdamW, Task  # noqa: E402

from decent_optim.topologies import get as get_topology  # noqa: E402

FIELDS = ["seed", "topology", "lws", "method", "steps", "final_loss", "target", "steps_to_target"]


def parse(spec: str) -> dict:
    kind, *parts = spec.split(":")
    out = dict(kind=kind, h=1, k=1, x=1.0, olr=0.7, om=0.9, mixmom=False, exact=False)
    for p in parts:
        if p.startswith("H"):
            out["h"] = int(p[1:])
        elif p.startswith("K"):
            out["k"] = int(p[1:])
        elif p.startswith("x"):
            out["x"] = float(p[1:])
        elif p.startswith("olr"):
            out["olr"] = float(p[3:])
        elif p.startswith("om"):
            out["om"] = float(p[2:])
        elif p in ("mixmom", "exact"):
            out[p] = True
        else:
            raise SystemExit(f"bad method {spec!r}: {p!r}")
    return out


def make(m: dict, mixing, n: int):
    if m["exact"]:
        mixing = rounds.exact_mean(n)
    kind = m["kind"]
    if kind == "ddp":
        return rounds.Ddp()
    if kind == "every":
        return rounds.Every(mixing)
    if kind == "local":
        return rounds.Local(mixing, m["h"])
    if kind == "diloco":
        return rounds.DiLoCo(m["h"], m["olr"], m["om"])
    if kind == "snoo":
        return rounds.Snoo(m["h"], m["olr"], m["om"])
    if kind == "blocking":
        return rounds.BlockingOuter(mixing, m["h"], m["olr"], m["om"])
    if kind == "lnest":
        return rounds.LocalOuter(mixing, m["h"], m["k"], m["olr"], m["om"])
    if kind == "delayed":
        return rounds.DelayedOuter(mixing, m["h"], m["olr"], m["om"], m["mixmom"])
    raise SystemExit(f"unknown kind {kind!r}")


def train(task: Task, spec: str, mixing, max_steps: int, eval_every: int, target: float | None):
    m = parse(spec)
    method = make(m, mixing, task.n)
    x = task.initial()
    opt = AdamW(task, x)
    peak = task.hyper.lr * m["x"]
    ones = torch.ones(task.n)
    reached, loss, step = None, float("nan"), 0
    ranks = list(range(task.n))
    for step in range(max_steps):
        if hasattr(method, "before_update"):
            method.before_update(x, step)
        xb, yb = task.batches([step] * task.n, ranks)
        g = task.grads(x, xb, yb, average=getattr(method, "averages_gradients", False))
        opt.step(x, g, ones * peak * task.hyper.lr_factor(step), ones)
        method(x, step + 1)
        done = step + 1
        if done % eval_every == 0 or done == max_steps:
            loss = task.loss_of_mean(x)
            if target is not None and loss <= target:
                reached = done
                break
    return dict(steps=step + 1, final_loss=loss, steps_to_target=reached)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--topology", default="alternating-exp-ring")
    p.add_argument("--lws", type=int, default=2, help="workers per node (2 x 2: 2; 4 x 1: 1)")
    p.add_argument("--eval-every", type=int, default=24)
    p.add_argument("--max-factor", type=float, default=1.5)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results.csv"))
    args = p.parse_args()
    torch.set_num_threads(1)
    task = Task(args.workers, args.seed)
    topo = get_topology(args.topology, args.workers, args.lws)

    def mixing(r: int) -> torch.Tensor:
        return topo.mixing_matrix(r).float()

    out = Path(args.out)
    done = []
    if out.exists():
        done = list(csv.DictReader(out.open()))
    key = (str(args.seed), args.topology, str(args.lws))

    def find(method: str):
        return next((r for r in done if (r["seed"], r["topology"], r["lws"]) == key
                     and r["method"] == method), None)  # fmt: skip

    methods = list(args.methods)
    if methods[0] != "ddp":
        methods.insert(0, "ddp")
    target = None
    for method in methods:
        row = find(method)
        if row is None:
            start = time.time()
            steps = task.hyper.steps if method == "ddp" else int(task.hyper.steps * args.max_factor)
            res = train(task, method, mixing, steps, args.eval_every, target)
            row = dict(seed=args.seed, topology=args.topology, lws=args.lws, method=method,
                       target=target, **res)  # fmt: skip
            new = not out.exists()
            with out.open("a", newline="") as f:
                w = csv.DictWriter(f, fieldnames=FIELDS)
                if new:
                    w.writeheader()
                w.writerow(row)
            done.append({k: str(v) for k, v in row.items()})
            print(f"{method}: {res} ({time.time() - start:.0f} s)", flush=True)
        else:
            print(f"{method}: (done) {row}", flush=True)
        if method == "ddp":
            target = float(row["final_loss"])


if __name__ == "__main__":
    main()
