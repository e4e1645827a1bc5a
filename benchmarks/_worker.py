"""The time-to-quality harness's worker loop: one method on this rank (``time_to_quality.py``).

Every rank builds the workload's model from the same seed, wraps it with its method (the
registry, ``methods.py``) and trains on batches drawn from a generator seeded by (seed, rank,
step), under the schedule (warm-up then cosine to 10% of the peak), gradient clipping at 1.0 and
the emulated device time (``_devices.py``). Every ``--eval-every`` steps the clock stops, the
consensus model is evaluated on the held-out batches, and a barrier restarts the clock; training
time counts to the last rank's arrival. With emulated devices each step is padded to its device
time after forward and backward, before any communication, so DDP all-reduces its gradients
after the pad (one flat buffer) instead of inside backward; Decent-DP, which communicates inside
backward, is padded at the start of the step. ``uneven`` methods keep snapshots at their rounds
(every ``--snapshot-rounds``-th, and the last) instead and evaluate them afterwards
(``_replay``). ``hetero`` methods (each rank its own H, ``methods.local_steps``) count
schedule, budget and evaluations in DDP-equivalent steps (the ranks' steps summed / n), stop at
the first sync at or past the budget and evaluate only right after a sync, where every rank is.
Rank 0 writes the method's row (``--part``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from types import SimpleNamespace

import _devices
import _text
import methods


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    m = methods.parse(args.method)
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

    def groups_of(params: list) -> list[dict]:  # weight decay on matrices only
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip

    hs = methods.local_steps(m, args.speeds, n)  # each rank's H (:hetero: from its speed)
    ctx = SimpleNamespace(args=args, model=model, params=params, groups=groups_of(params),
                          groups_of=groups_of,
                          betas=(0.9, 0.95), decent_lr=args.lr * args.decent_lr_factor,
                          lr_factor=lr_factor, H=hs[rank])  # fmt: skip
    built = methods.REGISTRY[m["kind"]].build(m, ctx)
    net, opt, peak = built.net, built.opt, built.peak
    params = list(model.parameters())  # sharded by decent's :node

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        total = sum(float(F.cross_entropy(model(x).flatten(0, 1), y.flatten())) for x, y in val)
        model.train()
        return total / len(val)

    @torch.no_grad()
    def consensus_loss(plain: bool = False) -> float:
        if plain:  # the parameters already are the consensus
            return evaluate()
        with built.averaged():  # DiLoCo mid-period, gossip: the workers' mean
            return evaluate()

    target = None
    if args.target_from:
        target = json.loads(Path(args.target_from).read_text())["final_loss"]
    max_steps = args.steps if m["kind"] == "ddp" else int(args.steps * args.max_steps_factor)
    if m["uneven"] and args.uneven_budget_factor:  # it trains to its budget (see _replay)
        max_steps = int(args.steps * args.uneven_budget_factor)
    time_limit = None
    if args.target_from and args.time_limit_factor:
        time_limit = args.time_limit_factor * json.loads(Path(args.target_from).read_text())["train_s"]  # fmt: skip
    timing = args.timing_steps  # a timing run: no target, no evaluation, the clock at 2 points
    if timing:
        max_steps, target, time_limit, marks = timing, None, None, (methods.period(args.method),)
    # :hetero: this rank syncs every `own` of its steps; schedule, budget and evaluations count
    # DDP-equivalent steps (the ranks' steps summed / n), `per_sync` of them a sync, so every
    # rank stops at the first sync at or past the budget, and evaluates only at syncs
    hetero, own, per_sync = m["hetero"], hs[rank] // m["F"], sum(hs) / m["F"] / n
    if hetero:
        max_steps = -(-max_steps * m["F"] * n // sum(hs)) * own
    device = _devices.Device(args, rank, n)
    if device.on and built.steps_in_backward:  # Decent-DP: one step's real compute, on a copy
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
        factor = lr_factor(int(opt.progress) if uneven else step * per_sync / own if hetero else step)  # fmt: skip
        x, y = batch(step)
        if built.steps_in_backward:  # Decent-DP communicates inside backward: pad before it
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
        if uneven:  # snapshots at rounds, evaluated after training (see _replay)
            if opt.round != evaluated and (opt.round % args.snapshot_rounds == 0 or opt.stopped):
                evaluated = opt.round
                elapsed_s = time.perf_counter() - resumed
                snapshots.append((elapsed_s, opt.progress, [p.detach().clone() for p in params]))
            continue
        done: float = step
        if hetero:  # evaluate at the first sync past each --eval-every, never between syncs
            done = step // own * per_sync
            skip = step % own or done // args.eval_every == (done - per_sync) // args.eval_every
        else:
            skip = done not in marks if timing else done % args.eval_every
        if skip and step != max_steps:
            continue
        # the wall-clock when the last rank got here; evaluation is not counted
        elapsed = torch.tensor([time.perf_counter() - resumed], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        train_s += float(elapsed.item())
        loss = None if timing else consensus_loss()
        rows.append({"step": done, "train_s": train_s, "val_loss": loss})
        if isinstance(getattr(opt, "bytes_sent", None), int):
            rows[-1]["bytes_sent"] = opt.bytes_sent
        if rank == 0:
            said = "" if loss is None else f" loss {loss:.4f}"  # a timing run: no loss
            print(f"    {args.method}: step {done} {train_s:.1f}s{said}", flush=True)
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
    steps = rows[-1]["step"]
    if rank == 0:
        out = {
            "method": args.method,
            "world_size": n,
            "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
            "steps": steps,
            "train_s": rows[-1]["train_s"],
            "final_loss": rows[-1]["val_loss"],
            "ms_per_step": rows[-1]["train_s"] / rows[-1]["step"] * 1e3,
            "target": target,
            "time_to_target_s": reached,
            "peak_lr": peak,
            "compute_ms": device.compute_s * 1e3,
            "bytes_per_step": methods.REGISTRY[m["kind"]].wire(opt, args.method, n, params, steps),
            "bytes_per_step_after_first_eval": _bytes_after_first(rows),
            "curve": rows,
        }
        if timing:  # its seconds per step: _record.write_run, from the two clock readings
            out["kind"] = "timing"
        Path(args.part).write_text(json.dumps(out))
    dist.barrier()  # the part is written (a next method in the same launch reads the target)


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
