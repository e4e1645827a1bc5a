"""One worker of the convergence study; ``run.py`` starts it under torchrun (see README.md).

It trains, one after the other, every run of the study (``study.py``) for this world size that
can be planned from the finished runs in ``--csv`` and is not among them: the task's model from
the seed's initial weights, on this rank's own batch stream, with the run's optimizer, learning
rate and schedule. After every run rank 0 appends one CSV row per evaluation, so a run is either
wholly in the file or not at all, and an interrupted study resumes where it stopped.

Every method trains the same way, as the paper does: linear warm-up then cosine decay to 10%
of the peak learning rate, gradient clipping at norm 1.0 (each worker clips its own gradient;
DDP clips the all-reduced one), weight decay only on parameters with two or more dimensions.
Methods:

* ``allreduce``: DistributedDataParallel + torch.optim.AdamW, the reference;
* ``adamw``: decent_optim.DecentralizedAdamW;
* ``accumadamw``: decent_optim.AccumAdamW with the run's ``accum_iter`` and betas;
* ``diloco``: DiLoCo with all-reduce (``benchmarks/_diloco.py``), per-worker torch.optim.AdamW
  as the inner optimizer, outer SGD lr 0.7, Nesterov momentum 0.9 (or the method's ``olr``,
  ``om``).

``adamw`` takes the method's ``local_steps=`` and ``outer=`` (``study.parse_method``).
Evaluation uses the consensus model: ``opt.averaged(model)``, the mean of the workers'
parameters and BatchNorm buffers (DiLoCo: of the parameters), restored afterwards so that
training goes on undisturbed. DDP's workers hold one model, which is evaluated as it is.
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
from datetime import timedelta
from pathlib import Path

import study
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import decent_optim as dopt

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import train_charlm  # noqa: E402  (the examples are scripts, not a package)
from _diloco import DiLoCo  # noqa: E402  (the baseline the time-to-quality benchmark uses too)

# what identifies a run (run.py builds these; one CSV column each), then what is measured
SPEC_FIELDS = [
    "task", "workers", "global_batch", "method", "optimizer", "topology", "beta1", "beta2",
    "accum_iter", "global_avg_every", "lr", "warmup", "steps", "seed", "key",
]  # fmt: skip
MEASURED = [
    "local_batch", "step", "lr_now", "train_loss", "val_loss", "val_acc", "consensus_distance",
    "elapsed_s",
]  # fmt: skip
FIELDS = SPEC_FIELDS + MEASURED
CLIP_NORM = 1.0
# a paused job (SIGSTOP while someone else benchmarks) must not trip gloo's timeouts
PATIENCE = timedelta(minutes=30)


@dataclass
class Task:
    """What the training loop needs to know about a task."""

    name: str
    make_model: Callable[[], nn.Module]
    sample: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    val: list[tuple[torch.Tensor, torch.Tensor]]  # fixed held-out batches, the same on every rank
    weight_decay: float

    @staticmethod
    def loss(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction=reduction)


def charlm_task(p: study.Protocol) -> Task:
    """The character GPT of examples/train_charlm.py on its grammar text.

    20,000 sentences (850k characters) rather than the example's 4,000, so that even the
    weak-scaling runs (up to 128 sequences per step) see the training text only a few times.
    """
    corpus = train_charlm.load_corpus(n_sentences=20_000, val_batches=p.val_batches)
    train, val = corpus.train, corpus.val_batches
    return Task(
        "charlm",
        lambda: train_charlm.CharGPT(corpus.vocab_size),
        lambda batch, gen: train_charlm.get_batch(train, batch, gen),
        val,
        weight_decay=0.1,
    )


def digits_task(p: study.Protocol) -> Task:
    """The BatchNorm CNN of examples/digits_cnn.py on scikit-learn's 8x8 digits, made noisy.

    Clean, the held-out set saturates (All-Reduce: 99.7% accuracy, loss 0.005 at 1200 steps, so
    one image moves the loss by several percent). Every training image therefore gets a fresh
    random shift of up to one pixel and Gaussian pixel noise (sigma 0.2, pixels in [0, 1]); the
    held-out set is ``p.val_copies`` (10) fixed noisy copies of each of the 360 held-out images.
    """
    import digits_cnn  # here: it imports scikit-learn, slow to load and only needed here
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]

    def corrupt(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        n = len(x)
        padded = F.pad(x[:, 0], (1, 1, 1, 1))  # (n, 10, 10)
        rows = torch.randint(3, (n, 1), generator=gen) + torch.arange(8)
        cols = torch.randint(3, (n, 1), generator=gen) + torch.arange(8)
        shifted = padded[torch.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]
        return (shifted + 0.2 * torch.randn(shifted.shape, generator=gen)).unsqueeze(1)

    def sample(batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx = train[torch.randint(len(train), (batch,), generator=gen)]
        return corrupt(images[idx], gen), labels[idx]

    val_gen = torch.Generator().manual_seed(12345)
    val = [(corrupt(images[test], val_gen), labels[test]) for _ in range(p.val_copies)]
    return Task("digits", digits_cnn.make_model, sample, val, weight_decay=0.1)


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


def rms_consensus_distance(opt: torch.optim.Optimizer | DiLoCo) -> float:
    """sqrt(mean over ranks of ||x_i - mean x||^2); 0 for DDP, whose workers share one model."""
    if not isinstance(opt, (dopt.DecentralizedOptimizer, DiLoCo)):
        return 0.0
    (total,) = sum_over_ranks([opt.consensus_distance() ** 2])
    return math.sqrt(total / dist.get_world_size())


def warmup_cosine(steps: int, warmup: int) -> Callable[[int], float]:
    """Linear warm-up to the peak over ``warmup`` steps, then cosine decay to 10% at ``steps``."""

    def factor(step: int) -> float:  # step = completed steps, 0 for the first
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(steps - warmup, 1), 1.0)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    return factor


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay the matrices (and embeddings); leave biases, LayerNorm and BatchNorm alone."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def build(task: Task, spec: dict) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer | DiLoCo]:
    """(model to train, module to call forward on, optimizer) for the run ``spec``."""
    model = task.make_model()
    groups = param_groups(model, task.weight_decay)
    kw = dict(lr=spec["lr"], betas=(spec["beta1"], spec["beta2"]))
    method = study.parse_method(spec["method"], spec["workers"])
    if spec["optimizer"] == "allreduce":
        return model, DistributedDataParallel(model), torch.optim.AdamW(groups, **kw)
    if spec["optimizer"] == "diloco":
        inner = torch.optim.AdamW(groups, **kw)
        momentum = method.outer_momentum
        opt = DiLoCo(
            model.parameters(), inner, method.local_steps, method.outer_lr, momentum, momentum > 0
        )
        return model, model, opt
    # the paper's alternating-exp-ring is node-aware; 2 workers per "node" as in its set-up
    # (with 2 workers in all, 2 nodes of 1)
    local = 2 if spec["workers"] >= 4 else 1
    common = dict(
        topology=spec["topology"], local_world_size=local, timeout=PATIENCE,
        global_avg_every=spec["global_avg_every"] or None,
        compression=method.compression or None,
    )  # fmt: skip
    if spec["optimizer"] == "adamw":
        outer: object = "diloco" if method.outer else None
        if method.slow_every:
            outer = dopt.LocalOuterSGD(every=method.slow_every)
        opt: torch.optim.Optimizer = dopt.DecentralizedAdamW(
            groups, **kw, **common, local_steps=method.local_steps, outer=outer,
        )  # fmt: skip
    elif spec["optimizer"] == "accumadamw":
        opt = dopt.AccumAdamW(groups, accum_iter=spec["accum_iter"], **kw, **common)
    else:
        raise SystemExit(f"unknown optimizer {spec['optimizer']!r}")
    return model, model, opt


def run(task: Task, spec: dict, eval_every: int) -> list[dict]:
    """One training run; returns its rows (on every rank; rank 0 writes them)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local_batch = spec["global_batch"] // world
    torch.manual_seed(spec["seed"])  # the same initial model for every method (and every rank)
    model, forward, opt = build(task, spec)
    schedule = warmup_cosine(spec["steps"], spec["warmup"])
    # DiLoCo: the schedule drives the inner rate (the outer one is fixed)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt.inner if isinstance(opt, DiLoCo) else opt, schedule
    )
    gen = torch.Generator().manual_seed(1000 * spec["seed"] + rank)  # this rank's batch stream
    params = list(model.parameters())
    rows, window = [], []
    start = time.perf_counter()
    for step in range(1, spec["steps"] + 1):
        x, y = task.sample(local_batch, gen)
        loss = task.loss(forward(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP_NORM)
        opt.step()
        sched.step()
        window.append(loss.item())
        if step % eval_every == 0 or step == spec["steps"]:
            (train_loss,) = sum_over_ranks([sum(window) / len(window)])
            window = []
            distance = rms_consensus_distance(opt)
            if isinstance(opt, dopt.DecentralizedOptimizer):
                with opt.averaged(model):  # parameters and BatchNorm buffers, restored after
                    val_loss, val_acc = evaluate(model, task)
            elif isinstance(opt, DiLoCo):
                with opt.averaged():  # mid-period the workers differ
                    val_loss, val_acc = evaluate(model, task)
            else:
                val_loss, val_acc = evaluate(model, task)
            rows.append(
                {
                    **{k: spec[k] for k in SPEC_FIELDS}, "local_batch": local_batch,
                    "step": step, "lr_now": opt.param_groups[0]["lr"],
                    "train_loss": train_loss / world, "val_loss": val_loss, "val_acc": val_acc,
                    "consensus_distance": distance, "elapsed_s": time.perf_counter() - start,
                }
            )  # fmt: skip
    if isinstance(opt, dopt.DecentralizedOptimizer):
        opt.synchronize()  # nothing may stay in flight when the next run builds its optimizer
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--protocol", choices=list(study.PROTOCOLS), default="full")
    parser.add_argument("--stages", nargs="+", default=study.STAGES, choices=study.STAGES)
    parser.add_argument("--tasks", nargs="+", help="only these tasks")
    parser.add_argument("--seeds", nargs="+", type=int, help="only these seeds")
    parser.add_argument("--csv", required=True, help="the study's runs; rank 0 appends to it")
    args = parser.parse_args()

    torch.set_num_threads(1)  # many workers share a small CPU
    dist.init_process_group("gloo", timeout=PATIENCE)
    rank, world = dist.get_rank(), dist.get_world_size()
    protocol, path = study.PROTOCOLS[args.protocol], Path(args.csv)
    tasks: dict[str, Task] = {}
    while True:
        # rank 0 picks the next run from what is finished, so that a stage whose plan depends
        # on an earlier stage's results (a tuned rate) can run in the same job
        pick: list[dict | None] = [None]
        if rank == 0:
            done = study.final_losses(study.read_runs(path))
            left = study.todo(protocol, args.stages, done, [world], args.tasks, args.seeds)
            pick = [left[0] if left else None]
            if left:
                print(f"[{world} workers] {len(left)} runs plannable now, next: {left[0]['key']}")
        dist.broadcast_object_list(pick, src=0)
        spec = pick[0]
        if spec is None:
            break
        task = tasks.get(spec["task"]) or tasks.setdefault(
            spec["task"], TASKS[spec["task"]](protocol)
        )
        rows = run(task, spec, protocol.eval_every)
        if rank == 0:
            new = not path.exists()
            with path.open("a", newline="") as f:  # one write per run: a run is whole or absent
                writer = csv.DictWriter(f, FIELDS)
                if new:
                    writer.writeheader()
                writer.writerows(rows)
            last = rows[-1]
            print(
                f"[{world} workers] {spec['key']}: val loss {last['val_loss']:.4f} "
                f"acc {last['val_acc']:.3f} consensus dist {last['consensus_distance']:.3g} "
                f"({last['elapsed_s']:.0f} s)",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
