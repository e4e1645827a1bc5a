"""The time-to-quality harness's report: tables and plots over the results of several runs.

    python benchmarks/report.py TAG [TAG ...] [--losses 0.6,0.5] [--versus METHOD] [--plot DIR]

TAG names ``benchmarks/results/ttq_<TAG>.json`` (quoted shell patterns allowed). Runs are grouped
by link (rate or regime R), shape and seed; in a group each run is one hardware (even, half,
quarter, jitter), and a method given by several tags on one hardware is the first tag's. Per
group, a table of each method's time to DDP's final held-out loss (DDP's: its training time)
over ``--versus``'s and over its own on even hardware, with steps, ms per step, final loss and
bytes per step against DDP's; ``--losses`` adds the time to each loss:

.. math::
    t_m(\\ell) = \\min\\{\\, s_k : \\ell_k \\le \\ell \\,\\}, \\qquad
    \\text{vs } V = t_m(\\ell) / t_V(\\ell), \\qquad
    \\text{vs even} = t_m^{hw}(\\ell) / t_m^{even}(\\ell),

over the evaluations :math:`(s_k, \\ell_k)` (seconds, held-out loss); ``...:fixed`` is compared
with its even run without the suffix. ``--plot DIR``: held-out loss against wall-clock,
``DIR/ttq_<link>_<shape>.png``, a panel per hardware and seed. ``--compose Q T [Q T ...]``, for
step-locked methods: the time to a loss = Q's steps to it x T's seconds per step; the two runs
must train alike (``ALIKE``) but in what ``--may-differ`` names (``MAY_DIFFER``); ``:uneven`` and
``:hetero`` are refused.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import methods

RESULTS = Path(__file__).resolve().parent / "results"
HARDWARE = ("even", "half", "quarter", "jitter")


def _argv(meta: dict, flag: str, default: str) -> str:
    argv = meta.get("argv", [])
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else default


def describe(meta: dict) -> tuple[str, str, int, str]:
    """(link, shape, seed, hardware) of a run: its record, or (older runs) its tag and argv."""
    row = meta["rows"][0]
    local = row.get("local_world_size") or 1
    shape = meta.get("shape") or f"{row['world_size'] // local}x{local}"
    link = meta.get("link") or meta["tag"].split("_")[0]
    seed = int(meta.get("seed", _argv(meta, "--seed", "0")))
    hardware = meta.get("hardware")
    if hardware is None:
        speeds = [float(s) for s in _argv(meta, "--speeds", "").split(",") if s]
        slow = {0.5: "half", 0.25: "quarter"}
        if speeds and min(speeds) < 1:
            hardware = slow.get(min(speeds), "speeds " + ",".join(f"{s:g}" for s in speeds))
        else:
            hardware = "jitter" if float(_argv(meta, "--jitter-cv", "0")) else "even"
    return link, shape, seed, hardware


def add_run(groups: dict, meta: dict) -> None:
    """One run into ``groups``; a method already there on the same hardware stays."""
    link, shape, seed, hw = describe(meta)
    run = groups.setdefault((link, shape, seed), {}).setdefault(hw, {"rows": {}, "load": meta["loadavg"]})  # fmt: skip
    for r in meta["rows"]:
        run["rows"].setdefault(r["method"], r)


def _paths(tag: str, results: Path) -> list[Path]:
    if not (paths := sorted(results.glob(f"ttq_{tag}.json"))):
        raise SystemExit(f"no results {results}/ttq_{tag}.json")
    return paths


def load(tags: list[str], results: Path = RESULTS) -> dict:
    """{(link, shape, seed): {hardware: {"rows": {method: row}, "load": loadavg}}}."""
    groups: dict = {}
    for path in (p for tag in tags for p in _paths(tag, results)):
        add_run(groups, json.loads(path.read_text()))
    order = {h: i for i, h in enumerate(HARDWARE)}
    return {k: dict(sorted(v.items(), key=lambda kv: order.get(kv[0], 9))) for k, v in groups.items()}  # fmt: skip


def time_to(row: dict | None, loss: float | None) -> float | None:
    """Seconds to ``loss`` (None: the run's target, DDP's final loss; DDP: its training time)."""
    if row is not None and loss is None and row["method"] == "ddp":
        return row["train_s"]
    loss = row["target"] if row is not None and loss is None else loss
    return None if row is None or loss is None else next(
        (c["train_s"] for c in row["curve"] if c["val_loss"] <= loss), None)  # fmt: skip


def _ratio(t: float | None, base: float | None) -> str:
    return "-" if t is None or not base else f"{t / base:.2f}x"


def _even(group: dict, method: str) -> dict | None:
    rows = group.get("even", {}).get("rows", {})
    return rows.get(method) or rows.get(method.removesuffix(":fixed"))


def _each(group: dict):
    """(method, hardware, run, row) of a group, by method first, then hardware."""
    for method in dict.fromkeys(m for run in group.values() for m in run["rows"]):
        yield from ((method, hw, run, run["rows"][method]) for hw, run in group.items()
                    if method in run["rows"])  # fmt: skip


def table(key: tuple, group: dict, versus: str | None) -> str:
    link, shape, seed = key
    loads = ", ".join(f"{hw} {run['load'][0]:.1f}" for hw, run in group.items())
    uneven = "even" in group and len(group) > 1
    head = ["method", "hardware", "time to DDP's loss", *(["vs V"] if versus else []),
            *(["vs even"] if uneven else []), "steps", "ms / step", "final loss", "vs DDP", "bytes / step vs DDP"]  # fmt: skip
    lines = [f"{link}, {shape}, seed {seed} (load average at the end: {loads})"
             + (f"; V = {versus}" if versus else ""), "",
             "| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]  # fmt: skip
    for method, hw, run, row in _each(group):
        ddp = run["rows"].get("ddp")
        t = time_to(row, None)
        cells = [f"{t:.1f} s" if t is not None else f"not reached ({row['train_s']:.0f} s)"]
        if versus:
            cells.append(_ratio(t, time_to(run["rows"].get(versus), None)))
        if uneven:
            cells.append("-" if hw == "even" else _ratio(t, time_to(_even(group, method), None)))  # fmt: skip
        cells += [str(row["steps"]), f"{row['ms_per_step']:.1f}", f"{row['final_loss']:.4f}"]
        cells.append(f"{(row['final_loss'] / ddp['final_loss'] - 1) * 100:+.2f}%" if ddp else "-")  # fmt: skip
        base = (ddp or {}).get("bytes_per_step")
        wire = ["-" if not (b and base) or row is ddp else f"1/{base / b:.0f}" if b <= base
                else f"{b / base:.1f}x"  # more than DDP (a complete topology)
                for b in (row.get("bytes_per_step"), row.get("bytes_per_step_after_first_eval"))]  # fmt: skip
        cells.append(wire[0] + (f" ({wire[1]} after the first evaluation)" if wire[1] != "-" else ""))  # fmt: skip
        lines.append(f"| {method} | {hw} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def at_losses(group: dict, losses: list[float], versus: str | None) -> str:
    """Time to each loss, with its ratio to ``versus`` and to the same method on even hardware."""
    lines = ["| method | hardware | " + " | ".join(f"to {x:g}" for x in losses) + " | final |",
             "|---|---|" + "---:|" * (len(losses) + 1)]  # fmt: skip
    for method, hw, run, row in _each(group):
        cells = []
        for loss in losses:
            t = time_to(row, loss)
            why = []
            if versus and method != versus:
                why.append(_ratio(t, time_to(run["rows"].get(versus), loss)) + " V")
            if hw != "even":
                why.append(_ratio(t, time_to(_even(group, method), loss)) + " even")
            cells.append("-" if t is None else f"{t:.1f} s" + (f" ({', '.join(why)})" if why else ""))  # fmt: skip
        lines.append(f"| {method} | {hw} | " + " | ".join(cells) + f" | {row['final_loss']:.4f} |")  # fmt: skip
    return "\n".join(lines)


def plot(groups: dict, out: Path) -> list[Path]:
    """One PNG per (link, shape): held-out loss against training seconds, a panel per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for link, shape in dict.fromkeys((k[0], k[1]) for k in groups):
        panels = [(seed, hw, run) for (li, sh, seed), group in groups.items()
                  if (li, sh) == (link, shape) for hw, run in group.items()]  # fmt: skip
        fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
        names = dict.fromkeys(m for *_, run in panels for m in run["rows"] if m != "ddp")
        color = dict(zip(names, plt.get_cmap("tab20").colors), ddp="k")  # a method's, every panel
        for ax, (seed, hw, run) in zip(axes[0], panels):
            for method, r in run["rows"].items():
                ax.plot([c["train_s"] for c in r["curve"]], [c["val_loss"] for c in r["curve"]],
                        color=color[method], lw=2 if method == "ddp" else 1.2, label=method,
                        ls="--" if method.startswith("diloco") else "-")  # fmt: skip
            if target := run["rows"].get("ddp", {}).get("final_loss"):
                ax.axhline(target, color="k", lw=0.8, ls=":", label="DDP's final loss")
                ax.set_ylim(0.97 * target, 1.3 * target)  # the approach to it is what matters
            ax.set(title=f"{link}, {shape}, {hw}, seed {seed}", ylabel="held-out loss (consensus)",
                   xlabel="training wall-clock s (evaluation excluded)")  # fmt: skip
            ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(out / f"ttq_{link}_{shape}.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


ALIKE = {"--workload": "char", "--steps": "1200", "--warmup": "240", "--global-batch": "32",
         "--lr": "6e-3", "--decent-lr-factor": "2", "--local-world-size": "0", "--device-ms": "0"}  # fmt: skip


def _alike(meta: dict) -> dict:
    """What a --compose pair must share: the runner's flags (its defaults), seed and ranks."""
    row, out = meta["rows"][0], {"--seed": describe(meta)[2]}
    out.update({f: float(v) if (v := _argv(meta, f, d)).replace(".", "").replace("e-", "").isdigit() else v
                for f, d in ALIKE.items()})  # fmt: skip
    return {**out, "--local-world-size": out["--local-world-size"] or row["local_world_size"],
            "ranks": row["world_size"]}  # fmt: skip


def s_per_step(row: dict, upto: int) -> float:
    """Seconds per step from the first clock reading past the first period to ``upto`` (0: last)."""
    c, first = row["curve"], methods.period(row["method"])
    c0 = next((x for x in c[:-1] if x["step"] >= first), {"step": 0, "train_s": 0.0})
    c1 = next((x for x in c if upto and x["step"] >= max(upto, c0["step"] + 1)), c[-1])
    return (c1["train_s"] - c0["train_s"]) / (c1["step"] - c0["step"])


def _pooled(tags: str, results: Path) -> dict:
    """One side of a --compose pair: a run, or runs joined by "+" with pooled rows (a method in
    several: the first run's). They must train alike but for the ranks per node: from a run with
    another count than the first's, only ``methods.node_blind`` methods (DDP's 2x2 rows for 4x1)."""
    names = tags.split("+")
    metas = [json.loads(_paths(x, results)[0].read_text()) for x in names]
    a, nodes, rows = _alike(metas[0]), "--local-world-size", {}
    for name, meta in zip(names, metas):
        b = _alike(meta)
        if differ := [f for f in a if a[f] != b.get(f) and f != nodes]:
            raise SystemExit(f"--compose {tags}: {name} trains otherwise ({differ})")
        for r in meta["rows"]:
            if a[nodes] == b[nodes] or methods.node_blind(r["method"]):
                rows.setdefault(r["method"], r)
    ddp_first = sorted(rows.values(), key=lambda r: r["method"] != "ddp")
    return {**metas[0], "tag": tags, "rows": ddp_first}


# what a step-locked method's steps to a loss (the quality side) or its seconds per step (the
# timing side) do not depend on, so a pair may differ in it when the user says so
MAY_DIFFER = ("--device-ms", "--seed")


def compose(
    quality: dict, timing: dict, upto: int = 0, may_differ: tuple = ()
) -> tuple[dict, list[str]]:
    """Q's rows at T's seconds per step, and the table's lines (measured: T's time, if a full run).
    ``may_differ``: flags of ``MAY_DIFFER`` the pair need not share."""
    alike, other = _alike(quality), _alike(timing)
    for flag in (f for f in alike if alike[f] != other[f] and f not in may_differ):
        raise SystemExit(f"--compose {quality['tag']} {timing['tag']}: {flag} differs ("
                         f"{alike[flag]} vs {other[flag]}): both runs must train the same "
                         "workload, schedule, global batch and seed on as many ranks")  # fmt: skip
    q, t = ({r["method"]: r for r in m["rows"]} for m in (quality, timing))
    rows, notes, lines = {}, [], ["| method | steps to DDP's loss | s / step | composed time | "
                                  "measured | error |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for method in dict.fromkeys([*q, *t]):
        side, unlocked = "timing" if method in q else "quality", methods.not_step_locked(method)
        why = (f"refused, not step-locked ({unlocked}): its time to quality needs a full run"
               if unlocked else f"missing from the {side} run (or DDP, the target, is)")  # fmt: skip
        if unlocked or method not in q or method not in t or "ddp" not in q:
            notes.append(f"* {method}: {why}")
            continue
        sps, row = s_per_step(t[method], upto), q[method]
        rows[method] = row = {**row, "target": q["ddp"]["final_loss"], "train_s": row["steps"] * sps,
                              "curve": [{**c, "train_s": c["step"] * sps} for c in row["curve"]]}  # fmt: skip
        took = time_to(row, None)
        full = None if t[method].get("kind") == "timing" else time_to(t[method], None)
        cells = [f"{took / sps:.0f}", f"{sps:.4f}", f"{took:.1f} s"] if took else [
            f"not reached in {row['steps']}", f"{sps:.4f}", "-"]  # fmt: skip
        err = f"{(took / full - 1) * 100:+.1f}%" if full and took else "-"
        cells += [f"{full:.1f} s" if full else "-", err]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return rows, lines + [""] * bool(notes) + notes


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tags", nargs="+", help="results ttq_<TAG>.json (shell patterns allowed)")
    p.add_argument("--losses", default="", help="comma-separated: the time to each loss too")
    p.add_argument("--versus", default=None, help="a method: each time over its time")
    p.add_argument("--plot", default=None, help="a folder: write the plots there")
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument("--compose", action="store_true", help="TAG pairs QUALITY TIMING: each "
                   "method's steps to a loss x its seconds per step (step-locked methods); "
                   "a side may pool runs: TAG+TAG")  # fmt: skip
    p.add_argument("--timing-window", type=int, default=0, help="--compose with a full run as "
                   "the timing: its s / step up to this step, as a timing run's (0: to its end)")  # fmt: skip
    p.add_argument("--may-differ", default="", help="--compose: flags the pairs need not share, "
                   "comma-separated: --device-ms (steps to a loss do not depend on it), --seed "
                   "(a step-locked method's s / step does not)")  # fmt: skip
    args = p.parse_args(argv)
    losses, groups = [float(x) for x in args.losses.split(",") if x], {}
    may_differ = tuple("--" + x.lstrip("-") for x in args.may_differ.split(",") if x)
    if bad := [x for x in may_differ if x not in MAY_DIFFER]:
        raise SystemExit(f"--may-differ {','.join(bad)}: only {', '.join(MAY_DIFFER)} may differ")
    if args.compose and len(args.tags) % 2:
        raise SystemExit("--compose takes pairs of tags: QUALITY TIMING [QUALITY TIMING ...]")
    if args.compose:
        for qt, tt in zip(args.tags[::2], args.tags[1::2]):
            metas = [_pooled(x, Path(args.results)) for x in (qt, tt)]
            rows, lines = compose(*metas, args.timing_window, may_differ)
            (link, shape, _, hw), seed = describe(metas[1]), describe(metas[0])[2]  # Q's steps
            group = groups[(f"{link}-composed", shape, seed)] = {hw: {"rows": rows, "load": [0.0]}}
            print(f"composed: steps from {qt} x seconds per step from {tt}\n", *lines, sep="\n")
            print(*["", at_losses(group, losses, None)] if losses else [], sep="\n")
    else:
        groups = load(args.tags, Path(args.results))
        for key, group in groups.items():
            print(table(key, group, args.versus) + "\n")
            if losses:
                print(at_losses(group, losses, args.versus) + "\n")
    for path in plot(groups, Path(args.plot)) if args.plot else []:
        print("wrote", path)


if __name__ == "__main__":
    main()
