"""Quality after a change of world size: the convergence study's character GPT, 1200 steps.

    python experiments/elastic/quality.py --out experiments/elastic/results/quality.jsonl

For each case ``A->B`` (default 8->4 and 4->8) and each resize rule, trains the study's run
(``experiments/convergence``: charlm, global batch 32, DecentralizedAdamW on
alternating-exp-ring at its tuned learning rate, warm-up and cosine schedule, ``--seed``) on A
workers up to step ``--switch``, saves a checkpoint (``decent_optim.checkpoint``), then resumes
it on B workers -- a new torchrun, as after a failure -- and trains to step 1200. The
uninterrupted runs (A == B) go through the same script. Appends one JSON line per run with the
final validation loss of the consensus model; ``--table`` prints the comparison.

Every run is a pair of ``torchrun --standalone`` jobs of this file (``--worker``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# the study's tuned run (lr x2 of All-Reduce's), as in experiments/convergence/results
STEPS, GLOBAL_BATCH, LR, WARMUP = 1200, 32, 0.012, 240


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(REPO / "experiments" / "convergence"))
    import study
    import torch
    import torch.distributed as dist
    import train

    import decent_optim as dopt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=train.PATIENCE)
    rank, world = dist.get_rank(), dist.get_world_size()
    seed = args.seed
    task = train.charlm_task(study.PROTOCOLS["full"])
    spec = dict(
        task="charlm", workers=world, global_batch=GLOBAL_BATCH, method="adamw:aer",
        optimizer="adamw", topology="alternating-exp-ring", beta1=0.9, beta2=0.95, accum_iter=1,
        global_avg_every=0, lr=LR, warmup=WARMUP, steps=args.steps, seed=seed,
    )  # fmt: skip
    torch.manual_seed(seed)
    model, forward, opt = train.build(task, spec)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, train.warmup_cosine(args.steps, WARMUP))
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    resumed = dopt.checkpoint.load(args.ckpt, model, opt, rule=args.rule)
    if resumed.step:
        sched.load_state_dict(resumed.extra["scheduler"])
        if resumed.source == "own":
            gen.set_state(resumed.extra["generator"])
        else:  # new batch streams: the old ones belong to other ranks
            gen.manual_seed(1000 * seed + rank + 7919 * resumed.step)
    params = list(model.parameters())
    local_batch = GLOBAL_BATCH // world
    for _ in range(resumed.step + 1, args.until + 1):
        x, y = task.sample(local_batch, gen)
        loss = task.loss(forward(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, train.CLIP_NORM)
        opt.step()
        sched.step()
    if args.until < args.steps:
        extra = {"scheduler": sched.state_dict(), "generator": gen.get_state()}
        dopt.checkpoint.save(args.ckpt, model, opt, step=args.until, extra=extra)
        dopt.checkpoint.wait(args.ckpt)
    else:
        with opt.averaged(model):
            val_loss, _ = train.evaluate(model, task)
        if rank == 0:
            print(json.dumps({"val_loss": val_loss}), flush=True)
    opt.synchronize()
    dist.barrier()  # no rank leaves while another still gossips
    # leave without running the process group's C++ destructors: with the sub-groups of
    # alternating-exp-ring they abort ("terminate called without an active exception") in
    # this script, after the result is printed
    sys.stdout.flush()
    os._exit(0)


def torchrun(workers: int, ckpt: str, until: int, rule: str, steps: int, seed: int) -> str:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(workers), __file__, "--worker", "--ckpt", ckpt,
        "--until", str(until), "--rule", rule, "--steps", str(steps),
        "--seed", str(seed),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout


def drive(args: argparse.Namespace) -> None:
    for case in args.cases:
        before, after = (int(n) for n in case.split("->"))
        for rule in args.rules if before != after else ["consensus"]:
            start = time.time()
            with tempfile.TemporaryDirectory() as ckpt:
                torchrun(before, ckpt, args.switch, rule, args.steps, args.seed)
                out = torchrun(after, ckpt, args.steps, rule, args.steps, args.seed)
            val = json.loads(out.strip().splitlines()[-1])["val_loss"]
            row = {"before": before, "after": after, "switch": args.switch, "rule": rule,
                   "steps": args.steps, "seed": args.seed, "val_loss": val, "seconds": round(time.time() - start),
                   "load": os.getloadavg()[0]}  # fmt: skip
            print(json.dumps(row), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


def table(path: str) -> None:
    """Mean over seeds; the gap is paired by seed with the uninterrupted run of the final size."""
    import statistics

    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    plain = {(r["after"], r["seed"]): r["val_loss"] for r in rows if r["before"] == r["after"]}
    groups: dict[tuple[int, int, str], list[dict]] = {}
    for r in rows:
        rule = "(uninterrupted)" if r["before"] == r["after"] else r["rule"]
        groups.setdefault((r["before"], r["after"], rule), []).append(r)

    def spread(values: list[float], fmt: str) -> str:
        std = f" ± {statistics.stdev(values):{fmt.lstrip('+')}}" if len(values) > 1 else ""
        return f"{statistics.mean(values):{fmt}}{std}"

    print("| workers | start of each new rank | final val loss | vs uninterrupted | seeds |")
    print("|---|---|---|---|---|")
    for (before, after, rule), runs in sorted(groups.items(), key=lambda kv: (-kv[0][0], kv[0])):
        gaps = [
            100 * (r["val_loss"] / plain[(after, r["seed"])] - 1)
            for r in runs
            if (after, r["seed"]) in plain
        ]
        name = f"{before}" if before == after else f"{before} -> {after}"
        gap = spread(gaps, "+.2f") + "%" if gaps and before != after else "--"
        seeds = ", ".join(str(r["seed"]) for r in runs)
        print(
            f"| {name} | {rule} | {spread([r['val_loss'] for r in runs], '.4f')} | {gap} | {seeds} |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--until", type=int, default=STEPS, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=STEPS, help="the run's length")
    p.add_argument("--rule", default="consensus")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", nargs="+", default=["8->8", "4->4", "8->4", "4->8"])
    p.add_argument("--rules", nargs="+", default=["consensus", "rank"])
    p.add_argument("--switch", type=int, default=600)
    p.add_argument("--out", default=str(HERE / "results" / "quality.jsonl"))
    p.add_argument("--table", action="store_true", help="print the table of --out and stop")
    args = p.parse_args()
    if args.worker:
        worker(args)
    elif args.table:
        table(args.out)
    else:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        drive(args)


if __name__ == "__main__":
    main()
