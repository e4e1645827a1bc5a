"""Checkpoints of a run with live membership (issue 42): saved after a change, resumed from disk.

Four gloo ranks train the small float64 model of ``_live`` with DecentralizedAdamW,
``membership=`` and int8 compression; every rank saves step ``EARLY`` into one folder (world size 4); rank 2
SIGKILLs itself when it should save step ``CUT`` (the others have saved it: rank 0's commit
waits for a file that never comes and must give up, not hold the next save), and the three
survivors save step ``LATE`` into the same folder (world size 3), then train on to ``STEPS``. A fresh world of three (new processes, a
plain ``init_process_group``, no membership) loads the folder: it must pick step ``LATE`` (not
be confused by the older checkpoint of another world size), hold exactly the state the
survivors saved, and train on to the very bits the survivors reached without stopping (each
restarted rank draws the data of the survivor whose file it loaded, kept in ``extra``). The
same restart after a run with ``membership=`` (exact gossip) in which nobody failed.
"""

from __future__ import annotations

import os
import signal
import warnings

import _live
import pytest
import torch
from _harness import run_world, run_world_fresh

TIMEOUT = 12.0  # seconds: the membership agreement's bound on each wait (3 s, then 8 s, were too
# short for rank 0 on a loaded machine: held in its commit at the cut, which gives up half this
# after the change, it posted too late and the others declared it dead)
PATIENT = 30.0  # the optimizer's timeout: a loss is noticed by a closed connection or the store
VICTIM = 2
EARLY, CUT, LATE = 2, 4, 10  # the steps saved: by 4 ranks, by 3 of 4 (the kill), by 3
STEPS, LR = _live.STEPS, _live.LR


def _optimizer(model, compression, membership=None):
    return _live.ring(model.parameters(), compression, membership, timeout=PATIENT)


def _copy(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    return value


def _state(model, opt):
    return {"model": _copy(model.state_dict()), "optimizer": _copy(opt.state_dict())}


def _live_run(rank, world_size, path, compression, kill):
    import torch.distributed as dist

    from decent_optim import checkpoint
    from decent_optim.gossip.membership import Membership

    store = dist.FileStore(os.path.join(path, "store"), -1)
    model = _live.model()
    opt = _optimizer(model, compression, Membership(store, prefix="live", timeout=TIMEOUT))
    root, out = os.path.join(path, "ckpt"), {}
    for t in range(STEPS):
        _live.loss(model, rank, t).backward()
        opt.step()
        opt.zero_grad()
        if kill and (rank, t + 1) == (VICTIM, CUT):
            os.kill(os.getpid(), signal.SIGKILL)
        if t + 1 in (EARLY, CUT, LATE):  # a round is in flight: the restart runs it again
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                checkpoint.save(root, model, opt, step=t + 1, extra={"member": rank})
                checkpoint.wait(root)  # on rank 0 at CUT: until the others start the change
            out[t + 1] = _state(model, opt)
            out["warned", t + 1] = [str(w.message) for w in said]
            out["steps", t + 1] = sorted(os.listdir(root))
    out["final"], out["view"] = _live.flat(model.parameters()), tuple(opt.membership)
    return out


def _restart(rank, world_size, path, compression):
    from decent_optim import checkpoint

    model = _live.model(seed=7)  # other values: everything must come from the file
    opt = _optimizer(model, compression)
    resumed = checkpoint.load(os.path.join(path, "ckpt"), model, opt)
    out = {"resumed": (resumed.step, resumed.saved_world_size, resumed.source)}
    out["loaded"] = _state(model, opt)
    _live.train(model, opt, resumed.extra["member"], resumed.step)
    out["final"] = _live.flat(model.parameters())
    return out


def _same(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), (where, a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(a), sorted(b))
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _check_restart(saved, restarted, step, world_size):
    assert len(saved) == len(restarted) == world_size
    for rank, (before, after) in enumerate(zip(saved, restarted)):
        assert after["resumed"] == (step, world_size, "own"), after["resumed"]
        _same(before[step], after["loaded"], f"rank {rank}")
        assert torch.equal(after["final"], before["final"]), (rank, after, before["final"])


@pytest.mark.multiprocess
def test_survivors_checkpoint_resumes_in_a_fresh_world_of_their_size(tmp_path):
    """With int8 compression, so that the public copies of the new groups are saved and
    restored too (exact gossip takes the same path, without them)."""
    path, compression = str(tmp_path), "int8"
    run = run_world_fresh(_live_run, 4, path, compression, True, timeout=90, killed=(VICTIM,))
    survivors = [run[r] for r in range(4) if r != VICTIM]
    assert [out["view"][1] for out in survivors] == [(0, 1, 3)] * 3
    # rank 0's commit of CUT gave up on the lost rank's file, with a warning
    assert run[0]["steps", CUT] == ["step-00000002", "step-00000004"], run[0]["steps", CUT]
    assert not os.path.exists(os.path.join(path, "ckpt", "step-00000004", "manifest.json"))
    (said,) = run[0]["warned", CUT]
    assert "step 4" in said and "is not committed: the group changed" in said, said
    assert all(not out["warned", LATE] for out in survivors)
    restarted = run_world(_restart, 3, path, compression, timeout=90)
    _check_restart(survivors, restarted, LATE, 3)
    # the load took the newest complete checkpoint and removed the incomplete one
    assert sorted(os.listdir(os.path.join(path, "ckpt"))) == ["step-00000002", "step-00000010"]


@pytest.mark.multiprocess
def test_restart_after_a_run_with_membership_and_no_failure(tmp_path):
    path = str(tmp_path)
    run = run_world_fresh(_live_run, 4, path, None, False, timeout=90)
    restarted = run_world(_restart, 4, path, None, timeout=90)
    _check_restart(run, restarted, LATE, 4)
