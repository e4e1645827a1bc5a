"""Time over even-hardware time at 16 workers, from ``uneven_ttq.sh``'s results (TAG=-16w).

    python experiments/uneven16/report.py [--tag=-16w[,-16wb...]] [--shape 8x2] [--rate 1gbit]
        [--seed 0] [--tolerance 0.01] [--losses 0.6,0.5] [--versus METHOD]

Several tags (comma-separated) merge their runs (a method's first tag wins).
At 16 workers with the harness's global batch of 32 (two sequences a rank) and a 240-step
schedule no method but DDP reached DDP's final held-out loss, so the time to DDP's loss is
undefined for them. Each cell here is instead the time a method took on uneven devices to reach
the final loss *it* reached on even devices, over its time to that loss on even devices (the
question of issue 39: what unevenness costs a method), and, for a comparison across methods,
the time to a loss every run reached (the worst final loss of the even runs). With
``--tolerance t`` a second ratio column takes the own even loss times ``1 + t`` as the target,
so that run-to-run noise in the last digits does not decide "not reached".
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


def _ms_per_step(row: dict) -> str:
    """Wall-clock milliseconds per (DDP-equivalent) step over the run's last curve point."""
    last = row["curve"][-1]
    step = last.get("step") or last.get("progress")
    return "-" if not step else f"{1000 * float(last['train_s']) / float(step):.0f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tag", default="-16w", help="comma-separated; write --tag=-16w")
    p.add_argument("--tolerance", type=float, default=0.01)
    p.add_argument("--losses", default="", help="comma-separated: also the time to each loss")
    p.add_argument("--shape", default="8x2")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--seed", default="0")
    p.add_argument(
        "--versus",
        default="",
        help="also each method's time to each loss over this "
        "method's on the same hardware (needs --losses)",
    )
    args = p.parse_args()
    runs: dict[str, tuple[dict, list]] = {}
    for hardware in ("even", "quarter", "jitter", "half"):
        for tag in args.tag.split(","):
            name = f"ttq_{args.rate}_uneven{tag}_{args.shape}_{hardware}_s{args.seed}.json"
            if (RESULTS / name).exists():
                data = json.loads((RESULTS / name).read_text())
                rows, load = runs.setdefault(hardware, ({}, data["loadavg"]))
                for r in data["rows"]:
                    rows.setdefault(r["method"], {**r, "loadavg": data["loadavg"]})
    even, _ = runs["even"]
    common = max(min(pt["val_loss"] for pt in r["curve"]) for r in even.values())
    print(f"common target: {common:.4f} (the worst best loss of the even runs)\n")
    print(
        f"| method | hardware | own even loss | time / even time | within {args.tolerance:.0%} "
        "| time to common target s | ms/step | final loss | load |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for method, base in even.items():
        own = min(pt["val_loss"] for pt in base["curve"])
        loose = own * (1 + args.tolerance)
        t_even, t_even_loose = _time_to(base["curve"], own), _time_to(base["curve"], loose)
        for hardware, (rows, _) in runs.items():
            row = rows.get(method)
            if row is None:
                continue
            ratios = []
            for target, t0 in ((own, t_even), (loose, t_even_loose)):
                t = _time_to(row["curve"], target)
                ratios.append("not reached" if t is None or not t0 else f"{t / t0:.2f}x")
            tc = _time_to(row["curve"], common)
            tcs = "-" if tc is None else f"{tc:.1f}"
            final = row["final_loss"]
            loads = "/".join(f"{x:.1f}" for x in row["loadavg"])
            pace = _ms_per_step(row)
            print(
                f"| {method} | {hardware} | {own:.4f} | {ratios[0]} | {ratios[1]} | {tcs} "
                f"| {pace} | {final:.4f} | {loads} |"
            )
    if args.losses:
        _at_losses(runs, [float(x) for x in args.losses.split(",")])
    if args.versus and args.losses:
        _versus(runs, args.versus, [float(x) for x in args.losses.split(",")])


def _at_losses(runs: dict, losses: list[float]) -> None:
    """Time to each loss on uneven devices over the same method's on even devices (a method
    with no even run of its own, ``...:fixed``, is compared with its even run without it: the
    periods differ only when the speeds do)."""
    even, _ = runs["even"]
    print("\n| method | hardware | " + " | ".join(f"to {x:g}" for x in losses) + " | final |")
    print("|---|---|" + "---:|" * (len(losses) + 1))
    for hardware, (rows, _) in runs.items():
        if hardware == "even":
            continue
        for method, row in rows.items():
            base = even.get(method) or even.get(method.removesuffix(":fixed"))
            if base is None:
                continue
            cells = []
            for loss in losses:
                t, t0 = _time_to(row["curve"], loss), _time_to(base["curve"], loss)
                cells.append("-" if t is None or t0 is None else f"{t / t0:.2f}x")
            print(
                f"| {method} | {hardware} | " + " | ".join(cells) + f" | {row['final_loss']:.4f} |"
            )


def _versus(runs: dict, reference: str, losses: list[float]) -> None:
    """Time to each loss over ``reference``'s time to it on the same hardware (the reference's
    own row: its seconds): is a variant faster or slower than the method it varies?"""
    print("\n| method | hardware | " + " | ".join(f"to {x:g}" for x in losses) + " | final |")
    print("|---|---|" + "---:|" * (len(losses) + 1))
    for hardware, (rows, _) in runs.items():
        base = rows.get(reference)
        if base is None:
            continue
        for method, row in rows.items():
            if not method.startswith(reference):
                continue
            cells = []
            for loss in losses:
                t, t0 = _time_to(row["curve"], loss), _time_to(base["curve"], loss)
                if t0 is None:
                    cells.append("-" if t is None else f"{t:.0f} s (ref. -)")
                elif method == reference:
                    cells.append(f"{t0:.0f} s")
                else:
                    cells.append("-" if t is None else f"{t / t0:.2f}x")
            print(
                f"| {method} | {hardware} | " + " | ".join(cells) + f" | {row['final_loss']:.4f} |"
            )


if __name__ == "__main__":
    main()
