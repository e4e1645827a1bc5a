"""Does torch.compile speed up the optimizer step? Eager vs compiled ``opt.step``, one process.

    python benchmarks/compile_step.py [--params 2000000] [--tensors 200]

decent_optim's local update already runs torch's fused multi-tensor kernels, so compiling the
step can only remove Python overhead; this measures whether it does. Prints median ms per step
for DecentralizedAdamW and torch.optim.AdamW(fused=True), eager and compiled (inductor).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import decent_optim as dopt


def timed_steps(step, params, steps: int = 30, warmup: int = 5) -> float:
    samples = []
    for t in range(warmup + steps):
        for p in params:
            p.grad = torch.ones_like(p)  # grads do not matter for speed
        start = time.perf_counter()
        step()
        if t >= warmup:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=2_000_000)
    parser.add_argument("--tensors", type=int, default=200)
    args = parser.parse_args()
    torch.manual_seed(0)
    size = args.params // args.tensors
    rows = []
    for name, make in [
        ("DecentralizedAdamW", lambda ps: dopt.DecentralizedAdamW(ps, lr=1e-3)),
        ("torch AdamW fused", lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)),
    ]:
        for compiled in (False, True):
            params = [torch.nn.Parameter(torch.randn(size)) for _ in range(args.tensors)]
            opt = make(params)
            step = torch.compile(opt.step) if compiled else opt.step
            rows.append((name, "compiled" if compiled else "eager", timed_steps(step, params)))
    print(
        f"{args.tensors} tensors, {args.params:,} parameters, float32, CPU, {torch.get_num_threads()} threads"
    )
    print("| optimizer | step | ms per step |")
    print("|---|---|---:|")
    for name, mode, ms in rows:
        print(f"| {name} | {mode} | {ms:.2f} |")


if __name__ == "__main__":
    main()
