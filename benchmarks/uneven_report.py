"""The tables of ``uneven_ttq.sh``: time to DDP's loss per method on even and uneven devices.

    python benchmarks/uneven_report.py            # reads results/ttq_*_uneven_*.json
    python benchmarks/uneven_report.py --rst      # one summary table, for the docs

For every (link rate, cluster shape, seed): each method's time to DDP's final loss with even
devices, with one rank at half speed and with 30% jitter, and the ratio of each to the same
method's even time (the issue's measure: what uneven hardware costs a method), then its final
loss against DDP's. ``--rst``: one row per (link, shape, seed), each method's uneven time over
its even time, and the uneven mode's even time over the step-locked mode's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
NAME = re.compile(
    r"ttq_(?P<rate>[^_]+)_uneven(?P<tag>[-\w]*?)_(?P<shape>\dx\d)_(?P<hw>even|half|jitter)_s(?P<seed>\d+)"
)
HARDWARE = ("even", "half", "jitter")


def load() -> dict:
    runs: dict = {}
    for path in sorted(RESULTS.glob("ttq_*_uneven_*.json")):
        match = NAME.fullmatch(path.stem)
        if match is None:
            continue
        meta = json.loads(path.read_text())
        key = (match["rate"], match["shape"], match["seed"], match["tag"])
        runs.setdefault(key, {})[match["hw"]] = {r["method"]: r for r in meta["rows"]}
        runs[key].setdefault("_load", {})[match["hw"]] = meta["loadavg"][0]
    return runs


def _time(row: dict | None) -> float | None:
    if row is None:
        return None
    return row["train_s"] if row["method"] == "ddp" else row["time_to_target_s"]


def table(key: tuple, by_hw: dict) -> str:
    rate, shape, seed, tag = key
    hws = [h for h in HARDWARE if h in by_hw]
    methods = list(dict.fromkeys(m for h in hws for m in by_hw[h]))
    loads = ", ".join(f"{h} {by_hw['_load'][h]:.1f}" for h in hws)
    lines = [
        f"{rate}, {shape}, seed {seed}{' ' + tag if tag else ''} (load average at the end: {loads})",
        "",
        "| method | " + " | ".join(hws) + " | final loss vs DDP (" + ", ".join(hws) + ") |",
        "|---|" + "---:|" * len(hws) + "---|",
    ]
    for m in methods:
        even = _time(by_hw.get("even", {}).get(m))
        cells, gaps = [], []
        for h in hws:
            row = by_hw[h].get(m)
            t = _time(row)
            if row is None:
                cells.append("-")
                continue
            if t is None:
                cells.append(f"not reached ({row['train_s']:.0f} s)")
            elif h == "even" or even is None:
                cells.append(f"{t:.1f} s")
            else:
                cells.append(f"{t:.1f} s ({t / even:.2f}x)")
            ddp = by_hw[h].get("ddp")
            if ddp:
                gaps.append(f"{(row['final_loss'] / ddp['final_loss'] - 1) * 100:+.2f}%")
        lines.append(f"| {m} | " + " | ".join(cells) + " | " + ", ".join(gaps) + " |")
    return "\n".join(lines)


LOCKED = "decent:alternating-exp-ring+int8:H4"
UNEVEN = "decent:alternating-exp-ring+int8:H2:uneven"


def _ratio(by_hw: dict, hw: str, method: str) -> str:
    t, even = _time(by_hw.get(hw, {}).get(method)), _time(by_hw.get("even", {}).get(method))
    if hw in by_hw and method in by_hw[hw] and t is None:
        return "not reached"
    return "-" if t is None or even is None else f"{t / even:.2f}x"


def summary(runs: dict) -> str:
    """An RST list-table: time on uneven devices over the same method's even time."""
    head = ["link, shape, seed", "DDP half", "DiLoCo half", "H=4 half", "H=2 uneven half",
            "H=2 uneven jitter", "H=2 uneven even / H=4 even", "load"]  # fmt: skip
    lines = [".. list-table::", "   :header-rows: 1", ""]
    rows = [head]
    for (rate, shape, seed, tag), by_hw in sorted(
        runs.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])
    ):
        if tag:
            continue
        even = by_hw.get("even", {})
        both = [_time(even.get(m)) for m in (UNEVEN, LOCKED)]
        vs = f"{both[0] / both[1]:.2f}" if None not in both else "-"
        loads = "/".join(f"{v:.1f}" for v in by_hw["_load"].values())
        rows.append([f"{rate}, {shape}, {seed}", _ratio(by_hw, "half", "ddp"),
                     _ratio(by_hw, "half", "diloco:H16"), _ratio(by_hw, "half", LOCKED),
                     _ratio(by_hw, "half", UNEVEN), _ratio(by_hw, "jitter", UNEVEN), vs, loads])  # fmt: skip
    for row in rows:
        lines.append("   * - " + row[0])
        lines += [f"     - {cell}" for cell in row[1:]]
    return "\n".join(lines)


def main() -> None:
    import sys

    runs = load()
    if "--rst" in sys.argv[1:]:
        print(summary(runs))
        return
    for key, by_hw in sorted(runs.items()):
        print(table(key, by_hw) + "\n")


if __name__ == "__main__":
    main()
