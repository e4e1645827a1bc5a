"""One run's results as the runner writes them: ``ttq_<tag>.csv`` (the curves), ``.md`` (its table:
each method against DDP) and ``.json`` (everything, with the run's link, shape, hardware and load
average), which ``report.py`` reads."""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

import _devices
import report


def write_run(args, nnodes: int, rows: list[dict], notes: list[str], regime: str) -> None:
    """Write the run's three files (above) into ``args.out`` and print its table."""
    out, load, timing = Path(args.out), os.getloadavg(), getattr(args, "timing_steps", 0)
    with open(out / f"ttq_{args.tag}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["tag", "method", "step", "train_s", "val_loss"])
        for r in rows:
            for c in r["curve"] if not timing else ():
                w.writerow([args.tag, r["method"], c["step"], f"{c['train_s']:.3f}",
                            f"{c['val_loss']:.6f}"])  # fmt: skip
    if timing:  # seconds per step after the first period (its start-up)
        for r in rows:
            r.update(timed_from=r["curve"][0]["step"], s_per_step=report.s_per_step(r, 0))
    hardware = args.hardware[0] if args.hardware else None
    meta = {"kind": "timing" if timing else "full", "tag": args.tag, "argv": sys.argv[1:],
            "loadavg": load, "link": args.link or "local", "shape": f"{nnodes}x{args.nproc}",
            "hardware": hardware, "seed": args.seed, "rows": rows, "notes": notes}  # fmt: skip
    (out / f"ttq_{args.tag}.json").write_text(json.dumps(meta, indent=2))
    groups: dict = {}
    report.add_run(groups, meta)
    key, group = next(iter(groups.items()))
    said = "a timing run (no evaluation)" if timing else (f"eval every {args.eval_every} steps "
            f"(excluded), target = DDP's final held-out loss {rows[0]['final_loss']:.4f}")  # fmt: skip
    text = "\n".join([
        f"`{args.tag}`: {nnodes} node(s) x {args.nproc} ranks, gloo, {args.workload} workload, "
        f"global batch {args.global_batch}, DDP schedule {args.steps} steps (warm-up "
        f"{args.warmup}), {said}; {_devices.describe(args)}{regime}", "",
        *([f"* {r['method']}: {r['s_per_step']:.4f} s / step (steps {r['timed_from']} to "
           f"{r['steps']})" for r in rows] if timing else [report.table(key, group, "ddp")]),
        "", *[f"* {n}" for n in notes]])  # fmt: skip
    (out / f"ttq_{args.tag}.md").write_text(text + "\n")
    print(text, flush=True)
