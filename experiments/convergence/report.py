"""Tables and plots of the convergence study, from its finished runs (``run.py`` calls this).

Writes to the results folder:

* ``summary.csv``: one line per configuration (a run without its seed): final validation loss
  mean and standard deviation over seeds, its gap to All-Reduce (paired by seed), accuracy,
  consensus distance, learning rate and its factor over All-Reduce's optimum, and which part of
  the study it belongs to;
* ``summary.md``: the same, as the tables of the docs: the main table (every method at its
  tuned rate), the gap at every evaluation step, the learning-rate sweeps, weak scaling,
  32 workers, the investigations (``knobs``), compressed vs exact gossip (``compressed``) and
  local steps vs DiLoCo at the same H (``local``);
* ``recommended.csv``: per worker count, the decentralized setting closest to All-Reduce;
* ``tables/*.csv``: each table of ``summary.md`` as CSV, for the docs;
* ``val_loss_<task>.png`` (validation loss, gap to All-Reduce and consensus distance vs step)
  and ``lr_sweep_<task>.png``.
"""

from __future__ import annotations

import csv
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import study

INT_FIELDS = ("workers", "global_batch", "accum_iter", "global_avg_every", "warmup", "steps")
FLOAT_FIELDS = ("beta1", "beta2", "lr")


class Config:
    """The runs of one configuration (every seed of it), with their curves."""

    def __init__(self, spec: dict, rows_by_seed: dict[int, list[dict]]):
        self.spec = spec
        self.runs = dict(sorted(rows_by_seed.items()))
        self.method = study.parse_method(spec["method"], spec["workers"])

    @property
    def seeds(self) -> list[int]:
        return list(self.runs)

    def final(self, seed: int, field: str = "val_loss") -> float:
        return float(self.runs[seed][-1][field])

    def curve(self, field: str) -> tuple[list[int], list[float]]:
        """(steps, mean over seeds) of ``field``, at the steps every seed evaluated."""
        steps = sorted(set.intersection(*({int(r["step"]) for r in v} for v in self.runs.values())))
        by_step = [
            [float(r[field]) for rows in self.runs.values() for r in rows if int(r["step"]) == s]
            for s in steps
        ]
        return steps, [statistics.fmean(v) for v in by_step]

    def at(self, seed: int, step: int) -> float:
        return next(float(r["val_loss"]) for r in self.runs[seed] if int(r["step"]) == step)


def load(runs: dict[str, list[dict]]) -> dict[str, Config]:
    specs: dict[str, dict] = {}
    by_config: dict[str, dict[int, list[dict]]] = defaultdict(dict)
    for rows in runs.values():
        spec = {k: rows[0][k] for k in ("task", "method", "optimizer", "topology", "key")}
        spec.update({k: int(rows[0][k]) for k in INT_FIELDS})
        spec.update({k: float(rows[0][k]) for k in FLOAT_FIELDS})
        spec["seed"] = int(rows[0]["seed"])
        ckey = study.config_key(spec)
        specs[ckey] = spec
        by_config[ckey][spec["seed"]] = rows
    return {k: Config(specs[k], by_config[k]) for k in by_config}


class Study:
    """The finished runs, read against the protocol that planned them."""

    def __init__(self, protocol: study.Protocol, runs: dict[str, list[dict]]):
        self.p = protocol
        self.configs = load(runs)
        self.done = study.final_losses(runs)
        self.base = {t: study.ar_optimum(protocol, t, self.done) for t in protocol.methods}

    def get(self, spec: dict) -> Config | None:
        return self.configs.get(study.config_key(spec))

    def reference(self, c: Config) -> Config | None:
        """All-Reduce at the same task, workers and global batch, at its designated rate
        (the optimum, scaled linearly with the global batch in weak scaling)."""
        base = self.base.get(c.spec["task"])
        if base is None:
            return None
        gb = c.spec["global_batch"]
        lr = base * gb / self.p.global_batch
        return self.get(
            study.make_spec(self.p, c.spec["task"], c.spec["workers"], "allreduce", lr, 0, gb)
        )

    def gap(self, c: Config, step: int | None = None) -> tuple[float, float] | None:
        """Relative gap of the validation loss to All-Reduce in %, mean and std over the seeds
        both have (the same seed: the same initial model and batch streams)."""
        ref = self.reference(c)
        if ref is None:
            return None
        seeds = [s for s in c.seeds if s in ref.runs]
        if not seeds:
            return None
        if step is None:
            values = [100 * (c.final(s) / ref.final(s) - 1) for s in seeds]
        else:
            values = [100 * (c.at(s, step) / ref.at(s, step) - 1) for s in seeds]
        return study.mean_std(values)

    def diloco(self, c: Config) -> Config | None:
        """The best DiLoCo with all-reduce at the same H as the local-steps run ``c`` (same
        task, workers and batch; lowest mean final loss over ``c``'s seeds) among those that ran
        every seed ``c`` ran: at DiLoCo's published outer rate or a swept one."""
        s, name = c.spec, study.diloco_twin(c.spec["method"])
        if name is None:
            return None
        same_h = [
            d
            for d in self.configs.values()
            if d.spec["method"].split(":")[:2] == name.split(":")
            and all(d.spec[k] == s[k] for k in ("task", "workers", "global_batch"))
            and set(c.seeds) <= set(d.seeds)
        ]
        return min(
            same_h, key=lambda d: statistics.fmean(d.final(x) for x in c.seeds), default=None
        )

    def exact(self, c: Config) -> Config | None:
        """The same run with exact (uncompressed) gossip."""
        s = c.spec
        name = study.uncompressed(s["method"])
        return self.get(
            study.make_spec(self.p, s["task"], s["workers"], name, s["lr"], 0, s["global_batch"])
        )

    def tuned(self, task: str, workers: int, method: str) -> Config | None:
        factor = study.best_factor(self.p, task, workers, method, self.done)
        base = self.base[task]
        if factor is None or base is None:
            return None
        return self.get(study.make_spec(self.p, task, workers, method, factor * base, 0))

    def part(self, c: Config) -> str:
        """Which part of the study a configuration belongs to (first match)."""
        s = c.spec
        for stage in ("seeds", "sweep", "ar-lr", "weak", "big", "knobs", "compressed", "local"):
            keys = {study.config_key(x) for x in study.plan(self.p, stage, self.done)}
            if study.config_key(s) in keys:
                if stage in ("seeds", "sweep"):
                    tuned = self.tuned(s["task"], s["workers"], s["method"])
                    return "tuned" if tuned is c else "lr sweep"
                return stage
        return "other"


def fmt_loss(c: Config) -> str:
    mean, std = study.mean_std(c.final(s) for s in c.seeds)
    return f"{mean:.4f}" if len(c.seeds) < 2 else f"{mean:.4f} ± {std:.4f}"


def fmt_gap(g: tuple[float, float] | None, seeds: int) -> str:
    if g is None:
        return ""
    return f"{g[0]:+.2f}%" if seeds < 2 else f"{g[0]:+.2f} ± {g[1]:.2f}%"


def label(c: Config) -> str:
    topo = "" if c.method.topology == "all-reduce" else f", {c.spec['topology']}"
    return c.method.label + topo


def md_table(header: list[str], rows: list[list[Any]], path: Path | None = None) -> list[str]:
    """The table as markdown lines; also written to ``path`` as CSV (for the docs), if given."""
    if path is not None:
        path.parent.mkdir(exist_ok=True)
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            writer.writerows([str(v).replace("**", "") for v in r] for r in rows)
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(v) for v in r) + " |" for r in rows]
    return out + [""]


def summary_rows(st: Study) -> list[dict]:
    out = []
    for c in sorted(st.configs.values(), key=lambda c: _order(st, c)):
        g = st.gap(c)
        base = st.base.get(c.spec["task"])
        acc = statistics.fmean(c.final(s, "val_acc") for s in c.seeds)
        d2c = statistics.fmean(c.final(s, "consensus_distance") for s in c.seeds)
        out.append(
            {
                "task": c.spec["task"], "part": st.part(c), "workers": c.spec["workers"],
                "global batch": c.spec["global_batch"],
                "local batch": c.spec["global_batch"] // c.spec["workers"],
                "method": c.spec["method"], "optimizer": c.method.label,
                "topology": c.spec["topology"], "beta2": f"{c.spec['beta2']:.4g}",
                "accum_iter": c.spec["accum_iter"], "lr": f"{c.spec['lr']:g}",
                "lr factor": "" if base is None else f"{c.spec['lr'] / base:.3g}",
                "warm-up": c.spec["warmup"], "steps": c.spec["steps"], "seeds": len(c.seeds),
                "val loss": fmt_loss(c), "vs All-Reduce": fmt_gap(g, len(c.seeds)),
                "val acc": f"{acc:.4f}", "consensus distance": f"{d2c:.3g}",
            }
        )  # fmt: skip
    return out


def _order(st: Study, c: Config) -> tuple:
    s = c.spec
    methods = st.p.methods.get(s["task"], ())
    rank = methods.index(s["method"]) if s["method"] in methods else len(methods)
    return (
        s["task"],
        s["global_batch"] != st.p.global_batch,
        s["workers"],
        rank,
        s["method"],
        s["lr"],
    )


def main_table(st: Study, task: str, tables: Path) -> list[str]:
    counts = sorted(st.p.seeds[task])
    header = ["method"] + [f"{n} workers (local batch {st.p.global_batch // n})" for n in counts]
    rows = []
    for method in st.p.methods[task]:
        cells, name = [], None
        for n in counts:
            c = st.tuned(task, n, method)
            if c is None:
                cells.append("")
                continue
            name = label(c)
            factor = c.spec["lr"] / st.base[task]  # type: ignore[operator]
            g = st.gap(c)
            gap = "" if method == "allreduce" else f" ({fmt_gap(g, len(c.seeds))})"
            cells.append(f"{fmt_loss(c)}{gap}, lr x{factor:g}, {len(c.seeds)} seeds")
        if name:
            rows.append([name] + cells)
    return md_table(header, rows, tables / f"main_{task}.csv")


def gap_table(st: Study, task: str, tables: Path) -> list[str]:
    """The main table reduced to the gaps at the last step (and the rate factor used)."""
    counts = sorted(st.p.seeds[task])
    header = ["method"] + [f"{n} workers" for n in counts]
    rows = []
    for method in st.p.methods[task][1:]:
        cells, name = [], None
        for n in counts:
            c = st.tuned(task, n, method)
            if c is None:
                cells.append("")
                continue
            name = label(c)
            factor = c.spec["lr"] / st.base[task]  # type: ignore[operator]
            cells.append(f"{fmt_gap(st.gap(c), len(c.seeds))} (lr x{factor:g})")
        if name:
            rows.append([name] + cells)
    return md_table(header, rows, tables / f"gaps_{task}.csv")


def gap_by_step(st: Study, task: str, tables: Path) -> list[str]:
    out = []
    for n in sorted(st.p.seeds[task]):
        rows, steps = [], None
        for method in st.p.methods[task][1:]:
            c = st.tuned(task, n, method)
            if c is None or st.reference(c) is None:
                continue
            steps = steps or c.curve("val_loss")[0]
            rows.append(
                [label(c), len(c.seeds)]
                + [fmt_gap(st.gap(c, step), len(c.seeds)) for step in steps]
            )
        if rows and steps:
            out += [f"**{n} workers**", ""]
            header = ["method", "seeds"] + [f"step {s}" for s in steps]
            out += md_table(header, rows, tables / f"gap_by_step_{task}_{n}.csv")
    return out


def sweep_table(st: Study, task: str, tables: Path) -> list[str]:
    base = st.base[task]
    out = []
    ar = [
        st.get(study.make_spec(st.p, task, st.p.ar_workers, "allreduce", lr, 0))
        for lr in st.p.ar_lrs[task]
    ]
    if all(ar):
        out += [f"All-Reduce ({st.p.ar_workers} workers, seed 0): final validation loss", ""]
        best = min(ar, key=lambda c: c.final(0))  # type: ignore[union-attr]
        cells = [
            f"**{c.final(0):.4f}**" if c is best else f"{c.final(0):.4f}"  # type: ignore[union-attr]
            for c in ar
        ]
        header = [f"lr {lr:g}" for lr in st.p.ar_lrs[task]]
        out += md_table(header, [cells], tables / f"lr_sweep_{task}_allreduce.csv")
    if base is None:
        return out
    out += [
        f"Every method at factor x {base:g} (All-Reduce's optimum), seed 0: final validation "
        "loss, the best in bold",
        "",
    ]
    for n in sorted(st.p.seeds[task]):
        rows = []
        for method in st.p.methods[task][1:]:
            cs = [st.get(s) for s in study.sweep_specs(st.p, task, n, method, base)]
            if not all(cs):
                continue
            best = min(cs, key=lambda c: c.final(0))  # type: ignore[union-attr]
            rows.append(
                [label(cs[0])]  # type: ignore[arg-type]
                + [f"**{c.final(0):.4f}**" if c is best else f"{c.final(0):.4f}" for c in cs]  # type: ignore[union-attr]
            )
        if rows:
            out += [f"**{n} workers**", ""]
            header = ["method"] + [f"x{k:g}" for k in study.factors(st.p, task, n)]
            out += md_table(header, rows, tables / f"lr_sweep_{task}_{n}.csv")
    return out


def part_table(st: Study, part: str, tables: Path) -> list[str]:
    rows = []
    for c in sorted(st.configs.values(), key=lambda c: _order(st, c)):
        if st.part(c) != part:
            continue
        base = st.base[c.spec["task"]]
        rows.append(
            [
                c.spec["workers"], c.spec["global_batch"], c.spec["global_batch"] // c.spec["workers"],
                label(c), f"{c.spec['lr']:g} (x{c.spec['lr'] / base:.3g})", c.spec["warmup"],
                len(c.seeds), fmt_loss(c),
                "" if c.method.optimizer == "allreduce" else fmt_gap(st.gap(c), len(c.seeds)),
                f"{statistics.fmean(c.final(s, 'consensus_distance') for s in c.seeds):.3g}",
            ]
        )  # fmt: skip
    header = [
        "workers", "global batch", "local batch", "method", "lr (x optimum)", "warm-up", "seeds",
        "val loss", "vs All-Reduce", "consensus distance",
    ]  # fmt: skip
    return md_table(header, rows, tables / f"{part}.csv") if rows else []


def compressed_table(st: Study, tables: Path) -> list[str]:
    """Compressed gossip against the same method's exact gossip, paired by seed (same initial
    model, same batches), with the issue's target per worker count."""
    rows = []
    for c in sorted(st.configs.values(), key=lambda c: _order(st, c)):
        exact = st.exact(c) if c.method.compression else None
        seeds = [s for s in c.seeds if exact is not None and s in exact.runs]
        if exact is None or not seeds:
            continue
        gap = study.mean_std(100 * (c.final(s) / exact.final(s) - 1) for s in seeds)
        target = st.p.compressed_targets.get(c.spec["workers"])
        rows.append(
            [
                c.spec["workers"], label(c), f"{c.spec['lr']:g}", c.spec["warmup"],
                " ".join(map(str, seeds)), fmt_loss(c), fmt_loss(exact),
                fmt_gap(gap, len(seeds)), "" if target is None else f"<= {target:g}%",
                "" if target is None else ("yes" if gap[0] <= target else "no"),
                fmt_gap(st.gap(c), len(c.seeds)), fmt_gap(st.gap(exact), len(exact.seeds)),
                f"{statistics.fmean(c.final(s, 'consensus_distance') for s in c.seeds):.3g}",
            ]
        )  # fmt: skip
    header = [
        "workers", "method", "lr", "warm-up", "seeds", "val loss", "exact: val loss",
        "vs exact", "target", "met", "vs All-Reduce", "exact: vs All-Reduce",
        "consensus distance",
    ]  # fmt: skip
    return md_table(header, rows, tables / "compressed.csv") if rows else []


def paired_gap(c: Config, ref: Config | None) -> tuple[tuple[float, float], int] | None:
    """(mean, std) over the seeds both ran of the relative gap of ``c``'s final loss to
    ``ref``'s, in %, and how many seeds that is."""
    seeds = [] if ref is None else [s for s in c.seeds if s in ref.runs]
    if ref is None or not seeds:
        return None
    return study.mean_std(100 * (c.final(s) / ref.final(s) - 1) for s in seeds), len(seeds)


def local_table(st: Study, tables: Path) -> list[str]:
    """Local steps and DiLoCo (the ``local`` stage): final loss, and its gaps to All-Reduce and
    to DiLoCo at the same H, each paired by seed (same initial model, same batches)."""
    order = list(dict.fromkeys(entry[2] for entry in st.p.local))  # the protocol's order
    local = [c for c in st.configs.values() if st.part(c) == "local"]
    rows = []
    for c in sorted(
        local, key=lambda c: (c.spec["workers"], order.index(c.spec["method"]), c.spec["lr"])
    ):
        base = st.base[c.spec["task"]]
        twin = st.diloco(c)
        cells = []
        for ref in (st.reference(c), twin):
            g = paired_gap(c, ref)
            cells.append("" if g is None else fmt_gap(*g))
        if twin is not None and cells[1]:
            plain = ", no momentum" if twin.method.outer_momentum == 0 else ""
            cells[1] += f" (outer lr {twin.method.outer_lr:g}{plain}, x{twin.spec['lr'] / base:g})"
        rows.append(
            [
                c.spec["workers"], label(c), f"{c.spec['lr']:g} (x{c.spec['lr'] / base:.3g})",
                " ".join(map(str, c.seeds)), fmt_loss(c), *cells,
                f"{statistics.fmean(c.final(s, 'consensus_distance') for s in c.seeds):.3g}",
            ]
        )  # fmt: skip
    header = [
        "workers", "method", "lr (x optimum)", "seeds", "val loss", "vs All-Reduce",
        "vs best DiLoCo, same H", "consensus distance",
    ]  # fmt: skip
    return md_table(header, rows, tables / "local.csv") if rows else []


def recommended(st: Study) -> list[dict]:
    """Per task and worker count (strong scaling and 32 workers), every decentralized method
    that got all the seeds, at its tuned rate: its gap to All-Reduce and the issue's target.
    The docs' table of recommended settings cites these rows."""
    out = []
    for task in st.p.methods:
        counts = sorted(st.p.seeds[task]) + (list(st.p.big_workers) if task == "charlm" else [])
        for n in counts:
            for method in st.p.seeded[task]:
                if method == "allreduce":
                    continue
                if n in st.p.big_workers:
                    specs = study.big_specs(st.p, st.base[task], st.done) if st.base[task] else []
                    c = next(
                        (st.get(s) for s in specs if s["workers"] == n and s["method"] == method),
                        None,
                    )
                else:
                    c = st.tuned(task, n, method)
                g = None if c is None else st.gap(c)
                if c is None or g is None:
                    continue
                target = st.p.targets.get(n) if task == "charlm" else None
                out.append(
                    {
                        "task": task, "workers": n, "local batch": st.p.global_batch // n,
                        "optimizer": "DecentralizedAdamW" if c.method.optimizer == "adamw" else "AccumAdamW",
                        "beta2": f"{c.spec['beta2']:.4g}",
                        "accum_iter": c.spec["accum_iter"] if c.method.optimizer == "accumadamw" else "",
                        "lr factor": f"{c.spec['lr'] / st.base[task]:g}",  # type: ignore[operator]
                        "warm-up": c.spec["warmup"], "topology": c.spec["topology"],
                        "seeds": len(c.seeds), "gap to All-Reduce": fmt_gap(g, len(c.seeds)),
                        "target": "" if target is None else f"<= {target:g}%",
                        "met": "" if target is None else ("yes" if g[0] <= target else "no"),
                    }
                )  # fmt: skip
    return out


def write_csv(rows: list[dict], path: Path) -> None:
    if not rows:
        return
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write_all(
    protocol: study.Protocol, runs: dict[str, list[dict]], out: Path, plots: bool = True
) -> None:
    st = Study(protocol, runs)
    tables = out / "tables"
    write_csv(summary_rows(st), out / "summary.csv")
    write_csv(recommended(st), out / "recommended.csv")
    lines = [
        "# Convergence study v2: results",
        "",
        "Generated by `experiments/convergence/run.py` from `runs.csv`; final validation loss of",
        "the consensus model, mean ± standard deviation over seeds; gaps to All-Reduce are paired",
        "by seed (same initial model, same batches). See README.md for the protocol.",
        "",
    ]
    for task in protocol.methods:
        lines += [f"## {task}: every method at its tuned learning rate", ""]
        lines += main_table(st, task, tables)
        lines += [f"### {task}: gap to All-Reduce at the last step, mean ± std over seeds", ""]
        lines += gap_table(st, task, tables)
        lines += [f"### {task}: gap to All-Reduce at every evaluation step", ""]
        lines += gap_by_step(st, task, tables)
        lines += [f"### {task}: learning-rate sweeps", ""]
        lines += sweep_table(st, task, tables)
    for part, title in (
        ("weak", "Weak scaling (charlm): local batch 8, linear learning-rate scaling"),
        ("big", "32 workers (charlm), local batch 1, at the factors tuned for 16 workers"),
        ("knobs", "Investigations (knobs)"),
    ):
        table = part_table(st, part, tables)
        if table:
            lines += [f"## {title}", ""] + table
    table = compressed_table(st, tables)
    if table:
        lines += ["## Compressed vs exact gossip (charlm), paired by seed", ""] + table
    table = local_table(st, tables)
    if table:
        lines += ["## Local steps vs DiLoCo with all-reduce (charlm), paired by seed", ""] + table
    (out / "summary.md").write_text("\n".join(lines))
    print(f"wrote {out / 'summary.md'}, summary.csv, recommended.csv")
    if plots:
        for path in plot_all(st, out):
            print(f"wrote {path}")


# -- plots --------------------------------------------------------------------------------------
COLORS = {"allreduce": "black", "adamw": "C0", "accum98": "C3", "accum95": "C1", "accum^s": "C2"}
STYLES = {"ring": ":", "aer": "-", "ope": "--", "complete": "-."}


def _style(method: str) -> dict:
    family, _, rest = method.partition(":")
    topology = rest.split(":")[0] if rest else "aer"
    return dict(color=COLORS.get(family, "C7"), linestyle=STYLES.get(topology, "-"))


def plot_all(st: Study, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for task in st.p.methods:
        counts = [n for n in sorted(st.p.seeds[task]) if st.tuned(task, n, "allreduce")]
        if not counts:
            continue
        fig, axes = plt.subplots(
            3, len(counts), figsize=(4.8 * len(counts), 9.5), squeeze=False, sharex=True
        )
        for col, n in enumerate(counts):
            ref = st.tuned(task, n, "allreduce")
            for method in st.p.methods[task]:
                c = st.tuned(task, n, method)
                if c is None:
                    continue
                steps, val = c.curve("val_loss")
                name = f"{label(c)} (x{c.spec['lr'] / st.base[task]:g}, {len(c.seeds)} seeds)"  # type: ignore[operator]
                axes[0][col].plot(steps, val, label=name, **_style(method))
                if c is not ref:
                    gaps = [st.gap(c, s) for s in steps]
                    axes[1][col].plot(
                        steps, [g[0] if g else float("nan") for g in gaps], **_style(method)
                    )
                    axes[2][col].plot(*c.curve("consensus_distance"), **_style(method))
            axes[0][col].set_title(f"{task}: {n} workers, local batch {st.p.global_batch // n}")
            axes[0][col].set_yscale("log")
            axes[1][col].axhline(0, color="black", linewidth=0.8)
            axes[1][col].axhspan(-1, 1, color="0.9", zorder=0)
            axes[1][col].set_yscale("symlog", linthresh=2)  # the early gaps are tens of percent
            axes[2][col].set_yscale("log")
            axes[2][col].set_xlabel("step")
            for ax in axes[:, col]:
                ax.grid(alpha=0.3, which="both")
            axes[0][col].legend(fontsize=6)
        axes[0][0].set_ylabel("validation loss (consensus model)")
        axes[1][0].set_ylabel("gap to All-Reduce, % (symlog; band: ±1%)")
        axes[2][0].set_ylabel("consensus distance (RMS over workers)")
        fig.tight_layout()
        path = out / f"val_loss_{task}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
        written += plot_sweep(st, task, out, plt)
    return written


def plot_sweep(st: Study, task: str, out: Path, plt: Any) -> list[Path]:
    base = st.base[task]
    if base is None:
        return []
    counts = sorted(st.p.seeds[task])
    fig, axes = plt.subplots(
        1, len(counts) + 1, figsize=(4.2 * (len(counts) + 1), 3.8), squeeze=False
    )
    ar = [
        (lr, st.get(study.make_spec(st.p, task, st.p.ar_workers, "allreduce", lr, 0)))
        for lr in st.p.ar_lrs[task]
    ]
    ar = [(lr / base, c) for lr, c in ar if c is not None]
    axes[0][0].plot([k for k, _ in ar], [c.final(0) for _, c in ar], "o-", color="black")
    axes[0][0].set_title(f"All-Reduce, {st.p.ar_workers} workers (optimum lr {base:g})")
    for col, n in enumerate(counts, 1):
        for method in st.p.methods[task][1:]:
            cs = [
                (k, st.get(s))
                for k, s in zip(
                    study.factors(st.p, task, n), study.sweep_specs(st.p, task, n, method, base)
                )
            ]
            cs = [(k, c) for k, c in cs if c is not None]
            if cs:
                axes[0][col].plot(
                    [k for k, _ in cs],
                    [c.final(0) for _, c in cs],
                    "o",
                    label=label(cs[0][1]),
                    **_style(method),
                )
        ref = st.tuned(task, n, "allreduce")
        if ref is not None:
            axes[0][col].axhline(
                ref.final(0), color="black", linewidth=0.8, label="All-Reduce at its optimum"
            )
        axes[0][col].set_title(f"{n} workers")
        if axes[0][col].get_legend_handles_labels()[0]:
            axes[0][col].legend(fontsize=5)
    for ax in axes[0]:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("learning rate / All-Reduce's optimum")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel(f"validation loss at step {st.p.steps} (seed 0)")
    fig.tight_layout()
    path = out / f"lr_sweep_{task}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]
