"""What the start-up agreement check costs, side by side with a construction that skips it.

Run under torchrun, e.g.
``quiet torchrun --standalone --nproc-per-node 2 benchmarks/startup_check.py`` (writes
``benchmarks/results/startup_check.md``).
For a model of ``--params`` float32 parameters split into ``--tensors`` equal tensors, it builds a
``DecentralizedAdamW`` ``--reps`` times with the check and ``--reps`` times without it
(alternating, each first in every other pair, so both see the same machine), and prints per construction (median over the
repetitions of the slowest rank): the check alone (describing the parameters, the shared-memory
check and the all-gather: :func:`decent_optim.optim.startup.describe`,
:func:`decent_optim.optim.membership.check_untied`, :func:`decent_optim.optim.agreement.agree`),
the whole construction with the check, the whole construction without it, and their ratio. The
check hashes descriptions, never values, so its cost follows the number of tensors, not their
size; the rest of the construction (flat buckets, the broadcast of rank 0's values) follows the
size.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import decent_optim as dopt
from decent_optim.optim import startup
from decent_optim.optim.agreement import DIGEST_SIZE, Account

_spent: dict[str, float] = {}
_REAL = {name: getattr(startup, name) for name in ("describe", "check_untied", "agree")}


def _timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _spent["check"] = _spent.get("check", 0.0) + time.perf_counter() - start

    return wrapper


def _skipped_agree(*args: Any, extra: Any = (), **kwargs: Any) -> list[list[int]]:
    return [[0] * DIGEST_SIZE + list(extra)]  # what agree() returns when every rank agrees


_WITH = {name: _timed(fn) for name, fn in _REAL.items()}
_WITHOUT = {
    "describe": lambda *args, **kwargs: Account(),
    "check_untied": lambda *args, **kwargs: None,
    "agree": _skipped_agree,
}


def _build(params: list[torch.nn.Parameter], check: bool) -> tuple[float, float]:
    """Seconds (slowest rank) of one construction, and of its check."""
    for name, fn in (_WITH if check else _WITHOUT).items():
        setattr(startup, name, fn)
    _spent.clear()
    dist.barrier()
    start = time.perf_counter()
    opt = dopt.DecentralizedAdamW(params, lr=1e-3, topology="ring")
    seconds = torch.tensor([time.perf_counter() - start, _spent.get("check", 0.0)])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    del opt
    gc.collect()  # so that the next optimizer gets slot 0 on every rank (the skipped check
    # would not agree on the slots)
    return float(seconds[0]), float(seconds[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--tensors", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/startup_check.md", help="'' for none")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    _build([torch.nn.Parameter(torch.zeros(8))], check=True)  # first-optimizer imports
    rows = []
    for count in args.tensors:
        size = int(args.params) // count
        params = [torch.nn.Parameter(torch.zeros(size)) for _ in range(count)]
        checks, with_check, without = [], [], []
        for rep in range(args.reps):
            for check in (True, False) if rep % 2 == 0 else (False, True):  # neither always first
                total, spent = _build(params, check)
                if check:
                    with_check.append(total)
                    checks.append(spent)
                else:
                    without.append(total)
        med = statistics.median
        rows.append((count, size, med(checks), med(with_check), med(without)))
    if dist.get_rank() == 0:
        world, millions = dist.get_world_size(), args.params / 1e6
        lines = [
            f"start-up agreement check, {world} gloo ranks, {millions:g}M float32 parameters, "
            f"DecentralizedAdamW, median of {args.reps} (slowest rank)",
            "",
            "| tensors | elements each | check ms | construction ms | without check ms "
            "| with / without |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {count} | {size} | {check * 1e3:.1f} | {total * 1e3:.0f} | {bare * 1e3:.0f} "
            f"| {total / bare:.3f} |"
            for count, size, check, total, bare in rows
        ]
        print("\n".join(lines))
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
