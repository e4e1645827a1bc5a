"""The convergence study (experiments/convergence) on its reduced protocol: 2 gloo ranks, 16
steps, both tasks, every stage that has runs at 2 workers (All-Reduce sweep, method sweep, more
seeds at the best rate, compressed gossip, local steps against DiLoCo).

Checked: it runs from its one command and writes every output; every planned run has every
evaluation and learns; the best rate of the sweep is the one rerun with more seeds; an
interrupted study resumes by training only the missing runs, and reproduces their values bit for
bit; All-Reduce keeps one model (consensus distance 0) and gossip does not; with 2 workers the
ring and one-peer-exp pair the same two workers every round and must train identical models; the
compressed run borrows the exact run's tuned rate, really compresses, and is paired with it; the
local-steps runs borrow their rates (plain: the every-step method's tuned one; DiLoCo and the
outer mode: All-Reduce's), really change the training, and are paired with DiLoCo at the same H.
"""

from __future__ import annotations

import csv
import math
import os
import re
import socket
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytest.importorskip("sklearn", reason="the digits task needs scikit-learn")
pytest.importorskip("matplotlib", reason="the study draws its plots with matplotlib")

REPO = Path(__file__).resolve().parent.parent
STUDY = REPO / "experiments" / "convergence"
EVALS = [8, 16]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_study(out: Path) -> str:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [
        sys.executable, str(STUDY / "run.py"), "--protocol", "smoke", "--out", str(out),
        "--port", str(_free_port()),
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("convergence")
    _run_study(out)
    return out


@pytest.fixture(scope="module")
def runs(study: Path) -> dict[str, list[dict]]:
    by_key: dict[str, list[dict]] = defaultdict(list)
    for row in _rows(study / "runs.csv"):
        by_key[row["key"]].append(row)
    return dict(by_key)


def test_every_output_is_written(study: Path) -> None:
    for name in ("runs.csv", "summary.csv", "summary.md", "recommended.csv"):
        assert (study / name).stat().st_size > 0, name
    for task in ("charlm", "digits"):
        for kind in ("val_loss", "lr_sweep"):
            assert (study / f"{kind}_{task}.png").stat().st_size > 0, (kind, task)
    summary = _rows(study / "summary.csv")
    tuned = [r for r in summary if r["part"] == "tuned"]
    # one tuned configuration per method: 5 for charlm, 2 for digits
    assert sorted((r["task"], r["method"]) for r in tuned) == sorted(
        [
            ("charlm", m)
            for m in ("allreduce", "adamw:ring", "adamw:aer", "adamw:ope", "accum98:ring")
        ]
        + [("digits", m) for m in ("allreduce", "accum98:ring")]
    )
    for row in tuned:
        if row["method"] == "allreduce":
            assert row["vs All-Reduce"].startswith("+0.00"), row
        assert int(row["seeds"]) == (2 if row["task"] == "charlm" else 1), row


def test_every_run_has_every_evaluation_and_learns(runs: dict[str, list[dict]]) -> None:
    # ar-lr: 2 + 1; sweep: 4 x 2 + 1 x 2 rates; seeds: one more seed for each charlm method;
    # compressed: int8 at 1 seed; local: plain, DiLoCo and outer mode at 1 seed
    assert len(runs) == 3 + 10 + 5 + 1 + 3
    for key, rows in runs.items():
        assert [int(r["step"]) for r in rows] == EVALS, key
        first, last = (float(r["val_loss"]) for r in rows)
        assert math.isfinite(last) and last < first, (key, first, last)
        assert float(rows[-1]["lr_now"]) < float(rows[0]["lr_now"])  # cosine decay


def test_the_best_rate_of_the_sweep_gets_the_seeds(runs: dict[str, list[dict]]) -> None:
    final = {k: float(rows[-1]["val_loss"]) for k, rows in runs.items()}
    ar = {k: v for k, v in final.items() if k.startswith("charlm/n2/gb8/allreduce/")}
    best_ar = min(ar, key=ar.__getitem__)
    base = float(runs[best_ar][0]["lr"])
    sweep = {k: v for k, v in final.items() if "/adamw:ring/" in k and k.startswith("charlm")}
    sweep_seed0 = {k: v for k, v in sweep.items() if k.endswith("seed0")}
    assert {float(runs[k][0]["lr"]) / base for k in sweep_seed0} == {1.0, 2.0}
    best = min(sweep_seed0, key=sweep_seed0.__getitem__)
    (seed1,) = [k for k in sweep if k.endswith("seed1")]
    assert runs[seed1][0]["lr"] == runs[best][0]["lr"]


def test_consensus_distance_is_zero_only_for_allreduce(runs: dict[str, list[dict]]) -> None:
    for rows in runs.values():
        for row in rows:
            distance = float(row["consensus_distance"])
            if row["optimizer"] == "allreduce":
                assert distance == 0.0
            else:
                assert distance > 0.0, row["key"]


def test_ring_and_one_peer_exp_agree_with_two_workers(runs: dict[str, list[dict]]) -> None:
    pairs = 0
    for key, rows in runs.items():
        if key.startswith("charlm/") and "/adamw:ring/" in key:
            other = runs[key.replace("/adamw:ring/", "/adamw:ope/")]
            for a, b in zip(rows, other):
                assert float(a["val_loss"]) == pytest.approx(float(b["val_loss"]), rel=1e-5)
            pairs += 1
    assert pairs == 2 + 1  # two rates at seed 0, the best rate at seed 1


def test_compressed_run_is_paired_with_the_exact_one(
    study: Path, runs: dict[str, list[dict]]
) -> None:
    (key,) = [k for k in runs if "/adamw:aer:int8/" in k]
    exact = {k: v for k, v in runs.items() if "/adamw:aer/" in k and k.endswith("/seed1")}
    (tuned,) = exact.values()  # the seeds stage reruns only the tuned rate
    assert runs[key][0]["lr"] == tuned[0]["lr"]
    paired = runs[key.replace("/adamw:aer:int8/", "/adamw:aer/")]
    a, b = float(runs[key][-1]["val_loss"]), float(paired[-1]["val_loss"])
    assert a != b  # the int8 rounding changes the run: compression= reached the optimizer
    assert abs(a / b - 1) < 0.05, (a, b)
    (row,) = _rows(study / "tables" / "compressed.csv")
    assert row["seeds"] == "0" and row["vs exact"] == f"{100 * (a / b - 1):+.2f}%", row
    assert "Compressed vs exact gossip" in (study / "summary.md").read_text()


def test_resume_trains_only_what_is_missing_and_reproduces_it(study: Path, tmp_path: Path) -> None:
    rows = _rows(study / "runs.csv")
    # an interrupted study: the last run missing, the one before it cut off mid-way
    keys = list(dict.fromkeys(r["key"] for r in rows))
    lost, torn = keys[-1], keys[-2]
    kept = [r for r in rows if r["key"] != lost and not (r["key"] == torn and r["step"] == "16")]
    with (tmp_path / "runs.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(kept)
    stdout = _run_study(tmp_path)
    assert "== 2 workers: 2 runs plannable now" in stdout, stdout
    trained = re.findall(r"^\[2 workers\] (\S+): val loss", stdout, flags=re.M)
    assert sorted(trained) == sorted([lost, torn]), stdout
    fields = ("train_loss", "val_loss", "val_acc", "consensus_distance")
    redone = {(r["key"], r["step"]): r for r in _rows(tmp_path / "runs.csv")}
    for r in rows:
        again = redone[(r["key"], r["step"])]
        assert {f: again[f] for f in fields} == {f: r[f] for f in fields}, r["key"]


def test_local_steps_borrow_their_rates_and_are_paired_with_diloco(
    study: Path, runs: dict[str, list[dict]]
) -> None:
    final = {k: float(rows[-1]["val_loss"]) for k, rows in runs.items()}
    ar = {k: v for k, v in final.items() if re.match(r"charlm/n2/gb8/allreduce/.*/seed0$", k)}
    reference = min(ar, key=ar.__getitem__)  # All-Reduce at its optimum, seed 0
    base = runs[reference][0]["lr"]
    (tuned,) = [rows for k, rows in runs.items() if "/adamw:aer/" in k and k.endswith("/seed1")]
    (plain,) = [k for k in runs if "/adamw:aer:h3/" in k]
    (diloco,) = [k for k in runs if "/diloco:h3/" in k]
    (outer,) = [k for k in runs if "/adamw:aer:h3:outer/" in k]
    assert runs[plain][0]["lr"] == tuned[0]["lr"]
    assert runs[diloco][0]["lr"] == runs[outer][0]["lr"] == base
    assert runs[diloco][0]["optimizer"] == "diloco"
    # local_steps= reached the optimizer: not the every-step run of the same rate and seed
    every_step = plain.replace("/adamw:aer:h3/", "/adamw:aer/")
    assert final[plain] != final[every_step]
    rows = {r["method"]: r for r in _rows(study / "tables" / "local.csv")}
    assert list(rows) == [
        "DecentralizedAdamW, local_steps=3, alternating-exp-ring",
        "DiLoCo (all-reduce), H=3, outer lr 0.7",
        'DecentralizedAdamW, local_steps=3, outer="diloco", alternating-exp-ring',
    ]
    for key, row in zip((plain, diloco, outer), rows.values()):
        assert row["vs All-Reduce"] == f"{100 * (final[key] / final[reference] - 1):+.2f}%"
        if key != diloco:
            gap = f"{100 * (final[key] / final[diloco] - 1):+.2f}%"
            assert row["vs best DiLoCo, same H"] == f"{gap} (outer lr 0.7, x1)"
        else:
            assert row["vs best DiLoCo, same H"] == ""
    assert "Local steps vs DiLoCo" in (study / "summary.md").read_text()
