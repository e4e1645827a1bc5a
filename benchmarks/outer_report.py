"""The tables of ``outer_ttq.sh``: time and steps to DDP's loss, against the best-tuned DiLoCo.

    python benchmarks/outer_report.py            # reads results/ttq_*_outer_*.json
    python benchmarks/outer_report.py --md       # one summary table (markdown), for notes

For every (link rate, cluster shape, seed): each method's time to DDP's final loss, its steps,
its time and steps over DiLoCo's (the ``diloco:`` method of the run, tuned in
``experiments/outer_sim``), its final loss against DDP's and the run's load average.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
NAME = re.compile(r"ttq_(?P<rate>[^_]+)_outer_(?P<shape>\dx\d)_s(?P<seed>\d+)")
RATES = {"1gbit": 0, "100mbit": 1, "20mbit": 2}


def load() -> dict:
    runs = {}
    for path in RESULTS.glob("ttq_*_outer_*.json"):
        match = NAME.fullmatch(path.stem)
        if match:
            runs[(match["rate"], match["shape"], match["seed"])] = json.loads(path.read_text())
    return dict(sorted(runs.items(), key=lambda kv: (kv[0][1], RATES.get(kv[0][0], 9), kv[0][2])))


def _time(row: dict) -> float | None:
    return row["train_s"] if row["method"] == "ddp" else row["time_to_target_s"]


def _steps(row: dict) -> int | None:
    return row["steps"] if _time(row) is not None else None


def _diloco(rows: list[dict]) -> dict | None:
    return next((r for r in rows if r["method"].startswith("diloco")), None)


def table(key: tuple, meta: dict) -> str:
    rate, shape, seed = key
    rows = meta["rows"]
    ddp = next(r for r in rows if r["method"] == "ddp")
    base = _diloco(rows)
    lines = [
        f"{rate}, {shape}, seed {seed} (load average at the end: {meta['loadavg'][0]:.1f})",
        "",
        "| method | time to DDP's loss | vs DiLoCo | steps | vs DiLoCo | ms/step | final loss vs DDP |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        t, s = _time(r), _steps(r)
        bt, bs = (_time(base), _steps(base)) if base else (None, None)
        cells = [
            f"{t:.1f} s" if t is not None else f"not reached ({r['train_s']:.0f} s)",
            f"{t / bt:.2f}x" if t is not None and bt else "-",
            str(s) if s is not None else "-",
            f"{s / bs:.2f}x" if s is not None and bs else "-",
            f"{r['ms_per_step']:.1f}",
            f"{(r['final_loss'] / ddp['final_loss'] - 1) * 100:+.2f}%",
        ]
        lines.append(f"| {r['method']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(runs: dict) -> str:
    """One row per run: each method's time over the best-tuned DiLoCo's (steps in brackets)."""
    methods = list(dict.fromkeys(r["method"] for m in runs.values() for r in m["rows"]))
    lines = [
        "| link, shape, seed | " + " | ".join(methods) + " | load |",
        "|---|" + "---:|" * len(methods) + "---:|",
    ]
    for (rate, shape, seed), meta in runs.items():
        by = {r["method"]: r for r in meta["rows"]}
        base = _diloco(meta["rows"])
        cells = []
        for m in methods:
            r = by.get(m)
            t = None if r is None else _time(r)
            if r is None or t is None or base is None or _time(base) is None:
                cells.append("-" if r is None else "not reached")
                continue
            cells.append(f"{t / _time(base):.2f}x ({r['steps']} steps)")
        lines.append(
            f"| {rate}, {shape}, {seed} | " + " | ".join(cells) + f" | {meta['loadavg'][0]:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    runs = load()
    if "--md" in sys.argv[1:]:
        print(summary(runs))
        return
    for key, meta in runs.items():
        print(table(key, meta) + "\n")


if __name__ == "__main__":
    main()
