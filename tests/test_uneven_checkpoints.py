"""Checkpoints of ``uneven=True`` runs whose ranks really are uneven, and their progress.

The ranks' step counts differ at a round by design, so a checkpoint saved at a round
(``step=opt.round``) must resume each rank at its own step, bit for bit where the arrivals
repeat; one whose ranks stand at different rounds is refused at load; and at another world size
the DDP-equivalent progress carries over.

Deterministic uneven runs (:func:`_train`): rank ``r`` mixes round ``j`` at its step
``H - 1 + j * PERIODS[r]`` (0-based), or, with adaptive periods, at the step that
:func:`_adaptive_plan` derives from the rule of decent_optim.optim.uneven_periods (rank 0 twice
as fast as rank 1, the slow one). The fast ranks must not find a
round in before that step: a round is complete nowhere before every rank has launched it (its
step counts travel in one all-reduce), so the ranks with period ``H`` hold back each launch of
round ``j`` until every fast rank is at its mixing step of ``j`` (their step counts are posted
in files). At a mixing step a rank waits for the round's transfers, as ``tests/test_uneven.py``
does, so each round is mixed exactly where planned -- also after a resume, where the round in
flight is sent again by the first step.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from _harness import run_world
from test_optim_multiprocess import OPTIMIZERS, _loss, _model, _param_groups
from test_uneven import NAME, _vector

import decent_optim as dopt
from decent_optim import checkpoint
from decent_optim.optim.agreement import AgreementError

H = 2  # local_steps
PERIODS = (2 * H, H)  # rank 0 takes twice the steps of rank 1 per period
SLOW = 1
# the planned schedule fixes every rank's period; adaptive periods: tests/test_uneven_periods.py
FIXED = dopt.Uneven(adaptive=False)


def _build(model, local_steps=H, uneven=FIXED, **extra):
    cls, kwargs, *_ = OPTIMIZERS[NAME]
    opt = cls(
        _param_groups(model),
        **kwargs,
        topology="ring",
        bucket_cap_mb=64 / 2**20,  # several buckets per group
        local_steps=local_steps,
        uneven=uneven,
        **extra,
    )
    opt.stop_at(10**6)  # uneven=True steps only with a budget; the tests' loops end first
    return opt


def _mixing_step(period: int | list[int], j: int) -> int:
    """The 0-based step at which a rank of ``period`` steps per period mixes round ``j`` (the
    step that launches round ``j + 1``; ``j = 0``: the one that launches round 1); a list: the
    planned steps themselves."""
    return period[j] if isinstance(period, list) else H - 1 + j * period


def _adaptive_plan(until: int) -> tuple[list[int], list[int]]:
    """The mixing steps of rounds 0..until of a fast rank 0 taking twice the steps of the slow
    rank 1, whose periods follow the rule: after mixing round j >= 2, a rank that took c_i steps
    between launching rounds j - 1 and j (mean c) takes min(H, max(1, floor(H c_i / c + 1/2)))
    before launching round j + 1 on."""
    periods, launch, mixing = [H, H], [[H], [H]], [[H - 1], [H - 1]]
    for j in range(1, until + 1):
        taken = [2 * periods[1], periods[1]]
        assert taken[0] >= periods[0]
        for r in (0, 1):
            mixing[r].append(launch[r][-1] + taken[r] - 1)
            launch[r].append(mixing[r][-1] + 1)
        if j >= 2:
            own = [launch[r][j - 1] - launch[r][j - 2] for r in (0, 1)]
            periods = [min(H, max(1, int(H * c / (sum(own) / 2) + 0.5))) for c in own]
    return mixing[0], mixing[1]


ADAPTIVE = dopt.Uneven(adaptive=True)


def _post(folder: str, phase: str, rank: int, count: int) -> None:
    path = os.path.join(folder, f"{phase}-{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(str(count))
    os.replace(path + ".tmp", path)


def _wait_for(folder: str, phase: str, rank: int, count: int) -> None:
    path, deadline = os.path.join(folder, f"{phase}-{rank}"), time.monotonic() + 120
    while True:
        try:
            with open(path) as f:
                if int(f.read() or -1) >= count:
                    return
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank} did not reach step {count} ({phase})")
        time.sleep(0.002)


def _train(rank, model, opt, t, folder, phase, periods, until, after=None):
    """Steps ``t, t + 1, ...`` until round ``until`` is mixed, as planned (module docstring),
    calling ``after(steps done)`` after each. Returns the steps that mixed a round and the
    progress after every step."""
    mine = periods[rank]
    fast = [s for s in range(len(periods)) if s != SLOW]
    plan = {_mixing_step(mine, j): j for j in range(0, until + 1)}
    first, mixed_at, progress = True, [], []
    while opt.round < until:
        rounds = opt._rounds
        # the round this step launches: the one in flight after a resume, or the next one
        launches = rounds.launched if first and rounds.in_flight else plan.get(t, -2) + 1
        if rank == SLOW and 1 <= launches <= until:
            for s in fast:
                _wait_for(folder, phase, s, _mixing_step(periods[s], launches))
        if plan.get(t, 0) >= 1 and rounds._waiter is not None:
            rounds._waiter.thread.join()  # the round must be mixed at this step
        before = opt.round
        opt.zero_grad()
        _loss(model, rank, t).backward()
        opt.step()
        first, t = False, t + 1
        _post(folder, phase, rank, t)
        progress.append(opt.progress)
        if opt.round != before:
            mixed_at.append(t - 1)
        if after is not None:
            after(t)
    return mixed_at, progress


def _straight(rank, n, folder, periods, save_round, until, options=None):
    """The uninterrupted run; at round ``save_round`` every rank saves (directory checkpoint
    and its own torch.save file) at its own step. ``options``: more arguments of the optimizer."""
    model = _model()
    opt = _build(model, local_steps=H, timeout=60, **(options or {}))
    saved = {}

    def after(t):
        if opt.round == save_round and not saved:
            checkpoint.save(Path(folder, "dir"), model, opt, step=opt.round, extra={"t": t})
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "t": t}
            torch.save(state, Path(folder, f"rank{rank}.pt"))
            saved.update(count=t, progress=opt.progress)

    mixed_at, progress = _train(rank, model, opt, 0, folder, "straight", periods, until, after)
    checkpoint.wait(Path(folder, "dir"))
    return _vector(model), mixed_at, progress, saved


def _resumed(rank, n, folder, periods, until, how, options=None):
    model = _model()
    opt = _build(model, local_steps=H, timeout=60, **(options or {}))
    if how == "checkpoint.load":
        t = checkpoint.load(Path(folder, "dir"), model, opt).extra["t"]
    else:
        state = torch.load(Path(folder, f"rank{rank}.pt"), weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        t = state["t"]
    at_load = opt.progress
    # a new optimizer asks at its first step whether the gradients were averaged and waits for
    # the answer at its second: the fast rank would wait for the slow one's first step, which
    # the uninterrupted run did not do here; without the question the arrivals repeat
    opt._averaged.done = True
    mixed_at, progress = _train(rank, model, opt, t, folder, how, periods, until)
    return _vector(model), mixed_at, progress, at_load


@pytest.mark.multiprocess
@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("how", ["checkpoint.load", "load_state_dict"])
def test_a_checkpoint_of_really_uneven_ranks_resumes_bit_for_bit(how, adaptive, tmp_path):
    save_round, until = 4, 7
    periods = _adaptive_plan(until) if adaptive else PERIODS
    options = {"uneven": ADAPTIVE} if adaptive else None
    straight = run_world(_straight, 2, str(tmp_path), periods, save_round, until, options)
    for rank, (_, mixed_at, _, _) in enumerate(straight):  # the plan held: the test is valid
        assert mixed_at == [_mixing_step(periods[rank], j) for j in range(1, until + 1)]
    counts = [saved["count"] for *_, saved in straight]
    assert counts[0] > counts[1], f"the ranks should be at different steps at the save: {counts}"
    if adaptive:  # the slow rank's periods were shortened before the save
        assert periods[1][save_round] - periods[1][save_round - 1] < H
    resumed = run_world(_resumed, 2, str(tmp_path), periods, until, how, options)
    for (x, mixed_at, progress, saved), (y, mixed_again, progress_again, at_load) in zip(
        straight, resumed
    ):
        assert at_load == saved["progress"]
        assert mixed_again == [m for m in mixed_at if m >= saved["count"]]
        assert progress_again == progress[saved["count"] :]
        assert torch.equal(x, y)


def _saved_at_a_step(rank, n, folder, periods, step):
    """Every rank saves at its own step ``step`` (not at a round), then trains on."""
    model = _model()
    opt = _build(model, local_steps=H, timeout=60)
    rounds = []

    def after(t):
        if t == step:
            checkpoint.save(Path(folder, "dir"), model, opt, step=t)
            torch.save({"opt": opt.state_dict()}, Path(folder, f"rank{rank}.pt"))
            rounds.append(opt.round)

    _train(rank, model, opt, 0, folder, "save", periods, 5, after)
    checkpoint.wait(Path(folder, "dir"))
    return rounds[0]


def _refused(rank, n, folder, how):
    model = _model()
    opt = _build(model, local_steps=H, timeout=60)
    try:
        if how == "checkpoint.load":
            checkpoint.load(Path(folder, "dir"), model, opt)
        else:
            opt.load_state_dict(
                torch.load(Path(folder, f"rank{rank}.pt"), weights_only=True)["opt"]
            )
    except Exception as err:
        return type(err).__name__, str(err)
    return "loaded", ""


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["checkpoint.load", "load_state_dict"])
def test_a_checkpoint_of_different_rounds_is_refused_on_every_rank(how, tmp_path):
    rounds = run_world(_saved_at_a_step, 2, str(tmp_path), PERIODS, 9)
    assert rounds[0] != rounds[1], f"the ranks should be at different rounds at step 9: {rounds}"
    got = run_world(_refused, 2, str(tmp_path), how)
    for kind, message in got:
        assert kind == AgreementError.__name__, message
        assert "the ranks disagree on the round (uneven=True)" in message
        assert f"rank 0: local_steps={H}, {rounds[0]} rounds mixed" in message
        assert "step=opt.round" in message
    assert got[0] == got[1]


# -- another world size: the progress carries over ---------------------------------------------


def _after_resize(rank, n, folder, options, budget, most):
    """Load the directory checkpoint into ``n`` ranks, set the budget, and train at even speed
    (each round given time to arrive) until it stops or ``most`` steps; returns the progress
    at the load and after every step, and whether the budget stopped the run at once."""
    model = _model()
    opt = _build(model, timeout=60, **options)
    checkpoint.load(Path(folder, "dir"), model, opt)
    at_load = opt.progress
    opt.stop_at(budget)
    at_once, progress, t = opt.stopped, [], 100
    while not opt.stopped and len(progress) < most:
        waiter = getattr(opt._rounds, "_waiter", None)
        if waiter is not None:
            waiter.thread.join()
        opt.zero_grad()
        _loss(model, rank, t).backward()
        opt.step()
        progress.append(opt.progress)
        t += 1
    return at_load, progress, at_once


@pytest.mark.multiprocess
@pytest.mark.parametrize("new_world", [1, 3])
def test_uneven_progress_carries_over_to_another_world_size(new_world, tmp_path):
    straight = run_world(_straight, 2, str(tmp_path), PERIODS, 3, 4)
    saved = [s for *_, s in straight]
    assert saved[0]["count"] != saved[1]["count"]
    # consensus: every new rank takes old rank 0's counters, so its progress
    want = saved[0]["progress"]
    budget = want + 5 * H + 1  # past twice the progress of the checkpoint's rounds
    options = dict(local_steps=H)
    runs = run_world(_after_resize, new_world, str(tmp_path), options, budget, 100)
    for at_load, progress, at_once in runs:
        assert at_load == want
        assert not at_once, "the budget was reached at once"
        # even ranks after the load: one DDP-equivalent step per step, across the mixed rounds
        assert progress == [want + k for k in range(1, len(progress) + 1)]
        assert progress[-1] >= budget and len(progress) <= budget - want + 2 * H


def _step_locked(rank, n, folder, options, steps):
    model = _model()
    opt = _build(model, timeout=60, **options)
    for t in range(steps):
        opt.zero_grad()
        _loss(model, rank, t).backward()
        opt.step()
    checkpoint.save(Path(folder, "dir"), model, opt, step=steps)
    checkpoint.wait(Path(folder, "dir"))
    return opt.progress


@pytest.mark.multiprocess
@pytest.mark.parametrize("local_steps", [1, 2])
@pytest.mark.parametrize("new_world", [1, 3])
def test_step_locked_progress_carries_over_to_another_world_size(local_steps, new_world, tmp_path):
    options = dict(local_steps=local_steps, uneven=False)
    saved = run_world(_step_locked, 2, str(tmp_path), options, 6)
    assert saved == [6.0, 6.0]
    runs = run_world(_after_resize, new_world, str(tmp_path), options, 6 + 5, 100)
    for at_load, progress, at_once in runs:
        assert at_load == 6 and not at_once
        assert progress == [6.0 + k for k in range(1, 6)]
