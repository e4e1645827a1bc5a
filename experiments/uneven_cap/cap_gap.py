"""The cap of ``uneven=Uneven(cap=c)`` at large speed gaps: steps per period, drift, loss.

torchrun --standalone --nproc-per-node 4 experiments/uneven_cap/cap_gap.py --gap 10 --cap 4
torchrun --standalone --nproc-per-node 4 experiments/uneven_cap/cap_gap.py --gap 10 --cap none

The character GPT of ``examples/train_charlm.py``, ``local_steps=2``, the last rank ``--gap``
times slower than the others (every step padded to an emulated device time by a sleep). Rank 0
prints one JSON line: each rank's steps, the most steps a fast rank took in one period (from a
launch to the mix of that round), the consensus distance and the held-out loss of the
consensus model at the end, and the seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import decent_optim as dopt

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train_charlm  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="budget, DDP-equivalent steps")
    p.add_argument("--step-ms", type=float, default=40.0, help="the fast ranks' device time")
    p.add_argument("--gap", type=float, default=10.0, help="the last rank is this much slower")
    p.add_argument("--cap", default="4", help="Uneven(cap=...), or 'none'")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    delay = args.step_ms / 1e3 * (args.gap if rank == n - 1 else 1.0)
    cap = None if args.cap == "none" else float(args.cap)
    corpus = train_charlm.load_corpus()
    torch.manual_seed(0)
    model = train_charlm.CharGPT(corpus.vocab_size)
    peak, local_steps = 3e-3, 2
    opt = dopt.DecentralizedAdamW(
        model.parameters(),
        lr=peak,
        topology="ring",
        local_steps=local_steps,
        uneven=dopt.Uneven(cap=cap),
        timeout=120,
    )
    opt.stop_at(args.steps)
    gen = torch.Generator().manual_seed(rank)
    steps, launched_at, longest, start = 0, local_steps, 0, time.perf_counter()
    while not opt.stopped:
        for group in opt.param_groups:
            group["lr"] = peak * 0.5 * (1 + math.cos(math.pi * min(1.0, opt.progress / args.steps)))
        t0 = time.perf_counter()
        x, y = train_charlm.get_batch(corpus.train, 16, gen)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        before = opt.round
        opt.step()
        steps += 1
        if opt.round != before:  # this step mixed a round; the next was launched after it
            longest = max(longest, steps - launched_at)
            launched_at = steps
        time.sleep(max(0.0, delay - (time.perf_counter() - t0)))  # pad to the device time
    seconds = time.perf_counter() - start
    distance = opt.consensus_distance()
    with opt.averaged(model), torch.no_grad():
        x, y = corpus.val_batches[0]
        held_out = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    rows = [None] * n
    dist.all_gather_object(rows, (steps, longest, distance))
    if rank == 0:
        print(json.dumps({
            "gap": args.gap, "cap": cap, "steps": [r[0] for r in rows],
            "longest_period": [r[1] for r in rows], "distance": [round(r[2], 4) for r in rows],
            "held_out": round(held_out, 4), "seconds": round(seconds, 1),
            "rounds": opt.round, "progress": round(opt.progress, 1),
        }), flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
