"""Time over even-hardware time at 16 workers, from ``uneven_ttq.sh``'s results (TAG=-16w).

    python experiments/uneven16/report.py [--tag -16w] [--shape 8x2] [--rate 1gbit] [--seed 0]

At 16 workers with the harness's global batch of 32 (two sequences a rank) and a 240-step
schedule no method but DDP reached DDP's final held-out loss, so the time to DDP's loss is
undefined for them. Each cell here is instead the time a method took on uneven devices to reach
the final loss *it* reached on even devices, over its time to that loss on even devices (the
question of issue 39: what unevenness costs a method), and, for a comparison across methods,
the time to a loss every run reached (the worst final loss of the even runs).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _time_to(curve: list[dict], loss: float) -> float | None:
    for point in curve:
        if point["val_loss"] <= loss:
            return float(point["train_s"])
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tag", default="-16w")
    p.add_argument("--shape", default="8x2")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--seed", default="0")
    args = p.parse_args()
    runs = {}
    for hardware in ("even", "quarter", "jitter", "half"):
        path = (
            RESULTS / f"ttq_{args.rate}_uneven{args.tag}_{args.shape}_{hardware}_s{args.seed}.json"
        )
        if path.exists():
            data = json.loads(path.read_text())
            runs[hardware] = ({r["method"]: r for r in data["rows"]}, data["loadavg"])
    even, _ = runs["even"]
    common = max(min(pt["val_loss"] for pt in r["curve"]) for r in even.values())
    print(f"common target: {common:.4f} (the worst best loss of the even runs)\n")
    print(
        "| method | hardware | own even loss | time / even time | time to common target s | final loss | load |"
    )
    print("|---|---|---:|---:|---:|---:|---|")
    for method, base in even.items():
        own = min(pt["val_loss"] for pt in base["curve"])
        t_even = _time_to(base["curve"], own)
        for hardware, (rows, load) in runs.items():
            row = rows.get(method)
            if row is None:
                continue
            t = _time_to(row["curve"], own)
            ratio = "not reached" if t is None or not t_even else f"{t / t_even:.2f}x"
            tc = _time_to(row["curve"], common)
            tcs = "-" if tc is None else f"{tc:.1f}"
            final = row["final_loss"]
            loads = "/".join(f"{x:.1f}" for x in load)
            print(
                f"| {method} | {hardware} | {own:.4f} | {ratio} | {tcs} | {final:.4f} | {loads} |"
            )


if __name__ == "__main__":
    main()
