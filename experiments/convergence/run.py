"""Run the convergence study and write its table and plots (see README.md).

    python experiments/convergence/run.py                    # the study in the docs (~40 min)
    python experiments/convergence/run.py --report-only      # redraw table and plots from the CSV

For each worker count it starts ``train.py`` once under torchrun (gloo, one thread per worker),
which trains every task x seed x learning-rate scale x method in turn and appends one row per
evaluation to ``<out>/runs.csv``. Then it summarises the final evaluation of every run:
``summary.csv`` / ``summary.md`` (validation loss mean and spread over seeds, its gap to
All-Reduce, accuracy, consensus distance) and ``val_loss_<task>.png`` (validation loss and
consensus distance vs step, mean over seeds).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
COLORS = {
    "AdamW (DDP)": "black",
    "DecentralizedAdamW": "C0",
    "AccumAdamW": "C3",
    "AccumAdamW, betas^s": "C2",
}
TOPOLOGIES = ["ring", "one-peer-exp", "complete"]
METHODS = ["allreduce"] + [f"{o}:{t}" for o in ("adamw", "accumadamw") for t in TOPOLOGIES]
METHODS.append("accumadamw^s:ring")  # the investigation of README.md: betas per refresh
# a run is identified by everything but the seed; these columns name it in the summary
KEY = ["task", "workers", "global_batch", "local_batch", "method", "accum_iter", "lr_scale"]


def launch(workers: int, args: argparse.Namespace, csv_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={workers}", str(HERE / "train.py"),
        "--tasks", *args.tasks, "--methods", *args.methods,
        "--seeds", *map(str, args.seeds), "--steps", str(args.steps),
        "--global-batch", str(args.global_batch), "--accum-iter", str(args.accum_iter),
        "--lr-scales", *map(str, args.lr_scales), "--eval-every", str(args.eval_every),
        "--csv", str(csv_path),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # never join an outer torchrun's world
    print(
        f"== {workers} workers: {' '.join(cmd[2:4])} ... (progress: one line per run)", flush=True
    )
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True)
    print(f"== {workers} workers done in {time.perf_counter() - start:.0f} s", flush=True)


def read_rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:.4f}"
    return f"{mean:.4f} ± {statistics.stdev(values):.4f}"


def summarise(rows: list[dict]) -> list[dict]:
    """One line per run configuration: its final evaluation, over seeds."""
    final: dict[tuple, dict[str, dict]] = defaultdict(dict)  # key -> seed -> last row
    for row in rows:
        seed_rows = final[tuple(row[k] for k in KEY)]
        last = seed_rows.get(row["seed"])
        if last is None or int(row["step"]) > int(last["step"]):
            seed_rows[row["seed"]] = row
    # the reference: All-Reduce at the task's own learning rate, same workers and batch
    reference: dict[tuple, float] = {}
    for key, by_seed in final.items():
        if key[KEY.index("method")] == "allreduce" and float(key[KEY.index("lr_scale")]) == 1.0:
            reference[key[:4]] = statistics.fmean(float(r["val_loss"]) for r in by_seed.values())
    out = []
    for key, by_seed in sorted(final.items(), key=lambda kv: _order(kv[0])):
        last_rows = list(by_seed.values())
        loss = [float(r["val_loss"]) for r in last_rows]
        ref = reference.get(key[:4])
        first = last_rows[0]
        out.append(
            {
                "task": first["task"],
                "workers": first["workers"],
                "local batch": first["local_batch"],
                "optimizer": first["optimizer"]
                + (f" (accum_iter={first['accum_iter']})" if first["accum_iter"] else ""),
                "topology": first["topology"],
                "lr scale": first["lr_scale"],
                "steps": first["step"],
                "seeds": len(last_rows),
                "val loss": _spread(loss),
                "vs All-Reduce": "" if ref is None else f"{100 * (statistics.fmean(loss) / ref - 1):+.1f}%",
                "val accuracy": f"{statistics.fmean(float(r['val_acc']) for r in last_rows):.3f}",
                "consensus distance": f"{statistics.fmean(float(r['consensus_distance']) for r in last_rows):.3g}",
            }
        )  # fmt: skip
    return out


def _order(key: tuple) -> tuple:
    task, workers, global_batch, _, method, accum_iter, lr_scale = key
    rank = METHODS.index(method) if method in METHODS else len(METHODS)
    return (
        task,
        int(workers),
        int(global_batch),
        float(lr_scale),
        rank,
        method,
        int(accum_iter or 0),
    )


def write_tables(summary: list[dict], out: Path) -> None:
    with (out / "summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, list(summary[0]))
        writer.writeheader()
        writer.writerows(summary)
    lines = ["| " + " | ".join(summary[0]) + " |", "|" + "---|" * len(summary[0])]
    lines += ["| " + " | ".join(str(v) for v in row.values()) + " |" for row in summary]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot(rows: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"all-reduce": "-", "ring": "-", "one-peer-exp": "--", "complete": ":"}
    written = []
    for task in sorted({r["task"] for r in rows}):
        if len({r["lr_scale"] for r in rows if r["task"] == task}) > 1:
            written.append(plot_lr_sweep([r for r in rows if r["task"] == task], out, plt))
        mine = [r for r in rows if r["task"] == task and float(r["lr_scale"]) == 1.0]
        counts = sorted({int(r["workers"]) for r in mine})
        fig, axes = plt.subplots(
            2, len(counts), figsize=(4.6 * len(counts), 6.4), squeeze=False, sharex=True
        )
        for col, workers in enumerate(counts):
            curves: dict[tuple, dict[int, list[tuple[float, float]]]] = defaultdict(
                lambda: defaultdict(list)
            )
            for r in mine:
                if int(r["workers"]) == workers:
                    curve = curves[(r["optimizer"], r["topology"])][int(r["step"])]
                    curve.append((float(r["val_loss"]), float(r["consensus_distance"])))
            local = next(r["local_batch"] for r in mine if int(r["workers"]) == workers)
            for (optimizer, topology), by_step in sorted(curves.items()):
                steps = sorted(by_step)
                label = optimizer if topology == "all-reduce" else f"{optimizer}, {topology}"
                style = dict(color=COLORS.get(optimizer), linestyle=styles.get(topology, "-"))
                val = [statistics.fmean(v for v, _ in by_step[s]) for s in steps]
                axes[0][col].plot(steps, val, label=label, **style)
                if topology != "all-reduce":
                    d2c = [statistics.fmean(d for _, d in by_step[s]) for s in steps]
                    axes[1][col].plot(steps, d2c, **style)
            axes[0][col].set_title(f"{task}: {workers} workers, local batch {local}")
            axes[0][col].set_yscale("log")
            axes[1][col].set_yscale("log")
            axes[1][col].set_xlabel("step")
            for ax in axes[:, col]:
                ax.grid(alpha=0.3, which="both")
        axes[0][0].set_ylabel("validation loss (consensus model)")
        axes[1][0].set_ylabel("consensus distance (RMS over workers)")
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        path = out / f"val_loss_{task}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def plot_lr_sweep(rows: list[dict], out: Path, plt: Any) -> Path:
    """Final validation loss vs learning-rate scale, one line per method and worker count."""
    final: dict[tuple, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    last_step = max(int(r["step"]) for r in rows)
    for r in rows:
        if int(r["step"]) == last_step:
            label = (
                r["optimizer"]
                if r["topology"] == "all-reduce"
                else f"{r['optimizer']}, {r['topology']}"
            )
            key = (label, r["workers"], r["optimizer"])
            final[key][float(r["lr_scale"])].append(float(r["val_loss"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    for (label, workers, optimizer), by_scale in sorted(final.items()):
        scales = sorted(by_scale)
        means = [statistics.fmean(by_scale[k]) for k in scales]
        ax.plot(
            scales, means, "o-", color=COLORS.get(optimizer), label=f"{label} ({workers} workers)"
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("learning rate / the task's default")
    ax.set_ylabel(f"validation loss at step {last_step}")
    ax.set_title(f"{rows[0]['task']}: learning-rate sweep")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / f"lr_sweep_{rows[0]['task']}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--tasks", nargs="+", default=["charlm", "digits"])
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--accum-iter", type=int, default=4)
    parser.add_argument("--lr-scales", nargs="+", type=float, default=[1.0])
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--report-only", action="store_true", help="skip training")
    parser.add_argument(
        "--append", action="store_true", help="add to <out>/runs.csv instead of starting afresh"
    )
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = args.out / "runs.csv"
    if not args.report_only:
        if csv_path.exists() and not args.append:
            csv_path.unlink()  # a fresh study; --report-only reuses the file
        for workers in args.workers:
            launch(workers, args, csv_path)
    rows = read_rows(csv_path)
    write_tables(summarise(rows), args.out)
    print(f"wrote {args.out / 'summary.csv'} and {args.out / 'summary.md'}")
    if not args.no_plots:
        for path in plot(rows, args.out):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
