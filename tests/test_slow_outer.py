"""``outer=LocalOuterSGD(...)`` (decent_optim.optim.outer) against independent references.

Many ranks: the dense float64 simulation of local steps (``reference.simulate_local``) with each
row's slow weights stepped by torch.optim.SGD's formula. One rank: torch.optim.AdamW inside and
torch.optim.SGD (Nesterov) on a copy of the parameters outside, every ``every`` steps.
"""

from __future__ import annotations

import io

import pytest
import torch
from _harness import run_world, run_world_fresh
from reference import CompressedMixing, Segment, simulate_local, worker_gradients
from test_optim_multiprocess import GROUP1, OPTIMIZERS, _loss, _model, _param_groups
from torch import nn

import decent_optim as dopt
from decent_optim.topologies import get as get_topology

STEPS = 14


def _vector(model: nn.Module) -> torch.Tensor:
    return nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def _slow_spec(outer: dopt.LocalOuterSGD) -> dict:
    return dict(lr=outer.lr, momentum=outer.momentum, nesterov=outer.nesterov, every=outer.every)


def _train(rank, n, name, topology, local, steps, local_steps, outer, compression=None):
    cls, kwargs, *_ = OPTIMIZERS[name]
    model = _model()
    opt = cls(
        _param_groups(model),
        **kwargs,
        topology=topology,
        local_world_size=local,
        bucket_cap_mb=25 if compression else 64 / 2**20,  # as tests/test_local_steps.py
        local_steps=local_steps,
        outer=outer,
        compression=compression,
    )
    for t in range(steps):
        opt.zero_grad()
        _loss(model, rank, t).backward()
        opt.step()
    return _vector(model)


def _reference(name, topology, n, local, steps, local_steps, outer, compression=None):
    _, _, kind, hyper = OPTIMIZERS[name]
    model = _model()
    sizes = [p.numel() for p in model.parameters()]
    split = sum(sizes[:2])
    segments = [Segment(0, split, hyper), Segment(split, sum(sizes), {**hyper, **GROUP1})]
    topo = get_topology(topology, n, local)
    mixer = None
    if compression:
        per_group = [CompressedMixing(topo, compression) for _ in segments]

        def mixer(x, k):
            return torch.cat(
                [m(x[:, s.start : s.stop], k) for m, s in zip(per_group, segments)], dim=1
            )

    return simulate_local(
        kind,
        topo.mixing_matrix,
        _vector(model).repeat(n, 1),
        worker_gradients(model, _loss),
        segments,
        steps,
        local_steps,
        mixer=mixer,
        slow=_slow_spec(outer),
    )


CASES = [  # (optimizer, topology, world size, local world size, local_steps, outer)
    ("DecentralizedAdamW", "ring", 4, 1, 2, dopt.LocalOuterSGD(every=4)),
    ("DecentralizedAdamW", "alternating-exp-ring", 4, 2, 3, dopt.LocalOuterSGD(0.6, 0.6, 6)),
    ("DSGD", "complete", 3, 1, 2, dopt.LocalOuterSGD(0.8, 0.5, 4, nesterov=False)),
    ("AccumAdam", "one-peer-exp", 2, 1, 1, dopt.LocalOuterSGD(0.5, 0.0, 3, nesterov=False)),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, topology, n, local, local_steps, outer", CASES, ids=str)
def test_matches_dense_reference(name, topology, n, local, local_steps, outer):
    got = run_world(_train, n, name, topology, local, STEPS, local_steps, outer)
    want = _reference(name, topology, n, local, STEPS, local_steps, outer)
    assert not torch.allclose(want[0], want[-1]), "ranks should differ: the test would be vacuous"
    torch.testing.assert_close(torch.stack(got), want, rtol=0, atol=1e-9)


@pytest.mark.multiprocess
def test_the_outer_step_changes_the_result():
    # the reference with the slow step differs from plain local steps (so the test above checks
    # the outer step, not only the rounds)
    name, topology, n, local, local_steps, outer = CASES[0]
    got = torch.stack(run_world(_train, n, name, topology, local, STEPS, local_steps, None))
    slow = _reference(name, topology, n, local, STEPS, local_steps, outer)
    assert (got - slow).abs().max() > 1e-4


@pytest.mark.multiprocess
def test_composes_with_int8_compression():
    args = ("DecentralizedAdamW", "alternating-exp-ring", 4, 2, STEPS, 3, CASES[1][-1])
    name, topology, n, local, steps, local_steps, outer = args
    got = torch.stack(
        run_world(_train, n, name, topology, local, steps, local_steps, outer, "int8")
    )
    want = _reference(*args, compression="int8")
    exact = _reference(*args)
    assert not torch.allclose(want, exact, rtol=0, atol=1e-9), "int8 should change the values"
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)


@pytest.mark.parametrize("local_steps, every", [(1, 3), (2, 4), (4, 4)])
def test_one_worker_is_torch_adamw_inside_torch_sgd_nesterov_outside(local_steps, every):
    model = _model()
    opt = dopt.DecentralizedAdamW(
        model.parameters(),
        lr=0.01,
        local_steps=local_steps,
        outer=dopt.LocalOuterSGD(lr=0.5, momentum=0.7, every=every),
    )
    twin = _model()
    inner = torch.optim.AdamW(twin.parameters(), lr=0.01)
    slow = [p.detach().clone().requires_grad_() for p in twin.parameters()]
    outer = torch.optim.SGD(slow, lr=0.5, momentum=0.7, nesterov=True)
    for t in range(13):
        for m, o in ((model, opt), (twin, inner)):
            o.zero_grad()
            _loss(m, 0, t).backward()
            o.step()
        if (t + 1) % every == 0:
            with torch.no_grad():
                for s, p in zip(slow, twin.parameters()):
                    s.grad = s - p
                outer.step()
                for s, p in zip(slow, twin.parameters()):
                    p.copy_(s)
    torch.testing.assert_close(_vector(model), _vector(twin), rtol=0, atol=1e-14)


def _build(model, **extra):
    options = dict(topology="ring", local_steps=2, outer=dopt.LocalOuterSGD(every=4))
    return dopt.DecentralizedAdamW(model.parameters(), lr=0.01, **{**options, **extra})


def _resume(rank, n, save_at, steps):
    """Train ``steps`` in one go, and again from a checkpoint taken at ``save_at``."""

    def run(model, opt, start, stop):
        for t in range(start, stop):
            opt.zero_grad()
            _loss(model, rank, t).backward()
            opt.step()

    model = _model()
    opt = _build(model)
    run(model, opt, 0, save_at)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    run(model, opt, save_at, steps)
    straight = _vector(model)
    model = _model()
    opt = _build(model)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    run(model, opt, save_at, steps)
    return straight, _vector(model)


@pytest.mark.multiprocess
# before the first outer step; mid-period; at a period's end between outer steps; at an outer step
@pytest.mark.parametrize("save_at", [3, 5, 6, 8])
def test_resume_mid_period_is_bit_exact(save_at):
    for straight, resumed in run_world(_resume, 2, save_at, 15):
        assert torch.equal(straight, resumed)


def test_checkpoint_records_the_slow_weights_and_refuses_other_settings():
    model = _model()
    opt = _build(model)
    for t in range(5):
        opt.zero_grad()
        _loss(model, 0, t).backward()
        opt.step()
    sd = opt.state_dict()
    entry = sd["decent_optim"]["local_steps"]
    assert set(entry["slow"]) == set(entry["slow_momentum"]) == {0, 1, 2, 3}
    # one outer step (at step 4) from the start: slow = start - 0.5 (D + 0.7 D), D = start - x4
    start = dict(enumerate(_model().parameters()))
    assert not torch.equal(entry["slow"][0], start[0].detach())
    for other in (
        dict(outer=dopt.LocalOuterSGD(every=8)),
        dict(outer="diloco"),
        dict(outer=None),
        dict(local_steps=4, outer=dopt.LocalOuterSGD(every=4)),
    ):
        with pytest.raises(ValueError, match="the checkpoint was saved with local_steps=2"):
            _build(_model(), **other).load_state_dict(sd)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(lr=0.0), ValueError, "lr must be > 0"),
        (dict(momentum=1.0), ValueError, "momentum must be < 1"),
        (dict(momentum=0.0), ValueError, "Nesterov needs a momentum"),
        (dict(every=0), ValueError, "every must be an int >= 1"),
        (dict(every=4.0), ValueError, "every must be an int >= 1"),
        (dict(nesterov="yes"), TypeError, "nesterov must be a bool"),
    ],
)
def test_bad_settings_say_what_to_do(kwargs, error, match):
    with pytest.raises(error, match=match):
        dopt.LocalOuterSGD(**kwargs)


def test_every_must_be_a_multiple_of_local_steps():
    # (not with uneven=True: tests/test_uneven_outer.py)
    with pytest.raises(ValueError, match="multiple of local_steps=3.*pass every=15"):
        dopt.DecentralizedAdamW(
            _model().parameters(), local_steps=3, outer=dopt.LocalOuterSGD(every=16)
        )


def _save_then_resize(rank, n, root, stage):
    from decent_optim import checkpoint

    model = _model()
    opt = _build(model)
    if stage == "save":
        for t in range(6):  # one outer step, then a period in flight
            opt.zero_grad()
            _loss(model, rank, t).backward()
            opt.step()
        checkpoint.save(root, model, opt, step=6)
        checkpoint.wait(root)
        return opt.state_dict()["decent_optim"]["local_steps"]["slow"]
    checkpoint.load(root, model, opt)
    slow = opt.state_dict()["decent_optim"]["local_steps"]["slow"]
    for t in range(6, 12):
        opt.zero_grad()
        _loss(model, rank, t).backward()
        opt.step()
    return slow, bool(torch.isfinite(_vector(model)).all())


@pytest.mark.multiprocess
def test_checkpoint_save_and_load_at_another_world_size(tmp_path):
    saved = run_world_fresh(_save_then_resize, 2, str(tmp_path), "save")
    assert not torch.equal(saved[0][0], saved[1][0]), "the ranks' slow weights should differ"
    ((slow, finite),) = run_world_fresh(_save_then_resize, 1, str(tmp_path), "load")
    assert finite
    for i, value in slow.items():  # consensus: the mean of the saved slow weights
        torch.testing.assert_close(value, (saved[0][i] + saved[1][i]) / 2, rtol=0, atol=1e-12)
