"""Steps to DDP's loss at many workers, simulated in one process (``_sim.py``, ``_sim_methods.py``).

    python benchmarks/simulate.py --workers 16 --local-world-size 2 --seeds 0 1 \\
        --methods ddp decent:one-peer-exp+int8:x3 diloco:H16:x1.5:olr0.5:om0.7

For each seed DDP trains the schedule (``--steps``) and its final held-out loss is the target;
every other method trains ``--max-steps-factor`` x the steps (``--stop-at-target``: until its
consensus model reaches the target), evaluated every ``--eval-every`` steps. One JSON line per
run is appended to ``--out`` (default ``benchmarks/results/sim_<workload>_<n>w.jsonl``); a run
already there (same workload, workers, shape, batch, schedule, seed and method) is skipped, and
a DDP run there gives the target without training again. ``--table`` prints the file's runs as a
Markdown table: steps to the target as a multiple of DDP's steps and the loss at the budget.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _sim  # noqa: E402
import _sim_methods  # noqa: E402
import torch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
KEY = ("workload", "workers", "lws", "global_batch", "steps", "warmup", "seed", "method")


def run(task: _sim.Task, spec: str, sched: _sim.Schedule, args, target: float | None) -> dict:
    method = _sim_methods.Method(spec, task, sched.lr, args.decent_lr_factor)
    budget = sched.steps if spec.startswith("ddp") else int(sched.steps * args.max_steps_factor)
    curve, reached, began = [], None, time.perf_counter()
    for t in range(budget):
        method.step(t, sched.factor(t))
        done = t + 1
        if done % args.eval_every and done != budget:
            continue
        loss = task.loss_of(method.consensus())
        curve.append([done, round(loss, 6)])
        if target is not None and reached is None and loss <= target:
            reached = done
        print(f"  {spec} seed {task.seed}: step {done} loss {loss:.4f}", flush=True)
        if reached and args.stop_at_target:
            break
    return {"curve": curve, "final_loss": curve[-1][1], "target": target,
            "steps_to_target": reached, "global_rounds": method.global_rounds,
            "wall_s": round(time.perf_counter() - began, 1)}  # fmt: skip


def load(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def table(rows: list[dict]) -> str:
    """Markdown: per (workers, method) and seed, steps to DDP's loss / DDP's steps and the loss
    at the budget relative to DDP's."""

    def schedule(r: dict) -> tuple:  # a file may hold runs of several schedules
        return r["workers"], r["seed"], r["workload"], r["steps"], r["warmup"]

    ddp = {schedule(r): r for r in rows if r["method"] == "ddp"}
    out = ["| workload | workers | method | seed | steps to DDP's loss (x DDP's) | loss at the budget (vs DDP) |",
           "|---|---:|---|---:|---|---|"]  # fmt: skip
    for r in rows:
        base = ddp.get(schedule(r))
        if base is None or r["method"] == "ddp":
            continue
        reach = r["steps_to_target"]
        x = f"{reach} ({reach / base['steps']:.2f}x)" if reach else f"not in {r['curve'][-1][0]}"
        rel = r["final_loss"] / base["final_loss"] - 1
        out.append(f"| {r['workload']} | {r['workers']} | `{r['method']}` | {r['seed']} | {x} | "
                   f"{r['final_loss']:.4f} at {r['curve'][-1][0]} ({rel:+.1%}) |")  # fmt: skip
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", default="shakespeare", choices=("char", "shakespeare"))
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--local-world-size", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=480)
    p.add_argument("--warmup", type=int, default=48)
    p.add_argument("--lr", type=float, default=6e-3)
    p.add_argument("--decent-lr-factor", type=float, default=2.0)
    p.add_argument("--eval-every", type=int, default=24)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--max-steps-factor", type=float, default=1.5)
    p.add_argument("--stop-at-target", action="store_true")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--methods", nargs="+", default=["ddp"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    p.add_argument("--table", action="store_true", help="print the runs in --out and stop")
    args = p.parse_args(argv)
    out = Path(args.out or RESULTS / f"sim_{args.workload}_{args.workers}w.jsonl")
    if args.table:
        print(table(load(out)))
        return
    torch.set_num_threads(args.threads)
    for spec in args.methods:
        _sim_methods.parse(spec)  # every spec checked before hours of training
    sched = _sim.Schedule(args.steps, args.warmup, args.lr)
    for seed in args.seeds:
        task = _sim.Task(args.workload, args.workers, seed, args.global_batch, args.val_batches,
                         args.local_world_size)  # fmt: skip
        common = {"workload": args.workload, "workers": args.workers,
                  "lws": args.local_world_size, "global_batch": args.global_batch,
                  "steps": args.steps, "warmup": args.warmup, "seed": seed}  # fmt: skip
        done = {tuple(r[k] for k in KEY): r for r in load(out)}
        ddp = done.get(tuple({**common, "method": "ddp"}[k] for k in KEY))
        for spec in ["ddp", *[s for s in args.methods if s != "ddp"]]:
            row = {**common, "method": spec}
            if tuple(row[k] for k in KEY) in done:
                continue
            target = None if spec == "ddp" else ddp["final_loss"]  # type: ignore[index]
            row.update(run(task, spec, sched, args, target), decent_lr_factor=args.decent_lr_factor)
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            if spec == "ddp":
                ddp = row


if __name__ == "__main__":
    main()
