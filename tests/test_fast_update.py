"""The bucket-wide fast paths of every optimizer and the mix factor they fold into their update.

World size 1: the same results as torch.optim (or, for AccumAdam with ``accum_iter > 1``, as the
plain-Python reference), also across state_dict round trips, skipped gradients and changes of
hyper-parameters. On gloo ranks: the same results as the dense simulation when the pair average's
1/2 is applied inside the update, and both ranks of a pair keep bit-identical parameters.
"""

import pytest
import torch
from _harness import run_world
from reference import RefState, Segment, simulate
from reference import accum_adam as reference_accum_adam

import decent_optim as dopt
from decent_optim.topologies import CustomTopology
from decent_optim.topologies import get as get_topology

SMALL = [(6, 5), (5,), (3, 4, 2), (1,), (7,)] * 4  # many small tensors: one flat kernel call
LARGE = [(400, 400), (400,)]  # mean size above the flattening threshold: cached lists


def _pair(shapes, cls, torch_cls, torch_kw=None, **kw):
    gen = torch.Generator().manual_seed(0)
    mine = [torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_() for s in shapes]
    theirs = [p.detach().clone().requires_grad_() for p in mine]
    return (
        mine,
        theirs,
        cls(mine, **kw),
        torch_cls(theirs, **(kw if torch_kw is None else torch_kw)),
    )


def _grads(mine, theirs, gen, skip=()):
    for k, (x, y) in enumerate(zip(mine, theirs)):
        if k in skip:
            x.grad = y.grad = None
        else:
            x.grad = torch.randn(x.shape, generator=gen, dtype=x.dtype)
            y.grad = x.grad.clone()


def _run_against_torch(mine, theirs, a, b, steps=25, skip_at=None):
    gen = torch.Generator().manual_seed(1)
    for t in range(steps):
        _grads(mine, theirs, gen, skip=(3,) if t == skip_at else ())
        if t == 12:  # hyper-parameters are read at every step
            for g in (*a.param_groups, *b.param_groups):
                g["lr"] *= 0.5
        a.step()
        b.step()


ADAM_CASES = [
    (dopt.DecentralizedAdamW, torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    (dopt.DecentralizedAdam, torch.optim.Adam, dict(lr=0.01, weight_decay=0.1, amsgrad=True)),
    (dopt.DecentralizedAdam, torch.optim.Adam, dict(lr=0.02, maximize=True)),
]


@pytest.mark.parametrize("shapes", [SMALL, LARGE], ids=["flat", "lists"])
@pytest.mark.parametrize("cls, torch_cls, kw", ADAM_CASES)
def test_fast_path_matches_torch(shapes, cls, torch_cls, kw):
    mine, theirs, a, b = _pair(shapes, cls, torch_cls, **kw)
    _run_against_torch(mine, theirs, a, b)
    for x, y in zip(mine, theirs):
        # the same elementwise formula; only the vectorisation of the kernel may differ
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(a.state[x][key], b.state[y][key], rtol=0, atol=1e-12)


SGD_CASES = [
    dict(lr=0.05),
    dict(lr=0.05, weight_decay=0.1, maximize=True),
    dict(lr=0.05, momentum=0.9, weight_decay=0.01),
    dict(lr=0.05, momentum=0.9, nesterov=True, maximize=True),
    dict(lr=0.05, momentum=0.5, dampening=0.3),
]


@pytest.mark.parametrize("shapes", [SMALL, LARGE], ids=["small", "large"])
@pytest.mark.parametrize("kw", SGD_CASES, ids=str)
@pytest.mark.parametrize("skip_at", [None, 5], ids=["all-grads", "skipped-grad"])
def test_dsgd_fast_path_matches_torch(shapes, kw, skip_at):
    mine, theirs, a, b = _pair(shapes, dopt.DSGD, torch.optim.SGD, **kw)
    _run_against_torch(mine, theirs, a, b, skip_at=skip_at)
    for x, y in zip(mine, theirs):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)
        if kw.get("momentum"):
            torch.testing.assert_close(
                a.state[x]["momentum_buffer"], b.state[y]["momentum_buffer"], rtol=0, atol=1e-12
            )


ACCUM_ONE_CASES = [
    (dopt.AccumAdam, torch.optim.Adam, dict(lr=0.01, weight_decay=0.1, amsgrad=True)),
    (dopt.AccumAdamW, torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    (dopt.AccumAdam, torch.optim.Adam, dict(lr=0.02, maximize=True)),
]


@pytest.mark.parametrize("shapes", [SMALL, LARGE], ids=["small", "large"])
@pytest.mark.parametrize("cls, torch_cls, kw", ACCUM_ONE_CASES)
def test_accum_adam_fast_path_with_accum_iter_one_matches_torch(shapes, cls, torch_cls, kw):
    mine, theirs, a, b = _pair(shapes, cls, torch_cls, torch_kw=kw, accum_iter=1, **kw)
    _run_against_torch(mine, theirs, a, b, skip_at=5)
    for x, y in zip(mine, theirs):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(a.state[x][key], b.state[y][key], rtol=0, atol=1e-12)


def _channels_last():
    return [(2, 3, 4, 5), (7,), (3, 3, 2, 2)]  # 4-d: made channels_last by _accum_params


def _accum_params(shapes):
    gen = torch.Generator().manual_seed(0)
    out = []
    for s in shapes:
        p = torch.randn(s, generator=gen, dtype=torch.float64)
        if len(s) == 4:
            p = p.to(memory_format=torch.channels_last)
        out.append(p.requires_grad_())
    return out


ACCUM_CASES = [
    (dopt.AccumAdam, dict(lr=0.01, weight_decay=0.1, accum_iter=3, amsgrad=True)),
    (dopt.AccumAdamW, dict(lr=0.01, weight_decay=0.1, accum_iter=4)),
    (dopt.AccumAdam, dict(lr=0.02, maximize=True, accum_iter=2)),
]


@pytest.mark.parametrize(
    "shapes, grad_layout",
    [
        (SMALL, "param"),
        (LARGE, "param"),
        (_channels_last(), "param"),  # cut parameters read in memory order
        (_channels_last(), "contiguous"),  # ... which these gradients do not allow
    ],
    ids=["small", "large", "channels-last", "channels-last-contiguous-grads"],
)
@pytest.mark.parametrize("cls, kw", ACCUM_CASES)
def test_accum_adam_fast_path_matches_reference(shapes, grad_layout, cls, kw):
    # each parameter against its own plain-Python AccumAdam (tests/reference.py), including a
    # parameter that skips a step (its own step count falls behind) and a change of lr
    params = _accum_params(shapes)
    opt = cls(params, **kw)
    hyper = {**kw, "decoupled": cls is dopt.AccumAdamW}
    xs = [p.detach().clone().reshape(-1) for p in params]
    refs = [RefState() for _ in params]
    gen = torch.Generator().manual_seed(1)
    for t in range(14):
        if t == 8:
            opt.param_groups[0]["lr"] *= 0.5
            hyper["lr"] *= 0.5
        for k, p in enumerate(params):
            if t == 5 and k == 1:
                p.grad = None
                continue
            g = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.grad = g.contiguous() if grad_layout == "contiguous" else torch.empty_like(p).copy_(g)
            refs[k].steps += 1
            xs[k] = reference_accum_adam(xs[k], g.reshape(-1), refs[k], **hyper)
        opt.step()
    for p, x, ref in zip(params, xs, refs):
        torch.testing.assert_close(p.detach().reshape(-1), x, rtol=0, atol=1e-12)
        state = opt.state[p]
        assert int(state["step"]) == ref.steps
        for key, name in (("exp_avg", "mbar"), ("exp_avg_sq", "vbar"), ("grad_acc", "acc")):
            want = ref.tensors.get(name, torch.zeros_like(x))
            torch.testing.assert_close(state[key].reshape(-1), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "kernel, cls, kw",
    [
        ("_fused_adamw_", dopt.DecentralizedAdamW, dict(lr=0.01)),
        ("_fused_sgd_", dopt.DSGD, dict(lr=0.01, momentum=0.9)),
        ("_fused_adamw_", dopt.AccumAdamW, dict(lr=0.01, accum_iter=2)),
    ],
)
def test_after_the_first_step_every_bucket_takes_the_fast_path(monkeypatch, kernel, cls, kw):
    # each bucket is one update of the rule covering the whole bucket, and one kernel call
    kernel_calls, batches = [], []
    real_kernel, real_update = getattr(torch, kernel), cls.rule.update

    def spy_kernel(*args, **kwargs):
        kernel_calls.append(args[0])
        return real_kernel(*args, **kwargs)

    def spy_update(batch, group, **kwargs):
        batches.append(batch)
        return real_update(batch, group, **kwargs)

    monkeypatch.setattr(torch, kernel, spy_kernel)
    monkeypatch.setattr(cls.rule, "update", spy_update)
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).requires_grad_() for s in SMALL]
    opt = cls(params, **kw, bucket_cap_mb=100 * 4 / 2**20)  # a few buckets
    buckets = opt._flat.buckets
    assert len(buckets) > 1
    for _ in range(3):  # the first step creates the state
        kernel_calls.clear()
        batches.clear()
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    assert [b.bucket for b in batches] == buckets
    assert all(b.whole for b in batches)
    if cls is dopt.DSGD:  # one call per bucket, on its parameters' list
        assert [len(p) for p in kernel_calls] == [len(b.params) for b in buckets]
        assert not any(b.flat for b in batches)
    else:  # flat: one call with one tensor per bucket (AccumAdam: one per slice of it)
        assert len(kernel_calls) == len(buckets)
        assert all(len(p) == 1 and p[0].dim() == 1 for p in kernel_calls)
        assert all(b.flat for b in batches)


def test_step_counters_are_shared_after_the_first_step():
    mine, theirs, a, _ = _pair(SMALL, dopt.DecentralizedAdamW, torch.optim.AdamW, lr=0.01)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        _grads(mine, theirs, gen)
        a.step()
    steps = [a.state[p]["step"] for p in mine]
    assert len({s.untyped_storage().data_ptr() for s in steps}) == 1
    assert all(s.item() == 3 for s in steps)


@pytest.mark.parametrize(
    "cls, kw, torch_cls",
    [
        (dopt.DecentralizedAdamW, dict(lr=0.01), torch.optim.AdamW),
        (dopt.DSGD, dict(lr=0.01, momentum=0.9, nesterov=True), torch.optim.SGD),
        (dopt.AccumAdam, dict(lr=0.01, accum_iter=1, weight_decay=0.1), torch.optim.Adam),
    ],
)
def test_a_skipped_gradient_matches_torch(cls, kw, torch_cls):
    torch_kw = {k: v for k, v in kw.items() if k != "accum_iter"}
    mine, theirs, a, b = _pair(SMALL, cls, torch_cls, torch_kw=torch_kw, **kw)
    gen = torch.Generator().manual_seed(2)
    for t in range(15):
        _grads(mine, theirs, gen, skip=(3,) if t == 5 else ())
        a.step()
        b.step()
    for x, y in zip(mine, theirs):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)
        if "step" in b.state[y]:
            assert a.state[x]["step"].item() == b.state[y]["step"].item()


@pytest.mark.parametrize(
    "cls, kw",
    [
        (dopt.DecentralizedAdamW, dict(lr=0.01)),
        (dopt.DSGD, dict(lr=0.01, momentum=0.9)),
        (dopt.AccumAdamW, dict(lr=0.01, accum_iter=4)),  # resumed in the middle of a window
    ],
)
def test_state_dict_round_trip_through_the_fast_path_is_exact(cls, kw):
    def run(resume_at=None):
        gen = torch.Generator().manual_seed(0)
        params = [torch.randn(s, generator=gen).requires_grad_() for s in SMALL]
        opt = cls(params, **kw)
        grads = torch.Generator().manual_seed(3)
        for t in range(13):
            if t == resume_at:
                saved = opt.state_dict()
                opt = cls(params, **kw)
                opt.load_state_dict(saved)
            for p in params:
                p.grad = torch.randn(p.shape, generator=grads)
            opt.step()
        return params, opt

    (x, a), (y, b) = run(), run(resume_at=6)
    for p, q in zip(x, y):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        for key, value in a.state[p].items():
            torch.testing.assert_close(b.state[q][key], value, rtol=0, atol=0)


def _idle_buffers(rank, world_size):
    from decent_optim.gossip import Gossiper
    from decent_optim.topologies import get

    gossip = Gossiper(get("ring", world_size))
    buf = torch.full((6,), float(rank), dtype=torch.float64)
    before = gossip.idle_buffer(0, buf)  # nothing received yet: no buffer to lend
    handle = gossip.start([buf], 0)
    during = gossip.idle_buffer(0, buf)  # in flight: the receive buffer is busy
    handle.wait_and_mix_()
    after = gossip.idle_buffer(0, buf)
    wrong_shape = gossip.idle_buffer(0, torch.zeros(7, dtype=torch.float64))
    return before is None, during is None, after is not None, wrong_shape is None, buf.tolist()


@pytest.mark.multiprocess
def test_receive_buffers_are_lent_only_while_idle():
    for before, during, after, wrong_shape, mixed in run_world(_idle_buffers, 2):
        assert (before, during, after, wrong_shape) == (True, True, True, True)
        assert mixed == [0.5] * 6


def _train_two_ranks(rank, world_size):
    # many small tensors: the flat path, with gradients in the borrowed receive buffer; rank i
    # minimises 1/2 ||x - b_i||^2, and every rank must keep matching the dense reference
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_() for s in SMALL]
    opt = dopt.DecentralizedAdamW(params, lr=0.05, topology="ring")
    targets = [torch.full(p.shape, float(rank + 1), dtype=torch.float64) for p in params]
    for _ in range(8):
        for p, b in zip(params, targets):
            p.grad = p.detach() - b
        opt.step()
    opt.synchronize()
    return torch.cat([p.detach().reshape(-1) for p in params])


@pytest.mark.multiprocess
def test_flat_path_on_two_ranks_matches_a_dense_simulation():
    got = run_world(_train_two_ranks, 2)
    # dense reference: each rank's own AdamW on the mixed values (ring of 2: W = [[.5,.5],[.5,.5]])
    gen = torch.Generator().manual_seed(0)
    x0 = torch.cat([torch.randn(s, generator=gen, dtype=torch.float64).reshape(-1) for s in SMALL])
    xs = [x0.clone().requires_grad_(), x0.clone().requires_grad_()]
    opts = [torch.optim.AdamW([x], lr=0.05) for x in xs]
    for _ in range(8):
        for i, x in enumerate(xs):  # gradient at the unmixed local value
            x.grad = x.detach() - (i + 1)
        with torch.no_grad():  # combine (round 0 mixes identical values: no change) ...
            mean = (xs[0] + xs[1]) / 2
            for x in xs:
                x.copy_(mean)
        for o in opts:  # ... then adapt
            o.step()
    with torch.no_grad():
        final = (xs[0] + xs[1]) / 2
    for g in got:
        torch.testing.assert_close(g, final)


# -- the mix factor on gloo ranks -----------------------------------------------------------------


def _case(cls, kind, **kwargs):
    """(class, kwargs, reference kind, reference hyper-parameters) of one configuration."""
    hyper = {k: float(v) if k == "lr" else v for k, v in kwargs.items() if k != "fused"}
    if cls in (dopt.DecentralizedAdamW, dopt.AccumAdamW):
        hyper["decoupled"] = True
    return cls, kwargs, kind, hyper


# Which of them fold the pair's 1/2 into the update: DSGD without momentum, Adam without weight
# decay, AdamW, AccumAdam(W) likewise; the others (momentum, L2 decay, a tensor lr) multiply first.
FACTOR_CASES = {
    "DSGD": _case(dopt.DSGD, "sgd", lr=0.05, weight_decay=0.01),
    "DSGD-momentum": _case(dopt.DSGD, "sgd", lr=0.05, momentum=0.9, nesterov=True),
    "DecentralizedAdam": _case(dopt.DecentralizedAdam, "adam", lr=0.05, maximize=True),
    "DecentralizedAdamW": _case(
        dopt.DecentralizedAdamW, "adam", lr=0.05, weight_decay=0.1, amsgrad=True
    ),
    "DecentralizedAdamW-tensor-lr": _case(
        dopt.DecentralizedAdamW,
        "adam",
        lr=torch.tensor(0.05, dtype=torch.float64),
        weight_decay=0.1,
    ),
    "AccumAdam": _case(dopt.AccumAdam, "accum_adam", lr=0.05, accum_iter=3),
    "AccumAdam-L2": _case(dopt.AccumAdam, "accum_adam", lr=0.05, accum_iter=2, weight_decay=0.05),
    "AccumAdamW": _case(dopt.AccumAdamW, "accum_adam", lr=0.05, accum_iter=2, weight_decay=0.1),
    # compiled into one pass that also adds the pair's peer values (PendingMix addend)
    "AccumAdamW-compiled": _case(
        dopt.AccumAdamW, "accum_adam", lr=0.05, accum_iter=2, weight_decay=0.1, fused=True
    ),
}
FACTOR_STEPS = 10
#: a path 0 - 1 - 2 with Metropolis weights: rank 1 weighs all three equally (a sum and a factor
#: of 1/3 left to the update), ranks 0 and 2 do not (mixed at once)
PATH3 = [[2 / 3, 1 / 3, 0], [1 / 3, 1 / 3, 1 / 3], [0, 1 / 3, 2 / 3]]


def _factor_topology(name, n):
    return CustomTopology([PATH3]) if name == "path" else get_topology(name, n)


def _factor_shapes():
    return SMALL + [(300, 250)]  # a bucket of small tensors (flat) and one large (lists)


def _factor_targets(n, d):
    gen = torch.Generator().manual_seed(5)
    return torch.randn(n, d, generator=gen, dtype=torch.float64) * 3


def _train_factor(rank, world_size, topology):
    # every case in one world: rank i minimises 1/2 ||x - b_i||^2 (gradient x - b_i)
    gen = torch.Generator().manual_seed(0)
    x0 = torch.cat(
        [torch.randn(s, generator=gen, dtype=torch.float64).reshape(-1) for s in _factor_shapes()]
    )
    target = _factor_targets(world_size, x0.numel())[rank]
    out = {}
    for name, (cls, kwargs, *_) in FACTOR_CASES.items():
        params, offset = [], 0
        for s in _factor_shapes():
            n = torch.Size(s).numel()
            params.append(x0[offset : offset + n].view(s).clone().requires_grad_())
            offset += n
        opt = cls(
            params, **kwargs, topology=_factor_topology(topology, world_size),
            bucket_cap_mb=2000 * 8 / 2**20,
        )  # fmt: skip
        for _ in range(FACTOR_STEPS):
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            offset = 0
            for p in params:
                p.grad = (flat - target)[offset : offset + p.numel()].view(p.shape).clone()
                offset += p.numel()
            opt.step()
        out[name] = torch.cat([p.detach().reshape(-1) for p in params])
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "topology, n",
    [("ring", 2), ("one-peer-exp", 4), ("ring", 3), ("complete", 3), ("path", 3)],
    ids=str,
)
def test_mix_factor_applied_in_the_update_matches_dense_reference(topology, n):
    got = run_world(_train_factor, n, topology)
    gen = torch.Generator().manual_seed(0)
    x0 = torch.cat(
        [torch.randn(s, generator=gen, dtype=torch.float64).reshape(-1) for s in _factor_shapes()]
    )
    targets = _factor_targets(n, x0.numel())
    mixing = _factor_topology(topology, n).mixing_matrix
    for name, (_, _, kind, hyper) in FACTOR_CASES.items():
        want = simulate(
            kind, mixing, x0.repeat(n, 1), lambda x, t: x - targets,
            [Segment(0, x0.numel(), hyper)], FACTOR_STEPS,
        )  # fmt: skip
        assert not torch.allclose(want[0], want[1]), (
            "ranks should differ: the test would be vacuous"
        )
        torch.testing.assert_close(
            torch.stack([g[name] for g in got]), want, rtol=0, atol=1e-10, msg=name
        )


def _pair_symmetry(rank, world_size):
    # both ranks get the same gradients, but start from different values (set after the start-up
    # broadcast, as a user may): after the first mix their parameters must agree bit for bit
    gen = torch.Generator().manual_seed(0)
    shapes = _factor_shapes()
    out = {}
    for name, (cls, kwargs, *_) in FACTOR_CASES.items():
        if name == "AccumAdam-L2":
            continue  # L2 decay makes the gradient, and so the state, depend on the values
        params = [
            torch.randn(s, generator=gen, dtype=torch.float32).requires_grad_() for s in shapes
        ]
        opt = cls(params, **kwargs, topology="ring")
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(rank)))
        same, differ_first = [], None
        for t in range(6):
            grads = torch.Generator().manual_seed(100 + t)  # the same on both ranks
            for p in params:
                p.grad = torch.randn(p.shape, generator=grads)
            opt.step()
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            everyone = [torch.empty_like(flat) for _ in range(world_size)]
            torch.distributed.all_gather(everyone, flat)
            if t == 0:
                differ_first = not torch.equal(everyone[0], everyone[1])
            else:
                same.append(torch.equal(everyone[0], everyone[1]))
        out[name] = (differ_first, same)
    return out


@pytest.mark.multiprocess
def test_pair_keeps_bit_identical_parameters_given_identical_gradients():
    results = run_world(_pair_symmetry, 2)
    assert results[0] == results[1]
    assert len(results[0]) >= 6
    for name, (differ_first, same) in results[0].items():
        assert differ_first, f"{name}: the ranks should start apart (the test would be vacuous)"
        assert all(same), f"{name}: a pair's mixed parameters differ between its ranks: {same}"
