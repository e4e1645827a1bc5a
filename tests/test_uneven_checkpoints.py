"""Checkpoints of ``uneven=True`` runs whose ranks really are uneven, and their progress.

The ranks' step counts differ at a round by design, so a checkpoint saved at a round
(``step=opt.round``) must resume each rank at its own step, bit for bit where the arrivals
repeat; one whose ranks stand at different rounds is refused at load; and at another world size
the DDP-equivalent progress carries over.

Deterministic uneven runs: ``_uneven.straight`` and ``_uneven.resumed``, whose ranks mix each
round at a planned step (rank ``r`` mixes round ``j`` at its step ``H - 1 + j * PERIODS[r]``, or
where ``_uneven.adaptive_plan`` puts it for adaptive periods).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _harness import run_world
from _uneven import (
    ADAPTIVE,
    PERIODS,
    PLANNED,
    H,
    adaptive_plan,
    build,
    mixing_step,
    resumed,
    straight,
    train_planned,
    train_step,
)
from test_optim_multiprocess import _model

from decent_optim import checkpoint
from decent_optim.optim.agreement import AgreementError


@pytest.mark.multiprocess
@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("how", ["checkpoint.load", "load_state_dict"])
def test_a_checkpoint_of_really_uneven_ranks_resumes_bit_for_bit(how, adaptive, tmp_path):
    save_round, until = 4, 7
    periods = adaptive_plan(until) if adaptive else PERIODS
    options = ADAPTIVE if adaptive else None
    first = run_world(straight, 2, str(tmp_path), periods, save_round, until, options)
    for rank, (_, mixed_at, _, _) in enumerate(first):  # the plan held: the test is valid
        assert mixed_at == [mixing_step(periods[rank], j) for j in range(1, until + 1)]
    counts = [saved["count"] for *_, saved in first]
    assert counts[0] > counts[1], f"the ranks should be at different steps at the save: {counts}"
    if adaptive:  # the slow rank's periods were shortened before the save
        assert periods[1][save_round] - periods[1][save_round - 1] < H
    again = run_world(resumed, 2, str(tmp_path), periods, until, how, options)
    for (x, mixed_at, progress, saved), (y, mixed_again, progress_again, at_load) in zip(
        first, again
    ):
        assert at_load == saved["progress"]
        assert mixed_again == [m for m in mixed_at if m >= saved["count"]]
        assert progress_again == progress[saved["count"] :]
        assert torch.equal(x, y)


def _saved_at_a_step(rank, n, folder, periods, at):
    """Every rank saves at its own step ``at`` (not at a round), then trains on."""
    model = _model()
    opt = build(model, **PLANNED)
    rounds = []

    def after(t):
        if t == at:
            checkpoint.save(Path(folder, "dir"), model, opt, step=t)
            torch.save({"opt": opt.state_dict()}, Path(folder, f"rank{rank}.pt"))
            rounds.append(opt.round)

    train_planned(rank, model, opt, 0, folder, "save", periods, 5, after)
    checkpoint.wait(Path(folder, "dir"))
    return rounds[0]


def _refused(rank, n, folder, how):
    model = _model()
    opt = build(model, **PLANNED)
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
    opt = build(model, **{**PLANNED, **options})
    checkpoint.load(Path(folder, "dir"), model, opt)
    at_load = opt.progress
    opt.stop_at(budget)
    at_once, progress, t = opt.stopped, [], 100
    while not opt.stopped and len(progress) < most:
        train_step(model, opt, rank, t, in_time=True)
        progress.append(opt.progress)
        t += 1
    return at_load, progress, at_once


@pytest.mark.multiprocess
@pytest.mark.parametrize("new_world", [1, 3])
def test_uneven_progress_carries_over_to_another_world_size(new_world, tmp_path):
    saved = [s for *_, s in run_world(straight, 2, str(tmp_path), PERIODS, 3, 4)]
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
    opt = build(model, **{**PLANNED, **options})
    for t in range(steps):
        train_step(model, opt, rank, t)
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
