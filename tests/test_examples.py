"""Smoke tests of the scripts in examples/: a few steps as one process and on 2 gloo ranks.

Each script runs in a subprocess exactly as a user starts it (``python examples/X.py`` and
``torchrun --standalone --nproc_per_node 2 examples/X.py``), with a timeout, and must exit 0 and
print its final summary. They need the ``examples`` extra (tqdm, matplotlib, scikit-learn), which
the ``test`` extra includes.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
TIMEOUT_S = 240  # start-up of 2 ranks plus a few steps; generous for a busy 2-core machine

# script, arguments for a few quick steps, text the final summary must contain
CASES = [
    ("quickstart.py", ["5"], "mean squared error vs sin(x)"),
    (
        "train_charlm.py",
        [
            "--steps",
            "6",
            "--log-every",
            "2",
            "--eval-every",
            "3",
            "--compare",
            "--plot",
            "loss.png",
        ],
        "done: All-Reduce (DDP + AdamW)",
    ),
    ("train_fsdp.py", ["--steps", "4"], "done: "),
    (
        "uneven_workers.py",
        ["--steps", "12", "--step-ms", "2", "--eval-rounds", "2"],
        "DDP-equivalent steps",
    ),
    (
        "digits_cnn.py",
        ["--steps", "6", "--eval-every", "3"],
        "test accuracy of the consensus model",
    ),
]


def _run(
    cmd: list[str], cwd: Path, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    # the checkout's decent_optim wins over an installed one, as in conftest.py
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for var in (
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        env.pop(var, None)  # a test run under torchrun must not make the script join that world
    proc = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited with {proc.returncode}\n"
        f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    )
    return proc


@pytest.mark.parametrize("script,args,summary", CASES, ids=[c[0] for c in CASES])
def test_example_single_process(script: str, args: list[str], summary: str, tmp_path: Path) -> None:
    proc = _run([sys.executable, str(EXAMPLES / script), *args], cwd=tmp_path)
    assert summary in proc.stdout
    if "--plot" in args:  # a PNG comparing both runs
        assert "done: decent_optim AdamW" in proc.stdout
        assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.multiprocess
@pytest.mark.parametrize("script,args,summary", CASES, ids=[c[0] for c in CASES])
def test_example_two_ranks(script: str, args: list[str], summary: str, tmp_path: Path) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = _run([*torchrun, str(EXAMPLES / script), *args], cwd=tmp_path)
    assert summary in proc.stdout
    if script == "quickstart.py":  # every rank prints its own result
        assert "rank 0:" in proc.stdout and "rank 1:" in proc.stdout


# examples/integrations/: the scripts of the "Using decent_optim with ..." pages, on 2 ranks
INTEGRATIONS = [
    ("hf_trainer.py", "transformers", ["--steps", "4"], "eval loss of the consensus model"),
    ("accelerate_loop.py", "accelerate", ["--epochs", "1"], "test error of the consensus model"),
    ("lightning_fit.py", "lightning", ["--epochs", "1"], "val loss of the consensus model"),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "script,module,args,summary", INTEGRATIONS, ids=[c[0] for c in INTEGRATIONS]
)
def test_integration_example_two_ranks(
    script: str, module: str, args: list[str], summary: str, tmp_path: Path
) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"needs {module}: pip install decent-optim[hf,lightning]")
    if script == "accelerate_loop.py":
        import decent_optim

        if not hasattr(decent_optim, "unwrap"):  # see needs_issue13 in test_integrations.py
            pytest.skip("needs issue 13: Accelerate's save_state writes safetensors")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = _run([*torchrun, str(EXAMPLES / "integrations" / script), *args], cwd=tmp_path)
    assert summary in proc.stdout


def test_charlm_baseline_flag_runs_only_the_baseline(tmp_path: Path) -> None:
    args = ["--steps", "3", "--eval-every", "3", "--baseline", "allreduce"]
    proc = _run([sys.executable, str(EXAMPLES / "train_charlm.py"), *args], cwd=tmp_path)
    assert "done: All-Reduce" in proc.stdout and "decent_optim AdamW" not in proc.stdout


def test_charlm_summary_after_a_resume_names_the_step_it_resumed_at(tmp_path: Path) -> None:
    script = [sys.executable, str(EXAMPLES / "train_charlm.py"), "--checkpoint-dir", "ckpt"]
    quick = ["--save-every", "2", "--eval-every", "100", "--log-every", "100"]
    _run([*script, *quick, "--steps", "4"], cwd=tmp_path)  # checkpoints at steps 2 and 4
    proc = _run([*script, *quick, "--steps", "6"], cwd=tmp_path)  # resumes at step 5
    assert "resumed from step 4" in proc.stdout, proc.stdout
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("done: ")]
    assert "(step 5) ->" in line and "(step 6)" in line, line  # the first step run: 5, not 1
    assert "over 2 steps (resumed at step 5, 6 in all)" in line, line


def test_uneven_workers_evaluates_at_the_end_and_resumes_with_its_budget(tmp_path: Path) -> None:
    """docs/uneven_hardware.rst's loop: a final evaluation at the round the budget ends on, and
    stop_at called again after a resume (the budget is not in the checkpoint)."""
    script = [sys.executable, str(EXAMPLES / "uneven_workers.py"), "--checkpoint-dir", "ckpt"]
    quick = ["--step-ms", "1", "--eval-every", "4"]  # every 4 steps: every 2 rounds

    def rounds(out: str) -> tuple[list[int], int, str]:
        evaluated = [int(x.split()[1][:-1]) for x in out.splitlines() if x.startswith("round ")]
        (summary,) = [x for x in out.splitlines() if "stopped at round" in x]
        return evaluated, int(summary.split("stopped at round ")[1].split(",")[0]), summary

    evaluated, stopped, _ = rounds(_run([*script, *quick, "--steps", "12"], cwd=tmp_path).stdout)
    assert evaluated == [*range(2, stopped, 2), stopped], (evaluated, stopped)  # and the final
    out = _run([*script, *quick, "--steps", "20"], cwd=tmp_path).stdout
    again, end, summary = rounds(out)
    assert f"(resumed at round {stopped})" in summary, out
    assert again[-1] == end > stopped and float(summary.split(", ")[-1].split()[0]) >= 20, out


@pytest.mark.multiprocess
def test_live_membership_example_trains_on_after_a_kill(tmp_path: Path) -> None:
    """examples/live_membership.py as docs/surviving_failures.rst runs it: rank 2 SIGKILLs
    itself before step 6 and the three others finish every step in a group of 3."""
    env = {"LIVE_KILL": "2:6"}
    script = [sys.executable, str(EXAMPLES / "live_membership.py"), "--workers", "4"]
    out = _run([*script, "--steps", "12"], cwd=tmp_path, extra_env=env).stdout
    done = [x for x in out.splitlines() if "] done: 12 steps" in x]
    assert len(done) == 3 and all(x.endswith("world size 3") for x in done), out
    assert "exit codes by rank: [0, 0, -9, 0]" in out, out
