"""Measure this cluster and predict which method trains fastest: ``python -m decent_optim.plan``.

Run it with the launcher and node layout of the real job, for example::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:PORT -m decent_optim.plan --params 65e6

In well under a minute it measures, at the given model size:

* the compute time of one forward + backward of a synthetic workload (a stack of square matrix
  multiplications holding ``--params`` parameters) on every rank, its mean and spread, and the
  forward's share of it;
* the local optimizer step (torch's fused AdamW on that many parameters);
* one all-reduce of the whole model (what DDP moves per iteration, without its overlap);
* one gossip round of each topology that fits the world size, round by round (a topology that
  does not fit -- ``one-peer-exp`` needs a power-of-two number of workers -- is listed under the
  table with the reason); with ``--compression bf16 int8 top1%+int2`` also the compressed rounds
  (``<topology>+<compression>``; only on more than one node, where they apply).

With ``--r R`` (seconds of one float32 copy over a node's uplink / seconds per step), or R from
its parts, ``--params N --link 10gbit --step-ms 55``, it also names the compression that keeps a
round hidden for each H (:func:`decent_optim.runtime.wire.hidden`,
:func:`decent_optim.runtime.regimes.recommend`). Last it prints the line to write,
:func:`decent_optim.recommend`'s for the job's layout (or ``--nodes`` / ``--workers-per-node``),
R, ``--speeds``, ``--failures`` and ``--steps``; without torchrun it prints only the regime and
that line (``--nodes 1 --workers-per-node 8`` needs no R).

With ``--local-steps 4 16`` it also predicts every topology gossiping every H steps
(``local_steps=H``: the round travels during H iterations) and DiLoCo's blocking all-reduce of
the pseudo-gradients every H steps (:mod:`decent_optim.runtime.local_steps`), for each H. These
predict time per iteration only: fewer rounds cost quality, which only training measures.
With ``--speeds 1 1 1 0.5`` (a factor per worker) every method runs on workers of those speeds
(:mod:`decent_optim.runtime.uneven`): the step-locked ones at the slowest's pace, and
``uneven=True`` (rows ``... uneven``, with ``--local-steps``) at the mean speed.

Rank 0 then prints the :mod:`decent_optim.runtime` predictions: time per iteration for
All-Reduce and each topology and the speedup over All-Reduce. Your model's compute time can be
given with ``--compute-ms`` (and ``--compute-std-ms``) instead of the synthetic workload.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

from decent_optim import runtime, topologies
from decent_optim._plan_args import LAUNCH, advice_text, parse, wants_advice
from decent_optim._plan_args import parser as _parser  # noqa: F401  (tests read its options)
from decent_optim._plan_report import as_json, format_table, predict
from decent_optim.gossip import Gossiper
from decent_optim.gossip.collectives import (
    all_reduce_,
    barrier,
    gather_floats,
    group_info,
    init_from_environment,
    shutdown,
    slowest,
)
from decent_optim.runtime import regimes

__all__ = ["format_table", "main", "measure", "predict"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _synthetic_model(
    params: int, layers: int, device: torch.device, dtype: torch.dtype
) -> tuple[list[torch.Tensor], int]:
    width = max(1, int(math.sqrt(params / layers)))
    gen = torch.Generator(device="cpu").manual_seed(0)
    weights = [
        (torch.randn(width, width, generator=gen, dtype=dtype) / math.sqrt(width))
        .to(device)
        .requires_grad_()
        for _ in range(layers)
    ]
    return weights, width


def _compute_times(
    weights: list[torch.Tensor], batch: int, iters: int, device: torch.device
) -> tuple[list, list]:
    """Seconds of forward+backward and of the forward alone, per iteration, on this rank."""
    x = torch.randn(batch, weights[0].shape[0], device=device, dtype=weights[0].dtype)
    total, forward = [], []
    for it in range(iters + 2):  # two warm-up iterations
        _sync(device)
        t0 = time.perf_counter()
        h = x
        for w in weights:
            h = torch.relu(h @ w)
        loss = h.square().mean()
        _sync(device)
        t1 = time.perf_counter()
        loss.backward()
        _sync(device)
        t2 = time.perf_counter()
        for w in weights:
            w.grad = None
        if it >= 2:
            total.append(t2 - t0)
            forward.append(t1 - t0)
    return total, forward


def _update_time(weights: list[torch.Tensor], reps: int, device: torch.device) -> float:
    for w in weights:
        w.grad = torch.zeros_like(w)
    fused = device.type in ("cuda", "cpu")
    opt = torch.optim.AdamW(weights, lr=1e-9, fused=fused)
    samples = []
    for it in range(reps + 1):
        _sync(device)
        t0 = time.perf_counter()
        opt.step()
        _sync(device)
        if it:
            samples.append(time.perf_counter() - t0)
    for w in weights:
        w.grad = None
    return statistics.median(samples)


def _allreduce_time(numel: int, reps: int, device: torch.device, dtype: torch.dtype) -> float:
    buf = torch.zeros(numel, device=device, dtype=dtype)
    samples = []
    for it in range(reps + 1):
        barrier()
        _sync(device)
        t0 = time.perf_counter()
        all_reduce_(buf)
        _sync(device)
        if it:
            samples.append(slowest(time.perf_counter() - t0, device))
    return statistics.median(samples)


def _gossip_round_times(
    topo: topologies.Topology,
    numel: int,
    reps: int,
    device: torch.device,
    dtype: torch.dtype,
    compression: str | None = None,
) -> list[float]:
    # the first repetition of every round is not timed: it also primes compressed groups
    gossip = Gossiper(topo, compression=compression)
    buffers = [torch.zeros(numel, device=device, dtype=dtype)]
    times = []
    for r in range(topo.period):
        samples = []
        for rep in range(reps + 1):
            barrier()
            _sync(device)
            t0 = time.perf_counter()
            gossip.start(buffers, r + rep * topo.period).wait_and_mix_()
            _sync(device)
            if rep:
                samples.append(slowest(time.perf_counter() - t0, device))
        times.append(statistics.median(samples))
    return times


def measure(args: argparse.Namespace, device: torch.device) -> dict:
    """Everything the runtime model needs, measured on this world; the same dict on every rank."""
    dtype = getattr(torch, args.dtype)
    _, n, backend = group_info()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    weights, width = _synthetic_model(int(args.params), args.layers, device, dtype)
    numel = sum(w.numel() for w in weights)
    if args.compute_ms is not None:
        compute_mean, compute_std = args.compute_ms / 1e3, args.compute_std_ms / 1e3
        fwd_share = 1 / 3
    else:
        total, forward = _compute_times(weights, args.batch, args.iters, device)
        everyone, everyone_fwd = gather_floats(total, device), gather_floats(forward, device)
        compute_mean = statistics.fmean(everyone)
        compute_std = statistics.pstdev(everyone)
        fwd_share = statistics.fmean(everyone_fwd) / compute_mean
    update = slowest(_update_time(weights, args.reps, device), device)
    result = {
        "world_size": n,
        "local_world_size": local,
        "backend": backend,
        "params": numel,
        "bytes": numel * weights[0].element_size(),
        "compute_mean_s": compute_mean,
        "compute_std_s": compute_std,
        "backward_fraction": 1 - fwd_share,
        "update_s": update,
        "allreduce_s": _allreduce_time(numel, args.reps, device, dtype),
        "gossip": {},
        "skipped": {},
    }
    for name in args.topologies:
        try:
            topo = topologies.get(name, n, local)
        except ValueError as err:  # this world size or node layout does not fit the topology
            result["skipped"][name] = str(err)  # printed under the table: why it is missing
            continue
        for c in [None, *(args.compression if n > local else [])]:
            if c is not None and topo.groups(0) is None:
                continue  # compression needs rounds of group averages
            result["gossip"][name if c is None else f"{name}+{c}"] = {
                "round_s": _gossip_round_times(topo, numel, args.reps, device, dtype, c),
                "degrees": runtime.round_degrees(topo),
            }
    result["wire_bytes"] = {
        c or "none": runtime.wire_bytes(result["bytes"], c, weights[0].element_size())
        for c in [None, *args.compression]
    }
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    regime = ""
    if args.r is not None:
        regime = regimes.report(args.r, args.local_steps, args.compression)
        regime = "\n".join(filter(None, [args.ratio_text, regime]))
    if wants_advice(args) and "RANK" not in os.environ:  # no measurement: the advice alone
        print("\n\n".join(filter(None, [regime, advice_text(args, strict=True)])))
        return 0
    if "RANK" not in os.environ:
        raise SystemExit(
            "decent_optim.plan measures the job's communication, so it must run in every "
            "process of the job. " + LAUNCH
        )
    device = init_from_environment()
    try:
        measured = measure(args, device)
        speeds = runtime.check_speeds(args.speeds, measured["world_size"]) if args.speeds else None
        rows = predict(measured, args.overlap, args.local_steps, speeds)
        if group_info()[0] == 0:
            print(format_table(measured, rows), flush=True)
            if regime:
                print("\n" + regime)
            per_node = measured["local_world_size"]
            nodes = max(1, measured["world_size"] // per_node)
            print("\n" + advice_text(args, nodes, per_node), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(as_json(measured, rows), f, indent=2)
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
