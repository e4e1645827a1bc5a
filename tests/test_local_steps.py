"""Local steps (``local_steps=``, ``outer=``) on gloo ranks against the dense float64 reference.

The reference (``reference.simulate_local``) writes the scheme of docs/algorithms.rst ("Local
steps") row by row with the textbook updates; one worker is also checked against torch.optim
(inner AdamW, outer SGD with Nesterov momentum on the anchor).
"""

from __future__ import annotations

import pytest
import torch
from _harness import run_world
from _uneven import resume_in_memory, vector
from reference import CompressedMixing, Segment, simulate_local, worker_gradients
from test_optim_multiprocess import GROUP1, OPTIMIZERS, _loss, _model, _param_groups
from test_optim_multiprocess import _reference as every_step_reference

import decent_optim as dopt
from decent_optim.topologies import get as get_topology

STEPS = 14
DILOCO = dict(lr=0.7, momentum=0.9, nesterov=True)
LOOKAHEAD = dict(lr=0.5, momentum=0.0, nesterov=False)  # plain momentum-free outer step
OUTERS = {"none": None, "diloco": DILOCO, "lookahead": LOOKAHEAD}


def _outer_arg(outer: str):
    spec = OUTERS[outer]
    return None if spec is None else dopt.OuterSGD(**spec)


def _train(rank, n, name, topology, local, steps, every, outer, compression=None, probe=None):
    """Returns the parameters after ``steps``, and at step ``probe`` the consensus distance and
    the averaged parameters."""
    cls, kwargs, *_ = OPTIMIZERS[name]
    model = _model()
    opt = cls(
        _param_groups(model),
        **kwargs,
        topology=topology,
        local_world_size=local,
        # tiny buckets (several per group) for exact rounds; one per group when compressed, so
        # that the reference quantizes the same chunks
        bucket_cap_mb=25 if compression else 64 / 2**20,
        local_steps=every,
        outer=_outer_arg(outer),
        compression=compression,
    )
    seen = None
    for t in range(steps):
        if t == probe:
            with opt.averaged():
                mean = vector(model)
            seen = (opt.consensus_distance(), mean)
        opt.zero_grad()
        _loss(model, rank, t).backward()
        opt.step()
    return vector(model), seen


def _reference(name, topology, n, local, steps, every, outer, compression=None):
    _, _, kind, hyper = OPTIMIZERS[name]
    model = _model()
    sizes = [p.numel() for p in model.parameters()]
    split = sum(sizes[:2])
    segments = [Segment(0, split, hyper), Segment(split, sum(sizes), {**hyper, **GROUP1})]
    x0 = vector(model).repeat(n, 1)

    grads = worker_gradients(model, _loss)

    topo = get_topology(topology, n, local)
    mixer = None
    if compression:  # a bucket per param group, each compressed on its own
        per_group = [CompressedMixing(topo, compression) for _ in segments]

        def mixer(x, k):
            return torch.cat(
                [m(x[:, s.start : s.stop], k) for m, s in zip(per_group, segments)], dim=1
            )

    return simulate_local(
        kind, topo.mixing_matrix, x0, grads, segments, steps, every, OUTERS[outer], mixer=mixer
    )


CASES = [  # (optimizer, topology, world size, local world size, local_steps, outer)
    ("DecentralizedAdamW", "ring", 4, 1, 1, "none"),
    ("DecentralizedAdamW", "ring", 4, 1, 3, "none"),
    ("DecentralizedAdamW", "ring", 4, 1, 1, "diloco"),
    ("DecentralizedAdamW", "ring", 4, 1, 3, "diloco"),
    ("DecentralizedAdamW", "alternating-exp-ring", 4, 2, 3, "none"),
    ("DecentralizedAdamW", "alternating-exp-ring", 4, 2, 3, "diloco"),
    ("DSGD", "complete", 3, 1, 3, "diloco"),
    ("AccumAdam", "one-peer-exp", 2, 1, 3, "lookahead"),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, topology, n, local, every, outer", CASES, ids=str)
def test_matches_dense_reference(name, topology, n, local, every, outer):
    probe = 7  # mid-period for local_steps=3
    got = run_world(_train, n, name, topology, local, STEPS, every, outer, None, probe)
    want = _reference(name, topology, n, local, STEPS, every, outer)
    assert not torch.allclose(want[0], want[-1]), "ranks should differ: the test would be vacuous"
    torch.testing.assert_close(torch.stack([g[0] for g in got]), want, rtol=0, atol=1e-9)
    # averaged() and consensus_distance() at a step inside a period: the mean of the ranks'
    # current parameters and each rank's distance to it
    at_probe = _reference(name, topology, n, local, probe, every, outer)
    mean = at_probe.mean(0)
    for rank, (_, (distance, averaged)) in enumerate(got):
        torch.testing.assert_close(averaged, mean, rtol=0, atol=1e-9)
        assert distance == pytest.approx(float((at_probe[rank] - mean).norm()), rel=1e-6)


def test_reference_with_one_local_step_is_every_step_gossip():
    # the reference of the new scheme reduces to the old one: x + (W x - x) = W x
    want = _reference("DecentralizedAdamW", "ring", 4, 1, STEPS, 1, "none")
    old = every_step_reference("DecentralizedAdamW", "ring", 4, 1, STEPS)
    torch.testing.assert_close(want, old, rtol=0, atol=1e-12)


def _plain(rank, n, every):
    model = _model()
    extra = {} if every is None else {"local_steps": every}
    opt = dopt.DecentralizedAdamW(model.parameters(), lr=0.01, topology="ring", **extra)
    for t in range(6):
        opt.zero_grad()
        _loss(model, rank, t).backward()
        opt.step()
    return vector(model)


@pytest.mark.multiprocess
def test_one_local_step_without_outer_is_todays_optimizer_bit_for_bit():
    today = run_world(_plain, 2, None)
    new = run_world(_plain, 2, 1)
    for a, b in zip(today, new):
        assert torch.equal(a, b)


@pytest.mark.multiprocess
def test_composes_with_int8_compression():
    args = ("DecentralizedAdamW", "alternating-exp-ring", 4, 2, STEPS, 3, "diloco")
    name, topology, n, local, steps, every, outer = args
    got = run_world(_train, n, name, topology, local, steps, every, outer, "int8")
    got = torch.stack([g[0] for g in got])
    want = _reference(*args, compression="int8")
    exact = _reference(*args)
    assert not torch.allclose(want, exact, rtol=0, atol=1e-9), "int8 should change the values"
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)


def test_one_worker_is_torch_adamw_inside_torch_sgd_nesterov_outside():
    every = 3
    model = _model()
    opt = dopt.DecentralizedAdamW(model.parameters(), lr=0.01, local_steps=every, outer="diloco")
    twin = _model()
    inner = torch.optim.AdamW(twin.parameters(), lr=0.01)
    anchors = [p.detach().clone().requires_grad_() for p in twin.parameters()]
    outer = torch.optim.SGD(anchors, lr=0.7, momentum=0.9, nesterov=True)
    for t in range(10):
        for m, o in ((model, opt), (twin, inner)):
            o.zero_grad()
            _loss(m, 0, t).backward()
            o.step()
        if (t + 1) % every == 0:
            with torch.no_grad():
                for a, p in zip(anchors, twin.parameters()):
                    a.grad = a - p
                outer.step()
                for a, p in zip(anchors, twin.parameters()):
                    p.copy_(a)
    torch.testing.assert_close(vector(model), vector(twin), rtol=0, atol=1e-14)


def _resume(rank, n, save_at, steps):
    """Train ``steps`` in one go, and again with a checkpoint at ``save_at`` loaded into a new
    model and optimizer; returns both results."""

    def make():
        model = _model()
        opt = dopt.DecentralizedAdamW(
            model.parameters(), lr=0.01, topology="ring", local_steps=3, outer="diloco"
        )
        return model, opt

    run = resume_in_memory(rank, make, save_at, steps)
    return run.straight, run.resumed


@pytest.mark.multiprocess
@pytest.mark.parametrize("save_at", [6, 7, 8])  # at a period's end, one and two steps into one
def test_resume_mid_period_is_bit_exact(save_at):
    for straight, resumed in run_world(_resume, 2, save_at, 13):
        assert torch.equal(straight, resumed)


def test_checkpoint_records_the_anchors_and_refuses_other_settings():
    model = _model()
    opt = dopt.DSGD(model.parameters(), lr=0.1, momentum=0.9, local_steps=3, outer="diloco")
    for t in range(4):
        opt.zero_grad()
        _loss(model, 0, t).backward()
        opt.step()
    sd = opt.state_dict()
    entry = sd["decent_optim"]["local_steps"]
    assert entry["local_steps"] == 3 and set(entry["anchor"]) == {0, 1, 2, 3}
    assert set(entry["outer_momentum"]) == {0, 1, 2, 3}
    other = dopt.DSGD(_model().parameters(), lr=0.1, momentum=0.9, local_steps=2)
    with pytest.raises(ValueError, match="saved with local_steps=3"):
        other.load_state_dict(sd)
    plain = dopt.DSGD(_model().parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="this optimizer has local_steps=1"):
        plain.load_state_dict(sd)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(local_steps=0), ValueError, "local_steps must be >= 1"),
        (dict(local_steps=2.0), TypeError, "local_steps must be an int"),
        (dict(local_steps=True), TypeError, "local_steps must be an int"),
        (dict(outer="adam"), ValueError, "outer must be None, \\['diloco'\\]"),
        (dict(outer={"lr": 0.7}), TypeError, "outer must be None"),
        (dict(local_steps=3, global_avg_every=4), ValueError, "multiple of local_steps=3"),
    ],
)
def test_bad_arguments_say_what_to_do(kwargs, error, match):
    with pytest.raises(error, match=match):
        dopt.DecentralizedAdamW(_model().parameters(), **kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(lr=0.0), ValueError, "lr must be > 0"),
        (dict(lr=float("nan")), ValueError, "finite"),
        (dict(momentum=-0.1), ValueError, "momentum must be a finite number >= 0"),
        (dict(momentum=0.0), ValueError, "Nesterov needs a momentum"),
        (dict(nesterov=1), TypeError, "nesterov must be a bool"),
    ],
)
def test_bad_outer_settings_say_what_to_do(kwargs, error, match):
    with pytest.raises(error, match=match):
        dopt.OuterSGD(**kwargs)


# -- the runtime model and plan ---------------------------------------------------------------------


def test_runtime_model_of_local_steps():
    from decent_optim import runtime

    work = runtime.Workload(compute_mean=0.1, compute_std=0.02, update_time=0.01)
    every = runtime.predict_gossip(work, [0.3, 0.05], [1, 1], "ring")
    one = runtime.predict_local_steps(work, [0.3, 0.05], [1, 1], 1, "ring")
    assert one.iteration == pytest.approx(every.iteration)
    # sigma = 0: a 0.3 s round hides behind 4 computes of 0.1 s; per iteration 0.1 + 0.01
    flat = runtime.Workload(compute_mean=0.1, update_time=0.01)
    four = runtime.predict_local_steps(flat, [0.3], [1], 4, "ring")
    assert four.iteration == pytest.approx(0.11) and four.exposed_comm == 0
    two = runtime.predict_local_steps(flat, [0.3], [1], 2, "ring")
    assert two.iteration == pytest.approx(0.3 / 2 + 0.01)
    # DiLoCo blocks on the all-reduce: (4 * 0.1 + 0.3) / 4 + 0.01
    diloco = runtime.predict_diloco(flat, 4, 0.3, 4)
    assert diloco.iteration == pytest.approx(0.185) and diloco.method == "diloco H=4"
    with pytest.raises(ValueError, match="local_steps must be an int >= 1"):
        runtime.predict_local_steps(flat, [0.3], [1], 0)


def test_plan_predicts_local_steps_per_h():
    from decent_optim import plan

    measured = {
        "world_size": 4, "local_world_size": 1, "backend": "gloo", "params": 10, "bytes": 40,
        "compute_mean_s": 0.1, "compute_std_s": 0.0, "backward_fraction": 0.5, "update_s": 0.0,
        "allreduce_s": 0.8, "gossip": {"ring": {"round_s": [0.3, 0.3], "degrees": [1, 1]}},
    }  # fmt: skip
    rows = plan.predict(measured, overlap=1.0, local_steps=[4])
    times = {p.method: p.iteration for p, _ in rows}
    assert rows[0][0].method == "ring H=4"
    assert times["ring H=4"] == pytest.approx(0.1)
    assert times["ring"] == pytest.approx(0.3)
    assert times["diloco H=4"] == pytest.approx(0.3)
    assert "ring H=4" in plan.format_table(measured, rows)
    assert plan.parse(["--local-steps", "4", "16"]).local_steps == [4, 16]
