"""Stall per checkpoint save: ``decent_optim.checkpoint.save`` in the foreground vs in the background.

    python benchmarks/checkpoint_stall.py --params 25e6 --saves 5 --dir /tmp/stall

One process (a world of one: the file per rank is what each rank writes, whatever the world
size) trains an MLP of ``--params`` parameters with DecentralizedAdamW and saves every few steps,
alternating foreground and background saves so that both see the same machine load. The stall
of a save is the time from the start of the save call to the end of the next step, minus a
normal step's time: what training waited for. Prints the medians, their ratio and the load
average; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time

import torch
from torch import nn

import decent_optim as dopt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=25e6)
    p.add_argument("--saves", type=int, default=5, help="of each kind")
    p.add_argument("--dir", default="/tmp/checkpoint-stall")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    torch.set_num_threads(1)
    width = int((args.params / 4) ** 0.5)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
    opt = dopt.DecentralizedAdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, width)

    def step() -> float:
        start = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        return time.perf_counter() - start

    for _ in range(3):
        step()  # warm-up
    plain = statistics.median(step() for _ in range(5))
    stalls: dict[str, list[float]] = {"foreground": [], "background": []}
    shutil.rmtree(args.dir, ignore_errors=True)
    for k in range(2 * args.saves):
        kind = "background" if k % 2 else "foreground"
        dopt.checkpoint.wait(args.dir)  # the previous background save is not measured
        for _ in range(2):
            step()
        start = time.perf_counter()
        dopt.checkpoint.save(args.dir, model, opt, step=k, background=kind == "background")
        step()
        stalls[kind].append(time.perf_counter() - start - plain)
    dopt.checkpoint.wait(args.dir)
    size = sum(f.stat().st_size for f in os.scandir(next(os.scandir(args.dir))))
    result = {
        "params": sum(p.numel() for p in model.parameters()),
        "file_mb": round(size / 2**20, 1),
        "step_s": round(plain, 4),
        **{f"{kind}_stall_s": round(statistics.median(v), 4) for kind, v in stalls.items()},
        "load_average_1min": os.getloadavg()[0],
    }
    result["ratio"] = round(result["background_stall_s"] / result["foreground_stall_s"], 3)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
