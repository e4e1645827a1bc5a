"""Smoke test of ``python -m decent_optim.plan`` on 2 gloo ranks started by torchrun."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from decent_optim import plan

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.multiprocess
def test_plan_runs_under_torchrun_and_prints_a_recommendation(tmp_path):
    out = tmp_path / "plan.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "decent_optim.plan", "--params", "20000", "--iters", "3", "--reps", "1",
        "--json", str(out), "--compression", "int8",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| all-reduce |" in proc.stdout and "recommended:" in proc.stdout
    result = json.loads(out.read_text())
    measured = result["measured"]
    assert measured["world_size"] == 2
    # 4 square layers of width floor(sqrt(20000 / 4)) = 70
    assert measured["params"] == 4 * 70 * 70
    assert measured["compute_mean_s"] > 0 and measured["allreduce_s"] > 0
    # with 2 ranks: complete, ring and one-peer-exp all fit (one node, so not the node-aware one,
    # and no compressed rounds: nothing crosses nodes)
    assert set(measured["gossip"]) == {"complete", "ring", "one-peer-exp"}
    # bytes of one copy on a link between nodes: float32, and int8 (1 byte + 4 per 1024)
    n = 4 * 70 * 70
    assert measured["wire_bytes"] == pytest.approx({"none": 4 * n, "int8": n * (1 + 4 / 1024)})
    assert "bytes per copy on a link between nodes: none 0.1 MiB, int8 0.0 MiB" in proc.stdout
    assert all(len(g["round_s"]) == len(g["degrees"]) for g in measured["gossip"].values())
    methods = [p["method"] for p in result["predicted"]]
    assert sorted(methods) == ["all-reduce", "complete", "one-peer-exp", "ring"]
    times = [p["iteration_s"] for p in result["predicted"]]
    assert times == sorted(times)  # fastest first


def test_plan_refuses_to_run_without_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match="torchrun"):
        plan.main(["--params", "100"])


def test_predictions_from_a_measurement_dict():
    measured = {
        "world_size": 4, "local_world_size": 1, "backend": "gloo", "params": 10, "bytes": 40,
        "compute_mean_s": 0.1, "compute_std_s": 0.0, "backward_fraction": 0.5, "update_s": 0.0,
        "allreduce_s": 0.3, "gossip": {"ring": {"round_s": [0.05, 0.05], "degrees": [1, 1]}},
    }  # fmt: skip
    rows = plan.predict(measured, overlap=1.0)
    # all-reduce: 0.1 + 0.3 - min(0.3, 0.5 * 0.1) = 0.35; ring hides its 0.05 s: 0.1
    assert [p.method for p, _ in rows] == ["ring", "all-reduce"]
    assert rows[0][1] == pytest.approx(3.5)
    assert "recommended: ring" in plan.format_table(measured, rows)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--params", "-5"], "argument --params: must be > 0, got -5"),
        (["--layers", "0"], "argument --layers: must be > 0, got 0"),
        (["--iters", "0"], "argument --iters: must be > 0, got 0"),
        (["--reps", "1.5"], "argument --reps: expected a number, got '1.5'"),
        (["--params", "nan"], "argument --params: must be finite, got nan"),
        (["--overlap", "2"], "argument --overlap: must be in [0, 1], got 2"),
        (["--params", "3", "--layers", "4"], "at least one parameter per layer"),
        (
            ["--topologies", "ring", "star"],
            "argument --topologies: unknown topology 'star'; valid names are complete, ring",
        ),
    ],
)
def test_bad_arguments_get_a_usage_error_not_a_traceback(argv, message, monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)  # the arguments are checked before anything else
    with pytest.raises(SystemExit) as exit_info:
        plan.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_predictions_include_compressed_rounds():
    measured = {
        "world_size": 4, "local_world_size": 2, "backend": "gloo", "params": 10, "bytes": 40,
        "compute_mean_s": 0.1, "compute_std_s": 0.0, "backward_fraction": 0.5, "update_s": 0.0,
        "allreduce_s": 0.3, "wire_bytes": {"none": 40, "int8": 10.04},
        "gossip": {"ring": {"round_s": [0.01, 0.4], "degrees": [1, 1]},
                   "ring+int8": {"round_s": [0.01, 0.1], "degrees": [1, 1]}},
    }  # fmt: skip
    rows = plan.predict(measured, overlap=1.0)
    # ring: (0.1 + 0.4) / 2 = 0.25; ring+int8 hides both rounds: 0.1; all-reduce 0.35
    assert [p.method for p, _ in rows] == ["ring+int8", "ring", "all-reduce"]
    assert rows[0][0].iteration == pytest.approx(0.1)
    table = plan.format_table(measured, rows)
    assert "recommended: ring+int8" in table and "int8 0.0 MiB" in table
