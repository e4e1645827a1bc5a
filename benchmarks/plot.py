"""Plots from ``benchmarks/results/*.json``: iteration time vs link rate, predicted vs measured.

    python benchmarks/plot.py

Writes ``link_sweep.png`` (benchmark c) and ``model_vs_measured.png`` (every training row of
benchmarks b-d) to ``benchmarks/results/``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def rate_bits(tag: str) -> float:
    m = re.fullmatch(r"link_([\d.]+)(k|m|g)bit", tag)
    return float(m.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] if m else float("nan")


def main() -> None:
    runs = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("train_*.json"))]
    sweep = sorted(
        (r for r in runs if r["tag"].startswith("link_")), key=lambda r: rate_bits(r["tag"])
    )
    if sweep:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        methods = list(dict.fromkeys(row["method"] for r in sweep for row in r["rows"]))
        for m in methods:
            pts = [(rate_bits(r["tag"]), row["iteration_ms"]) for r in sweep for row in r["rows"]
                   if row["method"] == m]  # fmt: skip
            style = "--" if m.startswith("decentdp") else "-" if m.startswith("decent") else ":"
            ax.plot([p[0] / 1e6 for p in pts], [p[1] for p in pts], style, marker="o", label=m)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("inter-node link rate (Mbit/s)")
        ax.set_ylabel("time per iteration (ms)")
        ax.set_title("2 emulated nodes x 2 ranks (gloo, CPU)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(RESULTS / "link_sweep.png", dpi=120)
        print("wrote", RESULTS / "link_sweep.png")
    rows = [(r["tag"], row) for r in runs for row in r["rows"]]
    if rows:
        fig, ax = plt.subplots(figsize=(5, 5))
        for tag in dict.fromkeys(t for t, _ in rows):
            pts = [(row["iteration_ms"], row["predicted_ms"]) for t, row in rows if t == tag]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=tag, s=18)
        lo = min(min(r["iteration_ms"], r["predicted_ms"]) for _, r in rows) * 0.8
        hi = max(max(r["iteration_ms"], r["predicted_ms"]) for _, r in rows) * 1.2
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        ax.fill_between([lo, hi], [lo * 0.8, hi * 0.8], [lo * 1.2, hi * 1.2], color="k", alpha=0.08,
                        label="+-20%")  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured ms / iteration")
        ax.set_ylabel("runtime model ms / iteration")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(RESULTS / "model_vs_measured.png", dpi=120)
        print("wrote", RESULTS / "model_vs_measured.png")


if __name__ == "__main__":
    main()
