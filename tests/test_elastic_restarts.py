"""torchrun's restarts on one node with the shared rendezvous store (issue 33, item 10).

With ``--max-restarts`` and torch's default shared store, the restarted workers'
``init_process_group`` connects to the dead workers (the store still holds their keys): it hung
in five of six runs here (until killed, 25 to 140 s later) and failed with gloo's
"connectFullMesh failed ... Connection refused" in the sixth. Before this fix nothing named the
cause. Now the first workers refuse to build an optimizer, naming
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, and a restarted worker refuses at ``import
decent_optim``, so torchrun ends within seconds, saying why. With the variable set, the same
run restarts and finishes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _harness import run_world

import decent_optim as dopt
from decent_optim.gossip.elastic import restart_hazard

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "_restart_worker.py"
FIX = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
#: two attempts of two workers that import torch take ~30 s on two busy cores; a hang, minutes
HANG_S = 150.0


def _torchrun(share_store: bool) -> tuple[int, str, float]:
    """``torchrun --nproc-per-node 2 --max-restarts 1`` of the worker: (exit code, output, s)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    if not share_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--max-restarts", "1", "--monitor-interval", "0.2", str(WORKER)]
    start = time.monotonic()
    # a session of its own: on a hang, the agent and its workers are killed together
    proc = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun hung for {HANG_S:g} s after the restart; its output:\n{out[-6000:]}")
    return proc.returncode, out, time.monotonic() - start


@pytest.mark.multiprocess
def test_restarts_with_the_shared_store_fail_fast_naming_the_variable():
    code, out, seconds = _torchrun(share_store=True)
    assert code != 0, out[-6000:]
    assert "finished" not in out, out[-6000:]
    # the first attempt: both ranks refuse to build the optimizer, before any step
    assert out.count(f"Fix: set {FIX} in the environment of the torchrun command") >= 2, out
    # the restart: refused at import, before its init_process_group could hang
    assert "this worker is torchrun's restart number 1" in out, out[-6000:]
    assert seconds < HANG_S, seconds


@pytest.mark.multiprocess
def test_restarts_with_a_store_per_round_resume_and_finish():
    code, out, _ = _torchrun(share_store=False)
    assert code == 0, out[-6000:]
    assert "attempt 0 rank 0: finished" not in out, out[-6000:]  # rank 1 died in attempt 0
    for rank in (0, 1):
        assert f"attempt 1 rank {rank}: finished" in out, out[-6000:]


TORCHRUN = {"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "0"}


@pytest.mark.parametrize(
    "env, hazard",
    [
        ({}, None),  # not under torchrun
        ({**TORCHRUN, "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"}, None),
        ({**TORCHRUN, "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "False",
          "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, None),
        ({**TORCHRUN, "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"},
         f"Fix: set {FIX} in the environment of the torchrun command itself"),
        # the static rendezvous shares its store whatever the variable says
        ({**TORCHRUN, "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True",
          "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, "this is the static rendezvous"),
    ],
)  # fmt: skip
def test_the_hazard_is_read_from_what_torchrun_tells_its_workers(env, hazard):
    message = restart_hazard(env)
    if hazard is None:
        assert message is None, message
    else:
        assert message is not None and hazard in message, message
        assert "--max-restarts 0" in message and "docs/surviving_failures" in message, message


def _build_with_restarts(rank, world_size):
    os.environ.update(
        TORCHELASTIC_MAX_RESTARTS="2",
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RUN_ID="test",
    )  # the harness restores the environment after the task
    start = time.monotonic()
    try:
        dopt.DecentralizedAdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-3, timeout=5.0)
    except RuntimeError as err:
        return type(err).__name__, str(err), time.monotonic() - start
    return "ok", "", time.monotonic() - start


@pytest.mark.multiprocess
def test_every_rank_refuses_to_build_the_optimizer_within_seconds():
    for kind, message, seconds in run_world(_build_with_restarts, 2):
        assert kind == "RuntimeError", message
        assert f"set {FIX}" in message and "TORCHELASTIC_MAX_RESTARTS=2" in message, message
        assert seconds < 5, seconds
