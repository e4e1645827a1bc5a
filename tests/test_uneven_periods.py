"""``Uneven(adaptive=True)``: a rank slower than the mean launches its rounds after fewer steps.

The rule, from the module docstring of decent_optim.optim.uneven and written here on its own:
after mixing round k, a rank that took ``c_i`` steps between launching rounds k - 1 and k, where
the ranks took ``mean`` on average, takes ``min(H, max(1, floor(H c_i / mean + 1/2)))`` steps
before launching round k + 2 (the period in force at the next launch). The tests record at
which of its own steps each rank mixed each round (a rank launches round k + 1 right after the
step that mixes round k) and check the periods against the rule, the parameters against the
dense float64 replay of test_uneven, and the drift against fixed periods.
"""

from __future__ import annotations

import pytest
import torch
from _harness import run_world
from _uneven import SMALL_BUCKETS, period_rule, run_uneven
from test_uneven import _reference

import decent_optim as dopt

H = 4


def _launches(mixed_at: list[int]) -> list[int]:
    """A rank's step count when it launched rounds 1, 2, ...: round 1 after its H-th step,
    round k + 1 right after the step that mixed round k (0-based step index + 1)."""
    return [H] + [s + 1 for s in mixed_at]


def _planned_periods(runs) -> list[list[int]]:
    """The rule's period of each rank for rounds 1, 2, ... (H until two rounds are mixed)."""
    n = len(runs)
    launches = [_launches(r[2]) for r in runs]
    rounds = len(runs[0][2])
    periods = [[H] * rounds for _ in range(n)]
    for k in range(2, rounds):  # mixing round k (1-based) sets the period of round k + 1
        own = [launches[i][k - 1] - launches[i][k - 2] for i in range(n)]
        mean = sum(own) / n
        for i in range(n):
            periods[i][k] = period_rule(H, own[i], mean)
    return periods


def _taken(run) -> list[int]:
    """Steps a rank took between launching each round and mixing it (the mixing step included)."""
    launches = _launches(run[2])
    return [run[2][k] + 1 - launches[k] for k in range(len(run[2]))]


def _run(rank, n, sleeps, budget, adaptive):
    options = dict(uneven=dopt.Uneven(adaptive=adaptive), bucket_cap_mb=SMALL_BUCKETS)
    return run_uneven(rank, n, sleeps, budget, H, options)


SLEEPS = [0.004, 0.004, 0.04]  # rank 2 ten times slower than the others


@pytest.mark.multiprocess
def test_periods_follow_the_rule_and_the_slow_rank_shortens_its_own():
    n, budget = 3, 150
    runs = run_world(_run, n, SLEEPS, budget, True)
    planned = _planned_periods(runs)
    for i, run in enumerate(runs):
        taken = _taken(run)
        # a rank mixes at its period's last step or later (when the round is late), never before
        assert all(t >= p for t, p in zip(taken, planned[i])), (i, taken, planned[i])
    slow = _taken(runs[2])[2:]
    assert planned[2][2:] and all(p == 1 for p in planned[2][3:]), planned[2]
    # the slow rank is the one the others wait for: its rounds are in when its period ends
    assert sum(t == 1 for t in slow) >= 0.7 * len(slow), slow
    # and the mixes are those of the dense replay of the recorded schedule
    want = _reference(n, "ring", H, runs)
    got = torch.stack([r[0] for r in runs])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)


@pytest.mark.multiprocess
def test_fast_ranks_drift_through_fewer_steps_than_with_fixed_periods():
    n, budget = 3, 150
    fixed = run_world(_run, n, SLEEPS, budget, False)
    adaptive = run_world(_run, n, SLEEPS, budget, True)

    def fast_steps_per_period(runs):
        taken = [t for r in runs[:2] for t in _taken(r)[3:]]
        return sum(taken) / len(taken)

    # fixed: the fast ranks fill the slow rank's H steps (about 10 H of theirs, the cap 8 H);
    # adaptive: its one step (about 10 of theirs)
    assert fast_steps_per_period(adaptive) < 0.5 * fast_steps_per_period(fixed), (
        fast_steps_per_period(adaptive),
        fast_steps_per_period(fixed),
    )
    # the same budget is reached either way, by every rank at the same round
    for runs in (fixed, adaptive):
        assert len({r[4] for r in runs}) == 1
        assert all(r[3] >= budget - H + 1 for r in runs)  # see test_uneven


@pytest.mark.parametrize("adaptive", [1, "yes", None])
def test_adaptive_must_be_a_bool(adaptive):
    with pytest.raises(TypeError, match="Uneven.adaptive must be True or False"):
        dopt.Uneven(adaptive=adaptive)
