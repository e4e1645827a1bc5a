"""How much overlap can this machine give at all? A gossip round against a synthetic compute.

    torchrun --standalone --nproc-per-node 4 benchmarks/overlap_floor.py [--params 1.89e6]

Every rank runs a chain of matrix products (one thread, no memory traffic to speak of) as its
"forward and backward", and the gossip round of a ``--params`` model, first each alone, then the
round launched before the compute and waited on after it -- the optimizer's timeline without an
optimizer or a model. Overlap efficiency is ``max(compute, comm) / overlapped`` (1.0: the round
is hidden completely). On CPUs with gloo the round is itself CPU work (the kernel copies every
byte through the sockets, even on loopback), so where the ranks already fill the cores the
efficiency stays below 1.0 however the optimizer schedules its communication; that is the
ceiling for the overlap efficiency of ``train_iteration.py`` on the same machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from decent_optim.gossip import Gossiper
from decent_optim.topologies import get


def slowest_median(fn: Callable[[int], object], reps: int, warmup: int = 2) -> float:
    """Median over ``reps`` repetitions of the slowest rank's time for ``fn(rep)``."""
    samples = []
    for rep in range(warmup + reps):
        dist.barrier()
        start = time.perf_counter()
        fn(rep)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if rep >= warmup:
            samples.append(elapsed.item())
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=1.89e6, help="model size (elements)")
    parser.add_argument("--topology", default="ring")
    parser.add_argument("--matmuls", type=int, default=60, help="products per 'iteration'")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gossip = Gossiper(get(args.topology, n, local))
    buffer = torch.randn(int(args.params))
    a = torch.randn(384, 384) / 384**0.5

    def compute(rep: int) -> None:
        x = a
        for _ in range(args.matmuls):
            x = torch.tanh(x @ a)

    def comm(rep: int) -> None:
        gossip.start([buffer], rep).wait_and_mix_()

    def overlapped(rep: int) -> None:
        handle = gossip.start([buffer], rep)
        compute(rep)
        handle.wait_and_mix_()

    c = slowest_median(compute, args.reps)
    m = slowest_median(comm, args.reps)
    o = slowest_median(overlapped, args.reps)
    if rank == 0:
        print(
            f"gloo, {n} ranks ({local} per node), {args.topology}, {args.params / 1e6:.2f}M "
            f"params, {os.cpu_count()} cores; median ms over {args.reps} repetitions"
        )
        print("| compute | comm | overlapped | overlap eff. | not hidden |")
        print("|---:|---:|---:|---:|---:|")
        print(
            f"| {c * 1e3:.1f} | {m * 1e3:.1f} | {o * 1e3:.1f} | {max(c, m) / o:.2f} | "
            f"{(o - max(c, m)) * 1e3:.1f} |"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
