"""The checkpoint folder: a save killed half-way, background saves, ``latest``, pruning.

The kill is real: a subprocess saves step 1, then step 2 through a ``torch.save`` slowed down to
write its bytes in small pieces, and is killed with SIGKILL once the first piece is on disk.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import decent_optim as dopt
from decent_optim import checkpoint
from decent_optim.checkpoint import directory

REPO = Path(__file__).resolve().parent.parent

_SAVER = textwrap.dedent(
    """
    import io, sys, time
    import torch
    import decent_optim as dopt
    from decent_optim import checkpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = dopt.DecentralizedAdamW(model.parameters(), lr=0.1)
    def train():
        opt.zero_grad()
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()
    train()
    checkpoint.save(sys.argv[1], model, opt, step=1)
    real_save = torch.save
    def slow_save(obj, f):
        data = io.BytesIO()
        real_save(obj, data)
        for start in range(0, len(data.getvalue()), 1024):
            f.write(data.getvalue()[start:start + 1024])
            f.flush()
            print("writing", flush=True)
            time.sleep(0.05)
    torch.save = slow_save
    train()
    checkpoint.save(sys.argv[1], model, opt, step=2)
    print("finished", flush=True)
    """
)


def _model_and_opt(seed: int = 5):
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 64)
    return model, dopt.DecentralizedAdamW(model.parameters(), lr=0.1)


def test_a_save_killed_half_way_leaves_the_previous_checkpoint(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", _SAVER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until step 2's file is partly written
        assert line.strip() == "writing", line
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    partial = tmp_path / "step-00000002"
    assert [p.name.startswith(".rank-00000-of-00001.pt.partial-") for p in partial.iterdir()] == [
        True
    ]
    found = checkpoint.latest(tmp_path)
    assert found is not None and found[1].step == 1
    saved = torch.load(found[0] / found[1].files[0], weights_only=True)["model"]
    model, opt = _model_and_opt()
    resumed = checkpoint.load(tmp_path, model, opt)
    assert (resumed.step, resumed.source) == (1, "own")
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[key])
    assert not partial.exists()  # the interrupted save is removed by the next load


def test_background_save_writes_the_values_of_the_call(tmp_path):
    model, opt = _model_and_opt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    checkpoint.save(tmp_path, model, opt, step=3, background=True, extra={"lr": 0.1})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # training goes on while the thread writes
    folder = checkpoint.wait(tmp_path)
    assert folder == tmp_path.resolve() / "step-00000003"
    assert checkpoint.wait(tmp_path) is None  # nothing in flight any more
    found = checkpoint.latest(tmp_path)
    assert found is not None
    saved = torch.load(found[0] / found[1].files[0], weights_only=True)
    assert saved["extra"] == {"lr": 0.1}
    for key, value in before.items():
        assert torch.equal(saved["model"][key], value)


def test_a_failed_background_save_raises_at_the_next_call(tmp_path):
    model, opt = _model_and_opt()
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    checkpoint.save(blocker, model, opt, step=1, background=True)
    with pytest.raises(RuntimeError, match="background checkpoint save") as info:
        checkpoint.save(blocker, model, opt, step=2)
    assert isinstance(info.value.__cause__, OSError)


def test_latest_keeps_the_newest_complete_and_prunes(tmp_path):
    model, opt = _model_and_opt()
    assert checkpoint.load(tmp_path, model, opt).step == 0  # nothing there yet
    for step in (10, 20, 30):
        checkpoint.save(tmp_path, model, opt, step=step, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000020", "step-00000030"]
    (tmp_path / "step-00000040").mkdir()  # a save that never got its manifest
    found = checkpoint.latest(tmp_path)
    assert found is not None and found[1].step == 30
    (found[0] / found[1].files[0]).write_bytes(b"cut short")
    with pytest.warns(UserWarning, match="damaged"):
        found = checkpoint.latest(tmp_path)
    assert found is not None and found[1].step == 20
    with pytest.raises(FileNotFoundError, match="no complete checkpoint of step 30"):
        with pytest.warns(UserWarning, match="damaged"):
            checkpoint.load(tmp_path, model, opt, step=30)


def test_rank_zero_gives_up_the_commit_when_a_rank_file_never_comes(tmp_path):
    with pytest.raises(TimeoutError, match="1 rank file.*same step"):
        directory.wait_for_files(tmp_path, ["rank-00001-of-00002.pt"], timeout=0.1)
