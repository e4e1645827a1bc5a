"""Training iterations of a GPT under FSDP2 across emulated nodes: HSDP vs decentralized HSDP.

Each node's ranks shard one replica with FSDP2; the replicas, one per node, are kept together:

* ``hsdp``: FSDP2's own HSDP, ``fully_shard`` on the 2-D mesh ``("replicate", "shard")`` and
  ``torch.optim.AdamW``: gradients all-reduced across nodes every iteration;
* ``decent``: ``fully_shard`` on ``mesh["shard"]`` and ``DecentralizedAdamW`` gossiping over
  ``mesh["replicate"]`` (``--topology``, default one-peer-exp), exact;
* ``decent-int8``: the same with ``compression="int8"``;
* ``floor``: ``fully_shard`` on ``mesh["shard"]`` and ``torch.optim.AdamW``, nothing across
  nodes (the compute and in-node communication floor).

All four models live in every process and run in blocks of ``--block`` iterations, round-robin,
``--rounds`` times, so that machine load hits them alike; a block ends with every rank at a
barrier (and ``decent``'s round in flight waited for), and its time per iteration is taken on
the slowest rank. Reported: the median over blocks, and the ratio to ``floor``. Run on the
emulated cluster, one command per node (use flock so that one benchmark runs at a time)::

    flock /tmp/emulate.lock /work/shared/tools/emulate-cluster --nodes 4 --rate 1gbit -- \\
      bash -c 'torchrun --nnodes $NNODES --node_rank $NODE_RANK --nproc_per_node 2 \\
        --master_addr $MASTER_ADDR --master_port $MASTER_PORT benchmarks/fsdp_iteration.py --tag 1gbit'

Results (rank 0): ``benchmarks/results/fsdp_<tag>.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import decent_optim

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ["floor", "hsdp", "decent", "decent-int8"]


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 4, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def gpt(vocab: int, width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(vocab, width), *[Block(width) for _ in range(depth)], nn.Linear(width, vocab)
    )


def build(method: str, args, mesh):
    model = gpt(args.vocab, args.width, args.depth)
    shard_on = mesh if method == "hsdp" else mesh["shard"]
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=shard_on)
    fully_shard(model, mesh=shard_on)
    if method in ("floor", "hsdp"):
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    compression = "int8" if method == "decent-int8" else None
    opt = decent_optim.DecentralizedAdamW(
        model.parameters(),
        lr=1e-4,
        topology=args.topology,
        process_group=mesh["replicate"],
        compression=compression,
    )
    return model, opt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tag", default="local")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--topology", default="one-peer-exp")
    p.add_argument("--block", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, per_node = dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    mesh = init_device_mesh(
        "cpu", (world // per_node, per_node), mesh_dim_names=("replicate", "shard")
    )
    runs = {m: build(m, args, mesh) for m in args.methods}
    g = torch.Generator().manual_seed(mesh["replicate"].get_local_rank())
    x = torch.randint(args.vocab, (args.batch, args.context + 1), generator=g)
    times: dict[str, list[float]] = {m: [] for m in args.methods}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for method in args.methods:
            model, opt = runs[method]
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.block):
                logits = model(x[:, :-1])
                nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
                opt.step()
                opt.zero_grad()
            if hasattr(opt, "synchronize"):
                opt.synchronize()
            dist.barrier()
            took = torch.tensor([(time.perf_counter() - start) / args.block])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if round_:
                times[method].append(float(took) * 1e3)
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in gpt(args.vocab, args.width, args.depth).parameters())
        floor = statistics.median(times["floor"]) if "floor" in times else None
        lines = [
            f"{world // per_node} nodes x {per_node} ranks, link {args.tag}, GPT {params / 1e6:.2f}M "
            f"parameters, batch {args.batch} x {args.context} per rank, decent topology "
            f"{args.topology}; median of {args.rounds} blocks of {args.block} iterations "
            f"(load average {os.getloadavg()[0]:.2f} at the end)",
            "",
            "| method | ms / iteration | vs floor |",
            "|---|---:|---:|",
        ]
        for method in args.methods:
            ms = statistics.median(times[method])
            ratio = f"{ms / floor:.2f}x" if floor else "-"
            lines.append(f"| {method} | {ms:.0f} | {ratio} |")
        table = "\n".join(lines)
        print(table, flush=True)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"fsdp_{args.tag}.md").write_text(table + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
