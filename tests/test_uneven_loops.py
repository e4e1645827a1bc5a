"""The loops users write with ``uneven=True``: refused, clear errors, collectives, the budget, the cap.

With uneven speeds the ranks take different numbers of steps, so whatever a rank does at its own
step count happens at a different round on each rank. These tests inject exactly that: a loop
of ``for step in range(N)``, collectives at the own step count, a rank that leaves its loop
early, collectives of the user's own at rounds, a budget raised after the stop, numpy numbers,
and speeds ten times apart (the cap on steps per period, checked against the dense reference of
``test_uneven``).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from _harness import run_world, run_world_fresh, wait_for_the_other_ranks
from _uneven import build, run_uneven, train_step, vector
from test_optim_multiprocess import _model
from test_uneven import _reference

import decent_optim as dopt
from decent_optim.gossip import GossipError
from decent_optim.optim.agreement import AgreementError

# -- a loop of `for step in range(N)` ----------------------------------------------------------------


def test_a_loop_without_a_budget_is_refused_at_its_first_step_with_the_loop_to_write():
    model = _model()
    opt = build(model, 2, budget=None)
    with pytest.raises(RuntimeError, match=r"before opt\.stop_at") as err:
        train_step(model, opt, 0, 0)
    assert "while not opt.stopped" in str(err.value) and "opt.round" in str(err.value)
    before = vector(model)
    opt.stop_at(4)  # then it trains
    train_step(model, opt, 0, 0)
    assert not torch.equal(before, vector(model))


def _leaves_early(rank, n):
    """Rank 0 leaves a `for step in range(6)` loop (alive, busy elsewhere); rank 1 loops on
    opt.stopped as documented."""
    model = _model()
    opt = build(model, 2, timeout=3)
    started = time.monotonic()
    try:
        if rank == 0:
            for t in range(6):
                train_step(model, opt, rank, t)
            # e.g. evaluating alone, or waiting at a barrier of its own, until rank 1 gave up
            wait_for_the_other_ranks()
            return "left", 0.0, ""
        t = 0
        while not opt.stopped:
            train_step(model, opt, rank, t)
            time.sleep(0.02)
            t += 1
    except GossipError as err:
        return "raised", time.monotonic() - started, str(err)
    return "finished", 0.0, ""


@pytest.mark.multiprocess
def test_a_rank_that_leaves_its_loop_early_gives_its_neighbour_a_clear_error_in_time():
    _, (what, seconds, message) = run_world_fresh(_leaves_early, 2)
    assert what == "raised", "the neighbour kept training without rank 0's rounds"
    assert seconds < 3 + 5, seconds
    assert "timeout 3 s" in message, message
    # the hint names the cause (a loop of the own step count) and the loop to write
    assert "for step in range(N)" in message and "while not opt.stopped" in message, message


# -- collectives -----------------------------------------------------------------------------------


def _averaged_at_own_steps(rank, n):
    """The habit of every other mode: evaluate when the own step count is a multiple of 5.
    Rank 1 is much slower, so the ranks reach their 5th step at different rounds. (The
    timeout also bounds the wait for the round left in flight when the optimizer is freed.)"""
    model = _model()
    opt = build(model, 2, timeout=5)
    for t in range(40):
        train_step(model, opt, rank, t)
        time.sleep(0.2 * rank)
        if t % 5 == 4:
            try:
                with opt.averaged(model):
                    pass
            except AgreementError as err:
                return opt.round, str(err)
    return opt.round, ""


@pytest.mark.multiprocess
def test_a_collective_at_different_rounds_is_a_clear_error_on_every_rank():
    (round0, msg0), (round1, msg1) = run_world_fresh(_averaged_at_own_steps, 2)
    assert round0 != round1, "the ranks should be at different rounds (the test would be vacuous)"
    for message in (msg0, msg1):
        assert "opt.averaged(): the ranks disagree on the round" in message, message
        assert f"rank 0: opt.round {round0}" in message and f"rank 1: opt.round {round1}" in message
        assert "opt.round % k == 0" in message, message
    assert msg0 == msg1


LOCAL_STEPS = 2  # of the run below: its stop may read up to this far below the budget


def _collectives_at_rounds(rank, n, budget, more):
    """Uneven speeds; at every other round, a collective of the user's own and an average;
    after the stop, a larger budget goes on."""
    import torch.distributed as dist

    model = _model()
    opt = build(model, LOCAL_STEPS, budget=None, timeout=60)
    sums, stops, last, t = [], [], -1, 0
    for total in (budget, budget + more):
        opt.stop_at(total)
        while not opt.stopped:
            train_step(model, opt, rank, t)
            time.sleep(0.01 * rank)
            t += 1
            if opt.round % 2 == 0 and opt.round != last:
                last = opt.round
                ones = torch.ones(3)
                dist.all_reduce(ones)  # the user's own collective, on the world group
                sums.append(ones.tolist())
                with opt.averaged(model):
                    pass
        stops.append((opt.round, opt.progress))
    return sums, stops, t


@pytest.mark.multiprocess
def test_collectives_of_the_users_at_rounds_and_a_budget_raised_after_the_stop():
    budget, more = 12, 8
    (sums0, stops0, steps0), (sums1, stops1, steps1) = run_world(
        _collectives_at_rounds, 2, budget, more
    )
    assert steps0 > steps1, "rank 0 should take more steps (the test would be vacuous)"
    assert len(sums0) == len(sums1) >= 3
    assert all(s == [2.0, 2.0, 2.0] for s in sums0 + sums1), (sums0, sums1)
    # both stops on both ranks at the same round, each at its budget within a period: the rule
    # is S_k / n + H >= budget at the round, and a slow rank may mix it after fewer than H
    # steps of its own, so its progress can read up to H below (19.5 of 20 seen under load)
    assert [r for r, _ in stops0] == [r for r, _ in stops1]
    for stops in (stops0, stops1):
        low, high = stops
        assert low[1] >= budget - LOCAL_STEPS and high[1] >= budget + more - LOCAL_STEPS, stops
    assert stops0[1][0] > stops0[0][0], "the raised budget did not train on"


def test_a_budget_raised_after_the_stop_trains_on_and_a_reached_one_stays_stopped():
    model = _model()
    opt = build(model, 4, budget=10)
    t = 0
    while not opt.stopped:
        train_step(model, opt, 0, t)
        t += 1
    assert t == 12
    opt.stop_at(11)  # reached already: still stopped
    assert opt.stopped
    opt.stop_at(20)
    assert not opt.stopped
    while not opt.stopped:
        train_step(model, opt, 0, t)
        t += 1
    # the stopping step launched no round, so the next leaves after step 13 (mixed at 17,
    # 13 + 4 < 20) and the one after at 17 (mixed at 21, 17 + 4 >= 20)
    assert t == 21 and opt.progress == 21


# -- numbers from numpy ----------------------------------------------------------------------------


def test_numpy_numbers_are_numbers():
    model = _model()
    opt = build(model, np.int64(2), budget=None)
    opt.stop_at(np.int64(4))
    opt.stop_at(np.float32(4.0))
    t = 0
    while not opt.stopped:
        train_step(model, opt, 0, t)
        t += 1
    assert t == 4
    outer = dopt.LocalOuterSGD(lr=np.float64(0.5), momentum=np.float32(0.5), every=np.int64(32))
    assert outer == dopt.LocalOuterSGD(lr=0.5, momentum=0.5, every=32)
    assert repr(outer) == repr(dopt.LocalOuterSGD(lr=0.5, momentum=0.5, every=32))
    assert repr(dopt.OuterSGD(lr=np.float64(0.7))) == repr(dopt.OuterSGD(lr=0.7))
    assert dopt.Uneven(cap=np.int64(3)) == dopt.Uneven(cap=3)
    with pytest.raises(ValueError, match="Uneven.cap must be a number >= 1"):
        dopt.Uneven(cap=0.5)


# -- the cap on steps per period -------------------------------------------------------------------


def _longest_period(mixed_at, local_steps):
    """The most steps a rank took from a launch to the step that mixed that round."""
    launches = [local_steps - 1] + mixed_at[:-1]  # round 1 after local_steps steps, then at mixes
    return max(m - a for a, m in zip(launches, mixed_at))


def _capped(cap):
    return dict(uneven=dopt.Uneven(cap=cap))  # run_uneven's options


@pytest.mark.multiprocess
def test_the_cap_bounds_the_fast_ranks_steps_per_period_and_matches_the_reference():
    local_steps, sleeps, budget = 2, [0.003, 0.04], 16
    free = run_world(run_uneven, 2, sleeps, budget, local_steps, _capped(None))
    capped = run_world(run_uneven, 2, sleeps, budget, local_steps, _capped(2))
    assert _longest_period(free[0][2], local_steps) > 2 * local_steps, "no drift to bound"
    assert _longest_period(capped[0][2], local_steps) <= 2 * local_steps
    # the capped schedule is still the uneven schedule, replayed in float64
    want = _reference(2, "ring", local_steps, capped)
    got = torch.stack([r[0] for r in capped])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
