"""Training iterations of a small GPT: decent_optim (per topology) vs DDP + AdamW vs Decent-DP.

Methods: ``none`` (the same model and loop with no communication at all: the compute floor under
the same contention), ``ddp``, ``decent:<topology>`` and ``decent:<topology>+<compression>``
(``DecentralizedAdamW``, optionally with ``compression="bf16"``/``"int8"``; ``:H<h>`` adds
``local_steps=h``), ``decentdp:<topology>``. Emulated uneven devices (``_devices.py``):
``--device-ms``, ``--speeds``, ``--jitter-cv``, each step padded at its start.

One node, 4 ranks (benchmark b), optionally with stragglers (d)::

    python benchmarks/train_iteration.py --nproc 4
    python benchmarks/train_iteration.py --nproc 4 --straggle-mean-ms 20 --straggle-std-ms 10 --tag stragglers

Emulated 2-node cluster with a slow link (c), 2 ranks per node (see ``sweep_link.sh``)::

    ../shared/tools/emulate-cluster --rate 1gbit -- python benchmarks/train_iteration.py --nproc 2 --tag 1gbit

The script is a launcher: it starts one ``torchrun`` per method (so each method's peak memory is
its own), on this node, with ``--nnodes``/``--node_rank``/``--master_addr`` from the variables
emulate-cluster sets (``--standalone`` without them). Every method trains the same model from the
same seed on the same batches, with the same global batch. Per method it measures

* iteration time (wall time of the timed iterations / their number, slowest rank) and samples/s;
* compute time: forward + backward + the same sleep, plus a fused AdamW step, with no
  communication at all (all ranks computing side by side, as in training);
* communication time alone: one all-reduce of the model (DDP) or the mean gossip round of the
  topology (decent_optim; Decent-DP's rounds are taken to cost the same);
* overlap efficiency = max(compute, communication) / iteration time (1.0: perfectly hidden;
  the inverse of the issue's ratio, so that larger is better);
* peak RSS of the rank's process (max over ranks) and its growth after the imports;
* the :mod:`decent_optim.runtime` prediction from the measured compute and communication times.

Results: ``benchmarks/results/train_<tag>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _devices  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TOPOLOGIES = ["ring", "one-peer-exp", "alternating-exp-ring", "complete"]
COMPRESSIONS = ["int8", "bf16"]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# -- the model ----------------------------------------------------------------------------------
def build_model(args):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x, mask):
            h = self.ln1(x)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = args.d_model
            self.tok, self.pos = nn.Embedding(args.vocab, d), nn.Embedding(args.context, d)
            self.blocks = nn.ModuleList(Block(d, args.heads) for _ in range(args.layers))
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, args.vocab)
            self.register_buffer(
                "mask", torch.triu(torch.full((args.context, args.context), float("-inf")), 1)
            )

        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            for b in self.blocks:
                x = b(x, self.mask)
            return self.head(self.ln(x))

    torch.manual_seed(args.seed)
    return GPT()


# -- one method on this rank --------------------------------------------------------------------
def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from decent_optim import runtime, topologies
    from decent_optim.gossip import Gossiper

    torch.set_num_threads(args.threads)
    base_rss = _rss_mb()
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    local_batch = args.global_batch // n
    method = args.method
    kind, _, spec = method.partition(":")
    spec, _, period = spec.partition(":H")  # decent:<topology>[+<compression>][:H<h>]
    topo_name, _, compression = spec.partition("+")
    local_steps = int(period) if period else 1
    device = _devices.Device(args, rank, n)

    def batch(it: int):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + rank * 10_007 + it)
        x = torch.randint(0, args.vocab, (local_batch, args.context + 1), generator=g)
        return x[:, :-1], x[:, 1:]

    straggle = random.Random(args.seed * 7919 + rank)

    def sleep() -> float:
        if args.straggle_mean_ms <= 0:
            return 0.0
        s = max(0.0, straggle.gauss(args.straggle_mean_ms, args.straggle_std_ms)) / 1e3
        time.sleep(s)
        return s

    def slowest(v: float) -> float:
        t = torch.tensor([v], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    model = build_model(args)
    params = [p for p in model.parameters()]
    numel = sum(p.numel() for p in params)
    adamw = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)

    # 1. compute alone: forward + backward (+ the straggler sleep), then a fused AdamW step
    ref = torch.optim.AdamW(params, fused=True, **adamw)
    compute, update = [], []
    if device.on:
        x0, y0 = batch(0)

        def one_step() -> None:
            model.zero_grad()
            F.cross_entropy(model(x0).flatten(0, 1), y0.flatten()).backward()

        device.calibrate(one_step)
        model.zero_grad()
    for it in range(args.warmup + args.compute_iters):
        x, y = batch(it)
        t0 = time.perf_counter()
        device.pad(it)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        sleep()
        t1 = time.perf_counter()
        ref.step()
        ref.zero_grad()
        t2 = time.perf_counter()
        if it >= args.warmup:
            compute.append(t1 - t0)
            update.append(t2 - t1)
    del ref
    everyone = [torch.zeros(len(compute), dtype=torch.float64) for _ in range(n)]
    dist.all_gather(everyone, torch.tensor(compute, dtype=torch.float64))
    samples = [v for t in everyone for v in t.tolist()]
    compute_mean, compute_std = statistics.fmean(samples), statistics.pstdev(samples)
    update_s = slowest(statistics.median(update))

    # 2. communication alone, at the model's size
    flat = torch.zeros(numel)
    if kind == "none":
        comm_rounds, degrees = [0.0], None
    elif kind == "ddp":
        times = []
        for rep in range(args.comm_reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(flat)
            if rep:
                times.append(slowest(time.perf_counter() - t0))
        comm_rounds = [statistics.median(times)]
        degrees = None
    else:
        topo = topologies.get(topo_name, n, local)
        gossip = Gossiper(topo, compression=compression or None)
        comm_rounds = []
        for r in range(topo.period):
            times = []
            for rep in range(args.comm_reps + 1):
                dist.barrier()
                t0 = time.perf_counter()
                gossip.start([flat], r + rep * topo.period).wait_and_mix_()
                if rep:
                    times.append(slowest(time.perf_counter() - t0))
            comm_rounds.append(statistics.median(times))
        degrees = runtime.round_degrees(topo)
        del gossip
    del flat

    # 3. training
    model = build_model(args)  # fresh, identical start for every method
    if kind == "none":  # the compute floor: the same loop, nothing exchanged
        net = model
        opt = torch.optim.AdamW(net.parameters(), fused=True, **adamw)

        def train_step(x, y):
            opt.zero_grad()
            F.cross_entropy(net(x).flatten(0, 1), y.flatten()).backward()
            sleep()
            opt.step()

    elif kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model)
        opt = torch.optim.AdamW(net.parameters(), fused=True, **adamw)

        def train_step(x, y):
            opt.zero_grad()
            F.cross_entropy(net(x).flatten(0, 1), y.flatten()).backward()
            sleep()
            opt.step()

    elif kind == "decent":
        import decent_optim as dopt

        opt = dopt.DecentralizedAdamW(
            model.parameters(),
            topology=topo_name,
            compression=compression or None,
            local_steps=local_steps,
            **adamw,
        )
        net = model

        def train_step(x, y):
            opt.zero_grad()
            F.cross_entropy(net(x).flatten(0, 1), y.flatten()).backward()
            sleep()
            opt.step()

    elif kind == "decentdp":
        from functools import partial

        from decent_dp.ddp import DecentralizedDataParallel
        from decent_dp.optim import optim_fn_adamw

        fn = partial(optim_fn_adamw, lr=3e-4, beta1=0.9, beta2=0.95, weight_decay=0.1)
        net = DecentralizedDataParallel(model, optim_fn=fn, topology=topo_name)
        net.train()

        def train_step(x, y):
            # Decent-DP updates and launches its gossip in backward hooks; a straggler's delay
            # sits after backward, where the next iteration's waits would see it
            F.cross_entropy(net(x).flatten(0, 1), y.flatten()).backward()
            sleep()

    else:
        raise SystemExit(f"unknown method {method!r}")

    for it in range(args.warmup):
        device.pad(1000 + it)
        train_step(*batch(1000 + it))
    dist.barrier()
    t0 = time.perf_counter()
    for it in range(args.iters):
        device.pad(2000 + it)  # before the step's communication (DDP's is inside backward)
        train_step(*batch(2000 + it))
        if rank == 0 and args.progress and (it + 1) % max(1, args.iters // 4) == 0:
            print(f"    {method}: {it + 1}/{args.iters}", flush=True)
    iteration = slowest((time.perf_counter() - t0) / args.iters)
    if kind == "decent":
        opt.synchronize()
    peak = slowest(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    growth = slowest(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base_rss)

    # 4. the model's prediction from the measured parts
    workload = runtime.Workload(
        compute_mean=compute_mean, compute_std=compute_std, update_time=update_s
    )
    if kind == "none":
        pred = runtime.predict_allreduce(workload, 1, 0.0)
    elif kind == "ddp":
        pred = runtime.predict_allreduce(workload, n, comm_rounds[0], overlap=args.ddp_overlap)
    else:
        pred = runtime.predict_gossip(workload, comm_rounds, degrees, method)
    comm = statistics.fmean(comm_rounds)
    compute_total = compute_mean + update_s
    if rank == 0:
        row = {
            "method": method, "world_size": n, "local_world_size": local, "params": numel,
            "global_batch": args.global_batch, "iteration_ms": iteration * 1e3,
            "samples_per_s": args.global_batch / iteration, "compute_ms": compute_total * 1e3,
            "compute_std_ms": compute_std * 1e3, "update_ms": update_s * 1e3,
            "comm_ms": comm * 1e3, "comm_rounds_ms": [c * 1e3 for c in comm_rounds],
            "overlap_efficiency": max(compute_total, comm) / iteration,
            "predicted_ms": pred.iteration * 1e3,
            "prediction_error": pred.iteration / iteration - 1,
            "peak_rss_mb": peak, "rss_growth_mb": growth,
        }  # fmt: skip
        Path(args.part).write_text(json.dumps(row))
    dist.destroy_process_group()


# -- launcher -----------------------------------------------------------------------------------
def default_methods(nproc: int, nnodes: int) -> list[str]:
    n = nproc * nnodes
    fit = [t for t in TOPOLOGIES
           if not (t == "one-peer-exp" and n & (n - 1))
           and not (t == "alternating-exp-ring" and (nnodes < 2 or nnodes & (nnodes - 1)))]  # fmt: skip
    ours = [f"decent:{t}" for t in fit]
    if nnodes > 1:  # compression acts on what crosses between nodes
        ours += [f"decent:{t}+{c}" for c in COMPRESSIONS for t in fit]
    # Decent-DP's own topologies (it has no odd-size ring; its complete is the all-reduce)
    theirs = [t for t in fit if t != "complete" and not (t == "ring" and n % 2)]
    return ["none", "ddp"] + ours + [f"decentdp:{t}" for t in theirs]


def launch(args, rest: list[str]) -> None:
    nnodes = int(os.environ.get("NNODES", 1))
    node_rank = int(os.environ.get("NODE_RANK", 0))
    methods = args.methods or default_methods(args.nproc, nnodes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = out / f".parts_{args.tag}"
    parts.mkdir(exist_ok=True)
    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONWARNINGS": "ignore"}
    for i, m in enumerate(methods):
        part = parts / f"{i}.json"
        part.unlink(missing_ok=True)
        if nnodes > 1:
            where = ["--nnodes", str(nnodes), "--node_rank", str(node_rank),
                     "--master_addr", os.environ["MASTER_ADDR"],
                     "--master_port", str(int(os.environ["MASTER_PORT"]) + 1 + i)]  # fmt: skip
        else:
            where = ["--standalone"]
        cmd = [sys.executable, "-m", "torch.distributed.run", *where, "--nproc_per_node",
               str(args.nproc), __file__, "--worker", "--method", m, "--part", str(part), *rest]  # fmt: skip
        if node_rank == 0:
            print(f"[{i + 1}/{len(methods)}] {m} ...", flush=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"  {m} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
            continue
        if node_rank == 0:
            print(proc.stdout, end="", flush=True)
            rows.append(json.loads(part.read_text()))
    if node_rank != 0 or not rows:
        return
    shutil.rmtree(parts, ignore_errors=True)
    ddp = next((r for r in rows if r["method"] == "ddp"), None)
    floor = next((r for r in rows if r["method"] == "none"), None)
    for r in rows:
        r["speedup_vs_ddp"] = ddp["iteration_ms"] / r["iteration_ms"] if ddp else None
        r["vs_floor"] = r["iteration_ms"] / floor["iteration_ms"] if floor else None
    meta = {"tag": args.tag, "nnodes": nnodes, "nproc_per_node": args.nproc, "argv": sys.argv[1:],
            "straggle_ms": [args.straggle_mean_ms, args.straggle_std_ms], "rows": rows}  # fmt: skip
    (out / f"train_{args.tag}.json").write_text(json.dumps(meta, indent=2))
    r0 = rows[0]
    lines = [
        f"`{args.tag}`: {nnodes} node(s) x {args.nproc} ranks, gloo, GPT {r0['params'] / 1e6:.2f}M "
        f"params, global batch {args.global_batch}, {args.iters} timed iterations, straggler sleep "
        f"{args.straggle_mean_ms:g} +- {args.straggle_std_ms:g} ms",
        "",
        "| method | ms / iter | vs floor | samples/s | vs DDP | compute ms | comm ms | overlap eff. | predicted ms | pred. error | peak RSS MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        sp = f"{r['speedup_vs_ddp']:.2f}x" if r["speedup_vs_ddp"] else "-"
        fl = f"{r['vs_floor']:.2f}x" if r["vs_floor"] else "-"
        lines.append(
            f"| {r['method']} | {r['iteration_ms']:.1f} | {fl} | {r['samples_per_s']:.1f} | {sp} | "
            f"{r['compute_ms']:.1f} | {r['comm_ms']:.1f} | {r['overlap_efficiency']:.2f} | "
            f"{r['predicted_ms']:.1f} | {r['prediction_error'] * 100:+.0f}% | {r['peak_rss_mb']:.0f} |"
        )
    table = "\n".join(lines)
    (out / f"train_{args.tag}.md").write_text(table + "\n")
    print(table, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4, help="ranks per node")
    p.add_argument("--methods", nargs="+", default=None,
                   help="ddp, decent:<topology>, decentdp:<topology> (default: all that fit)")  # fmt: skip
    p.add_argument("--tag", default="local")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", default=None, help=argparse.SUPPRESS)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    worker_args = argparse.ArgumentParser(add_help=False)
    for q in (p, worker_args):
        q.add_argument("--iters", type=int, default=20)
        q.add_argument("--warmup", type=int, default=3)
        q.add_argument("--compute-iters", type=int, default=10)
        q.add_argument("--comm-reps", type=int, default=3)
        q.add_argument("--global-batch", type=int, default=32)
        q.add_argument("--context", type=int, default=64)
        q.add_argument("--d-model", type=int, default=192)
        q.add_argument("--layers", type=int, default=4)
        q.add_argument("--heads", type=int, default=4)
        q.add_argument("--vocab", type=int, default=256)
        q.add_argument("--seed", type=int, default=0)
        q.add_argument("--threads", type=int, default=1, help="torch threads per rank")
        q.add_argument("--straggle-mean-ms", type=float, default=0.0)
        q.add_argument("--straggle-std-ms", type=float, default=0.0)
        q.add_argument("--ddp-overlap", type=float, default=1.0)
        q.add_argument("--progress", type=int, default=1)
        _devices.add_arguments(q)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    # forward the worker options unchanged
    known = {a.dest for a in worker_args._actions}
    rest = []
    for a in worker_args._actions:
        rest += [a.option_strings[0], str(getattr(args, a.dest))]
    assert all(k in known for k in ("iters", "seed"))
    launch(args, rest)


if __name__ == "__main__":
    main()
