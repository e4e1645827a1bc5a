"""One worker of the convergence study; ``run.py`` starts it under torchrun (see README.md).

For every task, seed and method it trains the task's model from the same initial weights on the
same per-rank batches, at a fixed global batch and step budget, and appends the measurements of
that run to ``--csv`` (rank 0 writes; one row per evaluation):

* ``allreduce``: DistributedDataParallel + torch.optim.AdamW, the reference;
* ``adamw:<topology>``: decent_optim.DecentralizedAdamW;
* ``accumadamw:<topology>``: decent_optim.AccumAdamW;
* ``accumadamw^s:<topology>``: AccumAdamW with betas (b1**s, b2**s), s = ``--accum-iter``: moment
  bases that forget per refresh what Adam's moments forget in s steps (an investigation).

Every optimizer gets the same hyper-parameters and the same warmup + cosine learning-rate
schedule. Evaluation uses the consensus model (``opt.averaged(model)``: the mean of the workers'
parameters and BatchNorm buffers); DDP's workers hold one model, so it is evaluated as it is.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import decent_optim as dopt

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import digits_cnn  # noqa: E402  (the examples are scripts, not a package)
import train_charlm  # noqa: E402

FIELDS = [
    "task", "workers", "global_batch", "local_batch", "method", "optimizer", "topology",
    "accum_iter", "lr_scale", "seed", "step", "lr", "train_loss", "val_loss", "val_acc",
    "consensus_distance", "elapsed_s",
]  # fmt: skip


@dataclass
class Task:
    """What the training loop needs to know about a task."""

    name: str
    make_model: Callable[[], nn.Module]
    sample: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    val: list[tuple[torch.Tensor, torch.Tensor]]  # fixed held-out batches, the same on every rank
    lr: float
    betas: tuple[float, float]
    weight_decay: float

    @staticmethod
    def loss(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction=reduction)


def charlm_task() -> Task:
    """The character GPT of examples/train_charlm.py on its built-in grammar text."""
    text = train_charlm.make_corpus()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    train, held_out = data[:split], data[split:]
    val_gen = torch.Generator().manual_seed(12345)
    val = [train_charlm.get_batch(held_out, 32, val_gen) for _ in range(16)]
    return Task(
        "charlm",
        lambda: train_charlm.CharGPT(len(chars)),
        lambda batch, gen: train_charlm.get_batch(train, batch, gen),
        val,
        lr=1.2e-2,  # All-Reduce's best of 1.5e-3 ... 2.4e-2 at 300 steps (README.md)
        betas=(0.9, 0.95),
        weight_decay=0.1,
    )


def digits_task() -> Task:
    """The BatchNorm CNN of examples/digits_cnn.py on scikit-learn's 8x8 digits."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]

    def sample(batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx = train[torch.randint(len(train), (batch,), generator=gen)]
        return images[idx], labels[idx]

    val = [(images[chunk], labels[chunk]) for chunk in test.split(40)]
    return Task(
        "digits",
        digits_cnn.make_model,
        sample,
        val,
        lr=1.2e-2,  # All-Reduce's best of 7.5e-4 ... 2.4e-2 at 300 steps (README.md)
        betas=(0.9, 0.999),
        weight_decay=0.01,
    )


TASKS = {"charlm": charlm_task, "digits": digits_task}


def sum_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def evaluate(model: nn.Module, task: Task) -> tuple[float, float]:
    """Held-out loss and accuracy of ``model``; each rank evaluates its share of the batches."""
    was_training = model.training
    model.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    loss, correct, count = 0.0, 0.0, 0.0
    for x, y in task.val[rank::world]:
        logits = model(x)
        loss += float(task.loss(logits, y, reduction="sum"))
        correct += float((logits.argmax(-1) == y).sum())
        count += y.numel()
    model.train(was_training)
    loss, correct, count = sum_over_ranks([loss, correct, count])
    return loss / count, correct / count


def rms_consensus_distance(opt: torch.optim.Optimizer) -> float:
    """sqrt(mean over ranks of ||x_i - mean x||^2); 0 for DDP, whose workers share one model."""
    if not isinstance(opt, dopt.DecentralizedOptimizer):
        return 0.0
    (total,) = sum_over_ranks([opt.consensus_distance() ** 2])
    return math.sqrt(total / dist.get_world_size())


def warmup_cosine(steps: int, warmup: int) -> Callable[[int], float]:
    """Linear warmup to the base lr, then cosine decay to 10% of it at ``steps``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(steps - warmup, 1), 1.0)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    return factor


def build(
    task: Task, method: str, lr_scale: float, args: argparse.Namespace
) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    """(model to train, module to call forward on, optimizer) for ``method``."""
    model = task.make_model()
    kw = dict(lr=task.lr * lr_scale, betas=task.betas, weight_decay=task.weight_decay)
    if method == "allreduce":
        return model, DistributedDataParallel(model), torch.optim.AdamW(model.parameters(), **kw)
    name, _, topology = method.partition(":")
    if name == "adamw":
        opt = dopt.DecentralizedAdamW(model.parameters(), topology=topology, **kw)
    elif name in ("accumadamw", "accumadamw^s"):
        s = args.accum_iter
        if name == "accumadamw^s":
            kw["betas"] = (task.betas[0] ** s, task.betas[1] ** s)
        opt = dopt.AccumAdamW(model.parameters(), topology=topology, accum_iter=s, **kw)
    else:
        raise SystemExit(
            f"unknown method {method!r}: use allreduce, adamw:<topology> or accumadamw:<topology>"
        )
    return model, model, opt


def run(
    task: Task, method: str, seed: int, lr_scale: float, args: argparse.Namespace
) -> list[dict]:
    """One training run; returns its rows (on every rank; rank 0 writes them)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local_batch = args.global_batch // world
    torch.manual_seed(seed)  # the same initial model for every method (and every rank)
    model, forward, opt = build(task, method, lr_scale, args)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, warmup_cosine(args.steps, max(1, args.steps // 20))
    )
    gen = torch.Generator().manual_seed(1000 * seed + rank)  # this rank's own batch stream
    name, _, topology = method.partition(":")
    base = dict(
        task=task.name, workers=world, global_batch=args.global_batch, local_batch=local_batch,
        method=method, accum_iter=args.accum_iter if name.startswith("accum") else "",
        lr_scale=lr_scale,
        optimizer={"allreduce": "AdamW (DDP)", "adamw": "DecentralizedAdamW",
                   "accumadamw": "AccumAdamW", "accumadamw^s": "AccumAdamW, betas^s"}[name],
        topology=topology or "all-reduce", seed=seed,
    )  # fmt: skip
    rows, window = [], []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = task.sample(local_batch, gen)
        loss = task.loss(forward(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        window.append(loss.item())
        if step % args.eval_every == 0 or step == args.steps:
            (train_loss,) = sum_over_ranks([sum(window) / len(window)])
            window = []
            distance = rms_consensus_distance(opt)
            if isinstance(opt, dopt.DecentralizedOptimizer):
                with opt.averaged(model):  # parameters and BatchNorm buffers, restored after
                    val_loss, val_acc = evaluate(model, task)
            else:
                val_loss, val_acc = evaluate(model, task)
            rows.append(
                dict(
                    base,
                    step=step,
                    lr=opt.param_groups[0]["lr"],
                    train_loss=train_loss / world,
                    val_loss=val_loss,
                    val_acc=val_acc,
                    consensus_distance=distance,
                    elapsed_s=time.perf_counter() - start,
                )  # fmt: skip
            )
    if isinstance(opt, dopt.DecentralizedOptimizer):
        opt.synchronize()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--methods", nargs="+", required=True)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--accum-iter", type=int, default=4)
    parser.add_argument(
        "--lr-scales", nargs="+", type=float, default=[1.0], help="multiples of the task's lr"
    )
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--csv", required=True, help="file the rows are appended to (rank 0)")
    args = parser.parse_args()

    torch.set_num_threads(1)  # many workers share a small CPU
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by {world} workers")
    path = Path(args.csv)
    if rank == 0 and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            csv.DictWriter(f, FIELDS).writeheader()
    for task_name in args.tasks:
        task = TASKS[task_name]()
        for seed in args.seeds:
            for lr_scale, method in [(k, m) for k in args.lr_scales for m in args.methods]:
                rows = run(task, method, seed, lr_scale, args)
                if rank == 0:
                    with path.open("a", newline="") as f:  # after every run: progress survives
                        csv.DictWriter(f, FIELDS).writerows(rows)
                    last = rows[-1]
                    print(
                        f"[{world} workers] {task_name} seed {seed} {method:24s} lr x{lr_scale:g} "
                        f"val loss {last['val_loss']:.4f} acc {last['val_acc']:.3f} "
                        f"consensus dist {last['consensus_distance']:.3g} "
                        f"({last['elapsed_s']:.0f} s)",
                        flush=True,
                    )
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
