"""Run the convergence study (v2) and write its tables and plots (see README.md).

    python experiments/convergence/run.py                    # the whole study, resumable
    python experiments/convergence/run.py --stages ar-lr sweep --workers 4 8   # a piece of it
    python experiments/convergence/run.py --dry-run          # the runs that can start now
    python experiments/convergence/run.py --report-only      # tables and plots from the CSV
    python experiments/convergence/run.py --report-only --docs-images docs/images/convergence

The study is planned in stages (``study.py``): later stages need earlier results (the All-Reduce
optimum, each method's best rate). This script starts ``train.py`` under torchrun (gloo, one
thread per worker) once per worker count, smallest first; each job trains every run for its
count that the finished runs in ``<out>/runs.csv`` allow to plan and that is not there yet.
Interrupting it loses at most the run in progress; the same command continues where it stopped.
Then ``report.py`` writes the tables (``summary.md``, ``summary.csv``) and plots.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import report
import study

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(workers: int, args: argparse.Namespace, csv_path: Path) -> None:
    """One torchrun job of ``workers`` ranks: it trains every run it can plan for that count."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={workers}",
        "--master-addr=127.0.0.1", f"--master-port={args.port or free_port()}",
        str(HERE / "train.py"), "--protocol", args.protocol, "--csv", str(csv_path),
        "--stages", *args.stages,
    ]  # fmt: skip
    if args.tasks:
        cmd += ["--tasks", *args.tasks]
    if args.seeds is not None:
        cmd += ["--seeds", *map(str, args.seeds)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # never join an outer torchrun's world
    print(f"== {workers} workers: start", flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True)
    print(f"== {workers} workers: done in {time.perf_counter() - start:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", nargs="+", default=study.STAGES, choices=study.STAGES)
    parser.add_argument("--workers", nargs="+", type=int, help="only these worker counts")
    parser.add_argument("--tasks", nargs="+", help="only these tasks")
    parser.add_argument(
        "--seeds", nargs="+", type=int,
        help="only these seeds (e.g. seed 0 of every count first, then the others)",
    )  # fmt: skip
    parser.add_argument(
        "--protocol", choices=list(study.PROTOCOLS), default="full",
        help="smoke: the reduced study of the CI test (2 workers, 16 steps)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--port", type=int, default=0, help="torchrun master port (0: any free)")
    parser.add_argument("--report-only", action="store_true", help="skip training")
    parser.add_argument("--dry-run", action="store_true", help="list the runs plannable now")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument(
        "--docs-images", type=Path, metavar="DIR",
        help="also copy the plots here (the docs page: docs/images/convergence)",
    )  # fmt: skip
    args = parser.parse_args()

    protocol = study.PROTOCOLS[args.protocol]
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = args.out / "runs.csv"
    counts = [n for n in study.worker_counts(protocol) if not args.workers or n in args.workers]
    while not args.report_only:
        # smallest count first: later counts need its results (All-Reduce's optimum); repeat
        # until a pass finds nothing to do, since a job's results can unlock another count's runs
        launched = False
        for workers in counts:
            done = study.final_losses(study.read_runs(csv_path))
            left = study.todo(protocol, args.stages, done, [workers], args.tasks, args.seeds)
            print(f"== {workers} workers: {len(left)} runs plannable now", flush=True)
            if args.dry_run:
                print("".join(f"   {s['key']}\n" for s in left), end="")
            elif left:
                launch(workers, args, csv_path)
                launched = True
        if not launched:
            break
    if args.dry_run or not csv_path.exists():
        return
    report.write_all(protocol, study.read_runs(csv_path), args.out, plots=not args.no_plots)
    if args.docs_images and not args.no_plots:
        args.docs_images.mkdir(parents=True, exist_ok=True)
        for png in sorted(args.out.glob("*.png")):
            shutil.copyfile(png, args.docs_images / png.name)
            print(f"copied {png.name} to {args.docs_images}")


if __name__ == "__main__":
    main()
