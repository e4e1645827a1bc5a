"""What ``python -m decent_optim.plan`` prints from its measurements (no torch needed).

:func:`predict` turns the measured dict of :func:`decent_optim.plan.measure` into the
:mod:`decent_optim.runtime` predictions, :func:`format_table` prints them and :func:`as_json`
is what ``--json`` writes.
"""

from __future__ import annotations

from collections.abc import Sequence

from decent_optim import runtime

__all__ = ["as_json", "format_table", "predict"]


def predict(
    measured: dict,
    overlap: float,
    local_steps: Sequence[int] = (),
    speeds: Sequence[float] | None = None,
) -> list[tuple[runtime.Prediction, float]]:
    """Predictions, fastest first, with the speedup over All-Reduce; with ``local_steps`` also
    every topology gossiping every H steps and DiLoCo's all-reduce every H steps, per H; with
    ``speeds`` (a factor per worker) on workers of those speeds, and ``uneven=True`` per H."""
    even = runtime.Workload(
        compute_mean=measured["compute_mean_s"],
        compute_std=measured["compute_std_s"],
        update_time=measured["update_s"],
        backward_fraction=min(1.0, max(0.0, measured["backward_fraction"])),
    )
    # step-locked methods wait for the slowest worker (decent_optim.runtime.uneven)
    workload = runtime.paced(even, speeds) if speeds else even
    gossip = {k: (v["round_s"], v["degrees"]) for k, v in measured["gossip"].items()}
    n, allreduce_s = measured["world_size"], measured["allreduce_s"]
    rows = runtime.recommend(workload, n, allreduce_s, gossip, overlap)
    if not local_steps:
        return rows
    base = next(p for p, _ in rows if p.method == "all-reduce").iteration
    preds = [p for p, _ in rows]
    for h in local_steps:
        preds += [runtime.predict_local_steps(workload, t, d, h, k) for k, (t, d) in gossip.items()]
        preds.append(runtime.predict_diloco(workload, n, allreduce_s, h))
        if speeds:
            preds += [runtime.predict_uneven(even, speeds, t, h, k) for k, (t, _) in gossip.items()]
    preds.sort(key=lambda p: p.iteration)
    return [(p, base / p.iteration if p.iteration > 0 else 1.0) for p in preds]


def format_table(measured: dict, rows: list[tuple[runtime.Prediction, float]]) -> str:
    m = measured
    lines = [
        f"{m['world_size']} workers ({m['local_world_size']} per node, {m['backend']}), "
        f"{m['params'] / 1e6:.2f}M parameters ({m['bytes'] / 2**20:.1f} MiB)",
        f"compute {m['compute_mean_s'] * 1e3:.1f} ms +- {m['compute_std_s'] * 1e3:.1f} ms, "
        f"local update {m['update_s'] * 1e3:.1f} ms, all-reduce {m['allreduce_s'] * 1e3:.1f} ms",
        "bytes per copy on a link between nodes: "
        + ", ".join(f"{c} {b / 2**20:.1f} MiB" for c, b in m.get("wire_bytes", {}).items()),
        "",
        "| method | predicted ms / iteration | waits on compute ms | communication ms | exposed ms | speedup vs all-reduce |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for p, speedup in rows:
        lines.append(
            f"| {p.method} | {p.iteration * 1e3:.1f} | {p.compute * 1e3:.1f} | {p.comm * 1e3:.1f} "
            f"| {p.exposed_comm * 1e3:.1f} | {speedup:.2f}x |"
        )
    best, speedup = rows[0]
    lines += ["", f"recommended: {best.method} ({speedup:.2f}x the speed of all-reduce, predicted)"]
    lines += [f"not measured: {name}: {why}" for name, why in m.get("skipped", {}).items()]
    return "\n".join(lines)


def as_json(measured: dict, rows: list[tuple[runtime.Prediction, float]]) -> dict:
    """The measurements and the predictions, fastest first, as ``--json`` writes them."""
    predicted = [
        {
            "method": p.method,
            "iteration_s": p.iteration,
            "speedup": s,
            "compute_s": p.compute,
            "comm_s": p.comm,
            "exposed_s": p.exposed_comm,
        }
        for p, s in rows
    ]
    return {"measured": measured, "predicted": predicted}
