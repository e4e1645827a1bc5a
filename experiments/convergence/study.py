"""The convergence study's protocol: which runs exist, and which to run next given the results.

A run is a dict (see ``train.SPEC_FIELDS``) with a unique ``key``. The study is planned in
stages, each a function of the finished runs, because later stages depend on earlier results:

1. ``ar-lr``: All-Reduce learning-rate sweep (4 workers, seed 0) -> the All-Reduce optimum;
2. ``sweep``: every method at {0.5, 1, 1.5, 2} x that optimum, seed 0, per worker count;
3. ``seeds``: every method at its best rate of the sweep, more seeds;
4. ``weak``: weak scaling, a fixed local batch of 8 and a global batch that grows;
5. ``big``: 32 workers, local batch 1;
6. ``knobs``: one step further where a setting misses (``global_avg_every``, ``accum_iter``,
   topology, beta2, learning rate);
7. ``compressed``: compressed gossip (``int8``, ``bf16``) at the uncompressed method's tuned rate
   and warm-up (no sweep of its own), paired by seed with the uncompressed runs;
8. ``local``: local steps (``local_steps=H``, optionally ``outer="diloco"``) against DiLoCo with
   all-reduce at the same ``H``, at borrowed rates (``rate_source``), paired by seed.

Method names are ``family:topology[:option...]``: family ``allreduce``, ``adamw`` (beta2 0.95),
``adamw98`` (beta2 0.98), ``accum98`` / ``accum95`` / ``accum99`` (AccumAdamW with that beta2),
``accum^s`` (AccumAdamW with betas (0.9**s, 0.95**s), the short-horizon heuristic of study v1);
topology ``ring``, ``aer`` (alternating-exp-ring, 2 workers per node), ``ope``
(one-peer-exp), ``complete``; options ``s<k>`` (accum_iter, default min(workers, 8)) and
``gavg<k>`` (``global_avg_every=k``), ``int8`` / ``bf16`` (``compression=``: what crosses
between nodes is compressed), ``h<k>`` (``local_steps=k``), ``outer`` (``outer="diloco"``),
``slow<k>`` (``outer=LocalOuterSGD(every=k)``, lr 0.5, momentum 0.7: the outer step on each
rank's slow weights).
Family ``diloco`` takes no topology: ``diloco:h<k>`` is DiLoCo with all-reduce
(``benchmarks/_diloco.py``: per-worker AdamW for k steps, outer SGD lr 0.7, Nesterov 0.9);
options ``olr<k>``: outer lr k / 100 instead of 0.7 (``diloco:h4:olr30``: 0.3), ``om<k>``: outer
momentum k / 100 instead of 0.9 (Nesterov while > 0; ``diloco:h4:olr100:om0``: plain averaging).
"""

from __future__ import annotations

import csv
import math
import re
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

TOPOLOGIES = {
    "ring": "ring",
    "aer": "alternating-exp-ring",
    "ope": "one-peer-exp",
    "complete": "complete",
}
STAGES = ["ar-lr", "sweep", "seeds", "weak", "big", "knobs", "compressed", "local"]
COMPRESSIONS = ("int8", "bf16")


@dataclass(frozen=True)
class Protocol:
    """Everything that fixes the study's runs; ``FULL`` is the study in the docs."""

    steps: int = 1200
    eval_every: int = 150
    val_batches: int = 16  # charlm: held-out batches of 32 x 64 characters
    val_copies: int = 10  # digits: noisy copies of the 360 held-out images
    global_batch: int = 32
    beta1: float = 0.9
    # warm-up = max(min_warmup, warmup_memories * s / (1 - beta1)): 240 covers accum_iter <= 8,
    # and every run with accum_iter <= 8 (All-Reduce included) gets the same schedule
    min_warmup: int = 240
    warmup_memories: float = 3.0
    ar_lrs: dict[str, tuple[float, ...]] = field(
        default_factory=lambda: {
            "charlm": (2e-3, 3e-3, 4e-3, 6e-3, 8e-3, 1.2e-2, 1.6e-2, 2.4e-2),
            "digits": (1.5e-3, 3e-3, 6e-3, 1.2e-2, 2.4e-2, 4.8e-2, 9.6e-2),
        }
    )
    ar_workers: int = 4  # where All-Reduce's rate is swept (the same maths at every count)
    lr_factors: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0)
    # cut to fit a shared 2-core machine (by worker count, or by (task, worker count)): at 8
    # workers only x1.5 and x2 (for DecentralizedAdamW and AccumAdamW on alternating-exp-ring
    # x0.5 and x1 were never the best at 4 or 16 workers); digits x1 and x2 (x0.5: a knob)
    lr_factors_at: dict[int | tuple[str, int], tuple[float, ...]] = field(
        default_factory=lambda: {
            ("charlm", 8): (1.5, 2.0),
            ("digits", 4): (1.0, 2.0),
            ("digits", 8): (1.0, 2.0),
        }
    )
    # task -> worker count -> seeds; seed 0 is the sweep's, the others rerun the best rate
    seeds: dict[str, dict[int, tuple[int, ...]]] = field(
        default_factory=lambda: {
            # pruned to fit the shared 2-core machine: 16 workers 1 seed, digits 1 seed
            "charlm": {4: (0, 1, 2), 8: (0, 1, 2), 16: (0, 1)},
            "digits": {4: (0,), 8: (0,)},
        }
    )
    # the methods that get every seed (All-Reduce and the paper's topology); the others seed 0
    seeded: dict[str, tuple[str, ...]] = field(
        default_factory=lambda: {
            "charlm": ("allreduce", "adamw:aer", "accum98:aer"),
            "digits": ("allreduce", "adamw:aer", "accum98:aer"),
        }
    )
    # ablations left out where they say least, to fit a shared 2-core machine: one-peer-exp
    # (ring and alternating-exp-ring already differ by < 0.1% at 16 workers) only for
    # DecentralizedAdamW at 4 workers; beta2 0.95 not at 4 workers (local batch 8); betas^s not
    # at 8 workers (its verdict is clear at 4 and 16)
    dropped: dict[tuple[str, int], tuple[str, ...]] = field(
        default_factory=lambda: {
            ("charlm", 4): ("accum98:ope", "accum95:aer"),
            # 8 workers: only the paper's topology and the recommended methods
            ("charlm", 8): (
                "adamw:ring",
                "adamw:ope",
                "accum98:ring",
                "accum98:ope",
                "accum95:aer",
                "accum^s:aer",
            ),
        }
    )
    methods: dict[str, tuple[str, ...]] = field(
        default_factory=lambda: {
            "charlm": (
                "allreduce",
                "adamw:ring",
                "adamw:aer",
                "adamw:ope",
                "accum98:ring",
                "accum98:aer",
                "accum98:ope",
                "accum95:aer",
                "accum^s:aer",
            ),
            "digits": ("allreduce", "adamw:aer", "accum98:aer"),
        }  # fmt: skip
    )
    # weak scaling (charlm): local batch fixed, global batch = local x workers; the base count
    # is the strong-scaling run with the same local batch (4 workers x 8 = 32)
    weak_local_batch: int = 8
    weak_workers: tuple[int, ...] = (8,)
    weak_methods: tuple[str, ...] = ("allreduce", "adamw:aer", "accum98:aer")
    # 32 workers, local batch 1 (charlm, seed 0), at the rate factors tuned at 16 workers
    big_workers: tuple[int, ...] = (32,)
    big_methods: tuple[str, ...] = ("allreduce", "adamw:aer", "accum98:aer")
    # the targets: gap to All-Reduce (mean over seeds, %) per worker count (charlm)
    targets: dict[int, float] = field(default_factory=lambda: {4: 1.0, 8: 1.0, 16: 2.0})
    # (task, workers, method, lr factor or None for the method's tuned one, seeds)
    # planned but not run for lack of machine time: x3 at 16 workers (x2, the sweep's edge, was
    # best there for every method) and AccumAdamW accum_iter=16 at 32 workers
    knobs: tuple[tuple[str, int, str, float | None, tuple[int, ...]], ...] = (
        # digits, 4 workers: x2 was worse than x1 for both decentralized methods; is x0.5 better?
        ("digits", 4, "adamw:aer", 0.5, (0,)),
        ("digits", 4, "accum98:aer", 0.5, (0,)),
    )
    # (task, workers, method, seeds): compressed gossip at the tuned rate of the method without
    # its compression option; the targets: within compressed_targets (%, mean over
    # seeds) of the uncompressed run's validation loss
    compressed: tuple[tuple[str, int, str, tuple[int, ...]], ...] = (
        ("charlm", 4, "adamw:aer:int8", (0, 1, 2)),
        ("charlm", 8, "adamw:aer:int8", (0, 1, 2)),
        ("charlm", 4, "adamw:aer:bf16", (0, 1, 2)),
        ("charlm", 8, "adamw:aer:bf16", (0, 1, 2)),
    )
    compressed_targets: dict[int, float] = field(default_factory=lambda: {4: 1.0, 8: 3.0})
    # (task, workers, method, lr factor or None for the rate_source's tuned one, seeds): local
    # steps against DiLoCo with all-reduce at the same H (issue 23), paired by seed
    local: tuple[tuple[str, int, str, float | None, tuple[int, ...]], ...] = tuple(
        ("charlm", n, method, None, (0, 1, 2))
        for n in (4, 8)
        for method in (
            "adamw:aer:h4", "adamw:aer:h4:int8", "diloco:h4", "adamw:aer:h16:outer", "diloco:h16",
        )
    ) + tuple(
        # added after seed 0: with DiLoCo's published outer rate (0.7) DiLoCo trained badly at
        # H = 4 (+118% at 4 workers), so its outer rate gets a sweep too (0.3, 0.1); plain local
        # steps, at the every-step method's x2 above, get x1 and x1.5
        ("charlm", n, method, factor, (0,))
        for n in (4, 8)
        for method, factor in (
            ("adamw:aer:h4", 1.0), ("adamw:aer:h4", 1.5), ("diloco:h4:olr30", None),
            ("diloco:h4:olr10", None),
        )
    ) + tuple(
        # then: outer lr 0.1 (the sweep's edge) was the best; seeds 1 and 2 for it, and below
        # the edge: 0.05, and plain averaging (outer lr 1, no momentum)
        ("charlm", n, method, None, seeds)
        for n in (4, 8)
        for method, seeds in (
            ("diloco:h4:olr10", (1, 2)), ("diloco:h4:olr5", (0,)), ("diloco:h4:olr100:om0", (0,)),
        )
    ) + tuple(
        # then: plain averaging was the best at both counts; seeds 1 and 2 for it, and at the
        # rate of the plain local steps (x2; better again at seed 0, so 3 seeds)
        ("charlm", n, "diloco:h4:olr100:om0", factor, seeds)
        for n in (4, 8)
        for factor, seeds in ((None, (1, 2)), (2.0, (0, 1, 2)))
    ) + tuple(
        # issue 32: the outer step on each rank's slow weights, at the plain local steps' rate
        ("charlm", n, method, None, (0, 1, 2))
        for n in (4, 8)
        for method in ("adamw:aer:h4:int8:slow16", "adamw:aer:h4:int8:slow32")
    )  # fmt: skip


FULL = Protocol()

# About a second per run on 2 workers: what tests/test_convergence_study.py runs
SMOKE = Protocol(
    steps=16,
    eval_every=8,
    val_batches=2,
    val_copies=1,
    global_batch=8,
    min_warmup=4,
    warmup_memories=0.1,
    ar_lrs={"charlm": (1e-2, 2e-2), "digits": (1e-2,)},
    ar_workers=2,
    lr_factors=(1.0, 2.0),
    seeds={"charlm": {2: (0, 1)}, "digits": {2: (0,)}},
    seeded={
        "charlm": ("allreduce", "adamw:ring", "adamw:aer", "adamw:ope", "accum98:ring"),
        "digits": (),
    },
    lr_factors_at={},
    methods={
        "charlm": ("allreduce", "adamw:ring", "adamw:aer", "adamw:ope", "accum98:ring"),
        "digits": ("allreduce", "accum98:ring"),
    },
    weak_workers=(),
    big_workers=(),
    knobs=(),
    compressed=(("charlm", 2, "adamw:aer:int8", (0,)),),
    # H = 3: no evaluation (steps 8 and 16) falls on the end of a period, where DiLoCo's workers
    # (and the outer mode's, with 2 workers) hold one model
    local=(
        ("charlm", 2, "adamw:aer:h3", None, (0,)),
        ("charlm", 2, "diloco:h3", None, (0,)),
        ("charlm", 2, "adamw:aer:h3:outer", None, (0,)),
    ),
)
PROTOCOLS = {"full": FULL, "smoke": SMOKE}


@dataclass(frozen=True)
class Method:
    """A method name resolved into optimizer settings (for ``workers`` workers)."""

    name: str
    optimizer: str  # allreduce | adamw | accumadamw | diloco
    topology: str
    beta1: float
    beta2: float
    accum_iter: int
    global_avg_every: int  # 0: never
    compression: str = ""  # "": exact gossip
    local_steps: int = 1  # gossip (DiLoCo: all-reduce) every this many steps
    outer: bool = False  # outer="diloco"
    outer_lr: float = 0.7  # DiLoCo's outer SGD rate
    outer_momentum: float = 0.9  # and its Nesterov momentum (0: no momentum)
    slow_every: int = 0  # outer=LocalOuterSGD(every=slow_every); 0: none

    @property
    def label(self) -> str:
        """How tables and plots call it (without the topology)."""
        if self.optimizer == "allreduce":
            return "All-Reduce AdamW (DDP)"
        if self.optimizer == "diloco":
            momentum = "" if self.outer_momentum == 0.9 else f", momentum {self.outer_momentum:g}"
            return (
                f"DiLoCo (all-reduce), H={self.local_steps}, outer lr {self.outer_lr:g}{momentum}"
            )
        extra = f", global avg every {self.global_avg_every}" if self.global_avg_every else ""
        extra += f", {self.compression} gossip" if self.compression else ""
        extra += f", local_steps={self.local_steps}" if self.local_steps > 1 else ""
        extra += ', outer="diloco"' if self.outer else ""
        extra += f", LocalOuterSGD every {self.slow_every}" if self.slow_every else ""
        if self.optimizer == "adamw":
            b2 = "" if self.beta2 == 0.95 else f" β2={self.beta2:g}"
            return f"DecentralizedAdamW{b2}{extra}"
        s = f"s={self.accum_iter}" if ":s" in self.name else "s=min(n,8)"
        if self.name.startswith("accum^s"):
            return f"AccumAdamW betas (0.9^s, 0.95^s), {s}{extra}"
        return f"AccumAdamW β2={self.beta2:g}, {s}{extra}"


def parse_method(name: str, workers: int, beta1: float = 0.9) -> Method:
    family, _, rest = name.partition(":")
    parts = rest.split(":") if rest else []
    if family in ("allreduce", "diloco"):  # no topology: all-reduce
        parts.insert(0, "")
    topology = TOPOLOGIES[parts[0]] if parts and parts[0] else "all-reduce"
    compression = "".join(p for p in parts[1:] if p in COMPRESSIONS)
    outer = "outer" in parts[1:]
    numbered = [p for p in parts[1:] if p not in COMPRESSIONS and p != "outer"]
    options = dict(re.fullmatch(r"([a-z]+)(\d+)", p).groups() for p in numbered)  # type: ignore[union-attr,misc]
    s = int(options.get("s", min(workers, 8)))
    gavg = int(options.get("gavg", 0))
    h = int(options.get("h", 1))
    outer_lr, outer_momentum = int(options.get("olr", 70)) / 100, int(options.get("om", 90)) / 100
    if family == "allreduce":
        return Method(name, "allreduce", "all-reduce", beta1, 0.95, 1, 0)
    if family == "diloco":
        return Method(
            name, "diloco", "all-reduce", beta1, 0.95, 1, 0, local_steps=h, outer_lr=outer_lr,
            outer_momentum=outer_momentum,
        )  # fmt: skip
    if family.startswith("adamw"):
        beta2 = 0.95 if family == "adamw" else int(family[5:]) / 100
        return Method(
            name, "adamw", topology, beta1, beta2, 1, gavg, compression, h, outer,
            slow_every=int(options.get("slow", 0)),
        )  # fmt: skip
    if family == "accum^s":
        return Method(name, "accumadamw", topology, beta1**s, 0.95**s, s, gavg, compression)
    if family.startswith("accum"):
        beta2 = int(family[5:]) / 100
        return Method(name, "accumadamw", topology, beta1, beta2, s, gavg, compression)
    raise ValueError(f"unknown method family {family!r} in {name!r}")


def warmup_steps(p: Protocol, method: Method) -> int:
    # AccumAdam's moment bases remember about s / (1 - beta1) steps: warm up over a few memories
    # (rounded first: 3 * 8 / (1 - 0.9) is 240.00000000000003 in floating point)
    memory = method.accum_iter / (1 - p.beta1)
    return max(p.min_warmup, math.ceil(round(p.warmup_memories * memory, 6)))


def make_spec(
    p: Protocol,
    task: str,
    workers: int,
    method_name: str,
    lr: float,
    seed: int,
    global_batch: int | None = None,
) -> dict:
    m = parse_method(method_name, workers, p.beta1)
    gb = global_batch or p.global_batch
    spec = dict(
        task=task, workers=workers, global_batch=gb, method=method_name, optimizer=m.optimizer,
        topology=m.topology, beta1=m.beta1, beta2=m.beta2, accum_iter=m.accum_iter,
        global_avg_every=m.global_avg_every, lr=float(f"{lr:.6g}"), warmup=warmup_steps(p, m),
        steps=p.steps, seed=seed,
    )  # fmt: skip
    spec["key"] = run_key(spec)
    return spec


def run_key(spec: dict) -> str:
    return (
        f"{spec['task']}/n{spec['workers']}/gb{spec['global_batch']}/{spec['method']}"
        f"/lr{float(spec['lr']):g}/wu{spec['warmup']}/T{spec['steps']}/seed{spec['seed']}"
    )


def config_key(spec: dict) -> str:
    """The run's key without its seed: the runs that a mean over seeds combines."""
    return run_key(spec).rsplit("/seed", 1)[0]


# -- results ------------------------------------------------------------------------------------
def read_runs(path: Path) -> dict[str, list[dict]]:
    """key -> its rows by step, for every finished run in the CSV (a run cut short is dropped)."""
    if not path.exists():
        return {}
    by_key: dict[str, dict[int, dict]] = defaultdict(dict)
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            try:
                float(row["val_loss"])
                by_key[row["key"]][int(row["step"])] = row  # a rerun's rows replace the old
            except (KeyError, TypeError, ValueError):
                continue  # a line torn by a killed write
    runs = {}
    for key, by_step in by_key.items():
        rows = [by_step[s] for s in sorted(by_step)]
        if rows[-1]["step"] == rows[-1]["steps"]:
            runs[key] = rows
    return runs


def todo(
    p: Protocol,
    stages: Iterable[str],
    done: dict[str, float],
    workers: Iterable[int] | None = None,
    tasks: Iterable[str] | None = None,
    seeds: Iterable[int] | None = None,
) -> list[dict]:
    """The runs of ``stages`` that can be specified now and are not finished, in stage order."""
    workers, tasks = (
        (None if workers is None else set(workers)),
        (None if tasks is None else set(tasks)),
    )
    seeds = None if seeds is None else set(seeds)
    out: dict[str, dict] = {}  # a run planned by two stages runs once
    for stage in stages:
        for s in plan(p, stage, done):
            if s["key"] in done or (workers and s["workers"] not in workers):
                continue
            if seeds is not None and s["seed"] not in seeds:
                continue
            if tasks is None or s["task"] in tasks:
                out.setdefault(s["key"], s)
    return list(out.values())


def worker_counts(p: Protocol) -> list[int]:
    """Every worker count the protocol trains with, smallest first."""
    counts = {p.ar_workers, *p.weak_workers, *p.big_workers}
    counts.update(n for by_count in p.seeds.values() for n in by_count)
    counts.update(knob[1] for knob in p.knobs)
    counts.update(c[1] for c in p.compressed)
    counts.update(c[1] for c in p.local)
    return sorted(counts)


def final_losses(runs: dict[str, list[dict]]) -> dict[str, float]:
    """key -> validation loss at the last step, for finished runs."""
    return {key: float(rows[-1]["val_loss"]) for key, rows in runs.items()}


def ar_optimum(p: Protocol, task: str, done: dict[str, float]) -> float | None:
    """All-Reduce's best learning rate of the sweep, or None until the sweep is finished."""
    specs = [make_spec(p, task, p.ar_workers, "allreduce", lr, 0) for lr in p.ar_lrs[task]]
    if not all(s["key"] in done for s in specs):
        return None
    return min(specs, key=lambda s: done[s["key"]])["lr"]


def sweep_specs(p: Protocol, task: str, workers: int, method: str, base: float) -> list[dict]:
    if method == "allreduce":  # its sweep is stage 1; here only its optimum
        return [make_spec(p, task, workers, method, base, 0)]
    return [make_spec(p, task, workers, method, k * base, 0) for k in factors(p, task, workers)]


def factors(p: Protocol, task: str, workers: int) -> tuple[float, ...]:
    """The learning-rate factors swept for ``task`` at ``workers`` workers."""
    at = p.lr_factors_at
    return at.get((task, workers), at.get(workers, p.lr_factors))


def best_factor(
    p: Protocol, task: str, workers: int, method: str, done: dict[str, float]
) -> float | None:
    """The method's best learning rate / All-Reduce's optimum, or None until known."""
    base = ar_optimum(p, task, done)
    if base is None:
        return None
    specs = sweep_specs(p, task, workers, method, base)
    if not all(s["key"] in done for s in specs):
        return None
    best = min(specs, key=lambda s: done[s["key"]])
    return best["lr"] / base


def plan(p: Protocol, stage: str, done: dict[str, float]) -> list[dict]:
    """The runs of ``stage`` that can be specified now (finished or not)."""
    out: list[dict] = []
    for task in p.methods:
        base = ar_optimum(p, task, done)
        if stage == "ar-lr":
            out += [make_spec(p, task, p.ar_workers, "allreduce", lr, 0) for lr in p.ar_lrs[task]]
        if base is None:
            continue
        for workers, seeds in p.seeds[task].items():
            for method in p.methods[task]:
                if method in p.dropped.get((task, workers), ()):
                    continue
                if stage == "sweep":
                    out += sweep_specs(p, task, workers, method, base)
                factor = best_factor(p, task, workers, method, done)
                if stage == "seeds" and factor is not None:
                    chosen = seeds if method in p.seeded[task] else seeds[:1]
                    out += [make_spec(p, task, workers, method, factor * base, s) for s in chosen]
        if stage == "weak" and task == "charlm":
            out += weak_specs(p, base, done)
        if stage == "big" and task == "charlm":
            out += big_specs(p, base, done)
        if stage == "knobs":
            out += _at_rates(p, task, base, done, p.knobs, _tuned_name)
        if stage == "compressed":
            for c_task, workers, method, seeds in p.compressed:
                factor = best_factor(p, task, workers, _tuned_name(method), done)
                if c_task == task and factor is not None:
                    out += [make_spec(p, task, workers, method, factor * base, s) for s in seeds]
        if stage == "local":
            out += local_specs(p, task, base, done)
    return out


def rate_source(method: str) -> str:
    """Whose tuned rate a local-steps run borrows: DiLoCo and the outer mode keep All-Reduce's
    for their inner AdamW (DiLoCo's convention); plain local steps take the every-step gossip
    method's (``adamw:aer:h4`` that of ``adamw:aer``)."""
    if method.startswith("diloco") or ":outer" in method:
        return "allreduce"
    return _tuned_name(method)


def local_specs(p: Protocol, task: str, base: float, done: dict[str, float]) -> list[dict]:
    """The ``local`` stage: seed 0 of every configuration first, then the other seeds."""
    out = _at_rates(p, task, base, done, p.local, rate_source)
    return sorted(out, key=lambda s: s["seed"])  # stable: the protocol's order within a seed


def _at_rates(
    p: Protocol,
    task: str,
    base: float,
    done: dict[str, float],
    entries: list,
    source: Callable[[str], str],
) -> list[dict]:
    """Runs of ``(task, workers, method, factor, seeds)`` entries of ``task``; a factor of None
    borrows the best tuned factor of the method ``source(method)`` (none yet: not plannable)."""
    out = []
    for e_task, workers, method, factor, seeds in entries:
        if e_task != task:
            continue
        if factor is None:
            factor = best_factor(p, task, workers, source(method), done)
        if factor is not None:
            out += [make_spec(p, task, workers, method, factor * base, s) for s in seeds]
    return out


def diloco_twin(method: str) -> str | None:
    """DiLoCo at the same H as a local-steps method (``adamw:aer:h4:int8`` -> ``diloco:h4``)."""
    h = re.search(r":h(\d+)", method)
    if method.startswith("diloco") or h is None:
        return None
    return f"diloco:h{h.group(1)}"


def _tuned_name(method: str) -> str:
    """The swept method whose tuned rate a knob variant borrows (options stripped)."""
    family, topology, *_ = (method + ":").split(":")
    return f"{family}:{topology}" if topology else family


def uncompressed(method: str) -> str:
    """The method without its compression option: the exact run a compressed one is paired with."""
    return ":".join(p for p in method.split(":") if p not in COMPRESSIONS)


def weak_specs(p: Protocol, base: float, done: dict[str, float]) -> list[dict]:
    """Linear learning-rate scaling from the 4-worker (global batch 32) optimum of each method."""
    out = []
    base_workers = p.global_batch // p.weak_local_batch
    for workers in p.weak_workers:
        scale = workers / base_workers
        for method in p.weak_methods:
            factor = best_factor(p, "charlm", base_workers, _tuned_name(method), done)
            if factor is not None:
                lr = factor * base * scale
                gb = p.weak_local_batch * workers
                out.append(make_spec(p, "charlm", workers, method, lr, 0, global_batch=gb))
    return out


def big_specs(p: Protocol, base: float, done: dict[str, float]) -> list[dict]:
    """32 workers at the factors tuned for the largest strong-scaling count."""
    out = []
    tuned_at = max(p.seeds["charlm"])
    for workers in p.big_workers:
        for method in p.big_methods:
            factor = best_factor(p, "charlm", tuned_at, _tuned_name(method), done)
            if factor is not None:
                out.append(make_spec(p, "charlm", workers, method, factor * base, 0))
    return out


def mean_std(values: Iterable[float]) -> tuple[float, float]:
    values = list(values)
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def group_by_config(specs: Iterable[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for s in specs:
        groups[config_key(s)].append(s)
    return groups
