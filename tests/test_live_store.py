"""Live membership (issue 64): the membership store lost and started again mid-run.

Three gloo ranks on the ring, their store served by a process that trains nothing. At rank 0's
step 3 that process exits: training goes on, each rank warned once that membership is paused.
At its step 6 rank 0 starts ``python -m decent_optim.store`` on the same port (an empty store);
at step 10 rank 2 is SIGKILLed: the two survivors find the store back, seed it, agree on the
change and train to the end in the rebuilt group. Before, membership stayed off for good and
the loss ended both with ``MembershipError``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import _live
import pytest
from _harness import run_world_fresh, start_alone
from test_live_launch import TIMEOUT, WAIT, _client, _Records, _serve, _stop_store
from test_live_torchrun import _free_ports

STEPS, LOST_AT, BACK_AT, KILL_AT = 14, 3, 6, 10
ROOT = Path(__file__).resolve().parent.parent


def _store_back(rank, world_size, port, path):
    from decent_optim import DSGD
    from decent_optim.gossip.membership import Membership, MembershipError

    logs = _Records()
    live = Membership(_client(port), prefix="back", timeout=TIMEOUT)
    model = _live.model()
    opt = DSGD(model.parameters(), lr=0.05, topology="ring", timeout=WAIT, membership=live)
    out = {"steps": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(STEPS):
            if t == LOST_AT and rank == 0:
                _stop_store(port)
            if t == BACK_AT and rank == 0:
                env = dict(os.environ, PYTHONPATH=str(ROOT))
                command = [sys.executable, "-m", "decent_optim.store", "--port", str(port)]
                server = subprocess.Popen([*command, "--port-file", path], env=env)
                out["server"] = server.pid
                deadline = time.monotonic() + WAIT
                while not os.path.exists(path) and time.monotonic() < deadline:
                    time.sleep(0.05)
            if t == KILL_AT and rank == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            _live.loss(model, rank, t).backward()
            try:
                opt.step()
            except MembershipError as err:
                out["error"] = str(err)
                break
            opt.zero_grad()
            out["steps"] += 1
    out["warnings"] = [str(w.message) for w in caught if "membership store" in str(w.message)]
    out["view"], out["logs"] = tuple(opt.membership), logs.messages
    return out


@pytest.mark.multiprocess
def test_a_store_started_again_serves_the_next_change(tmp_path):
    (port,) = _free_ports(1)
    first = start_alone(_serve, port, "stop")
    results = []
    try:
        path = str(tmp_path / "port")
        results = run_world_fresh(_store_back, 3, port, path, timeout=120, killed=(2,))
    finally:
        assert first.result(timeout=WAIT)
        for out in results:
            if out and "server" in out:
                os.kill(out["server"], signal.SIGTERM)
    assert results[2] is None
    for new_rank, old in enumerate((0, 1)):
        out = results[old]
        assert "error" not in out, out["error"]
        assert out["steps"] == STEPS, out
        assert out["view"] == (1, (0, 1), new_rank, (2,)), out["view"]
        assert len(out["warnings"]) == 1, out["warnings"]
        assert "live membership is paused until the store is back" in out["warnings"][0]
        back = [m for level, m in out["logs"] if "is back: live membership goes on" in m]
        lost = [m for level, m in out["logs"] if "generation 1: lost id(s) [2]" in m]
        assert len(back) == 1 and len(lost) == 1, out["logs"]
