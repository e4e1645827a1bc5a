"""Point-to-point vs sub-group all-reduce for one gossip round, on the ranks torchrun starts.

    torchrun --standalone --nproc-per-node 4 benchmarks/gossip_transport.py

For each topology and buffer size, every transport that can carry it runs ``--rounds`` rounds
(``start`` then ``wait_and_mix_``, back to back, no compute to hide behind) after a warm-up;
rank 0 prints, per transport, the median time of each round of the topology's period (slowest
rank), averaged over the period. ``auto`` is what the optimizers use.

Every round starts from a barrier, so by default the ranks arrive together. In training they do
not: ``--skew-ms S`` makes the upper half of the ranks (under ``emulate-cluster`` with 2 nodes:
the second node) start each round S ms after the barrier; the time printed is then from the
barrier to the end of the round, less S. This is how a transport that serialises the two
directions of a pair when one side is late shows up (see "The slow link" in
``benchmarks/README.md``); it needs a link that is slow in each direction separately, i.e.
``emulate-cluster``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from decent_optim.gossip import Gossiper
from decent_optim.topologies import get


def time_rounds(
    gossip: Gossiper, buffers: list[torch.Tensor], rounds: int, warmup: int = 3, skew: float = 0.0
) -> float:
    """Mean over the topology's rounds of the median time of each (slowest rank), in seconds."""
    period = gossip.topology.period
    samples: dict[int, list[float]] = {r: [] for r in range(period)}
    late = 2 * gossip.rank >= gossip.world_size  # the upper half, e.g. the second node
    for t in range(warmup * period + rounds):
        dist.barrier()
        start = time.perf_counter()
        if late and skew:
            time.sleep(skew)
        gossip.start(buffers, t).wait_and_mix_()
        elapsed = torch.tensor([time.perf_counter() - start - skew], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a round ends when its slowest rank does
        if t >= warmup * period:
            samples[t % period].append(elapsed.item())
    return statistics.fmean(statistics.median(v) for v in samples.values() if v)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1.0, 16.0, 64.0])
    parser.add_argument("--topologies", nargs="+", default=["ring", "one-peer-exp", "complete"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--skew-ms", type=float, default=0.0, help="the upper half of the ranks start this late"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    rows = []
    for name in args.topologies:
        topo = get(name, n, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        gossipers = {tr: Gossiper(topo, transport=tr) for tr in ("p2p", "allreduce", "auto")}
        for mb in args.sizes_mb:
            buffers = [torch.randn(int(mb * 2**20 / 4))]
            times = {
                tr: time_rounds(g, buffers, args.rounds, skew=args.skew_ms / 1e3)
                for tr, g in gossipers.items()
            }
            rows.append((name, mb, times))
    if rank == 0:
        print(
            f"gloo, {n} ranks, {args.rounds} rounds, upper half {args.skew_ms:g} ms late; "
            "time per round (slowest rank; median per round of the period, then the mean)"
        )
        print("| topology | MB | p2p | allreduce | auto | p2p / allreduce |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, mb, t in rows:
            print(
                f"| {name} | {mb:g} | {t['p2p'] * 1e3:.1f} ms | {t['allreduce'] * 1e3:.1f} ms | "
                f"{t['auto'] * 1e3:.1f} ms | {t['p2p'] / t['allreduce']:.2f} |"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
