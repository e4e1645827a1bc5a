"""``uneven=True`` (decent_optim.optim.uneven): periods that last until the neighbours' round is in.

The ranks run at different speeds (a sleep per step on the slow ones), so each takes its own
number of steps between rounds. The dense reference replays the run from what it recorded --
at which of its own steps each rank mixed each round -- in float64, written from the module's
docstring alone: ``x_i += sum_j w_ij a_j - a_i`` before the update of the mixing step (whose
gradient was taken before the mix), the anchor taken after it. Faults (a rank that stops calling ``step()``, one that dies) are injected.
"""

from __future__ import annotations

import time

import pytest
import torch
from _harness import run_world, run_world_fresh, wait_for_the_other_ranks
from _uneven import (
    NAME,
    SMALL_BUCKETS,
    build,
    resume_in_memory,
    run_in_time,
    run_uneven,
    train_step,
)
from _uneven import vector as _vector
from reference import UPDATES, RefState, Segment
from test_optim_multiprocess import GROUP1, OPTIMIZERS, _loss, _model

import decent_optim as dopt
from decent_optim.gossip import GossipError
from decent_optim.topologies import get as get_topology

UNEVEN = dict(bucket_cap_mb=SMALL_BUCKETS)  # run_uneven's options


def _reference(n, topology, local_steps, runs, local_world_size=1):
    """The uneven schedule replayed in float64 from each rank's recorded mixing steps."""
    _, _, kind, hyper = OPTIMIZERS[NAME]
    model = _model()
    sizes = [p.numel() for p in model.parameters()]
    split = sum(sizes[:2])
    segments = [Segment(0, split, hyper), Segment(split, sum(sizes), {**hyper, **GROUP1})]
    topo = get_topology(topology, n, local_world_size)
    x = [_vector(model).double() for _ in range(n)]
    states = [[RefState() for _ in segments] for _ in range(n)]
    done = [0] * n  # steps taken by each rank

    def step(i: int, change: torch.Tensor | None = None) -> None:
        """Rank i's next step; ``change``: a round's mix, added after the gradient was taken
        (the gradient is of the unmixed parameters: backward runs before ``step()``)."""
        torch.nn.utils.vector_to_parameters(x[i].clone(), model.parameters())
        model.zero_grad()
        _loss(model, i, done[i]).backward()
        g = torch.cat([p.grad.flatten() for p in model.parameters()])
        if change is not None:
            x[i] = x[i] + change
        new = x[i].clone()
        for seg, st in zip(segments, states[i]):
            sl = slice(seg.start, seg.stop)
            st.steps += 1
            new[sl] = UPDATES[kind](x[i][sl], g[sl], st, **seg.hyper)
        x[i] = new
        done[i] += 1

    for i in range(n):  # round 1 leaves after local_steps steps
        while done[i] < local_steps:
            step(i)
    anchors = torch.stack(x)
    rounds = len(runs[0][2])
    for k in range(1, rounds + 1):
        mixed = topo.mixing_matrix(k).double() @ anchors
        for i in range(n):
            at = runs[i][2][k - 1]
            while done[i] < at:
                step(i)
            step(i, mixed[i] - anchors[i])
        anchors = torch.stack(x)  # round k + 1 leaves right after the mixing step
    for i in range(n):
        assert done[i] == runs[i][1]
    return torch.stack(x)


@pytest.mark.multiprocess
def test_matches_the_dense_reference_with_uneven_step_counts():
    n, local_steps, budget = 3, 3, 24
    runs = run_world(run_uneven, n, [0.0, 0.004, 0.03], budget, local_steps, UNEVEN)
    steps = [r[1] for r in runs]
    assert steps[0] > steps[2] + 2 * local_steps, f"the fast rank should step more: {steps}"
    assert len({r[4] for r in runs}) == 1, "every rank must stop at the same round"
    want = _reference(n, "ring", local_steps, runs)
    got = torch.stack([r[0] for r in runs])
    assert not torch.allclose(got[0], got[2]), "ranks should differ: the test would be vacuous"
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
    # the budget: S_k / n + local_steps reached it at the last round, so a rank's progress, S_k
    # / n plus its own steps since (at least its period, which may be shortened to 1), is at
    # least budget - local_steps + 1
    assert all(r[3] >= budget - local_steps + 1 for r in runs)


def _even(uneven, compression=None):
    """Even ranks, each round given time to arrive (run_in_time's options), so that the uneven
    schedule mixes where the step-locked one does."""
    return dict(uneven=uneven, compression=compression, local_world_size=1)


@pytest.mark.multiprocess
def test_rounds_that_arrive_in_time_give_plain_local_steps_bit_for_bit():
    plain = run_world(run_in_time, 3, 14, _even(False))
    uneven = run_world(run_in_time, 3, 14, _even(True))
    for a, b in zip(plain, uneven):
        assert torch.equal(a, b)


def _stops_calling(rank, n):
    model = _model()
    opt = build(model, 2, bucket_cap_mb=SMALL_BUCKETS, timeout=3)
    started = time.monotonic()
    try:
        for t in range(400 if rank == 0 else 3):  # rank 1 stops after 3 steps
            train_step(model, opt, rank, t)
            time.sleep(0.01)
    except GossipError as err:
        return "raised", time.monotonic() - started, str(err)
    if rank == 1:
        wait_for_the_other_ranks()  # alive, but never sends round 2, until rank 0 gave up
    return "finished", time.monotonic() - started, ""


@pytest.mark.multiprocess
def test_a_neighbour_that_stops_stepping_raises_within_the_timeout():
    (what, seconds, message), _ = run_world_fresh(_stops_calling, 2)
    assert what == "raised", "the fast rank kept training without its neighbour"
    assert seconds < 3 + 5, seconds
    assert "round 2" in message and "timeout 3 s" in message, message


def _worker_alone(budget):
    model = _model()
    opt = build(model, 4, bucket_cap_mb=SMALL_BUCKETS, budget=budget)
    steps = 0
    while not opt.stopped:
        train_step(model, opt, 0, steps)
        steps += 1
    return steps, opt.progress, opt


def test_one_worker_stops_within_a_period_of_the_budget_and_then_refuses_to_step():
    steps, progress, opt = _worker_alone(10)
    # rounds leave after steps 4, 8, 12; round 2 is mixed at step 12, when 8 + 4 >= 10
    assert steps == 12 and progress == 12
    with pytest.raises(RuntimeError, match="after the budget of 10 steps"):
        opt.step()


def test_every_step_and_plain_local_steps_count_their_own_steps():
    model = _model()
    opt = dopt.DecentralizedAdamW(model.parameters(), lr=0.01, local_steps=2)
    opt.stop_at(3)
    for t in range(3):
        assert not opt.stopped
        _loss(model, 0, t).backward()
        opt.step()
    assert opt.stopped and opt.progress == 3


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(uneven=1), TypeError, "uneven must be True, False or a decent_optim.Uneven"),
        (dict(uneven=True, outer="diloco"), ValueError, "does not take outer="),
        (dict(uneven=True, global_avg_every=4), ValueError, "does not take global_avg_every="),
    ],
)
def test_bad_arguments_say_what_to_do(kwargs, error, match):
    with pytest.raises(error, match=match):
        dopt.DecentralizedAdamW(_model().parameters(), lr=0.01, local_steps=2, **kwargs)


@pytest.mark.parametrize("budget", [0, -1, True, "10"])
def test_a_bad_budget_says_what_to_do(budget):
    opt = dopt.DecentralizedAdamW(_model().parameters(), lr=0.01)
    with pytest.raises(ValueError, match="stop_at needs a number of steps > 0"):
        opt.stop_at(budget)


@pytest.mark.multiprocess
def test_composes_with_int8_compression():
    # rounds that arrive in time: the compressed exchange as plain local steps use it
    plain = run_world(run_in_time, 2, 14, _even(False, "int8"))
    uneven = run_world(run_in_time, 2, 14, _even(True, "int8"))
    for a, b in zip(plain, uneven):
        assert torch.equal(a, b)
    assert not torch.equal(plain[0], plain[1])
    # and at uneven speeds: no error, and the fast rank steps more
    runs = run_world(run_uneven, 2, [0.0, 0.02], 30, 3, {**UNEVEN, "compression": "int8"})
    assert all(torch.isfinite(r[0]).all() for r in runs)
    assert runs[0][1] > runs[1][1], "the fast rank should step more"


# -- the runtime model and plan ---------------------------------------------------------------------


def test_runtime_model_of_uneven_speeds():
    from decent_optim import runtime

    work = runtime.Workload(compute_mean=0.1, update_time=0.0)
    speeds = [1, 1, 1, 0.5]
    # step-locked methods run at the slowest's pace: 0.2 s per step
    assert runtime.paced(work, speeds).compute_mean == pytest.approx(0.2)
    # uneven periods at the mean speed, 0.875: 0.1 / 0.875 when the round fits in a period
    # (a period is the slowest's 4 steps, 0.8 s)
    fits = runtime.predict_uneven(work, speeds, [0.5], 4, "ring")
    assert fits.iteration == pytest.approx(0.1 / 0.875) and fits.exposed_comm == 0
    assert fits.method == "ring H=4 uneven"
    # a 1.6 s round doubles the period: twice the time per step
    slow = runtime.predict_uneven(work, speeds, [1.6], 4, "ring")
    assert slow.iteration == pytest.approx(2 * 0.1 / 0.875)
    with pytest.raises(ValueError, match="speeds must be positive"):
        runtime.predict_uneven(work, [1, 0], [0.5], 4)
    with pytest.raises(ValueError, match="one factor per worker"):
        runtime.check_speeds([1, 1], 4)


def test_plan_predicts_uneven_speeds():
    from decent_optim import plan

    measured = {
        "world_size": 4, "local_world_size": 1, "backend": "gloo", "params": 10, "bytes": 40,
        "compute_mean_s": 0.1, "compute_std_s": 0.0, "backward_fraction": 0.5, "update_s": 0.0,
        "allreduce_s": 0.08, "gossip": {"ring": {"round_s": [0.05, 0.05], "degrees": [1, 1]}},
    }  # fmt: skip
    rows = plan.predict(measured, overlap=1.0, local_steps=[4], speeds=[1, 1, 1, 0.5])
    times = {p.method: p.iteration for p, _ in rows}
    assert rows[0][0].method == "ring H=4 uneven"
    assert times["ring H=4 uneven"] == pytest.approx(0.1 / 0.875)
    assert times["ring H=4"] == pytest.approx(0.2)  # the slowest paces it
    assert times["all-reduce"] == pytest.approx(0.2 + 0.08 - 0.08)  # backward hides 0.08 s
    assert plan.parse(["--speeds", "1", "1", "1", "0.5"]).speeds == [1, 1, 1, 0.5]


# -- checkpoints ------------------------------------------------------------------------------------


def _resume(rank, n, save_at, steps):
    """Even ranks (rounds given time to arrive): ``steps`` in one go, and again with a
    checkpoint at ``save_at`` (mid-period, round in flight) loaded into a new optimizer."""

    def make():
        model = _model()
        return model, build(model)  # the budget is not saved: build() sets it again

    return resume_in_memory(rank, make, save_at, steps, in_time=True)


@pytest.mark.multiprocess
@pytest.mark.parametrize("save_at", [6, 7, 8])  # right after a launch, one and two steps after
def test_resume_mid_period_is_bit_exact(save_at):
    for straight, resumed, progress, resumed_progress, _ in run_world(_resume, 2, save_at, 14):
        assert torch.equal(straight, resumed)
        assert progress == resumed_progress


def _checkpoint_then_resize(rank, n, root, stage):
    """Stage "save": 2 ranks at uneven speed save at round 3 (``step=opt.round``); stage
    "load": the world loads it (another size) and trains on to a budget."""
    from decent_optim import checkpoint

    model = _model()
    opt = build(model, 2, bucket_cap_mb=SMALL_BUCKETS, timeout=60)
    if stage == "save":
        t = 0
        while opt.round < 3:
            time.sleep(0.01 * rank)
            train_step(model, opt, rank, t)
            t += 1
        checkpoint.save(root, model, opt, step=opt.round)
        checkpoint.wait(root)
        return _vector(model)
    resumed = checkpoint.load(root, model, opt)
    loaded = _vector(model)
    opt.stop_at(opt.progress + 6)
    t = 0
    while not opt.stopped:
        train_step(model, opt, rank, 100 + t)
        t += 1
    return resumed.step, loaded, bool(torch.isfinite(_vector(model)).all())


@pytest.mark.multiprocess
def test_checkpoint_save_and_load_at_another_world_size(tmp_path):
    saved = run_world_fresh(_checkpoint_then_resize, 2, str(tmp_path), "save")
    ((step, loaded, finite),) = run_world_fresh(_checkpoint_then_resize, 1, str(tmp_path), "load")
    assert step == 3 and finite
    # consensus: the one new rank starts from the mean of the two saved copies
    torch.testing.assert_close(loaded, torch.stack(saved).mean(0), rtol=0, atol=1e-12)
