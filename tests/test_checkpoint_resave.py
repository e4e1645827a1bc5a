"""A step saved again after a rollback (issue 39, item 1): ``load(step=2)``, train, and save step 4
again while the abandoned trajectory's step 4 is committed. The rank files of both have the same
size, so a rewrite in place under the old manifest would pass every size check. Each rank must
un-commit the step before it writes, and rank 0 must commit only the files of the new save: a
save that fails half way (one rank's write fails, injected) then resumes every rank from the
newest *complete* checkpoint of one trajectory, and a rank that saves late is waited for. A
step saved twice within one trajectory (a final save of the last step) stays committed.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from _harness import run_world

import decent_optim as dopt
from decent_optim import checkpoint
from decent_optim.checkpoint import directory

pytestmark = pytest.mark.multiprocess


def _build():
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    return model, dopt.DecentralizedAdamW(model.parameters(), lr=0.1, timeout=60)


def _train(model, opt, rank: int, step: int, trajectory: int) -> None:
    gen = torch.Generator().manual_seed(1000 * trajectory + 10 * step + rank)
    opt.zero_grad()
    model(torch.randn(4, 16, generator=gen)).square().mean().backward()
    opt.step()


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _first_trajectory(rank, world, root):
    """Steps 1-4, checkpoints at 2 and 4 (all kept); returns this rank's state at both."""
    model, opt = _build()
    states = {}
    for step in range(1, 5):
        _train(model, opt, rank, step, trajectory=1)
        if step % 2 == 0:
            checkpoint.save(root, model, opt, step=step, keep_last=None)
            checkpoint.wait(root)
            states[step] = _state(model)
    return states


def _rollback(rank, root):
    """Load step 2 and train steps 3 and 4 on other data: a second trajectory."""
    model, opt = _build()
    assert checkpoint.load(root, model, opt, step=2).step == 2
    for step in (3, 4):
        _train(model, opt, rank, step, trajectory=2)
    return model, opt


def _resave_and_fail(rank, world, root):
    """Save step 4 again; rank 1's write fails (the fault), so the save never completes."""
    model, opt = _rollback(rank, root)
    real = directory.save_file

    def full_disk(path, payload):
        raise directory.WriteError(28, f"No space left on device: {path}")

    if rank == 1:
        directory.save_file = full_disk
    try:
        checkpoint.save(root, model, opt, step=4, keep_last=None, timeout=3)
        checkpoint.wait(root)
    except OSError as err:  # rank 1's own write
        return type(err).__name__
    except RuntimeError as err:  # rank 0: rank 1's file never came
        return type(err).__name__
    finally:
        directory.save_file = real
    return None


def _resume(rank, world, root):
    model, opt = _build()
    resumed = checkpoint.load(root, model, opt)
    return resumed.step, _state(model)


def test_a_resave_after_a_rollback_that_fails_resumes_one_trajectory(tmp_path):
    root = str(tmp_path / "ckpt")
    first = run_world(_first_trajectory, 2, root)
    failed = run_world(_resave_and_fail, 2, root)
    resumed = run_world(_resume, 2, root)
    for rank, (step, state) in enumerate(resumed):
        # step 4 was being rewritten: not a checkpoint, so the newest complete one is step 2
        assert step == 2, (rank, step)
        for key, value in state.items():
            assert torch.equal(value, first[rank][2][key]), (rank, key)
    assert failed == ["RuntimeError", "WriteError"], failed  # rank 0: never committed


def _resave_with_a_late_rank(rank, world, root, signal):
    """Save step 4 again; rank 1 saves only once rank 0 has looked at the folder."""
    model, opt = _rollback(rank, root)
    newest_meanwhile = None
    if rank == 1:
        deadline = time.monotonic() + 120
        while not Path(signal).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    checkpoint.save(root, model, opt, step=4, keep_last=None, timeout=120)
    if rank == 0:  # its commit must wait for rank 1's new file, not take the old one
        manifest = Path(root) / "step-00000004" / directory.MANIFEST
        deadline = time.monotonic() + 3
        while not manifest.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        found = checkpoint.latest(Path(root))
        newest_meanwhile = None if found is None else found[1].step
        Path(signal).touch()
    checkpoint.wait(root)
    return newest_meanwhile, _state(model)


def test_rank_zero_commits_a_resaved_step_only_with_every_ranks_new_file(tmp_path):
    root = str(tmp_path / "ckpt")
    run_world(_first_trajectory, 2, root)
    results = run_world(_resave_with_a_late_rank, 2, root, str(tmp_path / "go"))
    assert results[0][0] == 2, "step 4 was committed before rank 1 wrote its new file"
    for rank, (step, state) in enumerate(run_world(_resume, 2, root)):
        assert step == 4, (rank, step)
        for key, value in state.items():
            assert torch.equal(value, results[rank][1][key]), (rank, key)


def _save_twice(rank, world, root):
    """A periodic save of the last step and a final save of it, in one trajectory."""
    model, opt = _build()
    _train(model, opt, rank, 1, trajectory=3)
    checkpoint.save(root, model, opt, step=1)
    checkpoint.wait(root)
    if rank == 1:
        time.sleep(0.5)  # the others' second save first: nothing there may un-commit it
    checkpoint.save(root, model, opt, step=1)
    checkpoint.wait(root)
    return _state(model)


def test_a_step_saved_twice_in_one_trajectory_stays_committed(tmp_path):
    root = str(tmp_path / "ckpt")
    saved = run_world(_save_twice, 2, root)
    for rank, (step, state) in enumerate(run_world(_resume, 2, root)):
        assert step == 1, (rank, step)
        for key, value in state.items():
            assert torch.equal(value, saved[rank][key]), (rank, key)
