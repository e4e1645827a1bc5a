"""The optimizer, training loops and resume loops that the tests of ``uneven=True`` share.

Test files import it by its top-level name, as ``_harness`` (``tests/conftest.py`` puts ``tests/``
on ``sys.path``); the functions taking ``(rank, n, ...)`` run on the ranks of ``run_world``.

- :func:`build`: test_optim_multiprocess's DecentralizedAdamW on its test model, with a budget
  (``uneven=True`` steps only with one; the tests' loops usually end first).
- :func:`train`: steps on test_optim_multiprocess's loss; ``in_time`` gives the round in flight
  time to arrive before each step, so that ``uneven=True`` mixes where the step-locked schedule
  mixes (the way to compare the two bit for bit).
- :func:`run_uneven`: ranks at the speeds of their sleeps, recording what the dense references
  replay (the 0-based steps that mixed a round).
- :func:`resume_in_memory` and :func:`save_or_resume`: an uninterrupted run and one resumed from
  its checkpoint (``torch.save`` of the model's and the optimizer's ``state_dict``).
- :func:`straight` and :func:`resumed`: the same for really uneven ranks whose rounds are mixed at
  planned steps (:func:`train_planned`), saved at a round (``step=opt.round``).
"""

from __future__ import annotations

import io
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from test_optim_multiprocess import OPTIMIZERS, _loss, _model, _param_groups
from torch import nn

import decent_optim as dopt
from decent_optim import checkpoint

NAME = "DecentralizedAdamW"
SMALL_BUCKETS = 64 / 2**20  # bucket_cap_mb for several buckets per parameter group


def vector(model: nn.Module) -> torch.Tensor:
    return nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def build(model, local_steps=3, *, topology="ring", uneven=True, budget=10**6, **options):
    """NAME's settings of test_optim_multiprocess on the test model's two parameter groups (on
    ``model.parameters()`` for another model), then ``opt.stop_at(budget)`` unless it is None."""
    cls, kwargs, *_ = OPTIMIZERS[NAME]
    groups = _param_groups(model) if isinstance(model, nn.Sequential) else model.parameters()
    opt = cls(
        groups, **kwargs, topology=topology, local_steps=local_steps, uneven=uneven, **options
    )
    if budget is not None:
        opt.stop_at(budget)
    return opt


def wait_for_round(opt) -> None:
    """Until the transfers of the round in flight (and its deferred steps) are done."""
    opt._rounds.wait()


def train_step(model, opt, rank: int, t: int, in_time: bool = False) -> None:
    if in_time:
        wait_for_round(opt)
    opt.zero_grad()
    _loss(model, rank, t).backward()
    opt.step()


def train(model, opt, rank: int, start: int, stop: int, in_time: bool = False) -> None:
    for t in range(start, stop):
        train_step(model, opt, rank, t, in_time)


class Run(NamedTuple):
    params: torch.Tensor
    steps: int
    mixed_at: list[int]  # the 0-based steps whose take() mixed a round
    progress: float
    rounds: int  # rounds mixed
    totals: list[float]  # the ranks' summed step counts read at each mixing step


def run_uneven(rank, n, sleeps, budget, local_steps, options=None) -> Run:
    """Train until the budget with ``sleeps[rank]`` seconds per step; ``options``: more
    arguments of :func:`build` (its timeout is 60 s unless given)."""
    model = _model()
    opt = build(model, local_steps, budget=budget, **{"timeout": 60, **(options or {})})
    steps, mixed_at, totals = 0, [], []
    while not opt.stopped:
        time.sleep(sleeps[rank])
        before = opt.round  # rounds mixed
        train_step(model, opt, rank, steps)
        if opt.round != before:
            mixed_at.append(steps)
            # the ranks' summed steps at the round just mixed, as its checkpoint records them
            totals.append(opt.state_dict()["decent_optim"]["local_steps"]["uneven"]["total"])
        steps += 1
    return Run(vector(model), steps, mixed_at, opt.progress, opt.round, totals)


def run_in_time(rank, n, steps, options) -> torch.Tensor:
    """``steps`` steps with rounds in time (:func:`train`); ``options``: :func:`build`'s."""
    model = _model()
    opt = build(model, **options)
    train(model, opt, rank, 0, steps, in_time=True)
    return vector(model)


class Resumed(NamedTuple):
    straight: torch.Tensor  # the parameters of the uninterrupted run
    resumed: torch.Tensor  # ... and of the resumed one
    progress: float
    resumed_progress: float
    noted: Any  # what ``note(opt)`` said at the save


def resume_in_memory(rank, make, save_at, steps, in_time=False, note=None) -> Resumed:
    """``steps`` steps in one go on ``make()``'s model and optimizer, and again from their
    checkpoint after ``save_at`` steps loaded into a new pair from ``make()``."""
    model, opt = make()
    train(model, opt, rank, 0, save_at, in_time)
    noted = None if note is None else note(opt)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    train(model, opt, rank, save_at, steps, in_time)
    straight, progress = vector(model), opt.progress
    opt.synchronize()  # no round of the old optimizer left in flight for the new one's
    del opt
    model, opt = make()
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    train(model, opt, rank, save_at, steps, in_time)
    return Resumed(straight, vector(model), progress, opt.progress, noted)


def save_or_resume(rank, model, opt, path, save_at, steps, resume, before_save=None):
    """``steps`` steps with rounds in time; the uninterrupted run (``resume`` false) saves to
    ``path`` after ``save_at`` steps (``before_save(opt)`` first), the resumed one loads that
    file and takes the steps after. Returns the parameters."""
    start = 0
    if resume:
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = save_at
    for t in range(start, steps):
        train_step(model, opt, rank, t, in_time=True)
        if t + 1 == save_at and not resume:
            if before_save is not None:
                before_save(opt)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    return vector(model)


# -- really uneven ranks, rounds mixed at planned steps ------------------------------------------
# Rank r mixes round j at its step H - 1 + j * PERIODS[r] (0-based), or, with adaptive periods,
# at the step adaptive_plan() derives from the period rule (rank 0 twice as fast as rank 1, the
# slow one). The fast ranks must not find a round in before that step: a round is complete
# nowhere before every rank has launched it, so the slow rank SLOW holds back each launch of
# round j until every fast rank is at its mixing step of j (their step counts are posted in
# files). At a mixing step a rank waits for the round's transfers, so each
# round is mixed exactly where planned -- also after a resume, where the round in flight is sent
# again by the first step.

H = 2  # local_steps
PERIODS = (2 * H, H)  # rank 0 takes twice the steps of rank 1 per period
SLOW = 1
# build()'s options; the plan fixes the periods (adaptive ones: adaptive_plan and its options)
PLANNED = dict(
    local_steps=H, bucket_cap_mb=SMALL_BUCKETS, timeout=60, uneven=dopt.Uneven(adaptive=False)
)
ADAPTIVE = dict(uneven=dopt.Uneven(adaptive=True))


def mixing_step(period: int | list[int], j: int) -> int:
    """The 0-based step at which a rank of ``period`` steps per period mixes round ``j`` (the
    step that launches round ``j + 1``; ``j = 0``: the one that launches round 1); a list:
    the planned steps themselves."""
    return period[j] if isinstance(period, list) else H - 1 + j * period


def period_rule(local_steps: int, own: int, mean: float) -> int:
    """The period of a rank that took ``own`` steps where the ranks took ``mean`` (the rule of
    decent_optim.optim.uneven_periods, written again here from its docstring)."""
    return min(local_steps, max(1, int(local_steps * own / mean + 0.5)))


def adaptive_plan(until: int) -> tuple[list[int], list[int]]:
    """The mixing steps of rounds 0..until of a fast rank 0 taking twice the steps of the slow
    rank 1, whose periods follow the rule: after mixing round j >= 2, a rank that took c_i steps
    between launching rounds j - 1 and j (mean c) takes min(H, max(1, floor(H c_i / c + 1/2)))
    before it launches round j + 1 and the later ones."""
    periods, launch, mixing = [H, H], [[H], [H]], [[H - 1], [H - 1]]
    for j in range(1, until + 1):
        taken = [2 * periods[1], periods[1]]
        assert taken[0] >= periods[0]
        for r in (0, 1):
            mixing[r].append(launch[r][-1] + taken[r] - 1)
            launch[r].append(mixing[r][-1] + 1)
        if j >= 2:
            own = [launch[r][j - 1] - launch[r][j - 2] for r in (0, 1)]
            periods = [period_rule(H, c, sum(own) / 2) for c in own]
    return mixing[0], mixing[1]


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


def train_planned(rank, model, opt, t, folder, phase, periods, until, after=None):
    """Steps ``t, t + 1, ...`` until round ``until`` is mixed, as planned, calling
    ``after(steps done)`` after each. Returns the steps that mixed a round and the progress
    after every step."""
    mine = periods[rank]
    fast = [s for s in range(len(periods)) if s != SLOW]
    plan = {mixing_step(mine, j): j for j in range(0, until + 1)}
    first, mixed_at, progress = True, [], []
    while opt.round < until:
        entry = opt.state_dict()["decent_optim"] if first else None
        # the round this step launches: the one in flight after a resume, or the next one
        resent = entry is not None and entry["pending"]
        launches = entry["local_steps"]["uneven"]["launched"] if resent else plan.get(t, -2) + 1
        if rank == SLOW and 1 <= launches <= until:
            for s in fast:
                _wait_for(folder, phase, s, mixing_step(periods[s], launches))
        if plan.get(t, 0) >= 1:
            opt._rounds.wait()  # the round must be mixed at this step
        before = opt.round
        train_step(model, opt, rank, t)
        first, t = False, t + 1
        _post(folder, phase, rank, t)
        progress.append(opt.progress)
        if opt.round != before:
            mixed_at.append(t - 1)
        if after is not None:
            after(t)
    return mixed_at, progress


def straight(rank, n, folder, periods, save_round, until, options=None):
    """The uninterrupted planned run; at round ``save_round`` every rank saves (directory
    checkpoint and its own torch.save file) at its own step. ``options``: more of build()'s."""
    model = _model()
    opt = build(model, **{**PLANNED, **(options or {})})
    saved: dict[str, float] = {}

    def after(t):
        if opt.round == save_round and not saved:
            checkpoint.save(Path(folder, "dir"), model, opt, step=opt.round, extra={"t": t})
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "t": t}
            torch.save(state, Path(folder, f"rank{rank}.pt"))
            saved.update(count=t, progress=opt.progress)

    mixed_at, progress = train_planned(
        rank, model, opt, 0, folder, "straight", periods, until, after
    )
    checkpoint.wait(Path(folder, "dir"))
    return vector(model), mixed_at, progress, saved


def resumed(rank, n, folder, periods, until, how, options=None):
    """:func:`straight`'s run resumed from its save (``how``: "checkpoint.load" or
    "load_state_dict"). Returns what :func:`straight` does, with the progress at the load."""
    model = _model()
    opt = build(model, **{**PLANNED, **(options or {})})
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
    mixed_at, progress = train_planned(rank, model, opt, t, folder, how, periods, until)
    return vector(model), mixed_at, progress, at_load
