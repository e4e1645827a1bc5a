"""Workers of uneven speed: the fast ones keep training while a slow one catches up.

torchrun --standalone --nproc-per-node 4 examples/uneven_workers.py             # rank 3 2x slower
torchrun --standalone --nproc-per-node 4 examples/uneven_workers.py --even      # for comparison

The character GPT of ``train_charlm.py``, with ``local_steps=2, uneven=True``: a round leaves
every 2 steps or more and each worker mixes it in when it has arrived, taking local steps until
then (a period lasts the slowest worker's 2 steps, so the fast ones take 4 at half its speed:
pick half the ``local_steps`` you would on even hardware). The loop ends on the optimizer's
budget, the learning rate follows its DDP-equivalent progress and evaluation happens at rounds,
the points every worker reaches in the same order (step counts differ from worker to worker),
with a final evaluation at the round the budget ends on. ``--checkpoint-dir`` saves at every
evaluation and resumes from there (``opt.stop_at`` is called after the load: the budget is not
in the checkpoint). A slow device is emulated by a sleep per step.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import decent_optim as dopt

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_charlm  # noqa: E402  (the model and data of the other example)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400, help="budget in DDP-equivalent steps")
    p.add_argument("--step-ms", type=float, default=60.0, help="emulated device time per step")
    p.add_argument("--slow-rank", type=int, default=-1, help="default: the last rank")
    p.add_argument("--even", action="store_true", help="every worker at the same speed")
    p.add_argument(
        "--eval-every", type=int, default=100, help="DDP-equivalent steps between evaluations"
    )
    p.add_argument(
        "--eval-rounds", type=int, help="rounds between evaluations (default: from --eval-every)"
    )
    p.add_argument("--checkpoint-dir", help="save at every evaluation and resume from there")
    args = p.parse_args()
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    n = dist.get_world_size() if dist.is_initialized() else 1
    torch.set_num_threads(1)
    slow = args.slow_rank % n
    delay_s = args.step_ms / 1e3 * (2 if rank == slow and not args.even else 1)

    corpus = train_charlm.load_corpus()
    torch.manual_seed(0)
    model = train_charlm.CharGPT(corpus.vocab_size)
    peak, local_steps = 3e-3, 2
    opt = dopt.DecentralizedAdamW(
        model.parameters(), lr=peak, topology="ring", local_steps=local_steps, uneven=True
    )
    resumed_at = 0
    if args.checkpoint_dir:  # round 0 when there is nothing to resume
        resumed_at = dopt.checkpoint.load(args.checkpoint_dir, model, opt).step
    opt.stop_at(args.steps)  # after load, on every start: the budget is not in the checkpoint
    # a round every local_steps steps (or more) of the slowest worker: on even hardware one
    # round is local_steps DDP-equivalent steps, so every E steps is every E // local_steps rounds
    eval_rounds = args.eval_rounds or max(1, args.eval_every // local_steps)
    last_eval = opt.round  # the round evaluated last: none yet (opt.round stays for a period)

    def evaluate() -> None:  # a collective: every worker is at this round
        with opt.averaged(model), torch.no_grad():
            x, y = corpus.val_batches[0]
            held_out = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
        if rank == 0:
            print(
                f"round {opt.round}: {opt.progress:.0f} DDP-equivalent steps, held-out "
                f"loss of the consensus model {held_out:.3f}",
                flush=True,
            )
        if args.checkpoint_dir:
            dopt.checkpoint.save(args.checkpoint_dir, model, opt, step=opt.round)

    gen = torch.Generator().manual_seed(1000 * resumed_at + rank)  # new batches after a resume
    steps, start = 0, time.perf_counter()
    while not opt.stopped:
        for group in opt.param_groups:  # cosine over the DDP-equivalent progress
            group["lr"] = peak * 0.5 * (1 + math.cos(math.pi * min(1.0, opt.progress / args.steps)))
        time.sleep(delay_s)  # the emulated device
        x, y = train_charlm.get_batch(corpus.train, 16, gen)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
        if opt.round % eval_rounds == 0 and opt.round != last_eval and not opt.stopped:
            last_eval = opt.round
            evaluate()
    evaluate()  # the final one, at the round the budget ended on
    if args.checkpoint_dir:
        dopt.checkpoint.wait(args.checkpoint_dir)
    seconds = time.perf_counter() - start
    resumed = f" (resumed at round {resumed_at})" if resumed_at else ""
    print(
        f"rank {rank}{' (slow)' if rank == slow and not args.even else ''}: {steps} steps in "
        f"{seconds:.1f} s{resumed}; stopped at round {opt.round}, {opt.progress:.0f} "
        "DDP-equivalent steps",
        flush=True,
    )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
