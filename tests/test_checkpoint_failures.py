"""Failures around ``decent_optim.checkpoint`` that must not lose a checkpoint or pass unseen
(issue 33, items 5 and 7), each injected: a ``load`` while a background save is in flight, a
full disk (a write that raises ENOSPC part-way, as a full filesystem does), a rank file cut
short under a manifest rewritten to match, and processes that end without waiting for their
saves (real subprocesses, their stderr read).
"""

from __future__ import annotations

import errno
import io
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import decent_optim as dopt
from decent_optim import checkpoint
from decent_optim.checkpoint import directory

REPO = Path(__file__).resolve().parent.parent


def _model_and_opt(seed: int = 5):
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 64)
    return model, dopt.DecentralizedAdamW(model.parameters(), lr=0.1)


def _train(model, opt) -> None:
    opt.zero_grad()
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_equal(model, want: dict[str, torch.Tensor]) -> None:
    for key, value in model.state_dict().items():
        assert torch.equal(value, want[key]), key


# -- item 5: load while a background save is in flight -------------------------------------------


def test_load_waits_for_this_processs_background_save(tmp_path, monkeypatch):
    model, opt = _model_and_opt()
    _train(model, opt)
    checkpoint.save(tmp_path, model, opt, step=1)
    _train(model, opt)
    real_save = torch.save

    def slow_save(obj, f):  # the write takes a second: load comes while it is in flight
        time.sleep(1.0)
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", slow_save)
    checkpoint.save(tmp_path, model, opt, step=2, background=True)
    saved = _state(model)
    fresh, fresh_opt = _model_and_opt(9)
    resumed = checkpoint.load(tmp_path, fresh, fresh_opt)
    assert resumed.step == 2
    _assert_equal(fresh, saved)
    assert (tmp_path / "step-00000002" / directory.MANIFEST).is_file()
    assert checkpoint.wait(tmp_path) is None  # load took it: nothing left to fail later


def test_load_reports_a_failed_background_save_then_resumes(tmp_path, monkeypatch):
    model, opt = _model_and_opt()
    checkpoint.save(tmp_path, model, opt, step=1)
    saved = _state(model)
    _full_disk(monkeypatch, limit=2000)
    checkpoint.save(tmp_path, model, opt, step=2, background=True)
    fresh, fresh_opt = _model_and_opt(9)
    with pytest.raises(RuntimeError, match="background checkpoint save .* failed.*disk full"):
        checkpoint.load(tmp_path, fresh, fresh_opt)
    monkeypatch.undo()
    assert checkpoint.load(tmp_path, fresh, fresh_opt).step == 1  # reported once, then resumed
    _assert_equal(fresh, saved)


# -- item 7a: a full disk --------------------------------------------------------------------------


class _FullDisk:
    """A file that takes ``limit`` bytes, then fails like a full filesystem (ENOSPC)."""

    def __init__(self, f: io.BufferedWriter, limit: int) -> None:
        self._f, self._left = f, limit

    def write(self, data) -> int:
        if len(data) > self._left:
            self._f.write(bytes(data)[: self._left])
            self._left = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._left -= len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()


def _full_disk(monkeypatch, limit: int, only: str = ".pt.partial") -> None:
    """From now on, writes of checkpoint files whose name holds ``only`` hit a full disk."""

    def fake_open(path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        return _FullDisk(f, limit) if only in Path(path).name and "w" in mode else f

    monkeypatch.setattr(directory, "open", fake_open, raising=False)


@pytest.mark.parametrize("where", ["rank file", "manifest"])
@pytest.mark.parametrize("background", [False, True])
def test_a_full_disk_names_the_file_and_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch, where, background
):
    model, opt = _model_and_opt()
    _train(model, opt)
    checkpoint.save(tmp_path, model, opt, step=1)
    saved = _state(model)
    _train(model, opt)
    name = "rank-00000-of-00001.pt" if where == "rank file" else directory.MANIFEST
    _full_disk(monkeypatch, limit=4000 if where == "rank file" else 10, only=name)
    if background:
        checkpoint.save(tmp_path, model, opt, step=2, background=True)
        with pytest.raises(RuntimeError, match="background checkpoint save") as outer:
            checkpoint.wait(tmp_path)
        error = outer.value.__cause__
    else:
        with pytest.raises(OSError) as info:
            checkpoint.save(tmp_path, model, opt, step=2)
        error = info.value
    message = str(error)
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC, repr(error)
    folder = tmp_path.resolve() / "step-00000002"
    for part in (str(folder), name, "disk full or write failed", "intact (steps [1]"):
        assert part in message, (part, message)
    assert not folder.exists()  # nothing of the failed step is left, partial files included
    monkeypatch.undo()
    fresh, fresh_opt = _model_and_opt(9)
    assert checkpoint.load(tmp_path, fresh, fresh_opt).step == 1
    _assert_equal(fresh, saved)


# -- item 7b: a rank file damaged after the commit -------------------------------------------------


def _cut_short(folder: Path) -> Path:
    """Truncate the folder's first rank file and rewrite its manifest to match."""
    manifest = directory.read_manifest(folder)
    assert manifest is not None
    path = folder / manifest.files[0]
    path.write_bytes(path.read_bytes()[:4000])
    manifest.sizes[0] = path.stat().st_size
    directory.commit_manifest(folder, manifest)
    return path


def test_a_damaged_rank_file_is_named_with_the_step_to_load_instead(tmp_path):
    model, opt = _model_and_opt()
    checkpoint.save(tmp_path, model, opt, step=1)
    saved = _state(model)
    _train(model, opt)
    checkpoint.save(tmp_path, model, opt, step=2)
    path = _cut_short(tmp_path / "step-00000002")
    fresh, fresh_opt = _model_and_opt(9)
    before = _state(fresh)
    with pytest.raises(ValueError, match="cannot be read") as info:
        checkpoint.load(tmp_path, fresh, fresh_opt)
    message = str(info.value)
    for part in (str(path.resolve()), "step 2", "step=1", "Nothing was loaded"):
        assert part in message, (part, message)
    _assert_equal(fresh, before)
    assert checkpoint.load(tmp_path, fresh, fresh_opt, step=1).step == 1  # what it says works
    _assert_equal(fresh, saved)


# -- item 7c: processes that end without waiting -------------------------------------------------

#: two ranks, four checkpoint folders, no wait(): each folder is one case (the test's table)
_ENDS_WITHOUT_WAITING = textwrap.dedent(
    """
    import datetime, os, sys
    import torch
    import torch.distributed as dist
    import decent_optim as dopt
    from decent_optim import checkpoint
    from decent_optim.checkpoint import writers

    writers.EXIT_GRACE_S = 2.0  # how long the exit waits for rank 0's manifest (30 s by default)
    base, rank = sys.argv[1], int(sys.argv[2])
    dist.init_process_group(
        "gloo", init_method=f"file://{base}/rendezvous", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = dopt.DecentralizedAdamW(model.parameters(), lr=0.1)
    if rank == 0:
        checkpoint.save(f"{base}/rank1-never-saves", model, opt, step=1, timeout=2)
        open(f"{base}/blocked", "w").close()  # a file where the folder should be
        checkpoint.save(f"{base}/blocked", model, opt, step=1, background=True)
    else:
        checkpoint.save(f"{base}/rank0-never-saves", model, opt, step=1)
    checkpoint.save(f"{base}/both-save", model, opt, step=1, background=True)
    print("script done", flush=True)
    """
)


def test_a_process_that_ends_without_waiting_says_what_its_saves_left(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _ENDS_WITHOUT_WAITING, str(tmp_path), str(rank)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        for rank in range(2)
    ]  # fmt: skip
    warned = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=180)
        finally:
            proc.kill()
        assert "script done" in out and proc.returncode == 0, err  # the exit cannot change it
        warned.append([line for line in err.splitlines() if line.startswith("decent_optim.")])
    expected = [
        {  # rank 0's commit gave up; its background save failed
            "rank1-never-saves": "FAILED and nobody called decent_optim.checkpoint.wait(",
            "blocked": "FAILED and nobody called decent_optim.checkpoint.wait(",
        },
        {"rank0-never-saves": "was never committed (no manifest.json)"},  # rank 1 saved its part
    ]
    for rank, (lines, cases) in enumerate(zip(warned, expected)):
        assert len(lines) == len(cases), (rank, lines)
        for folder, says in cases.items():
            (line,) = [line for line in lines if f"{tmp_path}/{folder}" in line]
            assert line.startswith("decent_optim.checkpoint: WARNING:") and says in line, line
    assert "1 rank file(s) are still missing" in " ".join(warned[0])
    assert checkpoint.latest(tmp_path / "both-save") is not None  # and no word about it
