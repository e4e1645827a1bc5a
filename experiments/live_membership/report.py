"""What a run of ``cluster.py`` measured: the seconds from each fault to the survivors' next
step, the steps they lost, the consensus distance over the run and the held-out loss at the end.

    python experiments/live_membership/report.py /tmp/live [--versus /tmp/live-baseline ...]

Per fault (``events.jsonl``): for every worker still training after it, the seconds from the
fault to its next completed step, and to the completion of the step in which it rebuilt its
group (its generation changed; the issue's "continue within 3 s"). Per join: the seconds from the
newcomer's process start to its first completed step in the group. Per worker at the end: the
steps it completed and the step numbers it skipped (none, if no step was lost). The consensus
distance at each dump step is the RMS over the workers that dumped there of
:math:`\\lVert x_i - \\bar x \\rVert_2`; the held-out loss is that of the final members' mean
parameters (the workers that dumped the final step), on 16 held-out batches of 32. ``--versus``
adds the held-out loss of other runs (an uninterrupted one) and the ratio. ``--json`` writes it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _text  # noqa: E402

EVAL_BATCHES = 16


def lines(path: Path) -> list[dict]:
    return [json.loads(s) for s in path.read_text().splitlines()] if path.exists() else []


def dumps(workdir: Path) -> dict[int, dict[int, Path]]:
    """step -> id -> file of the flat parameters."""
    out: dict[int, dict[int, Path]] = {}
    for f in (workdir / "params").glob("*.pt"):
        who, step = (int(v) for v in f.stem.split("-"))
        out.setdefault(step, {})[who] = f
    return out


def held_out(workdir: Path, work: _text.Workload) -> float:
    """The held-out loss of the mean of the final members' parameters."""
    steps = dumps(workdir)
    final = steps[max(steps)]
    mean = torch.stack([torch.load(f) for f in final.values()]).mean(0)
    model = work.make_model()
    torch.nn.utils.vector_to_parameters(mean, model.parameters())
    model.eval()
    with torch.no_grad():
        losses = [
            torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
            for x, y in work.val_batches
        ]
    return sum(losses) / len(losses)


def consensus(workdir: Path) -> list[tuple[int, int, float]]:
    """(step, workers, RMS distance to their mean) at each dump step."""
    out = []
    for step, files in sorted(dumps(workdir).items()):
        x = torch.stack([torch.load(f).double() for f in files.values()])
        dist = (x - x.mean(0)).norm(dim=1).pow(2).mean().sqrt().item()
        out.append((step, len(files), dist))
    return out


def faults(workdir: Path) -> list[dict]:
    """Per fault: every later worker's seconds to its next step and to its rebuilt step."""
    records = {}
    for f in workdir.glob("metrics-*.jsonl"):
        rows = lines(f)
        records[rows[0]["id"]] = rows
    out = []
    for event in sorted(lines(workdir / "events.jsonl"), key=lambda e: e["t"]):
        if event["kind"] == "join":
            continue
        row = {"event": f"{event['kind']}:{event['target']}@{event['step']}", "next": {},
               "rebuilt": {}}  # fmt: skip
        for who, rows in sorted(records.items()):
            after = [r for r in rows if r["t"] > event["t"]]
            if not after or rows[0]["t"] > event["t"]:
                continue  # died before it, or joined after it
            before = [r for r in rows if r["t"] <= event["t"]]
            gen = before[-1]["generation"] if before else after[0]["generation"]
            row["next"][who] = after[0]["t"] - event["t"]
            changed = [r for r in after if r["generation"] > gen]
            if changed and len(after) > 1:
                row["rebuilt"][who] = changed[0]["t"] - event["t"]
        out.append(row)
    return out


def report(workdir: Path, versus: list[Path], work: _text.Workload) -> dict:
    out: dict = {"workdir": str(workdir), "faults": faults(workdir), "joins": [], "workers": {}}
    for f in sorted(workdir.glob("metrics-*.jsonl")):
        rows = lines(f)
        steps = [r["step"] for r in rows]
        skipped = sorted(set(range(steps[0], steps[-1] + 1)) - set(steps))
        out["workers"][rows[0]["id"]] = {"first": steps[0], "last": steps[-1],
                                         "completed": len(steps), "skipped": skipped,
                                         "final_generation": rows[-1]["generation"]}  # fmt: skip
    for join in lines(workdir / "joins.jsonl"):
        rows = lines(workdir / f"metrics-{join['id']}.jsonl")
        first = rows[0]["t"] - join["started"] if rows else None
        out["joins"].append({"id": join["id"], "at_step": join["step"],
                             "let_in": join["let_in"] - join["started"],
                             "first_step": first})  # fmt: skip
    out["consensus"] = consensus(workdir)
    out["held_out"] = held_out(workdir, work)
    out["versus"] = {str(v): held_out(v, work) for v in versus}
    return out


def show(out: dict) -> None:
    print(f"# {out['workdir']}")
    for row in out["faults"]:
        nxt = ", ".join(f"{w}: {s:.2f}" for w, s in row["next"].items())
        reb = ", ".join(f"{w}: {s:.2f}" for w, s in row["rebuilt"].items())
        print(f"{row['event']}: next step after it (s) {{{nxt}}}; rebuilt-step (s) {{{reb}}}")
    for j in out["joins"]:
        first = f"{j['first_step']:.2f}" if j["first_step"] is not None else "-"
        print(f"join id {j['id']} at step {j['at_step']}: let in {j['let_in']:.2f} s, first "
              f"step {first} s after its process start")  # fmt: skip
    for who, w in out["workers"].items():
        print(
            f"worker {who}: steps {w['first']}..{w['last']} ({w['completed']} completed), "
            f"skipped {w['skipped'] or 'none'}, generation {w['final_generation']}"
        )
    peak = max(d for _, _, d in out["consensus"])
    last = out["consensus"][-1]
    print(f"consensus distance: max {peak:.4f}, final {last[2]:.2e} over {last[1]} workers")
    print("  by step: " + ", ".join(f"{s}: {d:.3f} ({n})" for s, n, d in out["consensus"]))
    print(f"held-out loss of the final members' mean: {out['held_out']:.4f}")
    for path, loss in out["versus"].items():
        print(f"  versus {path}: {loss:.4f} (ratio {out['held_out'] / loss:.4f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--versus", type=Path, nargs="*", default=[])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = _text.load("char", val_batches=EVAL_BATCHES)
    out = report(args.workdir, args.versus, work)
    show(out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
