"""``uneven=True, outer=LocalOuterSGD(...)`` (decent_optim.optim.outer) against references.

Many ranks at really uneven speeds: the dense float64 replay of tests/test_uneven.py (from each
rank's recorded mixing steps), written again here from the semantics alone with the outer step
added: with ``S_k`` the ranks' summed step counts at the launches of round ``k`` (``S_0 = 0``;
round 1 leaves after every rank's ``local_steps``-th step, round ``k + 1`` right after the step
that mixes round ``k``), every rank takes torch.optim.SGD's momentum step on its slow weights
with the pseudo-gradient ``slow - x``, then ``x = slow``, right after the update of the step that
mixes round ``k`` whenever ``floor(S_k / (n every)) > floor(S_{k-1} / (n every))``. One rank:
torch.optim.AdamW inside and torch.optim.SGD (Nesterov) outside at those rounds.
"""

from __future__ import annotations

import time

import pytest
import torch
from _harness import run_world, run_world_fresh
from _uneven import NAME, SMALL_BUCKETS, build, resume_in_memory, run_uneven, train_step, vector
from reference import UPDATES, RefState, Segment
from test_optim_multiprocess import GROUP1, OPTIMIZERS, _loss, _model

import decent_optim as dopt
from decent_optim.topologies import get as get_topology

OUTER = dopt.LocalOuterSGD(lr=0.6, momentum=0.7, every=5)  # not a multiple of local_steps=3


def _build(model, local_steps=3, outer=OUTER, **extra):
    """build() with small buckets and an outer step."""
    return build(model, local_steps, bucket_cap_mb=SMALL_BUCKETS, outer=outer, **extra)


def _summed_counts(n, local_steps, runs):
    """S_k for k = 0, 1, ...: each rank launches round 1 after its local_steps-th step and
    round k + 1 right after the step that mixes round k (the counts of the semantics)."""
    sums = [0, n * local_steps]
    for k in range(1, len(runs[0][2])):
        sums.append(sum(r[2][k - 1] + 1 for r in runs))
    return sums


def _outer_rounds(n, every, sums):
    """The rounds k >= 1 whose DDP-equivalent progress S_k / n crossed a multiple of every."""
    return {k for k in range(1, len(sums)) if sums[k] // (n * every) > sums[k - 1] // (n * every)}


def _reference(n, local_steps, runs, outer):
    """The uneven schedule replayed in float64, with the outer step at the crossing rounds
    (``outer=None``: without it)."""
    _, _, kind, hyper = OPTIMIZERS[NAME]
    model = _model()
    sizes = [p.numel() for p in model.parameters()]
    split = sum(sizes[:2])
    segments = [Segment(0, split, hyper), Segment(split, sum(sizes), {**hyper, **GROUP1})]
    topo = get_topology("ring", n, 1)
    x = [vector(model).double() for _ in range(n)]
    slow = [v.clone() for v in x]  # the slow weights start as the parameters
    bufs: list[torch.Tensor | None] = [None] * n
    states = [[RefState() for _ in segments] for _ in range(n)]
    done = [0] * n
    sums = _summed_counts(n, local_steps, runs)
    crossing = _outer_rounds(n, outer.every, sums) if outer is not None else set()

    def step(i: int, change: torch.Tensor | None = None) -> None:
        torch.nn.utils.vector_to_parameters(x[i].clone(), model.parameters())
        model.zero_grad()
        _loss(model, i, done[i]).backward()
        g = torch.cat([p.grad.flatten() for p in model.parameters()])
        if change is not None:  # the mix, after the gradient was taken
            x[i] = x[i] + change
        new = x[i].clone()
        for seg, st in zip(segments, states[i]):
            sl = slice(seg.start, seg.stop)
            st.steps += 1
            new[sl] = UPDATES[kind](x[i][sl], g[sl], st, **seg.hyper)
        x[i] = new
        done[i] += 1

    def outer_step(i: int) -> None:
        # torch.optim.SGD with momentum: the buffer starts as the first gradient
        d = slow[i] - x[i]
        bufs[i] = d.clone() if bufs[i] is None else outer.momentum * bufs[i] + d
        change = d + outer.momentum * bufs[i] if outer.nesterov else bufs[i]
        slow[i] = slow[i] - outer.lr * change
        x[i] = slow[i].clone()

    for i in range(n):
        while done[i] < local_steps:
            step(i)
    anchors = torch.stack(x)
    for k in range(1, len(runs[0][2]) + 1):
        mixed = topo.mixing_matrix(k).double() @ anchors
        for i in range(n):
            while done[i] < runs[i][2][k - 1]:
                step(i)
            step(i, mixed[i] - anchors[i])
            if k in crossing:
                outer_step(i)
        anchors = torch.stack(x)  # round k + 1 carries x = slow after an outer step
    for i in range(n):
        assert done[i] == runs[i][1]
    return torch.stack(x), sums, crossing


@pytest.mark.multiprocess
def test_matches_the_dense_reference_with_uneven_step_counts():
    # speeds 4:2:1 (sleeps dominate the step), so that rounds come often enough for several
    # outer steps and S_k / n grows by about 7 a round, crossing multiples of 9 in most rounds
    n, local_steps, budget, outer = 3, 3, 70, dopt.LocalOuterSGD(lr=0.6, momentum=0.7, every=9)
    options = dict(bucket_cap_mb=SMALL_BUCKETS, outer=outer)
    runs = run_world(run_uneven, n, [0.005, 0.01, 0.02], budget, local_steps, options)
    steps = [r[1] for r in runs]
    assert steps[0] > steps[2] + 2 * local_steps, f"the fast rank should step more: {steps}"
    want, sums, crossing = _reference(n, local_steps, runs, outer)
    print("S_k", sums, "outer steps at rounds", sorted(crossing))
    # every rank read the same S_k, the one the recorded steps give
    for r in runs:
        assert r.totals == [float(s) for s in sums[1:]]
    assert len(crossing) >= 2, f"too few outer steps to test: S_k {sums}"
    without, _, _ = _reference(n, local_steps, runs, None)
    assert (want - without).abs().max() > 1e-4, "the outer step should change the result"
    got = torch.stack([r[0] for r in runs])
    assert not torch.allclose(got[0], got[2]), "ranks should differ: the test would be vacuous"
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)


def _one_worker_twin(local_steps, every, steps, sync):
    """torch.optim.AdamW, and torch.optim.SGD (Nesterov) on slow copies at the rounds whose
    S_k = k local_steps crosses a multiple of every: one worker launches round k after its
    (k local_steps)-th step and mixes it in step (k + 1) local_steps, or right after the launch
    when synchronize() follows every step."""
    twin = _model()
    inner = torch.optim.AdamW(twin.parameters(), lr=0.01)
    slow = [p.detach().clone().requires_grad_() for p in twin.parameters()]
    outer = torch.optim.SGD(slow, lr=0.5, momentum=0.7, nesterov=True)
    lag = 0 if sync else 1
    at = {
        (k + lag) * local_steps
        for k in range(1, steps)
        if k * local_steps // every > (k - 1) * local_steps // every
    }
    for t in range(1, steps + 1):
        inner.zero_grad()
        _loss(twin, 0, t - 1).backward()
        inner.step()
        if t in at:
            with torch.no_grad():
                for s, p in zip(slow, twin.parameters()):
                    s.grad = s - p
                outer.step()
                for s, p in zip(slow, twin.parameters()):
                    p.copy_(s)
    return vector(twin), len(at & set(range(1, steps + 1)))


@pytest.mark.parametrize(
    "local_steps, every, sync",
    [(2, 3, False), (3, 2, False), (2, 4, False), (1, 3, False), (2, 2, True)],
)
def test_one_worker_is_torch_adamw_inside_torch_sgd_nesterov_outside(local_steps, every, sync):
    steps = 17
    model = _model()
    opt = dopt.DecentralizedAdamW(
        model.parameters(),
        lr=0.01,
        local_steps=local_steps,
        uneven=True,
        outer=dopt.LocalOuterSGD(lr=0.5, momentum=0.7, every=every),
    )
    opt.stop_at(10**6)
    for t in range(steps):
        train_step(model, opt, 0, t)
        if sync:
            opt.synchronize()
    want, outer_steps = _one_worker_twin(local_steps, every, steps, sync)
    assert outer_steps >= 2
    plain = _one_worker_twin(local_steps, 10**6, steps, sync)[0]
    assert not torch.allclose(want, plain), "the outer step should change the result"
    torch.testing.assert_close(vector(model), want, rtol=0, atol=1e-14)


def _resume(rank, n, save_at, steps):
    """Even ranks, each round given time to arrive before every step (as _uneven's
    run_in_time), so that arrivals repeat: ``steps`` in one go, and again from a checkpoint taken
    at ``save_at`` loaded into a new optimizer."""

    def make():
        model = _model()
        return model, _build(model, local_steps=2, outer=dopt.LocalOuterSGD(every=3))

    return resume_in_memory(rank, make, save_at, steps, in_time=True)


@pytest.mark.multiprocess
# local_steps=2, every=3: rounds leave after steps 2, 4, 6, ... and round k is mixed in step
# 2k + 2 with S_k / n = 2k, so outer steps come in steps 6, 8, 12 and 14 (k = 2, 3, 5, 6); saved
# before the first outer step, right after one, mid-period between two, and right after the
# next, every time with a round in flight
@pytest.mark.parametrize("save_at", [3, 6, 7, 8, 9])
def test_resume_mid_run_is_bit_exact(save_at):
    for straight, resumed, progress, resumed_progress, _ in run_world(_resume, 2, save_at, 15):
        assert torch.equal(straight, resumed)
        assert progress == resumed_progress


def _save_then_resize(rank, n, root, stage):
    """Stage "save": 2 ranks at uneven speed save at round 4; "load": 1 rank loads it."""
    from decent_optim import checkpoint

    model = _model()
    opt = _build(model, local_steps=2, outer=dopt.LocalOuterSGD(every=2), timeout=60)
    if stage == "save":
        t = 0
        while opt.round < 4:
            time.sleep(0.01 * rank)
            train_step(model, opt, rank, t)
            t += 1
        checkpoint.save(root, model, opt, step=opt.round)
        checkpoint.wait(root)
        entry = opt.state_dict()["decent_optim"]["local_steps"]
        return entry["slow"], entry["slow_momentum"]
    checkpoint.load(root, model, opt)
    entry = opt.state_dict()["decent_optim"]["local_steps"]
    slow, momentum = entry["slow"], entry["slow_momentum"]
    for t in range(8):
        train_step(model, opt, rank, 100 + t)
    return slow, momentum, bool(torch.isfinite(vector(model)).all())


@pytest.mark.multiprocess
def test_checkpoint_save_and_load_at_another_world_size_averages_the_slow_weights(tmp_path):
    saved = run_world_fresh(_save_then_resize, 2, str(tmp_path), "save")
    assert not torch.equal(saved[0][0][0], saved[1][0][0]), "the slow weights should differ"
    ((slow, momentum, finite),) = run_world_fresh(_save_then_resize, 1, str(tmp_path), "load")
    assert finite
    for got, key in ((slow, 0), (momentum, 1)):
        assert set(got) == {0, 1, 2, 3}
        for i, value in got.items():  # consensus: the mean of the saved copies
            mean = (saved[0][key][i] + saved[1][key][i]) / 2
            torch.testing.assert_close(value, mean, rtol=0, atol=1e-12)


def test_checkpoint_of_another_outer_setting_is_refused():
    model = _model()
    opt = _build(model, local_steps=2)
    for t in range(5):
        train_step(model, opt, 0, t)
    sd = opt.state_dict()
    assert set(sd["decent_optim"]["local_steps"]["slow"]) == {0, 1, 2, 3}
    for other in (dict(outer=None), dict(outer=dopt.LocalOuterSGD(every=6))):
        with pytest.raises(ValueError, match="the checkpoint was saved with local_steps=2"):
            _build(_model(), local_steps=2, **other).load_state_dict(sd)


@pytest.mark.parametrize(
    "outer, match",
    [
        ("diloco", 'does not take outer="diloco" or an OuterSGD: .* wait for the slowest'),
        (dopt.OuterSGD(), "pass outer=decent_optim.LocalOuterSGD"),
    ],
)
def test_outer_steps_with_a_round_of_their_own_are_refused(outer, match):
    with pytest.raises(ValueError, match=match):
        dopt.DecentralizedAdamW(_model().parameters(), local_steps=2, uneven=True, outer=outer)


def test_every_need_not_be_a_multiple_of_local_steps_with_uneven():
    outer = dopt.LocalOuterSGD(every=5)
    opt = dopt.DecentralizedAdamW(_model().parameters(), local_steps=3, uneven=True, outer=outer)
    assert opt.state_dict()["decent_optim"]["local_steps"]["outer"] == repr(outer)
    with pytest.raises(ValueError, match="multiple of local_steps=3"):  # step-locked: still
        dopt.DecentralizedAdamW(_model().parameters(), local_steps=3, outer=outer)
    with pytest.raises(TypeError, match="uneven must be True, False or a decent_optim.Uneven"):
        dopt.DecentralizedAdamW(_model().parameters(), local_steps=3, uneven=1, outer=outer)
