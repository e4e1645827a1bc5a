"""Sharded parameters: what the copy into FSDP2's storage costs (decent_optim.sharded).

    torchrun --standalone --nproc-per-node 2 benchmarks/sharded_storage.py

The buckets of a sharded optimizer hold the local shards in memory of their own and copy them
into FSDP2's sharded storage after every step (``Mirror.publish``). The alternative, aliasing
FSDP2's padded storage into the buckets, would save exactly that copy and that memory and
nothing else (the update, the gossip and FSDP2's all-gathers are the same), so this measures
the two differences directly, on one replica of 2 shards (gloo, CPU), DecentralizedAdamW:

* memory: the bytes of the buckets (the copy) against the optimizer's other state;
* time: the median of ``publish()`` against the median of a whole ``step()`` and of a whole
  iteration (forward and backward included), interleaved.

Results: ``benchmarks/results/sharded_storage.md``.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import decent_optim as dopt

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)])
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    for layer in model:
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    opt = dopt.DecentralizedAdamW(model.parameters(), lr=1e-4, process_group=mesh["replicate"])
    x = torch.randn(32, 1024)
    steps, copies, iterations = [], [], []
    for _ in range(30):
        begin = time.perf_counter()
        model(x).square().mean().backward()
        start = time.perf_counter()
        opt.step()
        steps.append(time.perf_counter() - start)
        start = time.perf_counter()
        opt._flat.publish()
        copies.append(time.perf_counter() - start)
        opt.zero_grad()
        iterations.append(time.perf_counter() - begin - copies[-1])
    bucket_bytes = sum(b.data.numel() * b.data.element_size() for b in opt._flat.buckets)
    state_bytes = sum(
        t.numel() * t.element_size() for b in opt._flat.buckets for t, _ in b._state.values()
    )
    step_ms, copy_ms = statistics.median(steps) * 1e3, statistics.median(copies) * 1e3
    iteration_ms = statistics.median(iterations) * 1e3
    if dist.get_rank() == 0:
        table = "\n".join(
            [
                f"DecentralizedAdamW, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
                f"parameters over {world} shards, per rank (torch {torch.__version__}, "
                f"{torch.get_num_threads()} threads)",
                "",
                "| | copy (chosen) | alias (rejected) |",
                "|---|---:|---:|",
                f"| bucket memory beyond FSDP2's shard | {bucket_bytes / 2**20:.1f} MiB | 0 |",
                f"| optimizer state (exp_avg, exp_avg_sq) | {state_bytes / 2**20:.1f} MiB "
                f"| {state_bytes / 2**20:.1f} MiB |",
                f"| step, median ms | {step_ms:.2f} | {step_ms - copy_ms:.2f} (less the copy) |",
                f"| the copy, median ms | {copy_ms:.2f} ({100 * copy_ms / step_ms:.0f}% of "
                "the step) | 0 |",
                f"| iteration (forward, backward, step; batch 32), median ms | "
                f"{iteration_ms:.1f} (copy: {100 * copy_ms / iteration_ms:.0f}%) | "
                f"{iteration_ms - copy_ms:.1f} |",
            ]
        )
        print(table)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "sharded_storage.md").write_text(table + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
