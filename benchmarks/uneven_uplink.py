"""Bytes and seconds per round on a node's uplink with ``uneven=True`` (issue 39), emulated cluster.

Run as root under emulate-cluster, one torchrun per node::

    flock /tmp/emulate.lock ../shared/tools/emulate-cluster --nodes 2 --rate 20mbit -- bash -c \\
      'torchrun --nnodes $NNODES --node_rank $NODE_RANK --nproc_per_node 2 \\
         --master_addr $MASTER_ADDR --master_port $MASTER_PORT benchmarks/uneven_uplink.py'

Every rank trains one flat parameter of ``--params`` float32 with ``DecentralizedAdamW(
local_steps=H, uneven=True)`` on random gradients, each step padded to ``--step-ms``, until
``--rounds`` rounds are mixed; then it mixes the round it launched last (``synchronize``). The
first local rank of each node reads its uplink's counters (``eth0`` in ``/proc/net/dev``: wire
bytes, TCP/IP headers and acknowledgements included) before and after. Node 0 prints one line:
bytes per round out of and into each node, in copies of the parameters, and seconds per round.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import decent_optim as dopt


def uplink_bytes(interface: str = "eth0") -> tuple[int, int]:
    """(sent, received) bytes of this network namespace's ``interface``."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, data = line.partition(":")
            if name.strip() == interface:
                fields = data.split()
                return int(fields[8]), int(fields[0])
    raise RuntimeError(f"no interface {interface} in /proc/net/dev: run under emulate-cluster")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--local-steps", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=50.0)
    parser.add_argument("--topology", default="complete")
    parser.add_argument("--compression", default=None)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    param = torch.nn.Parameter(torch.zeros(args.params))
    opt = dopt.DecentralizedAdamW(
        [param],
        lr=1e-3,
        topology=args.topology,
        local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]),
        compression=args.compression,
        local_steps=args.local_steps,
        uneven=True,
    )
    opt.stop_at(10**9)  # the loop ends on rounds
    gen = torch.Generator().manual_seed(rank)
    dist.barrier()
    before = uplink_bytes() if local == 0 else (0, 0)
    start = time.perf_counter()
    steps = 0
    while opt.round < args.rounds:
        began = time.perf_counter()
        param.grad = torch.randn(args.params, generator=gen)
        opt.step()
        steps += 1
        time.sleep(max(0.0, args.step_ms / 1e3 - (time.perf_counter() - began)))
    opt.synchronize()  # the round launched at the last mix: every rank launched it
    rounds = opt.round
    seconds = time.perf_counter() - start
    dist.barrier()
    after = uplink_bytes() if local == 0 else (0, 0)
    row = torch.tensor(
        [after[0] - before[0], after[1] - before[1], seconds, steps, rounds], dtype=torch.float64
    )
    rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    if rank == 0:
        copy = 4 * args.params
        width = int(os.environ["LOCAL_WORLD_SIZE"])
        nodes = rows[::width]
        sent = " ".join(f"{n[0] / n[4] / copy:.2f}" for n in nodes)
        got = " ".join(f"{n[1] / n[4] / copy:.2f}" for n in nodes)
        slowest = max(r[2] / r[4] for r in rows)
        print(
            f"{args.tag} {args.topology} {args.compression} params={args.params} "
            f"rounds={int(rows[0][4])} copies/round out per node: {sent}; in: {got}; "
            f"bytes/round out per node: {' '.join(f'{n[0] / n[4]:.0f}' for n in nodes)}; "
            f"s/round: {slowest:.2f}; steps per rank: {[int(r[3]) for r in rows]}",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
